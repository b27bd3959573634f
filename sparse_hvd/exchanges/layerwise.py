"""``grouping="layerwise"``: one allgather pair (or one allreduce) per variable.

Each collective depends only on its own variable's gradient, so TensorFlow's executor starts
it as soon as that gradient exists, while backprop of the layers below continues (the overlap
LAGS-SGD relies on, Shi et al. 2020); Horovod still fuses the collectives that become ready in
the same cycle. Horovod's collective ops are not stateful in TensorFlow's sense, so automatic
control dependencies do not chain them in program order.

1. each variable's selection: its values and its indices, one allgather each (named by the
   variable's key, the same on every rank); every rank receives every rank's, in rank order;
2. summed in rank order and divided by the number of workers (``sparse_hvd.exchanges.averaging``), as
   the fused exchange does: the same bits;
3. dense-route gradients: one allreduce each; whether every rank was finite: one tiny
   allreduce (``sparse_hvd.feedback.nonfinite``).

No lockstep header: the collectives are per variable, so a rank whose steps differ is caught
by the stall watchdog instead.

``exchange="compact_allgather"`` with this grouping (:class:`LayerwiseCompactAllgather`): the
same per-variable collectives, each variable's selection coded on its own (its indices
Elias-Fano coded among its own entries, its values as ``value_coding`` codes them) and
gathered with a header (this rank's "finite" flag, its step, the counts and the codes' fields)
by ONE allgather per variable, named by its key: steps 1-6 of the grouped exchanges' module
doc (``fused_allgather``, ``compact_allgather``) with one variable each, so the lockstep check
runs in every variable's collective and the "finite" flags need no collective of their own.
"""

import tensorflow as tf

from ..feedback.payload import Part, Payload
from .base import Exchange, register
from .compact_allgather import CompactAllgather


@register("allgather", grouping="layerwise")
class LayerwiseAllgather(Exchange):
    """Steps 1-3 of the module doc."""

    per_layer = True

    def _average_many(self, payload: Payload, sizes, step):
        sparse = self.sparse_average(payload.sparse.items, sizes, payload.sparse.keys, step)
        dense = self.dense_average(payload.dense.items, payload.dense.keys, step)
        return sparse, dense, self.finite_everywhere(payload, step), ()


@register("compact_allgather", grouping="layerwise")
class LayerwiseCompactAllgather(CompactAllgather):
    """A :class:`CompactAllgather` of its own for each sparse variable (module doc): every
    collective depends on one variable's gradient only. With ``staleness`` the delayed
    pipeline codes every variable as one set, as with the grouped exchange (it gathers on its
    own thread, one collective for everything)."""

    per_layer = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._parts = {}  # build index -> the variable's own CompactAllgather

    def _part(self, key):
        if key not in self._parts:
            part = CompactAllgather(f"{self.name}.{key}", self.process_set,
                                    compression=self.compression)
            part._at_positions = self._at_positions  # the form build chose (``FusedAllgather``)
            self._parts[key] = part
        return self._parts[key]

    def _average_many(self, payload: Payload, sizes, step):
        local_finite = (payload.finite_here(),) if payload.local_finite else ()
        nothing = tf.constant(0, tf.int64)
        averages, finite, changes = [], [], []
        for selection, key, n in zip(payload.sparse.items, payload.sparse.keys, sizes):
            # counted from 0 bytes, a part's count is what its codes change of the payload's
            alone = Payload(sparse=Part((0,), (key,), (selection,)), dense=Part(), rows=Part(),
                            state_updates=(), local_finite=local_finite, gradients=(),
                            sent_per_variable=(), dense_bytes=0, bytes_sent=nothing,
                            capped=nothing)
            part = self._part(key)
            average, _, part_finite, _ = part._average_many(alone, [n], step)
            averages += average
            finite.append(part_finite)
            changes.append(part._sent)
        if changes:
            self._sent = payload.bytes_sent + tf.add_n(changes)
        finite = tf.reduce_all(finite) if finite else self.finite_everywhere(payload, step)
        dense = self.dense_average(payload.dense.items, payload.dense.keys, step)
        return averages, dense, finite, ()

    @property
    def traced(self) -> bool:
        return False  # each variable's collective checks the lockstep fields itself
