"""The sparse allreduce's blocks (sparse_hvd/exchanges/sparse_blocks.py) in one process: what
each owner unpacks of the scatter and every rank of the gather is every sent bit, for every
value format, with empty blocks and empty regions; a coded block's length is the closed form
of its codes; what a top-k entry costs coded. On the native kernels' path and on the
TensorFlow ops' (GPU, or no kernels)."""

import numpy as np
import pytest
import tensorflow as tf

from sparse_hvd import kernels
from sparse_hvd.exchanges import index_coding, value_coding
from sparse_hvd.exchanges.compression import Compression
from sparse_hvd.exchanges.sparse_blocks import BLOCK_HEADER, CodedBlocks, PlainBlocks

SPECIAL = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-42, -1e-39, 3e-8, 6e4, 3e38, -1.0, 1.0]
# (values' dtype, compression): float16 values also as float32 rounded by compression
FORMATS = [("float32", "none"), ("float64", "none"), ("float16", "none"),
           ("bfloat16", "none"), ("float32", "float16"), ("float32", "bfloat16")]


@pytest.fixture(params=["native", "tensorflow"], autouse=True)
def path(request, monkeypatch):
    if request.param == "native" and kernels.encode_values() is None:
        pytest.skip("the native kernels are off in this run (SPARSE_HVD_NATIVE=0 or a GPU)")
    if request.param == "tensorflow":
        _without_kernels(monkeypatch)
    return request.param


def _without_kernels(monkeypatch):
    for name in ("encode_values", "decode_values", "encode_positions", "decode_positions",
                 "encode_entries", "scatter_blocks", "decode_scatter", "decode_gather"):
        monkeypatch.setattr(kernels, name, lambda: None)


def _entries(rng, count, start, length, dtype, compression, special=False):
    """``count`` distinct global indices of ``[start, start + length)`` in random order, and
    values of ``dtype`` as the payload holds them (rounded by ``compression``)."""
    indices = start + rng.choice(length, size=count, replace=False)
    values = rng.standard_normal(count) * 10.0 ** rng.integers(-3, 3)
    if special and count:
        values[:min(count, len(SPECIAL))] = SPECIAL[:count]
    values = tf.cast(tf.constant(values), dtype)
    half = compression.wire_dtype(dtype)
    if half is not None:
        values = tf.cast(tf.cast(values, half), dtype)
    return tf.constant(indices, tf.int32), values


def _bits(values):
    view = {8: tf.int64, 4: tf.int32, 2: tf.int16}[values.dtype.size]
    return tf.bitcast(values, view).numpy()


def _by_index(indices, values):
    order = np.argsort(indices, kind="stable")
    return indices[order], _bits(tf.gather(values, order))


@pytest.mark.parametrize("blocks_class", [CodedBlocks, PlainBlocks])
@pytest.mark.parametrize("dtype_name,compression", FORMATS)
def test_an_owner_unpacks_every_ranks_entries_bit_for_bit(blocks_class, dtype_name,
                                                          compression):
    rng = np.random.default_rng(7)
    compression = Compression(compression)
    blocks = blocks_class(compression)
    start, length = 1000, 5000  # the owner's region
    counts = [40, 0, 700, 3]  # from each of 4 ranks; rank 1 sends nothing
    sent = [_entries(rng, m, start, length, dtype_name, compression, special=r == 2)
            for r, m in enumerate(counts)]
    words = [blocks.scatter_block(i, v, tf.constant(start, tf.int64),
                                  tf.constant(length, tf.int64)) for i, v in sent]
    indices, values, per_rank = blocks.unpack_scatter(
        tf.concat(words, 0), tf.constant([int(tf.size(w)) for w in words], tf.int32),
        tf.as_dtype(dtype_name), tf.constant(start, tf.int64), tf.constant(length, tf.int64))
    np.testing.assert_array_equal(per_rank.numpy(), counts)
    assert values.dtype == tf.as_dtype(dtype_name) and indices.dtype == tf.int32
    first = 0
    for r, (sent_indices, sent_values) in enumerate(sent):
        got = slice(first, first + counts[r])
        first += counts[r]
        expected_indices, expected_bits = _by_index(sent_indices.numpy(), sent_values)
        got_indices, got_bits = _by_index(indices.numpy()[got], values[got])
        np.testing.assert_array_equal(got_indices, expected_indices, err_msg=f"rank {r}")
        np.testing.assert_array_equal(got_bits, expected_bits, err_msg=f"rank {r}")


