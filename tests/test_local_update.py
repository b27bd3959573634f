"""``sparsify="update"`` in one process: the inner optimizer's update, not the gradient, is
cut and error-fed (``sparse_hvd.feedback.local_update``)."""

import contextlib
import math
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from sparse_hvd.feedback import step_factor
from helpers import NumpyAdam, numpy_topk_split

SHAPE = (50, 40)  # 2000 entries: the sparse route
# an epsilon near the gradients' size: with Keras' default (1e-7) Adam's first update is +-LR
# everywhere (m / sqrt(v) = sign(g)), ties, which the cut sends all of
LR, EPSILON = 0.01, 0.5


def _step_function(optimizer, variable, mode):
    def step(grad):
        optimizer.apply_gradients([(grad, variable)])

    return tf.function(step, jit_compile=False) if mode == "function" else step


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_each_step_sends_the_topk_of_the_compensated_adam_update(mode):
    """The weights move by the top-k of (Adam's update of the gradient + residual), and Adam's
    moments follow every gradient, sent or not: a NumPy re-computation, step by step. The
    update is read back as w - w' in float32, exact for what the inner optimizer wrote but
    rounded to the weights' last place (about 5e-7 here), hence the absolute tolerance."""
    rng = np.random.RandomState(11)
    start = rng.randn(*SHAPE).astype("float32")
    variable = keras.Variable(start)
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.Adam(LR, epsilon=EPSILON), density=0.05, warmup_steps=0,
        sparsify="update", exchange="allgather")
    step = _step_function(optimizer, variable, mode)
    k = math.ceil(0.05 * start.size)
    adam = NumpyAdam(start.size, LR, EPSILON)
    expected, residual = start.astype("float64").ravel(), np.zeros(start.size)
    for number in range(1, 13):
        grad = rng.randn(*SHAPE).astype("float32")
        step(tf.constant(grad))
        chosen, sent, residual = numpy_topk_split(adam.update(grad.ravel()) + residual, k)
        expected = expected - sent

        np.testing.assert_allclose(variable.numpy().ravel(), expected, rtol=0, atol=2e-6)
        np.testing.assert_allclose(optimizer.residuals[0].numpy().ravel(), residual,
                                   rtol=0, atol=2e-6)
        assert int(optimizer.iterations.numpy()) == number
        assert int(optimizer.inner_optimizer.iterations.numpy()) == number
    momentum = optimizer.inner_optimizer._momentums[0].numpy().ravel()
    np.testing.assert_allclose(momentum, adam.m, rtol=1e-5, atol=1e-7)


def test_sgd_momentum_cuts_each_workers_velocity_step():
    """With SGD(momentum) the update is Keras' -(momentum * m - lr * g): the velocity runs on
    every gradient, and its step is cut and error-fed (momentum correction without masking)."""
    rng = np.random.RandomState(4)
    start = rng.randn(*SHAPE).astype("float32")
    variable = keras.Variable(start)
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), density=0.05, warmup_steps=0,
        sparsify="update")
    k = math.ceil(0.05 * start.size)
    velocity, residual = np.zeros(start.size), np.zeros(start.size)
    expected = start.astype("float64").ravel()
    for _ in range(8):
        grad = rng.randn(*SHAPE).astype("float32")
        optimizer.apply_gradients([(tf.constant(grad), variable)])
        velocity = 0.9 * velocity - 0.1 * grad.ravel()
        _, sent, residual = numpy_topk_split(-velocity + residual, k)
        expected = expected - sent
    np.testing.assert_allclose(variable.numpy().ravel(), expected, rtol=0, atol=2e-6)
    np.testing.assert_allclose(optimizer.residuals[0].numpy().ravel(), residual, rtol=0,
                               atol=2e-6)


