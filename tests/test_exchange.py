"""average_entries (the exchange's step 4): native kernel and TensorFlow ops, against NumPy.

The NumPy re-computation adds rank by rank in the order sent, rounding after every addition
(float16 and bfloat16 too): the bits every rank must get, on CPU and, by construction (no
atomics), on a GPU.
"""

import numpy as np
import pytest
import tensorflow as tf

from sparse_hvd import kernels
from sparse_hvd.exchanges import averaging as averaging_module
from sparse_hvd.exchanges.averaging import average_entries

SIZES = [1000, 70000, 33]


BFLOAT16 = tf.bfloat16.as_numpy_dtype


def _gathered(rows, dtype, seed=0):
    """Per row (rank) and variable, distinct indices (shared between rows) and values."""
    rng = np.random.RandomState(seed)
    counts = np.array([[(r * 7 + v * 5) % 40 * (v + 1) for v in range(len(SIZES))]
                       for r in range(rows)], np.int32)
    counts[0, 0] = 0  # a rank that sends nothing of one variable
    indices, values = [], []
    for r in range(rows):
        for v, n in enumerate(SIZES):
            chosen = rng.choice(min(n, 200), size=min(counts[r, v], n), replace=False)  # overlapping
            counts[r, v] = len(chosen)
            indices.append(chosen.astype(np.int32))
            values.append(rng.randn(counts[r, v]).astype(np.float32).astype(dtype))
    return counts, indices, values


def _numpy(counts, indices, values, columns, divisor, dtype):
    rows, variables = counts.shape
    totals = {c: np.zeros(SIZES[c], dtype) for c in columns}
    for r in range(rows):
        for v in range(variables):
            if v in totals:
                totals[v][indices[r * variables + v]] += values[r * variables + v]
    return [totals[c] / np.asarray(divisor, dtype) for c in columns]


def _use(monkeypatch, path):
    """Average by ``path``: "native" (the CPU kernel), "tensorflow" (TensorFlow ops, as on CPU
    without the kernel) or "gpu" (TensorFlow ops as with a GPU visible: the rank-by-rank loop)."""
    if path == "native" and kernels.scatter_mean() is None:
        pytest.skip("the native kernels are off in this run (SPARSE_HVD_NATIVE=0 or a GPU)")
    if path != "native":
        monkeypatch.setattr(averaging_module.kernels, "scatter_mean", lambda: None)
    monkeypatch.setattr(averaging_module.startup, "_GPU", path == "gpu")


