"""TensorFlow's CPU allocator: the pooled one (BFC) unless the job's environment says otherwise.

Why: a sparse step makes several temporaries the size of the model on the CPU (the compensated
update, the remainder, the signs, the averages), and TensorFlow's default CPU allocator takes
each large one from the operating system afresh and gives it back when freed, so every step
pays a page fault for every 4 KiB of them. TensorFlow's pooled allocator (best-fit with
coalescing, the one it uses on GPUs; on the CPU when ``TF_CPU_ALLOCATOR_USE_BFC`` is true)
keeps freed memory for the next step. Measured with ``scripts/benchmarks/bench_step.py --np 4
--rate 1gbit --inner momentum`` (the 4.35M MLP, runs alternated, README "The CPU allocator"):
the top-k step 203-214 ms against 221-245 ms, dense's 573-585 against 610-629, the floor
unchanged, and a lower peak resident memory in a single-process probe.

1. On import, sparse_hvd sets ``TF_CPU_ALLOCATOR_USE_BFC=true`` unless the environment already
   has it (``false`` keeps TensorFlow's default: the user's word wins).
2. TensorFlow reads it once, when its CPU allocator is first made (the first op on the CPU).
   Importing TensorFlow, Keras and Horovod runs none, so a script that imports sparse_hvd with
   them gets it; one that ran TensorFlow before importing sparse_hvd keeps the default, and
   :func:`note_if_unpooled` says so once, with what to do.
"""

import os

from . import log

VARIABLE = "TF_CPU_ALLOCATOR_USE_BFC"


class _State:
    chosen_by_user = None  # the value the environment had before sparse_hvd's import, if any
    noted = False


_state = _State()


def prefer_pooled():
    """Step 1: the pooled CPU allocator, unless the environment chose already."""
    _state.chosen_by_user = os.environ.get(VARIABLE)
    os.environ.setdefault(VARIABLE, "true")


def pooled_in_use() -> bool:
    """Whether TensorFlow's CPU allocator pools freed memory: it keeps statistics, which the
    pooled one (BFC) does, and so does the pool TensorFlow makes by default on some machines
    (seen on one: its default allocator rounded a 4 MB tensor up to 2^22 bytes and reported
    it), where nothing needs saying. Makes the allocator if no op has yet: call it after
    :func:`prefer_pooled`."""
    import tensorflow as tf

    try:
        tf.config.experimental.get_memory_info("CPU:0")
    except ValueError:
        return False
    return True


def note_if_unpooled(routes, process_set=None):
    """Step 2's message, once per process, on rank 0, for an optimizer with a sparse route
    among ``routes``: the default allocator is in use although the user did not choose it
    (TensorFlow made it before sparse_hvd was imported). Nothing on GPUs, whose sparse steps
    run there."""
    from .startup import gpu_visible, rank

    if _state.noted or _state.chosen_by_user is not None:
        return
    if not any(route.sparse for route in routes) or rank(process_set) != 0:
        return
    _state.noted = True
    if gpu_visible() or pooled_in_use():
        return
    log.info("TensorFlow made its CPU allocator before sparse_hvd was imported, so it is the "
             "default one, which costs the sparse step about 10%% in page faults; set %s=true in "
             "the job's environment (or import sparse_hvd before running TensorFlow ops), or "
             "%s=false to keep the default and silence this", VARIABLE, VARIABLE)
