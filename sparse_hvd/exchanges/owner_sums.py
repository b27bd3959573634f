"""Steps 3-4 of the sparse allreduce (``exchanges.sparse_allreduce``) on one owner: what it
received, summed index by index in rank order, counted at the threshold's levels, and the sums
that reach their variable's threshold kept.

On CPU with float32 or float64 sums, the native kernel (``sparse_hvd/kernels/owner_sum.cc``)
does it in one pass after merging two ranks' ascending blocks, or a radix sort of more
(measured, one process, load 10: 1.5 ms against the TensorFlow ops' 8.3 ms on 44,000 received
entries, 7.5 ms against 46 ms on 256,000, before the merge); elsewhere (GPUs, 16-bit sums)
TensorFlow ops compute the same bits:

1. the distinct indices and, for each, the sum of its entries in the order they arrived (rank
   by rank: ``averaging.sum_rank_by_rank``), ascending by index;
2. each sum's variable (the last start at or below its index) and magnitude in float64;
3. per variable, how many sums reach theta x each level; the kept sums reach theta itself.
"""

import tensorflow as tf

from .. import kernels
from .averaging import sum_rank_by_rank


def owner_sums(indices, values, per_rank, starts, thresholds, levels):
    """``(kept indices, kept sums, counts)`` for the received ``indices`` (int32, global) and
    ``values`` (rank by rank, ``per_rank`` entries from each), the variables' ``starts``
    (int32, ascending) and ``thresholds`` (float64, one per variable), at ``levels`` (floats,
    the first 1). Counts: int32 [variables, levels]."""
    native = kernels.owner_sum() if values.dtype in (tf.float32, tf.float64) else None
    if native is not None:
        return native(indices, values, starts, thresholds, tf.constant(levels, tf.float64))
    unique, slot = tf.unique(indices)  # Step 1
    sums = sum_rank_by_rank(values, slot, per_rank, tf.size(unique))
    ascending = tf.argsort(unique)
    unique, sums = tf.gather(unique, ascending), tf.gather(sums, ascending)
    variable = tf.searchsorted(starts, unique, side="right") - 1  # Step 2
    theta = tf.gather(thresholds, variable)
    magnitude = tf.abs(tf.cast(sums, tf.float64))
    counts = tf.stack([tf.math.unsorted_segment_sum(  # Step 3
        tf.cast(magnitude >= theta * level, tf.int32), variable, tf.size(starts))
        for level in levels], 1)
    keep = magnitude >= theta
    return tf.boolean_mask(unique, keep), tf.boolean_mask(sums, keep), counts
