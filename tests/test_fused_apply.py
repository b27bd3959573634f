"""The inner SGD's and Adam's fused step on averaged gradients (``feedback.fused_apply``)
against Keras' own ``apply`` of the same optimizer: the same weights, velocities, moving
averages and step count, bit for bit, step after step; and Keras' path wherever the fused op
would not be Keras' step."""

from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from helpers import native_op
from sparse_hvd import kernels
from sparse_hvd.feedback import application, fused_apply

SHAPES = {"kernel": (300, 70), "bias": (70,)}
STEPS = 4


def _optimizers():
    def decayed_nesterov():
        schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=2,
                                                               decay_rate=0.5)
        sgd = keras.optimizers.SGD(schedule, momentum=0.8, nesterov=True, weight_decay=0.01)
        sgd.exclude_from_weight_decay(var_names=["bias"])
        return sgd

    return {
        "plain": lambda: keras.optimizers.SGD(0.05),
        "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
        "nesterov_decay_schedule_excluded_bias": decayed_nesterov,
        "momentum_ema": lambda: keras.optimizers.SGD(0.05, momentum=0.9, use_ema=True,
                                                      ema_momentum=0.5,
                                                      ema_overwrite_frequency=3),
        "local_clipping": lambda: keras.optimizers.SGD(0.05, momentum=0.9, clipnorm=0.5),
    }


def _adams():
    def adamw():
        schedule = keras.optimizers.schedules.ExponentialDecay(3e-3, decay_steps=2,
                                                               decay_rate=0.5)
        adam = keras.optimizers.AdamW(schedule, weight_decay=0.1, beta_1=0.8, epsilon=1e-6)
        adam.exclude_from_weight_decay(var_names=["bias"])
        return adam

    return {
        "adam": lambda: keras.optimizers.Adam(1e-2),
        "adamw_schedule_excluded_bias": adamw,
        "adam_weight_decay_ema": lambda: keras.optimizers.Adam(
            2e-2, weight_decay=0.05, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=3),
        "adam_local_clipping": lambda: keras.optimizers.Adam(1e-2, global_clipnorm=0.5),
    }


def _make(kind):
    return {**_optimizers(), **_adams()}[kind]()


def _variables(dtype, constrained):
    rng = np.random.RandomState(3)
    constraint = keras.constraints.MaxNorm(0.7) if constrained else None
    return [keras.Variable(rng.randn(*shape).astype(dtype), name=name,
                           constraint=constraint if name == "kernel" else None)
            for name, shape in SHAPES.items()]


def _run(kind, dtype="float32", constrained=False, fused=True):
    """STEPS steps of the inner optimizer on the same gradients: by the wrapper's
    ``inner_step`` (``fused``) or by Keras' ``apply``. Returns [(weights, state)] a step and
    how many fused variable steps ran."""
    variables = _variables(dtype, constrained)
    inner = _make(kind)
    clipping = "local" if kind.endswith("local_clipping") else "after"
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        inner, density=0.05, exchange="dense", clipping=clipping, name=f"fused_apply_{kind}")
    optimizer.build(variables)
    inner = optimizer.inner_optimizer
    fused_calls = []

    def counted(real):
        def call(*args):
            fused_calls.append(1)
            return real(*args)
        return call

    @tf.function
    def step(grads):
        if fused:
            application.inner_step(optimizer, grads, variables)
        else:
            with application._local_clipping_off(optimizer):
                inner.apply(grads, variables)

    rng = np.random.RandomState(11)
    records = []
    with mock.patch.object(fused_apply, "_sgd_step", counted(fused_apply._sgd_step)), \
            mock.patch.object(fused_apply, "_adam_steps", counted(fused_apply._adam_steps)):
        for _ in range(STEPS):
            step([tf.constant(rng.randn(*v.shape).astype(dtype)) for v in variables])
            records.append(([v.numpy() for v in variables],
                            [v.numpy() for v in inner.variables]))
    return records, len(fused_calls)


