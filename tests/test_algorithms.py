"""Every sparsifier and density policy: selection invariants, bands, error feedback, configs."""

import math
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from sparse_hvd import kernels
from sparse_hvd.selection.density import WarmupDensity, get_density_policy
from sparse_hvd.selection.sparsifiers import ApproxTopK, RandomK, Threshold, get_sparsifier, serialize_sparsifier
from helpers import numpy_topk_indices

LAMBDA = 2.0  # for N(0, 1) data about 4.6% of entries pass

# Every registered sparsifier, with settings where the defaults would not exercise it here.
_SETTINGS = {
    "approx_topk": lambda: ApproxTopK(min_size=0, min_samples=64, seed=1),  # sample even small layers
    "randomk": lambda: RandomK(seed=3),
    "threshold": lambda: Threshold(threshold=LAMBDA, max_density=0.5),
}
SPARSIFIERS = {
    name: _SETTINGS.get(name, lambda name=name: get_sparsifier(name))
    for name in sparse_hvd.available_sparsifiers()
}


def _data(n, seed):
    return np.random.RandomState(seed).randn(n).astype("float32")


@pytest.mark.parametrize("name", sorted(SPARSIFIERS))
@pytest.mark.parametrize("n,k", [(100, 1), (5000, 50), (70000, 700)])
def test_selection_invariants(name, n, k):
    flat = _data(n, seed=n)
    selection = SPARSIFIERS[name]()(tf.constant(flat), k)
    indices = selection.indices.numpy()
    assert selection.indices.dtype == tf.int32
    assert len(np.unique(indices)) == len(indices), "an index was selected twice"
    assert np.all((0 <= indices) & (indices < n))
    np.testing.assert_array_equal(selection.values.numpy(), flat[indices])  # unchanged bits
    if name == "threshold":
        np.testing.assert_array_equal(np.sort(indices), np.flatnonzero(np.abs(flat) >= LAMBDA))
        assert not bool(selection.capped)
    elif name == "approx_topk":
        assert k / 2 <= len(indices) <= 2 * k and _is_a_top_set(flat, indices)
    else:
        assert len(indices) == k


def _is_a_top_set(flat, indices):
    """Every selected magnitude is >= every unselected one: the set is the top-m for its m."""
    chosen = np.zeros(flat.size, bool)
    chosen[indices] = True
    magnitude = np.abs(flat)
    return chosen.all() or not chosen.any() or magnitude[chosen].min() >= magnitude[~chosen].max()


@pytest.mark.parametrize("seed", range(12))
def test_approx_topk_sends_a_top_set_within_its_band_whether_or_not_the_estimate_misses(seed):
    n, k = 20000, 200
    flat = (_data(n, seed) * np.random.RandomState(seed + 100).exponential(size=n)).astype("float32")
    # A tiny sample makes the estimated cut miss often, so both branches run across seeds.
    sparsifier = ApproxTopK(sample_fraction=1e-4, min_samples=8, band=1.5, min_size=0, seed=seed)
    indices = sparsifier(tf.constant(flat), k).indices.numpy()
    assert 200 / 1.5 <= len(indices) <= 200 * 1.5
    assert _is_a_top_set(flat, indices)
    if len(indices) == k:
        np.testing.assert_array_equal(np.sort(indices), numpy_topk_indices(flat, k))


def test_approx_topk_achieves_the_requested_density_on_average():
    n, k = 200000, 2000
    sparsifier = ApproxTopK(seed=0)  # defaults: 0.2% sample (at least 1024), band 2
    counts = [len(sparsifier(tf.constant(_data(n, seed)), k).indices) for seed in range(40)]
    assert all(k / 2 <= c <= 2 * k for c in counts)
    assert abs(np.mean(counts) / k - 1) < 0.1, np.mean(counts)


@pytest.mark.parametrize("name", ["threshold", "approx_topk"])
def test_native_xla_and_plain_paths_give_the_same_bits(name, monkeypatch):
    make = {
        "threshold": lambda fuse: Threshold(threshold=1.0, max_density=0.5, fuse=fuse),
        "approx_topk": lambda fuse: ApproxTopK(min_size=0, seed=5, fuse=fuse),
    }[name]
    native = kernels.compensate_cut()
    paths = {"xla": (True, None), "plain": (False, None)}
    if native is not None:
        paths["native"] = (True, native)
    results = {}
    for path, (fuse, op) in paths.items():
        monkeypatch.setattr(kernels, "compensate_cut", lambda op=op: op)
        rng = np.random.RandomState(9)
        variable = keras.Variable(np.zeros((300, 200), "float32"))
        optimizer = sparse_hvd.SparseDistributedOptimizer(
            keras.optimizers.SGD(1.0), density=0.01, sparsifier=make(fuse))
        step = tf.function(lambda g: optimizer.apply_gradients([(g, variable)]))
        for _ in range(5):
            step(tf.constant(rng.randn(300, 200).astype("float32")))
        results[path] = (variable.numpy(), optimizer.residuals[0].numpy())
    for path, (weights, residual) in results.items():
        np.testing.assert_array_equal(weights, results["plain"][0], err_msg=path)
        np.testing.assert_array_equal(residual, results["plain"][1], err_msg=path)


