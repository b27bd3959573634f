"""``second_moment``: which second moment each worker's Adam divides by under the update cut.

With ``sparsify="update"`` each worker steps Adam on its own gradient, from a batch N times
smaller than the step's. Its noise variance is then N times that of the workers' mean
gradient, which dense Adam sees, so its second moment v is larger than dense Adam's and its
steps smaller where the gradient is mostly noise (up to sqrt(N) smaller). The options:

- ``"own"``: the worker's own v, as Keras' Adam keeps it;
- ``"mean_estimate"``: the part of v that the first moment m does not explain, v - m^2, is taken
  as noise and divided by N (:func:`mean_estimate_factors`);
- ``"noise_estimate"``: the same correction, with what m explains averaged over v's own
  horizon (:class:`SecondMoment`): a mean that was larger a few hundred steps ago, which v
  still holds and m^2 no longer does, is not taken for noise.

The moments themselves stay each worker's own: a correction scales the step, by
``(sqrt(v) + eps) / (sqrt(v_mean) + eps)`` per entry (Keras' Adam steps by
``alpha m / (sqrt(v) + eps)``). With one worker nothing is corrected. A decoupled weight decay
(``AdamW``, or ``Adam(weight_decay=...)``: Keras takes ``w * weight_decay * learning_rate``
from the weights before the moments' step) is not a step of the moments and is not scaled:
it is read before the step (:meth:`SecondMoment.decays`), taken out of the update, and added
back after the correction.
Measured (``docs/steps_to_loss_ablations.md``): under the sign exchange at 4 and 8 workers the
mean estimate closes much of the transformer's gap to dense but slows the LSTM, whose v still
holds the first steps' large gradients; the noise estimate does neither.
"""

from typing import List, NamedTuple

import keras
import tensorflow as tf

from .. import kernels

SECOND_MOMENTS = ("own", "mean_estimate", "noise_estimate")


def estimates_the_mean(optimizer) -> bool:
    """Whether a correction can act on ``optimizer`` (inside a LossScaleOptimizer): a Keras
    Adam (``AdamW`` too) whose moments' step is ``alpha m / (sqrt(v) + epsilon)``, not
    AMSGrad's (whose maximum of the second moments the factor would not know)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return isinstance(optimizer, keras.optimizers.Adam) and not optimizer.amsgrad


def _moments(adam, variable):
    """Adam's (m, v) of ``variable`` after its step and the bias corrections (1 - beta^t)."""
    index = adam._get_variable_index(variable)
    m = tf.convert_to_tensor(adam._momentums[index])
    v = tf.convert_to_tensor(adam._velocities[index])
    t = tf.cast(adam.iterations, v.dtype)  # the step just taken
    first = 1 - tf.pow(tf.cast(adam.beta_1, v.dtype), t)
    second = 1 - tf.pow(tf.cast(adam.beta_2, v.dtype), t)
    return m, v, first, second


def _factor(adam, v, v_mean):
    epsilon = tf.cast(adam.epsilon, v.dtype)
    return (tf.sqrt(v) + epsilon) / (tf.sqrt(v_mean) + epsilon)


def mean_estimate_factors(adam, variables, workers):
    """``second_moment="mean_estimate"``, after the step, per variable:

    1. ``m_hat = m / (1 - beta_1^t)``, ``v_hat = v / (1 - beta_2^t)``;
    2. ``v_mean = (m_hat^2 + max(v_hat - m_hat^2, 0) / N) (1 - beta_2^t)``;
    3. the factor ``(sqrt(v) + eps) / (sqrt(v_mean) + eps)``.
    """
    factors = []
    for variable in variables:
        m, v, first, second = _moments(adam, variable)
        m_hat, v_hat = m / first, v / second
        noise = tf.maximum(v_hat - tf.square(m_hat), 0.0)
        factors.append(_factor(adam, v, (tf.square(m_hat) + noise / workers) * second))
    return factors


