"""scripts/slurm/train_digits.sbatch on a real one-node Slurm cluster started by this test.

The fixture starts munge, slurmctld and slurmd (Debian 12's Slurm 22.05) as root on loopback,
each with its own files in a temporary directory: a fresh munge key and socket, a slurm.conf
(passed as SLURM_CONF, so nothing in /etc is read or written), state, spool and log
directories, and ports that were free. No cgroups are used (proctrack/linuxproc, task/none), so
it runs inside containers too. The sbatch script is submitted as a user would (from inside
the checkout, with arguments for the example) and must finish within a bound: a hang is a
failure, and everything still running is killed. Whatever happens, the finalizer cancels the
jobs, stops the daemons and kills every process left from this cluster (found by the
SLURM_CONF in its environment: job steps, ranks, slurmstepd), then removes the directory.

The packages are installed by scripts/install_slurm.sh when missing (as root). The test skips,
saying why, when it cannot run (not root, packages not installable); with CI=true it fails
instead, because there it must run.
"""

import os
import random
import re
import shutil
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from launch import launcher_available

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH_SCRIPT = os.path.join(ROOT, "scripts", "slurm", "train_digits.sbatch")
INSTALL_SCRIPT = os.path.join(ROOT, "scripts", "install_slurm.sh")
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")
SEARCH_PATH = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
JOB_BOUND = 180  # seconds for one job, start to end; it is cancelled (and the test fails) after
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
EPOCHS = 3
# Each daemon runs under `timeout`: should pytest itself be killed before its finalizers run,
# the daemons still end after this many seconds.
DAEMON_LIFETIME = 900


def cannot_run(reason):
    """Skip, or fail under CI (CI=true), where this test has to run."""
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"CI must run the Slurm test, but: {reason}")
    pytest.skip(reason)


def command(name):
    return shutil.which(name, path=SEARCH_PATH)


def run(argv, timeout=30, **kwargs):
    """A short Slurm client command; its output, or CalledProcessError/TimeoutExpired."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=True, **kwargs).stdout


def free_port():
    """A port free now and below the kernel's ephemeral range: an ephemeral one (bind to 0) can
    be taken by any process's outgoing connection before slurmd binds it, which failed a CI run
    ("Unable to bind listen port (43863): Address already in use") while rank tests ran beside."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, max(10001, ephemeral_low))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no luck: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path, lines=40):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError as error:
        return f"({error})"


