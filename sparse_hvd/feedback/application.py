"""Step 5's last part: the step's averages reach the weights.

With ``sparsify="gradient"`` every average is a true gradient and goes to the inner optimizer
(re-scaled for an inner LossScaleOptimizer, which divides by its scale again: exact both
ways; with ``clipping="local"`` its clipping is off, as each rank clipped before the exchange).
With ``sparsify="update"`` the averages of the sparse-route variables are updates, subtracted
(``feedback.local_update``), and only the variables sent whole go to the inner optimizer.
"""

import contextlib

import tensorflow as tf

from . import clipping as clipping_rules
from . import fused_apply, local_update


def apply_averages(opt, grads, variables=None):
    """Apply the averages ``grads`` of ``variables`` (None: every trainable variable, in the
    optimizer's order) as ``opt.sparsify`` says."""
    variables = opt._trainable_variables if variables is None else variables
    # every gradient a tensor of the graph being built (a gradient passed through untouched
    # may be an eager constant the step captured), as Keras' all-reduce hook requires
    grads = [g if isinstance(g, tf.IndexedSlices) else tf.identity(g) for g in grads]
    if opt.sparsify == "update":
        local_update.apply_averages(opt, grads, variables, opt._routes,
                                    lambda g, v: inner_step(opt, g, v),
                                    opt._loss_scaling.count_finite_step)
    else:
        inner_step(opt, grads, variables)


def inner_step(opt, grads, variables):
    """The inner optimizer's step on averaged true gradients: for a plain Keras SGD, Adam or
    AdamW one fused pass per variable (``feedback.fused_apply``, the same bits), else Keras'
    ``apply``."""
    if fused_apply.apply_if_usable(opt, grads, variables):
        return
    with _local_clipping_off(opt):
        opt.inner_optimizer.apply(opt._loss_scaling.rescale(grads), variables)


def own_step(opt, grads, variables):
    """``sparsify="update"``: the inner optimizer's step on this rank's own true gradients
    (known finite), past an inner LossScaleOptimizer: its scale and its count of finite steps
    move once a step, by the job's finiteness, when the averages are applied
    (``feedback.loss_scaling``, step 4)."""
    with _local_clipping_off(opt):
        opt._loss_scaling.base_optimizer.apply(list(grads), variables)


def _local_clipping_off(opt):
    """The inner optimizer's clipping off where each rank clipped before the exchange."""
    if opt.clipping == "local":
        return clipping_rules.switched_off(opt._clipper)
    return contextlib.nullcontext()
