"""Dense chosen after sparse steps, under the update cut: the residuals sent and the inner
state shared between two steps by a small function of their own, not by a train step traced
for that one step (``exchange="auto"`` with a function per mode, ``traced_choice``).

The flush (``plan_step``, way 3) is one step, yet traced as a whole train step (the model's
forward and backward passes, every variable's exchange): with 4 ranks on 2 cores its trace
and first run took 2.7-4.3 s on the wide CNN, against a step of 0.09 s, in every run on the
emulated 10 Gbit/s cluster where dense was chosen after a trial's sparse steps
(``docs/time_to_loss_10gbit_epyc_fast_400.md``). Here, on every rank, before the step that
would have flushed:

1. each cut variable's residual is averaged over the ranks (one fused allreduce per dtype)
   and that mean, times the factor the flush would have taken (``update_scale``,
   ``feedback.step_factor``), is subtracted from the variable (then its constraint); the
   residual becomes zero;
2. the inner state becomes the mean over the ranks (``local_update.share_own_state``);
3. the residuals are clear and the state shared (``clear``, ``own_state``), so the step runs
   dense's plain function (way 1), already traced: Horovod's step, the inner optimizer once on
   the averaged gradient.

What the model receives is what way 3 sends: the residuals' mean, at the same factor, and
every rank's step. Way 3 averages each rank's own step from its own state (at the factor) and
then shares the state; here the state is shared first and stepped once on the averaged
gradient (Horovod's step, at the rate): for SGD with or without momentum, whose step is linear
in its state and gradient, the same but for the factor, and Horovod's step for any other
optimizer. Every rank reads the same variables before the same call, so every rank runs it
(its collectives) at once. Measured with the first decision forced to dense on the emulated 1
Gbit/s cluster, the step after the decision took 1.5-1.6 s against 3.6-5.5 s
(``docs/time_to_loss_flush_between_1gbit.md``); at 10 Gbit/s, 0.6-0.9 s against 2.0-2.5 s.

Only where way 3 holds nothing else: the update cut (the gradient cut's residual is a
gradient, which only the inner optimizer's step can apply), no 16-bit values (way 3 keeps
the rounding error), no momentum correction, no accumulation of backward passes (the flush
would land between the passes of one step), and not before the first step after a restore
(which scales restored residuals to the job's worker count first). Elsewhere the flush stays
in its traced step.
"""

import tensorflow as tf

from ..feedback import local_update
from ..runtime import collectives


BETWEEN_STEPS = True  # False: every flush in its traced step (the previous releases)


def usable(step) -> bool:
    """Whether the flush of ``step`` (a ``MeasuredChoiceStep``) can run between its steps."""
    opt = step.optimizer
    return (BETWEEN_STEPS and step.dense_index is not None and opt.sparsify == "update"
            and not opt._compression.enabled and not opt.momentum_correction
            and opt.backward_passes_per_step == 1 and not opt._feedback.restored)


def flush(step):
    """Steps 1-3, eager, on every rank (traced once, at the job's first such flush)."""
    function = getattr(step, "_flush_between", None)
    if function is None:
        function = step._flush_between = tf.function(lambda: _flushed(step), autograph=False)
    function()


def _flushed(step):
    opt = step.optimizer
    routes = step.plans[step.dense_index].routes
    cut = []  # (variable, residual) of each cut variable
    if opt._feedback.enabled:
        for variable in opt._trainable_variables:
            index = opt._get_variable_index(variable)
            if routes[index].flushed:
                cut.append((variable, opt._feedback.residuals[index]))
    scale = opt._step_factor.on_step(opt, True) if cut else 1.0
    # in a tf.function the writes run in this order (its automatic control dependencies)
    means = collectives.means_by_dtype([tf.convert_to_tensor(r) for _, r in cut],
                                       f"{opt._prefix}.auto.flush_between",
                                       process_set=opt.process_set)
    for (variable, residual), mean in zip(cut, means):
        taken = tf.cast(scale, mean.dtype) * tf.reshape(mean, variable.shape)
        opt.assign_sub(variable, tf.cast(taken, variable.dtype))
        if getattr(variable, "constraint", None) is not None:
            opt.assign(variable, variable.constraint(variable))
        residual.assign(tf.zeros_like(residual))
    local_update.share_own_state(opt, f"{opt._prefix}.auto.share_between")
    step.clear.assign(True)
    step.own_state.assign(False)
