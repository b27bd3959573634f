"""Keras 3 callbacks that keep the replicas of a ``model.fit`` job in step.

Horovod's own Keras callbacks use APIs that Keras 3 removed; these are their replacements.
"""

import numbers

import keras
import tensorflow as tf

from ..runtime import collectives, startup as runtime
from ..runtime.broadcast import average_variables, broadcast_variables


def _assert_same_step(model):
    """At an epoch end: every rank must have taken the same number of steps (the optimizer's
    ``assert_same_step``; a rank still training receives it in its step and raises too)."""
    check = getattr(getattr(model, "optimizer", None), "assert_same_step", None)
    if check is not None:
        check()


def _replicated_optimizer_variables(optimizer):
    """The optimizer's variables except rank-local ones (residuals, local velocities)."""
    local = {id(v) for v in getattr(optimizer, "local_variables", [])}
    return [v for v in optimizer.variables if id(v) not in local]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, copy the model's and optimizer's state from ``root_rank``.

    Put it first in ``callbacks=[...]``. Every rank then starts from the same weights (a model
    initialised with different seeds, or restored only on rank 0, is fine). The optimizer is
    built first if it is not yet, so its slots (momentum, Adam moments, the iteration count) are
    synchronised too. Error-feedback residuals are not broadcast: they are each rank's own.
    """

    def __init__(self, root_rank=0, process_set=None):
        super().__init__()
        self.root_rank = root_rank
        self.process_set = runtime.as_process_set(process_set)
        self._done = False

    def on_train_begin(self, logs=None):
        if self._done:
            return
        variables = list(self.model.variables)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            variables += _replicated_optimizer_variables(optimizer)
        broadcast_variables(variables, root_rank=self.root_rank, process_set=self.process_set)
        self._done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of each epoch, replace every numeric log entry with its mean over the ranks.

    Place it before callbacks that read the logs (ModelCheckpoint, EarlyStopping, ...): they
    then see the job's metrics rather than one rank's. Every rank ends with the same values.
    It first checks that every rank has taken the same number of steps (uneven shards end the
    job here with a message, instead of a hang).
    """

    def __init__(self, process_set=None):
        super().__init__()
        self.process_set = runtime.as_process_set(process_set)

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or runtime.size(self.process_set) == 1:
            return
        _assert_same_step(self.model)
        mine = {k: float(v) for k, v in logs.items() if isinstance(v, numbers.Real) or _is_scalar(v)}
        everyone = collectives.allgather_object(
            mine, name=f"sparse_hvd.metrics.{epoch}", process_set=self.process_set
        )
        for other_rank, theirs in enumerate(everyone):
            if sorted(theirs) != sorted(mine):
                raise ValueError(
                    f"MetricAverageCallback: rank {other_rank} logged {sorted(theirs)} but this "
                    f"rank logged {sorted(mine)}; every rank must log the same metrics"
                )
        for key in mine:
            logs[key] = sum(theirs[key] for theirs in everyone) / len(everyone)


class _EveryNBatchesCallback(keras.callbacks.Callback):
    """Runs ``_run()`` at every epoch end and, if given, every ``every_n_batches`` batches; at
    an epoch end, after checking that every rank has taken the same number of steps."""

    def __init__(self, every_n_batches=None):
        super().__init__()
        if every_n_batches is not None and (
            isinstance(every_n_batches, bool) or not isinstance(every_n_batches, int) or every_n_batches < 1
        ):
            raise ValueError(f"`every_n_batches` must be a positive int or None, got {every_n_batches!r}")
        self.every_n_batches = every_n_batches

    def _run(self):
        raise NotImplementedError

    def on_train_batch_end(self, batch, logs=None):
        if self.every_n_batches and (batch + 1) % self.every_n_batches == 0:
            self._run()

    def on_epoch_end(self, epoch, logs=None):
        _assert_same_step(self.model)
        self._run()


class AverageNonTrainableCallback(_EveryNBatchesCallback):
    """Average the model's floating-point non-trainable variables over the ranks.

    Each rank updates BatchNormalization's moving mean and variance from its own batches, so
    without this the replicas agree on every trained weight but not on those statistics. The
    average is taken at the end of every epoch (before callbacks placed after this one, such as
    ModelCheckpoint, read the model) and at the end of training, and every
    ``every_n_batches`` batches if given. After it every rank holds the same bits.
    """

    def __init__(self, every_n_batches=None, process_set=None):
        super().__init__(every_n_batches)
        self.process_set = runtime.as_process_set(process_set)

    def _run(self):
        state = [
            v for v in self.model.non_trainable_variables if tf.as_dtype(v.dtype).is_floating
        ]
        average_variables(state, process_set=self.process_set, name="sparse_hvd.model_state")

    def on_train_end(self, logs=None):
        self._run()


class ShareResidualsCallback(_EveryNBatchesCallback):
    """Before checkpoints, make every rank's residuals their mean over the ranks.

    Place it before ``keras.callbacks.ModelCheckpoint`` (written by rank 0 only): at each epoch
    end (and every ``every_n_batches`` batches if given, to match a checkpoint's ``save_freq``)
    it calls ``optimizer.share_residuals()``, so the saved residuals stand for all ranks and a
    resumed run, on the same or another number of workers, keeps the gradient still owed to
    the model. Use it in the uninterrupted run too: then resuming from a checkpoint continues
    exactly as if the run had never stopped.
    """

    def _run(self):
        share = getattr(self.model.optimizer, "share_residuals", None)
        if share is None:
            raise ValueError("ShareResidualsCallback needs a model compiled with SparseDistributedOptimizer")
        share()


def _is_scalar(value):
    shape = getattr(value, "shape", None)
    return shape is not None and len(shape) == 0
