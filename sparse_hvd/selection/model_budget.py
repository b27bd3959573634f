"""One entry budget for the whole model instead of one per layer (``budget="model"``).

With a per-layer budget every sparse variable sends ``ceil(density * n)`` entries each step,
however large or small its gradient is compared with the others'. Ok-Topk (Li & Hoefler 2022)
merges all layers into one index space and selects there; users of GRACE asked for the same.
Here, each step on each rank:

1. the cut: the K-th largest magnitude of the compensated gradients ``c = gradient +
   residual`` (with momentum correction, velocity plus residual: what the sparsifier would
   see), K = the sum of the density policy's per-variable k, estimated from ``c`` at
   blocks of entries evenly spread over each variable (:func:`sample_stride`; each variable
   in proportion to its size; at least :data:`SAMPLES`, and about :data:`ABOVE` of them above
   the cut, or as few as :data:`FEWEST_ABOVE` where more would read over :data:`MOST_SAMPLED`
   of the model), exactly when the model has no more entries than the sample;
2. each variable sends its entries with ``|c| >= cut`` (ties at the cut included, unless
   ``> cut`` comes nearer K: :func:`nearer_the_budget`), in one pass over the data, through
   the same error feedback as any sparsifier.

So about K entries travel each step, as with per-layer budgets (within a few percent: about
ABOVE samples are above the cut, and the count varies as their square root), and only the
samples are read to find the cut: forming ``c`` for the whole
model and selecting among it, as an exact cut needs, cost a quarter of a step on a 4.35M
parameter MLP (measured: README, "Converging like dense"). A layer whose gradient is large for
its size (an output layer, an embedding, an LSTM's bias) sends more, one whose gradient is
small sends less. The cut is each rank's own, as a top-k selection is.
"""

import numpy as np
import tensorflow as tf

from .order_statistics import kth_largest
from .sparsifiers import Selection, Sparsifier, _magnitude_cut_step, _partial_sort_topk

SAMPLES = 1 << 16  # at least this many magnitudes are sampled each step (all of a smaller model)
ABOVE = 2048  # and enough that about this many of them are above the cut: K within ~2%
# but where that would read more than this share of the model, fewer above the cut, down to
# FEWEST_ABOVE (K within ~4%): at 0.1% of the 4.35M MLP, ABOVE alone asks for 47% of its
# entries a step; an eighth keeps about 540 above the cut there and reads a quarter as much
MOST_SAMPLED = 1 / 8
FEWEST_ABOVE = 512


BLOCK = 16  # sampled entries read together: one 64-byte cache line of float32


def sample_stride(count, n):
    """The distance ``S`` between the starts of the sampled blocks (:data:`BLOCK` entries
    each) that give at least ``count`` of ``n`` entries (or all): ``BLOCK x s``, ``s`` the
    largest integer at most ``n // (count + BLOCK)`` (or 1) divisible by neither 2 nor 3
    (int64). Elementwise: a vector of counts and lengths gives every variable's stride in
    one set of ops (a model's hundreds of variables each traced their own before).

    Reading whole cache lines is the point: scattered single entries (measured on the 4.35M
    MLP at 1%: 205,000 of them a step) cost a cache line each, as much memory traffic as a
    pass over every entry (15 ms a step on 2 cores), where blocks read 1/16 of it. And a block
    grid that shares no factor but ``BLOCK`` with a matrix's row length covers every column
    of it evenly: rows are mostly 2^a 3^b entries long, hence no 2 or 3 in ``s`` (one of any
    4 consecutive integers, or 1, qualifies)."""
    largest = tf.maximum(tf.math.floordiv(tf.cast(n, tf.int64),
                                          tf.cast(count, tf.int64) + BLOCK), 1)
    candidates = largest[..., None] - tf.range(4, dtype=tf.int64)
    fits = tf.logical_and(candidates >= 1, tf.logical_and(tf.math.floormod(candidates, 2) > 0,
                                                          tf.math.floormod(candidates, 3) > 0))
    return BLOCK * tf.reduce_max(tf.where(fits, candidates, tf.ones_like(candidates)), axis=-1)


