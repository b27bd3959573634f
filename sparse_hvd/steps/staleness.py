"""Bounded staleness: exchange a step's gradients in the background, apply them tau steps later.

Candela et al. ("Sparsification as a remedy for staleness in distributed asynchronous SGD") show
that SGD applying delayed sparse updates with error feedback keeps the O(1/sqrt(T)) non-convex
rate. With ``SparseDistributedOptimizer(..., staleness=tau)`` a worker no longer waits for the
network inside its step. :class:`DelayedUpdates` is the optimizer's side of it:

1. step t (in the training step): compensate and select as usual, write the residuals (unless
   this rank's gradients are not finite), and hand the payload with this rank's finiteness to
   the pipeline (:meth:`DelayedUpdates.submit`; the exchange runs on the pipeline's thread,
   ``sparse_hvd.steps.pipeline``). It returns at once.
2. Still in step t: the average of step t - tau is taken (:meth:`DelayedUpdates.take_due`,
   which waits only if it has not arrived yet) and given to the inner optimizer. The first tau
   steps apply nothing. With tau = 1 a whole step's exchange overlaps the next step's forward
   and backward pass; a larger tau leaves the network (or a straggler) tau steps.
3. No collective runs in the step itself: a step that was not finite on every rank comes back
   marked so on every rank, and is skipped everywhere when due (each rank gives what it sent
   back to its residuals) or stops the job, as ``nonfinite`` says.
4. Before a checkpoint, the exchanges in flight are waited for and their averages written into
   optimizer variables (the ``delayed`` slots, tau per trainable variable:
   :meth:`DelayedUpdates.hold_pending`), so the checkpoint holds them and a resumed job
   continues the same sequence; at the end of ``fit`` whatever is still pending is applied in
   step order (:meth:`DelayedUpdates.apply_pending`), so no update is lost. A slot is zeroed
   when used, so every rank's optimizer state agrees again even when only rank 0 saved.
"""

import functools
from typing import Callable, List, NamedTuple

import keras
import tensorflow as tf

from ..exchanges import create as create_exchange
from ..feedback.payload import Payload
from .pipeline import DelayedExchange, PayloadLayout


class Due(NamedTuple):
    """The delayed step a training step applies."""

    present: tf.Tensor  # bool: there is a step to apply (False for the first tau steps)
    finite: tf.Tensor  # bool: it was finite on every rank
    grads: List[tf.Tensor]  # its average for every trainable variable, shaped like it
    sent: dict  # {variable index: (values, indices)} this rank sent, to give back if skipped


