"""``sparsify="update"`` on every rank: each rank's own Adam, its update cut and error-fed, the
mean of the sent updates applied everywhere; a variable sent whole gets Adam on the average
(an independent NumPy computation of every rank's part, on every rank)."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from sparse_hvd.feedback import step_factor
from sparse_hvd.selection import defaults
from conftest import digest, gather
from helpers import NumpyAdam, numpy_topk_split

BIG, SMALL = (60, 50), (50,)  # 3000 entries: the sparse route; 50: the dense route
LR, EPSILON = 0.01, 0.5  # epsilon: no ties (tests/test_local_update.py)
DENSITY, STEPS = 0.05, 6


def _gradients(rank, step):
    rng = np.random.RandomState(1000 * step + rank)
    return [rng.randn(*BIG).astype("float32"), rng.randn(*SMALL).astype("float32")]


def _assert_applied(optimizer, variables, expected, residual, rank, atol):
    """This rank's weights are ``expected`` (NumPy, flat), and its residual of the first variable
    ``residual`` unless that is None."""
    for variable, value in zip(variables, expected):
        np.testing.assert_allclose(variable.numpy().ravel(), value, rtol=0, atol=atol,
                                   err_msg=f"rank {rank}")
    if residual is not None:
        np.testing.assert_allclose(optimizer.residuals[0].numpy().ravel(), residual, rtol=0,
                                   atol=atol, err_msg=f"rank {rank}")


def _mean_sent(updates, residuals, k):
    """The mean over the ranks of what each sends (its top ``k``, NumPy) of its ``updates[r]``
    plus its residual; ``residuals`` are left holding what each keeps."""
    sent = np.zeros_like(residuals[0])
    for r, update in enumerate(updates):
        _, mine, residuals[r] = numpy_topk_split(update + residuals[r], k)
        sent += mine
    return sent / len(updates)


@pytest.mark.parametrize("exchange", ["allgather", "dense"])
def test_the_mean_of_every_ranks_cut_adam_update_is_applied_on_every_rank(hvd, exchange):
    rank, size = hvd.rank(), hvd.size()
    start = [np.linspace(-1, 1, math.prod(s)).astype("float32").reshape(s) for s in (BIG, SMALL)]
    variables = [keras.Variable(w) for w in start]
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.Adam(LR, epsilon=EPSILON), density=DENSITY, warmup_steps=0,
        sparsify="update", exchange=exchange, budget="layer", name=f"update_{exchange}")

    @tf.function(jit_compile=False)
    def step(big, small):
        optimizer.apply_gradients(zip([big, small], variables))

    k = math.ceil(DENSITY * math.prod(BIG))
    adams = [NumpyAdam(math.prod(BIG), LR, EPSILON) for _ in range(size)]  # each rank's own
    shared = [NumpyAdam(math.prod(s), LR, EPSILON) for s in (BIG, SMALL)]  # on the averages
    residuals = [np.zeros(math.prod(BIG)) for _ in range(size)]
    expected = [w.astype("float64").ravel() for w in start]
    for number in range(STEPS):
        step(*map(tf.constant, _gradients(rank, number)))
        every = [_gradients(r, number) for r in range(size)]  # every rank's, computed here
        mean_big, mean_small = (sum(g[i].astype("float64") for g in every).ravel() / size
                                for i in (0, 1))
        if exchange == "dense":  # nothing is cut: Adam on the average, as Horovod's
            expected[0] = expected[0] - shared[0].update(mean_big)
        else:
            updates = [adams[r].update(every[r][0].ravel().astype("float64"))
                       for r in range(size)]
            expected[0] = expected[0] - _mean_sent(updates, residuals, k)
        expected[1] = expected[1] - shared[1].update(mean_small)  # the dense route
    _assert_applied(optimizer, variables, expected,
                    residuals[rank] if exchange == "allgather" else None, rank, atol=2e-6)
    if exchange == "allgather":
        # the averaged updates came back at their positions and were subtracted in place
        assert optimizer._exchange._at_positions
    # with the cut each rank's Adam followed its own gradients; sent whole, the average
    mine = adams[rank].m if exchange == "allgather" else shared[0].m
    np.testing.assert_allclose(optimizer.inner_optimizer._momentums[0].numpy().ravel(), mine,
                               rtol=1e-5, atol=1e-7)
    digests = gather(hvd, digest([v.numpy() for v in variables]), name=f"update.{exchange}")
    assert all(d == digests[0] for d in digests), digests
    steps = gather(hvd, int(optimizer.iterations.numpy()), name=f"update.{exchange}.steps")
    assert steps == [STEPS] * size


def test_a_step_not_finite_on_one_rank_is_skipped_everywhere_and_counted_once(hvd):
    """Rank 1's NaN: no rank moves its weights or counts the step; the ranks whose gradients
    were finite have moved their Adam moments (their own state), rank 1 has not."""
    rank, size = hvd.rank(), hvd.size()
    variable = keras.Variable(np.linspace(-1, 1, math.prod(BIG)).astype("float32").reshape(BIG))
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.Adam(LR), density=DENSITY, warmup_steps=0, sparsify="update",
        exchange="allgather", name="update_nan")
    optimizer.apply_gradients([(tf.constant(_gradients(rank, 0)[0]), variable)])
    before = variable.numpy().copy()
    moments = optimizer.inner_optimizer._momentums[0].numpy().copy()
    grad = _gradients(rank, 1)[0]
    if rank == 1 % size:
        grad[0, 0] = np.nan
    optimizer.apply_gradients([(tf.constant(grad), variable)])
    np.testing.assert_array_equal(variable.numpy(), before)
    assert int(optimizer.iterations.numpy()) == 1
    assert int(optimizer.inner_optimizer.iterations.numpy()) == 1
    assert optimizer.communication_stats()["skipped_steps"] == 1
    moved = not np.array_equal(optimizer.inner_optimizer._momentums[0].numpy(), moments)
    assert moved == (rank != 1 % size)


@pytest.mark.parametrize("exchange, update_scale, density, falling", [
    ("allgather", 1.5, DENSITY, False), ("dense", 1.5, DENSITY, False),
    ("allgather", None, defaults.DENSITY, False), ("allgather", None, defaults.DENSITY, True)])
def test_update_scale_multiplies_every_step_that_cuts(hvd, exchange, update_scale, density,
                                                      falling):
    """``update_scale`` under SGD's momentum: every rank subtracts the factor times the mean of
    the ranks' sent velocity steps from a cut variable and takes the factor times SGD's step on
    the averaged gradient on the dense route; the residuals and the velocities are what they
    are without it; a dense exchange, which cuts nothing, is Horovod's step. None at the
    default density is ``SGD_UPDATE_SCALE``: 1.5 at a constant rate, and under a ``falling``
    schedule growing toward 2.0 as the step's rate r falls below its share of the peak
    (``step_factor``'s closed form; NumPy, every rank's part computed on every rank)."""
    rank, size = hvd.rank(), hvd.size()
    lr, momentum = 0.1, 0.9
    rates = [lr * (0.5 ** (t // 2) if falling else 1.0) for t in range(STEPS)]
    at_peak, at_end = (defaults.SGD_UPDATE_SCALE if update_scale is None
                       else (update_scale, update_scale))
    share = step_factor.GROWS_BELOW  # the factor grows once r falls below share * peak
    grown = [min(1.0, max(0.0, 1 - r / (share * max(rates[:t + 1])))) for t, r in enumerate(rates)]
    factors = [at_peak + (at_end - at_peak) * g for g in grown]
    start = [np.linspace(-1, 1, math.prod(s)).astype("float32").reshape(s) for s in (BIG, SMALL)]
    variables = [keras.Variable(w) for w in start]
    schedule = (keras.optimizers.schedules.PiecewiseConstantDecay([1, 3], rates[0:6:2])
                if falling else lr)  # steps 0-1 at lr, 2-3 at lr / 2, then lr / 4
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(schedule, momentum=momentum), density=density, warmup_steps=0,
        sparsify="update", exchange=exchange, budget="layer", update_scale=update_scale,
        name=f"update_scale_{exchange}_{update_scale}_{falling}")
    assert optimizer.update_scale == (defaults.SGD_UPDATE_SCALE if update_scale is None
                                      else update_scale)

    @tf.function(jit_compile=False)
    def step(big, small):
        optimizer.apply_gradients(zip([big, small], variables))

    k = math.ceil(density * math.prod(BIG))
    velocities = [np.zeros(math.prod(BIG)) for _ in range(size)]  # each rank's own
    shared = [np.zeros(math.prod(s)) for s in (BIG, SMALL)]  # on the averages
    residuals = [np.zeros(math.prod(BIG)) for _ in range(size)]
    expected = [w.astype("float64").ravel() for w in start]
    for number, (rate, factor) in enumerate(zip(rates, factors)):
        step(*map(tf.constant, _gradients(rank, number)))
        every = [_gradients(r, number) for r in range(size)]
        mean_big, mean_small = (sum(g[i].astype("float64") for g in every).ravel() / size
                                for i in (0, 1))
        shared[1] = momentum * shared[1] - rate * mean_small
        if exchange == "dense":
            shared[0] = momentum * shared[0] - rate * mean_big
            expected[0] = expected[0] + shared[0]
            expected[1] = expected[1] + shared[1]
        else:
            for r in range(size):
                velocities[r] = momentum * velocities[r] - rate * every[r][0].ravel()
            sent = _mean_sent([-v for v in velocities], residuals, k)
            expected[0] = expected[0] - factor * sent
            expected[1] = expected[1] + factor * shared[1]
    if falling:
        assert factors[-1] > at_peak  # the rate at a quarter of its peak
    _assert_applied(optimizer, variables, expected,
                    residuals[rank] if exchange == "allgather" else None, rank, atol=5e-6)
    digests = gather(hvd, digest([v.numpy() for v in variables]),
                     name=f"scale.{exchange}.{update_scale}.{falling}")
    assert all(d == digests[0] for d in digests), digests


RHO, ACCUMULATOR_START = 0.9, 0.1  # RMSprop's decay, Adagrad's first accumulator


def _rmsprop_step(mean_square, gradient):
    """Keras' RMSprop (no momentum, not centered) in NumPy: ``mean_square`` moved in place."""
    mean_square[:] = RHO * mean_square + (1 - RHO) * gradient ** 2
    return LR * gradient / np.sqrt(mean_square + EPSILON)


