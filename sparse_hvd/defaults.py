"""The defaults that make ``SparseDistributedOptimizer(opt, density=d)`` train like ``opt``.

Top-k with error feedback alone trails dense training by many steps (``docs/steps_to_loss.md``
measures it: on a character LSTM at 1% it never reached dense's mid-run loss in 800 steps).
Two aids of Deep Gradient Compression (Lin et al., ICLR 2018) closed most of that gap in the
measured ablations, so they are on unless the user says otherwise:

1. **Warm-up** (``warmup_steps``, default :data:`WARMUP_STEPS`): a numeric ``density`` below
   :data:`WARMUP_INITIAL_DENSITY` becomes ``WarmupDensity(density, 0.25, warmup_steps)``: the
   density decays exponentially from 25% to ``density`` over the first steps, where gradients
   change fastest. It costs about ``0.15 x warmup_steps`` dense steps' worth of bytes in all
   (the mean density of the decay is 7.5%, and a sparse entry is a value and an index).
   ``warmup_steps=0`` keeps the density constant from the first step.
2. **Momentum correction** (``momentum_correction="auto"``): when the wrapped optimizer is
   ``keras.optimizers.SGD`` with momentum m > 0 (not Nesterov), the wrapper takes the momentum
   over: each rank accumulates its velocity ``u = m u + g`` before selecting, clears it where
   it sent (masking), and the inner SGD's ``momentum`` is set to 0, so the momentum is applied
   once, before the sparsification, not a second time to stale sparse sums. It is the
   momentum that smooths the gradient noise out of what each rank selects. Any other optimizer
   (Adam, ...) and ``momentum_correction=0`` leave the momentum where it is.

Both apply only where they can: not at densities that route every layer densely (0.5 and
above), not with ``staleness`` (which takes no momentum correction), and a density policy
object is used as given. The resolved settings go into ``get_config``, so a saved optimizer
reloads as it ran; a config written before these defaults existed (no ``warmup_steps`` key)
reloads with the constant density it had.
"""

import keras

from .density import ConstantDensity, DensityPolicy, WarmupDensity, get_density_policy

WARMUP_STEPS = 200
WARMUP_INITIAL_DENSITY = 0.25
AUTO = "auto"


def resolve_density(density, warmup_steps) -> DensityPolicy:
    """The density policy for the optimizer's ``density`` and ``warmup_steps`` arguments."""
    policy = get_density_policy(density)
    if warmup_steps is None:
        warmup_steps = WARMUP_STEPS
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"`warmup_steps` must be a non-negative int, got {warmup_steps!r}")
    if (type(policy) is not ConstantDensity or warmup_steps == 0
            or policy.density >= WARMUP_INITIAL_DENSITY):
        return policy
    return WarmupDensity(policy.density, initial_density=WARMUP_INITIAL_DENSITY,
                         warmup_steps=warmup_steps)


def resolve_momentum_correction(momentum_correction, optimizer, policy, staleness):
    """The momentum the wrapper applies itself: ``"auto"`` takes over a plain SGD's momentum
    (setting the inner SGD's to 0; see the module docstring), a number is used as given."""
    if momentum_correction != AUTO:
        return momentum_correction
    takes_over = (isinstance(optimizer, keras.optimizers.SGD)
                  and float(optimizer.momentum) > 0 and not optimizer.nesterov
                  and policy.final_density < 0.5 and not staleness and not optimizer.built)
    if not takes_over:
        return 0.0
    momentum = float(optimizer.momentum)
    optimizer.momentum = 0.0
    return momentum