class SlurmCluster:
    """munged + slurmctld + slurmd on this machine, configured and owned by one test module."""

    def __init__(self):
        # A short path: munge's socket path must fit a sockaddr_un (108 bytes).
        self.dir = tempfile.mkdtemp(prefix="sparse_hvd-slurm-")
        # munged insists that every directory above its socket is searchable by everyone.
        os.chmod(self.dir, 0o755)
        for sub in ("etc", "run", "state", "spool", "log", "tmp", "jobs"):
            os.makedirs(self.path(sub), mode=0o755)
        os.chmod(self.path("etc"), 0o700)
        self.conf = self.path("etc", "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        for name in list(self.env):  # a surrounding allocation must not leak into this cluster
            if name.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and name != "SLURM_CONF":
                del self.env[name]
        self.processes = {}
        self.hostname = socket.gethostname().split(".")[0]

    def path(self, *parts):
        return os.path.join(self.dir, *parts)

    # ---- start ---------------------------------------------------------------------------------

    def start(self, timeout=60):
        self._start_munge()
        self._write_conf()
        self._spawn("slurmctld", [command("slurmctld"), "-D", "-i"])
        self._spawn("slurmd", [command("slurmd"), "-D", "-N", self.hostname])
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                state = run([command("sinfo"), "-h", "-N", "-o", "%T"], env=self.env, timeout=10).strip()
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
                state = str(error)
            if state == "idle":
                return
            time.sleep(0.3)
        raise RuntimeError(f"the Slurm node is not idle after {timeout} s (state: {state})\n{self.logs()}")

    def _start_munge(self):
        key = self.path("etc", "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(os.urandom(1024))
        self.munge_socket = self.path("run", "munge.socket")
        self._spawn("munged", [
            command("munged"), "--foreground", f"--key-file={key}", f"--socket={self.munge_socket}",
            f"--pid-file={self.path('run', 'munged.pid')}", f"--seed-file={self.path('state', 'munged.seed')}",
            "--num-threads=2",
        ])
        deadline = time.monotonic() + 20
        while not os.path.exists(self.munge_socket):
            self._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged made no socket in 20 s\n{self.logs()}")
            time.sleep(0.1)

    def _write_conf(self):
        ctld_port = slurmd_port = free_port()
        while slurmd_port == ctld_port:
            slurmd_port = free_port()
        cpus = max(2, os.cpu_count() or 1)  # two tasks must fit; config_overrides trusts this
        conf = f"""\
# Written by tests/test_slurm.py: a throw-away one-node cluster on loopback.
ClusterName=sparsehvdtest
SlurmctldHost={self.hostname}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={self.path('state')}
SlurmdSpoolDir={self.path('spool')}
TmpFS={self.path('tmp')}
SlurmctldPidFile={self.path('run', 'slurmctld.pid')}
SlurmdPidFile={self.path('run', 'slurmd.pid')}
SlurmctldLogFile={self.path('log', 'slurmctld.log')}
SlurmdLogFile={self.path('log', 'slurmd.log')}
PlugStackConfig={self.path('etc', 'plugstack.conf')}
MailProg=/bin/true
# No cgroups: processes are tracked by parentage, tasks are not confined.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
MinJobAge=600
NodeName={self.hostname} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=30 State=UP
"""
        with open(self.conf, "w") as f:
            f.write(conf)
        open(self.path("etc", "plugstack.conf"), "w").close()

    def _spawn(self, name, argv):
        log = open(self.path("log", f"{name}.out"), "w")
        # timeout passes SIGTERM on to the daemon and ends when it does.
        self.processes[name] = subprocess.Popen(
            ["timeout", "-k", "10", str(DAEMON_LIFETIME), *argv], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
            cwd=self.dir, start_new_session=True,
        )
        log.close()

    def _check_alive(self):
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with status {process.returncode}\n{self.logs()}")

    # ---- use -----------------------------------------------------------------------------------

    def logs(self):
        names = sorted(os.listdir(self.path("log")))
        return "\n".join(f"--- {name} ---\n{tail(self.path('log', name))}" for name in names)

    def job_fields(self, job_id):
        """`scontrol show job` as a dict (JobState, ExitCode, ...)."""
        text = run([command("scontrol"), "-o", "show", "job", str(job_id)], env=self.env)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def submit_and_wait(self, sbatch_args, env, cwd, bound):
        """Submit with sbatch, poll until the job ends; cancel it and fail the test after ``bound`` s.

        Polls `scontrol` rather than using `sbatch --wait`, which checks every ~30 s and would
        take longer than the job itself. Returns (job id, scontrol fields, job output, seconds).
        """
        output_file = self.path("jobs", "%j.out")
        started = time.monotonic()
        stdout = run([command("sbatch"), "--parsable", f"--output={output_file}", *sbatch_args],
                     env=env, cwd=cwd)
        job_id = stdout.strip().split(";")[0]
        assert job_id.isdigit(), f"sbatch gave no job id: {stdout!r}"
        output_file = output_file.replace("%j", job_id)
        while True:
            fields = self.job_fields(job_id)
            if fields.get("JobState") in FINAL_STATES:
                break
            if time.monotonic() - started > bound:
                subprocess.run([command("scancel"), "--full", job_id], env=self.env, timeout=10)
                pytest.fail(f"job {job_id} did not end within {bound} s (state {fields.get('JobState')}; "
                            f"cancelled, the cluster is torn down now)\n"
                            f"--- job output ---\n{tail(output_file, 100)}\n{self.logs()}")
            time.sleep(0.25)
        return job_id, fields, tail(output_file, 1000), time.monotonic() - started

    # ---- stop ----------------------------------------------------------------------------------

    def stop(self):
        """Cancel every job, stop the daemons, kill whatever this cluster left, delete its files."""
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            try:
                jobs = run([command("squeue"), "-h", "-o", "%i"], env=self.env, timeout=10).split()
                if jobs:
                    run([command("scancel"), "--full", *jobs], env=self.env, timeout=10)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, TypeError):
                pass
        for name in ("slurmd", "slurmctld", "munged"):
            process = self.processes.get(name)
            if process is None or process.poll() is not None:
                continue
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        self._kill_leftovers()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _kill_leftovers(self):
        """SIGKILL every process whose environment names this cluster's slurm.conf.

        slurmstepd, the batch script, srun, mpirun and the ranks all inherit SLURM_CONF from
        slurmd or from the submitting sbatch, and outlive a stopped slurmd. The path is this
        cluster's own temporary file, so no other process matches.
        """
        marker = f"SLURM_CONF={self.conf}".encode()
        for _ in range(3):
            found = []
            for pid in filter(str.isdigit, os.listdir("/proc")):
                if int(pid) == os.getpid():
                    continue
                try:
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        if marker in f.read().split(b"\0"):
                            found.append(int(pid))
                except OSError:
                    continue
            if not found:
                return
            for pid in found:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)


