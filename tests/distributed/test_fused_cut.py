"""The update cut with a plain SGD and one budget for the model, on every rank: the local step,
error feedback and the model-wide cut in one native pass (``sparse_hvd.feedback.fused_cut``)
against NumPy's float32 arithmetic of every rank's step: each rank's velocity and residual bit
for bit, the weights the mean of what every rank sent (times the default's factor on SGD's
sparse steps, ``update_scale``), the replicas identical."""

import math

import keras
import numpy as np
import tensorflow as tf

import sparse_hvd
from sparse_hvd import kernels
from sparse_hvd.selection.defaults import SGD_UPDATE_SCALE
from conftest import digest, gather
from helpers import native_op

SHAPES = [(60, 50), (40, 100)]  # 3,000 and 4,000 entries: both sparse; the cut exact (small)
RATE, MOMENTUM, DENSITY = 0.1, 0.9, 0.01


def _gradient(rank, step, shape):
    return np.random.RandomState(1000 * step + rank).randn(*shape).astype("float32")


def test_every_rank_sends_its_local_steps_entries_at_the_model_wide_cut(hvd):
    native_op(kernels.local_sgd_cut)
    rank, size = hvd.rank(), hvd.size()
    start = [np.random.RandomState(7 + i).randn(*s).astype("float32")
             for i, s in enumerate(SHAPES)]
    variables = [keras.Variable(w.copy()) for w in start]
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(RATE, momentum=MOMENTUM), density=DENSITY, warmup_steps=0,
        budget="model", exchange="allgather", name="fused_cut_ranks")
    assert optimizer.update_scale == SGD_UPDATE_SCALE  # the default at this density

    @tf.function
    def step(g0, g1):
        optimizer.apply_gradients([(g0, variables[0]), (g1, variables[1])])

    sizes = [math.prod(s) for s in SHAPES]
    budget = sum(math.ceil(DENSITY * n) for n in sizes)
    weights = [w.ravel().copy() for w in start]
    velocities = [[np.zeros(n, "float32") for n in sizes] for _ in range(size)]
    residuals = [[np.zeros(n, "float32") for n in sizes] for _ in range(size)]
    rate, momentum = np.float32(RATE), np.float32(MOMENTUM)
    for t in range(4):
        step(*[tf.constant(_gradient(rank, t, s)) for s in SHAPES])
        summed = [np.zeros(n, "float64") for n in sizes]
        for r in range(size):
            compensated = []
            for i, shape in enumerate(SHAPES):
                velocity = velocities[r][i] * momentum - _gradient(r, t, shape).ravel() * rate
                update = weights[i] - (weights[i] + velocity)  # Keras' step, as an update
                velocities[r][i] = velocity
                compensated.append(update + residuals[r][i])
            cut = np.sort(np.abs(np.concatenate(compensated)))[::-1][budget - 1]
            for i, c in enumerate(compensated):
                sent = np.flatnonzero(np.abs(c) >= cut)
                summed[i][sent] += c[sent]
                residuals[r][i] = c.copy()
                residuals[r][i][sent] = 0.0
        for i in range(len(SHAPES)):
            # a constant rate is the peak: the factor at the peak
            weights[i] = (weights[i] - SGD_UPDATE_SCALE[0] * summed[i] / size).astype("float32")
            np.testing.assert_allclose(variables[i].numpy().ravel(), weights[i], rtol=1e-6,
                                       atol=1e-7, err_msg=f"rank {rank}, step {t}")
            weights[i] = variables[i].numpy().ravel().copy()  # go on from the applied bits
            np.testing.assert_array_equal(optimizer.residuals[i].numpy().ravel(),
                                          residuals[rank][i], err_msg=f"rank {rank}, step {t}")
            velocity = optimizer.inner_optimizer.momentums[i].numpy().ravel()
            np.testing.assert_array_equal(velocity, velocities[rank][i],
                                          err_msg=f"rank {rank}, step {t}")
    definition = step.get_concrete_function(
        *[tf.TensorSpec(s, tf.float32) for s in SHAPES]).graph.as_graph_def()
    types = {node.op for node in definition.node}
    for function in definition.library.function:
        types |= {node.op for node in function.node_def}
    assert "SparseHvdLocalSgdCut" in types and "SparseHvdLocalSgd" not in types
    digests = gather(hvd, digest([v.numpy() for v in variables]), name="fused_cut.digest")
    assert len(set(digests)) == 1, "replicas differ"
