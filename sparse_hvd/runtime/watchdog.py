"""The stall watchdog: a rank that waits too long in one of sparse_hvd's collectives ends the job.

Horovod matches collectives by name and waits without limit for one that another rank never
submits: a rank that stopped (a hung data loader or callback), or that runs another number of
steps (uneven data), would hold the whole allocation until the batch system's time limit.
Horovod's own stall shutdown (``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``) is off by default and,
under ``horovodrun --gloo``, did not end such jobs at all (Horovod 0.28.1). So sparse_hvd watches
its own collectives, the same way under every launcher:

1. Every collective sparse_hvd runs is bracketed (``sparse_hvd.runtime.collectives``): :func:`enter`
   records what is waited for (the collective's name and, in a training step, the step) and
   since when; :func:`leave` forgets it. In a traced step both are ``tf.numpy_function`` ops
   ordered around the collective by control dependencies (:func:`bracket`); eagerly they are a
   context manager (:func:`waiting`). A step's exchange is traced inside :func:`one_wait`: its
   collectives (one per layer with the layer-wise exchange) then share ONE pair, from the
   first one's inputs to the last one's outputs. With the native kernels the traced pair is
   two native ops instead (``kernels/watch.cc``: a table in C++ the thread reads through
   ctypes), since each ``numpy_function`` took the GIL and about 0.25 ms of the step. A traced
   step that ends with an error between its brackets (a collective that failed, the step
   check's mismatch) leaves its wait open; the step's next run drops it when it enters the
   same collective again.
2. A daemon thread looks at the oldest wait every ``limit / 10`` seconds (at most every 5 s).
   When it is older than the limit, the thread prints on stderr what this rank waited for, for
   how long, and the usual causes, and ends the process with status 124 (``os._exit``: the
   collective cannot be interrupted, and an orderly exit would wait for Horovod's shutdown,
   which waits for that collective).
3. The launcher sees a worker end with an error and ends the others: ``mpirun`` and
   ``horovodrun`` do so by themselves, ``srun`` with ``--kill-on-bad-exit``
   (``scripts/slurm/launch.sh`` passes it). A rank stuck outside any collective is ended that
   way: its peers are the ones waiting.

The limit: ``SPARSE_HVD_STALL_TIMEOUT`` seconds in the environment, or :func:`set_timeout`
(``sparse_hvd.init(stall_timeout=...)``); default 300; 0 turns the watchdog off. It applies to
steps traced after it was set. Work that one rank does alone while the others wait in a
collective (an evaluation or a checkpoint written by rank 0 only) must take less than the limit.
"""

import contextlib
import itertools
import os
import sys
import threading
import time

import numpy as np

from . import log

ENVIRONMENT_VARIABLE = "SPARSE_HVD_STALL_TIMEOUT"
DEFAULT_TIMEOUT = 300.0
EXIT_STATUS = 124  # what timeout(1) returns: the job ran out of time waiting

_lock = threading.Lock()
_waits = {}  # token -> (monotonic start, collective name, step or None)
_tokens = itertools.count(1)
_timeout = None  # seconds; None: read from the environment when first needed
_thread = None
_tracing = threading.local()  # .watch: the StepWatch of the exchange being traced, if any
_names = {}  # collective name -> its id in the native ops' table (``kernels/watch.cc``)


def _parse_timeout(value, what):
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number of seconds (0 turns the watchdog off), "
                         f"got {value!r}") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"{what} must be a finite number of seconds >= 0, got {value!r}")
    return seconds


def timeout() -> float:
    """The limit in seconds (0: off): :func:`set_timeout`'s, else the environment's, else 300."""
    global _timeout
    if _timeout is None:
        value = os.environ.get(ENVIRONMENT_VARIABLE)
        _timeout = DEFAULT_TIMEOUT if value in (None, "") else _parse_timeout(
            value, ENVIRONMENT_VARIABLE)
    return _timeout