def test_a_cut_variable_sent_whole_sends_its_step_and_residual_whole():
    """When ``exchange="auto"`` runs dense, the cut variables travel whole (``Route.flushed``).
    They go on as steps (each rank's inner state is its own, and the residual holds steps):
    the step plus the residual is sent whole and subtracted, the residual is then zero, and
    the next sparse step cuts again. SGD's momentum in NumPy, step by step."""
    rng = np.random.RandomState(8)
    start = rng.randn(*SHAPE).astype("float32")
    variable = keras.Variable(start)
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), density=0.05, warmup_steps=0,
        sparsify="update", exchange="allgather")
    k = math.ceil(0.05 * start.size)
    velocity, residual = np.zeros(start.size), np.zeros(start.size)
    expected = start.astype("float64").ravel()
    optimizer.build([variable])
    for number, whole in enumerate([False, False, True, True, False], start=1):
        route = optimizer._routes[0]
        optimizer._routes[0] = route._replace(sparse=not whole, flushed=whole)
        grad = rng.randn(*SHAPE).astype("float32")
        optimizer.apply_gradients([(tf.constant(grad), variable)])
        velocity = 0.9 * velocity - 0.1 * grad.ravel()
        if whole:
            expected, residual = expected - (-velocity + residual), np.zeros(start.size)
        else:
            _, sent, residual = numpy_topk_split(-velocity + residual, k)
            expected = expected - sent
        np.testing.assert_allclose(variable.numpy().ravel(), expected, rtol=0, atol=2e-6)
        np.testing.assert_allclose(optimizer.residuals[0].numpy().ravel(), residual, rtol=0,
                                   atol=2e-6)
        assert int(optimizer.iterations.numpy()) == number
        assert np.count_nonzero(residual) == (0 if whole else start.size - k)


def test_a_variable_sent_whole_gets_the_inner_optimizer_on_its_gradient():
    """Only cut variables are handled as updates: one under ``min_elements`` (the dense route)
    follows the plain inner optimizer bit for bit, and the step is counted once."""
    rng = np.random.RandomState(6)
    big, small = rng.randn(*SHAPE).astype("float32"), rng.randn(30).astype("float32")
    variables = [keras.Variable(big), keras.Variable(small)]
    plain = keras.Variable(small)
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.Adam(LR), density=0.05, warmup_steps=0, sparsify="update")
    reference = keras.optimizers.Adam(LR)
    for number in range(1, 6):
        grads = [tf.constant(rng.randn(*SHAPE).astype("float32")),
                 tf.constant(rng.randn(30).astype("float32"))]
        optimizer.apply_gradients(zip(grads, variables))
        reference.apply_gradients([(grads[1], plain)])
        assert int(optimizer.iterations.numpy()) == number
    np.testing.assert_array_equal(variables[1].numpy(), plain.numpy())
    assert not np.array_equal(variables[0].numpy(), big)


