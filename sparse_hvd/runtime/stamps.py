"""Timestamps in a traced step that wait for one tensor and for nothing else.

``tf.timestamp`` is a stateful op without a resource, and inside a ``tf.function`` automatic
control dependencies run such ops in the order the trace made them. The stamps made per
variable (each gradient's, for the selection span and ``AdaptiveDensity``'s backward windows)
each waited for the one made before it: with a grouped exchange (the variables in their order)
for the first variable's gradient, backprop's last, so the windows read about zero; with the
layer-wise exchange (backprop's order) for the previous layer's, which the executor may make
later. And the stall watchdog's bracket, which every collective of the step waits for, came
after the stamps, so the layer-wise exchange's collectives waited for the whole backward pass
(``bench_overlap.py``: their starts spread over 3.8 ms of a 133 ms step, about 140 ms of 205
when first measured); and the selections' stamp, made after the exchange, ran after the
exchange's watched wait, which ``communication_stats()`` then counted as selection.
:func:`time_after` is ordered by its input alone (the native
``SparseHvdTimeAfter``, ``kernels/time_after.cc``). Without the native kernels (a GPU visible,
``SPARSE_HVD_NATIVE=0``) it is ``tf.timestamp`` under a control dependency, with that order.
"""

import tensorflow as tf

from .. import kernels


def time_after(tensor) -> tf.Tensor:
    """Seconds since the epoch (float64, ``tf.timestamp``'s clock) once ``tensor`` exists."""
    if isinstance(tensor, tf.IndexedSlices):
        tensor = tensor.values
    native = kernels.time_after()
    if native is None:
        with tf.control_dependencies([tensor]):
            return tf.timestamp()
    return native(after=tensor)
