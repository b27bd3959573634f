"""Elias-Fano coded indices (sparse_hvd/exchanges/index_coding.py): exact round trips, the
code's length against its closed form, and the bound of the module doc; the native kernels'
path and the TensorFlow ops' give the same words."""

import math

import numpy as np
import pytest
import tensorflow as tf

from helpers import elias_fano_words
from sparse_hvd import kernels
from sparse_hvd.exchanges import index_coding

CASES = [  # (space n, entries K)
    (100, 1), (1000, 10), (4_350_000, 43_500), (4_350_000, 4_350), (64, 64), (64, 40),
    (2 ** 31 - 1, 5), (2 ** 31 - 1, 3000), (10, 0), (1, 1), (2 ** 20, 2 ** 10),
    (2 ** 20, 2 ** 20 - 1), (33, 1), (2 ** 16, 2 ** 8),  # n / K an exact power of two
]


def _positions(n, k, seed=0):
    rng = np.random.default_rng(seed)
    x = np.sort(rng.choice(n, k, replace=False)) if k else np.zeros(0, np.int64)
    if k >= 2:  # both ends of the space
        x[0], x[-1] = 0, n - 1
    return np.unique(x)


@pytest.mark.parametrize("n,k", CASES)
def test_positions_come_back_exactly_from_a_code_of_the_closed_form_length(n, k):
    x = _positions(n, k)
    words = index_coding.encode(tf.constant(x, tf.int64), n)
    assert words.dtype == tf.int32
    assert int(tf.size(words)) == elias_fano_words(n, len(x))
    low, bitmap = index_coding.encoded_words(len(x), n)
    assert int(low) + int(bitmap) == int(tf.size(words))
    np.testing.assert_array_equal(index_coding.decode(words, len(x), n).numpy(), x)


@pytest.mark.parametrize("density", [0.01, 0.001])
def test_an_index_costs_at_most_three_bits_above_log2_of_n_over_k(density):
    n = 4_350_000
    k = int(n * density)
    words = index_coding.encode(tf.constant(_positions(n, k, seed=1), tf.int64), n)
    bits_per_entry = 32 * int(tf.size(words)) / k
    assert bits_per_entry <= math.log2(n / k) + 3
    assert bits_per_entry < 12  # against 32 for an int32 index


def test_traced_with_unknown_counts_as_the_exchange_runs_it():
    n = 5000
    x = _positions(n, 77, seed=2)
    encode = tf.function(lambda p: index_coding.encode(p, n),
                         input_signature=[tf.TensorSpec([None], tf.int64)])
    decode = tf.function(lambda w, c: index_coding.decode(w, c, n),
                         input_signature=[tf.TensorSpec([None], tf.int32),
                                          tf.TensorSpec([], tf.int64)])
    words = encode(tf.constant(x))
    np.testing.assert_array_equal(decode(words, tf.constant(len(x), tf.int64)).numpy(), x)


def _use(monkeypatch, path):
    if path == "native" and kernels.encode_positions() is None:
        pytest.skip("the native kernels are off in this run (SPARSE_HVD_NATIVE=0 or a GPU)")
    if path == "tensorflow":
        monkeypatch.setattr(index_coding.kernels, "encode_positions", lambda: None)
        monkeypatch.setattr(index_coding.kernels, "encode_entries", lambda: None)
        monkeypatch.setattr(index_coding.kernels, "decode_positions", lambda: None)


@pytest.mark.parametrize("path", ["native", "tensorflow"])
def test_any_order_in_every_rank_back_in_order_from_the_closed_form_code(monkeypatch, path):
    """Two variables share the space, the second from position 1,000,000: each rank's
    positions come back as indices within their variable, rank after rank."""
    _use(monkeypatch, path)
    n, second, cases = 4_350_000, 1_000_000, [(4_350, 3), (0, 4), (43_500, 5), (1, 6), (2, 7)]
    blocks, counts, expected = [], [], []
    for k, seed in cases:
        x = _positions(n, k, seed)
        shuffled = np.random.default_rng(seed).permutation(x)
        words, order = index_coding.encode_in_any_order(tf.constant(shuffled), n)
        assert int(tf.size(words)) == elias_fano_words(n, len(x))
        np.testing.assert_array_equal(shuffled[order.numpy()], x)
        np.testing.assert_array_equal(words.numpy(), index_coding.encode(tf.constant(x), n).numpy())
        blocks.append(words)
        counts.append([int(np.sum(x < second)), int(np.sum(x >= second))])
        expected.append(np.where(x < second, x, x - second))
    decoded = index_coding.decode_ranks(tf.concat(blocks, 0), tf.constant(counts), [0, second], n)
    assert decoded.dtype == tf.int32
    np.testing.assert_array_equal(decoded.numpy(), np.concatenate(expected))


