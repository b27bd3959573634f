"""``exchange="dense"``: every gradient averaged by Horovod's allreduce, as plain Horovod does.

The baseline every sparse exchange is measured against, and what ``exchange="auto"`` runs when
the dense allreduce is the fastest. It sends no selections (``sends_selections = False``): the
optimizer routes every variable densely, so nothing is selected and the residuals stay zero.

1. the gradients: one ``grouped_allreduce`` per dtype (or one allreduce per variable with
   ``grouping="layerwise"``), 16-bit on the wire with ``compression="float16"``;
2. whether every rank was finite: read from the averages (a rank's NaN or infinity reaches
   every rank's sum; an average whose entries' sum overflows is skipped too); with
   embeddings' rows, which travel apart, one tiny allreduce (``sparse_hvd.feedback.nonfinite``).
"""

import tensorflow as tf

from ..feedback import nonfinite
from ..feedback.payload import Payload
from .base import Exchange, register


@register("dense", grouping="grouped")
class DenseAllreduce(Exchange):
    """Steps 1-2 of the module doc."""

    sends_selections = False

    def _average_many(self, payload: Payload, sizes, step):
        if payload.sparse.items:
            raise ValueError("exchange='dense' was handed sparse selections: every variable "
                             "must be routed densely with it")
        dense = self.dense_average(payload.dense.items, payload.dense.keys, step)
        if payload.local_finite and dense and not payload.rows.items:
            # a rank's NaN or infinity reaches every rank's sum: the averages say it, with no
            # collective of its own (the same bits on every rank, so the same answer); one
            # reduction per average, as each rank's own check (``Payload.local_finite``)
            finite = tf.reduce_all([nonfinite.all_finite(a) for a in dense])
            return [], dense, finite, ()
        return [], dense, self.finite_everywhere(payload, step), ()


@register("dense", grouping="layerwise")
class LayerwiseDenseAllreduce(DenseAllreduce):
    """One allreduce per variable, started as soon as its gradient exists."""

    per_layer = True
