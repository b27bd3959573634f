"""``exchange="compact_allgather"``: the allgather exchange with indices of about 1-1.5 bytes.

The fused allgather (``fused_allgather``) with one change to its wire format: instead of an
int32 index per entry, each rank's indices travel Elias-Fano coded (``index_coding``), 1.1
bytes an entry at 1% and 1.5 at 0.1% instead of 4. The values and everything else are the
allgather's, so the averages are the same bits.

1. each selection is put in index order (its values with it; the sum does not depend on the
   order of one rank's entries, which are distinct);
2. one index space: variable j's positions are offset by the entries of the variables before
   it, so the concatenated positions are ascending; they are coded as one set among the space's
   entries;
3. after the gather, each rank's block is decoded (its length follows from its entry count,
   in its header) and the offsets taken off again.

The coding costs CPU work that the saved bytes must pay for: worth it on a slow link, not on a
fast one. ``exchange="auto"`` times it against the others on the job and picks it only where it
is faster.
"""

import math

import tensorflow as tf

from ..feedback.payload import INDEX_BYTES
from . import index_coding
from .base import register
from .fused_allgather import FusedAllgather


@register("compact_allgather", grouping="grouped")
class CompactAllgather(FusedAllgather):
    """Steps 1-3 of the module doc around the fused allgather."""

    staleness = False  # the delayed pipeline gathers plain int32 indices on its own thread
    grouping_reason = "its indices are coded as one set over every variable's entries."
    builds_on = "allgather"  # the fused allgather, plus coding and decoding the indices

    def _index_bytes(self, density):
        return (2 + math.log2(1 / density)) / 8  # index_coding's Elias-Fano bits an index

    def _pack_indices(self, selections, sizes):
        if not selections:
            return tf.zeros([0], tf.int32), selections
        offsets = _offsets(sizes)
        positions = tf.concat([tf.cast(s.indices, tf.int64) + offset  # step 2
                               for s, offset in zip(selections, offsets)], 0)
        if len({s.values.dtype for s in selections}) == 1:  # step 1 as one sort
            order = tf.argsort(positions)
            positions = tf.gather(positions, order)
            counts = tf.stack([tf.size(s.indices) for s in selections])
            values = tf.split(tf.gather(tf.concat([s.values for s in selections], 0), order),
                              counts, num=len(selections))
            indices = tf.split(positions, counts, num=len(selections))
            ordered = [s._replace(values=v, indices=tf.cast(i - offset, tf.int32))
                       for s, v, i, offset in zip(selections, values, indices, offsets)]
        else:
            ordered = []
            for selection in selections:  # step 1, variable by variable
                order = tf.argsort(selection.indices)
                ordered.append(selection._replace(indices=tf.gather(selection.indices, order),
                                                  values=tf.gather(selection.values, order)))
            positions = tf.concat([tf.cast(s.indices, tf.int64) + offset
                                   for s, offset in zip(ordered, offsets)], 0)
        return index_coding.encode(positions, sum(sizes)), ordered

    def bytes_sent(self, payload, num_elements):
        """The payload's count with the int32 indices replaced by their code's words."""
        if not payload.sparse.items or self.size == 1:
            return payload.bytes_sent
        entries = tf.add_n([tf.size(s.indices, out_type=tf.int64) for s in payload.sparse.items])
        space = sum(num_elements[key] for key in payload.sparse.keys)
        low, bitmap = index_coding.encoded_words(entries, space)
        return payload.bytes_sent - INDEX_BYTES * entries + 4 * (low + bitmap)

    def _unpack_indices(self, gathered, counts, sizes):
        if not sizes:
            return tf.zeros([0], tf.int32)
        total, ranks = sum(sizes), counts.shape[0]
        per_rank = tf.reduce_sum(tf.cast(counts, tf.int64), axis=1)
        low, bitmap = index_coding.encoded_words(per_rank, total)
        lengths = low + bitmap
        starts = tf.cumsum(lengths, exclusive=True)
        decoded = [index_coding.decode(gathered[starts[r]:starts[r] + lengths[r]],  # step 3
                                       per_rank[r], total)
                   for r in range(ranks)]
        offsets = tf.repeat(tf.tile(tf.constant(_offsets(sizes) or [0], tf.int64),
                                    [ranks]), tf.reshape(counts, [-1]))
        return tf.cast(tf.concat(decoded, 0) - offsets, tf.int32)


def _offsets(sizes):
    """Where each variable starts in the one index space of step 2."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += size
    return offsets
