"""sparse_hvd's messages: one Python logger, ``logging.getLogger("sparse_hvd")``.

Every message the library writes (the exchange ``"auto"`` chose, the dense fallback's decision,
skipped steps, residuals rescaled after a restore, the per-epoch communication log, the stall
watchdog, the kernels' first build) goes through it. By default it writes INFO and above to
the process's current stderr as ``sparse_hvd: <message>``, with a handler of its own and
without propagating to the root logger, so a training script's logging set-up neither silences
nor repeats it. To quiet it: ``SPARSE_HVD_LOG_LEVEL=WARNING`` (or ``logger.setLevel``); to send
it through your own handlers: ``logging.getLogger("sparse_hvd").handlers.clear()`` and
``.propagate = True``.
"""

import logging
import os
import sys

NAME = "sparse_hvd"


class _CurrentStderr(logging.StreamHandler):
    """A stream handler that writes to whatever ``sys.stderr`` is at the time (pytest and
    notebooks replace it after import)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


def logger() -> logging.Logger:
    """The library's logger, with its default handler on first use."""
    log = logging.getLogger(NAME)
    if not getattr(log, "_sparse_hvd_defaults", False):
        log._sparse_hvd_defaults = True
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("sparse_hvd: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
        log.setLevel(os.environ.get("SPARSE_HVD_LOG_LEVEL", "INFO").upper())
    return log


def info(message, *args):
    logger().info(message, *args)


def error(message, *args):
    logger().error(message, *args)


def _log_in_graph(message):
    message = getattr(message, "item", lambda: message)()  # a 0-d array when run eagerly
    info("%s", message.decode() if isinstance(message, bytes) else str(message))


def info_in_graph(message) -> None:
    """Log a (string tensor) message when the graph runs (a host callback, only on the path
    that is taken: a skipped step, say)."""
    import tensorflow as tf

    tf.numpy_function(_log_in_graph, [message], [], stateful=True, name="sparse_hvd_log")
