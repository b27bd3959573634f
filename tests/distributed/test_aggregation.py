"""The averaged gradient every rank applies equals an independent NumPy computation."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from sparse_hvd import kernels
from sparse_hvd.exchanges import create
from sparse_hvd.selection.sparsifiers import Selection, register_sparsifier, topk
from conftest import digest, gather
from helpers import numpy_topk_indices, numpy_topk_split

BIG = (60, 50)  # 3000 entries: sparse route
SMALL = (50,)  # dense route (below min_elements)


def _rank_selection(rank, count, num_elements, salt):
    """Rank ``rank`` sends ``count`` distinct positions with values that encode rank and position."""
    indices = (np.arange(count) * (rank + 3) + salt) % num_elements
    values = (rank + 1) * 1000.0 + indices + salt
    return indices.astype("int32"), values.astype("float32")


@pytest.mark.parametrize("grouping", ["grouped", "layerwise"])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_sparse_average_with_different_counts_per_rank_and_one_rank_sending_none(hvd, mode, grouping):
    rank, size = hvd.rank(), hvd.size()
    n_a, n_b = 500, 37
    counts_a = [r for r in range(size)]  # rank 0 sends nothing
    counts_b = [size - r for r in range(size)]
    exchange = create("allgather", grouping, name=f"test.exchange.{mode}.{grouping}")

    def run():
        selections = []
        for n, counts, salt in ((n_a, counts_a, 0), (n_b, counts_b, 5)):
            i, v = _rank_selection(rank, counts[rank], n, salt)
            selections.append(Selection(values=tf.constant(v), indices=tf.constant(i)))
        return exchange.sparse_average(selections, [n_a, n_b], keys=[0, 1])

    # traced as the optimizer's step traces it: never converted by AutoGraph (a user's
    # tf.function reaches the exchange through apply(), which is not converted)
    averaged = tf.function(run, autograph=False)() if mode == "function" else run()

    for result, n, counts, salt in ((averaged[0], n_a, counts_a, 0), (averaged[1], n_b, counts_b, 5)):
        expected = np.zeros(n, "float64")
        for r in range(size):
            i, v = _rank_selection(r, counts[r], n, salt)
            np.add.at(expected, i, v)
        np.testing.assert_allclose(result.numpy(), expected / size, rtol=1e-6)


def _gradient(rank, step, shape):
    return np.random.RandomState(1000 * step + rank).randn(*shape).astype("float32")


@pytest.mark.parametrize("grouping", ["grouped", "layerwise"])
@pytest.mark.parametrize("density", [0.01, 0.2])
def test_optimizer_applies_the_mean_of_every_ranks_topk_with_error_feedback(hvd, density, grouping):
    rank, size = hvd.rank(), hvd.size()
    big = keras.Variable(np.ones(BIG, "float32"))
    small = keras.Variable(np.ones(SMALL, "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(1.0), density=density, grouping=grouping,
        name=f"agg_{int(density * 100)}_{grouping}",
    )

    @tf.function
    def step(g_big, g_small):
        optimizer.apply_gradients([(g_big, big), (g_small, small)])

    k = int(np.ceil(density * big.numpy().size))
    residuals = [np.zeros(big.numpy().size, "float32") for _ in range(size)]
    expected_big, expected_small = np.ones(BIG), np.ones(SMALL)
    for t in range(6):
        step(tf.constant(_gradient(rank, t, BIG)), tf.constant(_gradient(rank, t, SMALL) + rank))
        summed = np.zeros(big.numpy().size, "float64")
        for r in range(size):  # what every rank sent, recomputed here
            compensated = _gradient(r, t, BIG).ravel() + residuals[r]
            _, sent, residuals[r] = numpy_topk_split(compensated, k)
            summed += sent
        expected_big -= (summed / size).reshape(BIG)
        expected_small -= np.mean([_gradient(r, t, SMALL) + r for r in range(size)], axis=0)
        np.testing.assert_allclose(big.numpy(), expected_big, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(small.numpy(), expected_small, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(optimizer.residuals[0].numpy().ravel(), residuals[rank])

    digests = gather(hvd, digest([big.numpy(), small.numpy()]), name=f"agg.digest.{density}.{grouping}")
    assert len(set(digests)) == 1, "replicas differ"


@register_sparsifier("test_rank_count")
def _first_rank_entries(flat, k):
    """Rank r sends its r largest entries: rank 0 sends none, every rank a different number."""
    return topk(flat, sparse_hvd.rank()) if sparse_hvd.rank() > 0 else Selection(
        values=tf.zeros([0], flat.dtype), indices=tf.zeros([0], tf.int32)
    )


def test_optimizer_with_rank_dependent_counts_and_a_rank_sending_nothing(hvd):
    rank, size = hvd.rank(), hvd.size()
    variable = keras.Variable(np.zeros(BIG, "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(1.0), sparsifier="test_rank_count", name="rank_count"
    )
    residuals = [np.zeros(variable.numpy().size, "float32") for _ in range(size)]
    expected = np.zeros(variable.numpy().size)
    for t in range(4):
        optimizer.apply_gradients([(tf.constant(_gradient(rank, t, BIG)), variable)])
        summed = np.zeros_like(expected)
        for r in range(size):
            compensated = _gradient(r, t, BIG).ravel() + residuals[r]
            chosen = numpy_topk_indices(compensated, r)
            summed[chosen] += compensated[chosen]
            residuals[r] = compensated.copy()
            residuals[r][chosen] = 0.0
        expected -= summed / size
        np.testing.assert_allclose(variable.numpy().ravel(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(optimizer.residuals[0].numpy().ravel(), residuals[rank])
    stats = optimizer.communication_stats()
    assert stats["bytes_sent"] == 4 * rank * (4 + 4)


def test_threshold_aggregation_with_rank_dependent_counts_and_a_silent_rank(hvd):
    """Rank 0's gradients are too small to pass lambda at first: it sends nothing then."""
    rank, size = hvd.rank(), hvd.size()
    lam = 1.5
    variable = keras.Variable(np.zeros(BIG, "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(1.0), sparsifier=sparse_hvd.Threshold(threshold=lam, max_density=1.0),
        name="threshold_agg",
    )

    def grad(r, t):
        return _gradient(r, t, BIG) * (0.1 if r == 0 else 1.0 + r)

    residuals = [np.zeros(variable.numpy().size, "float32") for _ in range(size)]
    expected = np.zeros(variable.numpy().size)
    counts = []
    for t in range(4):
        optimizer.apply_gradients([(tf.constant(grad(rank, t)), variable)])
        summed = np.zeros_like(expected)
        step_counts = []
        for r in range(size):
            compensated = grad(r, t).ravel() + residuals[r]
            chosen = np.flatnonzero(np.abs(compensated) >= lam)
            step_counts.append(len(chosen))
            summed[chosen] += compensated[chosen]
            residuals[r] = compensated.copy()
            residuals[r][chosen] = 0.0
        counts.append(step_counts)
        expected -= summed / size
        np.testing.assert_allclose(variable.numpy().ravel(), expected, rtol=1e-5, atol=1e-5)
    assert counts[0][0] == 0, "rank 0 was meant to send nothing in the first step"
    assert len({c for step_counts in counts for c in step_counts[1:]}) > 1
    np.testing.assert_array_equal(optimizer.residuals[0].numpy().ravel(), residuals[rank])


def test_warmup_decisions_are_identical_on_every_rank(hvd):
    rank = hvd.rank()
    variable = keras.Variable(np.zeros(BIG, "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.1), density=sparse_hvd.WarmupDensity(0.01, 0.2, warmup_steps=4),
        name="warmup_ranks",
    )
    sent = []
    for t in range(6):
        optimizer.apply_gradients([(tf.constant(_gradient(rank, t, BIG)), variable)])
        sent.append(next(iter(optimizer.layer_stats().values()))["last_sent"])
    everyone = gather(hvd, sent, name="warmup.sent")
    assert all(s == everyone[0] for s in everyone)
    assert sent[0] == 600 and sent[-1] == 30


def test_adaptive_decisions_and_cost_model_are_identical_on_every_rank(hvd):
    rank = hvd.rank()
    policy = sparse_hvd.AdaptiveDensity(0.01, min_density=0.002, max_density=0.2, first_refresh=3,
                                        refresh_steps=4, probe_steps=8, probe_repeats=2)
    big = keras.Variable(np.zeros(BIG, "float32"))
    other = keras.Variable(np.zeros((40, 40), "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.1), density=policy, grouping="layerwise", name="adaptive_ranks")

    @tf.function
    def step(a, b):
        optimizer.apply_gradients([(a, big), (b, other)])

    for t in range(9):  # refreshes at steps 3 and 8
        step(tf.constant(_gradient(rank, t, BIG)), tf.constant(_gradient(rank, t, (40, 40))))
    mine = (policy.densities.numpy().tolist(), policy.cost_model.numpy().tolist(),
            [s["last_sent"] for s in optimizer.layer_stats().values()])
    everyone = gather(hvd, mine, name="adaptive.decisions")
    assert all(theirs == everyone[0] for theirs in everyone), everyone
    alpha, beta = policy.cost_model.numpy()
    assert alpha >= 0 and beta > 0
    assert all(0.002 - 1e-9 <= d <= 0.2 + 1e-9 for d in policy.densities.numpy())
    # probes sized from the payloads (8 bytes per entry at 1%: the larger is under 4 KiB, so
    # 1 KiB and 4 KiB), timed at build and at step 8 only, three allgathers of each size
    assert 8 * math.ceil(0.01 * np.prod(BIG)) < 4096
    assert optimizer.communication_stats()["measurement_bytes"] == 2 * 3 * (1024 + 4096)


def test_embedding_rows_on_the_dense_route_are_averaged_as_rows(hvd):
    rank, size = hvd.rank(), hvd.size()
    table = keras.Variable(np.zeros((30, 4), "float32"))  # 120 entries: dense route
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(1.0), name="rows")

    def rows(r):
        indices = np.array([r, r + 1, 7], "int32")  # row 7 from every rank, others overlap
        values = np.arange(12, dtype="float32").reshape(3, 4) * (r + 1)
        return indices, values

    indices, values = rows(rank)
    grad = tf.IndexedSlices(tf.constant(values), tf.constant(indices), tf.constant([30, 4]))
    optimizer.apply_gradients([(grad, table)])
    expected = np.zeros((30, 4))
    for r in range(size):
        i, v = rows(r)
        np.add.at(expected, i, -v / size)
    np.testing.assert_allclose(table.numpy(), expected, rtol=1e-6)
    assert len(set(gather(hvd, digest([table.numpy()]), name="rows.digest"))) == 1



def test_an_embeddings_repeated_rows_travel_once_per_rank(hvd):
    """A row looked up several times in a batch is one row per lookup in Keras' gradient; each
    rank sends it once, the sum of its repeats (bytes counted as sent), and the table gets the
    mean over ranks of every lookup's gradient; replicas identical."""
    rank, size = hvd.rank(), hvd.size()
    table = keras.Variable(np.zeros((30, 4), "float32"))  # 120 entries: dense route
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(1.0),
                                                      name="repeated_rows")

    def lookups(r):  # row r three times, row 7 twice, row 20 once
        indices = np.array([r, 7, r, 20, 7, r], "int32")
        values = (np.arange(24, dtype="float32").reshape(6, 4) + 1) * (r + 1)
        return indices, values

    indices, values = lookups(rank)
    optimizer.apply_gradients([(tf.IndexedSlices(tf.constant(values), tf.constant(indices),
                                                 (30, 4)), table)])
    expected = np.zeros((30, 4), "float64")
    for r in range(size):
        i, v = lookups(r)
        np.add.at(expected, i, -v.astype("float64") / size)
    np.testing.assert_allclose(table.numpy(), expected, rtol=1e-6)
    rows = len(set(indices.tolist()))  # 3: r, 7 and 20 (the rank tests run at under 7 ranks)
    assert optimizer.communication_stats()["bytes_sent"] == rows * (4 * 4 + 4)
    assert len(set(gather(hvd, digest([table.numpy()]), name="repeated_rows.digest"))) == 1


@pytest.mark.convergence_defaults
@pytest.mark.parametrize("budget", ["layer", "model"])
def test_the_default_warmup_and_a_model_wide_budget_apply_the_mean_of_every_selection(hvd, budget):
    """The defaults as users get them (the density warm-up) with per-layer and model-wide
    budgets: every rank's selections recomputed in NumPy, averaged, applied at lr 1; each
    rank's residual checked; the replicas bit-identical. The exchange is named: the default's
    steps before and in its first trial run dense (tests/distributed/test_auto_exchange.py)."""
    rank, size = hvd.rank(), hvd.size()
    shapes = [BIG, (40, 100)]  # 3,000 and 4,000 entries: both sparse
    variables = [keras.Variable(np.zeros(s, "float32")) for s in shapes]
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(1.0), density=0.01,
                                                      budget=budget, exchange="allgather",
                                                      name=f"defaults_{budget}")

    @tf.function
    def step(g0, g1):
        optimizer.apply_gradients([(g0, variables[0]), (g1, variables[1])])

    sizes = [math.prod(s) for s in shapes]
    residuals = [[np.zeros(n, "float32") for n in sizes] for _ in range(size)]
    expected = [np.zeros(n, "float64") for n in sizes]
    for t in range(4):
        # WarmupDensity(0.01, 0.1, 400)'s k (the default warm-up), computed independently
        ks = [math.ceil(n * 0.1 * 0.1 ** (t / 400) - 1e-9) for n in sizes]
        grads = lambda r: [_gradient(r, t, s) * (1 + 3 * i) for i, s in enumerate(shapes)]  # noqa: E731
        step(*[tf.constant(g) for g in grads(rank)])
        summed = [np.zeros(n, "float64") for n in sizes]
        for r in range(size):
            compensated = [g.ravel() + res for g, res in zip(grads(r), residuals[r])]
            if budget == "model":
                cut = np.sort(np.abs(np.concatenate(compensated)))[::-1][sum(ks) - 1]
                chosen = [np.flatnonzero(np.abs(c) >= cut) for c in compensated]
            else:
                chosen = [numpy_topk_indices(c, k) for c, k in zip(compensated, ks)]
            for i, (c, where) in enumerate(zip(compensated, chosen)):
                summed[i][where] += c[where]
                residuals[r][i] = c.copy()
                residuals[r][i][where] = 0.0
        for i in range(len(shapes)):
            expected[i] -= summed[i] / size
            np.testing.assert_allclose(variables[i].numpy().ravel(), expected[i], rtol=1e-5,
                                       atol=1e-5)
            np.testing.assert_array_equal(optimizer.residuals[i].numpy().ravel(),
                                          residuals[rank][i])
    digests = gather(hvd, digest([v.numpy() for v in variables]), name=f"defaults.{budget}")
    assert len(set(digests)) == 1, "replicas differ"


@pytest.mark.parametrize("grouping,staleness", [("grouped", 0), ("layerwise", 0), ("grouped", 1)])
def test_dense_exchange_applies_the_mean_of_every_ranks_whole_gradient(hvd, grouping, staleness):
    """exchange="dense": Horovod's allreduce of every gradient (nothing selected, residuals
    zero); what every rank applies is the NumPy mean of all ranks' gradients (one step late
    with staleness=1)."""
    rank, size = hvd.rank(), hvd.size()

    def gradients(r, step):
        rng = np.random.RandomState(1000 * step + r)
        return [rng.randn(*BIG).astype("float32"), rng.randn(*SMALL).astype("float32")]

    variables = [keras.Variable(np.ones(BIG, "float32")), keras.Variable(np.ones(SMALL, "float32"))]
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.1), density=0.01, exchange="dense", grouping=grouping,
        staleness=staleness, name=f"dense_{grouping}_{staleness}")
    expected = [np.ones(BIG, "float32"), np.ones(SMALL, "float32")]
    for step in range(3):
        optimizer.apply([tf.constant(g) for g in gradients(rank, step)], variables)
    for step in range(3 - staleness):
        every = [gradients(r, step) for r in range(size)]
        for j in range(2):
            mean = sum(g[j].astype("float64") for g in every) / size
            expected[j] = expected[j] - 0.1 * mean
    for variable, want in zip(variables, expected):
        np.testing.assert_allclose(variable.numpy(), want, rtol=1e-5, atol=1e-6)
    assert all(not np.any(r.numpy()) for r in optimizer.residuals)
    assert {s["route"] for s in optimizer.layer_stats().values()} == {"dense"}
    everyone = gather(hvd, digest([v.numpy() for v in variables]), f"dense.{grouping}.{staleness}")
    assert len(set(everyone)) == 1, "replicas differ"