def sampled_blocks(flat, stride):
    """The first :data:`BLOCK` entries of every ``stride`` entries of 1-D ``flat`` (whole
    strides only; a variable shorter than one stride gives its first block)."""
    n = flat.shape[0]
    rows = tf.maximum(tf.math.floordiv(tf.constant(n, tf.int64), stride), 1)
    return tf.reshape(tf.reshape(flat[:rows * stride], [rows, -1])[:, :BLOCK], [-1])


def model_wide_cut(magnitudes_at, sizes, budgets, sampled_all=None) -> tf.Tensor:
    """The cut for a model whose variables have ``sizes`` entries and per-variable
    ``budgets``: the K-th largest of the sampled magnitudes, K scaled to the sample (K = sum
    of ``budgets``), in float32. ``magnitudes_at(j, sample)`` gives ``|c|`` of variable j at
    the entries that ``sample`` (a function of a flat tensor; None: every entry) takes;
    ``sampled_all(strides)``, where given, those of every variable at once (the native
    ``SparseHvdSampledMagnitudes``: a stride of 0 takes every entry, S the blocks of
    :func:`sampled_blocks`). The sample is :data:`SAMPLES` entries, or more where K is so
    small a share of the model that fewer than :data:`ABOVE` samples would pass the cut; where
    that would read more than :data:`MOST_SAMPLED` of the model, as many as pass the cut in
    that share, but never fewer than :data:`FEWEST_ABOVE`; with no more entries than the
    sample, every entry is read and the cut is the exact K-th largest."""
    entries = sum(sizes)
    total = tf.minimum(tf.add_n([tf.convert_to_tensor(k, tf.int32) for k in budgets]), entries)
    share = tf.cast(total, tf.float64) / entries
    above = tf.clip_by_value(MOST_SAMPLED * entries * share, FEWEST_ABOVE, ABOVE)
    samples = tf.maximum(tf.cast(SAMPLES, tf.float64), tf.math.ceil(above / share))

    def exact():
        if sampled_all is not None:
            return sampled_all(tf.zeros([len(sizes)], tf.int64)), total
        return tf.concat([magnitudes_at(j, None) for j in range(len(sizes))], 0), total

    def sampled():
        strides = sample_stride(samples * tf.constant(sizes, tf.float64) / entries,
                                tf.constant(sizes, tf.int64))
        if sampled_all is not None:
            drawn = sampled_all(strides)
        else:
            drawn = tf.concat([magnitudes_at(j, _blocks_of(strides[j]))
                               for j in range(len(sizes))], 0)
        want = tf.cast(tf.math.ceil(share * tf.cast(tf.size(drawn), tf.float64)), tf.int32)
        return drawn, want

    sample, want = tf.cond(samples >= entries, exact, sampled)
    want = tf.clip_by_value(want, 1, tf.size(sample))
    return nearer_the_budget(sample, want, kth_largest(sample, want))


def nearer_the_budget(sample, want, cut):
    """``cut`` (the ``want``-th largest of ``sample``), or the float just above it where
    ``|c| > cut`` would send nearer ``want`` of the sample than ``|c| >= cut`` does: where many
    magnitudes tie at the cut, all of them would travel. Two cases that made it: a step whose
    learning rate is 0 (the first of a schedule warming up from 0, as Keras' ``CosineDecay``
    with ``warmup_target`` does) cuts an update of zeros, and the cut at 0 sent every entry, the
    whole model as index-value pairs, twice dense's bytes (every update-cut run of the
    benchmark did at its first step); and a Keras Lion's update is +-rate on every entry, whose
    ties sent up to 2.4x the budget in its warm-up's steps. Continuous magnitudes tie only
    with themselves (one sample at the cut), so ``>=`` stays."""
    at_or_above = tf.reduce_sum(tf.cast(sample >= cut, tf.int32))
    above = tf.reduce_sum(tf.cast(sample > cut, tf.int32))
    strictly = at_or_above - want > want - above
    # at least the smallest normal float: TensorFlow's CPU kernels flush subnormals to zero,
    # so the float above 0 would read as 0 and pass every zero again
    above_cut = tf.maximum(tf.math.nextafter(cut, tf.constant(float("inf"), cut.dtype)),
                           tf.constant(np.finfo(cut.dtype.as_numpy_dtype).tiny, cut.dtype))
    return tf.where(strictly, above_cut, cut)


def _blocks_of(stride):
    return lambda flat: sampled_blocks(flat, stride)


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
