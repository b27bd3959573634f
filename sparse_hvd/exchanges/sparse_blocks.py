"""How the sparse allreduce's entries travel (``exchanges.sparse_allreduce``): its two
collectives each carry a block of (index, value) entries per rank, all within one region of
the index space (the scatter's block for owner r holds entries of r's region; the gather's
block from owner r holds the sums r kept, also in its region).

* :class:`CodedBlocks` (``exchange="sparse_allreduce"``): a block is ``[its entry count, W,
  the Rice bitmap's bits, the value base | the indices Elias-Fano coded among the region's
  entries | the values coded]``, with the codes of ``index_coding`` and ``value_coding``
  (one value base per block: a block's values lie above one cut, the model's or its
  variables', close to it). About 1.1-1.5 bytes an index instead of 4, 3.1 a float32 value
  and 1.5 a float16 one; float64 values travel raw. Native one-pass kernels on CPU.
* :class:`PlainBlocks` (``exchange="plain_sparse_allreduce"``): ``[int32 indices | values
  as words]``, 8 bytes an entry with float32 values, 6 with 16-bit ones.

Both decode to the very bits that were sent, so the owners' sums, the applied averages and
the residuals are the same either way; only the bytes on the link and the CPU work differ.
Each block's entries are those of one rank, whose indices are distinct, so their order
within the block does not change any sum (the coded block sends them ascending).
"""

import tensorflow as tf

from .. import kernels
from . import index_coding, value_coding, wire
from .regions import owners_of

# the scatter's block header (CodedBlocks): entries, W, bitmap bits, value base
BLOCK_HEADER = 4
# the values' dtypes the native scatter codes (``kernels/scatter_blocks.cc``)
NATIVE_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


class PlainBlocks:
    """Blocks as int32 indices and the values' words (two 16-bit values to a word)."""

    header_fields = 0  # int32 fields each rank adds to the gather's header
    gathered_parts = 2  # tensors each rank adds to the gather

    def __init__(self, compression):
        self.compression = compression

    def scatter_block(self, indices, values, start, length):
        """One owner's block of the scatter: ``indices`` (global, int32) in its region
        ``[start, start + length)`` and their ``values``, as int32 words."""
        return tf.concat([indices, self.compression.encode(values)], 0)

    def scatter_blocks(self, indices, values, boundaries):
        """Every owner's :meth:`scatter_block` of the entries in its region (``boundaries``,
        int64 [owners + 1]: the regions' cut points), one after another, and the words of
        each (int32 [owners])."""
        owners = int(boundaries.shape[0]) - 1
        if owners == 1:
            block = self.scatter_block(indices, values, boundaries[0],
                                       boundaries[1] - boundaries[0])
            return block, tf.reshape(tf.size(block), [1])
        owner = owners_of(tf.cast(indices, tf.int64), boundaries)
        blocks = [self.scatter_block(owned, owned_values, boundaries[r],
                                     boundaries[r + 1] - boundaries[r])
                  for r, (owned, owned_values) in enumerate(zip(
                      tf.dynamic_partition(indices, owner, owners),
                      tf.dynamic_partition(values, owner, owners)))]
        return tf.concat(blocks, 0), tf.stack([tf.size(block) for block in blocks])

    def unpack_scatter(self, received, from_each, dtype, start, length):
        """The blocks this owner received (``from_each[r]`` words from rank r) as ``(global
        indices, values, entries per rank)``, rank by rank. A block of m entries has m +
        ceil(m / 2) words with 16-bit values and m (1 + w) with values of w words."""
        from_each = tf.cast(from_each, tf.int32)
        if self.compression.wire_dtype(dtype) is not None:
            per_rank = (2 * from_each) // 3
        else:
            per_rank = from_each // (1 + wire.words_per_value(dtype))
        rank_of = tf.repeat(tf.range(tf.size(from_each)), from_each)
        within = tf.range(tf.size(received)) - tf.gather(tf.cumsum(from_each, exclusive=True),
                                                         rank_of)
        is_index = within < tf.gather(per_rank, rank_of)
        values = self.compression.decode(tf.boolean_mask(received, tf.logical_not(is_index)),
                                         dtype, per_rank)
        return tf.boolean_mask(received, is_index), values, per_rank

    def gather_parts(self, kept, sums, start, length):
        """``(tensors to gather, header fields)`` for this owner's kept ``sums`` at the
        ascending global indices ``kept`` of its region; the sums travel in their dtype."""
        return [kept, wire.to_words(sums)], tf.zeros([0], tf.int32)

    def unpack_gather(self, parts, fields, boundaries, dtype):
        """Every owner's kept entries, owner by owner (so ascending): ``(global indices,
        sums)``, from the gathered ``parts`` and each rank's header ``fields`` [N, h]."""
        return parts[0], wire.from_words(parts[1], dtype)


