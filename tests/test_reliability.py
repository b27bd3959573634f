"""The watchdog, the step check and the helpers for unequal shards, in one process (the
multi-rank behaviour is in test_failures.py and test_faults.py)."""

import os
import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from sparse_hvd.runtime import lockstep
from sparse_hvd.runtime import watchdog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_python(code, env=None, timeout=60):
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=environment, cwd=ROOT)


@pytest.mark.parametrize("traced,native", [(False, "1"), (True, "1"), (True, "0")])
def test_a_wait_longer_than_the_limit_ends_the_process_saying_what_it_waited_for(traced, native):
    """A "collective" that never returns (a sleep), bracketed as sparse_hvd brackets its
    collectives: eagerly, and as the ops of a traced step (native ops, or numpy_functions
    without the native kernels)."""
    result = _run_python(f"""
        import time
        import numpy as np
        import tensorflow as tf
        from sparse_hvd.runtime import watchdog

        def never_returns(tensors):
            if {traced}:
                return [tf.numpy_function(lambda x: (time.sleep(60), x)[1], [tensors[0]], tf.float32)]
            time.sleep(60)

        run = lambda: watchdog.bracket(never_returns, [tf.constant([1.0])], "test.exchange",
                                       step=tf.constant(7))
        if {traced}:
            step = tf.function(run)
            kinds = {{op.type for op in step.get_concrete_function().graph.get_operations()}}
            print("native brackets:", "SparseHvdWatchEnter" in kinds, flush=True)
            step()
        else:
            run()
        print("returned, which it must not")
    """, env={"SPARSE_HVD_STALL_TIMEOUT": "1.5", "SPARSE_HVD_NATIVE": native})
    assert result.returncode == watchdog.EXIT_STATUS, result.stderr[-3000:]
    if traced:
        assert f"native brackets: {native == '1'}" in result.stdout, result.stdout
    assert "returned, which it must not" not in result.stdout
    # how long past the limit depends on the watchdog's polling and the machine's load
    assert re.search(r"has waited [23] s in collective 'test\.exchange' at training step 7 for "
                     r"the other ranks, longer than the limit of 1\.5 s \(SPARSE_HVD_STALL_TIMEOUT\)",
                     result.stderr), result.stderr


def test_waits_shorter_than_the_limit_and_a_limit_of_zero_do_nothing(monkeypatch):
    monkeypatch.setattr(watchdog, "_timeout", None)
    monkeypatch.setenv("SPARSE_HVD_STALL_TIMEOUT", "1")
    for _ in range(3):  # three waits of 0.6 s under a limit of 1 s: each one alone counts
        with watchdog.waiting("short"):
            time.sleep(0.6)
    sparse_hvd.init(stall_timeout=0)
    assert not watchdog.enabled()
    with watchdog.waiting("unwatched"):
        time.sleep(1.5)
    assert not watchdog._waits  # noqa: SLF001 (nothing left behind to be timed)


@pytest.mark.parametrize("value", ["soon", "-1", "inf", "nan"])
def test_a_bad_limit_in_the_environment_is_named(monkeypatch, value):
    monkeypatch.setattr(watchdog, "_timeout", None)
    monkeypatch.setenv("SPARSE_HVD_STALL_TIMEOUT", value)
    with pytest.raises(ValueError, match="SPARSE_HVD_STALL_TIMEOUT must be a"):
        watchdog.timeout()


@pytest.mark.parametrize("value,error", [(True, TypeError), ("x", ValueError), (-2, ValueError)])
def test_a_bad_limit_argument_is_named(monkeypatch, value, error):
    monkeypatch.setattr(watchdog, "_timeout", None)
    with pytest.raises(error, match="`stall_timeout`"):
        sparse_hvd.init(stall_timeout=value)


def test_the_step_fields_and_the_mismatch_message():
    assert lockstep.fields(tf.constant(5, tf.int64)).numpy().tolist() == [5, lockstep.TRAINING]
    assert lockstep.fields(tf.constant((1 << 31) + 3, tf.int64), lockstep.FINISHED).numpy().tolist() == [3, 1]
    agreed = np.array([[4, 0], [4, 0], [4, 0]], np.int32)
    assert bool(lockstep.agree(agreed))
    assert lockstep.check(agreed) is None
    for differing in ([[4, 0], [5, 0]], [[4, 0], [4, 1]], [[4, 1], [4, 2]]):
        assert not bool(lockstep.agree(np.array(differing, np.int32)))
    text = lockstep.message(np.array([[40, 0], [40, 2], [39, 1]], np.int32))
    assert ("rank 0 is in training step 40; rank 1 has ended an epoch after 40 steps; "
            "rank 2 has finished training after 39 steps.") in text
    with pytest.raises(ValueError, match="rank 1 is in training step 5"):
        lockstep.check(np.array([[4, 0], [5, 0]], np.int32))


