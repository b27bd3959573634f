"""Density policies: how many entries of each variable's gradient a worker may send this step.

A policy answers ``k(index, num_elements, step)`` for the variable at ``index`` (its position in
the optimizer's build order) with a Python int or an int32 scalar tensor, always in
[1, num_elements]. Every rank must get the same answer, so a policy may depend only on the step
(identical on every rank after the initial broadcast) and on state that is itself identical on
every rank.

* :class:`ConstantDensity`: ``k = ceil(density * n)``, the default (a float ``density`` given to
  the optimizer means this);
* :class:`WarmupDensity`: starts dense-ish and decays exponentially to the target density over
  a number of steps, as Deep Gradient Compression does over its first epochs (Lin et al. 2018):
  early gradients change fast, and sending more of them at first avoids a slow start.

``density`` values are read as the decimal the user wrote (0.07 of 100 entries is 7, not the 8
that binary floating point would give from 7.000000000000001).
"""

import math
import numbers
from fractions import Fraction

import tensorflow as tf


def validate_density(density, argument="density"):
    """``density`` as a float in (0, 1]; a TypeError/ValueError naming ``argument`` otherwise."""
    if isinstance(density, bool) or not isinstance(density, numbers.Real):
        raise TypeError(f"`{argument}` must be a number in (0, 1], got {type(density).__name__}")
    density = float(density)
    if not (0.0 < density <= 1.0) or math.isnan(density):
        raise ValueError(
            f"`{argument}` must be in (0, 1] (the fraction of each gradient to send), got {density}"
        )
    return density


def elements_to_send(num_elements: int, density: float) -> int:
    """k = ceil(density * num_elements), clamped to [1, num_elements]."""
    k = math.ceil(Fraction(repr(float(density))) * num_elements)
    return max(1, min(int(num_elements), k))


class DensityPolicy:
    """Base class: a per-variable, per-step entry budget with a Keras-style config."""

    #: the density the policy settles at; decides which variables are worth sparsifying at all
    final_density: float
    #: the policy relies on the layer-wise exchange (the optimizer warns without it)
    requires_layerwise = False
    #: the policy can size a step whose exchange is applied tau steps later (``staleness``)
    supports_staleness = True

    def k(self, index: int, num_elements: int, step):
        raise NotImplementedError

    def current_density(self, index: int, step) -> float:
        """The density asked of variable ``index`` at ``step`` (for statistics)."""
        return self.final_density

    def measurement_bytes(self) -> int:
        """Bytes this rank has sent for the policy's own measurements (probes), not gradients."""
        return 0

    # Hooks for policies that measure the running job (see sparse_hvd.selection.adaptive); no-ops here.

    def prepare(self, optimizer, variables, routes):
        """Called once from the optimizer's ``build``, eagerly, on every rank."""

    def gradient_ready(self, index: int, grad):
        """Called in the step for each variable's gradient, in the order they are processed."""

    def end_step(self, step):
        """Called in the step after every gradient has been seen."""

    def get_config(self) -> dict:
        raise NotImplementedError

    @classmethod
    def from_config(cls, config):
        return cls(**config)


class ConstantDensity(DensityPolicy):
    """The same density for every variable at every step."""

    def __init__(self, density=0.01):
        self.density = validate_density(density)
        self.final_density = self.density

    def k(self, index, num_elements, step):
        return elements_to_send(num_elements, self.density)

    def get_config(self):
        return {"density": self.density}


