"""backward_passes_per_step on several ranks: B passes on each rank are one exchange of each
rank's sum of B gradients, and every rank ends with the same weights."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from conftest import digest, gather

SHAPE = (60, 50)


@pytest.mark.parametrize("exchange", ["allgather", "sparse_allreduce"])
def test_accumulated_passes_are_one_exchange_of_their_sums_on_every_rank(hvd, exchange):
    rng = np.random.RandomState(10 + hvd.rank())
    grads = [rng.randn(*SHAPE).astype("float32") for _ in range(6)]
    results = []
    for passes, fed in ((3, grads), (1, [grads[0] + grads[1] + grads[2],
                                         grads[3] + grads[4] + grads[5]])):
        variable = keras.Variable(np.ones(SHAPE, "float32"))
        optimizer = sparse_hvd.SparseDistributedOptimizer(
            keras.optimizers.SGD(0.1), density=0.02, exchange=exchange,
            backward_passes_per_step=passes)
        for grad in fed:  # eagerly (the traced path is tested in one process)
            optimizer.apply([tf.constant(grad)], [variable])
        assert optimizer.communication_stats()["steps"] == 2
        results.append(variable.numpy())
    np.testing.assert_array_equal(results[0], results[1])
    everyone = gather(hvd, digest(results), f"accumulation.{exchange}")
    assert len(set(everyone)) == 1, "replicas differ"


def test_keras_accumulation_on_the_inner_optimizer_is_one_exchange_of_the_averaged_passes(hvd):
    """gradient_accumulation_steps=3 on the inner SGD: the wrapper averages the 3 passes and
    exchanges once, which equals one step on each rank's mean of them; the same on every rank."""
    rng = np.random.RandomState(20 + hvd.rank())
    grads = [rng.randn(*SHAPE).astype("float32") for _ in range(6)]
    results = []
    for inner, fed in ((keras.optimizers.SGD(0.1, gradient_accumulation_steps=3), grads),
                       (keras.optimizers.SGD(0.1), [sum(grads[:3]) / 3, sum(grads[3:]) / 3])):
        variable = keras.Variable(np.ones(SHAPE, "float32"))
        optimizer = sparse_hvd.SparseDistributedOptimizer(inner, density=0.02, warmup_steps=0)
        for grad in fed:
            optimizer.apply([tf.constant(grad)], [variable])
        assert optimizer.communication_stats()["steps"] == 2
        assert int(optimizer.iterations.numpy()) == 2  # updates, as Keras counts them
        assert int(optimizer._iterations.numpy()) == len(fed)  # backward passes
        results.append(variable.numpy())
    np.testing.assert_array_equal(results[0], results[1])
    everyone = gather(hvd, digest([results[0]]), "accumulation.keras")
    assert len(set(everyone)) == 1, "replicas differ"


def test_accumulated_passes_with_staleness_are_the_delayed_exchange_of_their_sums(hvd):
    rng = np.random.RandomState(30 + hvd.rank())
    grads = [rng.randn(*SHAPE).astype("float32") for _ in range(6)]
    results = []
    for passes, fed in ((2, grads), (1, [grads[i] + grads[i + 1] for i in range(0, 6, 2)])):
        variable = keras.Variable(np.ones(SHAPE, "float32"))
        optimizer = sparse_hvd.SparseDistributedOptimizer(
            keras.optimizers.SGD(0.1), density=0.02, warmup_steps=0, staleness=1,
            backward_passes_per_step=passes, name=f"stale_passes_{passes}")
        for grad in fed:
            optimizer.apply([tf.constant(grad)], [variable])
        optimizer.apply_pending()
        results.append(variable.numpy())
    np.testing.assert_array_equal(results[0], results[1])
    everyone = gather(hvd, digest([results[0]]), "accumulation.staleness")
    assert len(set(everyone)) == 1, "replicas differ"
