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
"""

from ..feedback.payload import Payload
from .base import Exchange, register


@register("allgather", grouping="layerwise")
class LayerwiseAllgather(Exchange):
    """Steps 1-3 of the module doc."""

    per_layer = True

    def _average_many(self, payload: Payload, sizes, step):
        sparse = self.sparse_average(payload.sparse.items, sizes, payload.sparse.keys, step)
        dense = self.dense_average(payload.dense.items, payload.dense.keys, step)
        return sparse, dense, self.finite_everywhere(payload, step), ()
