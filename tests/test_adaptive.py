"""The layer-wise adaptive density policy (LAGS-SGD): cost model, density choice, the step."""

import math
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import ancestors, training_step
import sparse_hvd
from sparse_hvd.selection.adaptive import AdaptiveDensity, fit_latency_bandwidth, solve_densities


def test_fit_recovers_latency_and_bandwidth_of_an_exact_line():
    sizes = np.array([4096, 65536, 524288, 2097152], "float64")
    alpha, beta = fit_latency_bandwidth(sizes, 2e-4 + 1e-9 * sizes)
    assert float(alpha) == pytest.approx(2e-4, rel=1e-9)
    assert float(beta) == pytest.approx(1e-9, rel=1e-9)


def test_fit_clamps_to_a_physical_model():
    sizes = np.array([1.0, 2.0, 3.0])
    alpha, beta = fit_latency_bandwidth(sizes, np.array([3.0, 2.0, 1.0]))  # time falling with size
    assert float(beta) > 0 and float(alpha) >= 0
    alpha, _ = fit_latency_bandwidth(sizes, np.array([0.0, 5.0, 10.0]))  # negative intercept
    assert float(alpha) == 0.0


N = [10000, 10000, 500, 10000]
SPARSE = [True, True, False, True]
PER_ENTRY = [8, 8, 4, 8]


def _solve(windows, alpha=1e-3, beta=1e-8, budget=None, lo=0.001, hi=0.1):
    return solve_densities(np.array(windows, "float64"), alpha, beta, N, PER_ENTRY, SPARSE, lo, hi, budget).numpy()


def test_each_layer_gets_what_hides_in_its_window_within_the_clamp():
    # layer 0: no window -> the minimum; layers 1 and 3: far more fits than max -> the maximum;
    # layer 2 is dense -> 1.0. The three exchanges (3 ms) fit in the longest window (0.5 s).
    d = _solve([0.0, 0.0011, 0.5, 0.0012])
    np.testing.assert_allclose(d, [0.001, 0.1, 1.0, 0.1])


def test_intermediate_densities_follow_the_window_and_the_shared_link():
    windows = [0.0, 1.02e-3, 0.0, 1.04e-3]
    d = _solve(windows)
    raw = [0.001, (0.02e-3 / 1e-8) / 8e4, 1.0, (0.04e-3 / 1e-8) / 8e4]  # 0.025 and 0.05
    total_time = sum(1e-3 + 1e-8 * raw[i] * N[i] * 8 for i in (0, 1, 3))
    scale = min(1.0, max(windows) / total_time)
    assert scale < 1.0  # three exchanges at 1 ms latency each do not fit in 1.04 ms
    expected = [max(0.001, raw[0] * scale), max(0.001, raw[1] * scale), 1.0, max(0.001, raw[3] * scale)]
    np.testing.assert_allclose(d, expected, rtol=1e-9)


def test_budget_scales_the_payload_down():
    d = _solve([10.0, 10.0, 10.0, 10.0], budget=4000.0)  # everything fits: max 0.1 each
    payload = 3 * 0.1 * 1e4 * 8
    np.testing.assert_allclose(d, [0.1 * 4000 / payload] * 2 + [1.0] + [0.1 * 4000 / payload])


def _model_and_optimizer(policy, grouping="layerwise", **options):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10),
    ])
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.05), density=policy, grouping=grouping, **options)
    model.compile(optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    return model, optimizer


def test_the_policy_measures_the_step_and_re_decides_at_refresh():
    policy = AdaptiveDensity(0.01, min_density=0.002, max_density=0.05, first_refresh=3, refresh_steps=5)
    model, optimizer = _model_and_optimizer(policy)
    rng = np.random.RandomState(0)
    x, y = rng.randn(160, 64).astype("float32"), rng.randint(0, 10, 160)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)  # 5 steps: refresh at 3
    densities = policy.densities.numpy()
    sparse = [v["route"] == "sparse" for v in optimizer.layer_stats().values()]
    assert sparse == [True, False, True, False, True, False]  # kernels of 16384, 32768, 1280
    assert np.all(densities[np.array(sparse)] >= 0.002 - 1e-9)
    assert np.all(densities[np.array(sparse)] <= 0.05 + 1e-9)
    assert not np.allclose(densities[np.array(sparse)], 0.01), "the refresh did not decide anything"
    # each window is the backward time left after that gradient existed (the last one's is 0
    # in each step, and the executor decides which that is; smoothed over the steps)
    windows = policy.windows.numpy()
    assert np.all(windows >= 0.0) and np.any(windows > 0.0)
    # the k used in the step follows the stored densities
    last = optimizer.layer_stats()
    for (path, stats), density in zip(last.items(), densities):
        if stats["route"] == "sparse":
            assert stats["last_sent"] == math.ceil(float(np.float32(density)) * stats["elements"])
            assert stats["target_density"] == pytest.approx(density)


def test_each_gradients_timestamp_waits_for_that_gradient_alone():
    """The backward windows come from one timestamp per gradient, each taken when its
    gradient exists: in the traced step a stamp depends on no other gradient's stamp (with
    ``tf.timestamp`` each waited for the one traced before it, and every window but one read
    about zero)."""
    if sparse_hvd.kernels.time_after() is None:
        pytest.skip("without the native kernels the stamps are tf.timestamp (runtime.stamps)")
    policy = AdaptiveDensity(0.01, min_density=0.002, max_density=0.05)
    model, optimizer = _model_and_optimizer(policy)
    step = training_step(model, optimizer, np.ones([8, 64], "float32"), np.zeros([8], "int64"))
    step()
    # the gradients' stamps (the selections' own, later, wait for their gradient's)
    stamps = [op for op in step.get_concrete_function().graph.get_operations()
              if op.type == "SparseHvdTimeAfter"
              and op.inputs[0].op.name.startswith("gradient_tape/")]
    assert len(stamps) >= len(model.trainable_variables)
    for stamp in stamps:
        assert list(stamp.control_inputs) == []
        waited = [op.name for op in ancestors(stamp) if op.type == "SparseHvdTimeAfter"]
        assert waited == [], f"{stamp.name} waits for {waited}"


