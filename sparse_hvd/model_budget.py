"""One entry budget for the whole model instead of one per layer (``budget="model"``).

With a per-layer budget every sparse variable sends ``ceil(density * n)`` entries each step,
however large or small its gradient is compared with the others'. Ok-Topk (Li & Hoefler 2022)
merges all layers into one index space and selects there; users of GRACE asked for the same.
Here, each step on each rank:

1. every sparse-route variable's compensated gradient ``c = gradient + residual`` is formed
   (with momentum correction, its velocity plus residual: what the sparsifier would see);
2. the cut is the K-th largest magnitude over all of them, K = the sum of the density policy's
   per-variable k (so the same number of entries travels as with per-layer budgets);
3. each variable sends its entries with ``|c| >= cut`` (ties at the cut included), through the
   same error feedback as any sparsifier.

A layer whose gradient is large for its size (an output layer, an embedding) sends more, one
whose gradient is small sends less. The cut is each rank's own, as a top-k selection is.
"""

import tensorflow as tf

from .sparsifiers import Selection, Sparsifier


def model_wide_cut(compensated, budgets) -> tf.Tensor:
    """The K-th largest magnitude over the flat tensors ``compensated`` (K = sum of
    ``budgets``, at most their entries), in float32."""
    magnitudes = tf.concat([tf.abs(tf.cast(tf.reshape(c, [-1]), tf.float32))
                            for c in compensated], 0)
    total = tf.add_n([tf.convert_to_tensor(k, tf.int32) for k in budgets])
    total = tf.minimum(total, tf.size(magnitudes))
    largest = tf.math.top_k(magnitudes, k=total, sorted=False).values
    return tf.reduce_min(largest)


class AtOrAbove(Sparsifier):
    """Selects every entry with ``|c| >= cut`` (the cut of :func:`model_wide_cut`)."""

    def __init__(self, cut):
        self.cut = cut

    def __call__(self, flat, k):
        indices = tf.cast(tf.reshape(
            tf.where(tf.abs(tf.cast(flat, tf.float32)) >= self.cut), [-1]), tf.int32)
        return Selection(tf.gather(flat, indices), indices, capped=None)

    def get_config(self):
        raise TypeError("AtOrAbove is made per step by the optimizer; it is not serialised")
