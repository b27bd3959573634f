#!/usr/bin/env bash
# Start a sparse_hvd training script on every task of the current Slurm allocation.
#
#   bash scripts/slurm/launch.sh SCRIPT.py [ARGS...]      # inside sbatch or salloc
#
# scripts/slurm/train_digits.sbatch calls it; any other training script of this project can be
# started the same way from an sbatch script of your own. One Slurm task is one Horovod worker.
#
# What it does, in order:
#   1. finds the Python environment: $SPARSE_HVD_VENV, else .venv/ of this checkout (this file
#      is run from the checkout, not from Slurm's spool directory, so its own path is reliable);
#   2. sets each worker's environment from Slurm's variables and Horovod settings that suit a
#      batch job (see "Environment" below);
#   3. picks the launcher and says which and why:
#        srun --mpi=pmix   when Slurm offers PMIx (`srun --mpi=list`) and Open MPI was built
#                          with PMIx support (`ompi_info`): Slurm starts, places, signals and
#                          accounts for every rank itself, no extra daemons;
#        mpirun            otherwise (fallback): Open MPI reads the allocation from Slurm's
#                          variables and starts its own daemons on the nodes (through srun).
#      SPARSE_HVD_LAUNCHER=srun or =mpirun forces one (default: auto).
#   4. execs it, so that Slurm's signals (time limit, scancel) reach the launcher directly.
#
# Environment (a variable already set wins, except the thread counts, which always follow the
# allocation: a value exported on a login node would not fit the compute nodes):
#   OMP_NUM_THREADS, TF_NUM_INTRAOP_THREADS  = SLURM_CPUS_PER_TASK (1 if unset): each worker
#                          computes with the cores Slurm gave its task, no more (2 workers on a
#                          node with each using every core would fight over them);
#   TF_NUM_INTEROP_THREADS = 2 (1 with a single CPU per task): how many independent ops run at
#                          once; the model's ops are a chain, so more only adds threads;
#   HOROVOD_FUSION_THRESHOLD = 64 MiB and HOROVOD_CYCLE_TIME = 1 ms (Horovod's defaults, set so
#                          they show in the job log and can be tuned per job): sparse_hvd already
#                          sends a step's values and indices as one grouped allgather each, well
#                          below 64 MiB at 1% density; a lower cycle time (0.2) cut latency on a
#                          loaded machine in scripts/benchmarks/bench_convergence.py;
#   SPARSE_HVD_STALL_TIMEOUT = 300: a rank that has waited 300 s in one of sparse_hvd's
#                          collectives (a peer is dead, hung, lost its node, or ran out of data)
#                          says what it waited for and ends the job, instead of every rank
#                          waiting until the wall-time limit; 300 s leaves room for rank 0
#                          writing a large checkpoint while the others wait for it;
#   HOROVOD_STALL_CHECK_TIME_SECONDS = 60, HOROVOD_STALL_SHUTDOWN_TIME_SECONDS = 600: Horovod
#                          names the stalled tensors after 60 s, and ends a job stalled in a
#                          collective that is not sparse_hvd's (the script's own) after 600 s;
#   PYTHONUNBUFFERED = 1 (output reaches the job log as it happens, not when a worker ends);
#   OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM) = 1 when running as root (Open MPI refuses otherwise).
set -euo pipefail

say() { printf '[launch] %s\n' "$*"; }
die() { printf '[launch] ERROR: %s\n' "$*" >&2; exit 2; }

