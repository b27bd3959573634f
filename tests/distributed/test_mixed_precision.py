"""Loss scaling across ranks: an overflow on one rank lowers the scale on every rank."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from conftest import digest, gather


@pytest.mark.parametrize("exchange", ["allgather", "sparse_allreduce"])
def test_an_overflow_on_the_last_rank_skips_the_step_and_halves_the_scale_everywhere(hvd, exchange):
    rank, size = hvd.rank(), hvd.size()
    variable = keras.Variable(np.ones((50, 40), "float32"))
    inner = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=256.0)
    optimizer = sparse_hvd.SparseDistributedOptimizer(inner, density=0.1, exchange=exchange,
                                                      name=f"mixed_overflow_{exchange}")
    optimizer.build([variable])
    step = tf.function(lambda g: optimizer.apply_gradients([(g, variable)]))

    for t in range(4):
        grad = np.random.RandomState(10 * t + rank).randn(50, 40).astype("float32")
        if t == 1 and rank == size - 1:
            grad[3, 4] = np.inf  # only this rank overflows
        step(tf.constant(grad * float(inner.dynamic_scale.numpy())))

    assert optimizer.communication_stats()["skipped_steps"] == 1
    assert float(inner.dynamic_scale.numpy()) == 128.0
    assert inner.iterations.numpy() == 3
    mine = digest([variable.numpy(), inner.dynamic_scale.numpy()])
    assert set(gather(hvd, mine, name=f"mixed_overflow.digest.{exchange}")) == {mine}
    assert np.all(np.isfinite(optimizer.residuals[0].numpy()))


def _expected_scales(initial, growth_steps, overflow_at, steps):
    """Keras' rule, once per step of the job: an overflow on any rank halves the scale and
    restarts the count; the growth_steps-th finite step in a row doubles it. Returns the scale
    after each step and the count after the last."""
    scale, counter, scales = initial, 0, []
    for t in range(steps):
        if t in overflow_at:
            scale, counter = scale / 2, 0
        elif counter == growth_steps - 1:
            scale, counter = scale * 2, 0
        else:
            counter += 1
        scales.append(scale)
    return scales, counter


@pytest.mark.parametrize("with_dense_route", [True, False])
def test_under_the_update_cut_the_scale_moves_once_a_step_and_alike_on_every_rank(
        hvd, with_dense_route):
    """With ``sparsify="update"`` each rank steps the inner optimizer on its own gradient
    first; that local step must not count toward the scale's growth (else a step with
    variables sent whole counts twice, and at a growth step an overflow on one rank leaves
    the ranks with different scales)."""
    rank, size = hvd.rank(), hvd.size()
    shapes = [(50, 40), (10,)] if with_dense_route else [(50, 40)]  # (10,): sent whole
    variables = [keras.Variable(np.full(s, 0.5, "float32")) for s in shapes]
    inner = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.01, momentum=0.9), initial_scale=256.0, dynamic_growth_steps=2)
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        inner, density=0.1, warmup_steps=0, exchange="allgather",
        name=f"mixed_update_{with_dense_route}")
    assert optimizer.sparsify == "update"
    optimizer.build(variables)
    step = tf.function(lambda gs: optimizer.apply_gradients(zip(gs, variables)))

    steps, overflow_at = 6, {3}  # step 3 is a growth step: the count is 1 before it
    expected, counter = _expected_scales(256.0, 2, overflow_at, steps)
    for t in range(steps):
        grads = [np.random.RandomState(10 * t + rank).randn(*s).astype("float32")
                 for s in shapes]
        if t in overflow_at and rank == size - 1:
            grads[0][3, 4] = np.inf  # only the last rank overflows
        scale = float(inner.dynamic_scale.numpy())
        step([tf.constant(g * scale) for g in grads])
        assert float(inner.dynamic_scale.numpy()) == expected[t], (t, rank)

    assert inner.iterations.numpy() == steps - len(overflow_at)
    assert inner.step_counter.numpy() == counter
    mine = digest([v.numpy() for v in variables] + [inner.dynamic_scale.numpy(),
                                                    inner.step_counter.numpy()])
    assert set(gather(hvd, mine, name=f"mixed_update.digest.{with_dense_route}")) == {mine}


def test_adamw_inside_a_loss_scale_optimizer_takes_the_noise_estimate_on_every_rank(hvd):
    """The signs with a LossScaleOptimizer around AdamW: the noise estimate acts on the AdamW
    inside (its decay, read at the inner rate, kept out of the correction: the closed form is
    in test_sign_exchange), the scale unmoved by the local steps; every rank ends alike."""
    rank = hvd.rank()
    variables = [keras.Variable(np.full((60, 50), 0.5, "float32"))]
    inner = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.AdamW(0.01, weight_decay=0.5), initial_scale=64.0)
    optimizer = sparse_hvd.SparseDistributedOptimizer(inner, exchange="sign", name="mixed_adamw")
    assert optimizer.second_moment == "noise_estimate"
    step = tf.function(lambda gs: optimizer.apply_gradients(zip(gs, variables)))
    for t in range(4):
        grad = np.random.RandomState(10 * t + rank).randn(60, 50).astype("float32")
        step([tf.constant(grad * 64.0)])
    assert np.all(np.isfinite(variables[0].numpy()))
    assert np.any(optimizer.residuals[0].numpy())  # the signs ran
    assert float(inner.dynamic_scale.numpy()) == 64.0 and inner.iterations.numpy() == 4
    mine = digest([v.numpy() for v in variables])
    assert set(gather(hvd, mine, name="mixed_adamw.digest")) == {mine}
