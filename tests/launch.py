"""Launch a command on several ranks with mpirun or horovodrun, always under a time limit.

A job that outlives ``timeout`` is killed with its whole process group and reported as a
failure (``JobResult.timed_out``): a hanging collective is a failing test, never a stuck suite.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from typing import NamedTuple, Sequence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import launching  # noqa: E402  (scripts/launching.py: every launcher command line of the project)

LAUNCHERS = ("mpirun", "gloo")


class JobResult(NamedTuple):
    returncode: int
    output: str
    seconds: float
    timed_out: bool


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
    python = launching.python_argv(argv)
    if launcher == "mpirun":
        return launching.mpirun_command(num_ranks, python, tcp_only=True, tag_output=True)
    if launcher == "gloo":
        return launching.gloo_command(num_ranks, python)
    raise ValueError(f"unknown launcher {launcher!r}")


def run_job(launcher: str, num_ranks: int, argv: Sequence[str], timeout: float, env=None) -> JobResult:
    """Run ``argv`` on ``num_ranks`` ranks; kill everything after ``timeout`` seconds."""
    job_env = launching.mpi_environment(dict(os.environ, **(env or {})))
    job_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    job_env.setdefault("PYTHONUNBUFFERED", "1")
    # A collective that one rank never reaches makes Horovod shut down instead of waiting forever.
    job_env.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", "15")
    job_env.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "60")
    command = launch_command(launcher, num_ranks, argv)
    start = time.monotonic()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=job_env,
        start_new_session=True, text=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        timed_out = True
    return JobResult(
        returncode=process.returncode, output=output, seconds=time.monotonic() - start,
        timed_out=timed_out,
    )
