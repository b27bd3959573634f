"""Bounded staleness (``staleness=tau``) in one process: the delayed update sequence, re-computed
in NumPy, and checkpoints written with exchanges in flight."""

import math
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from helpers import (classification_data, coded_value_words, elias_fano_words, mlp,
                     numpy_topk_split, raw_bits_of, weights_of)

BIG = (64, 40)  # 2560 entries: sparse route
SMALL = (30,)  # dense route (below min_elements)


def _gradients(rng, big, small):
    """Gradients that depend on the current weights (so applying them late changes the run)."""
    return (
        (rng.randn(*BIG) + 0.5 * big).astype("float32"),
        (rng.randn(*SMALL) + 0.5 * small).astype("float32"),
    )


def _expected_run(tau, steps, density, lr, nan_steps=()):
    """The delayed sequence, independently: send the top-k of (gradient + residual) at step t,
    apply it at step t + tau; steps with a NaN gradient send and apply nothing of their own."""
    rng = np.random.RandomState(11)
    big, small = np.ones(BIG, "float32"), np.full(SMALL, 2.0, "float32")
    residual = np.zeros(big.size, "float32")
    k = math.ceil(density * big.size)
    sent = {}  # step -> (big update, small update)
    history = []
    lr32 = np.float32(lr)
    for t in range(steps):
        g_big, g_small = _gradients(rng, big, small)
        if t not in nan_steps:
            compensated = g_big.ravel() + residual
            _, update, residual = numpy_topk_split(compensated, k)
            sent[t] = (update.reshape(BIG), g_small)
        if t - tau in sent:
            u_big, u_small = sent.pop(t - tau)
            big = big - lr32 * u_big
            small = small - lr32 * u_small
        history.append((big.copy(), small.copy()))
    for t in sorted(sent):  # what fit's end (apply_pending) applies
        u_big, u_small = sent[t]
        big, small = big - lr32 * u_big, small - lr32 * u_small
    return history, (big, small)


def _train_and_compare(optimizer, expected, mode, tolerance=0.0):
    """Train the two variables with ``optimizer`` on :func:`_gradients` (eagerly or traced),
    checking the weights after every step against ``expected[t]``; returns the variables."""
    big = keras.Variable(np.ones(BIG, "float32"))
    small = keras.Variable(np.full(SMALL, 2.0, "float32"))

    def step(g_big, g_small):
        optimizer.apply_gradients([(g_big, big), (g_small, small)])

    step = tf.function(step) if mode == "function" else step
    rng = np.random.RandomState(11)
    for t, (want_big, want_small) in enumerate(expected):
        g_big, g_small = _gradients(rng, big.numpy(), small.numpy())
        step(tf.constant(g_big), tf.constant(g_small))
        for variable, want in ((big, want_big), (small, want_small)):
            np.testing.assert_allclose(variable.numpy(), want, rtol=tolerance, atol=tolerance,
                                       err_msg=f"step {t}")
    return big, small


@pytest.mark.parametrize("exchange", ["allgather", "compact_allgather"])
@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("tau", [1, 2, 3])
def test_updates_are_applied_tau_steps_late_as_a_numpy_recomputation(tau, mode, exchange):
    """With the compact allgather the indices travel coded: the same bits arrive."""
    steps, density, lr = 9, 0.05, 0.5
    expected, final = _expected_run(tau, steps, density, lr)
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(lr), density=density, staleness=tau, exchange=exchange)
    big, small = _train_and_compare(optimizer, expected, mode)
    assert int(optimizer.iterations.numpy()) == steps - tau  # the first tau steps apply nothing

    optimizer.apply_pending()
    np.testing.assert_array_equal(big.numpy(), final[0])
    np.testing.assert_array_equal(small.numpy(), final[1])
    assert int(optimizer.iterations.numpy()) == steps
    optimizer.apply_pending()  # nothing left: a second call changes nothing
    np.testing.assert_array_equal(big.numpy(), final[0])


