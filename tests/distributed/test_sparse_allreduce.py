"""exchange="sparse_allreduce" on every rank, against a NumPy re-computation of its rule."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from conftest import digest, gather
from helpers import (built, classification_data, coded_value_words, elias_fano_words, mlp,
                     numpy_topk_indices, raw_bits_of, weights_of)

LEVELS = (1.0, 2 ** -(1 / 1024), 2 ** -(1 / 256), 2 ** -(1 / 64), 2 ** -(1 / 16), 2 ** -0.25,
          0.5, 0.25)
MAX_GROWTH, FIRST_MISS = 1.25, 1.01
SHAPES = [(60, 50), (40, 40)]  # sparse route (3000 and 1600 entries); the bias goes dense
DENSITY = 0.02


class NumpyRule:
    """The documented rule (sparse_hvd/exchanges/sparse_allreduce.py, steps 2-8, the thresholds'
    forecast in global_threshold.py) for every rank at once."""

    def __init__(self, size, select, rounding=None, model_wide=False):
        """``model_wide``: ``budget="model"``, under which the variables are one (their
        selection, threshold and top-k), with the sum of their budgets."""
        self.size, self.select, self.model_wide = size, select, model_wide
        self.rounding = rounding or (lambda values: values)  # what compression sends
        self.parts = [int(np.prod(s)) for s in SHAPES]
        self.sizes = list(self.parts)
        self.budgets = [math.ceil(DENSITY * n) for n in self.sizes]
        if model_wide:
            self.sizes, self.budgets = [sum(self.sizes)], [sum(self.budgets)]
        count = len(self.sizes)
        self.theta = [0.0] * count
        self.last_cut = [0.0] * count
        self.growth = [0.0] * count
        self.miss = [FIRST_MISS] * count
        self.residuals = [[np.zeros(n) for n in self.sizes] for _ in range(size)]
        self.applied = []  # per step, the applied indices of each variable of ``SHAPES``

    def split(self, vectors):
        """Per variable of ``SHAPES``, from this rule's variables (one when model-wide)."""
        joined = np.concatenate(vectors)
        return np.split(joined, np.cumsum(self.parts)[:-1])

    def thresholds(self):
        """Each variable's threshold (the one threshold for all when model-wide)."""
        return self.theta * (len(SHAPES) // len(self.theta))

    def forget(self):
        """A step that does not follow the exchange's last one forecasts afresh (the thresholds
        stay)."""
        self.last_cut = [0.0] * len(self.theta)
        self.growth = [0.0] * len(self.theta)
        self.miss = [FIRST_MISS] * len(self.theta)

    def step(self, grads):
        """``grads[rank][variable]`` (flat, per variable of ``SHAPES``): the averages every
        rank applies, per variable of ``SHAPES``."""
        if self.model_wide:
            grads = [[np.concatenate(g)] for g in grads]
        averages = []
        for v, n in enumerate(self.sizes):
            sent = []
            for r in range(self.size):
                compensated = grads[r][v] + self.residuals[r][v]
                chosen = self.select(r, compensated, self.budgets[v])
                values = self.rounding(compensated[chosen])
                sent.append((chosen, values))
                self.residuals[r][v] = compensated.copy()
                self.residuals[r][v][chosen] -= values  # zero, or the rounding error
            sums = {}
            for chosen, values in sent:  # rank order, from 0.0 as the segment sum does
                for i, x in zip(chosen.tolist(), values.tolist()):
                    sums[i] = sums.get(i, 0.0) + x
            theta = self.theta[v]
            kept = {i: s for i, s in sums.items() if abs(s) >= theta}
            counts = [sum(abs(s) >= theta * level for s in sums.values()) for level in LEVELS]
            magnitudes = sorted((abs(s) for s in kept.values()), reverse=True)
            k = self.budgets[v]
            predicted = theta * self.miss[v] * self.miss[v]  # the forecast theta was made from
            judged = theta > 0 and self.growth[v] > 0
            if len(magnitudes) >= k:
                cut = magnitudes[k - 1]
                kept = {i: s for i, s in kept.items() if abs(s) >= cut}  # the top k
                if self.last_cut[v] > 0:
                    self.growth[v] = min(max(cut / self.last_cut[v], 1 / MAX_GROWTH), MAX_GROWTH)
                base = cut
                missed = max(cut / predicted, predicted / cut) if judged else 0.0
                self.last_cut[v] = cut
            else:
                reached = [j for j in range(1, len(LEVELS)) if counts[j] >= k]
                factor = LEVELS[-1]  # none reached k: the lowest
                if reached:  # where the line through the counts around k reaches it
                    j = reached[0]
                    share = (k - counts[j - 1]) / (counts[j] - counts[j - 1])
                    factor = LEVELS[j - 1] - (LEVELS[j - 1] - LEVELS[j]) * share
                base = theta * factor
                missed = predicted / base if judged else 0.0
                self.last_cut[v] = 0.0
            if judged:
                self.miss[v] = max(missed, math.sqrt(self.miss[v]))
            growth = self.growth[v] if self.growth[v] > 0 else 1.0
            self.theta[v] = base * growth / (self.miss[v] * self.miss[v])
            average = np.zeros(n)
            for i, s in kept.items():
                average[i] = s / self.size
            averages.append(average)
            self.applied.append(sorted(kept))
            for r, (chosen, values) in enumerate(sent):
                for i, x in zip(chosen.tolist(), values.tolist()):
                    if i not in kept:
                        self.residuals[r][v][i] += x
        return self.split(averages)


def _gradients(rank, step, silent_rank=None):
    rng = np.random.RandomState(1000 * step + rank)
    grads = [rng.randn(n) * 0.1 for n in (3000, 1600)]
    grads[0][5] = 10.0 + rank  # an index every rank selects
    grads[0][:400] += rng.randn(400)  # most selections fall in the first region
    if rank == silent_rank:
        grads = [g * 1e-6 for g in grads]
    return grads


def _thresholds(exchange):
    """The thresholds of the two sparse variables (one state, or one per variable)."""
    if exchange.per_layer:
        return [float(exchange.parts[key].thresholds.numpy()[0]) for key in (0, 1)]
    return exchange.sparse_allreduce.thresholds.numpy()[:2].tolist()


def _run(hvd, sparsifier, select, steps, silent_rank, name, compression="none", rounding=None,
         grouping="grouped", gap_before=None, budget="layer"):
    """``gap_before``: before that step the optimizer's step count jumps (as when auto ran
    another exchange in between)."""
    rank, size = hvd.rank(), hvd.size()
    variables = [keras.Variable(np.zeros(s), dtype="float64") for s in SHAPES]
    bias = keras.Variable(np.zeros(10), dtype="float64")
    optimizer = built(sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(1.0), density=DENSITY, sparsifier=sparsifier,
        exchange="sparse_allreduce", compression=compression, warmup_steps=0, grouping=grouping,
        budget=budget, name=name), variables + [bias])
    step = tf.function(lambda a, b, c: optimizer.apply_gradients(
        [(a, variables[0]), (b, variables[1]), (c, bias)]))
    rule = NumpyRule(size, select, rounding, model_wide=budget == "model")
    expected = [np.zeros(int(np.prod(s))) for s in SHAPES]
    for t in range(steps):
        everyone = [_gradients(r, t, silent_rank) for r in range(size)]
        mine = everyone[rank]
        if t == gap_before:
            optimizer.iterations.assign_add(7)
            rule.forget()
        step(tf.constant(mine[0].reshape(SHAPES[0])), tf.constant(mine[1].reshape(SHAPES[1])),
             tf.constant(np.full(10, float(rank))))
        for v, average in enumerate(rule.step(everyone)):
            expected[v] = expected[v] - average
            np.testing.assert_array_equal(variables[v].numpy().reshape(-1), expected[v],
                                          err_msg=f"weights of variable {v} at step {t}")
        for v, residual in enumerate(rule.split(rule.residuals[rank])):
            np.testing.assert_array_equal(optimizer.residuals[v].numpy().reshape(-1), residual,
                                          err_msg=f"residual of variable {v} at step {t}")
        np.testing.assert_array_equal(_thresholds(optimizer._exchange), rule.thresholds())
    if rounding is None:  # the bias goes dense; with compression it is rounded too
        np.testing.assert_allclose(bias.numpy(), -steps * (size - 1) / 2 * np.ones(10))
    if grouping == "layerwise":
        return rule, None
    bounds = gather(hvd, optimizer._exchange.sparse_allreduce.boundaries.numpy().tolist(),
                    name=f"{name}.bounds")
    assert all(b == bounds[0] for b in bounds)
    return rule, bounds[0]


