"""The sparse allreduce owner's steps 3-4 (exchanges/owner_sums.py): the native kernel and the
TensorFlow ops (as on CPU without the kernel, and as with a GPU visible), against a NumPy
re-computation that adds each index's entries rank by rank from zero."""

import numpy as np
import pytest
import tensorflow as tf

from sparse_hvd import kernels
from sparse_hvd.exchanges import averaging, owner_sums as module
from sparse_hvd.exchanges.owner_sums import owner_sums
from sparse_hvd.exchanges.global_threshold import LEVELS

STARTS = [0, 300, 301, 5000]  # a one-entry variable among them


def _received(ranks, dtype, seed, ordered):
    """Per rank, distinct global indices (shared between ranks: sums of several entries) with
    values over six orders of magnitude, so rounding depends on the order of the additions;
    ``ordered``: each rank's ascending, as the coded blocks arrive (the kernel merges up to
    two such runs and sorts more)."""
    rng = np.random.RandomState(seed)
    indices, values, per_rank = [], [], []
    for _ in range(ranks):
        chosen = rng.choice(6000, size=rng.randint(1, 900), replace=False)
        chosen = np.concatenate([[300], chosen[chosen != 300]])  # the one-entry variable
        if ordered:
            chosen = np.sort(chosen)
        indices.append(chosen.astype(np.int32))
        values.append((rng.randn(chosen.size) * 10.0 ** rng.uniform(-3, 3, chosen.size))
                      .astype(dtype))
        per_rank.append(chosen.size)
    return indices, values, per_rank


def _numpy(indices, values, thresholds, starts=STARTS):
    sums = {}
    for rank_indices, rank_values in zip(indices, values):  # rank order, from zero
        for i, x in zip(rank_indices.tolist(), rank_values):
            sums[i] = sums.get(i, x.dtype.type(0)) + x
    order = sorted(sums)
    counts = np.zeros((len(starts), len(LEVELS)), np.int32)
    kept = []
    for i in order:
        variable = np.searchsorted(starts, i, side="right") - 1
        magnitude = abs(float(sums[i]))
        theta = thresholds[variable]
        counts[variable] += [magnitude >= theta * level for level in LEVELS]
        if magnitude >= theta:
            kept.append(i)
    dtype = values[0].dtype
    return np.array(kept, np.int32), np.array([sums[i] for i in kept], dtype), counts


def _use(monkeypatch, path):
    if path == "native" and kernels.owner_sum() is None:
        pytest.skip("the native kernels are off in this run (SPARSE_HVD_NATIVE=0 or a GPU)")
    if path != "native":
        monkeypatch.setattr(module.kernels, "owner_sum", lambda: None)
    monkeypatch.setattr(averaging.startup, "_GPU", path == "gpu")


@pytest.mark.parametrize("path", ["native", "tensorflow", "gpu"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("ranks,seed", [(1, 0), (2, 3), (3, 1), (5, 2)])
@pytest.mark.parametrize("ordered", [False, True])
def test_owner_sums_are_rank_order_sums_kept_at_the_threshold(monkeypatch, path, dtype, ranks,
                                                              seed, ordered):
    _use(monkeypatch, path)
    indices, values, per_rank = _received(ranks, dtype, seed, ordered)
    thresholds = [0.5, 0.0, 2.0, 1e9]  # theta 0 keeps all; 1e9 keeps none
    got = owner_sums(tf.constant(np.concatenate(indices)), tf.constant(np.concatenate(values)),
                     tf.constant(per_rank, tf.int32), tf.constant(STARTS, tf.int32),
                     tf.constant(thresholds, tf.float64), LEVELS)
    expected = _numpy(indices, values, thresholds)
    for name, g, e in zip(("kept indices", "kept sums", "counts"), got, expected):
        assert g.dtype.as_numpy_dtype == e.dtype, name
        np.testing.assert_array_equal(g.numpy(), e, err_msg=name)
    assert expected[2][3].sum() == 0 and expected[2][1][0] == 1  # the cases above were hit


@pytest.mark.parametrize("path", ["native", "tensorflow"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_a_variable_that_received_nothing_between_others_counts_nothing(monkeypatch, path,
                                                                        ranks):
    """The native kernel walks the variables as the ascending sums pass their starts: one
    that received nothing (here [2000, 3000), and the empty one at 3000) is stepped over,
    its counts zero, and the next one's sums counted against its own threshold."""
    _use(monkeypatch, path)
    starts = [0, 300, 301, 2000, 3000, 3000, 5000]
    indices, values, per_rank = _received(ranks, "float32", 7, ordered=True)
    outside = [(i < 2000) | (i >= 3000) for i in indices]
    indices = [i[keep] for i, keep in zip(indices, outside)]
    values = [v[keep] for v, keep in zip(values, outside)]
    per_rank = [int(keep.sum()) for keep in outside]
    thresholds = [0.5, 0.0, 2.0, 0.0, 0.0, 0.3, 1.0]
    got = owner_sums(tf.constant(np.concatenate(indices)), tf.constant(np.concatenate(values)),
                     tf.constant(per_rank, tf.int32), tf.constant(starts, tf.int32),
                     tf.constant(thresholds, tf.float64), LEVELS)
    expected = _numpy(indices, values, thresholds, starts)
    for name, g, e in zip(("kept indices", "kept sums", "counts"), got, expected):
        np.testing.assert_array_equal(g.numpy(), e, err_msg=name)
    assert not expected[2][3:5].any() and expected[2][5].all() and expected[2][6].any()


def test_nothing_received_keeps_nothing(monkeypatch):
    for path in ("native", "tensorflow"):
        if path == "native" and kernels.owner_sum() is None:
            continue
        if path != "native":
            monkeypatch.setattr(module.kernels, "owner_sum", lambda: None)
        kept, sums, counts = owner_sums(
            tf.zeros([0], tf.int32), tf.zeros([0], tf.float32), tf.constant([0, 0], tf.int32),
            tf.constant(STARTS, tf.int32), tf.zeros([4], tf.float64), LEVELS)
        assert kept.shape == (0,) and sums.shape == (0,) and not counts.numpy().any()
