"""The grouped exchange's single fused allgather, checked on every rank against NumPy.

Its rule (sparse_hvd/exchanges/fused_allgather.py): every variable's entries are summed rank by rank, in rank
order, and divided by the number of workers; small dense-route gradients are summed the same
way; every rank's "finite" flag travels in the header. Because the order is fixed, the result
is compared with NumPy's float arithmetic in the same order bit for bit, not to a tolerance.
"""

import numpy as np
import pytest
import tensorflow as tf

from sparse_hvd.exchanges import base as exchange_module
from sparse_hvd.exchanges.compact_allgather import CompactAllgather
from sparse_hvd.exchanges.fused_allgather import FusedAllgather as Exchange
from sparse_hvd.exchanges.layerwise import LayerwiseCompactAllgather
from sparse_hvd.feedback.payload import PayloadBuilder, Route
from sparse_hvd.selection.sparsifiers import Selection
from conftest import digest, gather
from helpers import coded_value_words, elias_fano_words, raw_bits_of

# (entries, dtype) of the sparse-route variables, then of the dense-route ones
SPARSE = [(500, "float32"), (37, "float32"), (300, "float64"), (64, "float16")]
DENSE = [((7, 3), "float32"), ((5,), "float64"), ((4,), "float32")]


def _selection(rank, variable, n, dtype):
    """Rank-dependent count (rank 0 sends nothing of variable 0), positions shared between
    ranks (position 1 is sent by every rank that sends two or more), random values."""
    count = (rank + variable) % 4 * 3 if (rank, variable) != (0, 0) else 0
    count = min(count, n)
    rng = np.random.RandomState(100 * variable + rank)
    indices = np.sort(rng.choice(n, size=count, replace=False)).astype("int32")
    if count >= 2:
        indices[0], indices[1] = 0, 1
        indices = np.unique(indices)
    values = rng.randn(len(indices)).astype(dtype)
    return indices, values


def _dense(rank, variable, shape, dtype):
    return np.random.RandomState(7000 + 10 * variable + rank).randn(*shape).astype(dtype)


def _payload(rank, finite, shuffled=False):
    builder = PayloadBuilder(check_finite=True)
    position = 0
    for variable, (n, dtype) in enumerate(SPARSE):
        indices, values = _selection(rank, variable, n, dtype)
        if shuffled:  # as top-k sends them: by magnitude, not by position
            order = np.random.RandomState(rank).permutation(len(indices))
            indices, values = indices[order], values[order]
        route = Route(n, True, np.dtype(dtype).itemsize)
        gradient = tf.constant(np.full(n, 1.0 if finite else np.nan, dtype))
        builder.add_sparse(position, variable, route,
                           gradient, Selection(tf.constant(values), tf.constant(indices)))
        position += 1
    for variable, (shape, dtype) in enumerate(DENSE, start=len(SPARSE)):
        route = Route(int(np.prod(shape)), False, np.dtype(dtype).itemsize)
        builder.add_dense(position, variable, route, tf.constant(_dense(rank, variable, shape, dtype)))
        position += 1
    return builder.build()


def _expected(size):
    """NumPy, rank by rank in rank order, then divided by the number of workers."""
    out = []
    for variable, (n, dtype) in enumerate(SPARSE):
        total = np.zeros(n, dtype)
        for r in range(size):
            indices, values = _selection(r, variable, n, dtype)
            total[indices] += values  # distinct within one rank
        out.append(total / np.asarray(size, dtype))
    for variable, (shape, dtype) in enumerate(DENSE, start=len(SPARSE)):
        total = np.zeros(shape, dtype)
        for r in range(size):
            total = total + _dense(r, variable, shape, dtype)
        out.append(total / np.asarray(size, dtype))
    return out


NUM_ELEMENTS = [n for n, _ in SPARSE] + [int(np.prod(s)) for s, _ in DENSE]


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("kind", [Exchange, CompactAllgather, LayerwiseCompactAllgather])
def test_fused_average_is_the_rank_order_sum_bit_for_bit(hvd, mode, kind):
    """The compact exchanges' coded indices (sent in any order; one set over every variable,
    or one per variable with grouping="layerwise") decode to the same sums."""
    rank, size = hvd.rank(), hvd.size()
    exchange = kind(name=f"test.fused.{mode}.{kind.__name__}")
    compact = kind is not Exchange
    run = lambda: exchange.average(_payload(rank, True, compact), NUM_ELEMENTS)  # noqa: E731
    # traced as the optimizer's step traces it: never converted by AutoGraph (a user's
    # tf.function reaches the exchange through apply(), which is not converted)
    averaged = tf.function(run, autograph=False)() if mode == "function" else run()
    results = [a.numpy().reshape(-1) for a in averaged.gradients]
    for variable, (result, expected) in enumerate(zip(results, _expected(size))):
        assert result.dtype == expected.dtype
        if kind.per_layer and variable >= len(SPARSE):  # Horovod's allreduce, its own order
            np.testing.assert_allclose(result, expected.reshape(-1), rtol=1e-6,
                                       err_msg=f"variable {variable}")
            continue
        np.testing.assert_array_equal(result, expected.reshape(-1), err_msg=f"variable {variable}")
    assert bool(averaged.finite)
    name = f"fused.digest.{mode}.{kind.__name__}"
    assert len(set(gather(hvd, digest(results), name=name))) == 1


