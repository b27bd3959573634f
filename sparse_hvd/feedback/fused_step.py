"""The update cut's local step for a plain Keras ``Adam``, ``AdamW`` or ``SGD`` in one native
pass per variable (``kernels/local_step.cc``), where :func:`local_update.local_updates`
otherwise runs Keras' step as TensorFlow operations and takes the update back from the
weights.

Why: measured with ``scripts/benchmarks/profile_step.py --inner adam --exchange sign
--budget default`` (2 workers, the 4.35M-parameter MLP), Keras' step of the largest variable
and the update cut's passes around it (a copy of the weights, the difference, the weights
written back) took about 22 ms of a 65 ms step: about fifteen passes over the variable,
each a TensorFlow op of its own. The native pass reads the gradient, the optimizer's state
and the weights once and writes the new state and the update once, and says whether the
update is finite (so no pass over the gradient comes first: the state is written only if it
is, ``local_update``); with
``second_moment="noise_estimate"`` it corrects Adam's update and writes q in the same pass.
Weights, the step count and the learning rate schedule are not touched (the update cut takes
them back anyway).

The same float32 operations in Keras' order (``update_step`` of ``keras.optimizers.Adam``
and ``SGD``, and the base optimizer's ``_apply_weight_decay``), so both paths give the same
bits (tested); the scalars (alpha, 1 - beta) are computed by TensorFlow as Keras computes
them.

It is used only where it is Keras' step exactly; anything else takes Keras' path:
exactly ``keras.optimizers.Adam``, ``AdamW`` or ``SGD`` (a subclass may change the step),
Adam without AMSGrad, no gradient accumulation or loss-scale factor, Python numbers for the
betas, epsilon and the momentum, no clipping of its own in the step (or ``clipping="local"``,
which turns it off), float32 variables and gradients without constraints, ``second_moment``
"own" or "noise_estimate" (or one worker), and the native kernels in use (never with a GPU
visible).
"""

from typing import Callable, List, NamedTuple, Optional

import keras
import tensorflow as tf

from .. import kernels
from . import clipping as clipping_rules

_PLAIN_ADAMS = (keras.optimizers.Adam, keras.optimizers.AdamW)
_NUMBERS = (int, float)


def _float32(value) -> tf.Tensor:
    """A Python number as Keras' ops take it beside a float32 tensor: rounded once to float32
    (1 - 0.999 computed in float64 first)."""
    return tf.constant(value, tf.float32)


def usable(opt, inner, grads, variables, workers) -> bool:
    """Whether the fused step is Keras' step for ``inner`` (the base optimizer) on these
    gradients and variables (the module's list), and the native op is there."""
    if type(inner) in _PLAIN_ADAMS:
        if not plain_adam(inner):
            return False
        if opt._second_moment.kind not in ("own", "noise_estimate") and workers > 1:
            return False
        native = kernels.local_adam
    elif type(inner) is keras.optimizers.SGD:
        if not isinstance(inner.momentum, _NUMBERS):
            return False
        native = kernels.local_sgd
    else:
        return False
    if not plain_step_inputs(opt, inner, grads, variables):
        return False
    if any(getattr(variable, "constraint", None) is not None for variable in variables):
        return False
    return native() is not None


def plain_adam(inner) -> bool:
    """Whether ``inner`` is exactly Keras' ``Adam`` or ``AdamW`` without AMSGrad, with Python
    numbers for its betas and epsilon (the native pass's step)."""
    return type(inner) in _PLAIN_ADAMS and not inner.amsgrad and all(
        isinstance(getattr(inner, name), _NUMBERS) for name in ("beta_1", "beta_2", "epsilon"))