def test_a_step_that_is_not_finite_moves_nothing():
    """The local Adam does not see a NaN gradient: the step is skipped, the weights, the
    moments and the step count are as before, and the skip is counted."""
    rng = np.random.RandomState(2)
    variable = keras.Variable(rng.randn(*SHAPE).astype("float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.Adam(LR), density=0.05, warmup_steps=0, sparsify="update")
    optimizer.apply_gradients([(tf.constant(rng.randn(*SHAPE).astype("float32")), variable)])
    before = variable.numpy().copy()
    moments = optimizer.inner_optimizer._momentums[0].numpy().copy()
    bad = rng.randn(*SHAPE).astype("float32")
    bad[3, 4] = np.nan
    optimizer.apply_gradients([(tf.constant(bad), variable)])
    np.testing.assert_array_equal(variable.numpy(), before)
    np.testing.assert_array_equal(optimizer.inner_optimizer._momentums[0].numpy(), moments)
    assert int(optimizer.iterations.numpy()) == 1
    assert optimizer.communication_stats()["skipped_steps"] == 1


def test_sparsify_is_checked_and_refused_beside_momentum_correction():
    with pytest.raises(ValueError, match="`sparsify` must be one of"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.Adam(), sparsify="updates")
    with pytest.raises(ValueError, match="sparsify='update'.*momentum_correction"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), sparsify="update",
                                              momentum_correction=0.9)


def test_a_checkpoint_resumes_the_update_mode_exactly(tmp_path):
    """The residuals (in units of the update) and Adam's state are saved and restored: a run
    resumed after 3 steps ends bit-identical to one that never stopped."""
    rng = np.random.RandomState(9)
    start = rng.randn(*SHAPE).astype("float32")
    grads = [tf.constant(rng.randn(*SHAPE).astype("float32")) for _ in range(6)]

    def fresh():
        variable = keras.Variable(start)
        optimizer = sparse_hvd.SparseDistributedOptimizer(
            keras.optimizers.Adam(LR, epsilon=EPSILON), density=0.05, warmup_steps=0,
            sparsify="update")
        optimizer.build([variable])
        return variable, optimizer

    variable, optimizer = fresh()
    for grad in grads[:3]:
        optimizer.apply_gradients([(grad, variable)])
    path = tf.train.Checkpoint(variable=variable, optimizer=optimizer).write(
        str(tmp_path / "ckpt"))
    for grad in grads[3:]:
        optimizer.apply_gradients([(grad, variable)])

    resumed, again = fresh()
    tf.train.Checkpoint(variable=resumed, optimizer=again).read(path).assert_consumed()
    assert int(again.iterations.numpy()) == 3
    for grad in grads[3:]:
        again.apply_gradients([(grad, resumed)])
    np.testing.assert_array_equal(resumed.numpy(), variable.numpy())
    np.testing.assert_array_equal(again.residuals[0].numpy(), optimizer.residuals[0].numpy())


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_the_inner_optimizers_moving_average_follows_the_applied_weights(mode):
    """``use_ema``: Keras' EMA (the first step copies, then ``m * ema + (1 - m) * w``) of the
    weights as applied, not of the weights the local step wrote and took back; and every
    ``ema_overwrite_frequency`` steps the weights become the EMA."""
    rng = np.random.RandomState(8)
    variable = keras.Variable(rng.randn(*SHAPE).astype("float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.Adam(LR, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=4),
        density=0.05, warmup_steps=0, sparsify="update")
    step = _step_function(optimizer, variable, mode)
    ema = None
    for number in range(1, 6):
        before = variable.numpy().astype("float64")
        step(tf.constant(rng.randn(*SHAPE).astype("float32")))
        applied = variable.numpy().astype("float64")
        average = optimizer.inner_optimizer._model_variables_moving_average[0].numpy()
        if number == 4:  # the EMA took the step, then the weights became the EMA
            assert not np.allclose(applied, before)
            np.testing.assert_array_equal(applied, average)
            ema = applied
            continue
        ema = applied if ema is None else 0.5 * ema + 0.5 * applied
        np.testing.assert_allclose(average, ema, rtol=0, atol=1e-6)


@pytest.mark.parametrize("correction", ["mean_estimate", "noise_estimate"])
@pytest.mark.parametrize("inner,arguments,message", [
    (keras.optimizers.SGD, {}, "sparsify='update' and a keras.optimizers.Adam"),
    (keras.optimizers.Adam, {"sparsify": "gradient"}, "got sparsify='gradient'"),
    (lambda lr: keras.optimizers.Adam(lr, amsgrad=True), {}, "without amsgrad"),
    (lambda lr: keras.optimizers.AdamW(lr, amsgrad=True), {}, "without amsgrad"),
])
def test_a_second_moment_correction_is_refused_where_it_cannot_act(inner, arguments, message,
                                                                   correction):
    with pytest.raises(ValueError, match=re.escape(f"`second_moment={correction!r}`")
                       + ".*" + re.escape(message)):
        sparse_hvd.SparseDistributedOptimizer(inner(0.1), second_moment=correction,
                                              **arguments)
    with pytest.raises(ValueError, match="`second_moment` must be one of"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.Adam(0.1), second_moment="v")
    plain = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.Adam(0.1),
                                                  second_moment=correction)
    assert plain.second_moment == correction
    assert sparse_hvd.SparseDistributedOptimizer.from_config(
        plain.get_config()).second_moment == correction


def test_the_noise_estimate_keeps_one_explained_moment_per_variable_and_no_other_state():
    """Its q is a variable of the optimizer per model variable, zero at the start, after the
    residuals' worker count; the other settings add none."""
    model_variables = [keras.Variable(np.zeros(s, "float32")) for s in ((6, 5), (5,))]
    sizes = {}
    for correction in ("own", "mean_estimate", "noise_estimate"):
        optimizer = sparse_hvd.SparseDistributedOptimizer(
            keras.optimizers.Adam(0.1), second_moment=correction, name=f"q_{correction}")
        optimizer.build(model_variables)
        sizes[correction] = len(optimizer.variables)
        named = [v for v in optimizer.variables if "explained_moment" in v.path]
        assert len(named) == (2 if correction == "noise_estimate" else 0)
        for q, variable in zip(named, model_variables):
            assert q.shape == variable.shape
            np.testing.assert_array_equal(q.numpy(), 0.0)
    assert sizes["own"] == sizes["mean_estimate"] == sizes["noise_estimate"] - 2


def test_a_checkpoint_written_without_the_noise_estimate_loads_with_q_from_adams_v():
    """Before this release the default with Adam kept no q: such a checkpoint loads into the
    noise estimate whole (residuals, Adam's moments), and q starts as Adam's v (no noise found
    yet); a checkpoint with q loads q itself."""
    start = [np.linspace(-1, 1, 30).astype("float32").reshape(6, 5), np.ones(5, "float32")]

    def trained(correction, name, shift=0.0):
        variables = [keras.Variable(w) for w in start]
        optimizer = sparse_hvd.SparseDistributedOptimizer(
            keras.optimizers.Adam(0.1), second_moment=correction, min_elements=1, name=name)
        for step in range(3):
            grads = [tf.constant(np.full(w.shape, step - 0.7 + shift, "float32") + w)
                     for w in start]
            optimizer.apply_gradients(zip(grads, variables))
        return optimizer, variables

    old, _ = trained("own", "written_own")
    store = {}
    old.save_own_variables(store)
    new, _ = trained("noise_estimate", "reads_own", shift=0.5)  # another state before
    assert len(new.variables) == len(store) + 2
    new.load_own_variables(store)
    for restored, saved in zip(new.residuals + new.inner_optimizer.variables,
                               old.residuals + old.inner_optimizer.variables):
        np.testing.assert_array_equal(restored.numpy(), saved.numpy())
    for q, v in zip(new._second_moment.variables, old.inner_optimizer._velocities):
        np.testing.assert_array_equal(q.numpy(), v.numpy())
    with_q = {}
    new.save_own_variables(with_q)
    again, _ = trained("noise_estimate", "reads_q", shift=0.5)
    again._second_moment.variables[0].assign(tf.fill([6, 5], 7.0))
    again.load_own_variables(with_q)
    for q, saved in zip(again._second_moment.variables, new._second_moment.variables):
        np.testing.assert_array_equal(q.numpy(), saved.numpy())


@pytest.mark.parametrize("shape", [(7,), (5, 6), (2, 3, 4)])
@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("path", ["native", "dense", "subclass"])
def test_averages_at_positions_are_subtracted_in_place_with_the_dense_subtractions_bits(
        monkeypatch, shape, traced, path):
    """``subtract_at_positions``: only the positions given are written, each ``w - a`` (a -0.0
    weight less +0.0 stays -0.0), the same bits as subtracting the dense average; by the native
    kernel or, without it, by the dense subtraction, which a subclass with its own
    ``assign_sub`` gets too (and sees)."""
    from sparse_hvd import kernels
    from sparse_hvd.feedback import local_update
    from sparse_hvd.feedback.local_update import subtract_at_positions

    if path == "native" and kernels.subtract_at() is None:
        pytest.skip("the native kernels are off in this run (SPARSE_HVD_NATIVE=0 or a GPU)")
    if path == "dense":
        monkeypatch.setattr(local_update.kernels, "subtract_at", lambda: None)
    seen = []

    class Watching(sparse_hvd.SparseDistributedOptimizer):
        def assign_sub(self, variable, value):
            seen.append(value.shape)
            super().assign_sub(variable, value)

    kind = Watching if path == "subclass" else sparse_hvd.SparseDistributedOptimizer
    opt = kind(keras.optimizers.SGD(0.1), density=0.5)

    n = math.prod(shape)
    rng = np.random.RandomState(7)
    start = rng.randn(n).astype("float32")
    start[4] = -0.0
    positions = np.array([n - 1, 4, 0, 2], np.int32)
    averages = rng.randn(4).astype("float32")
    averages[1] = 0.0
    variable = keras.Variable(start.reshape(shape))
    dense = np.zeros(n, np.float32)
    dense[positions] = averages
    expected = start - dense

    def subtract():
        subtract_at_positions(opt, variable, tf.IndexedSlices(
            tf.constant(averages), tf.constant(positions), tf.constant([n], tf.int64)))

    (tf.function(subtract) if traced else subtract)()
    assert seen == ([tuple(shape)] if path == "subclass" else [])
    got = variable.numpy().ravel()
    np.testing.assert_array_equal(got, expected)
    assert np.signbit(got[4]) and np.array_equal(np.signbit(got), np.signbit(expected))


def test_a_position_outside_the_variable_is_refused_naming_it_and_nothing_is_written():
    from sparse_hvd import kernels

    if kernels.subtract_at() is None:
        pytest.skip("the native kernels are off in this run (SPARSE_HVD_NATIVE=0 or a GPU)")
    variable = tf.Variable(np.arange(6, dtype="float32").reshape(2, 3))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"positions\[1\] = 6 is not in \[0, 6\)"):
        kernels.subtract_at()(variable.handle, tf.constant([0, 6]), tf.constant([1.0, 1.0]))
    np.testing.assert_array_equal(variable.numpy().ravel(), np.arange(6))


