"""Runs tests/distributed/ on every rank under mpirun and horovodrun (Gloo), each under a timeout."""

import os
import re

import pytest

from launch import launcher_available, run_job

HERE = os.path.dirname(os.path.abspath(__file__))
RANK_TESTS = os.path.join(HERE, "distributed")
RANK_ENV = {"SPARSE_HVD_RANK_TESTS": "1",
            **({"SPARSE_HVD_FULL_SUITE": "1"} if os.environ.get("SPARSE_HVD_FULL_SUITE") else {})}
# seconds for a whole job; a hang fails the test instead of the suite. On a slower 2-core machine
# the 3-rank folder job (3 ranks on 2 cores) took 532 s alone and ran past 600 s inside the
# suite, so the bound is generous: it is there to catch a hang, never to time the job.
JOB_TIMEOUT = 1200
# the job's own limit decides (pytest-timeout's default, setup.cfg, is shorter than a whole
# folder's job on a loaded machine); a margin to report the hung job's output
bounded_by_the_job = pytest.mark.timeout(JOB_TIMEOUT + 60)


# The default tier runs every file of tests/distributed once, under MPI (3 ranks) or Gloo (2
# ranks): the replicas, logging and staleness files and the two costliest (the auto exchange's
# trials and the option matrix) under Gloo, the rest (among them every exchange's own file, at an
# odd size) under MPI. Per file the two jobs cost about the same (measured: 2 Gloo ranks 309 s
# for the whole folder, 3 MPI ranks on 2 cores about as much), and the suite's time has room for
# each file once. The sparse allreduce's file runs in both: at 2 ranks it is one gather, its own
# code path (in the Gloo job rather than a job of its own, which cost about 30 s more to start).
# SPARSE_HVD_FULL_SUITE=1 (`scripts/test.sh --full`): every file under both.
GLOO_ONLY = ("test_replicas.py", "test_logging.py", "test_staleness.py",
             "test_option_matrix.py", "test_auto_exchange.py")
GLOO_TOO = ("test_sparse_allreduce.py",)


def rank_test_targets(launcher):
    """The pytest arguments that choose what ``launcher``'s job runs of tests/distributed."""
    if os.environ.get("SPARSE_HVD_FULL_SUITE"):
        return [RANK_TESTS]
    if launcher == "gloo":
        return [os.path.join(RANK_TESTS, name) for name in GLOO_ONLY + GLOO_TOO]
    return [RANK_TESTS] + [f"--ignore={os.path.join(RANK_TESTS, name)}" for name in GLOO_ONLY]


# MPI at an odd size, Gloo at an even one (the suite's time leaves no room for every launcher
# at every size; run e.g. `mpirun -np 2 ... pytest tests/distributed` by hand for more).
@pytest.mark.distributed
@bounded_by_the_job
@pytest.mark.parametrize("launcher,num_ranks", [("gloo", 2), ("mpirun", 3)])
def test_rank_tests_pass_on_every_rank(launcher, num_ranks):
    reason = launcher_available(launcher)
    if reason:
        pytest.skip(reason)
    targets = rank_test_targets(launcher)
    result = run_job(
        launcher, num_ranks,
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--color=no", *targets],
        timeout=JOB_TIMEOUT, env=RANK_ENV,
    )
    assert not result.timed_out, f"job hung for {JOB_TIMEOUT}s:\n{result.output[-6000:]}"
    assert result.returncode == 0, result.output[-10000:]
    summaries = re.findall(r"(\d+) passed(?:, \d+ \w+)* in ", result.output)
    assert len(summaries) == num_ranks, f"expected a pytest summary from each rank:\n{result.output[-6000:]}"
    assert len(set(summaries)) == 1 and int(summaries[0]) > 0
    assert not re.search(r"\d+ (failed|errors?)\b", result.output), result.output[-10000:]


# the jobs above run the same file at 3 ranks (the regions and the alltoall) and at 2 (one
# gather); the full suite also runs it at N = 5 (56 s)
@pytest.mark.distributed
@bounded_by_the_job
@pytest.mark.parametrize("launcher,num_ranks", [
    pytest.param("mpirun", 5, marks=pytest.mark.extended)])
def test_sparse_allreduce_rank_tests_pass_at_other_sizes(launcher, num_ranks):
    reason = launcher_available(launcher)
    if reason:
        pytest.skip(reason)
    result = run_job(
        launcher, num_ranks,
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--color=no",
         os.path.join(RANK_TESTS, "test_sparse_allreduce.py")],
        timeout=JOB_TIMEOUT, env=RANK_ENV,
    )
    assert not result.timed_out, f"job hung for {JOB_TIMEOUT}s:\n{result.output[-6000:]}"
    assert result.returncode == 0, result.output[-10000:]
    summaries = re.findall(r"(\d+) passed(?:, \d+ \w+)* in ", result.output)
    assert len(summaries) == num_ranks and len(set(summaries)) == 1, result.output[-6000:]
    assert not re.search(r"\d+ (failed|errors?)\b", result.output), result.output[-10000:]


@pytest.mark.distributed
@bounded_by_the_job
@pytest.mark.quick
def test_quick_tier_aggregation_on_two_ranks():
    """The quick tier's one multi-rank job (scripts/test.sh --quick): the aggregation tests,
    NumPy re-computations of what every rank applies, on 2 ranks under mpirun."""
    if not os.environ.get("SPARSE_HVD_QUICK"):
        pytest.skip("the full suite runs the whole folder above (this is the quick tier's job)")
    reason = launcher_available("mpirun")
    if reason:
        pytest.skip(reason)
    result = run_job(
        "mpirun", 2,
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--color=no",
         os.path.join(RANK_TESTS, "test_aggregation.py")],
        timeout=JOB_TIMEOUT, env=RANK_ENV,
    )
    assert not result.timed_out, f"job hung for {JOB_TIMEOUT}s:\n{result.output[-6000:]}"
    assert result.returncode == 0, result.output[-10000:]
    summaries = re.findall(r"(\d+) passed(?:, \d+ \w+)* in ", result.output)
    assert len(summaries) == 2 and len(set(summaries)) == 1 and int(summaries[0]) > 0, result.output[-6000:]
