"""Compact values (sparse_hvd/exchanges/value_coding.py): every bit comes back, for every
float format and every kind of value; the code's length against the module doc's rules
computed in plain integers; what a top-k selection's value costs. Each runs on the native
kernels' path and on the TensorFlow ops' (GPU, or no kernels), which must give the same words."""

import numpy as np
import pytest
import tensorflow as tf

from helpers import coded_value_words, numpy_topk_indices, raw_bits_of
from sparse_hvd import kernels
from sparse_hvd.exchanges import value_coding

FORMATS = ["float32", "float16", "bfloat16"]
SPECIAL = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-42, -1e-39, 3e-8, 6e4, 3e38, -1.0, 1.0]


@pytest.fixture(params=["native", "tensorflow"], autouse=True)
def path(request, monkeypatch):
    """Code by the native kernels or by TensorFlow ops."""
    if request.param == "native" and kernels.encode_values() is None:
        pytest.skip("the native kernels are off in this run (SPARSE_HVD_NATIVE=0 or a GPU)")
    if request.param == "tensorflow":
        monkeypatch.setattr(value_coding.kernels, "encode_values", lambda: None)
        monkeypatch.setattr(value_coding.kernels, "decode_values", lambda: None)
    return request.param


def _values(counts, seed, dtype_name, special=False):
    """One rank's values, variable after variable, each variable on its own scale."""
    rng = np.random.default_rng(seed)
    parts = []
    for variable, count in enumerate(counts):
        x = rng.standard_normal(count) * 10.0 ** (-2 * variable)
        if special and count:
            x[:min(count, len(SPECIAL))] = SPECIAL[:count]
        parts.append(x)
    return tf.cast(tf.constant(np.concatenate(parts) if parts else np.zeros(0)), dtype_name)


def _bits(values):
    view = tf.int32 if values.dtype.size == 4 else tf.int16
    return tf.bitcast(values, view).numpy()


@pytest.mark.parametrize("dtype_name", FORMATS)
def test_every_rank_gets_back_every_bit_from_blocks_of_the_closed_form_length(dtype_name):
    counts = np.array([[5, 0, 30], [0, 0, 0], [400, 3, 12], [1, 1, 1]])
    blocks, sent = [], []
    for rank, row in enumerate(counts):
        values = _values(row, rank, dtype_name, special=rank == 2)
        block = value_coding.encode(values, [tf.constant(c) for c in row])
        assert block.words.dtype == tf.int32
        expected = coded_value_words(raw_bits_of(values, dtype_name), row, dtype_name)
        assert int(tf.size(block.words)) == expected, f"rank {rank}"
        assert int(value_coding.coded_words(values, [tf.constant(c) for c in row])) == expected
        blocks.append(block)
        sent.append(values)
    decoded = value_coding.decode(tf.concat([b.words for b in blocks], 0), tf.constant(counts),
                                  tf.stack([value_coding.header_fields(b) for b in blocks]),
                                  dtype_name)
    assert decoded.dtype == tf.as_dtype(dtype_name)
    np.testing.assert_array_equal(_bits(decoded), _bits(tf.concat(sent, 0)))


@pytest.mark.parametrize("dtype_name", FORMATS)
def test_a_variable_of_zeros_alone_and_one_exponent_alone_come_back(dtype_name):
    values = tf.cast(tf.constant([0.0, -0.0, 0.0, 0.5, 0.5, -0.75, 2.0 ** -10]), dtype_name)
    counts = [3, 3, 1]  # zeros only; one binade only (code 0 there is not a zero); one value
    block = value_coding.encode(values, [tf.constant(c) for c in counts])
    assert int(block.width) == 0
    # the codes: 0, 0, 0 | 0, 0, 0 | 0: one unary bit each
    assert int(block.unary_bits) == 7
    decoded = value_coding.decode(block.words, tf.constant([counts]),
                                  value_coding.header_fields(block)[tf.newaxis], dtype_name)
    np.testing.assert_array_equal(_bits(decoded), _bits(values))


def test_traced_with_unknown_counts_as_the_exchange_runs_it():
    counts = [17, 250]
    values = _values(counts, 3, "float32")
    encode = tf.function(lambda v, a, b: value_coding.encode(v, [a, b]),
                         input_signature=[tf.TensorSpec([None], tf.float32),
                                          tf.TensorSpec([], tf.int32), tf.TensorSpec([], tf.int32)])
    block = encode(values, tf.constant(counts[0]), tf.constant(counts[1]))
    decode = tf.function(lambda w, c, f: value_coding.decode(w, c, f, tf.float32),
                         input_signature=[tf.TensorSpec([None], tf.int32),
                                          tf.TensorSpec([1, 2], tf.int32),
                                          tf.TensorSpec([1, 4], tf.int64)])
    decoded = decode(block.words, tf.constant([counts], tf.int32),
                     value_coding.header_fields(block)[tf.newaxis])
    np.testing.assert_array_equal(_bits(decoded), _bits(values))