@pytest.mark.parametrize("value,error,message", [
    (0, ValueError, "`update_scale` must be a positive finite number, got 0"),
    (-1.5, ValueError, "`update_scale` must be a positive finite number, got -1.5"),
    (float("nan"), ValueError, "`update_scale` must be a positive finite number, got nan"),
    (True, TypeError, "`update_scale` must be a number or a pair of numbers, got True"),
    ("1.5", TypeError, "`update_scale` must be a number or a pair of numbers, got '1.5'"),
    ((1.5, "2"), TypeError, "`update_scale` must be a number or a pair of numbers, got (1.5, '2')"),
    ((1.5, 0.0), ValueError,
     "`update_scale` must be a positive finite number (each of the pair), got (1.5, 0.0)"),
    ((1.5, 2.0, 2.5), ValueError, "`update_scale` as a pair is (the factor at the largest "
     "learning rate seen so far, the factor as the rate falls to 0), got (1.5, 2.0, 2.5)"),
])
def test_update_scale_is_checked(value, error, message):
    with pytest.raises(error, match=re.escape(message)):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                              update_scale=value)


def test_update_scale_is_refused_where_no_update_is_cut_and_serialised_where_it_is():
    with pytest.raises(ValueError, match=re.escape(
            "`update_scale=1.5` scales the averaged *update* of the cut variables, which "
            "`sparsify='gradient'` does not send")):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), update_scale=1.5)
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                                      update_scale=1.5)
    config = optimizer.get_config()
    assert config["update_scale"] == 1.5
    assert sparse_hvd.SparseDistributedOptimizer.from_config(config).update_scale == 1.5
    del config["update_scale"]  # a config written before the option: as it ran then
    assert sparse_hvd.SparseDistributedOptimizer.from_config(config).update_scale == 1.0


