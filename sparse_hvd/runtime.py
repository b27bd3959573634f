"""Where this process stands in the job: Horovod start-up, rank and size.

Everything else in sparse_hvd asks this module, never Horovod directly, whether it runs alone or
among other workers. Three situations are told apart:

1. launched by ``mpirun``/``horovodrun``/``srun`` with Horovod installed: Horovod is initialised
   (once, lazily) and its rank/size are used;
2. a plain ``python train.py`` with Horovod installed: Horovod initialises as a job of one, and no
   collective is ever called (size 1 needs none);
3. a plain process without Horovod: size 1, rank 0. If a launcher's environment says there are
   other workers, this is an error, not a silent single-worker run.
"""

import os

# Set by the launchers we support (Open MPI's mpirun, horovodrun, Slurm's srun with PMI/PMIx).
_LAUNCHER_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "HOROVOD_SIZE", "PMI_SIZE", "PMIX_SIZE")


def _launcher_size():
    """The number of workers a launcher announced in the environment, 1 when none did."""
    for var in _LAUNCHER_SIZE_VARS:
        value = os.environ.get(var)
        if value and value.isdigit():
            return int(value)
    return 1


def horovod():
    """The ``horovod.tensorflow`` module, initialised; None when running alone without Horovod."""
    try:
        import horovod.tensorflow as hvd
    except ImportError as error:
        if _launcher_size() > 1:
            raise ImportError(
                f"sparse_hvd: this process was launched as one of {_launcher_size()} workers, but "
                "horovod.tensorflow cannot be imported, so the workers cannot talk to each other. "
                "Run scripts/setup.sh (it builds Horovod with MPI and Gloo) or install Horovod."
            ) from error
        return None
    if not hvd.is_initialized():
        hvd.init()
    return hvd


def init(pin_gpu=True, stall_timeout=None):
    """Start Horovod (if present and not yet started) and optionally pin one GPU per local rank.

    Calling it is optional: the optimizer and callbacks start Horovod lazily. Call it first thing
    in a script that has GPUs, so that each worker sees only its own GPU before TensorFlow
    initialises them all. ``stall_timeout``: seconds a rank may wait in one of sparse_hvd's
    collectives before the watchdog ends the job (``sparse_hvd.watchdog``; 0: never); None
    keeps ``SPARSE_HVD_STALL_TIMEOUT`` or the default, 300.
    """
    if stall_timeout is not None:
        from . import watchdog

        watchdog.set_timeout(stall_timeout)
    hvd = horovod()
    if pin_gpu and hvd is not None:
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            gpu = gpus[hvd.local_rank() % len(gpus)]
            tf.config.experimental.set_memory_growth(gpu, True)
            tf.config.set_visible_devices(gpu, "GPU")
    return hvd


def _global_process_set(hvd):
    return hvd.global_process_set


def size(process_set=None):
    """Number of workers in ``process_set`` (the whole job by default)."""
    hvd = horovod()
    if hvd is None:
        return 1
    return (process_set or _global_process_set(hvd)).size()


def rank(process_set=None):
    """This worker's rank in ``process_set`` (the whole job by default)."""
    hvd = horovod()
    if hvd is None:
        return 0
    process_set = process_set or _global_process_set(hvd)
    if process_set.process_set_id == 0:
        return hvd.rank()
    return process_set.rank()


def local_rank():
    """This worker's rank among the workers on its host."""
    hvd = horovod()
    return 0 if hvd is None else hvd.local_rank()


def process_set_or_global(process_set):
    """``process_set`` if given, else Horovod's global process set (None without Horovod)."""
    hvd = horovod()
    if hvd is None:
        return None
    return process_set or _global_process_set(hvd)

