"""Elias-Fano coded indices (sparse_hvd/exchanges/index_coding.py): exact round trips, the
code's length against its closed form, and the bound of the module doc."""

import math

import numpy as np
import pytest
import tensorflow as tf

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


def _closed_form_words(n, k):
    """Words of the code by the module doc's steps, in plain integers."""
    if k == 0:
        return 0
    low = max(0, (n // k).bit_length() - 1)  # floor(log2(n / K)), in integers
    return -(-k * low // 32) + -(-(k + (n >> low) + 1) // 32)


@pytest.mark.parametrize("n,k", CASES)
def test_positions_come_back_exactly_from_a_code_of_the_closed_form_length(n, k):
    x = _positions(n, k)
    words = index_coding.encode(tf.constant(x, tf.int64), n)
    assert words.dtype == tf.int32
    assert int(tf.size(words)) == _closed_form_words(n, len(x))
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
