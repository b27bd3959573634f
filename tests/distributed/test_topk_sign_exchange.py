"""``exchange="topk_sign"`` on every rank: each rank sends the top-k entries of its compensated
update (or gradient) as they are and the sign of every other entry times their mean
magnitude; the mean over the ranks of both is applied everywhere and what neither carried
stays in each rank's residual (an independent NumPy computation of every rank's part, on
every rank)."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from conftest import digest, gather
from helpers import built, force_auto_choice

BIG, SMALL = (69, 51), (50,)  # 3519 entries (odd, not a multiple of 32): cut; 50: dense
LR, MOMENTUM, DENSITY, STEPS = 0.1, 0.9, 0.05, 5


def _gradients(rank, step):
    rng = np.random.RandomState(1000 * step + rank)
    big = rng.randn(*BIG) * np.exp(2 * rng.randn(*BIG))  # heavy-tailed, as SGD's are
    return [big.astype("float32"), rng.randn(*SMALL).astype("float32")]


def _sent(compensated, k, levels=1, group=1):
    """What one rank sends for a compensated float32 vector: its top-k entries as they are,
    every other entry as the others' mean magnitude, signed (a zero as +); with two levels,
    the next 9k entries (the band) at their own mean magnitude and the rest at theirs; with
    ``group=2`` each pair of entries (a last odd one alone) as the sign of its sum times
    sum |pair sums| / (n - k)."""
    order = np.argsort(-np.abs(compensated), kind="stable")
    top = order[:k]
    rest = compensated.copy()
    rest[top] = 0
    magnitude = np.abs(rest).astype("float64")
    if group == 2:
        sums = np.append(rest, np.float32(0))[:2 * ((rest.size + 1) // 2)].reshape(-1, 2).sum(1)
        scale = np.float32(np.abs(sums).astype("float64").sum() / (compensated.size - k))
        signs = np.repeat(np.where(sums < 0, -scale, scale), 2)[:rest.size].astype("float32")
    elif levels == 1:
        scale = np.float32(magnitude.sum() / (compensated.size - k))
        signs = np.where(rest < 0, -scale, scale).astype("float32")
    else:
        band = np.zeros(compensated.size, bool)
        band[order[k:10 * k]] = True
        band_scale = magnitude[band].sum() / band.sum()
        rest_scale = magnitude[~band].sum() / (compensated.size - k - band.sum())
        scales = np.where(band, band_scale, rest_scale)
        signs = np.where(rest < 0, -scales, scales).astype("float32")
    sent = signs.copy()
    sent[top] = compensated[top] + signs[top]
    return sent, rest - signs


@pytest.mark.parametrize("momentum,exchange", [(MOMENTUM, "topk_sign"), (0.0, "topk_sign"),
                                               (MOMENTUM, "topk_sign2"),
                                               (MOMENTUM, "topk_sign_pairs")])
def test_every_rank_applies_the_mean_of_the_top_entries_and_the_signs_of_the_rest(
        hvd, momentum, exchange):
    rank, size = hvd.rank(), hvd.size()
    start = [np.linspace(-1, 1, math.prod(s)).astype("float32").reshape(s) for s in (BIG, SMALL)]
    variables = [keras.Variable(w) for w in start]
    name = f"{exchange}_{int(momentum * 10)}"
    levels = 2 if exchange == "topk_sign2" else 1
    group = 2 if exchange == "topk_sign_pairs" else 1
    optimizer = built(sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(LR, momentum=momentum), density=DENSITY, exchange=exchange,
        name=name), variables)
    assert optimizer.sparsify == ("update" if momentum else "gradient")
    k = math.ceil(DENSITY * math.prod(BIG))

    @tf.function(jit_compile=False)
    def step(big, small):
        optimizer.apply_gradients(zip([big, small], variables))

    velocities = [np.zeros(math.prod(BIG)) for _ in range(size)]  # each rank's own (update cut)
    shared = np.zeros(math.prod(SMALL))  # the dense route's velocity, on the average
    residuals = [np.zeros(math.prod(BIG), "float32") for _ in range(size)]
    expected = [w.astype("float64").ravel() for w in start]
    for number in range(STEPS):
        step(*map(tf.constant, _gradients(rank, number)))
        every = [_gradients(r, number) for r in range(size)]  # every rank's, computed here
        total = np.zeros_like(expected[0])
        for r in range(size):
            own = every[r][0].ravel().astype("float64")
            if momentum:  # Keras SGD's step on this rank's own gradient, to be subtracted
                velocities[r] = momentum * velocities[r] + LR * own
                cut = velocities[r]
            else:
                cut = own
            sent, residuals[r] = _sent(cut.astype("float32") + residuals[r], k, levels, group)
            total += sent.astype("float64")
        shared = momentum * shared + LR * sum(g[1].astype("float64") for g in every).ravel() / size
        expected[0] = expected[0] - (total / size if momentum else LR * total / size)
        expected[1] = expected[1] - shared
    scale = np.abs(expected[0]).max()
    np.testing.assert_allclose(variables[0].numpy().ravel(), expected[0], rtol=0,
                               atol=1e-5 * scale, err_msg=f"rank {rank}")
    np.testing.assert_allclose(variables[1].numpy().ravel(), expected[1], rtol=0, atol=1e-5,
                               err_msg=f"rank {rank}")
    np.testing.assert_allclose(optimizer.residuals[0].numpy().ravel(), residuals[rank],
                               rtol=0, atol=1e-5 * np.abs(residuals[rank]).max(),
                               err_msg=f"rank {rank}")
    # what one rank sent per step: the dense route's float32s, k values and indices, then one
    # scale word and ceil(3519 / 32) = 110 words of signs (pairs: ceil(1760 / 32) = 55)
    signed = math.ceil(math.prod(BIG) / group)
    per_step = 4 * math.prod(SMALL) + 8 * k + levels * 4 * (1 + math.ceil(signed / 32))
    assert optimizer.communication_stats()["bytes_sent"] == STEPS * per_step
    digests = gather(hvd, digest([v.numpy() for v in variables]), name=f"{name}.digests")
    assert all(d == digests[0] for d in digests), digests
    optimizer.assert_same_step()  # the lockstep announcement of the fused allgather's layout


def test_a_step_not_finite_on_one_rank_is_skipped_everywhere(hvd):
    rank, size = hvd.rank(), hvd.size()
    start = np.linspace(-1, 1, math.prod(BIG)).astype("float32").reshape(BIG)
    variable = keras.Variable(start)
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(LR), density=DENSITY, exchange="topk_sign", name="topk_sign_nan")

    @tf.function(jit_compile=False)
    def step(gradient):
        optimizer.apply_gradients([(gradient, variable)])

    gradient = _gradients(rank, 0)[0]
    if rank == size - 1:
        gradient.flat[-1] = np.nan  # among the small entries: only the signs' scale sees it
        gradient = np.where(np.abs(gradient) > 1e3, 1.0, gradient).astype("float32")
    step(tf.constant(gradient))
    np.testing.assert_array_equal(variable.numpy(), start)
    np.testing.assert_array_equal(optimizer.residuals[0].numpy(), 0.0)
    assert int(optimizer.iterations.numpy()) == 0
    assert optimizer.communication_stats()["skipped_steps"] == 1


@pytest.mark.convergence_defaults
@pytest.mark.parametrize("forced", ["topk_sign", "dense"])
def test_with_sgd_momentum_the_default_times_topk_sign_against_dense(hvd, monkeypatch, forced):
    """``exchange=None`` with SGD's momentum and ``SIGNS_OF_REST`` on (it is off by default): a
    trial of ``topk_sign`` and dense, one decision on every rank (forced here), then the
    chosen one runs; replicas stay identical."""
    measured = force_auto_choice(monkeypatch, forced)
    monkeypatch.setattr(sparse_hvd.selection.defaults, "SIGNS_OF_REST", True)
    rank = hvd.rank()
    variables = [keras.Variable(np.zeros(s, "float32")) for s in (BIG, SMALL)]
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(LR, momentum=MOMENTUM), name=f"topk_sign_default_{forced}")

    @tf.function(jit_compile=False)
    def step(big, small):
        optimizer.apply_gradients(zip([big, small], variables))

    for number in range(1 + 2 * measured.TRIAL_STEPS + 3):
        step(*map(tf.constant, _gradients(rank, number)))
    assert [plan.name for plan in optimizer._step.plans] == ["topk_sign", "dense"]
    (_, times, choice), = optimizer.exchange_decisions
    assert choice == forced
    assert optimizer.layer_stats()[variables[0].path]["exchange"] == forced
    digests = gather(hvd, digest([v.numpy() for v in variables]),
                     name=f"topk_sign_default_{forced}.digests")
    assert all(d == digests[0] for d in digests), digests
    if forced == "topk_sign":  # the residuals hold what neither stage carried
        assert np.any(optimizer.residuals[0].numpy())
