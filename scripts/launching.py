"""The command lines that start a program on several ranks, for the tests, benchmarks and scripts.

One place builds every ``mpirun`` and ``horovodrun`` command line of the project, so that the
settings that matter on this kind of machine are chosen once and the same everywhere:

* ``--bind-to none``: ranks share a few cores with their TensorFlow thread pools; binding each
  rank to one core would starve them;
* ``--oversubscribe`` on one host: more ranks than cores is fine for tests;
* ``--mca btl self,tcp`` where the test is about the network path (no shared-memory shortcut);
* ``--mca mpi_yield_when_idle 1`` where ranks must not busy-poll cores the others compute on;
* as root, Open MPI's two ``OMPI_ALLOW_RUN_AS_ROOT*`` variables (:func:`mpi_environment`).

Only the standard library is imported, so a test or a benchmark's driver can use it without
loading TensorFlow.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Iterable, NamedTuple, Sequence, Tuple


def mpi_environment(base=None) -> dict:
    """``base`` (the process environment by default) plus what mpirun needs as root."""
    env = dict(os.environ if base is None else base)
    if os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def mpirun_command(num_ranks: int, argv: Sequence[str], *, hosts: Sequence[str] = (),
                   tcp_only: bool = False, tcp_include: str = None, oob_include: str = None,
                   yield_when_idle: bool = False, tag_output: bool = False,
                   export: Iterable[str] = (), mca: Iterable[Tuple[str, str]] = ()):
    """``mpirun`` starting ``argv`` on ``num_ranks`` ranks.

    Args:
        hosts: one slot on each of these hosts (``-H h1:1,h2:1``); none: all ranks on this
            machine, oversubscribed.
        tcp_only: MPI's point-to-point traffic over TCP only (``--mca btl self,tcp``).
        tcp_include, oob_include: the interface or subnet MPI's TCP traffic and Open MPI's
            out-of-band channel may use.
        yield_when_idle: ranks waiting in MPI yield their core instead of polling.
        tag_output: prefix every output line with the rank that printed it.
        export: environment variables (``NAME`` or ``NAME=value``) passed on to every rank.
        mca: further ``--mca key value`` pairs.
    """
    command = ["mpirun", "-np", str(num_ranks)]
    if hosts:
        command += ["-H", ",".join(f"{host}:1" for host in hosts)]
    else:
        command += ["--oversubscribe"]
    command += ["--bind-to", "none"]
    if tag_output:
        command += ["--tag-output"]
    settings = list(mca)
    if yield_when_idle:
        settings.append(("mpi_yield_when_idle", "1"))
    if tcp_only or tcp_include:
        settings.append(("btl", "self,tcp"))
    if tcp_include:
        settings.append(("btl_tcp_if_include", tcp_include))
    if oob_include:
        settings.append(("oob_tcp_if_include", oob_include))
    for key, value in settings:
        command += ["--mca", str(key), str(value)]
    for variable in export:
        command += ["-x", variable]
    return command + list(argv)


def horovodrun() -> str:
    """The ``horovodrun`` beside this Python (the project's virtual environment), or on PATH."""
    candidate = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    return candidate if os.path.exists(candidate) else shutil.which("horovodrun")


def gloo_command(num_ranks: int, argv: Sequence[str]):
    """``horovodrun --gloo`` starting ``argv`` on ``num_ranks`` ranks of this machine."""
    return [horovodrun(), "--gloo", "-np", str(num_ranks), *argv]


def python_argv(script_and_args: Sequence[str]):
    """``script_and_args`` run by this Python, unbuffered (so ranks' lines arrive as printed)."""
    return [sys.executable, "-u", *script_and_args]


def local_job_command(launcher: str, num_ranks: int, script_and_args: Sequence[str]):
    """``script_and_args`` (a Python script and its arguments) on ``num_ranks`` ranks of this
    machine: ``mpirun`` over TCP with each line tagged by its rank, or ``horovodrun --gloo``
    (``launcher`` "gloo")."""
    python = python_argv(script_and_args)
    if launcher == "mpirun":
        return mpirun_command(num_ranks, python, tcp_only=True, tag_output=True)
    if launcher == "gloo":
        return gloo_command(num_ranks, python)
    raise ValueError(f"unknown launcher {launcher!r}")


class Finished(NamedTuple):
    """How a command run by :func:`run_bounded` ended."""

    returncode: int
    output: str  # stdout and stderr, interleaved
    seconds: float
    timed_out: bool


def wait_for_idle(max_load: float, wait_seconds: float, poll: float = 10.0) -> float:
    """Before a timed job: wait (at most ``wait_seconds``) for the 1-minute load average to
    fall to ``max_load``; the load average it got to."""
    deadline = time.monotonic() + wait_seconds
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        time.sleep(poll)
    return os.getloadavg()[0]


def run_bounded(command, env, timeout) -> Finished:
    """Run ``command`` in a session of its own; after ``timeout`` seconds kill the whole
    session (the launcher and every rank it started), so that a hang ends as a failure."""
    start = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env=env, start_new_session=True, text=True)
    try:
        output, _ = process.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        timed_out = True
    return Finished(process.returncode, output, time.monotonic() - start, timed_out)


def run_benchmark_job(num_ranks: int, argv: Sequence[str], rate, timeout, env=None, cwd=None,
                      export: Iterable[str] = ()):
    """A benchmark's job of ``num_ranks`` ranks running ``argv``: on this machine's loopback
    with ``mpirun`` (``rate`` None), else on the emulated cluster with every link shaped to
    ``rate`` (``scripts/emulated_cluster.py``, root). A failure, a timeout included, exits
    with a message that says which."""
    import emulated_cluster as ec  # scripts/, the standard library only

    env = mpi_environment(env)
    if rate is None:
        subprocess.run(mpirun_command(num_ranks, argv, export=export), env=env, check=True,
                       timeout=timeout, cwd=cwd)
        return
    reason = ec.namespaces_unavailable()
    if reason:
        raise SystemExit(f"--rate needs the emulated cluster, which is unavailable: {reason}")
    with ec.EmulatedCluster(num_ranks, rate=rate) as cluster:
        rc, timed_out = ec.run_command(cluster.mpirun_command(argv), timeout, env=env)
    if rc != 0:
        raise SystemExit(f"the benchmark job failed ({'timed out' if timed_out else f'exit {rc}'})")
