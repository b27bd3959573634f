"""Turning gathered (index, value) entries into dense averages, the same bits on every rank.

Every rank adds the same entries in the same order (rank by rank, and within a rank in the
order sent): no atomics, so the result does not depend on thread timing. On CPU the native
kernel (``sparse_hvd/kernels/scatter_mean.cc``) walks the entries once and divides only where
entries arrived (0 / N is 0 exactly); else TensorFlow ops compute the same bits
(``dynamic_partition`` keeps the order, a segment sum adds in it, then the whole tensor is
divided). Used by the allgather exchange and the sparse allreduce.
"""

from typing import List

import tensorflow as tf

from . import kernels


def average_entries(indices, values, counts, columns, sizes, divisor) -> List[tf.Tensor]:
    """The sum and division of the module doc for the variables ``columns`` of ``counts``.

    Args:
        indices: int32 [entries]: every variable's gathered indices, rank by rank and within a
            rank variable by variable (the columns of ``counts``).
        values: [entries of ``columns``]: the values of the variables ``columns`` only, in the
            same order.
        counts: int32 [rows, variables]: entries of each variable in each row (rank).
        columns: which variables to average; ``sizes``: their numbers of entries.
        divisor: the number of workers.

    Returns one flat tensor per column: the sum of its entries in order, divided by
    ``divisor``.
    """
    columns, sizes = list(columns), list(sizes)
    native = kernels.scatter_mean() if values.dtype in (tf.float32, tf.float64) else None
    if native is not None:
        return native(indices, values, counts, tf.constant(divisor, values.dtype),
                      columns=columns, num_elements=sizes, num_outputs=len(columns))
    rows, variables = counts.shape
    owners = _owners(counts, rows)
    per_variable = tf.dynamic_partition(indices, owners, variables)
    if len(columns) < variables:
        owners = _owners(tf.gather(counts, columns, axis=1), rows)
    averaged = []
    for column, part, n in zip(columns, tf.dynamic_partition(values, owners, len(columns)), sizes):
        total = tf.math.unsorted_segment_sum(part, per_variable[column], n)
        averaged.append(total if divisor == 1 else total / tf.cast(divisor, total.dtype))
    return averaged


def _owners(counts, rows):
    """For every gathered entry, the column of ``counts`` ([rows, variables]: entries each rank
    sent of each variable) it belongs to: the entries arrive row by row, and within a row
    variable by variable."""
    columns = tf.shape(counts)[1]
    return tf.repeat(tf.tile(tf.range(columns), [rows]), tf.reshape(counts, [-1]))