def test_a_traced_mismatch_raises_before_anything_gathered_is_used():
    gathered = tf.Variable([7.0])

    @tf.function
    def step(fields):
        used = lockstep.after_check(fields, [gathered.read_value()])
        gathered.assign(used[0] + 1.0)

    step(tf.constant([[3, 0], [3, 0]]))
    assert gathered.numpy().tolist() == [8.0]
    with pytest.raises(tf.errors.OpError) as raised:
        step(tf.constant([[3, 0], [2, 0]]))
    assert "rank 1 is in training step 2" in str(raised.value)
    assert lockstep.mismatch_error(raised.value).args[0].startswith("sparse_hvd: the ranks are not")
    assert gathered.numpy().tolist() == [8.0]


def test_equal_shards_and_steps_per_epoch_alone():
    x, y = np.arange(10).reshape(5, 2), np.arange(5)
    cut_x, cut_y = sparse_hvd.equal_shards(x, y)
    np.testing.assert_array_equal(cut_x, x)
    np.testing.assert_array_equal(cut_y, y)
    assert sparse_hvd.equal_shards(x) is not None and len(sparse_hvd.equal_shards(x)) == 5
    assert sparse_hvd.steps_per_epoch(7) == 7
    with pytest.raises(ValueError, match="different lengths \\[4, 5\\]"):
        sparse_hvd.equal_shards(x, y[:4])
    with pytest.raises(ValueError, match="`num_batches` must be a non-negative int"):
        sparse_hvd.steps_per_epoch(2.5)
    with pytest.raises(ValueError, match="no batch at all"):
        sparse_hvd.steps_per_epoch(0)


def test_a_steps_collectives_share_one_watched_wait(monkeypatch):
    """Inside one_wait (a step's exchange) one enter/leave pair serves every collective, and
    every wait is left once the step is done."""
    monkeypatch.setattr(watchdog, "_timeout", 300.0)
    x = tf.Variable([1.0, 2.0])

    def collective(tensors):
        return [tensors[0] * 2.0]

    def step(shared):
        if shared:
            with watchdog.one_wait():
                first = watchdog.bracket(collective, [x.read_value()], "a", step=tf.constant(3))
                second = watchdog.bracket(collective, [first[0]], "b", step=tf.constant(3))
        else:
            first = watchdog.bracket(collective, [x.read_value()], "a", step=tf.constant(3))
            second = watchdog.bracket(collective, [first[0]], "b", step=tf.constant(3))
        return second[0]

    for shared, pairs in ((True, 1), (False, 2)):
        graph = tf.function(lambda: step(shared)).get_concrete_function().graph
        names = [op.name for op in graph.get_operations()]
        assert sum("watchdog_enter" in n for n in names) == pairs
        assert sum("watchdog_leave" in n for n in names) == pairs
        assert tf.function(lambda: step(shared))().numpy().tolist() == [4.0, 8.0]
    assert watchdog.open_waits() == 0


@pytest.mark.parametrize("native", [True, False])
def test_a_wait_left_open_by_a_failed_step_is_dropped_when_the_step_runs_again(monkeypatch,
                                                                               native):
    """A traced step that raises inside its bracketed exchange (a failed collective, the step
    check's mismatch) never runs its leave bracket; a job that catches the error and trains
    on must not be ended by that wait: the step's next run replaces it. Waits of other
    collectives stay."""
    monkeypatch.setattr(watchdog, "_timeout", 300.0)
    if not native:
        monkeypatch.setattr(watchdog, "_native_ops", lambda: None)
    elif watchdog._native_ops() is None:
        pytest.skip("the native kernels are off in this run (SPARSE_HVD_NATIVE=0 or a GPU)")
    before = watchdog.open_waits()

    def collective(tensors):
        with tf.control_dependencies([tf.debugging.Assert(tensors[0] > 0.0, ["NaN"])]):
            return [tensors[0] * 2.0]

    step = tf.function(lambda x: watchdog.bracket(collective, [x], "test.failing", step=tf.constant(5))[0])
    other = tf.function(lambda x: watchdog.bracket(lambda t: [tf.numpy_function(
        lambda v: v, [t[0]], tf.float32)], [x], "test.other")[0])
    assert float(step(tf.constant(1.0))) == 2.0
    assert watchdog.open_waits() == before
    for failures in (1, 2):
        with pytest.raises(tf.errors.InvalidArgumentError, match="NaN"):
            step(tf.constant(-1.0))
        assert watchdog.open_waits() == before + 1  # the failed run's wait, and only one
    assert float(other(tf.constant(3.0))) == 3.0  # another collective neither drops it...
    assert watchdog.open_waits() == before + 1
    assert float(step(tf.constant(1.0))) == 2.0  # ...but the step's next run does
    assert watchdog.open_waits() == before
