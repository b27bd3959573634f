"""Error feedback's native add-at-indices (kernels/add_at.cc) against NumPy: the same bits as
one addition per entry, the input left alone whenever something else still reads it, and
bad indices refused by name."""

import numpy as np
import pytest
import tensorflow as tf

from helpers import native_op
from sparse_hvd import kernels


@pytest.fixture
def add_at():
    return native_op(kernels.add_at)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_each_entry_gets_one_ieee_addition_in_a_forwarded_buffer(add_at, dtype, index_dtype):
    rng = np.random.RandomState(0)
    n = 200_000
    base = rng.randn(n).astype(dtype) * 10.0 ** rng.randint(-20, 20, n).astype(dtype)
    indices = rng.choice(n, 3000, replace=False).astype(index_dtype)
    values = rng.randn(3000).astype(dtype) * 1e-3
    want = base.copy()
    want[indices] += values  # distinct indices: one rounded addition each

    @tf.function
    def made_here(delta):  # the buffer is this function's own: the op may take it over
        return add_at(tf.constant(base) + delta, tf.constant(indices), tf.constant(values))

    got = made_here(tf.constant(0, dtype)).numpy()
    np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{got.itemsize}"))


def test_an_input_that_is_read_afterwards_is_left_as_it_was(add_at):
    flat = tf.Variable(np.arange(10, dtype=np.float32))

    @tf.function
    def both():
        before = flat.read_value() * 1.0
        after = add_at(before, tf.constant([1, 9]), tf.constant([100.0, 1000.0]))
        return before + 0.0, after

    before, after = both()
    np.testing.assert_array_equal(before.numpy(), np.arange(10))
    np.testing.assert_array_equal(after.numpy(), np.arange(10) + [0, 100, 0, 0, 0, 0, 0, 0, 0, 1000])


def test_repeated_indices_add_in_order(add_at):
    out = add_at(tf.constant([1.0, 0.0]), tf.constant([0, 0, 0]), tf.constant([1e8, -1e8, 1.0]))
    f = np.float32  # in float32, 1 + 1e8 rounds to 1e8: the order shows in the result
    want = ((f(1.0) + f(1e8)) + f(-1e8)) + f(1.0)
    assert want == 1.0 and want != f(1.0) + (f(1e8) + f(-1e8)) + f(1.0)
    np.testing.assert_array_equal(out.numpy(), [want, 0.0])


@pytest.mark.parametrize("index", [-1, 5])
def test_an_index_outside_the_tensor_is_refused_naming_it(add_at, index):
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"indices\[1\] = {index} is not in "
                                                             r"\[0, 5\)"):
        add_at(tf.zeros([5]), tf.constant([0, index]), tf.constant([1.0, 2.0]))
