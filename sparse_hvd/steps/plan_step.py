"""One step of ``exchange="auto"`` with one candidate's plan (``sparse_hvd.steps.measured``):
the synchronous step with the plan's exchange and routes, ending in a timestamp.

A sparse candidate's step is the synchronous step with its exchange. Dense's step sends every
sparse-route variable whole, in one of three ways, chosen in the graph by the same variables
on every rank (so every rank runs the same branch and its collectives):

1. **clear** (the variable ``clear``: a dense step already sent the residuals and no sparse
   step ran since): plain dense routes, Horovod's step (one condition around dense's
   allreduce; measured, it costs nothing there);
2. **held**, in a trial's dense turn while the residuals are not clear (``Route.held``): each
   variable's gradient travels alone and its residual waits for the sparse steps after the
   trial. A flush costs a transformer's convergence that the next 100 steps only partly
   repair (``docs/steps_to_loss_ablations.md``), and a trial that dense loses should leave
   training where it was;
3. **flushed**, when dense was chosen (``Route.flushed``): each compensated gradient (with the
   update cut: each rank's step plus its residual) travels and the residuals are cleared, so
   nothing owed is lost; then ``clear``.

With ``sparsify="update"`` the inner optimizer's state is each rank's own after sparse steps;
before a held turn's first step, and after a flush, it is made the mean over the ranks
(``local_update.share_own_state``), so that the dense steps after it hand the averaged
gradient to one state, as Horovod's step does: no local step, no weight copies. The variable
``own_state`` says whether that is due (a sparse step or a restore since the last time). The
first sparse step after a chosen dense phase (``clear``) starts the noise estimate's q anew
from Adam's v (``SecondMoment.restarted_if``): it stood still while dense ran.
"""

import tensorflow as tf

from ..feedback import local_update
from .strategies import SynchronousStep


def plan_step(step, plan, grads_and_vars, trial_step):
    """The step of ``step`` (a ``MeasuredChoiceStep``) with ``plan``, as a callable for a
    ``tf.switch_case`` branch: ``(its end's timestamp, its exchange's seconds)``.
    ``trial_step``: a boolean tensor, whether this step is a trial's step of this plan."""
    opt = step.optimizer
    update_cut = opt.sparsify == "update"

    def run_with(routes):
        saved = opt._exchange, opt._routes
        opt._exchange, opt._routes = plan.exchange, routes
        step._exchange_seconds = None
        try:
            went_ahead = SynchronousStep.run(step, grads_and_vars)
        finally:
            opt._exchange, opt._routes = saved
        exchanged, step._exchange_seconds = step._exchange_seconds, None
        if exchanged is None:  # no exchange ran (nothing to time)
            exchanged = tf.constant(0.0, tf.float64)
        return went_ahead, exchanged

    def shared_state(suffix):
        """The inner state made the mean over the ranks; True once done."""
        shared = local_update.share_own_state(opt, f"{opt._prefix}.auto.{suffix}")
        with tf.control_dependencies([shared, step.own_state.assign(False)]):
            return tf.constant(True)

    def flush(routes):
        """Way 3, then, with the update cut, the inner state shared."""
        went_ahead, exchanged = run_with(routes)
        if not update_cut:
            return went_ahead, exchanged
        with tf.control_dependencies([went_ahead]):
            shared = shared_state("share_inner_state")
        with tf.control_dependencies([shared]):
            return tf.identity(went_ahead), tf.identity(exchanged)

    def hold(routes):
        """Way 2, with the update cut after sharing the inner state (once a turn)."""
        if not update_cut:
            return run_with(routes)
        shared = tf.cond(step.own_state, lambda: shared_state("share_state_in_trial"),
                         lambda: tf.constant(True))
        with tf.control_dependencies([shared]):
            return run_with(routes)

    def run_plan():
        if plan.clear_routes is None:
            # the first sparse step after a chosen dense phase: the noise estimate's q anew
            restart = [opt._second_moment.restarted_if(opt._loss_scaling.base_optimizer,
                                                       step.clear)] if update_cut else []
            with tf.control_dependencies(restart):
                went_ahead, exchanged = run_with(plan.routes)
            selected = plan.exchange.sends_selections
            written = [step.clear.assign(tf.logical_and(went_ahead, not selected))]
            if selected and update_cut:
                written.append(step.own_state.assign(True))
        else:
            went_ahead, exchanged = tf.cond(
                step.clear, lambda: run_with(plan.clear_routes),
                lambda: tf.cond(trial_step, lambda: hold(plan.held_routes),
                                lambda: flush(plan.routes)))
            written = [step.clear.assign(tf.logical_or(
                step.clear, tf.logical_and(went_ahead, tf.logical_not(trial_step))))]
        # an explicit edge: after lowering, nothing else orders the step's end after its
        # writes (``went_ahead`` exists only once they are done)
        with tf.control_dependencies(written):
            return tf.timestamp(), exchanged
    return run_plan
