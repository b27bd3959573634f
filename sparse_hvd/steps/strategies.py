"""How a step runs, chosen once when the optimizer is made: synchronous or delayed.

Both strategies take the step's (gradient, variable) pairs (after ``backward_passes_per_step``'s
accumulation, which wraps either: ``sparse_hvd.feedback.accumulation``) and share what comes before and
after the exchange: the optimizer makes the payload (steps 1-3: compensate, select, remember),
and the inner optimizer applies averages. They differ in when the exchange runs, when its
average is applied, and what a checkpoint or the end of training must do with averages in
flight:

* :class:`SynchronousStep` (``staleness=0``): exchange now (step 4), apply now (step 5); the
  step's own collectives carry the lockstep check; nothing is ever in flight;
* :class:`DelayedStep` (``staleness=tau``): hand the payload to the background pipeline and
  apply the average of step t - tau (``sparse_hvd.steps.staleness``); averages in flight are held
  for checkpoints, applied when training ends, dropped on a restore.

What a strategy uses of the optimizer (besides ``feedback.preparation``, which makes the
payload from it): ``_exchange``, ``_apply_inner``, ``_skip_step``, ``_counters``,
``_feedback``, ``_routes``, ``density_policy``, ``nonfinite``, ``iterations``.
"""

from typing import List

import tensorflow as tf

from ..feedback import nonfinite, preparation
from ..runtime import watchdog
from ..feedback.payload import write_state
from .pipeline import PayloadLayout
from .staleness import DelayedUpdates


class SynchronousStep:
    """Steps 4-5 of ``SparseDistributedOptimizer.apply`` on this step's payload."""

    checks_lockstep = True  # its collectives carry every rank's step

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def build(self, var_list, routes):
        """Nothing to make: the synchronous step keeps no state of its own."""

    def policy_step(self):
        """The step the density policy sees: applied steps."""
        return self.optimizer.inner_optimizer.iterations

    def run(self, grads_and_vars):
        """Steps 1-5; returns whether the step went ahead (a bool tensor that exists once the
        step's writes are done)."""
        opt = self.optimizer
        variables = [v for _, v in grads_and_vars]
        with tf.name_scope("sparse_exchange"):
            payload = preparation.make_payload(opt, grads_and_vars)  # Steps 1-3
            with watchdog.one_wait():  # one watched wait for all of the step's collectives
                averaged = self.exchange(payload, [g for g, _ in grads_and_vars])  # Step 4
            grads, state_updates = preparation.inner_gradients(opt, payload, averaged.gradients,
                                                               variables)
            opt._counters.record(payload, averaged.bytes_sent)
            opt._counters.record_times(payload, grads)
            with tf.control_dependencies(grads):  # re-measure after this step's traffic
                opt.density_policy.end_step(self.policy_step())
            # sparse allreduce: what was sent but not applied goes back to the residuals. Added
            # here, before the conditional, where nothing else holds the residual's new value,
            # so the native add (kernels/add_at.cc) works in its buffer; TensorFlow's scatter
            # copied all of it (10-10.8 ms a step for the MLP's 4.2M-entry layer, 4 workers)
            state_updates = opt._feedback.add_back(payload.sparse.keys, averaged.returned,
                                                   state_updates)

        def go_ahead():
            write_state(state_updates, opt)
            opt._apply_inner(grads, variables)
            return tf.constant(True)  # after the writes above (automatic control edges)

        def skip():
            opt._skip_step("The step was skipped on every rank.")
            return tf.constant(False)

        return nonfinite.guard(opt.nonfinite, averaged.finite, go_ahead, skip)  # Step 5

    def exchange(self, payload, gradients):
        """Step 4: the exchange's averages of ``payload`` (``gradients``: the step's own, for
        a subclass that times the exchange from the moment they exist)."""
        opt = self.optimizer
        return opt._exchange.average(payload, opt._num_elements(), step=opt.iterations)

    def current_exchange(self):
        """The exchange the steps run now (``exchange="auto"`` switches it)."""
        return self.optimizer._exchange

    def current_routes(self):
        """The routes the steps run with now."""
        return self.optimizer._routes

    # nothing is ever in flight
    def hold_pending(self):
        pass

    def apply_pending(self):
        pass

    def discard(self):
        pass

    def residuals_restored(self):
        """The residuals were replaced by restored ones (eager): nothing to note here."""

    def pending_steps(self) -> List[int]:
        return []

    def held_steps(self) -> List[int]:
        return []


class DelayedStep(SynchronousStep):
    """A step with staleness tau: the exchange in the background, the average of t - tau."""

    checks_lockstep = False  # the pipeline's collectives run on its own thread

    def __init__(self, optimizer, staleness):
        super().__init__(optimizer)
        self.staleness = int(staleness)
        self.delayed = DelayedUpdates(self.staleness)

    def build(self, var_list, routes):
        opt = self.optimizer
        self.delayed.build(opt, var_list, routes, opt._prefix, opt.process_set)

    def policy_step(self):
        """The step the density policy sees: exchanged steps (the first tau apply nothing)."""
        return self.delayed.exchange_step

    def run(self, grads_and_vars):
        """Hand this step's payload and this rank's finiteness to the pipeline, then apply the
        average of step t - tau.

        No collective runs here: whether a step was finite on every rank travels with its
        payload and is acted on when the step is due (``nonfinite``: skip it on every rank and
        give this rank's sent entries back to its residuals, or stop).
        """
        opt = self.optimizer
        with tf.name_scope("delayed_exchange"):
            step = tf.convert_to_tensor(self.delayed.exchange_step.value)
            layout = PayloadLayout((), ())
            if grads_and_vars:
                payload = preparation.make_payload(opt, grads_and_vars, keep_rows=False)
                finite_here = payload.finite_here()
                opt._counters.record_times(payload)
                # this rank's gradients were not finite: write nothing
                tf.cond(finite_here, lambda: write_state(payload.state_updates, opt),
                        lambda: None)
                layout, sent = self.delayed.submit(step, finite_here, payload)
                opt._counters.record(payload, bytes_sent=sent)
                opt.density_policy.end_step(step)
            due = self.delayed.take_due(step - self.staleness, layout, opt._counters.record_wait)

            def apply_due():
                nonfinite.guard(opt.nonfinite, due.finite, lambda: self._apply(due.grads),
                                lambda: self._skip(due.sent))

            tf.cond(due.present, apply_due, lambda: None)
            self.delayed.exchange_step.assign_add(1)

    def _apply(self, grads):
        """A delayed average of every variable to the inner optimizer; with momentum
        correction, the dense-route variables' averages first through ordinary momentum, as the
        synchronous step does (their velocity is written now, when the average is applied)."""
        opt = self.optimizer
        grads, updates = list(grads), []
        for index, route in enumerate(opt._routes):
            if not route.sparse:
                grads[index], written = opt._feedback.after_exchange(index, grads[index])
                updates.extend(written)
        write_state(updates, opt)
        opt._apply_inner(grads)

    def _skip(self, sent):
        self.optimizer._skip_step("A delayed step was skipped on every rank.", sent)

    def hold_pending(self):
        if self.optimizer.built:
            self.delayed.hold_pending(undo=self._skip)

    def apply_pending(self):
        if self.optimizer.built:
            self.delayed.apply_pending(apply=self._apply, undo=self._skip)

    def discard(self):
        if self.optimizer.built:
            self.delayed.discard()

    def pending_steps(self) -> List[int]:
        return self.delayed.pending_steps() if self.optimizer.built else []

    def held_steps(self) -> List[int]:
        return self.delayed.held_steps() if self.optimizer.built else []
