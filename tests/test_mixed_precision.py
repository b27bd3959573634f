"""Mixed precision: loss scaling inside SparseDistributedOptimizer, decided on all ranks together."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from helpers import classification_data, numpy_topk_split, weights_of


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((20,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(5),
        keras.layers.Activation("linear", dtype="float32"),  # float32 logits, as Keras advises
    ])


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def test_density_one_equals_keras_loss_scaled_sgd_bit_for_bit(mixed_float16):
    x, y = classification_data(n=128)
    reference = _model()
    reference.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), _loss(),
                      jit_compile=False)
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)

    model = _model()
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), density=1.0)
    model.compile(optimizer, _loss(), jit_compile=False, auto_scale_loss=False)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)

    for a, b in zip(weights_of(reference), weights_of(model)):
        np.testing.assert_array_equal(a, b)
    assert float(optimizer.inner_optimizer.dynamic_scale.numpy()) == float(
        reference.optimizer.dynamic_scale.numpy())


def test_an_overflow_skips_the_step_lowers_the_scale_and_residuals_hold_true_gradients():
    start = np.ones((50, 40), "float32")
    variable = keras.Variable(start)
    inner = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=1024.0)
    optimizer = sparse_hvd.SparseDistributedOptimizer(inner, density=0.1)
    step = tf.function(lambda g: optimizer.apply_gradients([(g, variable)]))

    overflowed = np.full(start.shape, np.inf, "float32")
    step(tf.constant(overflowed))
    assert optimizer.communication_stats()["skipped_steps"] == 1
    assert float(inner.dynamic_scale.numpy()) == 512.0  # halved, as Keras' own skip does
    np.testing.assert_array_equal(variable.numpy(), start)
    assert not np.any(optimizer.residuals[0].numpy())

    scaled = np.random.RandomState(0).randn(*start.shape).astype("float32") * 512.0
    step(tf.constant(scaled))
    true = (scaled / np.float32(512.0)).ravel()
    _, sent, expected_residual = numpy_topk_split(true, 200)
    np.testing.assert_array_equal(optimizer.residuals[0].numpy().ravel(), expected_residual)
    np.testing.assert_array_equal(variable.numpy().ravel(), start.ravel() - sent)


def test_keras_automatic_loss_scaling_around_the_optimizer_is_refused(mixed_float16):
    x, y = classification_data(n=32)
    model = _model()
    model.compile(sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1)), _loss(),
                  jit_compile=False)  # Keras wraps it in a LossScaleOptimizer
    with pytest.raises(ValueError, match="auto_scale_loss=False"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