@pytest.mark.parametrize("kind", [Exchange, LayerwiseCompactAllgather])
def test_one_rank_not_finite_is_seen_by_every_rank(hvd, kind):
    rank, size = hvd.rank(), hvd.size()
    averaged = kind(name=f"test.fused.nonfinite.{kind.__name__}").average(
        _payload(rank, finite=rank != size - 1), NUM_ELEMENTS)
    assert not bool(averaged.finite)


def test_layerwise_compact_counts_each_variables_own_code(hvd):
    """With grouping="layerwise" each variable's selection is coded among its own entries:
    the bytes sent are the payload's with every selection's int32 indices and raw values
    replaced by an Elias-Fano code of its k positions among its n entries and value_coding's
    block of its values (float64 raw), recomputed here in plain integers."""
    rank = hvd.rank()
    payload = _payload(rank, True, shuffled=True)
    averaged = LayerwiseCompactAllgather(name="test.fused.layerwise_bytes").average(
        payload, NUM_ELEMENTS)
    expected = int(payload.bytes_sent)
    for variable, (n, dtype) in enumerate(SPARSE):
        indices, values = _selection(rank, variable, n, dtype)  # index order, as coded
        k = len(indices)
        value_words = 2 * k if dtype == "float64" else coded_value_words(
            raw_bits_of(values, dtype), [k], dtype)
        expected += 4 * (elias_fano_words(n, k) + value_words) - k * (4 + np.dtype(dtype).itemsize)
    assert int(averaged.bytes_sent) == expected


def test_dense_route_too_large_to_gather_is_allreduced(hvd, monkeypatch):
    rank, size = hvd.rank(), hvd.size()
    monkeypatch.setattr(exchange_module, "DENSE_GATHER_LIMIT", 0)
    averaged = Exchange(name="test.fused.allreduce").average(_payload(rank, True), NUM_ELEMENTS)
    for result, expected in zip(averaged.gradients, _expected(size)):
        np.testing.assert_allclose(result.numpy().reshape(-1), expected.reshape(-1), rtol=1e-3)
    assert bool(averaged.finite)


def test_layerwise_compact_trains_as_the_layerwise_allgather_does_in_fewer_bytes(hvd):
    """The optimizer with grouping="layerwise": the compact allgather's weights after ten
    steps of error feedback are the layerwise allgather's, bit for bit (the same rank-order
    sums; the dense route the same allreduces; its averages at positions, the plain one's
    dense), on every rank, for fewer bytes sent."""
    import keras

    import sparse_hvd
    from helpers import built, classification_data, mlp, weights_of

    rank = hvd.rank()
    x, y = classification_data(n=160, seed=rank)  # each rank its own data
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    weights, sent = {}, {}
    for exchange in ("allgather", "compact_allgather"):
        model = mlp(seed=3)  # the same initial weights on every rank and for both runs
        optimizer = built(sparse_hvd.SparseDistributedOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9), density=0.05, grouping="layerwise",
            exchange=exchange, min_elements=64, name=f"layerwise_{exchange}"),
            model.trainable_variables)

        @tf.function(jit_compile=False)
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        for i in range(10):
            step(tf.constant(x[16 * i:16 * (i + 1)]), tf.constant(y[16 * i:16 * (i + 1)]))
        weights[exchange] = weights_of(model)
        sent[exchange] = optimizer.communication_stats()["bytes_sent"]
        assert any(s["route"] == "sparse" and s["exchange"] == exchange
                   for s in optimizer.layer_stats().values())
        if exchange == "compact_allgather":  # the update cut: each part's averages at positions
            parts = optimizer._exchange._parts.values()
            assert optimizer.sparsify == "update" and parts and all(p._at_positions for p in parts)
    for plain, coded in zip(weights["allgather"], weights["compact_allgather"]):
        np.testing.assert_array_equal(coded, plain)
    assert sent["compact_allgather"] < 0.8 * sent["allgather"]
    everyone = gather(hvd, digest(weights["compact_allgather"]), name="layerwise_compact.digest")
    assert len(set(everyone)) == 1