def _adagrad_step(accumulator, gradient):
    """Keras' Adagrad in NumPy (its accumulator starts at ``ACCUMULATOR_START``)."""
    accumulator += gradient ** 2
    return LR * gradient / np.sqrt(accumulator + EPSILON)


@pytest.mark.parametrize("name", ["rmsprop", "adagrad"])
def test_the_default_step_is_the_factor_times_the_mean_cut_update(hvd, name):
    """RMSprop and Adagrad get SGD's larger sparse step by default (``update_scale=None`` at the
    default density: ``SGD_UPDATE_SCALE``, 1.5 at a constant rate): every rank subtracts 1.5
    times the mean of the ranks' cut updates from a cut variable and 1.5 times the optimizer's
    step on the averaged gradient from a variable on the dense route (NumPy RMSprop or Adagrad,
    every rank's part computed on every rank)."""
    rank, size = hvd.rank(), hvd.size()
    density, factor = defaults.DENSITY, defaults.SGD_UPDATE_SCALE[0]
    start = [np.linspace(-1, 1, math.prod(s)).astype("float32").reshape(s) for s in (BIG, SMALL)]
    variables = [keras.Variable(w) for w in start]
    inner, inner_step, state = {
        "rmsprop": (keras.optimizers.RMSprop(LR, rho=RHO, epsilon=EPSILON), _rmsprop_step, 0.0),
        "adagrad": (keras.optimizers.Adagrad(LR, initial_accumulator_value=ACCUMULATOR_START,
                                             epsilon=EPSILON), _adagrad_step, ACCUMULATOR_START),
    }[name]
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        inner, density=density, warmup_steps=0, exchange="allgather", budget="layer",
        name=f"{name}_default_scale")
    assert optimizer.sparsify == "update" and optimizer.update_scale == defaults.SGD_UPDATE_SCALE

    @tf.function(jit_compile=False)
    def step(big, small):
        optimizer.apply_gradients(zip([big, small], variables))

    k = math.ceil(density * math.prod(BIG))
    own = [np.full(math.prod(BIG), state) for _ in range(size)]  # each rank's optimizer state
    shared = np.full(math.prod(SMALL), state)  # the dense route's, on the averaged gradient
    residuals = [np.zeros(math.prod(BIG)) for _ in range(size)]
    expected = [w.astype("float64").ravel() for w in start]
    for number in range(STEPS):
        step(*map(tf.constant, _gradients(rank, number)))
        every = [_gradients(r, number) for r in range(size)]
        updates = [inner_step(own[r], every[r][0].astype("float64").ravel())
                   for r in range(size)]
        mean_small = sum(g[1].astype("float64") for g in every) / size
        expected[0] = expected[0] - factor * _mean_sent(updates, residuals, k)
        expected[1] = expected[1] - factor * inner_step(shared, mean_small)
    _assert_applied(optimizer, variables, expected, residuals[rank], rank, atol=5e-6)
    digests = gather(hvd, digest([v.numpy() for v in variables]), name=f"{name}.default_scale")
    assert all(d == digests[0] for d in digests), digests


