"""``python -m sparse_hvd.doctor``: what this environment has for sparse_hvd, and whether it works.

Run it first on a new cluster (on a login node, and once inside a job), the way
``horovodrun --check-build`` is run for Horovod. It checks, in order:

1. TensorFlow and Keras 3 import (needed);
2. Horovod imports with its TensorFlow ops, and which controllers (MPI, Gloo) and GPU
   libraries (NCCL, CUDA) it was built with (needed);
3. the controller the job will use is built in: ``--controller mpi|gloo``, or the one the
   launcher implies (under mpirun or srun: MPI; under horovodrun --gloo: Gloo), or at least
   one of them when nothing is launched yet (needed);
4. mpi4py and the MPI library it found (optional: only ``sparse_hvd.init(comm=...)`` needs it);
5. the native kernels load for this TensorFlow, compiled first if missing (needed, unless
   ``--allow-fallback``: without them the TensorFlow path computes the same bits, slower);
6. GPUs visible to TensorFlow; TensorFlow's CPU allocator (``runtime.allocator``); the
   launchers on PATH (mpirun, horovodrun, srun);
7. one training step of ``SparseDistributedOptimizer`` in this process (needed).

Each line starts with ``ok``, ``FAIL`` or ``info``; the exit status is 1 when a needed part
failed, else 0.
"""

import argparse
import os
import shutil
import sys


class Report:
    def __init__(self):
        self.failed = []

    def ok(self, what, detail=""):
        print(f"[ ok ] {what}{': ' + detail if detail else ''}", flush=True)

    def fail(self, what, detail):
        self.failed.append(what)
        print(f"[FAIL] {what}: {detail}", flush=True)

    def info(self, what, detail):
        print(f"[info] {what}: {detail}", flush=True)


def launcher_in_use():
    """(launcher, controller it implies) from the environment of this process."""
    if os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR") or os.environ.get("HOROVOD_CONTROLLER") == "gloo":
        return "horovodrun --gloo", "gloo"
    if os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE") or os.environ.get("PMIX_RANK"):
        return "mpirun", "mpi"
    if os.environ.get("SLURM_STEP_ID") is not None and os.environ.get("SLURM_NTASKS"):
        return "srun", "mpi"
    return None, None


def check_tensorflow(report):
    try:
        import keras
        import tensorflow as tf
    except ImportError as error:
        report.fail("TensorFlow", f"does not import ({error}); install tensorflow (or tensorflow-cpu)")
        return False
    if not keras.__version__.startswith("3."):
        report.fail("Keras", f"{keras.__version__}; sparse_hvd needs Keras 3 (TensorFlow 2.16+)")
        return False
    report.ok("TensorFlow", f"{tf.__version__}, Keras {keras.__version__}")
    return True


def check_horovod(report, controller):
    try:
        import horovod
        import horovod.tensorflow as hvd
    except ImportError as error:
        report.fail("Horovod", f"horovod.tensorflow does not import ({error}); build Horovod with "
                    "HOROVOD_WITH_TENSORFLOW=1 (scripts/setup.sh does)")
        return
    built = {name: bool(getattr(hvd, f"{name}_built", lambda: False)())
             for name in ("mpi", "gloo", "nccl", "cuda", "rocm")}
    report.ok("Horovod", f"{getattr(horovod, '__version__', '?')}, built with "
              + (", ".join(n.upper() for n, yes in built.items() if yes) or "no controller"))
    launcher, implied = launcher_in_use()
    if launcher:
        report.info("launcher", f"this process runs under {launcher}")
    wanted = controller if controller != "auto" else implied
    if wanted:
        if built.get(wanted):
            report.ok("controller", f"{wanted.upper()} is built in")
        else:
            report.fail("controller", f"{wanted.upper()} is not built into this Horovod (rebuild with "
                        f"HOROVOD_WITH_{wanted.upper()}=1, or launch with the other one)")
    elif built["mpi"] or built["gloo"]:
        report.ok("controller", "at least one of MPI and Gloo is built in")
    else:
        report.fail("controller", "neither MPI nor Gloo is built into this Horovod")


def check_mpi4py(report):
    try:
        from mpi4py import MPI
    except ImportError as error:
        report.info("mpi4py", f"not usable ({error}); only sparse_hvd.init(comm=...) needs it")
        return
    import mpi4py

    report.info("mpi4py", f"{mpi4py.__version__} with {MPI.Get_library_version().splitlines()[0].strip()}")


def check_kernels(report, allow_fallback):
    from . import kernels

    path, problem = kernels.status()
    if path:
        report.ok("native kernels", f"loaded from {path}")
    elif allow_fallback:
        report.info("native kernels", f"{problem}; the TensorFlow path is used (same results, slower)")
    else:
        report.fail("native kernels", f"{problem}. sparse_hvd falls back to slower TensorFlow ops; "
                    "fix it, or pass --allow-fallback if that is intended")


def check_devices(report):
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    report.info("GPUs", f"{len(gpus)} visible to TensorFlow" + (
        " (the native CPU kernels stand aside; TensorFlow ops run on the GPU)" if gpus else ""))
    from .runtime import allocator

    setting = os.environ.get(allocator.VARIABLE)
    if not allocator.pooled_in_use():
        described = (f"TensorFlow's default ({allocator.VARIABLE}={setting}): the sparse step "
                     "pays page faults for its temporaries")
    elif setting == "true":
        described = "TensorFlow's pooled one (BFC)"
    else:  # some machines' default allocator pools freed memory itself
        described = f"TensorFlow's default ({allocator.VARIABLE}={setting}), a pool here"
    report.info("CPU allocator", described)
    found = [name for name in ("mpirun", "horovodrun", "srun") if shutil.which(name)]
    report.info("launchers on PATH", ", ".join(found) or "none")


def check_one_step(report):
    try:
        import keras
        import numpy as np
        import tensorflow as tf

        import sparse_hvd

        variable = keras.Variable(np.zeros((64, 32), "float32"))
        optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(1.0), density=0.01,
                                                          name="doctor")
        gradient = tf.reshape(tf.range(64 * 32, dtype=tf.float32), (64, 32))
        optimizer.apply_gradients([(gradient, variable)])
        moved = int(np.count_nonzero(variable.numpy()))
        if moved == 0:
            raise RuntimeError("the variable did not move")
        report.ok("one step", f"SparseDistributedOptimizer moved {moved} of {64 * 32} entries "
                  "(the warm-up's first 25%)")
    except Exception as error:  # noqa: BLE001  (the doctor reports whatever breaks)
        report.fail("one step", f"{type(error).__name__}: {error}")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m sparse_hvd.doctor",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--controller", choices=("auto", "mpi", "gloo"), default="auto",
                        help="the Horovod controller the job will use (auto: from the launcher)")
    parser.add_argument("--allow-fallback", action="store_true",
                        help="native kernels that do not load are not a failure")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    report = Report()
    print(f"sparse_hvd doctor (Python {sys.version.split()[0]})", flush=True)
    if check_tensorflow(report):
        check_horovod(report, args.controller)
        check_mpi4py(report)
        check_kernels(report, args.allow_fallback)
        check_devices(report)
        check_one_step(report)
    if report.failed:
        print(f"doctor: {len(report.failed)} problem(s): {', '.join(report.failed)}", flush=True)
        return 1
    print("doctor: everything sparse_hvd needs is here", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