def test_each_step_applies_the_kept_sums_and_returns_the_rest(hvd):
    # top-k on every rank: index 5 chosen by all; the thresholds go from 0 (everything summed
    # is kept) to the exact k-th largest sum, and the regions re-balance toward index 0
    rule, bounds = _run(hvd, "topk", lambda r, c, k: numpy_topk_indices(c, k), steps=4,
                        silent_rank=None, name="sar_topk")
    assert all(theta > 0 for theta in rule.theta)
    assert bounds[0] == 0 and bounds[-1] == 4600 and bounds == sorted(bounds)
    if hvd.size() == 2:  # one gather: every rank sums the whole space, the regions stay even
        assert bounds == [0, 2300, 4600]
    else:
        assert bounds[1] < 4600 // hvd.size(), "the regions did not follow the selections"


def test_with_the_model_wide_budget_one_threshold_and_one_top_k_span_every_variable(hvd):
    # budget="model": each rank selects the top sum-of-k of both variables together, and the
    # owners keep and apply the top sum-of-k sums of both together (one threshold): variable 0,
    # whose first 400 entries are larger, gets more than its own k applied, as it was sent
    k = [math.ceil(DENSITY * int(np.prod(s))) for s in SHAPES]
    rule, _ = _run(hvd, "topk", lambda r, c, k: numpy_topk_indices(c, k), steps=4,
                   silent_rank=None, name="sar_model_wide", budget="model")
    assert rule.theta[0] > 0 and len(rule.theta) == 1
    assert len(rule.applied[0]) == sum(k)  # theta 0 at the first step: the exact top sum-of-k
    assert sum(i < rule.parts[0] for i in rule.applied[0]) > k[0], rule.applied[0]


