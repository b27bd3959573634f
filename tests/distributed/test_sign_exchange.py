"""``exchange="sign"`` on every rank: each rank sends the sign of every entry of its
compensated update (or gradient) and each block's mean magnitude (``"sign_per_variable"``:
the variable's); the mean over the ranks of
``scale * sign`` is applied everywhere and ``c - scale * sign`` stays in each rank's residual
(an independent NumPy computation of every rank's part, on every rank)."""

import math

import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from conftest import digest, gather
from helpers import NumpyAdam, built, force_auto_choice

BIG, SMALL = (70, 50), (50,)  # 3500 entries (not a multiple of 32): cut; 50: the dense route
LR, EPSILON, STEPS = 0.01, 0.5, 5
WEIGHT_DECAY = 0.5  # AdamW's: large, so that a decay scaled by the correction would show


def _gradients(rank, step):
    rng = np.random.RandomState(1000 * step + rank)
    big = rng.randn(*BIG)
    # no entry near zero, whose update the weights' float32 could round to 0 (sent as +) ...
    big = (np.sign(big) * (0.1 + np.abs(big))).astype("float32")
    big.flat[:7] = 0.0  # ... but exact zeros, which travel as +
    return [big, rng.randn(*SMALL).astype("float32")]


def _signed(compensated, block):
    """What one rank sends for a compensated float32 vector: each block's mean magnitude
    (``block`` 0: the vector's; else rounded to bfloat16 by ml_dtypes), signed."""
    size = block or compensated.size
    scales = np.array([np.mean(np.abs(compensated[b:b + size]).astype("float64"))
                       for b in range(0, compensated.size, size)], "float32")
    if block:
        scales = scales.astype(ml_dtypes.bfloat16).astype("float32")
    scale = np.repeat(scales, size)[:compensated.size]
    return np.where(compensated < 0, -scale, scale).astype("float32")


def _settled(compensated, signed, residual):
    """``signed`` where an entry of ``compensated`` is within float32 noise of zero (both
    signs right: NumPy's float64 update and the rank's float32 one can differ in sign there)
    takes the sign the rank chose, read from its new ``residual`` (``c - sent``)."""
    tied = np.abs(compensated) < 1e-7
    return np.where(tied, np.sign(compensated - residual) * np.abs(signed), signed)


def _mean_estimate_step(adam, size):
    """NumpyAdam's step just taken, its second moment replaced by the estimate of the mean
    gradient's (``second_moment="mean_estimate"``)."""
    first, second = 1 - adam.beta_1 ** adam.t, 1 - adam.beta_2 ** adam.t
    m_hat, v_hat = adam.m / first, adam.v / second
    v_mean = (m_hat ** 2 + np.maximum(v_hat - m_hat ** 2, 0) / size) * second
    alpha = adam.lr * np.sqrt(second) / first
    return adam.m * alpha / (np.sqrt(v_mean) + adam.epsilon)


def _noise_estimate_step(adam, explained, size):
    """NumpyAdam's step just taken, its second moment v replaced by ``v - s (1 - 1/N)`` (at
    least ``v / N``), the noise s read from v and ``explained``, the beta_2 average of m_hat^2,
    which this updates (``second_moment="noise_estimate"``)."""
    m_hat = adam.m / (1 - adam.beta_1 ** adam.t)
    explained += (m_hat ** 2 - explained) * (1 - adam.beta_2)
    noise = np.maximum(adam.v - explained, 0) * (1 + adam.beta_1) / (2 * adam.beta_1)
    v_mean = np.maximum(adam.v - noise * (1 - 1 / size), adam.v / size)
    second = 1 - adam.beta_2 ** adam.t
    alpha = adam.lr * np.sqrt(second) / (1 - adam.beta_1 ** adam.t)
    return adam.m * alpha / (np.sqrt(v_mean) + adam.epsilon)