@pytest.mark.parametrize("dtype_name,field", [("float32", 24), ("float16", 11)])
@pytest.mark.parametrize("density", [0.01, 0.001])
def test_a_top_k_value_costs_its_sign_and_mantissa_and_at_most_3_bits(dtype_name, field,
                                                                        density):
    """The largest 1% (0.1%) of heavy-tailed gradients, with each variable on its own scale:
    their exponents lie in a few binades above the variable's cut."""
    rng = np.random.default_rng(5)
    chosen, counts = [], []
    for scale, size in ((1.0, 200_000), (1e-3, 50_000), (30.0, 8_000)):
        gradient = rng.standard_t(4, size) * scale
        k = int(size * density)
        chosen.append(gradient[numpy_topk_indices(gradient, k)])
        counts.append(k)
    values = tf.cast(tf.constant(np.concatenate(chosen)), dtype_name)
    words = int(value_coding.coded_words(values, [tf.constant(c) for c in counts]))
    bits_per_value = 32 * words / sum(counts)
    assert bits_per_value <= field + 3, bits_per_value
    assert words == coded_value_words(raw_bits_of(values, dtype_name), counts, dtype_name)


@pytest.mark.parametrize("dtype_name", FORMATS)
def test_the_native_and_tensorflow_paths_write_the_same_words(dtype_name, path, monkeypatch):
    if path != "native":
        pytest.skip("compares the native path with the TensorFlow one")
    counts = [300, 0, 41, 7]
    values = _values(counts, 9, dtype_name, special=True)
    native = value_coding.encode(values, [tf.constant(c) for c in counts])
    monkeypatch.setattr(value_coding.kernels, "encode_values", lambda: None)
    plain = value_coding.encode(values, [tf.constant(c) for c in counts])
    np.testing.assert_array_equal(native.words.numpy(), plain.words.numpy())
    np.testing.assert_array_equal(value_coding.header_fields(native).numpy(),
                                  value_coding.header_fields(plain).numpy())


def test_words_that_do_not_match_their_header_are_refused_by_name(path):
    if path != "native":
        pytest.skip("the TensorFlow path trusts the lengths the exchange computed")
    counts = [50, 20]
    values = _values(counts, 11, "float32")
    block = value_coding.encode(values, [tf.constant(c) for c in counts])
    fields = value_coding.header_fields(block)[tf.newaxis]
    with pytest.raises(tf.errors.InvalidArgumentError, match="words"):
        value_coding.decode(block.words[:-1], tf.constant([counts]), fields, tf.float32)
    # a header that claims 64 more bitmap bits, with the two zero words they would take:
    # the bitmap then ends before the last values' bits
    unary = int(fields[0, 1])
    wrong = tf.tensor_scatter_nd_update(fields, [[0, 1]], [unary + 64])
    with pytest.raises(tf.errors.InvalidArgumentError, match="rank 0's value code"):
        value_coding.decode(tf.concat([block.words[:-1], tf.zeros([2], tf.int32),
                                       block.words[-1:]], 0),
                            tf.constant([counts]), wrong, tf.float32)


@pytest.mark.parametrize("dtype_name", FORMATS)
def test_the_host_decoder_gives_back_every_bit_of_one_ranks_block(dtype_name):
    """``decode_host`` (NumPy, the delayed pipeline's thread), each rank's block alone."""
    for rank, row in enumerate([[5, 0, 30], [0, 0, 0], [400, 3, 12], [1, 1, 1]]):
        values = _values(row, rank, dtype_name, special=rank == 2)
        block = value_coding.encode(values, [tf.constant(c) for c in row])
        fields = value_coding.header_fields(block).numpy()
        assert value_coding.host_block_words(sum(row), fields[0], fields[1], dtype_name) == (
            coded_value_words(raw_bits_of(values, dtype_name), row, dtype_name))
        decoded = value_coding.decode_host(block.words.numpy(), row, fields, dtype_name)
        assert decoded.dtype == tf.as_dtype(dtype_name).as_numpy_dtype
        np.testing.assert_array_equal(_bits(tf.constant(decoded)), _bits(values))


def test_the_host_decoder_refuses_a_block_of_the_wrong_length():
    values = _values([40], 0, "float32")
    block = value_coding.encode(values, [tf.constant(40)])
    fields = value_coding.header_fields(block).numpy()
    words = block.words.numpy()
    with pytest.raises(ValueError, match=f"has {len(words)} words, got {len(words) + 1}"):
        value_coding.decode_host(np.append(words, 0).astype(np.int32), [40], fields, "float32")
