"""``exchange="compact_allgather"``: the allgather exchange in about 4.2 bytes an entry, not 8.

The fused allgather (``fused_allgather``) with a coded wire format. Instead of an int32 index
per entry, each rank's indices travel Elias-Fano coded (``index_coding``): 1.1 bytes an entry
at 1% and 1.5 at 0.1% instead of 4. Instead of its raw bits, each float32 or 16-bit value
travels as its sign and mantissa and a Rice-coded exponent (``value_coding``): about 3.1
bytes a float32, 1.5 a float16. Nothing is rounded, so the averages are the allgather's bits.

1. one index space: variable j's positions are offset by the entries of the variables before
   it; the positions are coded as one set among the space's entries, and each selection is
   put in index order (its values with it; the sum does not depend on the order of one rank's
   entries, which are distinct);
2. each dtype's values are coded in that order, variable after variable; the header carries
   what their blocks' lengths follow from (``value_coding.header_fields``);
3. after the gather, every rank's indices are decoded (their lengths follow from the entry
   counts in the headers) and the offsets taken off again, and every rank's values decoded.

The coding costs CPU work that the saved bytes must pay for: on CPU it runs as native passes
(``sparse_hvd/kernels/index_codec.cc``, ``value_codec.cc``; a few nanoseconds an entry), with
TensorFlow ops on GPU. ``exchange="auto"`` times it against the others on the job and picks it
only where it is faster.

With ``staleness`` the delayed pipeline (``sparse_hvd.steps.pipeline``) runs the exchange on
its own thread: the indices and values are coded in the step as above (:meth:`pack_indices`,
:meth:`pack_values`) and decoded on that thread in NumPy (``index_coding.decode_host``,
``value_coding.decode_host``), which runs no TensorFlow op per step.
"""

import tensorflow as tf

from . import index_coding, value_coding
from .base import register
from .fused_allgather import FusedAllgather


@register("compact_allgather", grouping="grouped")
class CompactAllgather(FusedAllgather):
    """Steps 1-3 of the module doc around the fused allgather (float64 values travel as
    they are)."""

    staleness = True  # the delayed pipeline sends its codes too (module doc)
    coded = True
    builds_on = "allgather"  # the fused allgather, plus coding and decoding what it sends

    def pack_indices(self, selections, sizes):
        """Steps 1-2 for the indices (also the delayed pipeline's, ``steps.staleness``): the
        code of every selection's positions as one set, and the selections in its order."""
        if not selections:
            return tf.zeros([0], tf.int32), selections
        positions = tf.concat([tf.cast(s.indices, tf.int64) + offset  # step 2
                               for s, offset in zip(selections, _offsets(sizes))], 0)
        words, order = index_coding.encode_in_any_order(positions, sum(sizes))
        # step 1: the variables' ranges of the space do not overlap, so the sorting order
        # keeps each variable's entries where they were, in its own order
        counts = tf.stack([tf.size(s.indices) for s in selections])
        firsts = tf.cumsum(counts, exclusive=True)
        ordered = []
        for j, (selection, own) in enumerate(zip(selections, tf.split(order, counts,
                                                                      num=len(selections)))):
            own = own - firsts[j]
            ordered.append(selection._replace(indices=tf.gather(selection.indices, own),
                                              values=tf.gather(selection.values, own)))
        return words, ordered

    def _wire_values(self, selections, positions):
        """The values of variables ``positions``, one after another, as they travel: in their
        16-bit type with ``compression`` (exactly: the payload holds them rounded)."""
        values = tf.concat([selections[p].values for p in positions], 0)
        return tf.cast(values, self._wire_dtype(values.dtype))

    def _wire_dtype(self, dtype):
        return self.compression.wire_dtype(dtype) or tf.as_dtype(dtype)

    def pack_values(self, selections, counts, value_groups):
        """Each float32 or 16-bit group's values coded by ``value_coding``; its header fields
        ``[W, bitmap bits, each variable's base]``. float64 travels as it is, without fields."""
        words, fields = [], []
        for positions in value_groups.values():
            values = self._wire_values(selections, positions)
            if not value_coding.codable(values.dtype):
                words.append(self.compression.encode(values))
                continue
            block = value_coding.encode(values, [counts[p] for p in positions])
            words.append(block.words)
            fields.append(value_coding.header_fields(block))
        return words, tf.concat(fields, 0) if fields else tf.zeros([0], tf.int64)

    def _unpack_values(self, words, dtype, value_groups, counts, value_fields):
        wire = self._wire_dtype(dtype)
        if not value_coding.codable(wire):
            return super()._unpack_values(words, dtype, value_groups, counts, value_fields)
        start = 0  # where this group's fields start: after those of the coded groups before it
        for earlier, positions in value_groups.items():
            if earlier == dtype:
                break
            if value_coding.codable(self._wire_dtype(earlier)):
                start += 2 + len(positions)
        positions = value_groups[dtype]
        fields = value_fields[:, start:start + 2 + len(positions)]
        return tf.cast(value_coding.decode(words, tf.gather(counts, positions, axis=1), fields,
                                           wire), dtype)

    def _unpack_indices(self, gathered, counts, sizes):
        if not sizes:
            return tf.zeros([0], tf.int32)
        return index_coding.decode_ranks(gathered, counts, _offsets(sizes), sum(sizes))  # step 3


def _offsets(sizes):
    """Where each variable starts in the one index space of step 2."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += size
    return offsets