@pytest.mark.parametrize("grouping", ["grouped", "layerwise"])
def test_with_the_update_cut_the_applied_sums_are_subtracted_where_they_are(
        hvd, monkeypatch, grouping):
    """sparsify="update" under SGD's momentum (the default's cut): the owners' applied sums
    come back at their positions and are subtracted in place; weights and residuals are the
    bits of the dense averages' subtraction (the same training with the dense form), and
    every rank holds the same weights."""
    from sparse_hvd.exchanges.sparse_allreduce import (LayerwiseSparseAllreduce,
                                                       SparseAllreduceExchange)

    rank = hvd.rank()
    kind = SparseAllreduceExchange if grouping == "grouped" else LayerwiseSparseAllreduce

    def train(at_positions):
        monkeypatch.setattr(kind, "averages_at_positions", at_positions)
        variables = [keras.Variable(np.zeros(s, "float32")) for s in SHAPES]
        optimizer = built(sparse_hvd.SparseDistributedOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9), density=DENSITY, warmup_steps=0,
            exchange="sparse_allreduce", sparsify="update", grouping=grouping,
            name=f"sar_update_{grouping}_{at_positions}"), variables)
        step = tf.function(lambda a, b: optimizer.apply_gradients(zip([a, b], variables)))
        for t in range(5):
            step(*(tf.constant(g.reshape(s).astype("float32"))
                   for g, s in zip(_gradients(rank, t), SHAPES)))
        assert isinstance(optimizer._exchange, kind)
        assert optimizer._exchange._at_positions == at_positions
        return ([v.numpy() for v in variables], [r.numpy() for r in optimizer.residuals])

    (weights, residuals), (dense_weights, dense_residuals) = train(True), train(False)
    for v, (mine, dense) in enumerate(zip(weights + residuals, dense_weights + dense_residuals)):
        np.testing.assert_array_equal(mine, dense, err_msg=f"rank {rank}, state {v}")
    assert np.count_nonzero(weights[0]) > 0 and np.count_nonzero(residuals[0]) > 0
    digests = gather(hvd, digest(weights), name=f"sar_update.{grouping}.weights")
    assert all(d == digests[0] for d in digests), digests


