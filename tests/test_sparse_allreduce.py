"""The sparse allreduce's pieces in one process: regions, the threshold rule, the choice of
exchange, and the options it refuses."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from helpers import native_op
from sparse_hvd import kernels
from sparse_hvd.exchanges.global_threshold import (FIRST_MISS, LEVELS, MAX_GROWTH, Forecast,
                                                   next_thresholds)
from sparse_hvd.exchanges.regions import even_boundaries, owners_of
from sparse_hvd.selection.order_statistics import kth_largest_per_segment


def test_even_boundaries_cover_the_index_space():
    assert even_boundaries(10, 3) == [0, 3, 6, 10]
    assert even_boundaries(2, 4) == [0, 0, 1, 1, 2]  # more ranks than entries: empty regions


def test_each_index_goes_to_the_region_that_holds_it_and_empty_regions_get_nothing():
    boundaries = tf.constant([0, 4, 4, 9, 12], tf.int64)  # rank 1's region is empty
    owners = owners_of(tf.constant([0, 3, 4, 8, 9, 11], tf.int64), boundaries)
    np.testing.assert_array_equal(owners.numpy(), [0, 0, 2, 2, 3, 3])


@pytest.fixture(params=["native", "tensorflow"])
def forecast_path(request, monkeypatch):
    """Each threshold test runs on the native op and on the TensorFlow ops."""
    if request.param == "native":
        native_op(kernels.next_thresholds)
    else:
        monkeypatch.setattr(kernels, "next_thresholds", lambda: None)
    return request.param


def _threshold(theta, kept, counts, budget, last_cut=0.0, growth=0.0, miss=FIRST_MISS):
    """(cut, next theta, last cut, growth, miss) of one variable as Python floats."""
    cut, theta, forecast = next_thresholds(
        tf.constant([theta], tf.float64),
        Forecast(*(tf.constant([x], tf.float64) for x in (last_cut, growth, miss))),
        tf.constant(kept, tf.float64), tf.constant([0, len(kept)], tf.int32),
        tf.constant([counts], tf.int32), tf.constant([budget]))
    return (float(cut[0]), float(theta[0])) + tuple(float(x[0]) for x in forecast)


def test_the_first_cut_is_followed_with_the_first_margin_and_no_growth(forecast_path):
    # theta 0: everything was kept; the cut is the k-th largest; no growth is known yet and
    # nothing was forecast, so nothing is judged
    assert _threshold(0.0, [5.0, 1.0, 3.0, 2.0], [4] * 8, 3) == (
        2.0, 2.0 / (FIRST_MISS * FIRST_MISS), 2.0, 0.0, FIRST_MISS)


def test_enough_kept_forecasts_the_cut_grown_as_it_grew_within_the_margin_of_the_miss(
        forecast_path):
    # the previous cut 1.6, this one 2.0: growth 1.25. Theta 1.8 was forecast as 1.8 x 1.1^2
    # = 2.178 against the cut 2.0: missed by 1.089, more than sqrt(1.1): the miss is 1.089
    cut, theta, last, growth, miss = _threshold(1.8, [5.0, 3.0, 2.0], [3] * 8, 3, last_cut=1.6,
                                                growth=1.1, miss=1.1)
    assert (cut, last, growth, miss) == (2.0, 2.0, 2.0 / 1.6, 1.8 * 1.1 * 1.1 / 2.0)
    assert theta == 2.0 * (2.0 / 1.6) / (miss * miss)
    # a forecast 1.5 x 1.01^2 against the cut 2.0 missed by more: that is the new miss
    _, theta, _, _, miss = _threshold(1.5, [5.0, 3.0, 2.0], [3] * 8, 3, last_cut=2.0,
                                      growth=1.0)
    predicted = 1.5 * FIRST_MISS * FIRST_MISS
    assert miss == 2.0 / predicted and theta == 2.0 * 1.0 / (miss * miss)
    # growth beyond MAX_GROWTH either way is held to it
    assert _threshold(0.5, [5.0, 3.0, 2.0], [3] * 8, 3, last_cut=1.0, growth=1.0)[3] == 1.25
    assert _threshold(0.5, [5.0, 3.0, 2.0], [3] * 8, 3, last_cut=4.0, growth=1.0)[3] == 0.8


def test_too_few_kept_applies_them_all_and_lowers_theta_to_where_about_k_sums_were(forecast_path):
    assert len(LEVELS) == 8 and LEVELS[1] == 2 ** -(1 / 1024)
    # 2 kept, k = 5: 4 sums reach the third level below 1 (2^-1/64), 6 the fourth (2^-1/16):
    # the straight line through (2^-1/64, 4) and (2^-1/16, 6) reaches 5 half-way. The forecast
    # 8 x 1.01^2 missed by its distance to that; the cut is unknown
    lowered = 8.0 * (2 ** -(1 / 64) - (2 ** -(1 / 64) - 2 ** -(1 / 16)) * 0.5)
    cut, theta, last, growth, miss = _threshold(8.0, [9.0, 8.5], [2, 3, 3, 4, 6, 9, 9, 9], 5,
                                                last_cut=7.5, growth=1.05)
    assert (cut, last, growth) == (0.0, 0.0, 1.05)
    assert miss == 8.0 * FIRST_MISS * FIRST_MISS / lowered
    assert theta == lowered * 1.05 / (miss * miss)
    # k sums at the first level below 1 exactly: the line ends there
    first = 8.0 * (1.0 - (1.0 - 2 ** -(1 / 1024)) * 1.0)
    assert _threshold(8.0, [9.0, 8.5], [2, 4, 5, 6, 7, 9, 9, 9], 4)[1] == (
        first / (FIRST_MISS * FIRST_MISS))
    # not even a quarter of theta has k sums: a quarter, and the search goes on (no growth
    # known: nothing judged, the growth taken as 1)
    assert _threshold(8.0, [9.0], [1, 1, 1, 1, 1, 2, 2, 2], 4) == (
        0.0, 2.0 / (FIRST_MISS * FIRST_MISS), 0.0, 0.0, FIRST_MISS)
    # theta 0 keeps every sum: fewer than k exist, it stays 0
    assert _threshold(0.0, [1.0], [1] * 8, 4)[:2] == (0.0, 0.0)


def test_a_miss_narrows_by_its_square_root_each_step_it_is_not_exceeded(forecast_path):
    # forecast 2.0 x 1.21^2 = 2.9282, cut 2.9282 exactly: missed by 1, the miss falls to 1.1
    predicted = 2.0 * 1.21 * 1.21
    cut, _, _, _, miss = _threshold(2.0, [predicted + 1, predicted], [2] * 8, 2, last_cut=2.5,
                                    growth=1.2, miss=1.21)
    assert (cut, miss) == (predicted, 1.1)


def test_every_variable_at_once_is_each_variable_alone(forecast_path):
    """Steps 1-4 over several variables (some with too few kept sums, one with none) give each
    one what they give that variable alone."""
    rng = np.random.RandomState(3)
    lengths, budgets = [7, 0, 3, 12, 5, 6], [4, 2, 5, 12, 1, 2]
    thetas = [1.5, 0.0, 2.0, 0.0, 0.7, 1.2]
    last_cuts, growths = [1.4, 0.0, 2.1, 0.0, 0.0, 1.0], [1.05, 0.0, 1.1, 0.0, 1.02, 0.0]
    misses = [1.01, 1.01, 1.2, 1.01, 1.003, 1.05]
    counts = rng.randint(0, 20, size=(6, len(LEVELS)))
    kept = [np.abs(rng.randn(n)) * 3 for n in lengths]
    alone = [_threshold(*args) for args in zip(thetas, kept, counts.tolist(), budgets,
                                                last_cuts, growths, misses)]
    cut, theta, forecast = next_thresholds(
        tf.constant(thetas, tf.float64),
        Forecast(*(tf.constant(x, tf.float64) for x in (last_cuts, growths, misses))),
        tf.constant(np.concatenate(kept), tf.float64),
        tf.constant(np.cumsum([0] + lengths), tf.int32), tf.constant(counts, tf.int32),
        tf.constant(budgets))
    together = np.stack([cut.numpy(), theta.numpy()] + [x.numpy() for x in forecast], 1)
    np.testing.assert_array_equal(together, alone)


def _forecast_inputs(rng, lengths):
    """Random forecast inputs for variables with ``lengths`` kept sums: thetas, last cuts,
    growths and misses each 0 (or 1.01) in about a third of the variables, budgets from 0 to
    beyond the length, magnitudes with ties."""
    variables = len(lengths)

    def sometimes(values, other):
        return np.where(rng.rand(variables) < 0.35, other, values)

    thetas = sometimes(np.abs(rng.randn(variables)) * 2, 0.0)
    state = [sometimes(np.abs(rng.randn(variables)) * 2, 0.0),
             sometimes(rng.uniform(0.8, 1.25, variables), 0.0),
             sometimes(rng.uniform(1.0, 1.5, variables), FIRST_MISS)]
    kept = np.round(np.abs(rng.randn(sum(lengths))) * 8) / 4  # ties
    cuts = np.cumsum([0] + list(lengths))
    counts = np.sort(rng.randint(0, 40, size=(variables, len(LEVELS))), 1)
    budgets = rng.randint(0, 30, size=variables)
    return (tf.constant(thetas, tf.float64), Forecast(*(tf.constant(x, tf.float64) for x in state)),
            tf.constant(kept, tf.float64), tf.constant(cuts, tf.int32),
            tf.constant(counts, tf.int32), tf.constant(budgets, tf.int32))


def _flat(result):
    cut, theta, forecast = result
    return np.stack([cut.numpy(), theta.numpy()] + [x.numpy() for x in forecast])


@pytest.mark.parametrize("whole", [False, True])
def test_the_native_forecast_is_the_tensorflow_ops_bit_for_bit(whole, monkeypatch):
    """Many variables, each case of steps 1-4 among them (enough kept or not, no theta, no
    last cut, no growth, budgets of 0), per variable and for the model as one: the native op
    gives the TensorFlow ops' bits."""
    native_op(kernels.next_thresholds)
    rng = np.random.RandomState(11)
    for trial in range(20):
        lengths = rng.randint(0, 30, size=rng.randint(1, 9))
        inputs = _forecast_inputs(rng, lengths)
        native = _flat(next_thresholds(*inputs, whole=whole))
        with monkeypatch.context() as patch:
            patch.setattr(kernels, "next_thresholds", lambda: None)
            expected = _flat(next_thresholds(*inputs, whole=whole))
        np.testing.assert_array_equal(native.view(np.int64), expected.view(np.int64),
                                      err_msg=f"trial {trial}, lengths {list(lengths)}")