def plain_step_inputs(opt, inner, grads, variables, dtypes=("float32",)) -> bool:
    """What a fused step needs besides the optimizer's kind: no gradient accumulation or
    loss-scale factor, no clipping of the inner optimizer's own in the step (or
    ``clipping="local"``, which turns it off), and dense gradients of variables of
    ``dtypes`` (each gradient of its variable's dtype), none overwritten by its gradient."""
    if inner.gradient_accumulation_steps or inner.loss_scale_factor is not None:
        return False
    clips = any(getattr(inner, option, None) is not None for option in clipping_rules.OPTIONS)
    if clips and not (opt.clipping == "local" and opt._clipper is inner):
        return False
    if len(grads) != len(variables):
        return False
    for gradient, variable in zip(grads, variables):
        if variable.dtype not in dtypes or not isinstance(gradient, tf.Tensor):
            return False
        if gradient.dtype != tf.as_dtype(variable.dtype):
            return False
        if getattr(variable, "overwrite_with_gradient", False):
            return False
    return True


def _decayed(inner, variable) -> bool:
    """Whether Keras' ``_apply_weight_decay`` takes from ``variable`` in this step."""
    return inner.weight_decay is not None and inner._use_weight_decay(variable)


class LocalSteps(NamedTuple):
    """The native passes' results, nothing written yet: each variable's ``updates``, whether
    every update is ``finite`` (a bool tensor: a NaN or infinity in a gradient makes its update
    non-finite, ``kernels/local_step.cc``), and ``write_state()``, which assigns the optimizer
    state the passes computed (the caller does only where ``finite``)."""

    updates: List[tf.Tensor]
    finite: tf.Tensor
    write_state: Callable[[], None]


class SgdInputs(NamedTuple):
    """What the native SGD ops take for one variable besides its gradient: the velocity
    variable (None without momentum), the velocity and the weights flat (an empty velocity
    without momentum), and the coefficients [learning rate, momentum, decayed, decay]."""

    velocity: Optional[keras.Variable]
    flat_velocity: tf.Tensor
    flat_weights: tf.Tensor
    coefficients: tf.Tensor


def sgd_inputs(inner, variables) -> List[SgdInputs]:
    """Each variable's :class:`SgdInputs` for a plain SGD's step now (this step's learning
    rate: the count is not moved), as Keras' step would take them."""
    rate = tf.cast(inner.learning_rate, tf.float32)
    momentum = tf.cast(inner.momentum, tf.float32)
    decay = tf.cast(inner.weight_decay or 0.0, tf.float32)
    inputs = []
    for variable in variables:
        velocity = (inner.momentums[inner._get_variable_index(variable)]
                    if inner.momentum != 0 else None)
        inputs.append(SgdInputs(
            velocity, tf.reshape(velocity, [-1]) if velocity is not None else tf.zeros([0]),
            tf.reshape(variable, [-1]),
            tf.stack([rate, momentum, _float32(float(_decayed(inner, variable))), decay])))
    return inputs


def sgd_steps(inner, grads, variables) -> LocalSteps:
    """Steps 1-3 of :func:`local_update.local_updates` for a plain SGD by the native pass: per
    variable this rank's update, and the momentum's velocity to write."""
    native = kernels.local_sgd()
    updates, flags, writes = [], [], []
    for gradient, variable, given in zip(grads, variables, sgd_inputs(inner, variables)):
        update, kept, finite = native(tf.reshape(gradient, [-1]), given.flat_velocity,
                                      given.flat_weights, given.coefficients,
                                      nesterov=bool(inner.nesterov))
        if given.velocity is not None:
            writes.append((inner, given.velocity, tf.reshape(kept, variable.shape)))
        updates.append(tf.reshape(update, variable.shape))
        flags.append(finite)
    return LocalSteps(updates, tf.reduce_all(flags), lambda: assign_all(writes))


def assign_all(writes):
    """Each (optimizer, variable, value): the optimizer's ``assign`` (Keras' rule)."""
    for optimizer, variable, value in writes:
        optimizer.assign(variable, value)