def test_float16_values_reach_the_owners_and_the_rounding_stays_in_the_residual(hvd):
    # compression="float16": each rank's selected values are rounded to float16 (and travel
    # so, two to a word), the owners sum them in float64; residual = compensated - rounded
    def to_float16(values):
        return np.clip(values, -65504, 65504).astype(np.float16).astype(np.float64)

    rule, _ = _run(hvd, "topk", lambda r, c, k: numpy_topk_indices(c, k), steps=4,
                   silent_rank=None, name="sar_float16", compression="float16",
                   rounding=to_float16)
    rank = hvd.rank()
    assert any(np.any((r != 0) & (np.abs(r) < 1e-2)) for r in rule.residuals[rank]), \
        "no rounding error was kept"


def test_layerwise_runs_the_same_rule_one_variable_at_a_time(hvd):
    # grouping="layerwise": a sparse allreduce per variable; the thresholds and the kept sums
    # are per variable in both groupings, so the same NumPy rule holds, bit for bit
    rule, _ = _run(hvd, "topk", lambda r, c, k: numpy_topk_indices(c, k), steps=4,
                   silent_rank=None, name="sar_layerwise", grouping="layerwise")
    assert all(theta > 0 for theta in rule.theta)


@pytest.mark.parametrize("grouping", ["grouped", "layerwise"])
def test_a_step_that_does_not_follow_the_last_one_forecasts_afresh(hvd, grouping):
    # the forecast of step 4 (growth known and judged by then) is dropped at a gap of 7 steps:
    # thresholds, weights and residuals are the forgetting rule's bits, on every rank, to the end
    select = lambda r, c, k: numpy_topk_indices(c, k)  # noqa: E731
    rule, _ = _run(hvd, "topk", select, steps=7, silent_rank=None,
                   name=f"sar_gap_{grouping}", grouping=grouping, gap_before=4)
    remembering = NumpyRule(hvd.size(), select)  # the same steps, the old forecast kept
    for t in range(7):
        remembering.step([_gradients(r, t) for r in range(hvd.size())])
    assert remembering.theta != rule.theta, "the gap changed nothing: the test cannot tell"


def test_a_rank_that_sends_nothing_and_empty_regions(hvd):
    # a hard threshold: the last rank's gradients never pass lambda, so it sends nothing, and
    # most regions receive nothing (the selections lie in the first 400 entries)
    lam = 0.5
    size = hvd.size()
    rule, _ = _run(hvd, sparse_hvd.Threshold(threshold=lam, max_density=0.5),
                   lambda r, c, k: np.flatnonzero(np.abs(c) >= lam), steps=4,
                   silent_rank=size - 1, name="sar_threshold")
    assert np.count_nonzero(rule.residuals[size - 1][0]) > 0  # it keeps everything