@pytest.fixture(scope="module")
def slurm_cluster():
    """A running one-node cluster; installs the packages first when they are missing."""
    if os.geteuid() != 0:
        cannot_run("needs root: the test runs munged, slurmctld and slurmd itself")
    reason = launcher_available("mpirun")
    if reason:
        cannot_run(reason)
    if not all(command(name) for name in COMMANDS):
        try:
            # The script bounds each apt-get call itself (6 minutes in all); killing apt-get midway
            # could leave dpkg half-configured, so this limit is only a backstop.
            result = subprocess.run(["bash", INSTALL_SCRIPT], capture_output=True, text=True, timeout=420)
            output = result.stdout + result.stderr
        except subprocess.TimeoutExpired as error:
            result, output = None, f"timed out after {error.timeout} s"
        missing = [name for name in COMMANDS if not command(name)]
        if result is None or result.returncode != 0 or missing:
            cannot_run(f"Slurm/munge not installed and scripts/install_slurm.sh could not install "
                       f"them (missing: {' '.join(missing)}):\n{output[-3000:]}")
        print(output.strip())
    cluster = SlurmCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def expected_auto_launcher(env):
    """What launch.sh should pick by itself: srun when Slurm and Open MPI both speak PMIx."""
    slurm = subprocess.run([command("srun"), "--mpi=list"], capture_output=True, text=True, env=env,
                           timeout=30)
    ompi = subprocess.run(["ompi_info"], capture_output=True, text=True, timeout=60) \
        if shutil.which("ompi_info") else None
    slurm_pmix = "pmix" in slurm.stdout + slurm.stderr
    ompi_pmix = ompi is not None and re.search(r"MCA pmix: (ext\d+x|pmix\d+x)", ompi.stdout)
    return "srun" if slurm_pmix and ompi_pmix else "mpirun"