class SecondMoment:
    """The chosen correction, and the state ``"noise_estimate"`` keeps: q per variable, the
    beta_2 average of m_hat^2, kept as Keras keeps v (from zero, without a bias correction,
    which would be the same factor for both).

    ``"noise_estimate"``, after the step, per variable:

    1. ``q <- q + (m_hat^2 - q)(1 - beta_2)``: v averages g^2 over the same horizon, so for a
       stationary gradient of mean mu and noise variance s, v = mu^2 + s and
       q = mu^2 + s (1 - beta_1) / (1 + beta_1);
    2. the noise ``s = max(v - q, 0) (1 + beta_1) / (2 beta_1)``;
    3. dense Adam's second moment would be ``mu^2 + s / N = v - s (1 - 1/N)``, and it is at
       least ``v / N``: ``v_mean = max(v - s (1 - 1/N), v / N)``;
    4. the factor ``(sqrt(v) + eps) / (sqrt(v_mean) + eps)``.

    q is each worker's own, like Adam's moments: ``share_residuals`` and ``exchange="auto"``'s
    dense step average it with them (``local_update.own_state``).
    """

    def __init__(self, kind: str):
        self.kind = kind
        self.variables: List[keras.Variable] = []  # "noise_estimate": q per variable

    def build(self, optimizer, var_list):
        """Create q as variables of ``optimizer`` (in the checkpoint after the residuals'
        worker count; none unless ``"noise_estimate"``), which also writes them."""
        self.writer = optimizer
        if self.kind == "noise_estimate":
            self.variables = [optimizer.add_variable_from_reference(v, name="explained_moment")
                              for v in var_list]

    def start_from(self, adam):
        """q after a checkpoint without it: Adam's v, so that the step starts as ``"own"`` (no
        noise found) and the estimate forms over v's horizon, as from the first step."""
        for q, velocity in zip(self.variables, adam._velocities):
            self.writer.assign(q, velocity)

    def decays(self, adam, variables, weights, workers):
        """Per variable, the :class:`Decay` that ``adam``'s decoupled weight decay takes from
        its ``weights`` in the step about to be taken (its learning rate is this step's: read
        it before the step counts itself); None where it takes nothing (no weight decay, a
        variable excluded from it) or where nothing is corrected."""
        if self.kind == "own" or workers == 1 or not adam.weight_decay:
            return [None] * len(variables)
        rate = adam.learning_rate
        return [Decay(w, tf.cast(adam.weight_decay, w.dtype), tf.cast(rate, w.dtype))
                if adam._use_weight_decay(variable) else None
                for variable, w in zip(variables, weights)]

    def corrected(self, adam, updates, variables, workers, index_of, decays=None):
        """``updates`` (Adam's steps of ``variables`` just taken, weight decay included) with
        the second moment corrected; ``index_of(variable)``: its build index (which q is
        its); ``decays``: :meth:`decays` read before the step, kept out of the correction
        (``(update - d) * factor + d``)."""
        if self.kind == "own" or workers == 1:
            return updates
        decays = decays or [None] * len(updates)
        if self.kind == "noise_estimate":
            return [self._noise_estimate(adam, u, variable, workers, index_of(variable), d)
                    for u, variable, d in zip(updates, variables, decays)]
        factors = mean_estimate_factors(adam, variables, workers)
        return [u * f if d is None else d.kept_out(u, f)
                for u, f, d in zip(updates, factors, decays)]

    def restarted_if(self, adam, condition):
        """q made Adam's v (as :meth:`start_from`) where the boolean tensor ``condition``
        holds; returns a tensor to order the step after. ``exchange="auto"`` asks it before a
        sparse step that follows a chosen dense phase: there each worker's Adam stepped on
        the averaged gradient, with one state shared by the ranks, and q stood still (following
        it would cost each dense step several passes over the model), so the q of the phase's
        start no longer matches v. With q = v the noise reads zero, which v, fresh from the
        averaged gradient, nearly holds, and the estimate forms again over v's horizon."""
        if self.kind != "noise_estimate":
            return tf.constant(False)

        def restart():
            self.start_from(adam)
            return tf.constant(True)

        return tf.cond(condition, restart, lambda: tf.constant(False))

    def _noise_estimate(self, adam, update, variable, workers, index, decay):
        """Steps 1-4 for one variable: writes its q, returns its corrected update."""
        m, v, first, _ = _moments(adam, variable)
        q = self.variables[index]
        corrected, explained = noise_estimate_step(
            update, m, v, tf.convert_to_tensor(q), first, adam.beta_1, adam.beta_2,
            adam.epsilon, workers, decay)
        self.writer.assign(q, explained)
        return corrected


class Decay(NamedTuple):
    """What a decoupled weight decay (``AdamW``) takes from the weights in a step, as Keras
    computes it: ``(weights * weight_decay) * learning_rate`` (:meth:`amount`), the scalars in
    the weights' dtype."""

    weights: tf.Tensor
    weight_decay: tf.Tensor
    learning_rate: tf.Tensor

    def amount(self):
        return self.weights * self.weight_decay * self.learning_rate

    def kept_out(self, update, factor):
        """``update`` (which holds this decay) with only its other part scaled by ``factor``."""
        taken = self.amount()
        return (update - taken) * factor + taken


def noise_estimate_step(update, m, v, q, first, beta_1, beta_2, epsilon, workers, decay=None):
    """:class:`SecondMoment`'s steps 1-4 on tensors: (the corrected ``update``, q after the
    step); ``first`` = 1 - beta_1^t; ``decay``: the :class:`Decay` the update holds, kept out
    of the correction, or None. On CPU in one native pass (``kernels/noise_estimate.cc``, the
    decay too), elsewhere by the same float32 operations in the same order."""
    # the scalars in float64 before the cast, as Keras' Adam takes 1 - beta_2 (1 - 0.999 in
    # float32 is 1.3e-5 off)
    inv_first = tf.cast(1 / tf.cast(first, tf.float64), v.dtype)
    one_minus_beta_2, stationary, shrink, count, eps = (tf.constant(c, v.dtype) for c in (
        1 - beta_2, (1 + beta_1) / (2 * beta_1), 1 - 1 / workers, workers, epsilon))
    native = kernels.noise_estimate() if v.dtype == update.dtype == tf.float32 else None
    if native is not None:
        zero = tf.zeros([], v.dtype)
        weights, weight_decay, rate = decay if decay is not None else (
            tf.zeros([0], v.dtype), zero, zero)
        return native(update, m, v, q, weights, tf.stack(
            [inv_first, one_minus_beta_2, stationary, shrink, count, eps, weight_decay, rate]))
    m_hat = m * inv_first
    explained = q + (m_hat * m_hat - q) * one_minus_beta_2
    noise = tf.maximum(v - explained, 0.0) * stationary
    v_mean = tf.maximum(v - noise * shrink, v / count)
    factor = (tf.sqrt(v) + eps) / (tf.sqrt(v_mean) + eps)
    if decay is None:
        return update * factor, explained
    return decay.kept_out(update, factor), explained
