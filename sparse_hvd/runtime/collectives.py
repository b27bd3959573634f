"""Horovod's collectives as sparse_hvd calls them: by name, over a resolved process set.

Horovod matches a collective across ranks by its name and waits, without limit, for a name
one rank never submits. So every collective of sparse_hvd is named by its caller with a name
that is the same on every rank, and is called through this module, which:

* makes the name independent of TensorFlow's name scopes (``ignore_name_scope=True``), so the
  same collective gets the same name in a traced step, an eager call and a Keras callback;
* resolves ``process_set=None`` to Horovod's global process set;
* is the one module that imports Horovod's collective ops, so what sparse_hvd puts on the wire
  can be read in one place;
* carries bfloat16, which Horovod's collectives do not take: gathered and broadcast as its
  16-bit pattern (exact), reduced in float32 and rounded back once;
* brackets each collective for the stall watchdog (``sparse_hvd.runtime.watchdog``), which ends the job
  when a rank waits in one for longer than its limit. ``step``, when a caller gives it (the
  training step's exchange), is named in the watchdog's message.

Callers decide whether a collective is needed at all (a job of one calls none).
"""

from . import startup as runtime, watchdog

SUM = "sum"
AVERAGE = "average"


def _horovod_and_set(process_set):
    hvd = runtime.horovod()
    return hvd, runtime.process_set_or_global(process_set)


def _exact_wire(tensors):
    """bfloat16 tensors bit-cast to int16 (for collectives that move bits, not sums)."""
    import tensorflow as tf

    return [tf.bitcast(t, tf.int16) if t.dtype == tf.bfloat16 else t for t in tensors]


def _from_exact_wire(results, originals):
    import tensorflow as tf

    return [tf.bitcast(r, tf.bfloat16) if o.dtype == tf.bfloat16 else r
            for r, o in zip(results, originals)]


def _summable_wire(tensors):
    """bfloat16 tensors as float32 (for reductions; rounded back by :func:`_from_summable`)."""
    import tensorflow as tf

    return [tf.cast(t, tf.float32) if t.dtype == tf.bfloat16 else t for t in tensors]


def _from_summable(results, originals):
    import tensorflow as tf

    return [tf.cast(r, tf.bfloat16) if o.dtype == tf.bfloat16 else r
            for r, o in zip(results, originals)]


def _op(hvd, op):
    if op == SUM:
        return hvd.Sum
    if op == AVERAGE:
        return hvd.Average
    raise ValueError(f"unknown reduction {op!r}; use collectives.SUM or collectives.AVERAGE")


def _reduced(run, tensors, name, step):
    """``run`` (a Horovod reduction) of ``tensors``, bfloat16 reduced in float32, watched."""
    return _from_summable(watchdog.bracket(run, _summable_wire(tensors), name, step), tensors)


def _gathered(run, tensors, name, step):
    """``run`` (a Horovod gather) of ``tensors``, bfloat16 moved as its bits, watched."""
    return _from_exact_wire(watchdog.bracket(run, _exact_wire(tensors), name, step), tensors)


def allreduce(tensor, name, process_set=None, op=AVERAGE, step=None):
    """The element-wise ``op`` (SUM or AVERAGE) of ``tensor`` over the ranks."""
    hvd, process_set = _horovod_and_set(process_set)
    return _reduced(
        lambda wire: [hvd.allreduce(wire[0], op=_op(hvd, op), name=name, ignore_name_scope=True,
                                    process_set=process_set)],
        [tensor], name, step)[0]


def grouped_allreduce(tensors, name, process_set=None, op=AVERAGE, step=None):
    """:func:`allreduce` of several tensors of one dtype, fused into one Horovod message."""
    hvd, process_set = _horovod_and_set(process_set)
    return _reduced(
        lambda wire: hvd.grouped_allreduce(wire, op=_op(hvd, op), name=name,
                                           ignore_name_scope=True, process_set=process_set),
        list(tensors), name, step)


def means_by_dtype(tensors, name, process_set=None):
    """Each of ``tensors``' mean over the ranks, in their order: one :func:`grouped_allreduce`
    per dtype (named ``name.dtype``), the dtypes in one order on every rank."""
    tensors = list(tensors)
    by_dtype = {}
    for position, tensor in enumerate(tensors):
        by_dtype.setdefault(tensor.dtype.name, []).append(position)  # "float32"
    means = [None] * len(tensors)
    for dtype, positions in sorted(by_dtype.items()):
        reduced = grouped_allreduce([tensors[i] for i in positions], name=f"{name}.{dtype}",
                                    process_set=process_set)
        for position, mean in zip(positions, reduced):
            means[position] = mean
    return means


def allgather(tensor, name, process_set=None, step=None):
    """Every rank's ``tensor`` concatenated along the first axis, in rank order (ranks may
    contribute different numbers of rows, none included)."""
    hvd, process_set = _horovod_and_set(process_set)
    return _gathered(
        lambda wire: [hvd.allgather(wire[0], name=name, ignore_name_scope=True,
                                    process_set=process_set)],
        [tensor], name, step)[0]


def grouped_allgather(tensors, name, process_set=None, step=None):
    """:func:`allgather` of several tensors of one dtype, fused into one Horovod message."""
    hvd, process_set = _horovod_and_set(process_set)
    return _gathered(
        lambda wire: hvd.grouped_allgather(wire, name=name, ignore_name_scope=True,
                                           process_set=process_set),
        list(tensors), name, step)


def alltoall(tensor, splits, name, process_set=None, step=None):
    """Rows ``splits[r]`` of ``tensor`` (in order) go to rank r; returns what this rank
    received from every rank, concatenated in rank order, and how many rows came from each."""
    hvd, process_set = _horovod_and_set(process_set)

    def run(wire):
        return list(hvd.alltoall(wire[0], splits=wire[1], name=name, ignore_name_scope=True,
                                 process_set=process_set))

    received, received_splits = watchdog.bracket(run, _exact_wire([tensor]) + [splits], name, step)
    return _from_exact_wire([received], [tensor])[0], received_splits


def broadcast(tensor, root_rank, name, process_set=None):
    """``root_rank``'s ``tensor`` on every rank; ``root_rank`` counts within ``process_set``,
    as ``sparse_hvd.rank(process_set)`` does (Horovod takes the root's rank in the job)."""
    hvd, process_set = _horovod_and_set(process_set)
    root = int(root_rank)
    if process_set.process_set_id != 0:
        root = sorted(process_set.ranks)[root]

    return _gathered(
        lambda wire: [hvd.broadcast(wire[0], root, name=name, ignore_name_scope=True,
                                    process_set=process_set)],
        [tensor], name, None)[0]


def allgather_object(obj, name, process_set=None):
    """Every rank's picklable ``obj``, in rank order (eagerly, also when called from a trace).
    Alone: ``[obj]``, with no collective."""
    if runtime.size(process_set) == 1:
        return [obj]
    import tensorflow as tf

    hvd, process_set = _horovod_and_set(process_set)
    with tf.init_scope(), watchdog.waiting(name):
        return hvd.allgather_object(obj, name=name, process_set=process_set)
