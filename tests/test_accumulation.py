"""backward_passes_per_step: B passes accumulated locally, one exchange and one inner step,
against a NumPy re-computation and, at density 1.0, against Keras' own accumulation."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd

SHAPE = (50, 40)  # 2000 entries: the sparse route


def _gradients(count, seed=1):
    rng = np.random.RandomState(seed)
    return [rng.randn(*SHAPE).astype("float32") for _ in range(count)]


def _numpy_topk_step(weights, residual, total, k, lr):
    """One exchange of one rank: compensate, keep the k largest magnitudes, SGD."""
    compensated = (total + residual).reshape(-1)
    chosen = np.argsort(-np.abs(compensated), kind="stable")[:k]
    sent = np.zeros_like(compensated)
    sent[chosen] = compensated[chosen]
    residual = (compensated - sent).reshape(SHAPE)
    weights = weights - (sent.reshape(SHAPE) * np.float32(lr))
    return weights, residual


@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("passes", [2, 3])
@pytest.mark.parametrize("traced", [False, True])
def test_accumulated_passes_are_one_topk_exchange_and_one_step(passes, average, traced):
    grads = _gradients(2 * passes + 1)  # two exchanges and one pass left over
    initial = np.random.RandomState(0).randn(*SHAPE).astype("float32")
    variable = keras.Variable(initial.copy())
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.1), density=0.05, backward_passes_per_step=passes,
        average_aggregated_gradients=average)
    apply = optimizer.apply
    if traced:
        apply = tf.function(lambda g: optimizer.apply([g], [variable]))
        for grad in grads:
            apply(tf.constant(grad))
    else:
        for grad in grads:
            optimizer.apply([tf.constant(grad)], [variable])

    weights, residual = initial.copy(), np.zeros(SHAPE, np.float32)
    for first in (0, passes):
        total = np.zeros(SHAPE, np.float32)
        for grad in grads[first:first + passes]:
            total = total + grad
        if average and traced:  # in a graph TensorFlow turns x / constant into x * (1 / constant)
            total = total * np.float32(1 / passes)
        elif average:
            total = total / np.float32(passes)
        weights, residual = _numpy_topk_step(weights, residual, total, k=100, lr=0.1)
    np.testing.assert_array_equal(variable.numpy(), weights)
    np.testing.assert_array_equal(optimizer.residuals[0].numpy(), residual)
    np.testing.assert_array_equal(optimizer.local_variables[-1].numpy(), grads[-1])  # left over
    assert int(optimizer.iterations.numpy()) == 2
    stats = optimizer.communication_stats()
    assert stats["steps"] == 2  # exchanges: bytes per sample drop B-fold
    assert stats["bytes_sent"] == 2 * 100 * 8


@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_at_density_one_it_is_keras_accumulation(name):
    passes = 3
    grads = _gradients(2 * passes)
    results = []
    for wrap in (False, True):
        variable = keras.Variable(np.ones(SHAPE, "float32"))
        if wrap:
            optimizer = sparse_hvd.SparseDistributedOptimizer(
                getattr(keras.optimizers, name)(0.05), density=1.0, backward_passes_per_step=passes,
                average_aggregated_gradients=True)
        else:
            optimizer = getattr(keras.optimizers, name)(0.05, gradient_accumulation_steps=passes)
        for grad in grads:
            optimizer.apply([tf.constant(grad)], [variable])
        results.append(variable.numpy())
    np.testing.assert_array_equal(results[1], results[0])


def test_a_non_finite_pass_skips_its_step_and_the_residuals_never_see_it():
    grads = _gradients(4)
    grads[1][3, 4] = np.nan
    variable = keras.Variable(np.ones(SHAPE, "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), density=0.05,
                                                      backward_passes_per_step=2)
    for grad in grads:
        optimizer.apply([tf.constant(grad)], [variable])
    weights, residual = _numpy_topk_step(np.ones(SHAPE, np.float32), np.zeros(SHAPE, np.float32),
                                         grads[2] + grads[3], k=100, lr=0.1)
    np.testing.assert_array_equal(variable.numpy(), weights)
    np.testing.assert_array_equal(optimizer.residuals[0].numpy(), residual)
    assert optimizer.communication_stats()["skipped_steps"] == 1


def test_settings_are_checked_and_serialised():
    with pytest.raises(ValueError, match="`backward_passes_per_step` must be an int >= 1, got 0"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=0)
    with pytest.raises(TypeError, match="`average_aggregated_gradients` must be True or False"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1),
                                              average_aggregated_gradients="yes")
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=4,
                                                      average_aggregated_gradients=True)
    clone = sparse_hvd.SparseDistributedOptimizer.from_config(optimizer.get_config())
    assert (clone.backward_passes_per_step, clone.average_aggregated_gradients) == (4, True)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_with_staleness_the_accumulated_sums_go_through_the_delayed_pipeline(mode):
    """backward_passes_per_step=2 with staleness=1: the same weights and residuals, bit for
    bit, as staleness=1 fed with each pair's sum (the pipeline sees one exchange per 2 passes,
    and the inner optimizer steps once per exchange, one exchange late)."""
    grads = _gradients(8)
    results = []
    for passes, fed in ((2, grads), (1, [grads[i] + grads[i + 1] for i in range(0, 8, 2)])):
        variable = keras.Variable(np.ones(SHAPE, "float32"))
        optimizer = sparse_hvd.SparseDistributedOptimizer(
            keras.optimizers.SGD(0.1), density=0.05, warmup_steps=0, staleness=1,
            backward_passes_per_step=passes)
        step = lambda g: optimizer.apply([g], [variable])  # noqa: E731
        step = tf.function(step) if mode == "function" else step
        for grad in fed:
            step(tf.constant(grad))
        assert optimizer.communication_stats()["steps"] == 4
        assert int(optimizer.iterations.numpy()) == 3  # the first exchange is still in flight
        results.append((variable.numpy(), optimizer.residuals[0].numpy()))
    for got, expected in zip(*results):
        np.testing.assert_array_equal(got, expected)
