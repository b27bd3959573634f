"""The update cut's native local step (``sparse_hvd.feedback.fused_step``,
``kernels/local_step.cc``) against Keras' own step on the same optimizer: the same updates,
optimizer state and q, bit for bit, step after step; and Keras' path wherever the native step
would not be Keras' step."""

from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from helpers import native_op
from sparse_hvd import kernels
from sparse_hvd.feedback import application, fused_step, local_update

SHAPES = {"kernel": (400, 100), "bias": (100,)}  # 40,000 entries: two of the op's shards
STEPS = 4


def _optimizers():
    schedule = keras.optimizers.schedules.ExponentialDecay(3e-3, decay_steps=2, decay_rate=0.5)
    adamw = keras.optimizers.AdamW(schedule, weight_decay=0.1, beta_1=0.8, epsilon=1e-6)
    adamw.exclude_from_weight_decay(var_names=["bias"])
    return {
        "adam": lambda: keras.optimizers.Adam(1e-3),
        "adamw_schedule_excluded_bias": lambda: adamw,
        "adam_weight_decay": lambda: keras.optimizers.Adam(2e-3, weight_decay=0.05),
        "sgd": lambda: keras.optimizers.SGD(0.05),
        "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
        "sgd_nesterov_decay_schedule": lambda: keras.optimizers.SGD(
            keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=2, decay_rate=0.5),
            momentum=0.8, nesterov=True, weight_decay=0.01),
    }


def _state(inner):
    """The inner optimizer's floating-point state (moments, velocities), in order."""
    return [v.numpy() for v in inner.variables
            if v is not inner.iterations and "learning_rate" not in v.path]


def _run(inner, second_moment, workers, native):
    """STEPS local steps (step count moved between them, as an applied step would):
    [(updates, state, q)] a step, the weights checked untouched, and how many native
    calls."""
    rng = np.random.RandomState(5)
    variables = [keras.Variable(rng.randn(*shape).astype("float32"), name=name)
                 for name, shape in SHAPES.items()]
    start = [v.numpy().copy() for v in variables]
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        inner, density=0.05, warmup_steps=0, sparsify="update", exchange="allgather",
        second_moment=second_moment, name=f"fused_{native}")
    optimizer.build(variables)
    adam = optimizer.inner_optimizer
    calls = []

    def counted(real):
        def getter():
            op = real() if native else None
            if op is not None:
                calls.append(1)
            return op
        return getter

    records = []
    with mock.patch.object(kernels, "local_adam", counted(kernels.local_adam)), \
            mock.patch.object(kernels, "local_sgd", counted(kernels.local_sgd)), \
            mock.patch.object(local_update.runtime, "size", lambda process_set=None: workers):
        for _ in range(STEPS):
            grads = [tf.constant(rng.randn(*v.shape).astype("float32")) for v in variables]
            updates = local_update.local_updates(optimizer, grads, variables,
                                                 application.own_step)
            adam.iterations.assign_add(1)
            for variable, value in zip(variables, start):
                np.testing.assert_array_equal(variable.numpy(), value)
            records.append(([u.numpy() for u in updates], _state(adam),
                            [q.numpy() for q in optimizer._second_moment.variables]))
    return records, len(calls)


@pytest.mark.parametrize("workers", [1, 4])
@pytest.mark.parametrize("kind,second_moment", [
    (kind, second_moment) for kind in sorted(_optimizers())
    for second_moment in (("own",) if kind.startswith("sgd") else ("own", "noise_estimate"))])
def test_the_native_local_step_is_keras_step_bit_for_bit(kind, second_moment, workers):
    """Adam, AdamW with a schedule and a variable excluded from the decay, Adam with a
    weight decay; no correction and the noise estimate (at 4 workers, the decay kept out
    of it); SGD without and with momentum, Nesterov with a decay and a schedule: every
    update, moment, velocity and q equal to Keras' path's, each of 4 steps."""
    native_op(kernels.local_adam)
    made = _optimizers()[kind]
    fused, calls = _run(made(), second_moment, workers, native=True)
    assert calls > 0  # the native step ran
    keras_path, none = _run(_optimizers()[kind](), second_moment, workers, native=False)
    assert none == 0
    for step, (ours, theirs) in enumerate(zip(fused, keras_path)):
        for part, (a, b) in enumerate(zip(ours, theirs)):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y, err_msg=f"step {step}, part {part}")
        assert any(np.any(u != 0) for u in ours[0])