class CodedBlocks(PlainBlocks):
    """Blocks with coded indices and values (the module doc)."""

    header_fields = BLOCK_HEADER
    gathered_parts = 1

    def _coded(self, positions, values, length, wire_dtype):
        """``(header, index words, value words)`` of one block: ``positions`` (in the region,
        any order) and their ``values`` as they travel (``wire_dtype``)."""
        index_words, values = index_coding.encode_entries(positions, values, length)
        values = tf.cast(values, wire_dtype)
        count = tf.size(positions, out_type=tf.int64)
        if value_coding.codable(wire_dtype):
            block = value_coding.encode(values, [count])
            fields = tf.stack([count, block.width, block.unary_bits, block.bases[0]])
            value_words = block.words
        else:
            fields = tf.stack([count, 0, 0, 0])
            value_words = wire.to_words(values)
        return tf.cast(fields, tf.int32), index_words, value_words

    def _wire_dtype(self, dtype):
        return self.compression.wire_dtype(dtype) or tf.as_dtype(dtype)

    def scatter_block(self, indices, values, start, length):
        fields, index_words, value_words = self._coded(
            tf.cast(indices, tf.int64) - start, values, length, self._wire_dtype(values.dtype))
        return tf.concat([fields, index_words, value_words], 0)

    def scatter_blocks(self, indices, values, boundaries):
        """As the plain blocks' (the same words), natively in one op on CPU
        (``kernels/scatter_blocks.cc``: 184 operations fewer in the wide CNN's step at 4
        ranks)."""
        native = kernels.scatter_blocks()
        wire_dtype = self._wire_dtype(values.dtype)
        if native is None or wire_dtype not in NATIVE_DTYPES:
            return super().scatter_blocks(indices, values, boundaries)
        return native(tf.cast(indices, tf.int32), tf.cast(values, wire_dtype),
                      tf.cast(boundaries, tf.int64))

    def _value_words(self, fields, wire_dtype):
        """int32 words of each block's coded values, from its header ``fields`` [N, 4]."""
        fields = tf.cast(fields, tf.int64)
        if not value_coding.codable(wire_dtype):
            return fields[:, 0] * wire.words_per_value(wire_dtype)
        return tf.add_n(list(value_coding.block_words(
            fields[:, 0], fields[:, 1], fields[:, 2], value_coding.FORMATS[wire_dtype])))

    @staticmethod
    def _decoded_values(words, fields, wire_dtype, dtype):
        """Every block's values (rank by rank, as ``dtype``) from their concatenated
        ``words``, which hold them as ``wire_dtype``."""
        if not value_coding.codable(wire_dtype):
            return wire.from_words(words, dtype)
        counts = tf.cast(fields[:, :1], tf.int64)
        return tf.cast(value_coding.decode(words, counts, tf.cast(fields[:, 1:], tf.int64),
                                           wire_dtype), dtype)

    def unpack_scatter(self, received, from_each, dtype, start, length):
        """Every rank's block coded among this owner's region: one decoding of the indices
        (one space) and one of the values, after the words are split out of the blocks. A rank
        that is not training sends no words at all (``SparseAllreduce.announce``): no entries
        (the step's gather then stops every rank, naming each one's step). Natively one op
        on CPU (``kernels/decode_blocks.cc``)."""
        native = kernels.decode_scatter()
        wire_dtype = self._wire_dtype(dtype)
        if native is not None and wire_dtype in NATIVE_DTYPES:
            indices, values, counts = native(received, tf.cast(from_each, tf.int32),
                                             tf.cast(start, tf.int64), tf.cast(length, tf.int64),
                                             T=wire_dtype)
            return indices, tf.cast(values, dtype), counts
        ranks = from_each.shape[0]
        from_each = tf.cast(from_each, tf.int64)
        firsts = tf.cumsum(from_each, exclusive=True)
        sent = from_each > 0
        # a header of zeros (no entries) for a rank without a block
        padded = tf.concat([received, tf.zeros([BLOCK_HEADER], received.dtype)], 0)
        at = tf.where(sent, firsts, tf.size(received, out_type=tf.int64))
        fields = tf.gather(padded, at[:, None] + tf.range(BLOCK_HEADER, dtype=tf.int64))
        counts = tf.cast(fields[:, 0], tf.int64)
        low, bitmap = index_coding.encoded_words(counts, length)
        index_starts = firsts + tf.where(sent, tf.constant(BLOCK_HEADER, tf.int64), 0)
        value_starts = index_starts + low + bitmap
        index_words = tf.gather(received, tf.ragged.range(index_starts, value_starts).flat_values)
        value_ends = value_starts + self._value_words(fields, self._wire_dtype(dtype))
        value_words = tf.gather(received, tf.ragged.range(value_starts, value_ends).flat_values)
        positions = index_coding.decode_ranks(index_words, tf.reshape(counts, [ranks, 1]), [0],
                                              length)
        indices = positions + tf.cast(start, tf.int32)
        values = self._decoded_values(value_words, fields, self._wire_dtype(dtype), dtype)
        return indices, values, tf.cast(counts, tf.int32)

    def gather_parts(self, kept, sums, start, length):
        """As the plain blocks', the header's fields apart from the codes' words; natively the
        scatter's block for one region (``kernels/scatter_blocks.cc``), split after its
        header."""
        native = kernels.scatter_blocks()
        if native is not None and tf.as_dtype(sums.dtype) in NATIVE_DTYPES:
            start = tf.cast(start, tf.int64)
            region = tf.stack([start, start + tf.cast(length, tf.int64)])
            block, _ = native(tf.cast(kept, tf.int32), sums, region)
            return [block[BLOCK_HEADER:]], block[:BLOCK_HEADER]
        fields, index_words, value_words = self._coded(
            tf.cast(kept, tf.int64) - start, sums, length, tf.as_dtype(sums.dtype))
        return [tf.concat([index_words, value_words], 0)], fields

    def unpack_gather(self, parts, fields, boundaries, dtype):
        """The kept sums (coded in their own dtype): each owner's indices decoded among its
        own region, the values of all owners in one decoding. Natively one op on CPU
        (``kernels/decode_blocks.cc``; the TensorFlow ops' loop over the owners made about 30
        operations an owner in each traced step)."""
        native = kernels.decode_gather()
        if native is not None and tf.as_dtype(dtype) in NATIVE_DTYPES:
            return native(parts[0], tf.cast(fields, tf.int32), tf.cast(boundaries, tf.int64),
                          T=tf.as_dtype(dtype))
        ranks = fields.shape[0]
        words = parts[0]
        counts = tf.cast(fields[:, 0], tf.int64)
        lengths = boundaries[1:] - boundaries[:-1]
        low, bitmap = index_coding.encoded_words(counts, lengths)
        value_lengths = self._value_words(fields, tf.as_dtype(dtype))
        firsts = tf.cumsum(low + bitmap + value_lengths, exclusive=True)
        value_starts = firsts + low + bitmap
        indices = []
        for rank in range(ranks):
            own = words[firsts[rank]:value_starts[rank]]
            positions = index_coding.decode_ranks(own, tf.reshape(counts[rank], [1, 1]), [0],
                                                  lengths[rank])
            indices.append(positions + tf.cast(boundaries[rank], tf.int32))
        value_words = tf.gather(words, tf.ragged.range(value_starts,
                                                       value_starts + value_lengths).flat_values)
        return tf.concat(indices, 0), self._decoded_values(value_words, fields, dtype, dtype)