PATHS = ["native", "tensorflow", "gpu"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("rows,divisor", [(3, 3), (1, 1), (4, 4)])
def test_average_entries_is_the_rank_order_sum_divided(monkeypatch, path, dtype, rows, divisor):
    _use(monkeypatch, path)
    counts, indices, values = _gathered(rows, dtype)
    columns = [0, 2]  # variable 1 has another dtype: its values are not in this call
    group_values = [values[r * len(SIZES) + c] for r in range(rows) for c in columns]
    result = average_entries(tf.constant(np.concatenate(indices)), tf.constant(np.concatenate(group_values)),
                             tf.constant(counts), columns, [SIZES[c] for c in columns], divisor)
    for got, expected in zip(result, _numpy(counts, indices, values, columns, divisor, dtype)):
        np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.parametrize("path", ["tensorflow", "gpu"])
@pytest.mark.parametrize("dtype", ["float16", BFLOAT16])
@pytest.mark.parametrize("rows,divisor", [(3, 3), (5, 5)])
def test_16_bit_values_are_summed_rank_by_rank_in_their_own_precision(monkeypatch, path, dtype,
                                                                     rows, divisor):
    """16-bit values take the TensorFlow path (the native kernel is float32/64): each addition
    rounds to 16 bits, in rank order, exactly as NumPy does it."""
    _use(monkeypatch, path)
    counts, indices, values = _gathered(rows, dtype, seed=3)
    columns = [0, 1, 2]
    group_values = [values[r * len(SIZES) + c] for r in range(rows) for c in columns]
    result = average_entries(tf.constant(np.concatenate(indices)),
                             tf.constant(np.concatenate(group_values)), tf.constant(counts),
                             columns, SIZES, divisor)
    for got, expected in zip(result, _numpy(counts, indices, values, columns, divisor, dtype)):
        np.testing.assert_array_equal(got.numpy().astype(np.float32), expected.astype(np.float32))


@pytest.mark.parametrize("path", ["tensorflow", "gpu"])
def test_the_rank_by_rank_sum_adds_in_rank_order_not_by_magnitude(monkeypatch, path):
    """A case where the order of additions shows in the bits: 1e8 + 1 - 1e8 is 0 in float32
    (1 is lost against 1e8), but 1 when the large values meet first."""
    _use(monkeypatch, path)
    values = tf.constant([1e8, 1.0, -1e8], tf.float32)
    places = tf.constant([0, 0, 0], tf.int32)
    total = averaging_module.sum_rank_by_rank(values, places, tf.constant([1, 1, 1]), 2)
    assert total.numpy().tolist() == [0.0, 0.0]
    total = averaging_module.sum_rank_by_rank(tf.constant([1e8, -1e8, 1.0]), places,
                                              tf.constant([1, 1, 1]), 2)
    assert total.numpy().tolist() == [1.0, 0.0]


@pytest.mark.parametrize("rows_known", [True, False])
@pytest.mark.parametrize("unrolled_up_to", [64, 1])
def test_rows_are_summed_in_rank_order(monkeypatch, rows_known, unrolled_up_to):
    """Written out op by op (a known number of rows, up to UNROLLED_RANKS) or as a loop: the
    same order, so the same bits (1e8 + 1 - 1e8 is 0 in float32, 1e8 - 1e8 + 1 would be 1)."""
    monkeypatch.setattr(averaging_module, "UNROLLED_RANKS", unrolled_up_to)
    rows = np.array([[1e8, 3.0], [1.0, 0.5], [-1e8, 0.25]], np.float32)
    expected = np.zeros(2, np.float32)
    for row in rows:
        expected = expected + row
    assert expected[0] == 0.0
    shape = [3, 2] if rows_known else [None, 2]
    summed = tf.function(averaging_module.sum_rows_in_order,
                         input_signature=[tf.TensorSpec(shape, tf.float32)])
    np.testing.assert_array_equal(summed(tf.constant(rows)).numpy(), expected)


@pytest.mark.parametrize("path", ["tensorflow", "gpu"])
def test_without_the_kernel_an_index_outside_the_variables_is_an_error(monkeypatch, path):
    """The TensorFlow paths: a negative index (what an overflowing int32 index would become) is
    an error, never silently dropped."""
    _use(monkeypatch, path)
    with pytest.raises(tf.errors.InvalidArgumentError, match="index is outside its variable"):
        average_entries(tf.constant([1, -3], tf.int32), tf.constant([1.0, 2.0]),
                        tf.constant([[1, 1]]), [0, 1], [10, 33], 2)


@pytest.mark.parametrize("index", [40, -3])  # -3: what an overflowing int32 index becomes
def test_an_index_outside_its_variable_is_an_error_that_names_it(index):
    if kernels.scatter_mean() is None:
        pytest.skip("the native kernels are off in this run (SPARSE_HVD_NATIVE=0 or a GPU)")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=f"index {index} is outside variable 1 of 33"):
        average_entries(tf.constant([1, index], tf.int32), tf.constant([1.0, 2.0]),
                        tf.constant([[1, 1]]), [0, 1], [10, 33], 2)


def _native_only():
    if kernels.mean_at_positions() is None:
        pytest.skip("the native kernels are off in this run (SPARSE_HVD_NATIVE=0 or a GPU)")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("rows,divisor,ascending", [(3, 3, False), (1, 1, False), (4, 4, False),
                                                    (3, 3, True), (1, 1, True), (9, 9, True)])
