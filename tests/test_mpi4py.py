"""mpi4py communicators: two independent trainings in one mpirun job, each on its own
sub-communicator (examples/two_trainings.py, both of its ways), and their refusal under Gloo."""

import os
import re

import pytest

from launch import launcher_available, run_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "two_trainings.py")
GLOO_JOB = os.path.join(ROOT, "tests", "distributed", "job_mpi4py_on_gloo.py")


@pytest.mark.distributed
@pytest.mark.parametrize("via", [pytest.param("init", marks=pytest.mark.extended), "process_set"])
def test_two_trainings_on_sub_communicators_each_keep_identical_replicas(via):
    reason = launcher_available("mpirun")
    if reason:
        pytest.skip(reason)
    result = run_job("mpirun", 4, [EXAMPLE, "--via", via, "--epochs", "2"], timeout=240)
    assert not result.timed_out, result.output[-5000:]
    assert result.returncode == 0, result.output[-5000:]
    lines = re.findall(r"group (\d) rank (\d) of (\d): accuracy ([\d.]+) digest (\w+)", result.output)
    assert sorted((g, r) for g, r, _, _, _ in lines) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    assert all(size == "2" for _, _, size, _, _ in lines)
    digests = {g: {d for group, _, _, _, d in lines if group == g} for g in ("0", "1")}
    assert len(digests["0"]) == 1 and len(digests["1"]) == 1, digests  # identical inside a group
    assert digests["0"] != digests["1"]  # two different trainings
    assert all(float(accuracy) > 0.5 for _, _, _, accuracy, _ in lines)


@pytest.mark.distributed
def test_communicators_are_refused_under_gloo_with_a_message():
    reason = launcher_available("gloo")
    if reason:
        pytest.skip(reason)
    result = run_job("gloo", 2, [GLOO_JOB], timeout=180)
    assert not result.timed_out, result.output[-5000:]
    assert result.returncode == 0, result.output[-5000:]
    assert "which it must not" not in result.output
    for form in ("init(comm=...)", "init(process_sets=...)", "process_set=communicator"):
        refused = re.findall(rf"rank \d refused {re.escape(form)}: .*needs Horovod's MPI controller, "
                             r"but this job runs on Gloo", result.output)
        assert len(refused) == 2, result.output[-5000:]
    assert result.output.count("of 2 done") == 2