def test_the_model_as_one_variable_is_one_forecast_over_everything(forecast_path):
    """``whole``: every slot gets what the first slot's state gives over all the kept sums,
    the counts and the budgets summed."""
    rng = np.random.RandomState(12)
    thetas, forecast, kept, _, counts, budgets = _forecast_inputs(rng, [5, 0, 9, 4])
    expected = _flat(next_thresholds(
        thetas[:1], Forecast(*(x[:1] for x in forecast)), kept,
        tf.constant([0, int(tf.size(kept))], tf.int32), tf.reduce_sum(counts, 0, keepdims=True),
        tf.reduce_sum(budgets, keepdims=True)))
    got = _flat(next_thresholds(thetas, forecast, kept, None, counts, budgets, whole=True))
    np.testing.assert_array_equal(got, np.repeat(expected, 4, axis=1))


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(cuts=tf.constant([0, 5, 3, 9], tf.int32)), "cuts[2] = 3"),
    (lambda a: a.update(cuts=tf.constant([0, 9], tf.int32)), "cuts must have one more entry"),
    (lambda a: a.update(level_counts=a["level_counts"][:, :3]), "level_counts must be [3, 8]"),
    (lambda a: a.update(budgets=a["budgets"][:2]), "budgets must have 3 entries"),
])
def test_the_native_forecast_refuses_malformed_inputs_naming_them(change, message):
    native = native_op(kernels.next_thresholds)
    thetas, forecast, kept, cuts, counts, budgets = _forecast_inputs(
        np.random.RandomState(13), [3, 2, 4])
    arguments = dict(cuts=cuts, level_counts=counts, budgets=budgets)
    change(arguments)
    with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(message)):
        native(thetas, *forecast, kept, arguments["cuts"], arguments["level_counts"],
               arguments["budgets"], tf.constant(LEVELS, tf.float64), max_growth=MAX_GROWTH)


