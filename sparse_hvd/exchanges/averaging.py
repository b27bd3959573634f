"""Turning gathered (index, value) entries into dense averages, the same bits on every rank.

Every rank adds the same entries in the same order (rank by rank, and within a rank in the
order sent), so the result does not depend on thread timing: the same bits on every rank. On
CPU the native kernel (``sparse_hvd/kernels/scatter_mean.cc``) walks the entries once and
divides only where entries arrived (0 / N is 0 exactly). Elsewhere (GPUs, 16-bit values)
TensorFlow ops compute the same bits; on a GPU without a segment sum or a scatter that could
meet one index twice, since those run with atomics there and add in whatever order threads come:

1. every entry gets its place in one flat space of all the averaged variables;
2. the entries are added rank by rank (:func:`sum_rank_by_rank`: on a GPU a loop over the ranks,
   one rank's entries at a time; within a rank the places are distinct, so no two additions
   meet in one place);
3. the whole tensor is divided by the number of workers, and split into the variables.

Used by the allgather exchange and the sparse allreduce. With the update cut the allgather hands
back only the averaged positions (:func:`average_at_positions`), which the weights lose in place.
"""

from typing import List

import tensorflow as tf

from .. import kernels
from ..runtime import startup


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
    # Step 1: each averaged variable's entries at its offset in one flat space
    slot_of_column = [-1] * variables
    for slot, column in enumerate(columns):
        slot_of_column[column] = slot
    slots = tf.gather(tf.constant(slot_of_column, tf.int32), _owners(counts, rows))
    averaged_here = slots >= 0
    offsets = tf.constant([sum(sizes[:slot]) for slot in range(len(columns))] or [0], tf.int32)
    entry_indices = tf.boolean_mask(indices, averaged_here)
    entry_slots = tf.boolean_mask(slots, averaged_here)
    inside = tf.reduce_all(tf.logical_and(
        entry_indices >= 0, entry_indices < tf.gather(tf.constant(sizes or [0], tf.int32),
                                                      entry_slots)))
    check = tf.debugging.Assert(inside, ["sparse_hvd: a gathered index is outside its variable "
                                         "(negative, or at least its number of entries)"])
    with tf.control_dependencies([check]):
        places = entry_indices + tf.gather(offsets, entry_slots)
    # Step 2: rank by rank
    per_rank = tf.reduce_sum(tf.gather(counts, columns, axis=1), axis=1)
    total = sum_rank_by_rank(values, places, per_rank, sum(sizes))
    # Step 3
    total = divided(total, divisor)
    return tf.split(total, sizes) if columns else []


def average_at_positions(indices, values, counts, columns, sizes, divisor):
    """:func:`average_entries`'s averages only where entries arrived, one ``tf.IndexedSlices``
    per column (flat positions in the order they first arrived, or ascending where every
    rank's ascend and at most 8 ranks sent them, and their averages: the same bits as the
    dense average there; it is 0 elsewhere), for a caller that subtracts them in place; None
    where the native kernel does not run (then :func:`average_entries`)."""
    native = kernels.mean_at_positions() if values.dtype in (tf.float32, tf.float64) else None
    if native is None:
        return None
    columns, sizes = list(columns), list(sizes)
    positions, averages = native(indices, values, counts, tf.constant(divisor, values.dtype),
                                 columns=columns, num_elements=sizes,
                                 num_outputs=len(columns))
    return [tf.IndexedSlices(average, where, tf.constant([size], tf.int64))
            for where, average, size in zip(positions, averages, sizes)]


def divided(total, divisor) -> tf.Tensor:
    """``total / divisor``, correctly rounded in ``total``'s dtype, traced or not. (In a traced
    function TensorFlow turns ``x / constant`` into ``x * (1 / constant)``, off by one unit in the
    last place now and then, and for 16-bit values by far more; ``divide_no_nan`` is left alone.)
    """
    if divisor == 1:
        return total
    return tf.math.divide_no_nan(total, tf.cast(divisor, total.dtype))


