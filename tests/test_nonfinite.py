"""A NaN or infinite gradient is never written into a residual; the step is skipped or stops."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd

SHAPE = (50, 40)


def _setup(**kwargs):
    variable = keras.Variable(np.zeros(SHAPE, "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.5), density=0.01, **kwargs)
    step = tf.function(lambda g: optimizer.apply_gradients([(g, variable)]))
    return variable, optimizer, step


def _state(variable, optimizer):
    return [variable.numpy().copy()] + [v.numpy().copy() for v in optimizer.local_variables] + [
        int(optimizer.iterations)]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("momentum_correction", [0.0, 0.9])
def test_a_non_finite_step_is_skipped_and_leaves_every_state_unchanged(bad, momentum_correction):
    variable, optimizer, step = _setup(momentum_correction=momentum_correction)
    rng = np.random.RandomState(0)
    step(tf.constant(rng.randn(*SHAPE).astype("float32")))
    before = _state(variable, optimizer)
    poisoned = rng.randn(*SHAPE).astype("float32")
    poisoned[3, 7] = bad
    step(tf.constant(poisoned))
    after = _state(variable, optimizer)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert optimizer.communication_stats()["skipped_steps"] == 1
    step(tf.constant(rng.randn(*SHAPE).astype("float32")))  # training goes on
    assert int(optimizer.iterations) == 2
    assert all(np.all(np.isfinite(v)) for v in _state(variable, optimizer)[:-1])


def test_raise_stops_with_a_message():
    variable, optimizer, step = _setup(nonfinite="raise")
    with pytest.raises(tf.errors.InvalidArgumentError, match="non-finite"):
        step(tf.constant(np.full(SHAPE, np.nan, "float32")))


def test_ignore_lets_nan_into_the_residual():
    variable, optimizer, step = _setup(nonfinite="ignore")
    grad = np.zeros(SHAPE, "float32")
    grad[0, 0] = np.nan
    step(tf.constant(grad))
    assert np.isnan(optimizer.residuals[0].numpy()).any() or np.isnan(variable.numpy()).any()


def test_nonfinite_choice_is_checked():
    with pytest.raises(ValueError, match="`nonfinite` must be one of"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), nonfinite="stop")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_16_bit_gradient_whose_sum_passes_the_format_is_not_skipped(dtype):
    """The finiteness check is one sum per gradient; a float16 sum overflows at 65,504, which
    100,000 entries of 1.0 pass with no entry infinite: summed in float32, it is applied."""
    from sparse_hvd.feedback.nonfinite import all_finite

    ones = tf.ones([100_000], dtype)
    assert not bool(tf.math.is_finite(tf.reduce_sum(tf.ones([100_000], "float16"))))
    assert bool(all_finite(ones))
    assert not bool(all_finite(tf.concat([ones, tf.constant([np.nan], dtype)], 0)))
    assert not bool(all_finite(tf.concat([ones, tf.constant([-np.inf], dtype)], 0)))
    for density, sent in ((1.0, 100_000), (0.01, 1_000)):  # dense route, then sparse
        variable = keras.Variable(np.zeros([100_000], dtype), dtype=dtype)
        optimizer = sparse_hvd.SparseDistributedOptimizer(
            keras.optimizers.SGD(0.5), density=density, warmup_steps=0)
        optimizer.apply_gradients([(ones, variable)])
        assert optimizer.communication_stats()["skipped_steps"] == 0
        moved = variable.numpy().astype("float32")
        assert np.count_nonzero(moved) == sent and set(moved[moved != 0]) == {-0.5}