@pytest.mark.parametrize("blocks_class", [CodedBlocks, PlainBlocks])
@pytest.mark.parametrize("dtype_name,compression", FORMATS)
@pytest.mark.parametrize("ascending", [True, False])
def test_the_scatter_is_each_owners_block_of_its_region_one_after_another(
        blocks_class, dtype_name, compression, ascending, monkeypatch):
    """``scatter_blocks`` (natively one op) gives, owner by owner, the block of the entries in
    its region that the TensorFlow ops make of them alone, bit for bit, and each block's
    words; an empty region and an owner sent nothing get an empty block; the entries may
    arrive in any order."""
    rng = np.random.default_rng(11)
    compression = Compression(compression)
    blocks = blocks_class(compression)
    boundaries = [0, 300, 300, 4000, 4100, 9000]  # owner 1's region is empty
    indices, values = _entries(rng, 900, 0, 9000, dtype_name, compression, special=True)
    indices = indices.numpy()
    indices[np.isin(indices, np.arange(4000, 4100))] = 0  # owner 3 gets no entries ...
    keep = np.unique(indices, return_index=True)[1]  # ... and indices stay distinct
    order = np.sort(keep) if not ascending else keep[np.argsort(indices[keep])]
    indices, values = tf.constant(indices[order]), tf.gather(values, order)
    words, splits = blocks.scatter_blocks(indices, values, tf.constant(boundaries, tf.int64))
    owner = np.searchsorted(boundaries[1:-1], indices.numpy(), side="right")
    with monkeypatch.context() as plain:
        _without_kernels(plain)
        expected = [blocks.scatter_block(
            tf.constant(indices.numpy()[owner == r]), tf.gather(values, np.flatnonzero(owner == r)),
            tf.constant(start, tf.int64), tf.constant(end - start, tf.int64))
            for r, (start, end) in enumerate(zip(boundaries[:-1], boundaries[1:]))]
    assert [int(np.sum(owner == r)) for r in range(5)][1::2] == [0, 0]
    np.testing.assert_array_equal(splits.numpy(), [int(tf.size(e)) for e in expected])
    np.testing.assert_array_equal(words.numpy(), tf.concat(expected, 0).numpy())


@pytest.mark.parametrize("blocks_class", [CodedBlocks, PlainBlocks])
def test_a_scatter_of_an_index_twice_or_outside_the_space_is_refused(blocks_class, path):
    blocks = blocks_class(Compression("none"))
    boundaries = tf.constant([0, 10, 20], tf.int64)
    values = tf.constant([1.0, 2.0, 3.0])
    if blocks_class is PlainBlocks:  # no codes: the indices travel as they are
        words, splits = blocks.scatter_blocks(tf.constant([3, 12, 12]), values, boundaries)
        np.testing.assert_array_equal(splits.numpy(), [2, 4])
        return
    if path == "tensorflow":
        pytest.skip("the TensorFlow ops code what they are given (as index_coding.encode)")
    for indices, said in (([3, 12, 12], "sent twice"), ([3, 12, 25], "outside")):
        with pytest.raises(tf.errors.InvalidArgumentError, match=said):
            blocks.scatter_blocks(tf.constant(indices), values, boundaries)


@pytest.mark.parametrize("blocks_class", [CodedBlocks, PlainBlocks])
def test_a_rank_that_sends_no_words_sent_no_entries(blocks_class):
    # a rank that is not training announces its state with an empty alltoall (no header
    # either): the owner unpacks the others' entries and none of its; the step's gather then
    # stops every rank by the lockstep check
    rng = np.random.default_rng(5)
    compression = Compression("none")
    blocks = blocks_class(compression)
    start, length = 0, 1000
    sent = [_entries(rng, m, start, length, "float32", compression) for m in (30, 0, 12)]
    words = [blocks.scatter_block(i, v, tf.constant(start, tf.int64),
                                  tf.constant(length, tf.int64)) for i, v in sent]
    words[1] = tf.zeros([0], tf.int32)
    indices, values, per_rank = blocks.unpack_scatter(
        tf.concat(words, 0), tf.constant([int(tf.size(w)) for w in words], tf.int32),
        tf.float32, tf.constant(start, tf.int64), tf.constant(length, tf.int64))
    np.testing.assert_array_equal(per_rank.numpy(), [30, 0, 12])
    expected = np.concatenate([np.sort(sent[0][0].numpy()), np.sort(sent[2][0].numpy())])
    got = np.concatenate([np.sort(indices.numpy()[:30]), np.sort(indices.numpy()[30:])])
    np.testing.assert_array_equal(got, expected)
    assert values.shape == [42]