[ $# -ge 1 ] || die "usage: bash scripts/slurm/launch.sh SCRIPT.py [ARGS...]"
[ -n "${SLURM_JOB_ID:-}" ] || die "not inside a Slurm allocation (no SLURM_JOB_ID): submit with sbatch or run under salloc"
SCRIPT="$1"; shift
[ -f "$SCRIPT" ] || die "no such script: $SCRIPT"

# --- 1. Python environment ---------------------------------------------------------------------
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${SPARSE_HVD_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
[ -x "$PY" ] || die "no Python at $PY: run 'bash scripts/setup.sh' in $ROOT on a machine that sees the same file system, or point SPARSE_HVD_VENV at the environment"

# --- 2. environment of every worker ------------------------------------------------------------
NTASKS="${SLURM_NTASKS:-${SLURM_NPROCS:-}}"
[ -n "$NTASKS" ] || die "SLURM_NTASKS is not set: request tasks (sbatch --ntasks-per-node=M or --ntasks=N)"
CPUS="${SLURM_CPUS_PER_TASK:-1}"
export OMP_NUM_THREADS="$CPUS"
export TF_NUM_INTRAOP_THREADS="$CPUS"
if [ "$CPUS" -gt 1 ]; then export TF_NUM_INTEROP_THREADS=2; else export TF_NUM_INTEROP_THREADS=1; fi
export HOROVOD_FUSION_THRESHOLD="${HOROVOD_FUSION_THRESHOLD:-67108864}"
export HOROVOD_CYCLE_TIME="${HOROVOD_CYCLE_TIME:-1}"
export HOROVOD_STALL_CHECK_TIME_SECONDS="${HOROVOD_STALL_CHECK_TIME_SECONDS:-60}"
export HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="${HOROVOD_STALL_SHUTDOWN_TIME_SECONDS:-600}"
export SPARSE_HVD_STALL_TIMEOUT="${SPARSE_HVD_STALL_TIMEOUT:-300}"
export PYTHONUNBUFFERED=1
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
if [ "$(id -u)" = 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

say "job ${SLURM_JOB_ID}: ${SLURM_JOB_NUM_NODES:-1} node(s) (${SLURM_JOB_NODELIST:-?}), $NTASKS task(s) (${SLURM_TASKS_PER_NODE:-?} per node), $CPUS CPU(s) per task"
say "python: $PY"
say "threads per worker: OMP/TF intra-op $CPUS, TF inter-op $TF_NUM_INTEROP_THREADS; Horovod: fusion ${HOROVOD_FUSION_THRESHOLD} B, cycle ${HOROVOD_CYCLE_TIME} ms, stall warning ${HOROVOD_STALL_CHECK_TIME_SECONDS} s, stall shutdown ${HOROVOD_STALL_SHUTDOWN_TIME_SECONDS} s; sparse_hvd stall watchdog ${SPARSE_HVD_STALL_TIMEOUT} s"

# --- 3. launcher -------------------------------------------------------------------------------
slurm_pmix() {  # the PMIx plugin versions Slurm offers, empty if none
    srun --mpi=list 2>&1 | grep -oE '\bpmix[a-z0-9_]*' | sort -u | tr '\n' ' ' | sed 's/ $//'
}
ompi_pmix() {  # Open MPI's PMIx client components (ext3x, pmix3x, ...), empty if none
    # "isolated" and "flux" are no PMIx servers' clients, s1/s2 are PMI-1/PMI-2.
    command -v ompi_info >/dev/null 2>&1 || return 0
    ompi_info 2>/dev/null | grep -oE 'MCA pmix: (ext[0-9]+x|pmix[0-9]+x)' | awk '{print $3}' | sort -u | tr '\n' ' ' | sed 's/ $//'
}

WANT="${SPARSE_HVD_LAUNCHER:-auto}"
case "$WANT" in
    auto)
        S_PMIX="$(slurm_pmix)"; O_PMIX="$(ompi_pmix)"
        if [ -n "$S_PMIX" ] && [ -n "$O_PMIX" ]; then
            LAUNCHER=srun; WHY="Slurm offers PMIx ($S_PMIX) and Open MPI has a PMIx client ($O_PMIX)"
        elif [ -z "$S_PMIX" ]; then
            LAUNCHER=mpirun; WHY="fallback: 'srun --mpi=list' offers no pmix"
        else
            LAUNCHER=mpirun; WHY="fallback: Slurm offers PMIx ($S_PMIX) but ompi_info shows no PMIx client in Open MPI"
        fi ;;
    srun) LAUNCHER=srun; WHY="forced by SPARSE_HVD_LAUNCHER=srun" ;;
    mpirun) LAUNCHER=mpirun; WHY="forced by SPARSE_HVD_LAUNCHER=mpirun" ;;
    *) die "SPARSE_HVD_LAUNCHER must be auto, srun or mpirun, not '$WANT'" ;;
esac

if [ "$LAUNCHER" = srun ]; then
    # --mpi=pmix: Slurm's PMIx server wires the ranks up (Open MPI's direct launch).
    # --cpus-per-task: since Slurm 22.05 srun no longer inherits it from sbatch; without it every
    #   task of the step would get one CPU whatever the job asked for.
    # --kill-on-bad-exit=1: a worker that exits non-zero ends the whole step at once (the others
    #   would otherwise wait in their next collective until the stall watchdog ends them).
    CMD=(srun --mpi=pmix --cpus-per-task="$CPUS" --kill-on-bad-exit=1 "$PY" -u "$SCRIPT" "$@")
else
    command -v mpirun >/dev/null 2>&1 || die "mpirun not found (and srun --mpi=pmix not usable: $WHY)"
    # -np: one rank per Slurm task; Open MPI takes the nodes and slots from the allocation and
    #   starts its daemons there through srun.
    # --bind-to none: Open MPI would pin each rank to one core, and a worker with several CPUs
    #   per task would then run all its threads on it.
    # --oversubscribe: never places more than -np ranks; it only keeps mpirun from refusing when
    #   it counts the allocation's slots differently from Slurm (hyperthreads, --cpus-per-task).
    # -x: the settings above reach ranks on other nodes too.
    CMD=(mpirun -np "$NTASKS" --bind-to none --oversubscribe)
    for var in OMP_NUM_THREADS TF_NUM_INTRAOP_THREADS TF_NUM_INTEROP_THREADS HOROVOD_FUSION_THRESHOLD \
               HOROVOD_CYCLE_TIME HOROVOD_STALL_CHECK_TIME_SECONDS HOROVOD_STALL_SHUTDOWN_TIME_SECONDS \
               SPARSE_HVD_STALL_TIMEOUT PYTHONUNBUFFERED TF_CPP_MIN_LOG_LEVEL PATH LD_LIBRARY_PATH; do
        if [ -n "${!var+x}" ]; then CMD+=(-x "$var"); fi
    done
    CMD+=("$PY" -u "$SCRIPT" "$@")
fi
say "launcher: $LAUNCHER ($WHY)"
say "command: ${CMD[*]}"
exec "${CMD[@]}"
