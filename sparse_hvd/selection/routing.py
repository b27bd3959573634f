"""Automatic dense fallback: send a layer sparsely only where that is faster than a dense allreduce.

On a fast network a dense allreduce of a layer can cost less than selecting its top entries,
gathering them from every worker and scatter-adding them: sparsification then slows training
down. With ``SparseDistributedOptimizer(..., dense_fallback=True)`` the optimizer decides per
layer, once, when it is built, from measurements of the live job:

1. sparsify: this rank times its own sparse path for each candidate layer (compensate, select,
   remember, and the receiver's scatter-add of what arrives), on random data of the layer's
   shape with the density policy's k (median of a few calls after a warm-up);
2. network: ``t = alpha + beta * bytes`` is fitted to timed Horovod allgathers and allreduces
   of several sizes (``sparse_hvd.selection.adaptive``);
3. the timings and both models are averaged over the ranks, so every rank decides the same;
4. a layer goes dense when ``beta_allreduce * n * itemsize`` is no more than
   ``t_sparsify + beta_allgather * k * (itemsize + INDEX_BYTES)``: the latencies are left out, as fused
   messages share them.

The decision is printed by rank 0 and shown by ``optimizer.layer_stats()``; it is not
re-measured during training. With one worker nothing is sent, so every layer goes dense.
"""

import statistics
import time

import numpy as np
import tensorflow as tf

from ..runtime import collectives, log, startup as runtime
from .adaptive import fit_latency_bandwidth, probe_allgather_costs, probe_allreduce_costs
from ..exchanges.averaging import average_entries
from .density import elements_to_send
from ..feedback.error_feedback import compensate_and_select
from ..feedback.payload import INDEX_BYTES

PROBE_BYTES = (65536, 524288, 2097152, 8388608)
SPARSIFY_REPEATS = 3


def time_sparsify(num_elements, dtype, k, sparsifier, error_feedback, repeats=SPARSIFY_REPEATS):
    """Median seconds of this rank's sparse path for one layer of ``num_elements`` entries."""
    rng = np.random.default_rng(num_elements)
    grad = tf.constant(rng.standard_normal(num_elements).astype(dtype))
    residual = tf.constant((0.1 * rng.standard_normal(num_elements)).astype(dtype))

    @tf.function(jit_compile=False, autograph=False)  # as the step traces it: unconverted
    def work(grad, residual):
        selection, remainder = compensate_and_select(grad, residual, sparsifier, k, error_feedback)
        received = average_entries(selection.indices, selection.values,
                                   tf.reshape(tf.size(selection.indices), [1, 1]), [0],
                                   [num_elements], 2)[0]
        return received[0] + (remainder[0] if remainder is not None else 0)

    work(grad, residual).numpy()  # trace and warm up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work(grad, residual).numpy()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def dense_is_faster(num_elements, itemsize, k, sparsify_seconds, beta_gather, beta_reduce):
    """Step 4 of the module doc: the allreduce of the whole layer takes no longer than
    sparsifying it and gathering k (value, int32 index) pairs from every rank."""
    sparse_seconds = sparsify_seconds + beta_gather * k * (itemsize + INDEX_BYTES)
    return beta_reduce * num_elements * itemsize <= sparse_seconds


def choose_dense_layers(routes, dtypes, density, sparsifier, error_feedback, name, process_set=None):
    """Indices of the sparse-route layers that a dense allreduce moves faster. Eager; a
    collective: every rank must call it with the same routes."""
    candidates = [i for i, route in enumerate(routes) if route.sparse]
    if not candidates:
        return []
    size = runtime.size(process_set)
    if size == 1:
        return candidates
    sparsify = [
        time_sparsify(routes[i].num_elements, dtypes[i], elements_to_send(routes[i].num_elements, density),
                      sparsifier, error_feedback)
        for i in candidates
    ]
    gather_times, _ = probe_allgather_costs(f"{name}.fallback", PROBE_BYTES, 3, process_set)
    reduce_times, _ = probe_allreduce_costs(f"{name}.fallback", PROBE_BYTES, 3, process_set)
    sizes = tf.constant(PROBE_BYTES, tf.float64)
    _, beta_gather = fit_latency_bandwidth(sizes, gather_times)
    _, beta_reduce = fit_latency_bandwidth(sizes, reduce_times)
    measured = tf.concat([tf.constant(sparsify, tf.float64), tf.stack([beta_gather, beta_reduce])], 0)
    measured = collectives.allreduce(measured, name=f"{name}.fallback.measured",
                                     process_set=process_set).numpy()
    sparsify, beta_gather, beta_reduce = measured[:-2], measured[-2], measured[-1]
    dense = [
        i for position, i in enumerate(candidates)
        if dense_is_faster(routes[i].num_elements, routes[i].itemsize,
                           elements_to_send(routes[i].num_elements, density),
                           sparsify[position], beta_gather, beta_reduce)
    ]
    if runtime.rank(process_set) == 0:
        log.info(f"dense fallback: {len(dense)} of {len(candidates)} sparse-route layers go "
                 f"dense (allreduce {1 / max(beta_reduce, 1e-30) / 1e6:,.0f} MB/s, allgather "
                 f"{1 / max(beta_gather, 1e-30) / 1e6:,.0f} MB/s per rank's payload, sparsify "
                 f"{1e3 * float(np.sum(sparsify)):.1f} ms per step)")
    return dense


def route_densely_where_faster(optimizer, var_list):
    """``dense_fallback`` for a ``SparseDistributedOptimizer`` being built: the variables a
    dense allreduce moves faster are routed densely (timed on the live job, the same decision
    on every rank)."""
    with tf.init_scope():
        slower = choose_dense_layers(
            optimizer._routes, [tf.as_dtype(v.dtype).as_numpy_dtype for v in var_list],
            optimizer.density, optimizer.sparsifier, optimizer.error_feedback,
            name=optimizer._prefix, process_set=optimizer.process_set)
    for index in slower:
        optimizer._routes[index] = optimizer._routes[index]._replace(sparse=False)
