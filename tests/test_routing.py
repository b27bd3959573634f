"""The automatic dense fallback in one process: the decision rule, and a job of one."""

import keras
import pytest

import sparse_hvd
from sparse_hvd.selection.routing import dense_is_faster
from helpers import classification_data, mlp


def test_the_rule_compares_an_allreduce_with_sparsify_plus_allgather():
    # 1 M float32 entries, k = 10 000: the allreduce moves 4 MB, the allgather 80 KB per rank.
    n, k = 1_000_000, 10_000
    slow_net = dict(beta_gather=1e-8, beta_reduce=1e-8)  # 100 MB/s: 40 ms vs 0.8 ms + sparsify
    assert not dense_is_faster(n, 4, k, sparsify_seconds=0.02, **slow_net)
    assert dense_is_faster(n, 4, k, sparsify_seconds=0.05, **slow_net)
    fast_net = dict(beta_gather=1e-10, beta_reduce=1e-10)  # 10 GB/s: 0.4 ms vs sparsify
    assert dense_is_faster(n, 4, k, sparsify_seconds=0.001, **fast_net)
    assert not dense_is_faster(n, 4, k, sparsify_seconds=0.0001, **fast_net)


def test_alone_every_layer_goes_dense_and_nothing_is_sparsified():
    model = mlp(input_dim=40, hidden=64)
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), density=0.01,
                                                      dense_fallback=True)
    model.compile(optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    x, y = classification_data(input_dim=40)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert {stat["route"] for stat in optimizer.layer_stats().values()} == {"dense"}
    stats = optimizer.communication_stats()
    assert stats["bytes_sent"] == stats["dense_bytes"]


def test_dense_fallback_must_be_a_bool_and_serialises():
    with pytest.raises(TypeError, match="`dense_fallback`"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), dense_fallback="yes")
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), dense_fallback=True)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(optimizer))
    assert restored.dense_fallback is True