@pytest.mark.parametrize("path", ["native", "tensorflow"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("arrive", ["sorted", "shuffled"])
def test_values_come_in_the_codes_order_with_the_same_words(monkeypatch, path, dtype, arrive):
    """``encode_entries``: the words of :func:`encode` of the sorted positions, and each value
    moved with its position (values distinct, so a wrong permutation shows)."""
    _use(monkeypatch, path)
    wide = dtype in ("float32", "float64")  # 16-bit types hold the integers to 256 exactly
    for n, k in [(4_350_000, 43_500 if wide else 256), (100_000, 200), (10, 0), (1, 1)]:
        x = _positions(n, k, 3)
        values = np.arange(1, len(x) + 1, dtype=np.float64)  # exact in the dtype
        permutation = (np.random.default_rng(1).permutation(len(x)) if arrive == "shuffled"
                       else np.arange(len(x)))
        words, in_order = index_coding.encode_entries(
            tf.constant(x[permutation]), tf.cast(values[permutation], dtype), n)
        assert in_order.dtype == tf.as_dtype(dtype)
        np.testing.assert_array_equal(words.numpy(),
                                      index_coding.encode(tf.constant(x), n).numpy())
        np.testing.assert_array_equal(in_order.numpy().astype(np.float64), values)


def test_the_native_entry_code_refuses_repeated_positions_and_values_of_another_length(
        monkeypatch):
    _use(monkeypatch, "native")
    with pytest.raises(tf.errors.InvalidArgumentError, match="sent twice"):
        index_coding.encode_entries(tf.constant([5, 9, 5], tf.int64), tf.zeros([3]), 100)
    with pytest.raises(tf.errors.InvalidArgumentError, match="outside"):
        index_coding.encode_entries(tf.constant([5, 100], tf.int64), tf.zeros([2]), 100)
    with pytest.raises(tf.errors.InvalidArgumentError, match="2 positions, 3 values"):
        index_coding.encode_entries(tf.constant([5, 9], tf.int64), tf.zeros([3]), 100)


def test_the_native_code_refuses_repeated_or_outside_positions_and_wrong_words(monkeypatch):
    _use(monkeypatch, "native")
    with pytest.raises(tf.errors.InvalidArgumentError, match="sent twice"):
        index_coding.encode_in_any_order(tf.constant([5, 9, 5], tf.int64), 100)
    with pytest.raises(tf.errors.InvalidArgumentError, match="outside"):
        index_coding.encode_in_any_order(tf.constant([5, 100], tf.int64), 100)
    words, _ = index_coding.encode_in_any_order(tf.constant([1, 50, 70], tf.int64), 100)
    with pytest.raises(tf.errors.InvalidArgumentError, match="words"):
        index_coding.decode_ranks(words[:-1], tf.constant([[3]]), [0], 100)
    with pytest.raises(tf.errors.InvalidArgumentError, match="within its variables"):
        index_coding.decode_ranks(words, tf.constant([[1, 2]]), [0, 60], 100)  # 50 is not >= 60


@pytest.mark.parametrize("n,k", CASES)
def test_the_host_decoder_reads_the_words_the_step_coded(n, k):
    """``decode_host`` (NumPy, the delayed pipeline's thread) against the TensorFlow code."""
    x = _positions(n, k, seed=3)
    words = index_coding.encode(tf.constant(x, tf.int64), n).numpy()
    _, low, bitmap = index_coding.host_layout(len(x), n)
    assert low + bitmap == elias_fano_words(n, len(x))
    decoded = index_coding.decode_host(words, len(x), n)
    assert decoded.dtype == np.int64
    np.testing.assert_array_equal(decoded, x)


def test_the_host_decoder_refuses_a_code_of_the_wrong_length():
    words = index_coding.encode(tf.constant([3, 70, 99], tf.int64), 100).numpy()
    with pytest.raises(ValueError, match="has 2 words, got 3"):
        index_coding.decode_host(np.concatenate([words, [0]]).astype(np.int32), 3, 100)
    with pytest.raises(ValueError, match="set bits"):
        index_coding.decode_host(words, 2, 100)  # its bitmap holds 3 positions, not 2