def test_a_step_with_a_nonfinite_gradient_sends_nothing_and_delays_nothing_else():
    tau, steps, density, lr, bad = 2, 8, 0.05, 0.5, 3
    expected, _ = _expected_run(tau, steps, density, lr, nan_steps={bad})
    big = keras.Variable(np.ones(BIG, "float32"))
    small = keras.Variable(np.full(SMALL, 2.0, "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(lr), density=density, staleness=tau)
    step = tf.function(lambda gb, gs: optimizer.apply_gradients([(gb, big), (gs, small)]))
    rng = np.random.RandomState(11)
    for t in range(steps):
        g_big, g_small = _gradients(rng, big.numpy(), small.numpy())
        if t == bad:
            g_big[0, 0] = np.nan
        step(tf.constant(g_big), tf.constant(g_small))
        np.testing.assert_array_equal(big.numpy(), expected[t][0], err_msg=f"step {t}")
    assert optimizer.communication_stats()["skipped_steps"] == 1
    assert np.all(np.isfinite(optimizer.residuals[0].numpy()))


def _fit_model(tau, seed=0):
    model = mlp(seed=seed)
    model.compile(
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.Adam(0.01), density=0.05,
                                              staleness=tau),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False,
    )
    return model


def test_fit_applies_what_is_in_flight_when_it_ends():
    x, y = classification_data(n=64)
    model = _fit_model(tau=3)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    optimizer = model.optimizer
    assert int(optimizer.iterations.numpy()) == 4  # 4 steps, 3 of them applied at fit's end
    assert optimizer.pending_steps() == []


class _SaveAt(keras.callbacks.Callback):
    """Saves the whole model at the end of one epoch, with ``tau`` exchanges in flight."""

    def __init__(self, path, epoch):
        super().__init__()
        self.path, self.epoch = path, epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            self.model.save(self.path)


@pytest.mark.parametrize("tau", [1, 3])
def test_resuming_from_a_checkpoint_written_mid_pipeline_continues_the_same_sequence(tmp_path, tau):
    x, y = classification_data(n=96)
    path = os.path.join(tmp_path, "mid.keras")

    uninterrupted = _fit_model(tau)
    uninterrupted.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0,
                      callbacks=[_SaveAt(path, epoch=1)])

    resumed = keras.models.load_model(path)
    optimizer = resumed.optimizer
    held = optimizer.held_steps()
    assert held == list(range(12 - tau, 12)), "the checkpoint holds the tau exchanges in flight"
    resumed.fit(x, y, batch_size=16, epochs=4, initial_epoch=2, shuffle=False, verbose=0)

    for a, b in zip(weights_of(uninterrupted), weights_of(resumed)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(uninterrupted.optimizer.variables, resumed.optimizer.variables):
        np.testing.assert_array_equal(np.array(a), np.array(b), err_msg=a.path)


def test_tf_train_checkpoint_after_hold_pending_resumes_the_same_sequence(tmp_path):
    tau, steps, density, lr = 2, 8, 0.05, 0.5
    _, final = _expected_run(tau, steps, density, lr)

    def make():
        big = keras.Variable(np.ones(BIG, "float32"))
        small = keras.Variable(np.full(SMALL, 2.0, "float32"))
        optimizer = sparse_hvd.SparseDistributedOptimizer(
            keras.optimizers.SGD(lr), density=density, staleness=tau)
        optimizer.build([big, small])
        checkpoint = tf.train.Checkpoint(big=big, small=small, optimizer=optimizer)
        return big, small, optimizer, checkpoint

    rng = np.random.RandomState(11)
    big, small, optimizer, checkpoint = make()
    for _ in range(5):
        g = _gradients(rng, big.numpy(), small.numpy())
        optimizer.apply_gradients(zip(map(tf.constant, g), [big, small]))
    optimizer.hold_pending()
    saved = checkpoint.save(os.path.join(tmp_path, "ckpt"))

    big, small, optimizer, checkpoint = make()
    checkpoint.restore(saved)
    for _ in range(5, steps):
        g = _gradients(rng, big.numpy(), small.numpy())
        optimizer.apply_gradients(zip(map(tf.constant, g), [big, small]))
    optimizer.apply_pending()
    np.testing.assert_array_equal(big.numpy(), final[0])
    np.testing.assert_array_equal(small.numpy(), final[1])


def test_staleness_serialises_with_the_optimizer():
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), staleness=2)
    config = keras.saving.serialize_keras_object(optimizer)
    assert keras.saving.deserialize_keras_object(config).staleness == 2


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_bad_staleness_is_refused(bad):
    with pytest.raises(ValueError, match="`staleness` must be a non-negative int"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), staleness=bad)


def test_staleness_refuses_the_adaptive_policy():
    with pytest.raises(ValueError, match="AdaptiveDensity"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), staleness=1,
                                              density=sparse_hvd.AdaptiveDensity(),
                                              grouping="layerwise")


