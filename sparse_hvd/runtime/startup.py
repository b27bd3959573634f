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
import sys

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


def _is_mpi4py_communicator(obj):
    return type(obj).__module__.startswith("mpi4py") and hasattr(obj, "Get_size")


def _launched_with_gloo():
    """``horovodrun --gloo`` (its environment), before Horovod is started; Horovod's own
    answer after."""
    hvd = sys.modules.get("horovod.tensorflow")
    if hvd is not None and hvd.is_initialized():
        return bool(hvd.gloo_enabled())
    return (os.environ.get("HOROVOD_CONTROLLER") == "gloo"
            or "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ)


def _refuse_under_gloo(what):
    if _launched_with_gloo():
        raise ValueError(
            f"{what} is an mpi4py communicator, which needs Horovod's MPI controller, but this "
            "job runs on Gloo (horovodrun --gloo). Launch it with mpirun, horovodrun --mpi or "
            "srun, or give the ranks instead (a list of ranks, or hvd.ProcessSet([...])).")


def init(pin_gpu=True, stall_timeout=None, comm=None, process_sets=None):
    """Start Horovod (if present and not yet started) and optionally pin one GPU per local rank.

    Calling it is optional: the optimizer and callbacks start Horovod lazily. Call it first thing
    in a script that has GPUs, so that each worker sees only its own GPU before TensorFlow
    initialises them all. ``stall_timeout``: seconds a rank may wait in one of sparse_hvd's
    collectives before the watchdog ends the job (``sparse_hvd.runtime.watchdog``; 0: never); None
    keeps ``SPARSE_HVD_STALL_TIMEOUT`` or the default, 300.

    ``comm`` and ``process_sets`` are Horovod's (``hvd.init(comm=..., process_sets=...)``):
    ``comm``, an mpi4py communicator (or a list of ranks), becomes the job sparse_hvd trains
    in, so that an MPI program can train on a sub-communicator of ``MPI.COMM_WORLD.Split``;
    ``process_sets`` lists the process sets to register (mpi4py communicators or
    ``hvd.ProcessSet``s), which can then be passed as ``process_set=``. Both need Horovod not to
    be started yet (call this first), and mpi4py communicators need MPI (not Gloo).
    """
    if stall_timeout is not None:
        from . import watchdog

        watchdog.set_timeout(stall_timeout)
    if comm is not None or process_sets is not None:
        _start_with(comm, process_sets)
    hvd = horovod()
    if pin_gpu and hvd is not None:
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            gpu = gpus[hvd.local_rank() % len(gpus)]
            tf.config.experimental.set_memory_growth(gpu, True)
            tf.config.set_visible_devices(gpu, "GPU")
    return hvd


def gpu_visible() -> bool:
    """Whether TensorFlow sees a GPU: asked once per process, since the answer decides how
    traced steps are built (which kernels, which order of additions) and cannot change while
    the process runs."""
    global _GPU
    if _GPU is None:
        import tensorflow as tf

        _GPU = bool(tf.config.list_physical_devices("GPU"))
    return _GPU


_GPU = None


def _start_with(comm, process_sets):
    """``hvd.init(comm, process_sets)``, with mpi4py communicators refused under Gloo."""
    import horovod.tensorflow as hvd

    if hvd.is_initialized():
        raise ValueError("sparse_hvd.init(comm=..., process_sets=...) must come before anything "
                         "starts Horovod (the optimizer and the callbacks start it when first "
                         "used): call it first in the script")
    if _is_mpi4py_communicator(comm):
        _refuse_under_gloo("`comm`")
    sets = []
    for each in process_sets or ():
        if _is_mpi4py_communicator(each):
            _refuse_under_gloo("an entry of `process_sets`")
        sets.append(each if isinstance(each, hvd.ProcessSet) else hvd.ProcessSet(each))
    hvd.init(comm=comm, process_sets=sets or None)


def as_process_set(process_set):
    """``process_set`` as a Horovod ProcessSet: None and ProcessSets as they are; an mpi4py
    communicator as the registered process set with the same ranks (the global one when it
    holds every rank)."""
    if process_set is None or not _is_mpi4py_communicator(process_set):
        return process_set
    _refuse_under_gloo("`process_set`")
    hvd = horovod()
    from mpi4py import MPI

    reference = hvd.global_process_set.mpi_comm or MPI.COMM_WORLD
    ranks = MPI.Group.Translate_ranks(process_set.Get_group(), list(range(process_set.Get_size())),
                                      reference.Get_group())
    if sorted(ranks) == list(range(hvd.size())):
        return hvd.global_process_set
    from horovod.common import process_sets as registry

    for set_id, set_ranks in registry._basics._get_process_set_ids_and_ranks().items():
        if sorted(set_ranks) == sorted(ranks):
            found = registry._temp_process_set_object(set_id)
            found.ranks = list(set_ranks)
            return found
    raise ValueError(
        f"`process_set`: no Horovod process set holds the ranks {sorted(ranks)} of this "
        "communicator; register it when starting: sparse_hvd.init(process_sets=[communicator])")


def _global_process_set(hvd):
    return hvd.global_process_set


def size(process_set=None):
    """Number of workers in ``process_set`` (the whole job by default)."""
    hvd = horovod()
    if hvd is None:
        return 1
    return (as_process_set(process_set) or _global_process_set(hvd)).size()


def rank(process_set=None):
    """This worker's rank in ``process_set`` (the whole job by default)."""
    hvd = horovod()
    if hvd is None:
        return 0
    process_set = as_process_set(process_set) or _global_process_set(hvd)
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
    return as_process_set(process_set) or _global_process_set(hvd)