@pytest.mark.parametrize("blocks_class", [CodedBlocks, PlainBlocks])
@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_every_rank_unpacks_every_owners_kept_sums_in_index_order(blocks_class, dtype_name):
    rng = np.random.default_rng(3)
    blocks = blocks_class(Compression("float16"))  # the sums travel in their own dtype anyway
    boundaries = [0, 100, 100, 350, 100000]  # rank 1's region is empty
    kept = [40, 0, 250, 900]  # every entry of rank 2's region
    parts, fields, expected_indices, expected_values = [], [], [], []
    for r, m in enumerate(kept):
        start, length = boundaries[r], boundaries[r + 1] - boundaries[r]
        indices, values = _entries(rng, m, start, length, dtype_name, Compression("none"),
                                   special=r == 3)
        indices = tf.sort(indices)  # an owner's kept sums are ascending
        own_parts, own_fields = blocks.gather_parts(indices, values, tf.constant(start, tf.int64),
                                                    tf.constant(length, tf.int64))
        parts.append(own_parts)
        fields.append(own_fields)
        expected_indices.append(indices.numpy())
        expected_values.append(_bits(values))
    gathered = [tf.concat(column, 0) for column in zip(*parts)]  # what the allgather hands out
    assert len(gathered) == blocks.gathered_parts
    indices, values = blocks.unpack_gather(gathered, tf.stack(fields),
                                           tf.constant(boundaries, tf.int64), dtype_name)
    np.testing.assert_array_equal(indices.numpy(), np.concatenate(expected_indices))
    np.testing.assert_array_equal(_bits(values), np.concatenate(expected_values))


def test_a_coded_block_is_its_header_and_the_closed_form_lengths_of_its_codes():
    rng = np.random.default_rng(0)
    blocks = CodedBlocks(Compression("none"))
    for count, length in ((0, 10), (1, 1), (37, 40), (500, 100000)):
        indices, values = _entries(rng, count, 0, length, "float32", Compression("none"))
        words = blocks.scatter_block(indices, values, tf.constant(0, tf.int64),
                                     tf.constant(length, tf.int64))
        fields = words[:BLOCK_HEADER].numpy()
        assert fields[0] == count
        low, bitmap = (int(w) for w in index_coding.encoded_words(count, length))
        value_words = sum(int(w) for w in value_coding.block_words(
            tf.constant(count, tf.int64), tf.constant(int(fields[1]), tf.int64),
            tf.constant(int(fields[2]), tf.int64), value_coding.FORMATS[tf.float32]))
        assert int(tf.size(words)) == BLOCK_HEADER + low + bitmap + value_words


@pytest.mark.parametrize("value_dtype,compression,most", [("float32", "none", 5.0),
                                                          ("float32", "float16", 3.5)])
def test_a_top_k_entry_costs_at_most_the_issues_bytes(value_dtype, compression, most):
    # a 1% top-k of one rank's normal gradient over 4 regions: indices among each region's
    # entries, values within a few binades of the cut
    rng = np.random.default_rng(1)
    compression = Compression(compression)
    blocks = CodedBlocks(compression)
    n, k = 400000, 4000
    gradient = rng.standard_normal(n)
    chosen = np.argpartition(-np.abs(gradient), k)[:k]
    values = tf.constant(gradient[chosen], value_dtype)
    half = compression.wire_dtype(values.dtype)
    if half is not None:
        values = tf.cast(tf.cast(values, half), value_dtype)
    sent = 0
    for r in range(4):
        start, length = r * n // 4, n // 4
        mine = (chosen >= start) & (chosen < start + length)
        sent += int(tf.size(blocks.scatter_block(
            tf.constant(chosen[mine], tf.int32), tf.boolean_mask(values, mine),
            tf.constant(start, tf.int64), tf.constant(length, tf.int64))))
    assert 4 * sent / k <= most