@pytest.mark.convergence_defaults
def test_lions_tied_first_step_sends_nothing_of_the_cut_variable_on_every_rank(hvd):
    """Lion's first update is +-rate on every entry (its momentum zero), all tied at the
    model-wide cut, so the cut sends ``> cut``, which comes nearer k than ``>= cut`` (every
    entry, as it did before ``selection.model_budget.nearer_the_budget``): none of them. NumPy,
    every rank's update, cut and residual, the mean of what they sent applied everywhere;
    the dense route's variable takes Lion's step on the mean gradient."""
    rank, size = hvd.rank(), hvd.size()
    # the cut variable starts at 0, where before - after is the step itself: every entry tied
    start = [np.zeros(BIG, "float32"), np.linspace(-1, 1, SMALL[0]).astype("float32")]
    variables = [keras.Variable(w) for w in start]
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.Lion(LR),
                                                      exchange="allgather", name="lion_default")
    assert optimizer.sparsify == "update" and optimizer.budget == "model"
    assert optimizer.update_scale == 1.0

    @tf.function(jit_compile=False)
    def step(big, small):
        optimizer.apply_gradients(zip([big, small], variables))

    step(*map(tf.constant, _gradients(rank, 0)))
    k = int(optimizer.density_policy.k(0, math.prod(BIG), 0))  # the warm-up's first: 10%
    w = start[0].ravel()
    sent = np.zeros(w.size)
    for r in range(size):
        step_r = np.float32(LR) * np.sign(_gradients(r, 0)[0].ravel())  # m = 0: sign(g)
        update = w - (w - step_r)  # float32, as the update cut takes it
        magnitudes = np.abs(update)
        kth = np.sort(magnitudes)[::-1][k - 1]
        at_or_above, above = int(np.sum(magnitudes >= kth)), int(np.sum(magnitudes > kth))
        passed = magnitudes >= kth if at_or_above - k <= k - above else magnitudes > kth
        assert at_or_above == w.size and not passed.any()  # all tied: none travels, not all
        sent += np.where(passed, update, 0).astype("float64")
        if r == rank:
            np.testing.assert_array_equal(optimizer.residuals[0].numpy().ravel(),
                                          np.where(passed, 0, update))
    np.testing.assert_allclose(variables[0].numpy().ravel(), w - sent / size, rtol=0, atol=1e-6,
                               err_msg=f"rank {rank}")
    mean_small = sum(_gradients(r, 0)[1].astype("float64") for r in range(size)) / size
    np.testing.assert_allclose(variables[1].numpy(), start[1] - LR * np.sign(mean_small),
                               rtol=0, atol=1e-6, err_msg=f"rank {rank}")
    digests = gather(hvd, digest([v.numpy() for v in variables]), name="lion.replicas")
    assert all(d == digests[0] for d in digests), digests