@pytest.mark.parametrize("exchange,compression", [("allgather", None), ("allgather", "float16"),
                                                  ("compact_allgather", None),
                                                  ("compact_allgather", "float16")])
def test_the_policy_prices_an_entry_as_its_exchange_sends_it(exchange, compression):
    """The payload a window can hide is divided by what an entry costs on the wire: a value
    and an int32 index (4 + 4 bytes, 2 + 4 with float16), or coded: the exponent's 8 (float16:
    5) bits down to value_coding's estimate, the index about 2 + log2(1 / density) bits."""
    from sparse_hvd.exchanges.value_coding import EXPONENT_BITS

    policy = AdaptiveDensity(0.01)
    model, optimizer = _model_and_optimizer(policy, exchange=exchange, compression=compression)
    optimizer.build(model.trainable_variables)
    value = 2 if compression else 4
    if exchange == "allgather":
        expected = value + 4
    else:
        exponent = 5 if compression else 8
        expected = value - (exponent - EXPONENT_BITS) / 8 + (2 + math.log2(100)) / 8
    sparse = [v["route"] == "sparse" for v in optimizer.layer_stats().values()]
    costs = [c for c, s in zip(policy._bytes_per_entry, sparse) if s]
    assert costs and all(c == pytest.approx(expected) for c in costs)
    if exchange == "compact_allgather":
        assert expected < 0.6 * (value + 4)  # about twice the entries in the same window


def test_adaptive_density_keeps_the_error_feedback_invariant():
    policy = AdaptiveDensity(0.01, first_refresh=2, refresh_steps=3)
    variable = keras.Variable(np.zeros((80, 60)), dtype="float64")
    other = keras.Variable(np.zeros((60, 50)), dtype="float64")
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(1.0), density=policy, grouping="layerwise")
    step = tf.function(lambda a, b: optimizer.apply_gradients([(a, variable), (b, other)]))
    rng = np.random.RandomState(4)
    total = np.zeros((80, 60))
    for _ in range(10):
        g = rng.randn(80, 60)
        total += g
        step(tf.constant(g), tf.constant(rng.randn(60, 50)))
    np.testing.assert_allclose(-variable.numpy() + optimizer.residuals[0].numpy(), total, rtol=1e-9, atol=1e-9)


def test_adaptive_config_round_trips_and_densities_are_saved(tmp_path):
    policy = AdaptiveDensity(0.01, min_density=0.002, max_density=0.05, first_refresh=2)
    model, optimizer = _model_and_optimizer(policy)
    clone = sparse_hvd.SparseDistributedOptimizer.from_config(optimizer.get_config())
    assert clone.density_policy.get_config() == policy.get_config()
    rng = np.random.RandomState(1)
    model.fit(rng.randn(128, 64).astype("float32"), rng.randint(0, 10, 128), batch_size=32, verbose=0)
    path = str(tmp_path / "adaptive.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(loaded.optimizer.density_policy.densities.numpy(), policy.densities.numpy())


def test_adaptive_without_layerwise_exchange_warns_and_bad_settings_fail():
    with pytest.warns(UserWarning, match="grouping='layerwise'"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), density=AdaptiveDensity())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), density=AdaptiveDensity(), grouping="layerwise")
    with pytest.raises(ValueError, match="`min_density` <= `density` <= `max_density`"):
        AdaptiveDensity(0.2, max_density=0.1)
    with pytest.raises(ValueError, match="`refresh_steps` must be a positive int"):
        AdaptiveDensity(refresh_steps=0)
    with pytest.raises(ValueError, match="`budget_bytes` must be positive"):
        AdaptiveDensity(budget_bytes=-5)


def test_probe_sizes_bracket_the_jobs_payloads_within_limits():
    from sparse_hvd.selection.adaptive import probe_sizes_for

    assert probe_sizes_for([12_000, 300_000, 80]) == (1024, 300_000)
    assert probe_sizes_for([100_000, 200_000]) == (65536, 262144)  # 4x apart at least
    assert probe_sizes_for([5000, 50_000_000]) == (5000, 1 << 20)  # never megabyte probes
    assert probe_sizes_for([2000]) == (2000, 8000)  # one layer: still two sizes, 4x apart
    assert probe_sizes_for([]) == (4096, 16384)


def test_probe_settings_are_checked_and_round_trip():
    policy = AdaptiveDensity(refresh_steps=20)
    assert policy.probe_steps == 200 and policy.probe_bytes is None
    assert AdaptiveDensity.from_config(policy.get_config()).get_config() == policy.get_config()
    with pytest.raises(ValueError, match="`probe_steps` must be a positive int"):
        AdaptiveDensity(probe_steps=0)
    with pytest.raises(ValueError, match="`probe_bytes` needs at least two different sizes"):
        AdaptiveDensity(probe_bytes=(4096, 4096))


def test_one_process_sends_no_probes():
    policy = AdaptiveDensity(0.01, first_refresh=2, refresh_steps=2, probe_steps=2)
    model, optimizer = _model_and_optimizer(policy)
    rng = np.random.RandomState(1)
    model.fit(rng.randn(128, 64).astype("float32"), rng.randint(0, 10, 128), batch_size=32, verbose=0)
    assert optimizer.communication_stats()["measurement_bytes"] == 0
