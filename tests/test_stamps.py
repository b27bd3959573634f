"""``runtime.stamps.time_after``: the clock once a tensor exists, not chained to the step's
other stateful operations (kernels/time_after.cc)."""

import time

import pytest
import tensorflow as tf

from sparse_hvd import kernels
from sparse_hvd.runtime.stamps import time_after

needs_native = pytest.mark.skipif(kernels.time_after() is None,
                                  reason="the native kernels are not in use here")


def test_it_reads_the_same_clock_as_tf_timestamp_when_its_input_exists():
    before = tf.timestamp().numpy()
    x = tf.random.uniform([1000])
    stamp = time_after(x).numpy()
    after = time.time()
    assert before <= stamp <= after + 1e-3
    assert time_after(tf.IndexedSlices(x, tf.range(1000), [1000])).numpy() >= stamp


@needs_native
def test_in_a_trace_it_waits_for_its_input_and_for_no_earlier_stateful_op():
    """Automatic control dependencies chain a ``tf.timestamp`` made after another one to it;
    ``time_after`` takes its input and no control input, so a stamp of an early tensor made
    after the stamp of a late one still fires when the early one exists."""
    seen = {}

    @tf.function
    def step(x):
        late = tf.timestamp()
        chained = tf.timestamp()
        early = time_after(x * 2.0)
        seen.update(late=late.op, chained=chained.op, early=early.op)
        return late, chained, early

    step(tf.ones([4]))
    graph = step.get_concrete_function(tf.TensorSpec([4])).graph
    chained = graph.get_operation_by_name(seen["chained"].name)
    early = graph.get_operation_by_name(seen["early"].name)
    assert seen["late"].name in [op.name for op in chained.control_inputs]
    assert early.type == "SparseHvdTimeAfter"
    assert list(early.control_inputs) == []
    assert [t.op.type for t in early.inputs] == ["Mul"]


def test_without_the_native_op_it_is_a_timestamp_after_its_input(monkeypatch):
    monkeypatch.setattr(kernels, "time_after", lambda: None)
    x = tf.constant([1.0])

    @tf.function
    def stamp(y):
        return time_after(y * 3.0)

    value = stamp(x).numpy()
    graph = stamp.get_concrete_function(tf.TensorSpec([1])).graph
    stamps = [op for op in graph.get_operations() if op.type == "Timestamp"]
    assert len(stamps) == 1 and [op.type for op in stamps[0].control_inputs] == ["Mul"]
    assert value <= time.time()
