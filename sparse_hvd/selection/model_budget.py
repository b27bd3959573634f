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

The cut is found among the entries above a sampled estimate (:func:`model_wide_cut`), so a
large model is not sorted whole each step. A layer whose gradient is large for its size (an output layer, an embedding) sends more, one
whose gradient is small sends less. The cut is each rank's own, as a top-k selection is.
"""

import tensorflow as tf

from .sparsifiers import (Selection, Sparsifier, _magnitude_cut_step, _partial_sort_topk,
                          spread_positions)


# Models of more than this many entries find the cut without a sort of every magnitude
SAMPLED_ABOVE = 1 << 16
SAMPLES = 8192  # magnitudes sampled over the model, each variable in proportion to its size
CANDIDATE_MARGIN = 2.0  # the sampled cut aims at this many times K candidates
# above this share of the entries (the warm-up's first steps), the candidates would be many:
# the radix selection's cost does not depend on K
RADIX_ABOVE = 0.05


def model_wide_cut(compensated, budgets) -> tf.Tensor:
    """The K-th largest magnitude over the flat tensors ``compensated`` (K = sum of
    ``budgets``, at most their entries), in float32, exactly.

    A small model sorts its magnitudes. A large one, for K up to :data:`RADIX_ABOVE` of its
    entries: (a) the magnitudes at fixed spread positions (:data:`SAMPLES`) give a cut that
    about ``CANDIDATE_MARGIN x K`` entries pass; (b) one comparison per entry collects those
    candidates; (c) if at least K passed, the K largest magnitudes are all among them and the
    K-th largest candidate is the cut; else (the estimate missed) every magnitude is sorted.
    For a larger K: :func:`radix_kth_largest`.
    """
    flats = [tf.abs(tf.cast(tf.reshape(c, [-1]), tf.float32)) for c in compensated]
    sizes = [int(f.shape[0]) for f in flats]
    entries = sum(sizes)
    total = tf.minimum(tf.add_n([tf.convert_to_tensor(k, tf.int32) for k in budgets]), entries)

    def kth_largest(magnitudes):
        return tf.reduce_min(tf.math.top_k(magnitudes, k=total, sorted=False).values)

    if entries <= SAMPLED_ABOVE:
        return kth_largest(tf.concat(flats, 0))

    def among_candidates():
        sample = tf.concat([tf.gather(f, spread_positions(max(1, SAMPLES * n // entries), n))
                            for f, n in zip(flats, sizes)], 0)
        drawn = int(sample.shape[0])
        want = tf.cast(tf.math.ceil(
            CANDIDATE_MARGIN * tf.cast(total, tf.float64) * drawn / entries), tf.int32)
        estimate = tf.reduce_min(tf.math.top_k(sample, k=tf.clip_by_value(want, 1, drawn),
                                               sorted=False).values)
        candidates = tf.concat([tf.boolean_mask(f, f >= estimate) for f in flats], 0)
        return tf.cond(tf.size(candidates) >= total, lambda: kth_largest(candidates),
                       lambda: kth_largest(tf.concat(flats, 0)))

    return tf.cond(tf.cast(total, tf.float64) <= RADIX_ABOVE * entries, among_candidates,
                   lambda: radix_kth_largest(flats, total))


def radix_kth_largest(magnitudes, k) -> tf.Tensor:
    """The k-th largest of the non-negative float32 tensors ``magnitudes`` (k >= 1), exactly,
    in two counting passes over their bits, whatever k is: a non-negative float's bits, read
    as an int32, order as the float does, so (1) a histogram of the upper 16 bits finds the
    bucket that holds the k-th largest (the first, from the top, where the count of larger or
    equal entries reaches k), and (2) a histogram of the lower 16 bits within that bucket finds
    its exact bits."""
    bits = [tf.bitcast(m, tf.int32) for m in magnitudes]
    upper = [tf.bitwise.right_shift(b, 16) for b in bits]
    counts = tf.add_n([tf.math.bincount(u, minlength=1 << 15, maxlength=1 << 15) for u in upper])
    at_or_above = tf.cumsum(counts, reverse=True)
    bucket = tf.cast(tf.reduce_max(tf.where(at_or_above >= k)), tf.int32)
    larger = at_or_above[bucket] - counts[bucket]
    lower = tf.add_n([
        tf.math.bincount(tf.boolean_mask(tf.bitwise.bitwise_and(b, 0xFFFF), tf.equal(u, bucket)),
                         minlength=1 << 16, maxlength=1 << 16)
        for b, u in zip(bits, upper)])
    low = tf.cast(tf.reduce_max(tf.where(tf.cumsum(lower, reverse=True) >= k - larger)),
                  tf.int32)
    return tf.bitcast(tf.bitwise.bitwise_or(tf.bitwise.left_shift(bucket, 16), low), tf.float32)


class AtOrAbove(Sparsifier):
    """Selects every entry with ``|c| >= cut`` (the cut of :func:`model_wide_cut`)."""

    def __init__(self, cut):
        self.cut = cut

    def __call__(self, flat, k):
        indices = tf.cast(tf.reshape(
            tf.where(tf.abs(tf.cast(flat, tf.float32)) >= self.cut), [-1]), tf.int32)
        return Selection(tf.gather(flat, indices), indices, capped=None)

    def fused_compensate_select(self, flat_grad, flat_residual, k=None):
        """Compensate, select and remember in one pass over the data (the hard threshold's
        native kernel, with no cap), for float32 gradients (the cut is a float32, so the
        comparison is the same); None for other dtypes (the three steps then run apart)."""
        if flat_grad.dtype != tf.float32:
            return None
        n = int(flat_grad.shape[0])
        selection, remainder = _magnitude_cut_step(flat_grad, flat_residual, self.cut, 0, n,
                                                   _partial_sort_topk(n), fuse=True)
        return selection._replace(capped=None), remainder

    def get_config(self):
        raise TypeError("AtOrAbove is made per step by the optimizer; it is not serialised")