def _kth_reference(values, cuts, k):
    return [np.sort(values[a:b])[::-1][n - 1] if 1 <= n <= b - a else 0.0
            for a, b, n in zip(cuts[:-1], cuts[1:], k)]


@pytest.mark.parametrize("path", ["native", "tensorflow"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_kth_largest_of_each_segment_is_numpys(path, dtype, monkeypatch):
    """Segments empty, of one entry, with ties, and k of 0, of the length and beyond it."""
    if path == "native":
        native_op(kernels.kth_largest)
    else:
        monkeypatch.setattr(kernels, "kth_largest", lambda: None)
    rng = np.random.RandomState(5)
    values = np.abs(rng.randn(40)).astype(dtype)
    values[10:14] = 2.5  # ties
    cuts = [0, 0, 1, 14, 14, 30, 40]
    k = [1, 1, 4, 1, 16, 0]
    got = kth_largest_per_segment(tf.constant(values), tf.constant(cuts, tf.int32),
                                  tf.constant(k, tf.int32))
    np.testing.assert_array_equal(got.numpy(), np.array(_kth_reference(values, cuts, k), dtype))
    k = [0, 1, 13, 0, 3, 10]
    got = kth_largest_per_segment(tf.constant(values), tf.constant(cuts, tf.int32),
                                  tf.constant(k, tf.int32))
    np.testing.assert_array_equal(got.numpy(), np.array(_kth_reference(values, cuts, k), dtype))


@pytest.mark.parametrize("pattern", ["spread", "large_at_every_16th", "ties", "nan"])
def test_the_native_kth_largest_of_long_segments_is_numpys(pattern):
    """Segments long enough for the selection among the entries not below a sampled bound
    (kth_select.h): k small, middling and near the length, a pattern whose sample bound keeps
    too few (every 16th entry large, where the sample is read: the op must fall back to all),
    ties, NaNs (above every number)."""
    op = native_op(kernels.kth_largest)
    rng = np.random.RandomState(7)
    values = np.abs(rng.randn(50_000)).astype(np.float32)
    if pattern == "large_at_every_16th":
        values[::16] += 100.0
    elif pattern == "ties":
        values = np.round(values, 1)
    elif pattern == "nan":
        values[rng.choice(values.size, 30, replace=False)] = np.nan
    cuts = [0, 20_000, 50_000]
    for k in ([1, 1], [50, 7], [1250, 1875], [2000, 3000], [18_750, 28_125],
              [19_000, 29_990], [20_000, 30_000]):
        got = op(tf.constant(values), tf.constant(cuts, tf.int32), tf.constant(k, tf.int32))
        expected = [np.sort(values[a:b])[::-1][kv - 1]  # NaN sorts last: first, reversed
                    for a, b, kv in zip(cuts[:-1], cuts[1:], k)]
        np.testing.assert_array_equal(got.numpy(), np.array(expected, np.float32), err_msg=str(k))


@pytest.mark.parametrize("cuts,message", [([0, 5, 3], "must not decrease"),
                                          ([0, 2, 9], r"cuts\[2\] = 9 is not in \[0, 6\]"),
                                          ([0, 6], "one more entry than k")])
def test_the_native_kth_largest_refuses_bad_cuts_naming_them(cuts, message):
    op = native_op(kernels.kth_largest)
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        op(tf.zeros([6], tf.float64), tf.constant(cuts, tf.int32), tf.constant([1, 1], tf.int32))


def test_staleness_is_refused_naming_both():
    with pytest.raises(ValueError, match="exchange='sparse_allreduce'.*`staleness`"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1),
                                              exchange="sparse_allreduce", staleness=2)


@pytest.mark.parametrize("settings", [
    {"grouping": "layerwise"},
    {"grouping": "layerwise", "density": sparse_hvd.AdaptiveDensity()},
    {"density": sparse_hvd.AdaptiveDensity()},
    {"compression": "float16"},
])
def test_it_takes_the_layerwise_grouping_the_adaptive_policy_and_compression(settings):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the adaptive policy without layerwise warns
        optimizer = sparse_hvd.SparseDistributedOptimizer(
            keras.optimizers.SGD(0.1), exchange="sparse_allreduce", **settings)
    assert optimizer._exchange.method == "sparse_allreduce"
    assert optimizer._exchange.per_layer == (settings.get("grouping") == "layerwise")


def test_an_unknown_exchange_is_refused():
    with pytest.raises(ValueError, match="`exchange` must be one of"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), exchange="ring")