def test_update_scale_grows_from_1_over_the_first_quarter_of_the_density_warm_up():
    """At step t of a warm-up of W steps the factor is 1 + (scale - 1) * min(1, t / (W // 4)):
    a variable on the dense route (SGD without momentum, so its step is the rate times its
    constant gradient) moves by the rate times the sum of the factors; without a warm-up by
    the factor from the first step."""
    lr, scale, warmup, steps = 0.1, 2.0, 16, 6
    for warmup_steps, factors in ((warmup, [1 + (scale - 1) * min(1, t / 4)
                                            for t in range(steps)]),
                                  (0, [scale] * steps)):
        cut, small = keras.Variable(np.zeros(2000, "float32")), keras.Variable(np.zeros(8, "float32"))
        optimizer = sparse_hvd.SparseDistributedOptimizer(
            keras.optimizers.SGD(lr), density=0.01, warmup_steps=warmup_steps, sparsify="update",
            update_scale=scale, exchange="allgather", name=f"ramp_{warmup_steps}")
        gradients = [tf.constant(np.linspace(1, 2, 2000, dtype="float32")), tf.ones(8)]
        for _ in range(steps):
            optimizer.apply_gradients(zip(gradients, [cut, small]))
        np.testing.assert_allclose(small.numpy(), -lr * sum(factors), rtol=1e-5)
        assert optimizer.layer_stats()[cut.path]["route"] == "sparse"