@pytest.mark.distributed
@pytest.mark.timeout(720)  # covers the fixture too: install (<= 6 min) and start
@pytest.mark.parametrize("launcher", ["auto", pytest.param("mpirun", marks=pytest.mark.extended)])
def test_sbatch_script_trains_on_two_tasks(slurm_cluster, launcher):
    cluster = slurm_cluster
    env = dict(cluster.env, SPARSE_HVD_LAUNCHER=launcher)
    # Use the environment this test runs in when it is not the checkout's .venv (which the
    # script finds by itself).
    if os.path.realpath(os.path.join(ROOT, ".venv")) != os.path.realpath(sys.prefix):
        env.setdefault("SPARSE_HVD_VENV", sys.prefix)
    expected = expected_auto_launcher(env) if launcher == "auto" else launcher
    # Submitted from a subdirectory of the checkout, as a user would: the script finds the
    # checkout from there (Slurm runs a copy of it from its spool directory).
    job_id, fields, output, seconds = cluster.submit_and_wait(
        ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=5", SBATCH_SCRIPT,
         "--epochs", str(EPOCHS)],
        env=env, cwd=os.path.join(ROOT, "tests"), bound=JOB_BOUND)
    context = f"--- job {job_id} output ---\n{output}\n{cluster.logs()}"

    assert fields.get("JobState") == "COMPLETED" and fields.get("ExitCode") == "0:0", \
        f"scontrol: JobState={fields.get('JobState')} ExitCode={fields.get('ExitCode')}\n{context}"
    chosen = re.search(r"^\[launch\] launcher: (\S+) \((.*)\)$", output, re.M)
    assert chosen, f"launch.sh did not say which launcher it chose\n{context}"
    assert chosen.group(1) == expected, context
    assert re.search(r"^\[sbatch\] checkout: ", output, re.M), context
    # Both tasks form one Horovod job of 2 (two separate 1-worker runs would print twice) and
    # only rank 0 prints results.
    assert len(re.findall(r"^2 worker\(s\)", output, re.M)) == 1, context
    # No "$" in these patterns: another rank's stderr may land between a line and its newline.
    accuracies = re.findall(r"^test accuracy: ([0-9.]+)", output, re.M)
    assert len(accuracies) == 1, context
    assert float(accuracies[0]) > 0.5, context  # 0.83 after 3 epochs here; chance is 0.1
    assert len(re.findall(rf"^Epoch {EPOCHS}/{EPOCHS}\b", output, re.M)) == 1, context
    assert output.count("replicas identical: True") == 1, context
    assert "replicas identical: False" not in output, context
    print(f"{launcher}: launcher {chosen.group(1)} ({chosen.group(2)}); job {job_id} took {seconds:.1f} s, "
          f"test accuracy {accuracies[0]}")


@pytest.mark.distributed
@pytest.mark.timeout(720)  # covers the fixture too: install (<= 6 min) and start
def test_a_stalled_worker_ends_the_slurm_job(slurm_cluster):
    """launch.sh's settings end a job whose rank stopped, long before the job's time limit.

    Rank 1 sleeps outside any collective; sparse_hvd's stall watchdog (its limit set by
    launch.sh, shortened here through the environment, which launch.sh lets win; Horovod's own
    stall shutdown off) ends rank 0 with a message, and srun's --kill-on-bad-exit then ends
    rank 1 (which would otherwise sleep for an hour). A rank that dies outright ends the step
    the same way, without waiting for the limit.
    """
    how = "stall"
    cluster = slurm_cluster
    env = dict(cluster.env, SPARSE_HVD_STALL_TIMEOUT="15", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="0")
    if os.path.realpath(os.path.join(ROOT, ".venv")) != os.path.realpath(sys.prefix):
        env.setdefault("SPARSE_HVD_VENV", sys.prefix)
    job = os.path.join(ROOT, "tests", "distributed", "job_rank_fails.py")
    launch = os.path.join(ROOT, "scripts", "slurm", "launch.sh")
    job_id, fields, output, seconds = cluster.submit_and_wait(
        # A 3-minute limit: had the watchdog not worked, Slurm would end the job as
        # TIMEOUT, not FAILED.
        ["--nodes=1", "--ntasks-per-node=2", "--time=3", "--job-name=fails",
         f"--wrap=bash {shlex.quote(launch)} {shlex.quote(job)} {how}"],
        env=env, cwd=ROOT, bound=240)
    context = f"--- job {job_id} output ---\n{output}\n{cluster.logs()}"
    assert fields.get("JobState") == "FAILED", f"JobState={fields.get('JobState')}\n{context}"
    assert fields.get("ExitCode") != "0:0", context
    assert "finished training, which it must not" not in output, context
    assert re.search(r"sparse_hvd: rank 0 of 2 has waited 1\d s in collective", output), context
    # Start-up, then the watchdog's 15 s: 42 to 74 s were measured with Horovod's stall
    # shutdown of 15 s on a 2-core machine that other jobs loaded.
    assert seconds < 150, f"the job took {seconds:.0f} s to end\n{context}"
    assert re.search(r"^\[launch\] launcher: srun ", output, re.M) or expected_auto_launcher(env) == "mpirun", context
    print(f"{how}: job {job_id} ended {fields.get('JobState')} (exit {fields.get('ExitCode')}) after {seconds:.1f} s")
