"""What the optimizer counts: this rank's communication totals and per-layer figures.

The counters are plain ``tf.Variable``s, kept out of the optimizer's ``variables`` on purpose:
they are per rank (a broadcast from the root would overwrite them) and describe this process,
not the training state a checkpoint holds.
"""

import tensorflow as tf

from ..feedback.payload import Payload
from ..runtime.stamps import time_after

EMPTY = {"steps": 0, "bytes_sent": 0, "dense_bytes": 0, "capped_selections": 0,
         "skipped_steps": 0, "sparsify_seconds": 0.0, "exchange_seconds": 0.0,
         "measurement_bytes": 0, "update_factor": 1.0}


class CommunicationCounters:
    """This rank's running totals since the optimizer was built (``communication_stats()``)."""

    def __init__(self, num_variables):
        def counter(name, shape=()):
            return tf.Variable(tf.zeros(shape, tf.int64), trainable=False, name=name)

        with tf.init_scope():
            self.steps = counter("steps")
            self.bytes_sent = counter("bytes_sent")
            self.dense_bytes = counter("dense_bytes")
            self.capped_selections = counter("capped_selections")
            self.skipped_steps = counter("skipped_steps")
            self.last_sent = counter("last_sent", [num_variables])  # entries, per variable
            # wall time from all gradients to all selections, and from there to all averages
            self.sparsify_seconds = tf.Variable(0.0, dtype=tf.float64, trainable=False)
            self.exchange_seconds = tf.Variable(0.0, dtype=tf.float64, trainable=False)

    def record(self, payload: Payload, bytes_sent=None):
        """Count one step's payload (``bytes_sent``: as the exchange sends it, when that
        differs from the payload's own count: coded indices)."""
        self.steps.assign_add(1)
        sent = payload.bytes_sent if bytes_sent is None else bytes_sent
        self.bytes_sent.assign_add(tf.cast(sent, tf.int64))
        self.dense_bytes.assign_add(tf.cast(payload.dense_bytes, tf.int64))
        self.capped_selections.assign_add(tf.cast(payload.capped, tf.int64))
        if payload.sent_per_variable:
            indices, counts = zip(*payload.sent_per_variable)
            self.last_sent.scatter_nd_update(
                tf.constant([[i] for i in indices]), tf.cast(tf.stack(counts), tf.int64)
            )

    def record_times(self, payload: Payload, averaged=()):
        """Timestamps taken once the tensors they depend on exist: gradients -> selections ->
        ``averaged`` (the data is used later, so Grappler keeps these orderings). The first is
        the latest of the timestamps each selection waited for (``Payload.ready_times``).

        The first two are ``runtime.stamps.time_after``'s, ordered by their inputs alone:
        inside a ``tf.function`` a ``tf.timestamp`` made here, after the exchange, ran after
        the exchange's watched wait (automatic control dependencies run the stateful ops that
        take no resource in the order they were made), which then counted as selection.
        Without the native kernels they are ``tf.timestamp`` again, with that error."""
        if payload.ready_times:
            ready = tf.reduce_max(tf.stack(payload.ready_times))
        else:
            ready = tf.reduce_max(tf.stack([time_after(g) for g in payload.gradients] or
                                           [tf.timestamp()]))
        chosen = tf.reduce_max(tf.stack([time_after(t) for t in payload.selected] + [ready]))
        averaged = [a.values if isinstance(a, tf.IndexedSlices) else a for a in averaged]
        with tf.control_dependencies(averaged + [chosen]):
            done = tf.timestamp()
        self.sparsify_seconds.assign_add(chosen - ready)
        self.exchange_seconds.assign_add(done - chosen)

    def record_wait(self, started, done):
        """With staleness: the time a step waited for a delayed average (what was not hidden)."""
        self.exchange_seconds.assign_add(done - started)

    def record_skip(self):
        self.skipped_steps.assign_add(1)

    def as_dict(self):
        """``communication_stats()``: ``steps``: exchanged steps (skipped ones included);
        ``bytes_sent``: payload this rank contributed (values, indices and densely averaged
        gradients); ``dense_bytes``: what a dense float32 exchange of the same gradients would
        have sent; ``capped_selections``: selections a payload cap cut short;
        ``skipped_steps``: steps skipped for non-finite gradients; ``sparsify_seconds``: wall
        time from all gradients to all selections; ``exchange_seconds``: from there to all
        averaged gradients (with the layer-wise exchange the two overlap backprop and each
        other: spans, not costs; with ``staleness``, the time steps waited for a delayed
        average, the part of the exchange the computation did not hide)."""
        return {
            "sparsify_seconds": float(self.sparsify_seconds.numpy()),
            "exchange_seconds": float(self.exchange_seconds.numpy()),
            "steps": int(self.steps.numpy()),
            "bytes_sent": int(self.bytes_sent.numpy()),
            "dense_bytes": int(self.dense_bytes.numpy()),
            "capped_selections": int(self.capped_selections.numpy()),
            "skipped_steps": int(self.skipped_steps.numpy()),
        }


def layer_stats(variables, routes, counters: CommunicationCounters, policy, step,
                exchange="allgather"):
    """Per variable (by path): entries, route, how it is exchanged ("allgather",
    "sparse_allreduce" or "dense"), and entries/density sent in the last step."""
    last = counters.last_sent.numpy()
    stats = {}
    for index, (variable, route) in enumerate(zip(variables, routes)):
        stats[variable.path] = {
            "elements": route.num_elements,
            "route": "sparse" if route.sparse else "dense",
            "exchange": exchange if route.sparse else "dense",
            "target_density": policy.current_density(index, step) if route.sparse else 1.0,
            "last_sent": int(last[index]),
            "last_density": float(last[index]) / max(route.num_elements, 1),
        }
    return stats