def set_timeout(seconds):
    """Set the limit (seconds; 0 turns the watchdog off) for collectives traced or run from now."""
    global _timeout
    if isinstance(seconds, bool):
        raise TypeError(f"`stall_timeout` must be a number of seconds, got {seconds!r}")
    _timeout = _parse_timeout(seconds, "`stall_timeout`")


def enabled() -> bool:
    return timeout() > 0


# ---- the brackets ------------------------------------------------------------------------------

def enter(name, step=None, replacing=False) -> int:
    """Record that this rank now waits in collective ``name`` (at training step ``step``).
    ``replacing`` (a traced step's bracket): first drop a wait of the same name, left open by
    an earlier run of that step which ended with an error between its brackets (as the native
    ops do, ``kernels/watch.cc``); kept, it would end a job that caught the error and went on."""
    token = next(_tokens)
    with _lock:
        if replacing:
            for stale in [t for t, (_, other, _) in _waits.items() if other == name]:
                del _waits[stale]
        _waits[token] = (time.monotonic(), name, step)
    _start_thread()
    return token


def leave(token):
    with _lock:
        _waits.pop(int(token), None)


class waiting:
    """Context manager: an eager collective, bracketed by :func:`enter` and :func:`leave`."""

    def __init__(self, name, step=None):
        self.name, self.step = name, step

    def __enter__(self):
        self.token = enter(self.name, self.step) if enabled() else None
        return self

    def __exit__(self, *exc):
        if self.token is not None:
            leave(self.token)
        return False


def _native_ops():
    """``(enter op, leave op)`` of the native kernels, or None (then ``numpy_function``s)."""
    from .. import kernels

    enter_op, leave_op = kernels.watch_enter(), kernels.watch_leave()
    return None if enter_op is None or leave_op is None else (enter_op, leave_op)


def _enter_op(name, step, after):
    """A traced :func:`enter` that runs once ``after`` (tensors) exist; returns its token."""
    import tensorflow as tf

    def enter_at(step):
        return np.int64(enter(name, None if step < 0 else int(step), replacing=True))

    step = tf.constant(-1, tf.int64) if step is None else tf.cast(step, tf.int64)
    native = _native_ops()
    with tf.control_dependencies(after):
        if native is None:
            return tf.numpy_function(enter_at, [step], tf.int64, stateful=True,
                                     name="watchdog_enter")
        with _lock:
            name_id = _names.setdefault(name, len(_names))
        _start_thread()  # the ops do not call into Python: the thread must run already
        return native[0](step, name_id=name_id, name="watchdog_enter")


def _leave_op(token, after):
    import tensorflow as tf

    def leave_token(token):
        leave(token)
        return token

    native = _native_ops()
    with tf.control_dependencies(after):
        if native is None:
            tf.numpy_function(leave_token, [token], tf.int64, stateful=True,
                              name="watchdog_leave")
        else:
            native[1](token, name="watchdog_leave")


class StepWatch:
    """One enter/leave pair for every collective traced while it is active (see
    :func:`one_wait`): enter when the first collective's inputs exist, leave when every
    collective's outputs do."""

    def __init__(self):
        self.token = None
        self.outputs = []

    def wrap(self, run, tensors, name, step):
        import tensorflow as tf

        if self.token is None:
            self.token = _enter_op(name, step, after=tensors)
        with tf.control_dependencies([self.token]):
            tensors = [tf.identity(t) for t in tensors]
        outputs = run(tensors)
        self.outputs.extend(tf.nest.flatten(outputs))
        return outputs

    def close(self):
        if self.token is not None:
            _leave_op(self.token, after=self.outputs)


@contextlib.contextmanager
def one_wait():
    """Trace a step's exchange: all its collectives share one watched wait, named after the
    first of them. Nothing to do eagerly or when the watchdog is off."""
    import tensorflow as tf

    if not enabled() or tf.executing_eagerly() or getattr(_tracing, "watch", None) is not None:
        yield
        return
    _tracing.watch = StepWatch()
    try:
        yield
    finally:
        watch, _tracing.watch = _tracing.watch, None
        watch.close()


