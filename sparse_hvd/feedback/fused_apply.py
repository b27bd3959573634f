"""The inner optimizer's step on averaged gradients in one pass per variable, for a plain
Keras SGD, Adam or AdamW.

Where the inner optimizer steps on averaged gradients (every dense step of
``exchange="dense"`` or of an ``"auto"`` that chose dense, the gradient cut's step, the
variables sent whole), Keras 3 runs its step as separate operations, each a pass over the
variable: SGD with momentum five (``m * momentum``, ``g * lr``, their difference, the
velocity's assignment, the weights' ``assign_add``), Adam about a dozen. Here:

* **SGD**: TensorFlow's own training ops do the same arithmetic in one pass, in place:
  ``ResourceApplyKerasMomentum`` (``accum = accum * momentum - grad * lr``, then ``var +=
  accum``, or with Nesterov ``var += accum * momentum - grad * lr``) and
  ``ResourceApplyGradientDescent`` (``var -= lr * grad``) without momentum. On every device
  TensorFlow has them for (CPU and GPU).
* **Adam, AdamW**: ``SparseHvdApplyAdam`` (``kernels/apply_adam.cc``): m, v and the
  weights from one read of each, written back in place under the variables' locks, as
  TensorFlow's training ops write (not TensorFlow's own ``ResourceApplyAdam``, which rounds
  1 - beta_1 differently from Keras); CPU only (the native kernels), Keras' path on a GPU.
  Its first form wrote three new tensors a step, and a job's first ~8 dense steps
  page-faulted while the allocator's pool grew (0.3-1.5 s against 0.1 s a step:
  ``scripts/benchmarks/probe_first_steps.py``).

The same float operations in Keras' order, so the same bits as Keras' path on a CPU (tested).
Everything else of Keras' ``apply`` is Keras' own code, in its order: the weight decay
(``_apply_weight_decay``: Adam's pass can decay too, and gives Keras' bits eagerly, but in a
traced step Keras' decay came out one unit apart from it in 3 of 21,000 entries, a graph
rewrite of its products, so Keras' own ops run), the step, the moving average of the weights
(``use_ema``), the constraints, the step count.

Why: measured with ``scripts/benchmarks/profile_step.py --exchange dense`` (2 workers on
loopback, the 4.35M-parameter MLP, SGD momentum 0.9), Keras' SGD step took about 17 ms of a
129 ms step in six ops, where the dense allreduce's own work (the division and the check of
the sums) took 4.3 ms; a single-process probe of the 2048x2048 layer: Keras' step 9.6 ms,
the fused op 3.8 ms (with Nesterov 12.7 against 4.1). With Adam the wrapper's dense step went
from 1.05x a user's own allreduce step to 0.84x (``bench_step.py --inner adam``,
``docs/step_cost_fused_apply.md``).

Used only where this is Keras' step exactly: exactly ``keras.optimizers.SGD`` (a subclass may
change the step) with a Python number for the momentum, or what :func:`fused_step.plain_adam`
accepts, and what :func:`fused_step.plain_step_inputs` asks (no gradient accumulation,
loss-scale factor or clipping of its own in the step; dense gradients; float32 or float64
for SGD, float32 for Adam).
"""

import keras
import tensorflow as tf

from .. import kernels
from . import fused_step, local_update

SGD_DTYPES = ("float32", "float64")


def usable(opt, inner, grads, variables) -> bool:
    """Whether the fused step is Keras' step of ``inner`` on these gradients and variables."""
    if type(inner) is keras.optimizers.SGD and isinstance(inner.momentum, (int, float)):
        return fused_step.plain_step_inputs(opt, inner, grads, variables, SGD_DTYPES)
    if fused_step.plain_adam(inner) and kernels.apply_adam() is not None:
        return fused_step.plain_step_inputs(opt, inner, grads, variables)
    return False


def apply_if_usable(opt, grads, variables) -> bool:
    """Apply the inner optimizer's step to ``variables`` from the averaged gradients ``grads``
    by the fused ops and return True where :func:`usable`; else do nothing and return False
    (the caller runs Keras' ``apply``)."""
    inner = opt.inner_optimizer
    grads, variables = list(grads), list(variables)
    if not grads or not usable(opt, inner, grads, variables):
        return False
    grads = [tf.reshape(g, v.shape) for g, v in zip(grads, variables)]
    with tf.name_scope(inner.name):
        inner._apply_weight_decay(variables)
        if type(inner) is keras.optimizers.SGD:
            rate = inner.learning_rate  # this step's: read before the count moves, as Keras'
            for gradient, variable in zip(grads, variables):
                _sgd_step(inner, gradient, variable, rate)
        else:
            _adam_steps(inner, grads, variables)
        if inner.use_ema:
            local_update.moving_average_step(inner)
        for variable in variables:
            if variable.constraint is not None:
                variable.assign(variable.constraint(variable))
        inner.iterations.assign_add(1)
    return True


def _sgd_step(inner, gradient, variable, rate):
    """Keras' ``SGD.update_step`` of one variable in one op."""
    # the scalars by Keras' own casts (its momentum goes through float32 even for float64)
    rate = keras.ops.cast(rate, variable.dtype)
    if inner.momentum == 0:
        tf.raw_ops.ResourceApplyGradientDescent(var=variable.handle, alpha=rate, delta=gradient)
        return
    velocity = inner.momentums[inner._get_variable_index(variable)]
    tf.raw_ops.ResourceApplyKerasMomentum(
        var=variable.handle, accum=velocity.handle, lr=rate, grad=gradient,
        momentum=keras.ops.cast(inner.momentum, variable.dtype), use_nesterov=bool(inner.nesterov))


def _adam_steps(inner, grads, variables):
    """Keras' ``Adam.update_step`` of every variable, one native pass each, in place (the
    step's finiteness was checked on the averages before)."""
    native = kernels.apply_adam()
    coefficients = fused_step.adam_apply_coefficients(inner)
    for gradient, variable in zip(grads, variables):
        index = inner._get_variable_index(variable)
        native(variable=variable.handle, m=inner._momentums[index].handle,
               v=inner._velocities[index].handle, gradient=gradient, coefficients=coefficients)