# a schedule that rises, then falls: the peak is the largest rate so far, not the first
RATES, BOUNDARIES = (0.05, 0.1, 0.025, 0.075), (2, 4, 6)


def _expected_factors(at_peak, at_end, steps, ramp=None, share=1.0):
    """The closed form of ``feedback.step_factor``: at step t, r the schedule's rate, p the
    largest rate up to t, f = at_peak + (at_end - at_peak) * g with g = 1 - r / (share p)
    clipped to [0, 1], then the ramp."""
    factors, peak = [], 0.0
    for t in range(steps):
        rate = RATES[sum(t > b for b in BOUNDARIES)]
        peak = max(peak, rate)
        factor = at_peak + (at_end - at_peak) * min(1.0, max(0.0, 1 - rate / (share * peak)))
        factors.append(1 + (factor - 1) * min(1, t / ramp) if ramp else factor)
    return factors


@contextlib.contextmanager
def _step_factor_setting(name, value):
    """``step_factor``'s module setting ``name`` at ``value`` (read when a step is traced)."""
    saved = getattr(step_factor, name)
    setattr(step_factor, name, value)
    try:
        yield
    finally:
        setattr(step_factor, name, saved)


def _rate_following_optimizer(update_scale, warmup_steps, name):
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay(list(BOUNDARIES), list(RATES))
    return sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(schedule), density=0.01, warmup_steps=warmup_steps,
        sparsify="update", update_scale=update_scale, exchange="allgather", name=name)


def test_a_pair_grows_the_factor_as_the_rate_falls_below_its_peak():
    """``update_scale=(a, b)``: a variable on the dense route (SGD without momentum: its step
    is the rate times its constant gradient) moves by the sum of each step's rate times the
    closed-form factor, the ramp of the density's warm-up included, growing from the peak or
    from a share of it (``GROWS_BELOW``); the peak is the largest rate seen, and the pair is
    serialised as it is."""
    steps = 9
    for warmup_steps, ramp, share in ((0, None, step_factor.GROWS_BELOW), (16, 4, 1.0),
                                      (0, None, 0.5)):
        cut, small = keras.Variable(np.zeros(2000, "float32")), keras.Variable(np.zeros(8, "float32"))
        with _step_factor_setting("GROWS_BELOW", share):
            optimizer = _rate_following_optimizer((1.5, 2.0), warmup_steps,
                                                  f"pair_{warmup_steps}_{share}")
            gradients = [tf.constant(np.linspace(1, 2, 2000, dtype="float32")), tf.ones(8)]
            reported = []  # what the logs show before each step: that step's factor
            for _ in range(steps):
                reported.append(optimizer.communication_stats()["update_factor"])
                optimizer.apply_gradients(zip(gradients, [cut, small]))
            reported.append(optimizer.communication_stats()["update_factor"])
        rates = [RATES[sum(t > b for b in BOUNDARIES)] for t in range(steps)]
        factors = _expected_factors(1.5, 2.0, steps + 1, ramp, share)
        np.testing.assert_allclose(reported, factors, rtol=1e-6)
        assert max(factors) > 1.5  # the rate fell below the peak's share: the factor grew
        np.testing.assert_allclose(small.numpy(), -sum(r * f for r, f in zip(rates, factors)),
                                   rtol=1e-5)
        assert float(optimizer._step_factor.peak.numpy()) == pytest.approx(max(rates))
    config = optimizer.get_config()
    assert tuple(config["update_scale"]) == (1.5, 2.0)
    config["update_scale"] = list(config["update_scale"])  # as JSON brings it back
    assert sparse_hvd.SparseDistributedOptimizer.from_config(config).update_scale == (1.5, 2.0)
    assert sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.1), sparsify="update", update_scale=(1.5, 1.5)).update_scale == 1.5


