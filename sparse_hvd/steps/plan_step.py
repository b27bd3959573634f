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
from Adam's v (``SecondMoment.restarted_if``): it stood still while dense ran; and it is where
the sparse steps began for their factor (``StepFactor.restarted_if``: after the factor's ramp,
such steps take none).

Traced for one plan at a time (``traced_choice``), dense's step is traced for the way its next
step takes, which the host reads before the call (:func:`traced_mode`): way 1 alone while the
residuals are clear (from a fresh build until the first sparse step), and for a trial's turn
after sparse steps where way 2 sends what way 1 does (no compression: it differs only in
keeping a rounding error), the inner state shared first if due; way 2 alone for such a turn
with compression; and for the flush, way 3 with way 1 for the steps after it (the flush's
function: the step after dense is chosen), unless ``flush_between`` sends the residuals before
that step (the update cut without 16-bit values), which then runs way 1's function. A call that
runs several steps stays in its way: dense's steps keep the residuals as they were (a held step
outside a trial leaves them to the sparse steps after it, and does not call them clear); in the
flush's function a step of a trial whose residuals are not clear (only after a flush that did
not go ahead, in the same call) flushes them instead of holding them: nothing is lost, and
every rank does the same. With the three ways in one function, dense's trace and first call
took 3.6 s a rank at 4 workers on 2 cores (the wide CNN), way 1 alone 1.4 s: the first steps of
every job that starts on dense (way 2 traced apart for the trial's turn after sparse steps took
another 1.1 s, hence way 1 there where it can). The three ways stay together only in the step
that holds every candidate as a branch (no ``traced_choice``).
"""

import tensorflow as tf

from ..feedback import local_update
from .strategies import SynchronousStep

FIRST = -1  # traced for the plan steps run before the first trial (``first_mode``)
DENSE_PLAIN = -2  # dense's plan, way 1 alone (the residuals clear, or held as way 1 sends)
DENSE_HELD = -3  # dense's plan, way 2 alone (a trial's turn after sparse steps, compressed)
DENSE_FLUSH = -4  # dense's plan, way 3 then way 1 (the step after dense is chosen)


def traced_mode(step, branch) -> int:
    """What the function of a step due for the plan ``branch`` is traced for (eager, on the
    host, the same on every rank): dense's way, or ``branch`` itself."""
    if branch != step.dense_index:
        return branch
    if bool(step.clear.numpy()):
        return DENSE_PLAIN
    if bool(step.next_in_trial.numpy()):
        # way 2 sends what way 1 does unless values are rounded: it keeps each value's rounding
        # error in its residual (``preparation``)
        return DENSE_HELD if step.optimizer._compression.enabled else DENSE_PLAIN
    return DENSE_FLUSH


def first_traced(step) -> int:
    """What the first function, traced before the optimizer was built, was traced for: the
    first plan, or dense's way 1 (the build's residuals are clear)."""
    first = step.first_mode()
    return DENSE_PLAIN if first == step.dense_index else first


def traced_plan(step):
    """``(the plan's index, its way: "plain", "held", "flush" or None for all)`` of a step
    traced for ``step.traced``."""
    traced = first_traced(step) if step.traced == FIRST else step.traced
    ways = {DENSE_PLAIN: "plain", DENSE_HELD: "held", DENSE_FLUSH: "flush"}
    if traced in ways:
        return step.dense_index, ways[traced]
    return traced, None


def plan_step(step, plan, grads_and_vars, trial_step, way=None):
    """The step of ``step`` (a ``MeasuredChoiceStep``) with ``plan``, as a callable for a
    ``tf.switch_case`` branch: ``(its end's timestamp, its exchange's seconds)``.
    ``trial_step``: a boolean tensor, whether this step is a trial's step of this plan;
    ``way``: dense's plan traced for way 1 ("plain": sharing the inner state first if due,
    as way 2 does) or way 2 ("held") alone, or for way 3 then way 1 ("flush")."""
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
            # the first sparse step after a chosen dense phase: the noise estimate's q anew,
            # the factor's sparse steps begin here
            restart = [opt._second_moment.restarted_if(opt._loss_scaling.base_optimizer,
                                                       step.clear),
                       opt._step_factor.restarted_if(opt, step.clear)] if update_cut else []
            with tf.control_dependencies(restart):
                went_ahead, exchanged = run_with(plan.routes)
            selected = plan.exchange.sends_selections
            written = [step.clear.assign(tf.logical_and(went_ahead, not selected))]
            if selected and update_cut:
                written.append(step.own_state.assign(True))
        elif way in ("plain", "held"):  # the residuals stay as they were: clear, or held
            went_ahead, exchanged = hold(plan.clear_routes if way == "plain" else plan.held_routes)
            written = [went_ahead]
        else:  # way 1 where clear, else the flush ("flush"), or a trial's hold or the flush
            def owed():
                if way == "flush":
                    return flush(plan.routes)
                return tf.cond(trial_step, lambda: hold(plan.held_routes),
                               lambda: flush(plan.routes))
            went_ahead, exchanged = tf.cond(step.clear, lambda: run_with(plan.clear_routes), owed)
            sent = went_ahead
            if way is None:  # a trial's held step leaves the residuals owed
                sent = tf.logical_and(went_ahead, tf.logical_not(trial_step))
            written = [step.clear.assign(tf.logical_or(step.clear, sent))]
        # an explicit edge: after lowering, nothing else orders the step's end after its
        # writes (``went_ahead`` exists only once they are done)
        with tf.control_dependencies(written):
            return tf.timestamp(), exchanged
    return run_plan
