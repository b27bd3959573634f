"""Fault drill: each fault a user meets, under each launcher, and how long the job takes to end.

What it does
    Starts 2-rank jobs on this machine (``tests/distributed/job_rank_fails.py`` and
    ``job_faults.py``, a small MLP with the README's one-line change), one per fault and
    launcher, each under a time limit, and prints per job: the exit status, whether every rank
    named the cause (the line each job's ranks must print), and the seconds from launch to the
    end of the job. Faults:

    * ``killed``: rank 1 is killed (SIGKILL) at its fourth batch;
    * ``stuck``: rank 1 sleeps at its fourth batch, outside any collective; ended by the stall
      watchdog (``--stall-timeout`` seconds, 60 here; 300 by default in a real job);
    * ``uneven`` / ``uneven_callbacks``: rank 1 has half the batches (no callbacks / the
      README's callbacks);
    * ``mismatched_model``: rank 1's hidden layer is one unit wider;
    * ``nan``: one of rank 1's samples is NaN (skipped on every rank, training goes on);
    * ``disk_full`` (MPI only, root): ``examples/train_digits.py`` writes its checkpoints to a
      tmpfs too small for the second one; then the job is resumed from what is there and must
      continue from the first checkpoint.

    Launchers: ``mpirun`` and ``horovodrun --gloo`` (``--launchers``). Slurm's srun is tried by
    ``tests/test_slurm.py`` (the stuck rank) on a cluster it starts.

Run::

    .venv/bin/python scripts/failure_drill.py            # about 6 minutes on 2 cores
    .venv/bin/python scripts/failure_drill.py --faults stuck,killed --launchers gloo
"""

import argparse
import os
import re
import shutil
import subprocess
import tempfile

import launching

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = os.path.join(ROOT, "tests", "distributed")

# fault -> (script and arguments, what the output must hold: every rank's line and the cause)
MISMATCH = "the ranks are not at the same step"
FAULTS = {
    "killed": (["job_rank_fails.py", "kill"], []),
    "stuck": (["job_rank_fails.py", "stall"], [r"rank 0 of 2 has waited \d+ s in collective"]),
    "uneven": (["job_faults.py", "uneven"],
               [r"rank 0 raised", r"rank 1 raised",
                rf"{MISMATCH}.*rank 1 has finished training after 60 steps"]),
    "uneven_callbacks": (["job_faults.py", "uneven_callbacks"],
                         [r"rank 0 raised", r"rank 1 raised",
                          rf"{MISMATCH}.*rank 1 has ended an epoch after 20 steps"]),
    "mismatched_model": (["job_faults.py", "mismatched_model"],
                         [rf"rank {r} raised: ValueError: .*\(32, 64\) float32 on rank 0 but "
                          rf"\S+ \(32, 65\)" for r in (0, 1)]),
    "nan": (["job_faults.py", "nan"],
            [rf"rank {r} finished nan after 117 steps \(3 skipped\)" for r in (0, 1)]),
}


def run(launcher, argv, env, limit):
    """(status, output, seconds, timed out) of a 2-rank job."""
    environment = launching.mpi_environment(dict(os.environ, **env))
    environment.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return launching.run_bounded(launching.local_job_command(launcher, 2, argv), environment, limit)


def drill(fault, launcher, stall_timeout, limit):
    argv, expected = FAULTS[fault]
    env = {"SPARSE_HVD_STALL_TIMEOUT": str(stall_timeout),
           "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "0"}
    status, output, seconds, timed_out = run(launcher, [os.path.join(JOBS, argv[0])] + argv[1:],
                                             env, limit)
    named = all(re.search(pattern, output) for pattern in expected)
    if fault == "killed":  # the launcher names the killed rank; nobody may finish
        named = "finished training, which it must not" not in output
    return status, named, seconds, timed_out, output


def disk_full(stall_timeout, limit):
    """A checkpoint that does not fit: the job ends; a resume continues from the last one."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        return None
    workdir = tempfile.mkdtemp(prefix="sparse_hvd_drill_")
    mountpoint = os.path.join(workdir, "small")
    os.makedirs(mountpoint)
    # one checkpoint of train_digits' model takes 2.7 MB: room for one, not two
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", mountpoint]).returncode:
        return None
    try:
        script = os.path.join(ROOT, "examples", "train_digits.py")
        env = {"SPARSE_HVD_STALL_TIMEOUT": str(stall_timeout)}
        status, output, seconds, timed_out = run(
            "mpirun", [script, "--epochs", "4", "--checkpoint-dir", mountpoint], env, limit)
        kept = sorted(os.listdir(mountpoint))
        full = "No space left on device" in output or "Errno 28" in output
        resume_dir = os.path.join(workdir, "copy")
        shutil.copytree(mountpoint, resume_dir)
    finally:
        subprocess.run(["umount", mountpoint])
    r_status, r_output, r_seconds, r_timed_out = run(
        "mpirun", [script, "--epochs", "4", "--checkpoint-dir", resume_dir, "--resume"], env, limit)
    resumed = re.search(r"resum\w* from .*epoch-001\.keras", r_output) is not None
    shutil.rmtree(workdir, ignore_errors=True)
    return {"status": status, "seconds": seconds, "timed_out": timed_out, "full": full,
            "kept": kept, "resume_status": r_status, "resumed_from_epoch_1": resumed,
            "resume_seconds": r_seconds, "output": output, "resume_output": r_output}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", default=",".join(list(FAULTS) + ["disk_full"]))
    parser.add_argument("--launchers", default="mpirun,gloo")
    parser.add_argument("--stall-timeout", type=float, default=60)
    parser.add_argument("--limit", type=float, default=300, help="seconds before a job is killed")
    parser.add_argument("--verbose", action="store_true", help="print every job's output")
    args = parser.parse_args()
    print(f"load before: {os.getloadavg()[0]:.1f}")
    print(f"{'fault':<18} {'launcher':<8} {'status':>6}  {'cause named':<11} {'seconds':>8}")
    for fault in args.faults.split(","):
        if fault == "disk_full":
            result = disk_full(args.stall_timeout, args.limit)
            if result is None:
                print(f"{'disk_full':<18} skipped: needs root and mount")
                continue
            print(f"{'disk_full':<18} {'mpirun':<8} {result['status']:>6}  "
                  f"{'yes' if result['full'] else 'NO':<11} {result['seconds']:>8.1f}"
                  f"{'  (killed at the limit)' if result['timed_out'] else ''}")
            print(f"{'':<18} checkpoints kept: {result['kept']}; resume: status "
                  f"{result['resume_status']}, from epoch-001: "
                  f"{'yes' if result['resumed_from_epoch_1'] else 'NO'}, "
                  f"{result['resume_seconds']:.1f} s")
            if args.verbose:
                print(result["output"][-4000:], result["resume_output"][-4000:])
            continue
        for launcher in args.launchers.split(","):
            status, named, seconds, timed_out, output = drill(fault, launcher, args.stall_timeout,
                                                              args.limit)
            print(f"{fault:<18} {launcher:<8} {status:>6}  {'yes' if named else 'NO':<11} "
                  f"{seconds:>8.1f}{'  (killed at the limit)' if timed_out else ''}", flush=True)
            if args.verbose or not named or timed_out:
                print(output[-4000:])
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