def bracket(run, tensors, name, step=None):
    """``run(tensors)`` with the wait watched: in a trace, an :func:`enter` op runs before the
    collective's inputs are handed over and a :func:`leave` op after its outputs exist (shared
    by a step's collectives inside :func:`one_wait`)."""
    import tensorflow as tf

    if not enabled():
        return run(tensors)
    if tf.executing_eagerly():
        with waiting(name, None if step is None else int(step)):
            return run(tensors)
    watch = getattr(_tracing, "watch", None)
    if watch is not None:
        return watch.wrap(run, tensors, name, step)
    token = _enter_op(name, step, after=[])
    with tf.control_dependencies([token]):
        tensors = [tf.identity(t) for t in tensors]
    outputs = run(tensors)
    _leave_op(token, after=tf.nest.flatten(outputs))
    return outputs


# ---- the thread --------------------------------------------------------------------------------

def _start_thread():
    global _thread
    if _thread is not None:
        return
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_watch, name="sparse_hvd.watchdog", daemon=True)
            _thread.start()


def _native_table():
    """The native ops' table (``kernels.watch_table``), or None before any native bracket."""
    from .. import kernels

    return kernels.watch_table() if _names else None


def _native_oldest():
    """The native table's oldest wait as ``(monotonic start, name, step)``, or None."""
    table = _native_table()
    if table is None:
        return None
    import ctypes

    age, name_id, step = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
    if not table.sparse_hvd_oldest_wait(ctypes.byref(age), ctypes.byref(name_id),
                                        ctypes.byref(step)):
        return None
    with _lock:
        names = {number: name for name, number in _names.items()}
    return (time.monotonic() - age.value / 1e9, names.get(name_id.value, "?"),
            None if step.value < 0 else step.value)


def _oldest():
    with _lock:
        oldest = min(_waits.values(), default=None, key=lambda wait: wait[0])
    native = _native_oldest()
    return min([wait for wait in (oldest, native) if wait is not None], default=None,
               key=lambda wait: wait[0])


def open_waits() -> int:
    """How many waits are open (eager and traced): 0 between steps."""
    table = _native_table()
    with _lock:
        count = len(_waits)
    return count + (table.sparse_hvd_open_waits() if table is not None else 0)


def _watch():
    while True:
        limit = timeout()
        time.sleep(min(5.0, max(0.1, (limit or 10.0) / 10)))
        oldest = _oldest()
        if limit and oldest is not None and time.monotonic() - oldest[0] > limit:
            _end_job(oldest, limit)


def stall_message(rank, size, name, step, waited, limit) -> str:
    """What a rank prints before it ends the job."""
    where = f"in collective '{name}'" + ("" if step is None else f" at training step {step}")
    return (
        f"rank {rank} of {size} has waited {waited:.0f} s {where} for the other "
        f"ranks, longer than the limit of {limit:g} s ({ENVIRONMENT_VARIABLE}), and ends the "
        "job. Another rank has stopped, hangs, or runs other steps or collectives than this "
        "one: a crash or hang in its callbacks or data loader; uneven data (every rank must "
        "run the same number of steps: see sparse_hvd.equal_shards and "
        "sparse_hvd.steps_per_epoch); a model or optimizer built on one rank only; or work that one rank does "
        f"alone for longer than the limit (then raise {ENVIRONMENT_VARIABLE})."
    )


def _end_job(wait, limit):
    from . import startup as runtime

    start, name, step = wait
    try:
        rank, size = runtime.rank(), runtime.size()
    except Exception:  # Horovod may be in a state where even this fails; say what we know
        rank, size = "?", "?"
    log.error("%s", stall_message(rank, size, name, step, time.monotonic() - start, limit))
    sys.stdout.flush()
    os._exit(EXIT_STATUS)