def test_nothing_of_any_gradient_is_lost_at_any_step(hvd):
    rank, size = hvd.rank(), hvd.size()
    variable = keras.Variable(np.zeros((80, 70)), dtype="float64")
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(1.0), density=0.01, sparsifier="approx_topk",
        exchange="sparse_allreduce", name="sar_conservation")
    step = tf.function(lambda g: optimizer.apply_gradients([(g, variable)]))
    rng = np.random.RandomState(rank)
    total = np.zeros((80, 70))
    for t in range(15):
        g = rng.standard_cauchy((80, 70)) * 0.01
        total += g
        step(tf.constant(g))
        residuals = hvd.allreduce(tf.constant(optimizer.residuals[0].numpy()), op=hvd.Sum,
                                  name=f"sar_conservation.r{t}").numpy()
        gradients = hvd.allreduce(tf.constant(total), op=hvd.Sum, name=f"sar_conservation.g{t}").numpy()
        # sum of residuals + N x (everything applied) == sum of every gradient so far
        np.testing.assert_allclose(residuals + size * -variable.numpy(), gradients,
                                   rtol=0, atol=1e-12, err_msg=f"step {t}")


def test_model_fit_keeps_replicas_identical_and_resumes_exactly(hvd, tmp_path_factory):
    rank = hvd.rank()
    x, y = classification_data(n=64, seed=rank)

    def compiled(model):
        # the gradient cut; the thresholds' forecast is not in the checkpoint (a resumed job
        # forecasts afresh), so the uninterrupted run below forgets it at the same step
        model.compile(sparse_hvd.SparseDistributedOptimizer(
            keras.optimizers.SGD(0.05, momentum=0.9), density=0.01, sparsify="gradient",
            exchange="sparse_allreduce", name="sar_fit"),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
        return model

    callbacks = [sparse_hvd.BroadcastGlobalVariablesCallback(0), sparse_hvd.ShareResidualsCallback()]
    model = compiled(mlp(seed=rank))
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    assert len(set(gather(hvd, digest(weights_of(model)), name="sar_fit.digest"))) == 1
    thresholds = model.optimizer._exchange.sparse_allreduce.thresholds.numpy()
    assert len(set(gather(hvd, digest([thresholds]), name="sar_fit.thresholds"))) == 1
    assert np.count_nonzero(thresholds) > 0

    directory = gather(hvd, str(tmp_path_factory.mktemp("sar_resume")), name="sar_fit.dir")[0]
    path = f"{directory}/epoch1.keras"
    if rank == 0:
        model.save(path)
    gather(hvd, "saved", name="sar_fit.barrier")
    model.optimizer._exchange.sparse_allreduce.last_step.assign(-1)  # as after a restore
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=callbacks[1:])
    uninterrupted = weights_of(model)
    resumed = keras.models.load_model(path)
    assert resumed.optimizer.exchange == "sparse_allreduce"
    np.testing.assert_array_equal(resumed.optimizer._exchange.sparse_allreduce.thresholds.numpy(),
                                  thresholds)
    resumed.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    for a, b in zip(uninterrupted, weights_of(resumed)):
        np.testing.assert_array_equal(a, b)
    assert len(set(gather(hvd, digest(weights_of(resumed)), name="sar_fit.resumed"))) == 1


def test_it_composes_with_momentum_correction_warmup_approx_topk_and_dense_fallback(hvd):
    rank = hvd.rank()
    x, y = classification_data(n=64, seed=rank)
    model = mlp(seed=rank)
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.05), momentum_correction=0.9, sparsifier="approx_topk",
        density=sparse_hvd.WarmupDensity(0.01, initial_density=0.2, warmup_steps=4),
        dense_fallback=True, exchange="sparse_allreduce", name="sar_combo")
    model.compile(optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                        callbacks=[sparse_hvd.BroadcastGlobalVariablesCallback(0)])
    assert np.all(np.isfinite(history.history["loss"]))
    assert len(set(gather(hvd, digest(weights_of(model)), name="sar_combo.digest"))) == 1
    exchanges = {s["exchange"] for s in optimizer.layer_stats().values()}
    assert exchanges <= {"sparse_allreduce", "dense"}