def _coded_scatter(rng, counts, start, length):
    """Coded blocks of ``counts[r]`` float32 entries from each rank, as an owner receives them."""
    blocks = CodedBlocks(Compression("none"))
    words = [blocks.scatter_block(*_entries(rng, m, start, length, "float32",
                                            Compression("none")),
                                  tf.constant(start, tf.int64), tf.constant(length, tf.int64))
             for m in counts]
    return blocks, [w.numpy() for w in words]


def test_native_unpacking_refuses_blocks_that_do_not_hold_their_headers(path):
    """The native decoding (one op each way) names the rank whose words do not hold what its
    header says: a block cut short, a count beyond its region, a bitmap that ends early, a
    gather whose headers add up to other words; never a value read past its block."""
    if path == "tensorflow":
        pytest.skip("the TensorFlow ops trust the headers' word counts (no native check)")
    rng = np.random.default_rng(13)
    start, length = 200, 3000
    blocks, words = _coded_scatter(rng, [25, 60, 7], start, length)

    def unpack(words):
        return blocks.unpack_scatter(tf.constant(np.concatenate(words)),
                                     tf.constant([len(w) for w in words], tf.int32),
                                     tf.float32, tf.constant(start, tf.int64),
                                     tf.constant(length, tf.int64))

    short = [words[0], words[1][:-1], words[2]]
    with pytest.raises(tf.errors.InvalidArgumentError, match="rank 1's block header says"):
        unpack(short)
    too_many = [words[0], words[1], words[2].copy()]
    too_many[2][0] = length + 1
    with pytest.raises(tf.errors.InvalidArgumentError, match="rank 2's block says 3001 entries"):
        unpack(too_many)
    no_bitmap = [words[0].copy(), words[1], words[2]]
    low_words, bitmap_words = (int(w) for w in index_coding.encoded_words(25, length))
    first_bitmap = BLOCK_HEADER + low_words
    no_bitmap[0][first_bitmap:first_bitmap + bitmap_words] = 0
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="rank 0's block does not decode to ascending positions"):
        unpack(no_bitmap)
    headerless = [words[0], words[1][:2], words[2]]
    with pytest.raises(tf.errors.InvalidArgumentError, match="rank 1's block of 2 words has no"):
        unpack(headerless)

    # the gather: owner r's block among its own region, its header apart
    boundaries = [0, 1000, 1000, 5000]
    parts, fields = [], []
    for r in range(3):
        own_start, own_length = boundaries[r], boundaries[r + 1] - boundaries[r]
        indices, values = _entries(rng, min(own_length, 30), own_start, own_length, "float32",
                                   Compression("none"))
        own_parts, own_fields = blocks.gather_parts(
            tf.sort(indices), values, tf.constant(own_start, tf.int64),
            tf.constant(own_length, tf.int64))
        parts.append(own_parts[0].numpy())
        fields.append(own_fields.numpy())
    fields = np.stack(fields)
    fields[2, 0] += 1  # owner 2's header says one entry more than its words hold
    with pytest.raises(tf.errors.InvalidArgumentError, match="headers add up to"):
        blocks.unpack_gather([tf.constant(np.concatenate(parts))], tf.constant(fields),
                             tf.constant(boundaries, tf.int64), tf.float32)


@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_an_owners_gathered_block_is_the_tensorflow_ops_code_of_its_kept_sums(
        dtype_name, path, monkeypatch):
    """``gather_parts`` (natively the scatter's op for one region, split after its header)
    gives the words and header fields the TensorFlow ops give, bit for bit, also for no sums."""
    if path == "tensorflow":
        pytest.skip("compares the native path with the TensorFlow ops")
    rng = np.random.default_rng(17)
    blocks = CodedBlocks(Compression("none"))
    start, length = 700, 6000
    for count in (0, 1, 450):
        indices, sums = _entries(rng, count, start, length, dtype_name, Compression("none"),
                                 special=True)
        indices = tf.sort(indices)
        args = (indices, sums, tf.constant(start, tf.int64), tf.constant(length, tf.int64))
        parts, fields = blocks.gather_parts(*args)
        with monkeypatch.context() as plain:
            _without_kernels(plain)
            expected_parts, expected_fields = blocks.gather_parts(*args)
        np.testing.assert_array_equal(fields.numpy(), expected_fields.numpy())
        np.testing.assert_array_equal(parts[0].numpy(), expected_parts[0].numpy())