def sum_rank_by_rank(values, places, per_rank, size) -> tf.Tensor:
    """``values`` added into ``size`` zeros at ``places``: the first ``per_rank[0]`` entries,
    then the next ``per_rank[1]``, and so on, each rank's places distinct.

    Without a GPU, one segment sum: on CPU it adds the entries one after another in their
    order, which is this order. With a GPU a segment sum would add with atomics, in whatever
    order threads come, so a loop adds one rank at a time: no place receives two additions at
    once, and the additions are the same, in the same order (measured on CPU: 14 ms against
    5 ms for the segment sum, 8 ranks of 25,000 entries, which is why it is not used there).
    """
    if not startup.gpu_visible():
        return tf.math.unsorted_segment_sum(values, places, size)
    return _sum_one_rank_at_a_time(values, places, per_rank, size)


def _sum_one_rank_at_a_time(values, places, per_rank, size) -> tf.Tensor:
    ends = tf.cumsum(per_rank)
    starts = ends - per_rank

    def add_one_rank(rank, total):
        start, end = starts[rank], ends[rank]
        return rank + 1, tf.tensor_scatter_nd_add(
            total, tf.expand_dims(places[start:end], 1), values[start:end])

    _, total = tf.while_loop(lambda rank, _: rank < tf.size(per_rank), add_one_rank,
                             [tf.constant(0, per_rank.dtype), tf.zeros([size], values.dtype)])
    return total


UNROLLED_RANKS = 64  # up to this many rows, sum_rows_in_order adds them op by op


def sum_rows_in_order(rows) -> tf.Tensor:
    """The sum of a [ranks, n] tensor's rows, added in rank order from zero (the same bits
    everywhere). With a known number of rows up to :data:`UNROLLED_RANKS` the additions are
    written out: a ``tf.foldl`` (a while loop) took about 0.2-0.4 s of each trace of a step at
    4 ranks on 2 cores, and ``exchange="auto"`` traces one step per candidate it tries."""
    count = rows.shape[0]
    if count is None or count > UNROLLED_RANKS:
        return tf.foldl(lambda total, row: total + row, rows,
                        initializer=tf.zeros(tf.shape(rows)[1:], rows.dtype))
    total = tf.zeros(tf.shape(rows)[1:], rows.dtype)
    for row in tf.unstack(rows, num=count):
        total = total + row
    return total


def _owners(counts, rows):
    """For every gathered entry, the column of ``counts`` ([rows, variables]: entries each rank
    sent of each variable) it belongs to: the entries arrive row by row, and within a row
    variable by variable."""
    columns = tf.shape(counts)[1]
    return tf.repeat(tf.tile(tf.range(columns), [rows]), tf.reshape(counts, [-1]))


def applied_averages(sums, divisor) -> tf.Tensor:
    """The sparse allreduce's averages of its applied ``sums`` (step 6): each position is
    applied once, so its average is its sum over ``divisor``, with the bits
    :func:`average_entries` gives it (a sum added to zero first, so -0.0 averages to +0.0).
    (The native ``SparseHvdApplied`` writes the same bits with its ``divisor``.)"""
    return tf.where(tf.equal(sums, 0), tf.zeros_like(sums), divided(sums, divisor))


def applied_at_positions(positions, averages, cuts, sizes):
    """The sparse allreduce's ``averages`` (:func:`applied_averages`) where the applied sums
    are, one ``tf.IndexedSlices`` per variable (``cuts``: where each variable's slice of
    ``positions`` starts, and the end), for an optimizer that subtracts them in place
    (``sparsify="update"``)."""
    # one split each: slices per variable traced 104 of the step's 1,431 operations (wide CNN)
    counts = cuts[1:] - cuts[:-1]
    return [tf.IndexedSlices(values, at, tf.constant([n], tf.int64)) for values, at, n in zip(
        tf.split(averages, counts, num=len(sizes)), tf.split(positions, counts, num=len(sizes)),
        sizes)]