def adam_scalars(adam):
    """This step's learning rate, Adam's alpha (``lr sqrt(1 - beta_2^t) / (1 - beta_1^t)``)
    and 1 - beta_1^t, in float32 by Keras' ``update_step``'s operations (the count not yet
    moved)."""
    rate = tf.cast(adam.learning_rate, tf.float32)
    t = tf.cast(adam.iterations + 1, tf.float32)
    beta_1_power = tf.pow(tf.cast(adam.beta_1, tf.float32), t)
    beta_2_power = tf.pow(tf.cast(adam.beta_2, tf.float32), t)
    alpha = rate * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)
    return rate, alpha, 1 - beta_1_power


def adam_apply_coefficients(adam) -> tf.Tensor:
    """The coefficients of the in-place step on averaged gradients (``SparseHvdApplyAdam``,
    ``fused_apply``): 1 - beta_1 and 1 - beta_2 (Python's differences, then float32, as
    Keras' ``update_step`` takes them), alpha, epsilon."""
    _, alpha, _ = adam_scalars(adam)
    return tf.stack([_float32(1 - adam.beta_1), _float32(1 - adam.beta_2), alpha,
                     _float32(adam.epsilon)])


def adam_steps(opt, adam, grads, variables, workers) -> LocalSteps:
    """Steps 1-3 of :func:`local_update.local_updates` for a plain Adam by the native pass:
    per variable, this rank's update (corrected by the noise estimate where
    ``second_moment`` asks), and Adam's m and v (and q) to write."""
    native = kernels.local_adam()
    second_moment = opt._second_moment
    correct = second_moment.kind == "noise_estimate" and workers > 1
    rate, alpha, first = adam_scalars(adam)  # first: as second_moment._moments reads it
    inv_first = tf.cast(1 / tf.cast(first, tf.float64), tf.float32)
    decay = tf.cast(adam.weight_decay or 0.0, tf.float32)
    updates, flags, writes = [], [], []
    for gradient, variable in zip(grads, variables):
        index = adam._get_variable_index(variable)
        decayed = _decayed(adam, variable)
        # second_moment.decays: the correction keeps out a decay that takes something
        kept_out = correct and bool(adam.weight_decay) and decayed
        coefficients = tf.stack([
            _float32(1 - adam.beta_1), _float32(1 - adam.beta_2), alpha, _float32(adam.epsilon),
            _float32(float(decayed)), decay, rate, _float32(float(kept_out)), inv_first,
            _float32((1 + adam.beta_1) / (2 * adam.beta_1)), _float32(1 - 1 / workers),
            _float32(workers)])
        q = second_moment.variables[opt._get_variable_index(variable)] if correct else None
        update, m, v, explained, finite = native(
            tf.reshape(gradient, [-1]), tf.reshape(adam._momentums[index], [-1]),
            tf.reshape(adam._velocities[index], [-1]), tf.reshape(variable, [-1]),
            tf.reshape(q, [-1]) if q is not None else tf.zeros([0]), coefficients,
            correct=correct)
        writes.append((adam, adam._momentums[index], tf.reshape(m, variable.shape)))
        writes.append((adam, adam._velocities[index], tf.reshape(v, variable.shape)))
        if q is not None:
            writes.append((second_moment.writer, q, tf.reshape(explained, variable.shape)))
        updates.append(tf.reshape(update, variable.shape))
        flags.append(finite)
    return LocalSteps(updates, tf.reduce_all(flags), lambda: assign_all(writes))


def steps_if_usable(opt, inner, grads, variables, workers) -> Optional[LocalSteps]:
    """The native passes' :class:`LocalSteps` where :func:`usable` (nothing written: the
    state by ``write_state()``, the weights and the step count never), else None (Keras'
    path)."""
    if not usable(opt, inner, grads, variables, workers):
        return None
    if type(inner) is keras.optimizers.SGD:
        return sgd_steps(inner, grads, variables)
    return adam_steps(opt, inner, grads, variables, workers)
