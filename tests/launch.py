"""Launch a command on several ranks with mpirun or horovodrun, always under a time limit.

A job that outlives ``timeout`` is killed with its whole process group and reported as a
failure (``JobResult.timed_out``): a hanging collective is a failing test, never a stuck suite.
"""

import os
import shutil
import sys
from typing import Sequence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import launching  # noqa: E402  (scripts/launching.py: every launcher command line of the project)

LAUNCHERS = ("mpirun", "gloo")

# Horovod's background thread coordinates the ranks once every HOROVOD_CYCLE_TIME ms (1 by
# default), a collective each cycle whether or not a tensor waits. Under horovodrun --gloo on
# 2 shared cores those cycles kept 20-30% of the CPU in system time, and the 2-rank folder job
# (tests/test_distributed.py) took 272 and 286 s at 1 ms against 242 and 247 s at 5 ms (243 s
# at 10) on a slower 2-core machine. Under mpirun (3 ranks) 5 ms was no faster (213 s against
# 202 s), so only Gloo jobs get it; it adds at most a cycle to each collective's start.
GLOO_CYCLE_MS = "5"


JobResult = launching.Finished  # returncode, output, seconds, timed_out


def launcher_available(launcher: str) -> str:
    """Empty string when ``launcher`` can run here, else the reason it cannot."""
    try:
        import horovod.tensorflow as hvd
    except ImportError:
        return "Horovod is not installed (run scripts/setup.sh)"
    if launcher == "mpirun":
        if not shutil.which("mpirun"):
            return "mpirun not found"
        return "" if hvd.mpi_built() else "Horovod was built without MPI"
    if launcher == "gloo":
        if not launching.horovodrun():
            return "horovodrun not found"
        return "" if hvd.gloo_built() else "Horovod was built without Gloo"
    raise ValueError(f"unknown launcher {launcher!r}")


def launch_command(launcher: str, num_ranks: int, argv: Sequence[str]):
    """The command line that starts ``argv`` (a Python script and its arguments) on each rank."""
    return launching.local_job_command(launcher, num_ranks, argv)


def run_job(launcher: str, num_ranks: int, argv: Sequence[str], timeout: float, env=None) -> JobResult:
    """Run ``argv`` on ``num_ranks`` ranks; kill everything after ``timeout`` seconds."""
    job_env = launching.mpi_environment(dict(os.environ, **(env or {})))
    job_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    job_env.setdefault("PYTHONUNBUFFERED", "1")
    # A collective that one rank never reaches makes Horovod shut down instead of waiting forever.
    job_env.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", "15")
    job_env.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "60")
    if launcher == "gloo":
        job_env.setdefault("HOROVOD_CYCLE_TIME", GLOO_CYCLE_MS)
    return launching.run_bounded(launch_command(launcher, num_ranks, argv), job_env, timeout)
