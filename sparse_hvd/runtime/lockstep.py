"""Every rank at the same step: the step travels with the payload, and a mismatch stops the job.

Data-parallel training averages the gradients of one step over the ranks. A rank that runs more
or fewer steps than the others (shards of unequal length, an early stop decided on one rank, a
restore from another checkpoint) would otherwise have its gradients averaged with another
step's, silently, until the first rank to finish leaves the others waiting.

So each rank's header in the step's exchange carries two more int32 fields (:func:`fields`):
the step (the inner optimizer's ``iterations``) and what the rank is doing:

* ``TRAINING``: it is in training step ``step``;
* ``FINISHED``: it has left ``model.fit`` after ``step`` steps (``finalize_variable_values``);
* ``EPOCH_END``: it has ended an epoch after ``step`` steps (sparse_hvd's epoch-end callbacks).

The last two are sent by :meth:`SparseDistributedOptimizer.assert_same_step`, which runs the
step's collectives with empty payloads. When the gathered fields differ, every rank raises the
same error (:func:`check`), naming each rank's step: the first epoch end of uneven shards ends
the job with a message instead of a hang.
"""

import numpy as np
import tensorflow as tf

TRAINING, FINISHED, EPOCH_END = 0, 1, 2
WIDTH = 2  # int32 fields per rank
_DOING = {
    TRAINING: "is in training step {step}",
    FINISHED: "has finished training after {step} steps",
    EPOCH_END: "has ended an epoch after {step} steps",
}


def fields(step, state=TRAINING) -> tf.Tensor:
    """This rank's fields: ``[step mod 2^31, state]`` (int32)."""
    step = tf.cast(tf.math.floormod(tf.cast(step, tf.int64), 1 << 31), tf.int32)
    return tf.stack([step, tf.cast(state, tf.int32)])


def message(gathered) -> str:
    """The error for gathered fields ([ranks, 2]) that do not agree."""
    gathered = np.asarray(gathered).reshape(-1, WIDTH)
    doing = "; ".join(
        f"rank {rank} " + _DOING.get(int(state), "is in an unknown state").format(step=int(step))
        for rank, (step, state) in enumerate(gathered))
    return (
        "sparse_hvd: the ranks are not at the same step, so their gradients cannot be averaged: "
        f"{doing}. Every rank must run the same number of steps per epoch: cut NumPy shards "
        "to one length with x, y = sparse_hvd.equal_shards(x, y), or repeat a dataset and "
        "pass steps_per_epoch=sparse_hvd.steps_per_epoch(len(dataset)) to model.fit. Ranks "
        "restored from different checkpoints, or an early stop decided on one rank only, also "
        "end here."
    )


def mismatch_error(error):
    """The mismatch a traced :func:`check` raised (inside TensorFlow's error, with its
    traceback) as the ValueError an eager caller expects; None for any other error."""
    text = getattr(error, "message", str(error))
    start = text.find("sparse_hvd: the ranks are not at the same step")
    if start < 0:
        return None
    return ValueError(text[start:].splitlines()[0])


def agree(gathered) -> tf.Tensor:
    """Whether gathered fields ([ranks, 2]) agree: one step, one state, and never a rank in a
    training step beside one that is not."""
    gathered = tf.reshape(gathered, [-1, WIDTH])
    return tf.reduce_all(tf.equal(gathered, gathered[:1]))


def check(gathered):
    """Raise on every rank (InvalidArgumentError in a trace, ValueError eagerly) unless the
    gathered fields agree; returns an op (or None eagerly) to depend on."""
    gathered = tf.reshape(gathered, [-1, WIDTH])
    if tf.executing_eagerly():
        if not bool(agree(gathered)):
            raise ValueError(message(gathered.numpy()))
        return None

    def raise_mismatch(values):
        raise ValueError(message(values))

    return tf.cond(
        agree(gathered), lambda: tf.constant(True),
        lambda: tf.numpy_function(lambda v: raise_mismatch(v) or np.bool_(False), [gathered],
                                  tf.bool, stateful=True))


def after_check(gathered_fields, tensors):
    """``tensors`` (what was gathered with the fields) available only once :func:`check` of
    ``gathered_fields`` has passed: nothing of a mismatched step is unpacked or applied."""
    with tf.control_dependencies([check(gathered_fields)]):
        return [tf.identity(t) for t in tensors]
