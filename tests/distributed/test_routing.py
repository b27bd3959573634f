"""The automatic dense fallback on every rank: the same decision everywhere, and a sparsifier
slower than any network sends nothing sparsely."""

import time

import keras
import tensorflow as tf

import sparse_hvd
from sparse_hvd.selection.sparsifiers import Sparsifier, topk
from conftest import digest, gather
from helpers import classification_data, mlp


class _Sleepy(Sparsifier):
    """Top-k that takes 0.2 s more per layer: slower than any allreduce of these layers."""

    def __call__(self, flat, k):
        def sleep(x):
            time.sleep(0.2)
            return x

        flat = tf.numpy_function(sleep, [flat], flat.dtype, stateful=True)
        return topk(tf.ensure_shape(flat, [None]), k)


def _fit(hvd, sparsifier, name):
    model = mlp(input_dim=40, hidden=64, seed=2)
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.1), density=0.01, sparsifier=sparsifier, dense_fallback=True,
        name=name)
    model.compile(optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    x, y = classification_data(input_dim=40, n=64, seed=hvd.rank())
    model.fit(x, y, batch_size=16, epochs=1, verbose=0,
              callbacks=[sparse_hvd.BroadcastGlobalVariablesCallback(0)])
    return model, optimizer


def test_every_rank_routes_the_same_layers_and_replicas_stay_identical(hvd):
    model, optimizer = _fit(hvd, "topk", "fallback_same")
    # in build order (variable paths can differ between ranks: Keras numbers layer names)
    routes = [stat["route"] for stat in optimizer.layer_stats().values()]
    assert all(r == routes for r in gather(hvd, routes, name="fallback_same.routes"))
    mine = digest(model.get_weights())
    assert set(gather(hvd, mine, name="fallback_same.digest")) == {mine}


def test_a_sparsifier_slower_than_the_network_sends_every_layer_densely(hvd):
    _, optimizer = _fit(hvd, _Sleepy(), "fallback_sleepy")
    assert {stat["route"] for stat in optimizer.layer_stats().values()} == {"dense"}
    stats = optimizer.communication_stats()
    assert stats["bytes_sent"] == stats["dense_bytes"]
