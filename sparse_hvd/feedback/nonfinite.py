"""Non-finite gradients: every rank takes the same decision, or none is taken.

A NaN or infinite gradient on one rank would, once averaged, poison every replica; a rank that
skipped its step alone would leave the others waiting in the next exchange. So:

1. each rank flags its own gradients (``Payload.local_finite``: one reduction per gradient,
   :func:`all_finite`);
2. the flags are agreed on by every rank (:func:`agree`: one tiny allreduce; the staleness
   pipeline carries them with the payload instead);
3. one guard (:func:`guard`) acts on the agreed flag, as ``nonfinite`` says: "skip" the step on
   every rank, "raise" on every rank, or "ignore" (no check at all).
"""


import tensorflow as tf

from ..runtime import collectives, log, startup as runtime

MESSAGE = "non-finite (NaN or infinite) gradients on at least one rank."


def all_finite(values: tf.Tensor) -> tf.Tensor:
    """True iff every entry of ``values`` is finite, in one reduction: a sum is non-finite iff
    an entry is, or the sum overflows (3.4e38 in float32). 16-bit values are summed in float32:
    a float16 sum overflows at 65,504, which 100,000 entries of 1.0 pass."""
    if values.dtype.size < 4:
        values = tf.cast(values, tf.float32)
    return tf.math.is_finite(tf.reduce_sum(values))


def agree(local_finite: tf.Tensor, name, process_set=None, step=None) -> tf.Tensor:
    """True iff ``local_finite`` is True on every rank: the same answer everywhere."""
    bad = tf.cast(tf.logical_not(local_finite), tf.float32)
    if runtime.size(process_set) > 1:
        bad = collectives.allreduce(bad, name=name, process_set=process_set, op=collectives.SUM,
                                    step=step)
    return tf.equal(bad, 0.0)


def guard(mode: str, finite, go_ahead, skip):
    """Run ``go_ahead()`` if ``finite`` (a bool tensor, the same on every rank), else ``skip()``
    ("skip"), or stop with an InvalidArgumentError before anything is written ("raise").
    With "ignore", ``go_ahead()`` runs unconditionally. Returns what the branch that ran
    returned (the two must return the same structure)."""
    if mode == "skip":
        return tf.cond(finite, go_ahead, skip)
    if mode == "raise":
        with tf.control_dependencies([tf.debugging.Assert(finite, [MESSAGE])]):
            return go_ahead()  # nothing is written unless the check passed
    return go_ahead()


def announce_skip(what, process_set=None):
    """Rank 0 logs that ``what`` was skipped on every rank (in the step's graph)."""
    if runtime.rank(process_set) == 0:
        log.info_in_graph(tf.constant(f"{MESSAGE} {what}"))