def _inner_optimizer(inner):
    """The inner optimizer of a test; AdamW with a learning rate that changes every step (its
    weight decay uses the rate of the step it is taken in)."""
    if inner.startswith("adamw"):
        schedule = keras.optimizers.schedules.ExponentialDecay(LR, decay_steps=1, decay_rate=0.8)
        return keras.optimizers.AdamW(schedule, weight_decay=WEIGHT_DECAY, epsilon=EPSILON)
    if inner.startswith("adam"):
        return keras.optimizers.Adam(LR, epsilon=EPSILON)
    return keras.optimizers.SGD(LR)


# Every second moment with both exchanges. An entry within float32 noise of zero can take
# either sign (at 2 ranks one of Adam's 3500 entries did, with one float32 scale a variable),
# and with the blocks' bfloat16 scales a block's mean that NumPy and TensorFlow compute a
# float32 ulp apart can round to neighbouring bfloat16s (a bfloat16 ulp is about the
# tolerance): so each step starts from every rank's actual residual (gathered), such an entry
# takes the sign its rank chose (``_settled``), and each rank's new residual is checked against
# the step's closed form.
@pytest.mark.parametrize("exchange", ["sign_per_variable", "sign"])
@pytest.mark.parametrize("inner", ["adam_own", "adam_mean_estimate", "adam", "adamw",
                                   "adamw_mean_estimate", "sgd"])
def test_every_rank_applies_the_mean_of_the_ranks_scaled_signs(hvd, inner, exchange):
    rank, size = hvd.rank(), hvd.size()
    start = [np.linspace(-1, 1, math.prod(s)).astype("float32").reshape(s) for s in (BIG, SMALL)]
    variables = [keras.Variable(w) for w in start]
    adam = inner.startswith("adam")
    block = 64 if exchange == "sign" else 0
    optimizer = built(sparse_hvd.SparseDistributedOptimizer(
        _inner_optimizer(inner), exchange=exchange, name=f"{exchange}_{inner}",
        second_moment=inner.split("_", 1)[1] if "_" in inner else None), variables)
    assert optimizer.sparsify == ("update" if adam else "gradient")
    if inner in ("adam", "adamw"):  # the sign exchange's default with Adam and AdamW
        assert optimizer.second_moment == "noise_estimate"

    @tf.function(jit_compile=False)
    def step(big, small):
        optimizer.apply_gradients(zip([big, small], variables))

    adams = [NumpyAdam(math.prod(BIG), LR, EPSILON) for _ in range(size)]  # each rank's own
    shared = NumpyAdam(math.prod(SMALL), LR, EPSILON)  # the dense route's, on the average
    explained = [np.zeros(math.prod(BIG)) for _ in range(size)]  # each rank's q
    residuals = [np.zeros(math.prod(BIG), "float32") for _ in range(size)]  # as TF keeps them
    expected = [w.astype("float64").ravel() for w in start]
    for number in range(STEPS):
        step(*map(tf.constant, _gradients(rank, number)))
        # every rank's residual after the step, for ties and the next step
        actual = gather(hvd, optimizer.residuals[0].numpy().ravel(),
                        name=f"{exchange}.{inner}.residuals.{number}")
        every = [_gradients(r, number) for r in range(size)]  # every rank's, computed here
        sent = np.zeros_like(expected[0])
        # AdamW: this step's rate, and what its decay takes from the weights (not corrected)
        decoupled = inner.startswith("adamw")
        rate = LR * 0.8 ** number if decoupled else LR
        decays = [w * WEIGHT_DECAY * rate if decoupled else 0.0 for w in expected]
        for r in range(size):
            own = every[r][0].ravel().astype("float64")
            adams[r].lr = rate
            cut = adams[r].update(own) if adam else own
            if inner.endswith("mean_estimate"):
                cut = _mean_estimate_step(adams[r], size) + decays[0]
            elif inner in ("adam", "adamw"):
                cut = _noise_estimate_step(adams[r], explained[r], size) + decays[0]
            compensated = cut.astype("float32") + residuals[r]  # in float32, as on the ranks
            signed = _settled(compensated, _signed(compensated, block), actual[r])
            residuals[r] = compensated - signed
            sent += signed.astype("float64")
        mean_small = sum(g[1].astype("float64") for g in every).ravel() / size
        if adam:
            shared.lr = rate
            expected[0] = expected[0] - sent / size
            expected[1] = expected[1] - decays[1] - shared.update(mean_small)
        else:
            expected[0] = expected[0] - LR * sent / size
            expected[1] = expected[1] - LR * mean_small
        # this rank's new residual, then every rank's actual one for the next step
        np.testing.assert_allclose(actual[rank], residuals[rank], rtol=0, atol=2e-5,
                                   err_msg=f"rank {rank} step {number}")
        residuals = actual
    for variable, value in zip(variables, expected):
        np.testing.assert_allclose(variable.numpy().ravel(), value, rtol=0, atol=2e-5,
                                   err_msg=f"rank {rank}")
    np.testing.assert_allclose(optimizer.residuals[0].numpy().ravel(), residuals[rank],
                               rtol=0, atol=2e-5, err_msg=f"rank {rank}")
    if inner in ("adam", "adamw"):  # the noise estimate: the cut variable's q, this rank's own
        np.testing.assert_allclose(optimizer._second_moment.variables[0].numpy().ravel(),
                                   explained[rank], rtol=1e-5, atol=0, err_msg=f"rank {rank}")
    # what one rank sent per step: the dense route's float32s, then the scales (one word; or
    # ceil(3500 / 64) = 55 bfloat16 scales in 28 words) and ceil(3500 / 32) = 110 words of signs
    scale_words = math.ceil(math.ceil(math.prod(BIG) / block) / 2) if block else 1
    per_step = 4 * math.prod(SMALL) + 4 * (scale_words + math.ceil(math.prod(BIG) / 32))
    assert optimizer.communication_stats()["bytes_sent"] == STEPS * per_step
    digests = gather(hvd, digest([v.numpy() for v in variables]),
                     name=f"{exchange}.{inner}")
    assert all(d == digests[0] for d in digests), digests
    steps = gather(hvd, int(optimizer.iterations.numpy()), name=f"{exchange}.{inner}.steps")
    assert steps == [STEPS] * size
    optimizer.assert_same_step()  # the lockstep announcement of the fused allgather's layout


