"""A rank that raises or dies makes the whole job fail within a bounded time."""

import os
import re

import pytest

from launch import launcher_available, run_job

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed", "job_rank_fails.py")
BOUND = 120  # seconds; the job is killed (and the test fails) if it is still running then


# What each launcher says when a rank is killed (SIGKILL: exit status 137).
KILLED = {"mpirun": r"mpirun noticed that process rank 1 with PID \d+ on node \S+ exited on "
                    r"signal 9 \(Killed\)",
          "gloo": r"The first process to do so was:\s+Process name: 1\s+Exit code: 137"}


def assert_training_had_started(output):
    """Both ranks trained three steps before rank 1 failed (a job that died at import or
    start-up would not have printed this)."""
    for rank in (0, 1):
        assert re.search(rf"rank {rank} trained 3 steps", output), output[-5000:]


# Rank 1 raises, is killed, or stalls (sleeps outside any collective). A stall is ended by
# sparse_hvd's watchdog (its limit shortened here; Horovod's own stall shutdown is off), under
# horovodrun --gloo too, where Horovod 0.28.1's stall shutdown did not end such a job.
# each way of failing under one launcher; the other launcher's in the extended tier
CASES = [("mpirun", "raise"), ("gloo", "kill"), ("gloo", "stall"),
         pytest.param("gloo", "raise", marks=pytest.mark.extended),
         pytest.param("mpirun", "kill", marks=pytest.mark.extended),
         pytest.param("mpirun", "stall", marks=pytest.mark.extended)]
STALE_CASES = [("gloo", "kill"), ("mpirun", "none"),
               pytest.param("mpirun", "kill", marks=pytest.mark.extended)]
WATCHDOG = {"SPARSE_HVD_STALL_TIMEOUT": "10", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "0"}


@pytest.mark.distributed
@pytest.mark.parametrize("launcher,how", CASES)
def test_a_failing_rank_ends_the_job_quickly(launcher, how):
    reason = launcher_available(launcher)
    if reason:
        pytest.skip(reason)
    result = run_job(launcher, 2, [JOB, how], timeout=BOUND, env=WATCHDOG)
    assert not result.timed_out, f"the job hung after rank 1 failed:\n{result.output[-5000:]}"
    assert result.returncode != 0
    assert "finished training, which it must not" not in result.output
    assert_training_had_started(result.output)
    if how == "kill":
        assert re.search(KILLED[launcher], result.output), result.output[-5000:]
    if how == "raise":
        assert "rank 1 fails on purpose" in result.output
    if how == "stall":
        # rank 0 waits in one of the step's collectives at its fourth step (step 3: the
        # default's trial times it), and says so
        assert re.search(r"sparse_hvd: rank 0 of 2 has waited 1\d s in collective "
                         r"'sparse_hvd\.\S+' at training step 3 .*SPARSE_HVD_STALL_TIMEOUT",
                         result.output), result.output[-5000:]
    print(f"{launcher}/{how}: job ended with status {result.returncode} after {result.seconds:.1f} s")


@pytest.mark.distributed
@pytest.mark.parametrize("launcher,how", STALE_CASES)
def test_staleness_on_one_interop_thread_finishes_and_a_dying_rank_ends_the_job(launcher, how):
    """With staleness=2 the exchange runs on the optimizer's thread: a job on one TensorFlow
    inter-op thread must finish (no starvation), and one whose rank 1 dies must end."""
    reason = launcher_available(launcher)
    if reason:
        pytest.skip(reason)
    result = run_job(launcher, 2, [JOB, how, "2"], timeout=BOUND, env=WATCHDOG)
    assert not result.timed_out, f"the job hung:\n{result.output[-5000:]}"
    if how == "none":
        assert result.returncode == 0, result.output[-5000:]
        assert result.output.count("finished training") == 2
    else:
        assert result.returncode != 0
        assert "finished training, which it must not" not in result.output
        assert re.search(KILLED[launcher], result.output), result.output[-5000:]
    assert_training_had_started(result.output)
    print(f"{launcher}/{how}/staleness: status {result.returncode} after {result.seconds:.1f} s")