def test_the_native_kernel_is_built_and_loads():
    if os.environ.get("SPARSE_HVD_NATIVE") == "0":
        pytest.skip("this run tests the TensorFlow fallback (SPARSE_HVD_NATIVE=0)")
    path, problem = kernels.status()
    assert path is not None, f"the native kernels {problem}"
    assert kernels.compensate_cut() is not None
    op = kernels.compensate_cut()
    g = tf.constant([0.5, -2.0, 1.0, 3.0, -0.25], tf.float32)
    r = tf.constant([0.5, 0.5, -0.5, 0.0, 0.0], tf.float32)
    remainder, indices, values, rejected, finite = op(g, r, tf.constant(1.0),
                                                      tf.constant(10, tf.int64))
    np.testing.assert_array_equal(indices.numpy(), [0, 1, 3])
    np.testing.assert_array_equal(values.numpy(), [1.0, -1.5, 3.0])
    np.testing.assert_array_equal(remainder.numpy(), [0.0, 0.0, 0.5, 0.0, -0.25])
    assert not bool(rejected) and bool(finite)
    *_, rejected, finite = op(g, r, tf.constant(1.0), tf.constant(2, tf.int64))
    assert bool(rejected) and bool(finite)
    # the same pass says whether every compensated entry is finite, in every shard
    for bad in (np.nan, np.inf, -np.inf):
        big = np.ones(200_000, np.float32)
        big[150_001] = bad
        *_, finite = op(tf.constant(big), tf.zeros_like(big), tf.constant(2.0),
                        tf.constant(10, tf.int64))
        assert not bool(finite), bad
        *_, finite = kernels.compensate_topk()(
            tf.constant(big), tf.zeros_like(big), tf.constant(0.5), tf.constant(3, tf.int64),
            tf.constant(3, tf.int64), tf.constant(300_000, tf.int64))
        assert not bool(finite), bad


def test_threshold_cap_keeps_the_largest_and_reports_it():
    flat = _data(1000, 5)
    selection = Threshold(threshold=0.01, max_density=0.02)(tf.constant(flat), 1)
    assert bool(selection.capped)
    np.testing.assert_array_equal(np.sort(selection.indices.numpy()), numpy_topk_indices(flat, 20))


def test_threshold_may_send_nothing():
    selection = Threshold(threshold=100.0)(tf.constant(_data(2000, 1)), 10)
    assert selection.indices.shape[0] == 0 and not bool(selection.capped)


POLICIES = {
    "constant": lambda: 0.01,
    "warmup": lambda: WarmupDensity(0.01, initial_density=0.3, warmup_steps=20),
    "adaptive": lambda: sparse_hvd.AdaptiveDensity(0.01, first_refresh=5, refresh_steps=10),
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("name", sorted(SPARSIFIERS))
def test_error_feedback_invariant_for_every_sparsifier_and_policy(name, policy):
    rng = np.random.RandomState(11)
    shape = (60, 50)
    start = rng.randn(*shape)
    variable = keras.Variable(start, dtype="float64")
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(1.0), density=POLICIES[policy](), sparsifier=SPARSIFIERS[name](),
        grouping="layerwise" if policy == "adaptive" else "grouped",
    )
    step = tf.function(lambda g: optimizer.apply_gradients([(g, variable)]))
    total = np.zeros(shape)
    for _ in range(40):
        grad = rng.randn(*shape)
        total += grad
        step(tf.constant(grad))
    sent = start - variable.numpy()
    np.testing.assert_allclose(sent + optimizer.residuals[0].numpy(), total, rtol=1e-9, atol=1e-9)


def test_warmup_density_decays_exponentially_to_the_target():
    policy = WarmupDensity(0.01, initial_density=0.25, warmup_steps=100)
    n = 10000
    ks = [int(policy.k(0, n, step)) for step in range(0, 130)]
    expected = [math.ceil(0.25 * (0.01 / 0.25) ** (t / 100) * n - 1e-9) for t in range(100)]
    assert ks[:100] == expected
    assert ks[100:] == [100] * 30
    assert all(a >= b for a, b in zip(ks, ks[1:]))


def test_warmup_density_drives_the_optimizer_k_each_step():
    variable = keras.Variable(np.zeros((100, 100), "float32"))
    policy = WarmupDensity(0.001, initial_density=0.1, warmup_steps=5)
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), density=policy)
    sent = []
    for _ in range(8):
        optimizer.apply_gradients([(tf.random.normal((100, 100)), variable)])
        sent.append(next(iter(optimizer.layer_stats().values()))["last_sent"])
    assert sent == [int(policy.k(0, 10000, t)) for t in range(8)]
    assert sent[0] == 1000 and sent[5:] == [10, 10, 10]