@pytest.mark.parametrize("make,why", [
    (lambda: keras.optimizers.Adam(1e-3, amsgrad=True), "amsgrad"),
    (lambda: keras.optimizers.Adam(1e-3, clipnorm=1.0), "its own clipping"),
    (lambda: keras.optimizers.Adam(1e-3, loss_scale_factor=8.0), "a loss-scale factor"),
    (lambda: type("MyAdam", (keras.optimizers.Adam,), {})(1e-3), "a subclass"),
    (lambda: keras.optimizers.Lion(1e-3), "another optimizer"),
    (lambda: keras.optimizers.SGD(1e-3, momentum=0.9, global_clipnorm=1.0), "SGD clipping"),
    (lambda: type("MySGD", (keras.optimizers.SGD,), {})(1e-3), "an SGD subclass"),
])
def test_anything_but_a_plain_adam_takes_keras_path(make, why):
    variable = keras.Variable(np.ones((40, 50), "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        make(), density=0.05, warmup_steps=0, sparsify="update", exchange="allgather")
    optimizer.build([variable])
    adam = optimizer._loss_scaling.base_optimizer
    assert not fused_step.usable(optimizer, adam, [tf.ones((40, 50))], [variable], 1), why


def test_a_plain_adam_is_usable_and_not_with_the_mean_estimate_or_a_constraint():
    native_op(kernels.local_adam)
    variable = keras.Variable(np.ones((40, 50), "float32"))
    grads = [tf.ones((40, 50))]

    def usable(second_moment="noise_estimate", workers=2, target=variable):
        optimizer = sparse_hvd.SparseDistributedOptimizer(
            keras.optimizers.Adam(1e-3), density=0.05, warmup_steps=0, sparsify="update",
            exchange="allgather", second_moment=second_moment)
        optimizer.build([target])
        return fused_step.usable(optimizer, optimizer.inner_optimizer, grads, [target],
                                 workers)

    assert usable()
    assert usable("own")
    assert not usable("mean_estimate")
    assert usable("mean_estimate", workers=1)  # nothing is corrected with one worker
    constrained = keras.Variable(np.ones((40, 50), "float32"))
    constrained.constraint = keras.constraints.NonNeg()  # as a layer's add_weight sets it
    assert not usable(target=constrained)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("kind", ["adam", "sgd_momentum", "sgd_nesterov_decay_schedule"])
def test_a_non_finite_gradient_writes_no_state_and_hands_on_a_non_finite_update(kind, bad):
    """One entry of one gradient NaN or infinite: the pass says so (its ``finite``), the
    optimizer state is left as it was on every variable, and the updates handed on are
    non-finite at that entry (so the exchange skips the step); a finite gradient's pass says
    it is finite."""
    native_op(kernels.local_adam)
    rng = np.random.RandomState(2)
    variables = [keras.Variable(rng.randn(*shape).astype("float32"), name=name)
                 for name, shape in SHAPES.items()]
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        _optimizers()[kind](), density=0.05, warmup_steps=0, sparsify="update",
        exchange="allgather", second_moment="own")
    optimizer.build(variables)
    inner = optimizer.inner_optimizer
    warm = [tf.constant(rng.randn(*v.shape).astype("float32")) for v in variables]
    local_update.local_updates(optimizer, warm, variables, application.own_step)
    before = _state(inner)
    assert any(np.any(s != 0) for s in before)  # the first step wrote a state
    grads = [g.numpy().copy() for g in warm]
    grads[0][7, 3] = bad
    fused = fused_step.steps_if_usable(optimizer, inner, [tf.constant(g) for g in grads],
                                       variables, 1)
    assert not bool(fused.finite)
    updates = local_update.local_updates(optimizer, [tf.constant(g) for g in grads], variables,
                                         application.own_step)
    for kept, now in zip(before, _state(inner)):
        np.testing.assert_array_equal(kept, now)
    assert not np.isfinite(updates[0].numpy()[7, 3])
    assert np.all(np.isfinite(updates[1].numpy()))
    assert bool(fused_step.steps_if_usable(optimizer, inner, warm, variables, 1).finite)