@pytest.mark.parametrize("constrained", [False, True])
@pytest.mark.parametrize("kind,dtype", [(kind, dtype) for kind in sorted(_optimizers())
                                        for dtype in ("float32", "float64")]
                         + [(kind, "float32") for kind in sorted(_adams())])
def test_the_fused_step_is_keras_step_bit_for_bit(kind, dtype, constrained):
    """SGD without momentum, with momentum, Nesterov with a weight decay (the bias excluded)
    and a schedule, with the weights' moving average overwriting them every 3 steps, with
    clipping turned off by ``clipping="local"``, in float32 and float64; Adam, AdamW with a
    schedule and the bias excluded from its decay, Adam with a decay and the moving average,
    Adam with clipping turned off, in float32; a constraint or none: every weight and every
    optimizer variable (velocities, moments, averages, the step count) equal to Keras'
    ``apply``'s after each of 4 steps, and the weights moved."""
    if kind in _adams():
        native_op(kernels.apply_adam)
    ours, calls = _run(kind, dtype, constrained, fused=True)
    # traced once: one fused step per SGD variable, one call for all of Adam's
    assert calls == (1 if kind in _adams() else len(SHAPES))
    theirs, none = _run(kind, dtype, constrained, fused=False)
    assert none == 0
    start = [v.numpy() for v in _variables(dtype, constrained)]
    for step, ((weights, state), (keras_weights, keras_state)) in enumerate(zip(ours, theirs)):
        for a, b in zip(weights + state, keras_weights + keras_state):
            np.testing.assert_array_equal(a, b, err_msg=f"step {step}")
    assert all(np.any(w != s) for w, s in zip(ours[-1][0], start))