def test_sparse_steps_begun_after_the_ramp_take_the_rate_and_where_they_began_is_saved():
    """``StepFactor.restarted_if`` (what ``exchange="auto"``'s first sparse step after a chosen
    dense phase runs), with a 16-step warm-up (the ramp: 4 steps): the dense-route variable
    moves by each step's rate times the pair's closed-form factor ramped from step 0, and
    from a restart after the ramp (step 6) by the rate alone; a restart within it (step 2),
    a False condition (step 3) or ``AFTER_DENSE_AT_RATE = False`` change nothing. Where the
    sparse steps began is saved with the optimizer; a checkpoint without it (the previous
    release) loads it as 0: the factor as before."""
    gradients = [tf.constant(np.linspace(1, 2, 2000, dtype="float32")), tf.ones(8)]
    steps = 12
    rates = [RATES[sum(t > b for b in BOUNDARIES)] for t in range(steps)]
    ramped = _expected_factors(1.5, 2.0, steps, ramp=4)

    def moved(restart_at, enabled=True):
        variables = [keras.Variable(np.zeros(2000, "float32")),
                     keras.Variable(np.zeros(8, "float32"))]
        optimizer = _rate_following_optimizer((1.5, 2.0), 16, f"since_{restart_at}_{enabled}")
        optimizer.build(variables)
        with _step_factor_setting("AFTER_DENSE_AT_RATE", enabled):
            for t in range(steps):
                if t in (3, restart_at):
                    optimizer._step_factor.restarted_if(optimizer, tf.constant(t == restart_at))
                optimizer.apply_gradients(zip(gradients, variables))
        return optimizer, -variables[1].numpy()[0]

    def expected(at_rate_from):
        return sum(r * (1.0 if t >= at_rate_from else f)
                   for t, (r, f) in enumerate(zip(rates, ramped)))

    optimizer, distance = moved(6)
    assert distance == pytest.approx(expected(6), rel=1e-5)
    assert expected(6) < expected(steps)  # the steps from 6 on took the rate
    assert int(optimizer._step_factor.sparse_since.numpy()) == 6
    for restart_at, enabled in ((6, False), (2, True), (None, True)):
        assert moved(restart_at, enabled)[1] == pytest.approx(expected(steps), rel=1e-5)

    def fresh(name):
        restored = _rate_following_optimizer((1.5, 2.0), 16, name)
        restored.build([keras.Variable(np.zeros(2000, "float32")),
                        keras.Variable(np.zeros(8, "float32"))])
        return restored

    store = {}
    optimizer.save_own_variables(store)
    at = [v is optimizer._step_factor.sparse_since for v in optimizer.variables].index(True)
    assert int(np.asarray(store[str(at)])) == 6
    resumed = fresh("since_resumed")
    resumed.load_own_variables(store)
    assert int(resumed._step_factor.sparse_since.numpy()) == 6
    legacy = fresh("since_legacy")
    legacy.load_own_variables(
        {str(i): store[str(j)] for i, j in enumerate(j for j in range(len(store)) if j != at)})
    assert int(legacy._step_factor.sparse_since.numpy()) == 0
    assert float(legacy._step_factor.peak.numpy()) == pytest.approx(max(rates))
    # no ramp without a warm-up: no such variable, the checkpoint as before
    plain = _rate_following_optimizer((1.5, 2.0), 0, "since_no_ramp")
    plain.build([keras.Variable(np.zeros(2000, "float32"))])
    assert plain._step_factor.since_variables == [] and plain._step_factor.peak is not None


