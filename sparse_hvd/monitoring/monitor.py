"""What the sparsifier is doing, per epoch: a Keras callback that logs it on rank 0.

Each epoch, :class:`CommunicationLogger` reads the optimizer's counters and writes one JSON
line (``path``), optionally TensorBoard scalars (``tensorboard_dir``), and prints one line;
only rank 0 does any of it. ``python -m sparse_hvd.report LOG`` turns the lines into a table
and plots.
"""

import json
import math
import os

import keras

from ..runtime import log, startup as runtime


def _sparse_optimizer(model):
    optimizer = getattr(model, "optimizer", None)
    inner = getattr(optimizer, "inner_optimizer", None)
    for candidate in (optimizer, inner):
        if candidate is not None and hasattr(candidate, "communication_stats"):
            return candidate
    raise ValueError(
        "CommunicationLogger needs a model compiled with sparse_hvd.SparseDistributedOptimizer, "
        f"got {type(optimizer).__name__}"
    )


def epoch_record(optimizer, epoch, previous, per_layer=False):
    """The logged values of one epoch, from the counters now and at the previous epoch's end."""
    now = optimizer.communication_stats()
    steps = max(1, now["steps"] - previous["steps"])
    sent = now["bytes_sent"] - previous["bytes_sent"]
    dense = now["dense_bytes"] - previous["dense_bytes"]
    layers = optimizer.layer_stats()
    sparse = [s for s in layers.values() if s["route"] == "sparse"]
    residual_norm = math.sqrt(sum(float((r.numpy().astype("float64") ** 2).sum()) for r in optimizer.residuals))
    record = {
        "epoch": epoch,
        "steps": now["steps"] - previous["steps"],
        "bytes_sent_per_step": sent / steps,
        "dense_bytes_per_step": dense / steps,
        "compression": dense / sent if sent else float("inf"),
        "density_last_step": (
            sum(s["last_sent"] for s in sparse) / sum(s["elements"] for s in sparse) if sparse else 1.0
        ),
        "residual_norm": residual_norm,
        "sparsify_ms_per_step": 1000 * (now["sparsify_seconds"] - previous["sparsify_seconds"]) / steps,
        "exchange_ms_per_step": 1000 * (now["exchange_seconds"] - previous["exchange_seconds"]) / steps,
        "skipped_steps": now["skipped_steps"] - previous["skipped_steps"],
        "capped_selections": now["capped_selections"] - previous["capped_selections"],
        "update_factor": now["update_factor"],
    }
    if per_layer:
        record["layers"] = layers
    return record, now


class CommunicationLogger(keras.callbacks.Callback):
    """Logs bytes sent vs dense, achieved density, residual norm, time in sparsification and
    exchange, and the factor of the next step that cuts (``update_scale``), once per epoch, on
    rank 0 only.

    Args:
        path: a JSON-lines file to append one record per epoch to (``python -m sparse_hvd.report``
            reads it); None logs nothing to disk.
        tensorboard_dir: also write the scalars there as TensorBoard summaries (needs the
            tensorboard package: the `sparse_hvd[tensorboard]` extra).
        per_layer: include every variable's route, entries and last-step density in the record.
        verbose: print one line per epoch.
    """

    def __init__(self, path=None, tensorboard_dir=None, per_layer=False, verbose=True):
        super().__init__()
        self.path = path
        self.tensorboard_dir = tensorboard_dir
        self.per_layer = per_layer
        self.verbose = verbose
        self._previous = None
        self._writer = None

    def on_train_begin(self, logs=None):
        self._optimizer = _sparse_optimizer(self.model)
        self._previous = self._optimizer.communication_stats()
        if runtime.rank() == 0 and self.tensorboard_dir:
            import tensorflow as tf

            try:
                import tensorboard  # noqa: F401  (tf.summary's implementation)
            except ImportError:
                raise ImportError(
                    "CommunicationLogger(tensorboard_dir=...) needs the tensorboard package, which "
                    "tensorflow-cpu does not install: pip install 'sparse_hvd[tensorboard]' "
                    "(or tensorboard)"
                ) from None

            self._writer = tf.summary.create_file_writer(self.tensorboard_dir)

    def on_epoch_end(self, epoch, logs=None):
        if runtime.rank() != 0:
            self._previous = self._optimizer.communication_stats()
            return
        record, self._previous = epoch_record(self._optimizer, epoch, self._previous, self.per_layer)
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "a") as handle:
                handle.write(json.dumps(record) + "\n")
        if self._writer is not None:
            import tensorflow as tf

            with self._writer.as_default(step=epoch):
                for key, value in record.items():
                    if key not in ("epoch", "layers") and math.isfinite(value):
                        tf.summary.scalar(f"sparse_hvd/{key}", value)
            self._writer.flush()
        if self.verbose:
            log.info(
                f"epoch {epoch + 1}: {record['bytes_sent_per_step']:,.0f} B/step "
                f"({record['compression']:.1f}x less than dense), density "
                f"{100 * record['density_last_step']:.2f}%, residual norm "
                f"{record['residual_norm']:.3g}, sparsify {record['sparsify_ms_per_step']:.2f} ms, "
                f"exchange {record['exchange_ms_per_step']:.2f} ms per step"
                + (f", step factor {record['update_factor']:.2f}"
                   if record["update_factor"] != 1 else "")
                + (f", {record['skipped_steps']} skipped" if record["skipped_steps"] else ""),
            )
