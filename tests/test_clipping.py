"""clipping="local": each rank clips its own gradient before error feedback (DGC), and the
inner optimizer does not clip the average again. Against Keras and NumPy, one process."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from helpers import numpy_topk_indices

SHAPE = (40, 30)


def _gradients(steps):
    """A persistent direction plus noise, as successive real gradients are."""
    rng = np.random.RandomState(4)
    direction = rng.randn(*SHAPE)
    return [(3 * (direction + 0.3 * rng.randn(*SHAPE))).astype("float32") for _ in range(steps)]


@pytest.mark.parametrize("option", [dict(clipnorm=0.5), dict(global_clipnorm=0.7),
                                     dict(clipvalue=0.1)])
def test_one_worker_at_density_one_is_keras_clipping(option):
    weights = []
    for wrap in (False, True):
        variable = keras.Variable(np.ones(SHAPE, "float32"))
        optimizer = keras.optimizers.SGD(0.1, **option)
        if wrap:
            optimizer = sparse_hvd.SparseDistributedOptimizer(optimizer, density=1.0,
                                                              min_elements=0, clipping="local")
        for grad in _gradients(3):
            optimizer.apply([tf.constant(grad)], [variable])
        weights.append(variable.numpy())
    np.testing.assert_allclose(weights[1], weights[0], rtol=1e-6, atol=1e-7)
    assert getattr(optimizer, list(option)[0]) == list(option.values())[0]  # still configured


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_the_gradient_is_clipped_before_the_residual_and_the_average_is_not(mode):
    """NumPy: c = clip(g) + residual, top-k sent, the rest kept; the weights move by exactly
    lr x sent (unclipped, although its norm exceeds clipnorm by the second step)."""
    clipnorm, k, lr = 0.5, 30, 0.1
    variable = keras.Variable(np.ones(SHAPE, "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(lr, clipnorm=clipnorm), density=k / np.prod(SHAPE),
        warmup_steps=0, clipping="local")
    step = lambda g: optimizer.apply([g], [variable])  # noqa: E731
    step = tf.function(step) if mode == "function" else step
    weights, residual = np.ones(SHAPE, np.float32).ravel(), np.zeros(np.prod(SHAPE), np.float32)
    sent_norms = []
    for grad in _gradients(12):
        step(tf.constant(grad))
        g = grad.ravel()
        g = g * min(1.0, clipnorm / np.linalg.norm(g.astype(np.float64)))
        compensated = g.astype(np.float32) + residual
        chosen = numpy_topk_indices(compensated, k)
        sent = np.zeros_like(compensated)
        sent[chosen] = compensated[chosen]
        residual = compensated - sent
        weights = weights - np.float32(lr) * sent
        sent_norms.append(np.linalg.norm(sent))
    assert max(sent_norms) > clipnorm  # the inner optimizer would have clipped this
    np.testing.assert_allclose(variable.numpy().ravel(), weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(optimizer.residuals[0].numpy().ravel(), residual, rtol=1e-5,
                               atol=1e-6)


def test_clipping_is_checked_and_serialised():
    with pytest.raises(ValueError, match="`clipping` must be one of \\('after', 'local'\\), got 'before'"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), clipping="before")
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1, clipnorm=1.0),
                                                      clipping="local")
    again = sparse_hvd.SparseDistributedOptimizer.from_config(optimizer.get_config())
    assert again.clipping == "local" and again.inner_optimizer.clipnorm == 1.0
