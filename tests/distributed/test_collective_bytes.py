"""The benchmarks' count of what the collectives bring into a rank
(scripts/benchmarks/collective_bytes.py), against sizes worked out from the ranks' inputs."""

import os
import sys

import tensorflow as tf

import sparse_hvd.runtime.collectives as collectives

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "scripts", "benchmarks"))
import collective_bytes  # noqa: E402

WRAPPED = ("allgather", "grouped_allgather", "alltoall", "allreduce", "grouped_allreduce")


def _counter(monkeypatch, rank, size):
    for name in WRAPPED:  # put back after the test, whatever install() replaced
        monkeypatch.setattr(collectives, name, getattr(collectives, name))
    return collective_bytes.CollectiveBytes(tf, rank, size).install(collectives)


def test_each_collective_counts_what_the_other_ranks_sent(hvd, monkeypatch):
    rank, size = hvd.rank(), hvd.size()
    counter = _counter(monkeypatch, rank, size)
    others = [r for r in range(size) if r != rank]

    # rank r gathers 3 (r + 1) float32 values: the others' 12 (s + 1) bytes come in
    collectives.allgather(tf.ones([3 * (rank + 1)]), name="cb.gather")
    expected = sum(12 * (s + 1) for s in others)
    assert counter.read() == expected

    # two tensors in one message: 2 float64 rows of 4 values, and r float64 values
    collectives.grouped_allgather([tf.zeros([2, 4], tf.float64), tf.zeros([rank], tf.float64)],
                                  name="cb.grouped")
    expected += sum(64 + 8 * s for s in others)
    assert counter.read() == expected

    # rank s sends s + j + 1 rows of 2 int16 values to rank j: rank r receives the others'
    splits = tf.constant([rank + j + 1 for j in range(size)], tf.int32)
    rows = int(tf.reduce_sum(splits))
    received, _ = collectives.alltoall(tf.zeros([rows, 2], tf.int16), splits, name="cb.a2a")
    assert received.shape[0] == sum(s + rank + 1 for s in range(size))
    expected += sum(4 * (s + rank + 1) for s in others)
    assert counter.read() == expected

    # an allreduce as a ring: 2 (N - 1) / N of its 40 + 8 bytes, rounded down
    collectives.allreduce(tf.ones([10]), name="cb.reduce")
    collectives.grouped_allreduce([tf.ones([2], tf.float32)], name="cb.greduce")
    expected += 40 * 2 * (size - 1) // size + 8 * 2 * (size - 1) // size
    assert counter.read() == expected


def test_inside_a_traced_step_only_the_branch_that_runs_counts(hvd, monkeypatch):
    rank, size = hvd.rank(), hvd.size()
    counter = _counter(monkeypatch, rank, size)

    @tf.function
    def step(gather_more):
        return tf.cond(
            gather_more,
            lambda: tf.reduce_sum(collectives.allgather(tf.ones([5]), name="cb.more")),
            lambda: tf.reduce_sum(collectives.allgather(tf.ones([1]), name="cb.less")))

    flags = [True, False, False]
    for flag in flags:
        step(tf.constant(flag))
    per_step = {True: 20, False: 4}
    assert counter.read() == sum(per_step[f] for f in flags) * (size - 1)
