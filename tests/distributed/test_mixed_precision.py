"""Loss scaling across ranks: an overflow on one rank lowers the scale on every rank."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from conftest import digest, gather


@pytest.mark.parametrize("exchange", ["allgather", "sparse_allreduce"])
def test_an_overflow_on_the_last_rank_skips_the_step_and_halves_the_scale_everywhere(hvd, exchange):
    rank, size = hvd.rank(), hvd.size()
    variable = keras.Variable(np.ones((50, 40), "float32"))
    inner = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=256.0)
    optimizer = sparse_hvd.SparseDistributedOptimizer(inner, density=0.1, exchange=exchange,
                                                      name=f"mixed_overflow_{exchange}")
    optimizer.build([variable])
    step = tf.function(lambda g: optimizer.apply_gradients([(g, variable)]))

    for t in range(4):
        grad = np.random.RandomState(10 * t + rank).randn(50, 40).astype("float32")
        if t == 1 and rank == size - 1:
            grad[3, 4] = np.inf  # only this rank overflows
        step(tf.constant(grad * float(inner.dynamic_scale.numpy())))

    assert optimizer.communication_stats()["skipped_steps"] == 1
    assert float(inner.dynamic_scale.numpy()) == 128.0
    assert inner.iterations.numpy() == 3
    mine = digest([variable.numpy(), inner.dynamic_scale.numpy()])
    assert set(gather(hvd, mine, name=f"mixed_overflow.digest.{exchange}")) == {mine}
    assert np.all(np.isfinite(optimizer.residuals[0].numpy()))