@pytest.mark.parametrize("exchange,compression,packed", [
    ("sign", None, True), ("sign", "float16", True),  # its bfloat16 scales are not rounded
    ("sign_per_variable", None, True), ("sign_per_variable", "float16", False)])
def test_a_rank_takes_its_signs_packed_from_the_compensating_pass(hvd, exchange, compression,
                                                                  packed):
    """More than one worker: the compensating pass writes the sign words and scales as they
    travel (``SparseHvdPackedCompensateSign``) and nothing packs floats afterwards, unless
    ``compression`` rounds the scales (``sign_per_variable``'s float32 ones), which keeps the
    pass that writes the floats and the packing (the traced step's ops, every rank)."""
    from helpers import native_op
    from sparse_hvd import kernels

    native_op(kernels.packed_compensate_sign)
    variables = [keras.Variable(np.ones(BIG, "float32")), keras.Variable(np.ones(SMALL, "float32"))]
    optimizer = built(sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.Adam(LR), exchange=exchange, compression=compression,
        name=f"packed_{exchange}_{compression}"), variables)

    @tf.function(jit_compile=False)
    def step(big, small):
        optimizer.apply_gradients(zip([big, small], variables))

    graph = step.get_concrete_function(*map(tf.constant, _gradients(hvd.rank(), 0))).graph
    types = {op.type for op in graph.get_operations()} | {
        node.op for function in graph.as_graph_def().library.function
        for node in function.node_def}
    assert ("SparseHvdPackedCompensateSign" in types) == packed, sorted(types)
    assert ("SparseHvdSignPack" in types) != packed
    assert ("SparseHvdCompensateSign" in types) != packed


