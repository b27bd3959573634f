"""The sparse allreduce's regions (``exchanges.sparse_allreduce``, steps 2 and 8): the index
space cut into one contiguous region per rank, who owns each index, and where a rank's
selected indices divide into equal parts (the next step's cut points, averaged over the
ranks). The regions only decide who sums what, never the result."""

from typing import List

import tensorflow as tf

from ..selection.sparsifiers import spread_positions

# sampled selected indices per rank and step for the boundaries (step 8)
BOUNDARY_SAMPLES = 1024


def sorted_search(sorted_sequence, values, side):
    """``tf.searchsorted`` of 1-D tensors (int32 positions) as the one op it wraps: the
    wrapper's reshapes for N-D inputs traced about 20 operations a call, six calls a step."""
    search = tf.raw_ops.LowerBound if side == "left" else tf.raw_ops.UpperBound
    # reshapes, not ``[tf.newaxis]`` and ``[0]``: a strided slice and its three constants each
    return tf.reshape(search(sorted_inputs=tf.reshape(sorted_sequence, [1, -1]),
                             values=tf.reshape(values, [1, -1]), out_type=tf.int32), [-1])


def even_boundaries(total: int, parts: int) -> List[int]:
    """``parts + 1`` cut points of [0, total) into regions of (nearly) equal length."""
    return [total * j // parts for j in range(parts + 1)]


def owners_of(indices, boundaries):
    """The region (rank) of each global index: ``boundaries[r] <= i < boundaries[r + 1]``.
    Empty regions (equal cut points) own nothing."""
    inner = boundaries[1:-1]
    return sorted_search(inner, indices, "right")


def sampled_quantiles(indices, parts, current):
    """Where ``indices`` divide into ``parts`` equal parts (from at most BOUNDARY_SAMPLES of
    them, at fixed spread positions); ``current`` (int64 [parts - 1]) if there are none."""
    count = tf.size(indices, out_type=tf.int64)

    def quantiles():
        samples = tf.minimum(count, BOUNDARY_SAMPLES)
        positions = spread_positions(samples, count)
        ordered = tf.sort(tf.gather(tf.cast(indices, tf.int64), positions))
        return tf.gather(ordered, tf.range(1, parts, dtype=tf.int64) * samples // parts)

    return tf.cond(count > 0, quantiles, lambda: current)