def _expected_momentum_correction_run(tau, steps, density, lr, m):
    """DGC's momentum correction with masking, delayed by tau, independently: the sparse
    variable's velocity u = m u + g and accumulation v = v + u, the top-k of v sent at step t
    and applied at t + tau, u and v cleared where sent; the dense-route variable's averaged
    gradient gets ordinary momentum when it is applied (SGD without momentum inside)."""
    rng = np.random.RandomState(11)
    big, small = np.ones(BIG, "float32"), np.full(SMALL, 2.0, "float32")
    u = np.zeros(big.size, "float32")
    v = np.zeros(big.size, "float32")
    small_velocity = np.zeros(SMALL, "float32")
    k, m32, lr32 = math.ceil(density * big.size), np.float32(m), np.float32(lr)
    sent, history = {}, []

    def apply(u_big, u_small):
        nonlocal big, small, small_velocity
        small_velocity = m32 * small_velocity + u_small
        big = big - lr32 * u_big
        small = small - lr32 * small_velocity

    for t in range(steps):
        g_big, g_small = _gradients(rng, big, small)
        u = m32 * u + g_big.ravel()
        chosen, update, v = numpy_topk_split(u + v, k)
        u[chosen] = 0
        sent[t] = (update.reshape(BIG), g_small)
        if t - tau in sent:
            apply(*sent.pop(t - tau))
        history.append((big.copy(), small.copy()))
    for t in sorted(sent):
        apply(*sent[t])
    return history, (big, small)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_staleness_with_momentum_correction_as_a_numpy_recomputation(mode):
    tau, steps, density, lr, m = 2, 8, 0.05, 0.2, 0.9
    expected, final = _expected_momentum_correction_run(tau, steps, density, lr, m)
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(lr), density=density, staleness=tau, momentum_correction=m,
        warmup_steps=0)
    # NumPy and TensorFlow may order the velocity's float additions differently
    big, small = _train_and_compare(optimizer, expected, mode, tolerance=1e-6)
    optimizer.apply_pending()
    np.testing.assert_allclose(big.numpy(), final[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(small.numpy(), final[1], rtol=1e-6, atol=1e-6)


def _float16(values):
    return np.clip(values, -65504, 65504).astype(np.float16).astype(np.float32)


@pytest.mark.parametrize("exchange", ["allgather", "compact_allgather"])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_staleness_with_float16_values_as_a_numpy_recomputation(mode, exchange):
    """compression="float16" through the delayed pipeline: the sparse values and the dense
    gradient travel rounded to float16, the rounding error stays in each residual, and the
    average is applied tau steps late."""
    tau, steps, density, lr = 2, 7, 0.05, 0.3
    rng = np.random.RandomState(11)
    big, small = np.ones(BIG, "float32"), np.full(SMALL, 2.0, "float32")
    residual = np.zeros(big.size, "float32")
    small_residual = np.zeros(SMALL, "float32")
    k, lr32, sent, expected = math.ceil(density * big.size), np.float32(lr), {}, []
    for t in range(steps):
        g_big, g_small = _gradients(rng, big, small)
        compensated = g_big.ravel() + residual
        chosen, _, residual = numpy_topk_split(compensated, k)
        update = np.zeros_like(compensated)
        update[chosen] = _float16(compensated[chosen])
        residual[chosen] = compensated[chosen] - update[chosen]
        small_sent = _float16(g_small + small_residual)
        small_residual = (g_small + small_residual) - small_sent
        sent[t] = (update.reshape(BIG), small_sent)
        if t - tau in sent:
            u_big, u_small = sent.pop(t - tau)
            big, small = big - lr32 * u_big, small - lr32 * u_small
        expected.append((big.copy(), small.copy()))

    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(lr), density=density, staleness=tau, compression="float16",
        warmup_steps=0, exchange=exchange)
    _train_and_compare(optimizer, expected, mode)
    np.testing.assert_array_equal(optimizer.residuals[0].numpy().ravel(), residual)
    np.testing.assert_array_equal(optimizer.residuals[1].numpy(), small_residual)
    assert np.count_nonzero(residual[np.abs(residual) < 1e-2]) > 0  # rounding errors kept


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_packed_tables_sum_every_ranks_entries_in_rank_order(dtype):
    from sparse_hvd.steps.pipeline import pack, unpack_sum

    rng = np.random.RandomState(5)
    n, tables, expected = 300, [], np.zeros(300, dtype)
    for count in (0, 17, 300, 5):  # four "ranks", the first sending nothing
        indices = rng.permutation(n)[:count].astype("int32")
        values = (rng.randn(count) * 1e3).astype(dtype)
        tables.append(pack(values, indices))
        for i, v in zip(indices, values):  # an independent rank-order sum
            expected[i] = expected[i] + v
    total = unpack_sum(np.concatenate(tables), n, dtype)
    assert total.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(total, expected)


def test_coded_tables_sum_every_ranks_entries_in_rank_order():
    """Three variables in one index space, four "ranks", the first sending nothing: each
    rank's indices coded as one set by index_coding, the float32 variables' values (the first
    and the last) in one value_coding block, the float64 one's as they are."""
    from sparse_hvd.exchanges import index_coding, value_coding
    from sparse_hvd.steps.pipeline import pack_coded, unpack_coded_sums

    rng = np.random.RandomState(6)
    sizes, dtypes, groups = (300, 1000, 50), ("float32", "float64", "float32"), ((0, 2), (1,))
    expected = [np.zeros(n, d) for n, d in zip(sizes, dtypes)]
    tables = []
    for counts in ((0, 0, 0), (17, 1000, 2), (300, 3, 50), (5, 0, 1)):
        values, positions = [], []
        for j, (n, count, dtype) in enumerate(zip(sizes, counts, dtypes)):
            indices = np.sort(rng.permutation(n)[:count])
            values.append((rng.randn(count) * 1e3).astype(dtype))
            if count > 1:
                values[-1][1] = 0.0  # a zero among them (exponent 0)
            positions.append(indices + sum(sizes[:j]))
            for i, v in zip(indices, values[-1]):  # an independent rank-order sum
                expected[j][i] = expected[j][i] + v
        code = index_coding.encode(tf.constant(np.concatenate(positions), tf.int64), sum(sizes))
        assert len(code) == elias_fano_words(sum(sizes), sum(counts))
        block = value_coding.encode(tf.constant(np.concatenate([values[0], values[2]])),
                                    [counts[0], counts[2]])
        fields = value_coding.header_fields(block).numpy()
        tables.append(pack_coded(counts, fields, [block.words.numpy(), values[1].view(np.int32)],
                                 code.numpy()))
    totals = unpack_coded_sums(np.concatenate(tables), sizes, groups, dtypes, dtypes)
    for total, want in zip(totals, expected):
        assert total.dtype == want.dtype
        np.testing.assert_array_equal(total, want)


def test_coded_indices_and_values_cut_the_bytes_sent_by_the_closed_form():
    """``communication_stats()`` counts the codes' words instead of k int32 indices and k
    float32 values: an Elias-Fano code of k positions among the sparse entries and
    value_coding's block of the values sent, both recomputed in plain integers from the run
    re-computed in NumPy; the dense route is counted as before."""
    tau, steps, density, lr = 1, 5, 0.05, 0.1
    stats = {}
    for exchange in ("allgather", "compact_allgather"):
        optimizer = sparse_hvd.SparseDistributedOptimizer(
            keras.optimizers.SGD(lr), density=density, staleness=tau, exchange=exchange,
            warmup_steps=0)
        big = keras.Variable(np.ones(BIG, "float32"))
        small = keras.Variable(np.full(SMALL, 2.0, "float32"))
        step = tf.function(lambda gb, gs: optimizer.apply_gradients([(gb, big), (gs, small)]))
        rng = np.random.RandomState(11)
        for _ in range(steps):
            step(*[tf.constant(g) for g in _gradients(rng, big.numpy(), small.numpy())])
        optimizer.apply_pending()
        stats[exchange] = optimizer.communication_stats()["bytes_sent"]
    # the values each step sent, in index order, from the run in NumPy
    rng = np.random.RandomState(11)
    big, small = np.ones(BIG, "float32"), np.full(SMALL, 2.0, "float32")
    residual, k, n = np.zeros(big.size, "float32"), math.ceil(density * big.size), big.size
    pending, saved = {}, 0
    for t in range(steps):
        g_big, g_small = _gradients(rng, big, small)
        compensated = g_big.ravel() + residual
        chosen, update, residual = numpy_topk_split(compensated, k)
        values = compensated[np.sort(chosen)]
        words = elias_fano_words(n, k) + coded_value_words(raw_bits_of(values, "float32"), [k],
                                                           "float32")
        saved += 8 * k - 4 * words
        pending[t] = (update.reshape(BIG), g_small)
        if t - tau in pending:
            u_big, u_small = pending.pop(t - tau)
            big, small = big - np.float32(lr) * u_big, small - np.float32(lr) * u_small
    assert stats["allgather"] - stats["compact_allgather"] == saved
    assert saved > 0.3 * steps * 8 * k  # coded: at most about 5 bytes an entry, not 8
