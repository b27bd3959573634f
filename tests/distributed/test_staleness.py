"""Bounded staleness on every rank: the delayed average matches NumPy, replicas stay identical,
and a checkpoint written with exchanges in flight resumes the uninterrupted run."""

import math
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from conftest import digest, gather
from helpers import built, classification_data, each_ranks_inner_state, mlp, numpy_topk_split

BIG = (64, 40)  # sparse route
SMALL = (30,)  # dense route


def _gradient(rank, step, big, small):
    rng = np.random.RandomState(100 * step + rank)
    return (
        (rng.randn(*BIG) + 0.5 * big).astype("float32"),
        (rng.randn(*SMALL) * (rank + 1) + 0.5 * small).astype("float32"),
    )


@pytest.mark.parametrize("tau,bad_step,exchange", [
    (1, None, "allgather"), (2, None, "allgather"), (1, 2, "allgather"), (2, 3, "allgather"),
    (1, None, "compact_allgather"), (2, 3, "compact_allgather")])
def test_the_mean_of_every_ranks_topk_is_applied_tau_steps_later(hvd, tau, bad_step, exchange):
    """With ``bad_step``, the last rank's gradient is NaN at that step: no rank applies that
    step, and every other rank gets what it sent back into its residual when it is due. With
    the compact allgather every rank's indices travel coded and are decoded on every rank."""
    rank, size = hvd.rank(), hvd.size()
    bad_rank = size - 1
    steps, density, lr = 7, 0.05, np.float32(0.25)
    name = f"stale_agg_{tau}_{bad_step}_{exchange}"
    big = keras.Variable(np.ones(BIG, "float32"))
    small = keras.Variable(np.full(SMALL, 2.0, "float32"))
    optimizer = built(sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(float(lr)), density=density, staleness=tau, name=name,
        exchange=exchange), [big, small])
    step = tf.function(lambda gb, gs: optimizer.apply_gradients([(gb, big), (gs, small)]))

    # The same run in NumPy, every rank's part computed here from the shared weights.
    k = math.ceil(density * big.numpy().size)
    e_big, e_small = big.numpy().copy(), small.numpy().copy()
    residuals = [np.zeros(e_big.size, "float32") for _ in range(size)]
    sent, own = {}, {}
    for t in range(steps):
        g_big, g_small = _gradient(rank, t, big.numpy(), small.numpy())
        if t == bad_step and rank == bad_rank:
            g_big[0, 0] = np.nan
        step(tf.constant(g_big), tf.constant(g_small))

        total_big = np.zeros(e_big.size, "float64")
        total_small = np.zeros(SMALL, "float64")
        for r in range(size):
            if t == bad_step and r == bad_rank:
                continue  # its residual is left as it was
            r_big, r_small = _gradient(r, t, e_big, e_small)
            compensated = r_big.ravel() + residuals[r]
            chosen, sent_r, residuals[r] = numpy_topk_split(compensated, k)
            total_big += sent_r
            own[(t, r)] = (chosen, compensated[chosen])
            total_small += r_small
        sent[t] = (total_big.reshape(BIG) / size, total_small / size)
        if t - tau == bad_step:  # dropped everywhere; the good ranks take back what they sent
            sent.pop(t - tau)
            for r in range(size):
                if (t - tau, r) in own:
                    chosen, values = own[(t - tau, r)]
                    residuals[r][chosen] += values
        elif t - tau in sent:
            u_big, u_small = sent.pop(t - tau)
            e_big = (e_big - lr * u_big).astype("float32")
            e_small = (e_small - lr * u_small).astype("float32")
        np.testing.assert_allclose(big.numpy(), e_big, rtol=1e-5, atol=1e-6, err_msg=f"step {t}")
        np.testing.assert_allclose(small.numpy(), e_small, rtol=1e-5, atol=1e-6, err_msg=f"step {t}")
        np.testing.assert_allclose(optimizer.residuals[0].numpy().ravel(), residuals[rank],
                                   rtol=1e-5, atol=1e-6, err_msg=f"step {t}")
        # ...and every rank holds exactly the same weights after every step.
        mine = digest([big.numpy(), small.numpy()])
        assert set(gather(hvd, mine, name=f"{name}.{t}")) == {mine}
    optimizer.apply_pending()
    skipped = 0 if bad_step is None else 1
    assert optimizer.communication_stats()["skipped_steps"] == skipped
    assert optimizer.iterations.numpy() == steps - skipped


def _model_and_data(rank, size, tau, seed=3):
    x, y = classification_data(n=96 * size, seed=seed)
    model = mlp(seed=seed)
    model.compile(
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                              density=0.05, staleness=tau, name="stale_fit"),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False,
    )
    return model, x[rank::size], y[rank::size]


class _SaveAt(keras.callbacks.Callback):
    def __init__(self, path, epoch):
        super().__init__()
        self.path, self.epoch = path, epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch and self.path:
            self.model.save(self.path)


def _replicated_state(model):
    """Weights and the optimizer state that is the same on every rank (not the residuals, nor
    the inner optimizer's momentum, which follows each rank's gradients with the default
    sparsify="update")."""
    own = [*model.optimizer.local_variables, *each_ranks_inner_state(model.optimizer)]
    local = {id(v) for v in own}
    return [np.array(w) for w in model.get_weights()] + [
        np.array(v) for v in model.optimizer.variables if id(v) not in local
    ]


def _every_state(model):
    """Weights and all of the optimizer's state, each rank's own included."""
    return [np.array(w) for w in model.get_weights()] + [
        np.array(v) for v in model.optimizer.variables]


def test_fit_with_staleness_keeps_replicas_bit_identical_when_only_rank_0_saves(hvd, tmp_path):
    rank, size = hvd.rank(), hvd.size()
    model, x, y = _model_and_data(rank, size, tau=2)
    path = os.path.join(tmp_path, "rank0.keras") if rank == 0 else None
    # Rank 0's save holds its exchanges in flight in the slots; the others keep them in the
    # pipeline: both paths must apply the same averages.
    model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
              callbacks=[sparse_hvd.BroadcastGlobalVariablesCallback(0), _SaveAt(path, epoch=0)])
    mine = digest(_replicated_state(model))
    assert set(gather(hvd, mine, name="stale_fit.digest")) == {mine}
    assert model.optimizer.iterations.numpy() == 3 * 6


def test_resume_from_a_mid_pipeline_checkpoint_matches_the_uninterrupted_run(hvd, tmp_path):
    rank, size = hvd.rank(), hvd.size()
    # Each rank keeps its own checkpoint here, so that its own residuals come back exactly.
    path = os.path.join(tmp_path, f"mid.rank{rank}.keras")
    model, x, y = _model_and_data(rank, size, tau=2)
    callbacks = [sparse_hvd.BroadcastGlobalVariablesCallback(0)]
    model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
              callbacks=callbacks + [_SaveAt(path, epoch=0)])

    resumed = keras.models.load_model(path)
    assert resumed.optimizer.held_steps() == [4, 5]
    resumed.fit(x, y, batch_size=16, epochs=3, initial_epoch=1, shuffle=False, verbose=0)
    for a, b in zip(_every_state(model), _every_state(resumed)):
        np.testing.assert_array_equal(a, b)
    mine = digest(_replicated_state(resumed))
    assert set(gather(hvd, mine, name="stale_resume.digest")) == {mine}