class WarmupDensity(DensityPolicy):
    """Exponential decay from ``initial_density`` to ``density`` over ``warmup_steps`` steps.

    density(t) = initial * (density / initial) ** (min(t, warmup_steps) / warmup_steps), so
    each step multiplies the density by the same factor; from ``warmup_steps`` on it is
    ``density``. With DGC's schedule (25% -> 0.1% over 4 epochs) pass initial_density=0.25 and
    warmup_steps=4 * steps_per_epoch.
    """

    def __init__(self, density=0.01, initial_density=0.25, warmup_steps=1000):
        self.final_density = validate_density(density)
        self.initial_density = validate_density(initial_density, "initial_density")
        if self.initial_density < self.final_density:
            raise ValueError(
                f"`initial_density` ({self.initial_density}) must be >= `density` ({self.final_density})"
            )
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"`warmup_steps` must be a positive int, got {warmup_steps!r}")
        self.warmup_steps = warmup_steps

    def _density_at(self, step):
        progress = tf.minimum(tf.cast(step, tf.float64) / self.warmup_steps, 1.0)
        ratio = self.final_density / self.initial_density
        return self.initial_density * tf.pow(tf.constant(ratio, tf.float64), progress)

    def k(self, index, num_elements, step):
        final_k = elements_to_send(num_elements, self.final_density)
        k = tf.cast(tf.math.ceil(self._density_at(step) * num_elements - 1e-9), tf.int32)
        # From warmup_steps on the result is exactly the constant policy's k.
        k = tf.where(tf.cast(step, tf.int64) >= self.warmup_steps, final_k, k)
        return tf.clip_by_value(k, 1, num_elements)

    def current_density(self, index, step):
        return float(self._density_at(step))

    def get_config(self):
        return {
            "density": self.final_density,
            "initial_density": self.initial_density,
            "warmup_steps": self.warmup_steps,
        }


class DenseStart(DensityPolicy):
    """Every entry for the first ``dense_steps`` steps, then ``density``.

    The dense phase of Ok-Topk (its first 512 iterations) and of PyTorch's PowerSGD hook
    (``start_powerSGD_iter``): the first steps, where gradients change fastest, are exchanged
    whole, and the sparse phase starts from the dense trajectory with empty residuals (a step
    that sends everything leaves nothing behind).
    """

    def __init__(self, density=0.01, dense_steps=100):
        self.final_density = validate_density(density)
        if isinstance(dense_steps, bool) or not isinstance(dense_steps, int) or dense_steps < 0:
            raise ValueError(f"`dense_steps` must be a non-negative int, got {dense_steps!r}")
        self.dense_steps = dense_steps

    def k(self, index, num_elements, step):
        final_k = elements_to_send(num_elements, self.final_density)
        return tf.where(tf.cast(step, tf.int64) < self.dense_steps, num_elements, final_k)

    def current_density(self, index, step):
        return 1.0 if int(step) < self.dense_steps else self.final_density

    def get_config(self):
        return {"density": self.final_density, "dense_steps": self.dense_steps}


_POLICIES = {"constant": ConstantDensity, "warmup": WarmupDensity, "dense_start": DenseStart}


def register_density_policy(name, cls):
    """Make ``cls`` (a DensityPolicy subclass) serialisable under ``name``."""
    if name in _POLICIES and _POLICIES[name] is not cls:
        raise ValueError(f"a density policy named {name!r} already exists")
    _POLICIES[name] = cls
    return cls


def get_density_policy(spec) -> DensityPolicy:
    """A policy from a number (constant density), a DensityPolicy, or a serialised config."""
    if isinstance(spec, DensityPolicy):
        return spec
    if isinstance(spec, dict) and spec.get("class_name") in _POLICIES:
        return _POLICIES[spec["class_name"]].from_config(spec.get("config", {}))
    if isinstance(spec, dict):
        raise ValueError(
            f"Unknown density policy {spec.get('class_name')!r}; available: {', '.join(sorted(_POLICIES))}"
        )
    return ConstantDensity(spec)


def serialize_density_policy(policy: DensityPolicy):
    """A float for a constant density (as the user wrote it), else a {class_name, config} dict."""
    if type(policy) is ConstantDensity:
        return policy.density
    for name, cls in _POLICIES.items():
        if type(policy) is cls:
            return {"class_name": name, "config": policy.get_config()}
    raise TypeError(f"cannot serialise density policy {type(policy).__name__}: not a sparse_hvd policy")