def test_the_peak_is_checkpointed_and_a_checkpoint_without_it_restarts_it_at_the_rate():
    """The peak is saved with the optimizer: restored after 5 steps, 4 more steps move the
    dense-route variable as 9 uninterrupted ones do. A checkpoint written without a peak (a
    constant factor, or before the pair existed) loads with the peak at 0: the first step
    after it takes its own rate as the peak (a factor of exactly ``at_peak``)."""
    gradients = [tf.constant(np.linspace(1, 2, 2000, dtype="float32")), tf.ones(8)]

    def run(optimizer, variables, steps):
        for _ in range(steps):
            optimizer.apply_gradients(zip(gradients, variables))

    def fresh():
        return [keras.Variable(np.zeros(2000, "float32")), keras.Variable(np.zeros(8, "float32"))]

    whole = fresh()
    run(_rate_following_optimizer((1.5, 2.0), 0, "whole"), whole, 9)
    first, variables = _rate_following_optimizer((1.5, 2.0), 0, "first"), fresh()
    run(first, variables, 5)
    store = {}
    first.save_own_variables(store)
    resumed = _rate_following_optimizer((1.5, 2.0), 0, "resumed")
    resumed.build(variables)
    resumed.load_own_variables(store)
    assert float(resumed._step_factor.peak.numpy()) == pytest.approx(0.1)
    run(resumed, variables, 4)
    np.testing.assert_allclose(variables[1].numpy(), whole[1].numpy(), rtol=1e-6)

    at = [v is first._step_factor.peak for v in first.variables].index(True)
    older = [store[str(i)] for i in range(len(store)) if i != at]
    legacy = _rate_following_optimizer((1.5, 2.0), 0, "legacy")
    variables = [keras.Variable(v) for v in variables]
    before = variables[1].numpy().copy()
    legacy.build(variables)
    legacy.load_own_variables({str(i): v for i, v in enumerate(older)})
    assert float(legacy._step_factor.peak.numpy()) == 0.0
    assert int(legacy.iterations.numpy()) == 5
    run(legacy, variables, 1)  # step 5: its rate 0.025 becomes the peak (restored: 0.1, 1.875)
    np.testing.assert_allclose(variables[1].numpy(), before - 0.025 * 1.5, rtol=1e-6)
    assert float(legacy._step_factor.peak.numpy()) == pytest.approx(0.025)


def test_a_checkpoint_written_before_q_and_the_peak_loads_with_both_filled():
    """Adam with the noise estimate's q and a factor that follows the rate: a checkpoint
    without the peak (the previous release) loads with q as saved and the peak at 0; one
    without both (before q existed) loads with the peak at 0 and q restarted from Adam's v;
    every other variable is restored as saved, in place."""
    def build(name):
        optimizer = sparse_hvd.SparseDistributedOptimizer(
            keras.optimizers.Adam(LR, epsilon=EPSILON), density=0.05, warmup_steps=0,
            sparsify="update", update_scale=(1.5, 2.0), second_moment="noise_estimate",
            exchange="allgather", name=name)
        optimizer.build([keras.Variable(np.zeros(SHAPE, "float32"))])
        return optimizer

    saved = build("saved")
    variable = saved._trainable_variables[0]
    rng = np.random.RandomState(5)
    for _ in range(3):
        saved.apply_gradients([(tf.constant(rng.randn(*SHAPE).astype("float32")), variable)])
    store = {}
    saved.save_own_variables(store)
    q, peak = saved._second_moment.variables[0], saved._step_factor.peak
    at = {id(v): i for i, v in enumerate(saved.variables)}
    velocity = saved.inner_optimizer._velocities[0].numpy()
    assert float(peak.numpy()) == pytest.approx(LR) and np.any(q.numpy() != velocity)
    for left_out in ([peak], [q, peak]):
        dropped = {at[id(v)] for v in left_out}
        older = [store[str(i)] for i in range(len(store)) if i not in dropped]
        restored = build(f"restored_{len(left_out)}")
        restored.load_own_variables({str(i): v for i, v in enumerate(older)})
        expected_q = velocity if len(left_out) == 2 else q.numpy()
        np.testing.assert_array_equal(restored._second_moment.variables[0].numpy(), expected_q)
        assert float(restored._step_factor.peak.numpy()) == 0.0
        for i, v in enumerate(restored.variables):
            if i not in dropped and i != at[id(q)]:
                np.testing.assert_array_equal(v.numpy(), np.asarray(store[str(i)]),
                                              err_msg=v.path)
    short = [store[str(i)] for i in range(len(store) - 3)]  # no release wrote that few
    with pytest.warns(UserWarning, match="Skipping variable loading"):
        restored.load_own_variables({str(i): v for i, v in enumerate(short)})
