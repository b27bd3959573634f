"""Faults a new user runs into, on 2 ranks under mpirun and horovodrun --gloo: each job must
end with a message that names the cause on every rank, or train correctly
(tests/distributed/job_faults.py holds the jobs; a stuck or dying rank is in test_failures.py)."""

import os
import re

import pytest

from launch import LAUNCHERS, launcher_available, run_job

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed", "job_faults.py")
BOUND = 150  # seconds; a job still running then is killed and the test fails
# Rank 1 has 320 samples, rank 0 640, in batches of 16: 20 and 40 steps an epoch, 3 epochs.
MISMATCH = {
    "uneven_callbacks": "rank 0 is in training step 20; rank 1 has ended an epoch after 20 steps",
    "uneven": "rank 0 is in training step 60; rank 1 has finished training after 60 steps",
}


def _run(launcher, args):
    reason = launcher_available(launcher)
    if reason:
        pytest.skip(reason)
    # Horovod's own stall shutdown off: what ends these jobs must be sparse_hvd's doing.
    env = {"SPARSE_HVD_STALL_TIMEOUT": "30", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "0"}
    result = run_job(launcher, 2, [JOB] + list(args), timeout=BOUND, env=env)
    assert not result.timed_out, f"the job hung:\n{result.output[-5000:]}"
    print(f"{launcher} {' '.join(args)}: status {result.returncode} after {result.seconds:.1f} s")
    return result


# Each case under both launchers; the exchanges split between them to keep the suite short.
# every case and exchange once; the other launcher's in the extended tier
UNEVEN = [("gloo", "uneven_callbacks", "sparse_allreduce"), ("mpirun", "uneven", "allgather"),
          pytest.param("mpirun", "uneven_callbacks", "allgather", marks=pytest.mark.extended),
          pytest.param("gloo", "uneven", "sparse_allreduce", marks=pytest.mark.extended)]
GOOD = [("gloo", "sparse_allreduce"), pytest.param("mpirun", "allgather", marks=pytest.mark.extended)]


@pytest.mark.distributed
@pytest.mark.parametrize("launcher,case,exchange", UNEVEN)
def test_uneven_shards_stop_every_rank_naming_each_ranks_step(launcher, case, exchange):
    result = _run(launcher, [case, exchange])
    assert result.returncode != 0
    assert not re.search(r"rank \d finished \w+ after", result.output), result.output[-5000:]
    for rank in (0, 1):
        raised = re.search(rf"^.*rank {rank} raised: .*$", result.output, re.M)
        assert raised, f"rank {rank} did not raise:\n{result.output[-5000:]}"
    # rank 0's error is TensorFlow's, with sparse_hvd's message inside: both name both ranks
    assert result.output.count(MISMATCH[case]) >= 2, result.output[-5000:]
    assert "sparse_hvd.equal_shards" in result.output


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", [
    pytest.param(launcher, marks=pytest.mark.extended) if launcher == "gloo" else launcher
    for launcher in LAUNCHERS])
def test_an_optimizer_created_on_one_rank_only_is_named_in_an_error_on_every_rank(launcher):
    result = _run(launcher, ["extra_optimizer"])
    assert result.returncode != 0
    for rank in (0, 1):
        assert re.search(rf"rank {rank} raised: ValueError: .*name is 'sparse_distributed_optimizer_1' "
                         r"on rank 0 but 'sparse_distributed_optimizer' on rank 1", result.output), \
            result.output[-5000:]


@pytest.mark.distributed
@pytest.mark.parametrize("launcher,exchange", GOOD)
def test_equal_shards_repeated_datasets_and_bfloat16_train_identical_replicas(launcher, exchange):
    result = _run(launcher, ["good", exchange])
    assert result.returncode == 0, result.output[-5000:]
    # equal_shards: 320 samples everywhere; repeat_dataset: min(40, 20) steps an epoch;
    # bfloat16: 640 samples on both ranks
    for case, steps in (("equal_shards", 60), ("repeat_dataset", 60), ("bfloat16", 120)):
        found = re.findall(rf"rank (\d) finished {case} after (\d+) steps \(0 skipped\) "
                           r"digest (\w+)", result.output)
        assert sorted(rank for rank, _, _ in found) == ["0", "1"], result.output[-5000:]
        assert {int(s) for _, s, _ in found} == {steps}, found
        assert len({digest for _, _, digest in found}) == 1, f"{case}: replicas differ: {found}"