class DelayedUpdates:
    """Slots for the averages of the last tau steps, the step counter and the pipeline.

    Args:
        staleness: tau >= 1, steps an update is applied late.
    """

    def __init__(self, staleness: int):
        self.staleness = int(staleness)
        self.slots: List[keras.Variable] = []
        self.slot_steps = None
        self.exchange_step = None
        self.pipeline = None

    def build(self, optimizer, var_list, routes, name, process_set=None):
        """Create the slots, the slots' steps and the exchange step as variables of
        ``optimizer`` (in that order: the checkpoint format), and the pipeline."""
        tau = self.staleness
        self.slots = [
            optimizer.add_variable(shape=(tau, *variable.shape), dtype=variable.dtype,
                                   initializer="zeros", name="delayed")
            for variable in var_list
        ]
        # Which step each slot holds (-1: none). A slot is filled only by hold_pending.
        self.slot_steps = optimizer.add_variable(
            shape=(tau,), dtype="int64", initializer=keras.initializers.Constant(-1),
            name="delayed_steps",
        )
        self.exchange_step = optimizer.add_variable(
            shape=(), dtype="int64", initializer="zeros", name="exchange_step"
        )
        self._dtypes = [tf.as_dtype(variable.dtype) for variable in var_list]
        self._shapes = [variable.shape for variable in var_list]
        self._num_elements = [route.num_elements for route in routes]
        self.compression = optimizer._compression
        # exchange="compact_allgather": its indices and values travel coded; else as they are
        method = ("compact_allgather" if optimizer._exchange.method == "compact_allgather"
                  else "allgather")
        self.pipeline = DelayedExchange(
            create_exchange(method, name=f"{name}.delayed", process_set=process_set,
                            compression=self.compression),
            self._num_elements, [d.as_numpy_dtype for d in self._dtypes],
        )

    # ---- in the training step ------------------------------------------------------------------

    def submit(self, step, finite_here, payload: Payload):
        """Step 1 of the module doc: hand ``payload`` (densified rows) and whether this rank's
        gradients were finite to the pipeline. Returns the payload's layout and the bytes it
        sends (None: the payload's own count; with codes, what they take)."""
        selections = payload.sparse.items
        layout = PayloadLayout(tuple(payload.sparse.keys), tuple(payload.dense.keys),
                               coded=self.pipeline.coded and bool(selections))
        code, sent = [], None
        if layout.coded:  # coded here, by the exchange's own (native) passes
            sizes = [self._num_elements[index] for index in layout.sparse]
            packed = self.pipeline.exchange.pack_selections(payload, sizes)
            selections, sent = packed.selections, packed.sent
            layout = layout._replace(
                value_groups=tuple(tuple(p) for p in packed.value_groups.values()))
            code = [packed.indices] + packed.words + [tf.cast(packed.fields, tf.int32)]
        arrays = [t for s in selections for t in (self._as_sent(s.values), s.indices)] + code
        arrays += [tf.reshape(g, [-1]) for g in payload.dense.items]
        tf.numpy_function(functools.partial(self.pipeline.submit, layout),
                          [step, finite_here] + arrays, tf.int64, stateful=True,
                          name="submit")
        return layout, sent

    def _as_sent(self, values):
        """Sparse values as they travel: 16-bit with ``compression`` (the payload holds values
        rounded to it already, so the cast is exact)."""
        half = self.compression.wire_dtype(values.dtype)
        return values if half is None else tf.cast(values, half)

    def take_due(self, due, layout: PayloadLayout, record_wait: Callable) -> Due:
        """Step 2 of the module doc: step ``due``'s average, from the slots after a restore,
        else from the pipeline (waiting for it if needed); ``present`` is False for a step
        never exchanged. ``record_wait(started, done)`` is given the time it waited."""
        sent_dtypes = [t for i in layout.sparse for t in (self._dtypes[i], tf.int32)]
        slot = tf.math.floormod(due, self.staleness)
        held = tf.equal(tf.gather(self.slot_steps.value, slot), due)
        count = len(self.slots)

        def from_slots():
            averages = [tf.reshape(tf.gather(d.value, slot), [-1]) for d in self.slots]
            with tf.control_dependencies(averages):
                self._release_slot(slot)
            nothing_sent = [tf.zeros([0], t) for t in sent_dtypes]
            return ([tf.constant(True), tf.constant(True)] + [tf.identity(a) for a in averages]
                    + nothing_sent)

        def from_pipeline():
            taken = tf.numpy_function(functools.partial(self.pipeline.take_for_step, layout),
                                      [due], [tf.bool, tf.bool] + self._dtypes + sent_dtypes,
                                      stateful=True, name="take")
            taken[0].set_shape([])
            taken[1].set_shape([])
            for average, n in zip(taken[2:], self._num_elements):
                average.set_shape([n])
            for sent in taken[2 + count:]:
                sent.set_shape([None])
            return taken

        started = tf.timestamp()
        with tf.control_dependencies([started]):
            results = tf.cond(tf.logical_and(due >= 0, held), from_slots, from_pipeline)
        averages, sent = results[2:2 + count], results[2 + count:]
        with tf.control_dependencies(averages):
            record_wait(started, tf.timestamp())
        return Due(
            present=results[0], finite=results[1],
            grads=[tf.reshape(a, shape) for a, shape in zip(averages, self._shapes)],
            sent={index: (sent[2 * j], sent[2 * j + 1]) for j, index in enumerate(layout.sparse)},
        )

    def _release_slot(self, slot):
        """Mark a slot empty and zero it, so that every rank's slots agree again (only the
        rank that wrote a checkpoint filled them)."""
        for delayed in self.slots:
            delayed.value.scatter_nd_update(
                [[slot]], tf.zeros([1, *delayed.shape[1:]], delayed.dtype))
        self.slot_steps.value.scatter_nd_update([[slot]], tf.constant([-1], tf.int64))

    # ---- between steps (eager) -----------------------------------------------------------------

    def held_steps(self) -> List[int]:
        """The steps whose averages are held in the slots (after ``hold_pending`` or a
        restore), sorted."""
        return sorted(int(step) for step in self.slot_steps.numpy() if step >= 0)

    def pending_steps(self) -> List[int]:
        """Steps submitted to the pipeline whose average has not been taken yet, oldest first."""
        return self.pipeline.pending_steps()

    def _take_finite(self, step, undo):
        """Step ``step``'s averages from the pipeline, or None after ``undo(sent)`` if it was
        not finite on every rank."""
        result = self.pipeline.take(step)
        if not result.finite:
            undo(result.own)
            return None
        return result.averages

    def hold_pending(self, undo):
        """Step 4 of the module doc: wait for the exchanges in flight and keep their averages
        in the slots. A step not finite on every rank is undone now (``undo(sent)``)."""
        with tf.init_scope():
            for step in self.pending_steps():
                averages = self._take_finite(step, undo)
                if averages is None:
                    continue
                slot = [[step % self.staleness]]
                for delayed, average in zip(self.slots, averages):
                    delayed.value.scatter_nd_update(
                        slot, tf.reshape(tf.constant(average), [1, *delayed.shape[1:]]))
                self.slot_steps.value.scatter_nd_update(slot, tf.constant([step], tf.int64))

    def apply_pending(self, apply, undo):
        """Step 4 of the module doc: ``apply(grads)`` every delayed average not applied yet,
        oldest first, from the slots or the pipeline; ``undo(sent)`` those not finite."""
        with tf.init_scope():
            held = tf.convert_to_tensor(self.slot_steps.value).numpy()
            in_slots = {int(step): slot for slot, step in enumerate(held) if step >= 0}
            for step in sorted(set(in_slots) | set(self.pending_steps())):
                if step in in_slots:
                    averages = [tf.gather(d.value, in_slots[step]) for d in self.slots]
                    self._release_slot(in_slots[step])
                else:
                    averages = self._take_finite(step, undo)
                    if averages is None:
                        continue
                apply([tf.reshape(tf.convert_to_tensor(a), shape)
                       for a, shape in zip(averages, self._shapes)])

    def discard(self):
        """Wait for the exchanges in flight and drop them: a restore replaces the slots."""
        self.pipeline.discard()