def test_averages_at_positions_are_the_dense_averages_where_entries_arrived(
        dtype, rows, divisor, ascending):
    """The update cut's form of step 4: every position that received an entry once, with the
    bits of the dense average there; in the order it first arrived (rank by rank), or
    ascending where every rank's indices ascend (merged) and there are at most 8 ranks."""
    _native_only()
    counts, indices, values = _gathered(rows, dtype)
    if ascending:  # as a magnitude cut sends them
        orders = [np.argsort(run) for run in indices]
        indices = [run[order] for run, order in zip(indices, orders)]
        values = [run[order] for run, order in zip(values, orders)]
    columns = [0, 2]
    group_values = [values[r * len(SIZES) + c] for r in range(rows) for c in columns]
    result = averaging_module.average_at_positions(
        tf.constant(np.concatenate(indices)), tf.constant(np.concatenate(group_values)),
        tf.constant(counts), columns, [SIZES[c] for c in columns], divisor)
    dense = _numpy(counts, indices, values, columns, divisor, dtype)
    for column, got, expected in zip(columns, result, dense):
        arrived = [i for r in range(rows) for i in indices[r * len(SIZES) + column]]
        first_seen = list(dict.fromkeys(int(i) for i in arrived))
        if ascending and rows <= 8:
            first_seen = sorted(first_seen)
        assert got.indices.numpy().tolist() == first_seen
        assert got.values.dtype == dtype and got.dense_shape.numpy().tolist() == [SIZES[column]]
        np.testing.assert_array_equal(got.values.numpy(), expected[first_seen])
        np.testing.assert_array_equal(tf.convert_to_tensor(got).numpy(), expected)


def test_a_negative_zero_sum_at_a_position_is_a_positive_zero_as_in_the_dense_average():
    """0 + (-0.0) is +0.0: the dense average starts from zeros, and so does each position's
    sum here; a weight of -0.0 less +0.0 stays -0.0 either way."""
    _native_only()
    result = averaging_module.average_at_positions(
        tf.constant([3, 3], tf.int32), tf.constant([-0.0, -0.0]), tf.constant([[1], [1]]),
        [0], [5], 2)[0]
    dense = average_entries(tf.constant([3, 3], tf.int32), tf.constant([-0.0, -0.0]),
                            tf.constant([[1], [1]]), [0], [5], 2)[0]
    assert result.indices.numpy().tolist() == [3]
    assert not np.signbit(result.values.numpy()[0]) and not np.signbit(dense.numpy()[3])


@pytest.mark.parametrize("index", [40, -3])
@pytest.mark.parametrize("after", [[], [2]])  # [2]: variable 1's run [index, 2] (both paths)
def test_an_index_outside_its_variable_at_positions_is_an_error_that_names_it(index, after):
    _native_only()
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=f"index {index} is outside variable 1 of 33"):
        averaging_module.average_at_positions(
            tf.constant([1, index] + after, tf.int32), tf.constant([1.0, 2.0] + [3.0] * len(after)),
            tf.constant([[1, 1 + len(after)]]), [0, 1], [10, 33], 2)


def test_without_the_kernel_there_are_no_averages_at_positions(monkeypatch):
    """The TensorFlow paths (16-bit values, a GPU, no kernels) keep the dense averages."""
    assert averaging_module.average_at_positions(
        tf.constant([1], tf.int32), tf.constant([1.0], tf.float16), tf.constant([[1]]), [0],
        [10], 2) is None
    monkeypatch.setattr(averaging_module.kernels, "mean_at_positions", lambda: None)
    assert averaging_module.average_at_positions(
        tf.constant([1], tf.int32), tf.constant([1.0]), tf.constant([[1]]), [0], [10], 2) is None
