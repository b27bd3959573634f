"""The step's timestamps: ``communication_stats()``' two spans, gradients -> selections
(``sparsify_seconds``) and selections -> averages (``exchange_seconds``), put a wait for
another rank in the exchange; and with ``grouping="layerwise"`` no timestamp holds a layer's
collective back until the backward pass ends.

One rank (the last) sleeps before each of the timed steps. Every other rank, its selections
made, waits at the exchange's collective for it, so the sleep must land in their exchange
span and not in their selection span; the late rank itself waits for nobody. Inside a
``tf.function`` a timestamp made after the exchange ran after the exchange's stateful ops
(automatic control dependencies order them as made), and the wait was counted as selection.
"""

import time

import keras
import numpy as np
import pytest

import sparse_hvd
from conftest import gather
from helpers import ancestors, classification_data, mlp, training_step

SLEEP = 0.3  # seconds the late rank sleeps before each timed step
TIMED_STEPS = 3
needs_native_stamps = pytest.mark.skipif(
    sparse_hvd.kernels.time_after() is None,
    reason="without the native kernels the step's timestamps are tf.timestamp, which the "
           "trace runs in order (runtime.stamps)")


@needs_native_stamps
@pytest.mark.parametrize("exchange", ["allgather", "sparse_allreduce", "auto"])
def test_a_late_rank_is_counted_in_the_others_exchange_span(hvd, exchange):
    rank, size = hvd.rank(), hvd.size()
    late = size - 1
    model = mlp(seed=1)  # the same initial weights on every rank
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.1), density=0.05, exchange=exchange, warmup_steps=0,
        name=f"spans_{exchange}")
    x, y = classification_data(n=16, seed=rank)
    step = training_step(model, optimizer, x, y)
    for _ in range(2):  # traced, and the collectives set up
        step().numpy()
    before = optimizer.communication_stats()
    for _ in range(TIMED_STEPS):
        if rank == late:
            time.sleep(SLEEP)
        step().numpy()
    after = optimizer.communication_stats()
    spans = [(after[key] - before[key]) / TIMED_STEPS
             for key in ("sparsify_seconds", "exchange_seconds")]
    everyone = gather(hvd, spans, name=f"spans.{exchange}")
    for who, (sparsify, exchanged) in enumerate(everyone):
        assert sparsify < 0.5 * SLEEP, f"rank {who}: selection span {sparsify:.3f} s"
        if who == late:
            assert exchanged < 0.5 * SLEEP, f"rank {who}: exchange span {exchanged:.3f} s"
        else:
            assert exchanged > 0.6 * SLEEP, f"rank {who}: exchange span {exchanged:.3f} s"
    assert np.all(np.isfinite(everyone))


@needs_native_stamps
def test_per_layer_collectives_wait_only_for_their_own_gradient(hvd):
    """``grouping="layerwise"``: the output layer's collective (its gradient is backprop's
    first) does not wait for the input layer's gradient (backprop's last), so it overlaps the
    rest of backprop; the input layer's does wait for it. Neither the gradients' timestamps
    nor the selections' may chain the collectives, through the stall watchdog's bracket,
    behind the whole backward pass."""
    model = mlp(input_dim=32, hidden=64, classes=32, seed=1)  # both kernels sent sparsely
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.1), density=0.05, exchange="allgather", grouping="layerwise",
        warmup_steps=0, name="spans_layerwise")
    x, y = classification_data(n=16, input_dim=32, classes=32, seed=hvd.rank())
    made = {}
    step = training_step(model, optimizer, x, y, seen=made)
    step().numpy()
    graph = step.get_concrete_function().graph
    # named ...spans_layerwise.values.<variable>, ...indices.<variable>
    gathers = {".".join(op.name.split(".")[-2:]): op
               for op in graph.get_operations() if op.type == "HorovodAllgather"}
    first_layer = graph.get_operation_by_name(made["gradients"][0].name)
    for kind in ("values", "indices"):
        assert first_layer in ancestors(gathers[f"{kind}.0"])
        assert first_layer not in ancestors(gathers[f"{kind}.2"]), f"{kind}.2 waits for it"
