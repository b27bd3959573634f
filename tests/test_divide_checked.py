"""The dense allreduce's native divide-and-check (kernels/divide_checked.cc) against NumPy."""

import numpy as np
import pytest
import tensorflow as tf

from helpers import native_op
from sparse_hvd import kernels


@pytest.fixture
def divide():
    return native_op(kernels.divide_checked)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("workers", [1, 2, 3, 4, 7])
def test_each_average_is_the_correctly_rounded_quotient(divide, dtype, workers):
    """NumPy's division of two floats is IEEE's, correctly rounded: the same bits, for tensors
    of several shapes (more than one shard of 64K entries among them)."""
    rng = np.random.RandomState(workers)
    sums = [rng.randn(*shape).astype(dtype) * 10.0 ** rng.randint(-30, 30, shape).astype(dtype)
            for shape in [(300, 700), (5,), (1,), (2, 3, 4)]]
    averages, finite = divide([tf.constant(s) for s in sums], tf.constant(workers, dtype))
    assert bool(finite)
    for got, total in zip(averages, sums):
        want = total / np.array(workers, dtype)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got.numpy().view(f"u{want.itemsize}"),
                                      want.view(f"u{want.itemsize}"))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 65_535, 65_536, 199_999])
def test_one_non_finite_sum_anywhere_makes_it_not_finite(divide, bad, where):
    sums = np.ones(200_000, np.float32)
    sums[where] = bad
    averages, finite = divide([tf.constant(np.ones(3, np.float32)), tf.constant(sums)],
                               tf.constant(2.0))
    assert not bool(finite)
    np.testing.assert_array_equal(averages[1].numpy()[where], np.float32(bad) / 2)


def test_huge_finite_sums_stay_finite(divide):
    """Unlike a sum over the averages, which overflows, every entry here is finite."""
    sums = np.full(1000, np.finfo(np.float32).max, np.float32)
    _, finite = divide([tf.constant(sums)], tf.constant(2.0))
    assert bool(finite)


def test_a_divisor_below_one_is_refused(divide):
    with pytest.raises(tf.errors.InvalidArgumentError, match="divisor must be 1 or more"):
        divide([tf.constant([1.0])], tf.constant(0.0))