def test_the_exchange_round_trips_through_the_config():
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1),
                                                      exchange="sparse_allreduce")
    clone = sparse_hvd.SparseDistributedOptimizer.from_config(optimizer.get_config())
    assert clone.exchange == "sparse_allreduce"


def test_one_worker_applies_its_own_selection_as_the_allgather_exchange_does():
    # alone there is nothing to exchange: the same step as exchange="allgather"
    results = []
    for exchange in ("allgather", "sparse_allreduce"):
        variable = keras.Variable(np.zeros((50, 40)), dtype="float64")
        optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(1.0),
                                                          exchange=exchange)
        rng = np.random.RandomState(0)
        for _ in range(3):
            optimizer.apply_gradients([(tf.constant(rng.randn(50, 40)), variable)])
        results.append((variable.numpy(), optimizer.residuals[0].numpy()))
        assert [s["exchange"] for s in optimizer.layer_stats().values()] == [exchange]
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


@pytest.mark.parametrize("path", ["native", "tensorflow"])
@pytest.mark.parametrize("needles_ascend", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_the_values_owed_are_those_whose_indices_are_absent_from_the_applied_list(
        path, needles_ascend, dtype, monkeypatch):
    from sparse_hvd.exchanges.sparse_allreduce import unapplied

    if path == "native" and kernels.unapplied() is None:
        pytest.skip("the native kernels are off in this run (SPARSE_HVD_NATIVE=0 or a GPU)")
    if path == "tensorflow":
        monkeypatch.setattr(kernels, "unapplied", lambda: None)
    rng = np.random.default_rng(4)
    offset = 70000  # the variable's start in the index space: applied holds global indices
    sent = np.sort(rng.choice(100000, 5000, replace=False)).astype(np.int32)
    if not needles_ascend:
        rng.shuffle(sent)
    values = rng.standard_normal(sent.size).astype(np.float32) + 3.0  # never 0 itself
    applied = np.sort(np.concatenate([rng.choice(sent, 2000, replace=False) + offset,
                                      rng.choice(200000, 300)])).astype(np.int32)
    applied = np.unique(applied)
    for needles, given, hay in ((sent, values, applied), (sent, values, applied[:0]),
                                (sent[:0], values[:0], applied),
                                (sent[:1], values[:1], applied[-1:])):
        given = tf.cast(tf.constant(given), dtype)
        got = unapplied(tf.constant(needles), tf.constant(hay), given, offset)
        assert got.dtype == given.dtype
        expected = np.where(np.isin(needles + offset, hay), 0.0,
                            given.numpy().astype(np.float64))
        np.testing.assert_array_equal(got.numpy().astype(np.float64), expected)


@pytest.mark.parametrize("path", ["native", "tensorflow"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_the_applied_entries_are_the_kept_sums_that_reach_their_variables_cut(
        path, dtype, monkeypatch):
    """Three variables at 0, 40,000 and 90,000 of the index space (the middle one with no kept
    entry at all, the last with a cut of 0: all applied), against NumPy."""
    from sparse_hvd.exchanges.sparse_allreduce import applied_entries

    if path == "native" and kernels.applied() is None:
        pytest.skip("the native kernels are off in this run (SPARSE_HVD_NATIVE=0 or a GPU)")
    if path == "tensorflow":
        monkeypatch.setattr(kernels, "applied", lambda: None)
    rng = np.random.default_rng(7)
    starts = np.array([0, 40000, 90000], np.int32)
    kept = np.concatenate([rng.choice(40000, 3000, replace=False),
                           90000 + rng.choice(5000, 400, replace=False)])
    kept = np.unique(kept).astype(np.int32)
    sums = rng.standard_normal(kept.size)
    magnitudes = np.abs(sums)
    magnitudes[5] = 1.25  # exactly at the first variable's cut: applied
    cuts = np.array([1.25, 0.5, 0.0])
    variable = np.searchsorted(starts, kept, "right") - 1
    reach = magnitudes >= cuts[variable]
    got = applied_entries(tf.constant(kept), tf.cast(tf.constant(sums), dtype),
                          tf.constant(magnitudes), tf.constant(cuts), tf.constant(starts))
    applied, local, values, counts = (t.numpy() for t in got)
    np.testing.assert_array_equal(applied, kept[reach])
    np.testing.assert_array_equal(local, kept[reach] - starts[variable[reach]])
    np.testing.assert_array_equal(values, tf.cast(tf.constant(sums[reach]), dtype).numpy())
    np.testing.assert_array_equal(counts, np.bincount(variable[reach], minlength=3))
    assert counts[1] == 0 and counts[2] == 400
    empty = applied_entries(tf.constant(kept[:0]), tf.cast(tf.constant(sums[:0]), dtype),
                            tf.constant(magnitudes[:0]), tf.constant(cuts), tf.constant(starts))
    assert [int(tf.size(t)) for t in empty] == [0, 0, 0, 3]
    np.testing.assert_array_equal(empty[3].numpy(), [0, 0, 0])


@pytest.mark.parametrize("path", ["native", "tensorflow"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
@pytest.mark.parametrize("divisor", [3, 4, 7])
def test_the_applied_averages_are_the_sums_over_n_as_ieee_division_rounds_them(
        path, dtype, divisor, monkeypatch):
    """With a divisor the applied entries carry their averages: the sum over N, correctly
    rounded in the sum's type (for the 16-bit types: in float32, then rounded, as Eigen
    divides them), and +0.0 for a sum of 0 or -0.0; NumPy's own division is the reference.
    The indices and counts are those without a divisor."""
    from sparse_hvd.exchanges.sparse_allreduce import applied_entries

    if path == "native" and kernels.applied() is None:
        pytest.skip("the native kernels are off in this run (SPARSE_HVD_NATIVE=0 or a GPU)")
    if path == "tensorflow":
        monkeypatch.setattr(kernels, "applied", lambda: None)
    rng = np.random.default_rng(divisor)
    starts = np.array([0, 5000], np.int32)
    kept = np.unique(rng.choice(9000, 2000, replace=False)).astype(np.int32)
    sums = rng.standard_normal(kept.size) * 10.0 ** rng.integers(-6, 4, kept.size)
    sums[:6] = [0.0, -0.0, 0.0, -0.0, 1e-30, -1e-30]
    typed = tf.cast(tf.constant(sums), dtype)
    magnitudes = np.abs(typed.numpy().astype(np.float64))
    cuts = np.array([0.0, 0.5])
    args = (tf.constant(kept), typed, tf.constant(magnitudes), tf.constant(cuts),
            tf.constant(starts))
    plain = [t.numpy() for t in applied_entries(*args)]
    averaged = [t.numpy() for t in applied_entries(*args, divisor=divisor)]
    for got, expected in zip(averaged[:2] + averaged[3:], plain[:2] + plain[3:]):
        np.testing.assert_array_equal(got, expected)
    applied_sums = plain[2]
    if dtype in ("float32", "float64"):
        quotient = applied_sums / applied_sums.dtype.type(divisor)
    else:  # in float32, rounded to the 16-bit type once
        quotient = tf.cast(applied_sums.astype(np.float32) / np.float32(divisor), dtype).numpy()
    expected = np.where(applied_sums == 0, np.zeros_like(quotient), quotient)
    got = averaged[2]
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got.astype(np.float64), expected.astype(np.float64))
    assert not np.any(np.signbit(got.astype(np.float64)[applied_sums == 0]))
    assert np.sum(applied_sums == 0) >= 4  # the zeros and -0.0s were applied (cut 0)


def test_kept_entries_out_of_order_are_refused_naming_the_place():
    if kernels.applied() is None:
        pytest.skip("the native kernels are off in this run (SPARSE_HVD_NATIVE=0 or a GPU)")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"kept must ascend from starts\[0\] = 0: kept\[2\] = 4 after 9"):
        kernels.applied()(tf.constant([1, 9, 4]), tf.constant([1., 2., 3.]),
                          tf.constant([1., 2., 3.], tf.float64), tf.constant([0.], tf.float64),
                          tf.constant([0]))


def test_an_applied_list_out_of_order_is_refused_naming_the_place():
    if kernels.unapplied() is None:
        pytest.skip("the native kernels are off in this run (SPARSE_HVD_NATIVE=0 or a GPU)")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"sorted must ascend: sorted\[1\] = 7, sorted\[2\] = 7"):
        kernels.unapplied()(tf.constant([1, 2]), tf.constant([3, 7, 7]), tf.constant([1., 2.]), 0)


def test_values_of_another_length_than_the_indices_are_refused():
    if kernels.unapplied() is None:
        pytest.skip("the native kernels are off in this run (SPARSE_HVD_NATIVE=0 or a GPU)")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"values must have one entry per needle: 3 values, 2 needles"):
        kernels.unapplied()(tf.constant([1, 2]), tf.constant([3, 7]), tf.constant([1., 2., 3.]),
                            0)
