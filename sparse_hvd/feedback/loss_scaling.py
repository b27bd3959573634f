"""Loss scaling for an inner ``keras.optimizers.LossScaleOptimizer`` (mixed precision).

Gradients arrive multiplied by the loss scale (a power of two). Residuals and the exchange work
on true gradients, so that a change of scale never mixes units in a residual, and dividing or
multiplying by a power of two is exact both ways:

1. :meth:`LossScaling.unscale` divides each incoming gradient by the scale;
2. :meth:`LossScaling.rescale` multiplies the averaged gradients by it again before the inner
   LossScaleOptimizer, which divides by it and checks for overflow itself;
3. a step skipped on every rank for non-finite gradients must still lower the scale, or the
   next steps would overflow again: :meth:`LossScaling.report_overflow` takes the inner
   optimizer's own non-finite path with one NaN gradient;
4. with ``sparsify="update"`` each rank first steps on its own gradient: that step goes to the
   optimizer inside the LossScaleOptimizer (:attr:`LossScaling.base_optimizer`), so that the
   scale's count of finite steps moves once a step, on every rank alike (by the job's
   finiteness, not by this rank's); a step in which no variable reaches the LossScaleOptimizer
   counts by :meth:`LossScaling.count_finite_step`.

Without an inner LossScaleOptimizer each of these does nothing.
"""

import keras
import tensorflow as tf


def _times(grad, factor):
    """``grad * factor`` for a dense tensor or the values of an IndexedSlices."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype), grad.indices,
                                grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


def _divided(grad, divisor):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / tf.cast(divisor, grad.values.dtype), grad.indices,
                                grad.dense_shape)
    return grad / tf.cast(divisor, grad.dtype)


class LossScaling:
    """The loss scale of ``inner_optimizer`` if it is a LossScaleOptimizer (else inactive)."""

    def __init__(self, inner_optimizer):
        self.inner_optimizer = inner_optimizer

    @property
    def active(self) -> bool:
        return isinstance(self.inner_optimizer, keras.optimizers.LossScaleOptimizer)

    def scale(self):
        """The current scale (a power of two), or None."""
        return self.inner_optimizer.dynamic_scale if self.active else None

    @property
    def base_optimizer(self):
        """The optimizer that steps the weights: inside the LossScaleOptimizer, or the inner."""
        return self.inner_optimizer.inner_optimizer if self.active else self.inner_optimizer

    def count_finite_step(self):
        """Keras' rule for a step whose gradients were finite on every rank: the
        ``dynamic_growth_steps``-th such step in a row doubles the scale and restarts the count
        (for a step that reached the weights without the LossScaleOptimizer's ``apply``)."""
        if not self.active:
            return
        optimizer = self.inner_optimizer
        due = tf.equal(optimizer.step_counter, optimizer.dynamic_growth_steps - 1)

        def grow():
            optimizer.step_counter.assign(0)
            optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 2.0)

        def count():
            optimizer.step_counter.assign_add(1)

        tf.cond(due, grow, count)

    def unscale(self, grad):
        """Step 1: a true gradient from a scaled one (dense or IndexedSlices)."""
        return _divided(grad, self.scale()) if self.active else grad

    def rescale(self, grads):
        """Step 2: the averaged true gradients as the inner LossScaleOptimizer expects them."""
        if not self.active:
            return grads
        scale = self.scale()
        return [_times(g, scale) for g in grads]

    def report_overflow(self, variables):
        """Step 3: lower the inner optimizer's scale after a step skipped on every rank."""
        if not self.active:
            return
        nan = tf.fill(variables[0].shape, tf.constant(float("nan"), variables[0].dtype))
        self.inner_optimizer.apply([nan] + [None] * (len(variables) - 1), variables)
