"""``backward_passes_per_step``: several local backward passes, one exchange.

Horovod's ``backward_passes_per_step=B`` (with ``average_aggregated_gradients``), for the sparse
exchange: B backward passes are added up locally and exchanged once, so the bytes per sample
drop B-fold and the inner optimizer steps once per B passes.

1. every pass adds its gradient (densified, in the variable's dtype) into this rank's
   accumulator of that variable;
2. the B-th pass instead hands ``accumulator + gradient`` (divided by B with
   ``average_aggregated_gradients=True``) to the ordinary step: compensate, select, exchange,
   apply; then the accumulators are zeroed. Every rank counts its passes the same way, so all
   ranks exchange at the same passes.

A non-finite pass makes its accumulated sum non-finite, so that step is skipped on every rank
(``nonfinite="skip"``) and the accumulators start again from zero: the residuals never see it.
The accumulators are each rank's own (like the residuals, not broadcast) and are saved with the
optimizer; ``ShareResidualsCallback`` does not average them, so write checkpoints where they are
empty, at an exchange (steps per epoch a multiple of B). They are separate from the residuals,
at the cost of one copy of the model, because a skipped step must leave the residuals
untouched.

Keras' own ``gradient_accumulation_steps=B`` on the inner optimizer means the same thing for
one process (B passes averaged, then one update; ``iterations`` counts updates, the
optimizer's ``_iterations`` passes), but done by the inner optimizer it would come after the
exchange, which would still run at every pass. The wrapper takes it over
(:func:`take_over_keras_accumulation`): it accumulates in its accumulators (readable as
Keras' ``_accumulated_gradients``), averages, exchanges once per B passes and hands the inner
optimizer one step, which clips and decays the average as Keras would.
"""

import tensorflow as tf


def _dense(grad, variable):
    if isinstance(grad, tf.IndexedSlices):
        grad = tf.math.unsorted_segment_sum(grad.values, grad.indices, variable.shape[0])
    return tf.cast(grad, variable.dtype)


def take_over_keras_accumulation(optimizer, backward_passes_per_step):
    """B from the inner ``optimizer``'s ``gradient_accumulation_steps`` (None when it has none),
    which is switched off there: the wrapper accumulates before the exchange instead."""
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if not steps:
        return None
    if backward_passes_per_step != 1:
        raise ValueError(
            f"the inner optimizer has gradient_accumulation_steps={steps} and the wrapper "
            f"backward_passes_per_step={backward_passes_per_step}: both accumulate backward "
            "passes before a step. Give one of them.")
    optimizer.gradient_accumulation_steps = None
    return int(steps)


def _overwritten(variable):
    """A variable the inner optimizer overwrites with its gradient (Keras'
    ``overwrite_with_gradient``, float8 scales): its passes combine by maximum, as in Keras."""
    return getattr(variable, "overwrite_with_gradient", False)


def _combined(accumulator, grad, variable):
    grad = _dense(grad, variable)
    if _overwritten(variable):
        return tf.maximum(tf.convert_to_tensor(accumulator), grad)
    return accumulator + grad


class LocalAccumulation:
    """The accumulators and the pass counter of ``backward_passes_per_step`` (see module doc).

    Args:
        passes: B, the backward passes per exchange (at least 2 to need this class).
        average: divide the accumulated sum by B (Horovod's ``average_aggregated_gradients``).
    """

    def __init__(self, passes: int, average: bool):
        self.passes = int(passes)
        self.average = bool(average)
        self.accumulators = []
        self.counter = None

    def build(self, optimizer, var_list):
        """The optimizer's variables: one accumulator per trainable variable, and the count of
        passes seen (the same on every rank)."""
        self.writer = optimizer  # writes through its assign methods (Keras' rule)
        self.accumulators = [optimizer.add_variable_from_reference(v, name="accumulated_gradient")
                             for v in var_list]
        self.counter = optimizer.add_variable(shape=(), dtype="int64", name="backward_passes")

    def pass_or_step(self, grads_and_vars, index_of, step):
        """Step 1 on this pass, or step 2: ``step(grads_and_vars)`` with the accumulated sums.

        ``index_of(variable)``: the variable's build index (its accumulator).
        """
        passes = self.counter.assign_add(1)
        due = tf.equal(tf.math.floormod(passes, self.passes), 0)

        def accumulate():
            for grad, variable in grads_and_vars:
                accumulator = self.accumulators[index_of(variable)]
                self.writer.assign(accumulator, _combined(accumulator, grad, variable))

        def exchange():
            summed = []
            for grad, variable in grads_and_vars:
                total = _combined(self.accumulators[index_of(variable)], grad, variable)
                if self.average and not _overwritten(variable):
                    total = total / tf.cast(self.passes, total.dtype)
                summed.append((total, variable))
            step(summed)
            for accumulator in self.accumulators:
                self.writer.assign(accumulator, tf.zeros_like(accumulator))

        tf.cond(due, exchange, accumulate)