def test_threshold_in_the_optimizer_counts_capped_selections():
    variable = keras.Variable(np.zeros((50, 40), "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.1), sparsifier=Threshold(threshold=1e-6, max_density=0.01)
    )
    for _ in range(3):
        optimizer.apply_gradients([(tf.random.normal((50, 40)), variable)])
    stats = optimizer.communication_stats()
    assert stats["capped_selections"] == 3
    assert stats["bytes_sent"] == 3 * 20 * 8


def test_without_error_feedback_the_unsent_part_is_dropped():
    variable = keras.Variable(np.zeros((50, 40), "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(1.0), density=0.01, error_feedback=False
    )
    grad = np.random.RandomState(2).randn(50, 40).astype("float32")
    optimizer.apply_gradients([(tf.constant(grad), variable)])
    optimizer.apply_gradients([(tf.constant(grad), variable)])
    chosen = numpy_topk_indices(grad.ravel(), 20)
    expected = np.zeros(2000, "float32")
    expected[chosen] = -2 * grad.ravel()[chosen]
    np.testing.assert_array_equal(variable.numpy().ravel(), expected)
    assert np.count_nonzero(optimizer.residuals[0].numpy()) == 0


def test_configs_round_trip_for_sparsifiers_and_policies():
    for sparsifier in (Threshold(0.5, max_density=0.2), ApproxTopK(band=1.2, fuse=False), RandomK(seed=4)):
        clone = get_sparsifier(serialize_sparsifier(sparsifier))
        assert type(clone) is type(sparsifier) and clone.get_config() == sparsifier.get_config()
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.1), density=WarmupDensity(0.001, 0.2, 50),
        sparsifier=Threshold(0.3), error_feedback=False,
    )
    clone = sparse_hvd.SparseDistributedOptimizer.from_config(optimizer.get_config())
    assert clone.get_config() == optimizer.get_config()
    assert isinstance(clone.density_policy, WarmupDensity) and clone.density == 0.001
    assert isinstance(clone.sparsifier, Threshold) and clone.error_feedback is False


def test_algorithm_settings_errors_name_the_argument():
    with pytest.raises(ValueError, match="'threshold' needs settings.*Threshold"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), sparsifier="threshold")
    with pytest.raises(ValueError, match="`threshold` must be a positive number"):
        Threshold(threshold=-1.0)
    with pytest.raises(ValueError, match="`max_density` must be in"):
        Threshold(threshold=1.0, max_density=0)
    with pytest.raises(ValueError, match="`initial_density`.*must be >= `density`"):
        WarmupDensity(0.1, initial_density=0.01)
    with pytest.raises(ValueError, match="`warmup_steps` must be a positive int"):
        WarmupDensity(0.01, warmup_steps=0)
    with pytest.raises(ValueError, match="Unknown density policy 'cosine'"):
        get_density_policy({"class_name": "cosine"})
    with pytest.raises(TypeError, match="`sparsifier` must be a registered name"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), sparsifier=3)


def test_momentum_correction_recomputed_in_numpy():
    """DGC: u = m*u + g; c = u + r; send top-k of c; r = c - sent; u[sent] = 0; w -= lr*sent.
    The small bias (dense route) gets ordinary momentum on its (averaged) gradient."""
    m, lr = 0.9, 0.5
    rng = np.random.RandomState(21)
    kernel = keras.Variable(np.zeros((50, 40)), dtype="float64")
    bias = keras.Variable(np.zeros(40), dtype="float64")
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(lr), density=0.01, momentum_correction=m
    )
    u, r, w = np.zeros(2000), np.zeros(2000), np.zeros(2000)
    u_bias, w_bias = np.zeros(40), np.zeros(40)
    for _ in range(15):
        g, g_bias = rng.randn(2000), rng.randn(40)
        optimizer.apply_gradients([(tf.constant(g.reshape(50, 40)), kernel), (tf.constant(g_bias), bias)])
        u = m * u + g
        c = u + r
        chosen = numpy_topk_indices(c, 20)
        sent = np.zeros(2000)
        sent[chosen] = c[chosen]
        r = c - sent
        u[chosen] = 0.0
        w -= lr * sent
        u_bias = m * u_bias + g_bias
        w_bias -= lr * u_bias
        np.testing.assert_allclose(kernel.numpy().ravel(), w, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(bias.numpy(), w_bias, rtol=1e-12, atol=1e-12)
    assert len(optimizer.local_variables) == 4


def test_momentum_correction_refuses_a_second_momentum():
    with pytest.raises(ValueError, match="momentum=0.9, which would apply it twice"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), momentum_correction=0.9)
    with pytest.raises(ValueError, match="wrap keras.optimizers.SGD"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.Adam(), momentum_correction=0.9)
    with pytest.raises(ValueError, match=r"`momentum_correction` must be a number in \[0, 1\)"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), momentum_correction=1.0)