def test_coded_blocks_apply_the_same_bits_as_plain_ones_for_every_kind_of_value(hvd):
    # float32 (and float16 with compression): the coded blocks' values and indices decode to
    # the bits sent, so the coded exchange (the default) applies what the plain one applies,
    # checked against NumPy above, on every rank; its thresholds and regions are the same
    rank, size = hvd.rank(), hvd.size()
    special = np.array([0.0, -0.0, 1e-42, -3e-39, 6e4, -2.5, 1e30], np.float32)
    for compression in ("none", "float16"):
        runs = []
        for exchange in ("sparse_allreduce", "plain_sparse_allreduce"):
            variables = [keras.Variable(np.zeros(s, np.float32)) for s in SHAPES]
            optimizer = built(sparse_hvd.SparseDistributedOptimizer(
                keras.optimizers.SGD(0.5), density=0.05, exchange=exchange,
                compression=compression, warmup_steps=0, name=f"sar_{exchange}_{compression}"),
                variables)
            step = tf.function(lambda a, b: optimizer.apply_gradients(
                [(a, variables[0]), (b, variables[1])]))
            for t in range(6):
                grads = [g.astype(np.float32) for g in _gradients(rank, t)]
                grads[1][:] = 0.0  # a variable whose selection is all zeros
                grads[0][100:100 + len(special)] = special * (rank + 1) * 1e3
                step(tf.constant(grads[0].reshape(SHAPES[0])),
                     tf.constant(grads[1].reshape(SHAPES[1])))
            state = optimizer._exchange.sparse_allreduce
            runs.append([v.numpy() for v in variables]
                        + [r.numpy() for r in optimizer.residuals]
                        + [state.thresholds.numpy(), state.boundaries.numpy()])
        coded, plain = runs
        assert np.count_nonzero(coded[0]) > 0
        for a, b in zip(coded, plain):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8),
                                          err_msg=f"compression={compression}")
        shared = coded[:2] + coded[-2:]  # the weights, thresholds and regions (not residuals)
        assert len(set(gather(hvd, digest(shared), name=f"sar_coded_{compression}"))) == 1


@pytest.mark.parametrize("grouping", ["grouped", "layerwise"])
def test_the_statistics_count_the_blocks_as_they_travel(hvd, grouping):
    # communication_stats()["bytes_sent"]: this rank's selection as its scatter blocks, one
    # per owner of the even regions of the first step (at two ranks one block of the whole
    # space, which the one gather carries): the header's 4 words, the Elias-Fano code among the
    # region's entries and the values' code (tests/helpers.py, plain integers); uncoded, 8
    # bytes an entry. One variable: its own index space in either grouping
    rank, size = hvd.rank(), hvd.size()
    n, k = 3000, 60
    gradient = np.random.RandomState(rank).randn(n).astype(np.float32)
    chosen = np.sort(numpy_topk_indices(gradient, k))
    regions = [0, n] if size == 2 else [n * r // size for r in range(size + 1)]
    words = 0
    for start, end in zip(regions[:-1], regions[1:]):
        mine = chosen[(chosen >= start) & (chosen < end)]
        words += 4 + elias_fano_words(end - start, len(mine))
        words += coded_value_words(raw_bits_of(gradient[mine], "float32"), [len(mine)], "float32")
    for exchange, expected in (("sparse_allreduce", 4 * words),
                               ("plain_sparse_allreduce", k * 8)):
        variable = keras.Variable(np.zeros(n, np.float32))
        optimizer = built(sparse_hvd.SparseDistributedOptimizer(
            keras.optimizers.SGD(0.1), density=k / n, exchange=exchange, warmup_steps=0,
            grouping=grouping, name=f"sar_stats_{exchange}_{grouping}"), [variable])
        tf.function(lambda g: optimizer.apply_gradients([(g, variable)]))(tf.constant(gradient))
        assert optimizer.communication_stats()["bytes_sent"] == expected, exchange