@pytest.mark.parametrize("make,why", [
    (lambda: keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=1.0), "its own clipping"),
    (lambda: keras.optimizers.SGD(0.1, loss_scale_factor=8.0), "a loss-scale factor"),
    (lambda: type("MySGD", (keras.optimizers.SGD,), {})(0.1), "a subclass"),
    (lambda: keras.optimizers.Adam(1e-3, amsgrad=True), "AMSGrad"),
    (lambda: type("MyAdam", (keras.optimizers.Adam,), {})(1e-3), "an Adam subclass"),
    (lambda: keras.optimizers.Lion(1e-3), "another optimizer"),
])
def test_anything_but_a_plain_sgd_takes_keras_path(make, why):
    variable = keras.Variable(np.ones((40, 50), "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(make(), density=0.05, exchange="dense")
    optimizer.build([variable])
    inner = optimizer.inner_optimizer
    assert not fused_apply.usable(optimizer, inner, [tf.ones((40, 50))], [variable]), why
    assert not fused_apply.apply_if_usable(optimizer, [tf.ones((40, 50))], [variable])
    np.testing.assert_array_equal(variable.numpy(), 1.0)  # nothing written


def test_gradients_it_cannot_take_go_to_keras():
    """Rows of an embedding (IndexedSlices), a gradient of another dtype, a float16
    variable, a float64 one for Adam, a variable overwritten by its gradient: Keras' path;
    dense float32: fused."""
    variable = keras.Variable(np.ones((40, 50), "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), density=0.05, exchange="dense")
    optimizer.build([variable])
    inner = optimizer.inner_optimizer
    rows = tf.IndexedSlices(tf.ones((2, 50)), tf.constant([0, 3]), tf.constant([40, 50]))
    assert fused_apply.usable(optimizer, inner, [tf.ones((40, 50))], [variable])
    assert not fused_apply.usable(optimizer, inner, [rows], [variable])
    assert not fused_apply.usable(optimizer, inner, [tf.ones((40, 50), tf.float64)],
                                  [variable])
    half = keras.Variable(np.ones((4, 5), "float16"))
    assert not fused_apply.usable(optimizer, inner, [tf.ones((4, 5), tf.float16)], [half])
    double = keras.Variable(np.ones((4, 5), "float64"))
    adam = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.Adam(1e-3), density=0.05,
                                                 exchange="dense")
    adam.build([double])
    assert not fused_apply.usable(adam, adam.inner_optimizer, [tf.ones((4, 5), tf.float64)],
                                  [double])  # the native pass is float32 only
    variable.overwrite_with_gradient = True
    assert not fused_apply.usable(optimizer, inner, [tf.ones((40, 50))], [variable])


def _adam_state(n, seed=5):
    rng = np.random.RandomState(seed)
    return (rng.randn(n).astype("float32"), (0.1 * rng.randn(n)).astype("float32"),
            rng.rand(n).astype("float32"), rng.randn(n).astype("float32"))


@pytest.mark.parametrize("held", [False, True])
def test_the_in_place_adam_step_is_adams_formula_and_spares_a_held_read(held):
    """``SparseHvdApplyAdam`` on 70,007 entries (two whole shards and part of a third): the weights
    and both moments equal Adam's formula computed in float32 by NumPy in Keras' order, bit
    for bit; a read of the three variables taken before the step (``held``) keeps the
    values it had (the step copies a buffer a read still holds, never writes under it)."""
    apply_adam = native_op(kernels.apply_adam)
    n = 70_007
    weights, m, v, gradient = _adam_state(n)
    w_var, m_var, v_var = (tf.Variable(a) for a in (weights, m, v))
    reads = [x.read_value() for x in (w_var, m_var, v_var)] if held else []
    one_minus = (np.float32(1 - 0.9), np.float32(1 - 0.999))
    alpha, epsilon = np.float32(0.003), np.float32(1e-7)
    apply_adam(variable=w_var.handle, m=m_var.handle, v=v_var.handle,
               gradient=tf.constant(gradient.reshape(7, -1)),  # any shape of n entries
               coefficients=tf.constant([*one_minus, alpha, epsilon]))
    first = m + (gradient - m) * one_minus[0]
    second = v + (gradient * gradient - v) * one_minus[1]
    expected = weights - (first * alpha) / (np.sqrt(second) + epsilon)
    for got, want in zip((w_var, m_var, v_var), (expected, first, second)):
        assert got.numpy().dtype == np.float32
        np.testing.assert_array_equal(got.numpy(), want)
    for read, before in zip(reads, (weights, m, v)):
        np.testing.assert_array_equal(read.numpy(), before)


def test_the_in_place_adam_step_refuses_what_it_cannot_take_naming_it():
    """A variable or moment of another length or dtype, or coefficients of another count:
    refused, naming which, and nothing written."""
    apply_adam = native_op(kernels.apply_adam)
    weights, m, v, gradient = _adam_state(6)
    coefficients = tf.constant([0.1, 0.001, 0.01, 1e-7])

    def call(w_var, m_var, v_var, grad=gradient, k=coefficients):
        apply_adam(variable=w_var.handle, m=m_var.handle, v=v_var.handle,
                   gradient=tf.constant(grad), coefficients=k)

    w_var, m_var, v_var = (tf.Variable(a) for a in (weights, m, v))
    with pytest.raises(tf.errors.InvalidArgumentError, match="m has 5 entries, the gradient 6"):
        call(w_var, tf.Variable(m[:5]), v_var)
    with pytest.raises(tf.errors.InvalidArgumentError, match="v must be float32"):
        call(w_var, m_var, tf.Variable(v.astype("float64")))
    with pytest.raises(tf.errors.InvalidArgumentError, match="coefficients must hold 4 values"):
        call(w_var, m_var, v_var, k=tf.constant([0.1, 0.001, 0.01]))
    for variable, before in zip((w_var, m_var, v_var), (weights, m, v)):
        np.testing.assert_array_equal(variable.numpy(), before)