@pytest.mark.parametrize("native", [True, False])
def test_dense_exchange_averages_are_the_rounded_quotient_of_the_sums(hvd, monkeypatch, native):
    """exchange="dense": float32 and float64 averages in one step, by the native
    divide-and-check (Horovod's sum, then one division) or without it (Horovod's average).
    With 2 workers the sum is exact in any order, so the update is NumPy's bit for bit."""
    if native and kernels.divide_checked() is None:
        pytest.skip("no native kernels in this run")
    if not native:
        monkeypatch.setattr(kernels, "divide_checked", lambda: None)
    rank, size = hvd.rank(), hvd.size()

    def gradients(r):
        rng = np.random.RandomState(77 + r)
        return [rng.randn(*BIG).astype("float32"), rng.randn(40, 30).astype("float64")]

    variables = [keras.Variable(np.zeros(BIG, "float32")),
                 keras.Variable(np.zeros((40, 30), "float64"), dtype="float64")]
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(1.0), exchange="dense", name=f"dense_divided_{native}")
    optimizer.apply([tf.constant(g) for g in gradients(rank)], variables)
    every = [gradients(r) for r in range(size)]
    for j, variable in enumerate(variables):
        total = every[0][j]
        for g in every[1:]:
            total = total + g[j]
        want = -(total / np.array(size, total.dtype))
        if size == 2:
            np.testing.assert_array_equal(variable.numpy(), want)
        else:
            np.testing.assert_allclose(variable.numpy(), want, rtol=1e-6)
    everyone = gather(hvd, digest([v.numpy() for v in variables]), f"dense_divided.{native}")
    assert len(set(everyone)) == 1, "replicas differ"