def test_a_step_not_finite_on_one_rank_is_skipped_everywhere(hvd):
    rank, size = hvd.rank(), hvd.size()
    start = np.linspace(-1, 1, math.prod(BIG)).astype("float32").reshape(BIG)
    variable = keras.Variable(start)
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(LR), exchange="sign", name="sign_nan")

    @tf.function(jit_compile=False)
    def step(gradient):
        optimizer.apply_gradients([(gradient, variable)])

    gradient = _gradients(rank, 0)[0]
    if rank == size - 1:
        gradient[3, 4] = np.nan
    step(tf.constant(gradient))
    np.testing.assert_array_equal(variable.numpy(), start)
    np.testing.assert_array_equal(optimizer.residuals[0].numpy(), 0.0)
    assert int(optimizer.iterations.numpy()) == 0
    assert optimizer.communication_stats()["skipped_steps"] == 1


@pytest.mark.convergence_defaults
@pytest.mark.parametrize("forced", ["sign", "dense"])
def test_with_adam_the_default_times_signs_against_dense_and_runs_the_choice(
        hvd, monkeypatch, forced):
    """``exchange=None`` with Adam: a trial of the sign exchange and dense, one decision on
    every rank (forced here, asked with the signs' own margin, 1.2x), then the chosen one runs
    (the layer statistics say so); replicas stay identical through the switches."""
    measured = force_auto_choice(monkeypatch, forced)
    forcing, margins = measured.decide, []

    def decide(seconds, names, margin):
        margins.append(margin)
        return forcing(seconds, names, margin)

    monkeypatch.setattr(measured, "decide", decide)
    rank = hvd.rank()
    variables = [keras.Variable(np.zeros(s, "float32")) for s in (BIG, SMALL)]
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.Adam(LR, epsilon=EPSILON), name=f"sign_default_{forced}")

    @tf.function(jit_compile=False)
    def step(big, small):
        optimizer.apply_gradients(zip([big, small], variables))

    adam = optimizer.inner_optimizer

    def state(owner, slots):  # the big variable's slot, float64 (None before the first step)
        if not optimizer.built:
            return None
        slot = getattr(owner, slots)[optimizer._get_variable_index(variables[0])]
        return slot.numpy().astype("float64")

    steps = 1 + 2 * measured.TRIAL_STEPS + 3
    stats, restarts, follows = [], 0, 0
    for number in range(steps):
        clear = optimizer.built and bool(optimizer._step.clear.numpy())
        v, q = state(adam, "_velocities"), state(optimizer._second_moment, "variables")
        sent = optimizer.communication_stats()["bytes_sent"]
        step(*map(tf.constant, _gradients(rank, number)))
        stats.append(optimizer.layer_stats()[variables[0].path])
        if optimizer.communication_stats()["bytes_sent"] - sent > 4 * math.prod(BIG):
            continue  # a dense step: the big variable whole; a sign step sends its signs
        # the noise estimate's q: made Adam's v before the first sign step after dense steps
        # that were not a trial's turn (the step before the trial here), then its step 1
        base = v if clear else q
        restarts, follows = restarts + clear, follows + (not clear)
        m_hat = state(adam, "_momentums") / (1 - 0.9 ** int(adam.iterations.numpy()))
        np.testing.assert_allclose(state(optimizer._second_moment, "variables"),
                                   base + (m_hat ** 2 - base) * (1 - 0.999),
                                   rtol=1e-5, atol=1e-12, err_msg=f"rank {rank} step {number}")
    assert restarts == 1 and follows == measured.TRIAL_STEPS - 1 + 3 * (forced == "sign")
    assert [plan.name for plan in optimizer._step.plans] == ["sign", "dense"]
    (_, times, choice), = optimizer.exchange_decisions
    assert choice == forced and set(times) == {"sign", "dense"}
    assert margins and set(margins) == {0.2}, margins  # no warm-up: the whole margin
    assert stats[0]["exchange"] == "dense"  # before the trial
    assert stats[-1]["exchange"] == forced
    assert stats[-1]["last_density"] == 1.0  # every entry: its sign, or its value
    everyone = gather(hvd, (sorted(times), choice), name=f"sign_default_{forced}.decisions")
    assert all(e == everyone[0] for e in everyone), everyone
    digests = gather(hvd, digest([v.numpy() for v in variables]),
                     name=f"sign_default_{forced}.digests")
    assert all(d == digests[0] for d in digests), digests
    if forced == "sign":  # the residuals hold what the signs left out
        assert np.any(optimizer.residuals[0].numpy())
