"""average_entries (the exchange's step 4): native kernel and TensorFlow ops, against NumPy."""

import numpy as np
import pytest
import tensorflow as tf

from sparse_hvd import kernels
from sparse_hvd import averaging as averaging_module
from sparse_hvd.averaging import average_entries

SIZES = [1000, 70000, 33]


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
            values.append(rng.randn(counts[r, v]).astype(dtype))
    return counts, indices, values


def _numpy(counts, indices, values, columns, divisor, dtype):
    rows, variables = counts.shape
    totals = {c: np.zeros(SIZES[c], dtype) for c in columns}
    for r in range(rows):
        for v in range(variables):
            if v in totals:
                totals[v][indices[r * variables + v]] += values[r * variables + v]
    return [totals[c] / np.asarray(divisor, dtype) for c in columns]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("rows,divisor", [(3, 3), (1, 1), (4, 4)])
def test_average_entries_is_the_rank_order_sum_divided(monkeypatch, native, dtype, rows, divisor):
    if native and kernels.scatter_mean() is None:
        pytest.skip("the native kernels are not built here (scripts/setup.sh builds them)")
    if not native:
        monkeypatch.setattr(averaging_module.kernels, "scatter_mean", lambda: None)
    counts, indices, values = _gathered(rows, dtype)
    columns = [0, 2]  # variable 1 has another dtype: its values are not in this call
    group_values = [values[r * len(SIZES) + c] for r in range(rows) for c in columns]
    result = average_entries(tf.constant(np.concatenate(indices)), tf.constant(np.concatenate(group_values)),
                             tf.constant(counts), columns, [SIZES[c] for c in columns], divisor)
    for got, expected in zip(result, _numpy(counts, indices, values, columns, divisor, dtype)):
        np.testing.assert_array_equal(got.numpy(), expected)


def test_an_index_outside_its_variable_is_an_error_that_names_it():
    if kernels.scatter_mean() is None:
        pytest.skip("the native kernels are not built here")
    with pytest.raises(tf.errors.InvalidArgumentError, match="index 40 is outside variable 1 of 33"):
        average_entries(tf.constant([1, 40], tf.int32), tf.constant([1.0, 2.0]),
                        tf.constant([[1, 1]]), [0, 1], [10, 33], 2)