def test_local_clipping_clips_each_ranks_gradient_to_the_threshold_times_sqrt_n(hvd):
    """clipping="local", clipnorm c: every rank applies the mean over ranks of each rank's
    gradient clipped to c x sqrt(N) (NumPy), and the average is not clipped again; the ranks'
    gradients are independent, so that average's norm is about c, where dense's clipping of
    the average would put it."""
    rank, size = hvd.rank(), hvd.size()
    clipnorm, lr = 0.5, 0.1

    def gradient(r):
        return (np.random.RandomState(70 + r).randn(*BIG) * (r + 1)).astype("float64")

    variable = keras.Variable(np.ones(BIG, "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(lr, clipnorm=clipnorm), density=1.0, min_elements=0,
        clipping="local", name="local_clip")
    optimizer.apply([tf.constant(gradient(rank).astype("float32"))], [variable])
    threshold = clipnorm * math.sqrt(size)
    norms = [np.linalg.norm(gradient(r)) for r in range(size)]
    assert min(norms) > threshold  # every rank's gradient is clipped
    clipped = [gradient(r) * threshold / norm for r, norm in zip(range(size), norms)]
    average = sum(clipped) / size
    np.testing.assert_allclose(variable.numpy(), 1 - lr * average, rtol=1e-5, atol=1e-6)
    moved = np.linalg.norm((1 - variable.numpy().astype("float64")) / lr)
    # independent directions: |sum|^2 = N (c sqrt(N))^2 up to cross terms of order 1/sqrt(n)
    assert moved == pytest.approx(clipnorm, rel=0.05)
    everyone = gather(hvd, digest([variable.numpy()]), "local_clip")
    assert len(set(everyone)) == 1, "replicas differ"
