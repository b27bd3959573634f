"""Horovod's collectives as sparse_hvd calls them: by name, over a resolved process set.

Horovod matches a collective across ranks by its name and waits, without limit, for a name
one rank never submits. So every collective of sparse_hvd is named by its caller with a name
that is the same on every rank, and is called through this module, which:

* makes the name independent of TensorFlow's name scopes (``ignore_name_scope=True``), so the
  same collective gets the same name in a traced step, an eager call and a Keras callback;
* resolves ``process_set=None`` to Horovod's global process set;
* is the one module that imports Horovod's collective ops, so what sparse_hvd puts on the wire
  can be read in one place.

Callers decide whether a collective is needed at all (a job of one calls none).
"""

from . import runtime

SUM = "sum"
AVERAGE = "average"


def _horovod_and_set(process_set):
    hvd = runtime.horovod()
    return hvd, runtime.process_set_or_global(process_set)


def _op(hvd, op):
    if op == SUM:
        return hvd.Sum
    if op == AVERAGE:
        return hvd.Average
    raise ValueError(f"unknown reduction {op!r}; use collectives.SUM or collectives.AVERAGE")


def allreduce(tensor, name, process_set=None, op=AVERAGE):
    """The element-wise ``op`` (SUM or AVERAGE) of ``tensor`` over the ranks."""
    hvd, process_set = _horovod_and_set(process_set)
    return hvd.allreduce(tensor, op=_op(hvd, op), name=name, ignore_name_scope=True,
                         process_set=process_set)


def grouped_allreduce(tensors, name, process_set=None, op=AVERAGE):
    """:func:`allreduce` of several tensors of one dtype, fused into one Horovod message."""
    hvd, process_set = _horovod_and_set(process_set)
    return hvd.grouped_allreduce(list(tensors), op=_op(hvd, op), name=name,
                                 ignore_name_scope=True, process_set=process_set)


def allgather(tensor, name, process_set=None):
    """Every rank's ``tensor`` concatenated along the first axis, in rank order (ranks may
    contribute different numbers of rows, none included)."""
    hvd, process_set = _horovod_and_set(process_set)
    return hvd.allgather(tensor, name=name, ignore_name_scope=True, process_set=process_set)


def grouped_allgather(tensors, name, process_set=None):
    """:func:`allgather` of several tensors of one dtype, fused into one Horovod message."""
    hvd, process_set = _horovod_and_set(process_set)
    return hvd.grouped_allgather(list(tensors), name=name, ignore_name_scope=True,
                                 process_set=process_set)


def alltoall(tensor, splits, name, process_set=None):
    """Rows ``splits[r]`` of ``tensor`` (in order) go to rank r; returns what this rank
    received from every rank, concatenated in rank order."""
    hvd, process_set = _horovod_and_set(process_set)
    received, _ = hvd.alltoall(tensor, splits=splits, name=name, ignore_name_scope=True,
                               process_set=process_set)
    return received


def broadcast(tensor, root_rank, name, process_set=None):
    """``root_rank``'s ``tensor`` on every rank."""
    hvd, process_set = _horovod_and_set(process_set)
    return hvd.broadcast(tensor, int(root_rank), name=name, ignore_name_scope=True,
                         process_set=process_set)


def allgather_object(obj, name, process_set=None):
    """Every rank's picklable ``obj``, in rank order (eagerly, also when called from a trace).
    Alone: ``[obj]``, with no collective."""
    if runtime.size(process_set) == 1:
        return [obj]
    import tensorflow as tf

    hvd, process_set = _horovod_and_set(process_set)
    with tf.init_scope():
        return hvd.allgather_object(obj, name=name, process_set=process_set)
