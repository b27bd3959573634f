"""``exchange="dense"``: every gradient averaged by Horovod's allreduce, as plain Horovod does.

The baseline every sparse exchange is measured against, and what ``exchange="auto"`` runs when
the dense allreduce is the fastest. It sends no selections (``sends_selections = False``): the
optimizer routes every variable densely, so nothing is selected and the residuals stay zero.

1. the gradients: one ``grouped_allreduce`` per dtype (or one allreduce per variable with
   ``grouping="layerwise"``), 16-bit on the wire with ``compression="float16"``;
2. whether every rank was finite: read from the averages (a rank's NaN or infinity reaches
   every rank's sum); with embeddings' rows, which travel apart, one tiny allreduce
   (``sparse_hvd.feedback.nonfinite``).

With the native kernels (a CPU job) the float32/float64 gradients of the grouped exchange are
summed by Horovod (``op=Sum``) and the native ``SparseHvdDivideChecked`` divides each sum by
the number of workers and says whether every average is finite, in one pass: Horovod's
``op=Average`` scales its buffer in a pass of its own and the check then read every average
again (its sums: 1.8 ms of a 50 ms step of the 4.35M MLP at 2 workers, ``profile_step.py``;
the wrapper's step went from 1.05-1.06x a plain allreduce's to 1.02x). On a GPU, with 16-bit
compression or layer by layer, Horovod averages and each average's sum is checked (a sum is
non-finite iff an entry is, or the sum overflows).
"""

import tensorflow as tf

from .. import kernels
from ..feedback import nonfinite
from ..feedback.payload import Payload
from ..runtime import collectives
from .base import Exchange, group_positions_by_dtype, register

DIVIDED_NATIVELY = (tf.float32, tf.float64)  # the dtypes SparseHvdDivideChecked takes


@register("dense", grouping="grouped")
class DenseAllreduce(Exchange):
    """Steps 1-2 of the module doc."""

    sends_selections = False

    def _average_many(self, payload: Payload, sizes, step):
        if payload.sparse.items:
            raise ValueError("exchange='dense' was handed sparse selections: every variable "
                             "must be routed densely with it")
        tensors, keys = payload.dense.items, payload.dense.keys
        if payload.local_finite and tensors and not payload.rows.items:
            # a rank's NaN or infinity reaches every rank's sum: the averages say it, with no
            # collective of its own (the same bits on every rank, so the same answer)
            divide = self._native_divide(tensors)
            if divide is not None:
                return ([],) + self._divided_checked(divide, tensors, step) + ((),)
            dense = self.dense_average(tensors, keys, step)
            finite = tf.reduce_all([nonfinite.all_finite(a) for a in dense])
            return [], dense, finite, ()
        dense = self.dense_average(tensors, keys, step)
        return [], dense, self.finite_everywhere(payload, step), ()

    def _native_divide(self, tensors):
        """The native divide-and-check op where it applies (module doc), else None."""
        if (self.size == 1 or self.per_layer or self.compression.enabled
                or any(t.dtype not in DIVIDED_NATIVELY for t in tensors)):
            return None
        return kernels.divide_checked()

    def _divided_checked(self, divide, tensors, step):
        """``(averages, finite)``: one ``grouped_allreduce(op=Sum)`` per dtype, then each
        dtype's sums divided and checked by ``divide`` in one pass."""
        sums = self.per_dtype(
            lambda group, name, process_set, step: collectives.grouped_allreduce(
                group, name=name, process_set=process_set, op=collectives.SUM, step=step),
            list(tensors), f"{self.name}.dense_sum", step)
        averages = [None] * len(sums)
        checks = []
        for dtype, positions in group_positions_by_dtype(sums).items():
            divided, finite = divide([sums[p] for p in positions], tf.cast(self.size, dtype))
            checks.append(finite)
            for position, average in zip(positions, divided):
                averages[position] = average
        return averages, tf.reduce_all(checks)


@register("dense", grouping="layerwise")
class LayerwiseDenseAllreduce(DenseAllreduce):
    """One allreduce per variable, started as soon as its gradient exists."""

    per_layer = True
