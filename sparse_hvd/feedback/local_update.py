"""``sparsify="update"``: each worker runs the inner optimizer on its own gradient, and what
is cut, error-fed and averaged is the *update* the inner optimizer would make.

With ``sparsify="gradient"`` (the default for a plain SGD only) the inner optimizer
runs once per step, on the average of the sparse gradients, the same on every rank. An entry
of the gradient that waits in a residual for T steps then reaches the optimizer as one sum:
Adam's moments see a spike where dense Adam saw T small steps. With ``"update"`` the moments
follow each worker's own gradient every step (DGC's momentum correction, generalised from
SGD's momentum to any Keras optimizer), so an entry held back is a held-back *step*, applied
late but at its size.
Measured at 4 workers, 3 seeds (``docs/steps_to_loss_ablations.md``, "What is cut,
measured"): with Adam, the transformer and the LSTM end closer to dense than with the
gradient cut, and so does the LSTM with SGD's momentum; it is the default with every inner
optimizer that keeps a state (``selection.defaults``).

Each step, on every rank:

1. read the weights w;
2. apply the inner optimizer to this rank's gradient (its clipping, weight decay and moments
   act here, on this rank's gradient; with ``clipping="local"`` the gradient was clipped
   before and the inner optimizer's own clipping is off);
3. the update is u = w - w', where w' are the weights it wrote; write w back and take back
   the inner optimizer's ``iterations`` increment (the step is counted when it is applied);
4. u goes through error feedback and the exchange as a gradient would; what arrives, the
   average of the sent updates (times the step's factor, :mod:`.step_factor`), is subtracted
   from the weights (``apply_averages``), and the step is counted then, so a skipped step
   counts nothing.

For a plain Keras Adam, AdamW or SGD, steps 1-3 are one native pass per variable that
writes the optimizer's state and returns the update without touching the weights
(:mod:`.fused_step`, the same bits).

Only variables on the sparse route are handled so: a variable always sent whole (under
``min_elements``) gets the inner optimizer on the averaged gradient, as without sparse_hvd
(its step then taken times the same factor, so that the whole step is scaled alike).
A cut variable that ``exchange="auto"`` sends whole (a dense step: ``Route.flushed``) stays
on steps in that step: its update plus its residual is sent whole, averaged and subtracted
(its inner state is each rank's own, so handing the averaged gradient to the inner optimizer
would move each rank's weights differently, and its residual holds steps, not gradients).
The same step makes the inner state the mean over the ranks (:func:`share_own_state`), so
the dense steps after it are Horovod's: the inner optimizer once, on the averaged gradient.
A trial's dense turn (``Route.held``) shares the state first and steps so too, keeping the
residuals for the sparse steps after the trial (``steps.plan_step``).

A rank whose gradient is not finite skips step 2 and hands its gradient on unchanged: the
exchange sees it and the step is skipped on every rank (``nonfinite``). (The native passes
compute the step into new tensors and say whether every update is finite, which a non-finite
gradient makes it not; that rank writes no state and hands the non-finite updates on.) The
ranks whose gradients were finite have then already moved their moments by that step's
gradient; their weights and step counts are untouched.

What differs from the gradient cut, by construction: the inner optimizer's state is each worker's
own (only the weights are the same everywhere). A checkpoint written by one rank holds that
rank's; ``share_residuals`` (``ShareResidualsCallback``) makes every rank's the mean over the
ranks first, as it does the residuals (:func:`own_state`), so that the saved state stands for
all and a resumed run continues exactly as the uninterrupted one that shared too. The mean is
the natural state to resume from: SGD's velocity and Adam's first moment are linear in the
gradients, so their mean is what dense training would have; Adam's second moment is then the
mean of the workers' mean squares.
"""

import contextlib

import keras
import tensorflow as tf

from . import fused_step, nonfinite
from .. import kernels
from ..runtime import startup as runtime


def local_updates(opt, grads, variables, own_step):
    """Steps 1-3 for dense true gradients ``grads`` of ``variables``: the inner optimizer's
    updates (weights and the step count left as they were). ``own_step(opt, grads,
    variables)`` is the inner optimizer's step on this rank's gradient
    (``feedback.application.own_step``: past an inner LossScaleOptimizer, clipping off after
    local clipping)."""
    inner = opt.inner_optimizer
    base, workers = opt._loss_scaling.base_optimizer, runtime.size(opt.process_set)
    fused = fused_step.steps_if_usable(opt, base, grads, variables, workers)
    if fused is not None:  # a plain Adam or SGD: the same steps in one native pass each
        return _written_where_finite(opt, fused)

    def step():
        before = [tf.identity(v) for v in variables]
        # second_moment corrects Adam's step, not its weight decay (read now: this step's rate)
        decays = opt._second_moment.decays(base, variables, before, workers)
        with tf.control_dependencies(before + [d.learning_rate for d in decays if d]):
            with _moving_average_off(opt._clipper):
                own_step(opt, list(grads), variables)
        updates = [b - tf.identity(v) for b, v in zip(before, variables)]
        updates = opt._second_moment.corrected(base, updates, variables, workers,
                                               opt._get_variable_index, decays)
        with tf.control_dependencies(updates):
            for variable, value in zip(variables, before):
                opt.assign(variable, value)  # through the wrapper, as Keras' rule asks
            inner.iterations.assign_sub(1)
        return [tf.identity(u) for u in updates]

    if opt.nonfinite == "ignore":
        return step()
    finite = tf.reduce_all([nonfinite.all_finite(g) for g in grads])  # the payload's own test
    return tf.cond(finite, step, lambda: [tf.identity(g) for g in grads])


def _written_where_finite(opt, fused):
    """The native passes' updates (``fused_step.LocalSteps``), their optimizer state written
    where every update is finite; else the updates (non-finite: the exchange sees it) go on
    with nothing written. The passes say it themselves, so no pass over the gradients comes
    before them."""
    def written():
        fused.write_state()
        return [tf.identity(u) for u in fused.updates]

    if opt.nonfinite == "ignore":
        return written()
    return tf.cond(fused.finite, written, lambda: [tf.identity(u) for u in fused.updates])


def own_state(opt):
    """The state that follows each worker's own gradients with ``sparsify="update"``: the
    inner optimizer's floating-point variables other than the step count, the learning rate
    and the EMA of the weights, which follows the applied weights (SGD's velocities, Adam's
    moments), those of the optimizer inside a LossScaleOptimizer (whose loss scale is the same
    on every rank); and the second moment's correction's (``second_moment``)."""
    inner = opt.inner_optimizer
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        inner = inner.inner_optimizer
    shared = {id(inner.iterations)}
    shared.update(id(v) for v in getattr(inner, "_model_variables_moving_average", None) or [])
    if isinstance(getattr(inner, "_learning_rate", None), keras.Variable):
        shared.add(id(inner._learning_rate))
    return [v for v in inner.variables
            if id(v) not in shared and tf.as_dtype(v.dtype).is_floating
            ] + opt._second_moment.variables


def share_own_state(opt, name):
    """In a traced step, on every rank: replace :func:`own_state` by its mean over the ranks
    (one fused allreduce per dtype). ``exchange="auto"`` does it in the dense step that sends
    the residuals whole, so that the dense steps after it can hand the averaged gradient to
    one shared state, as Horovod's dense step does. Returns the assignments' op."""
    from ..runtime import collectives

    variables = own_state(opt)
    means = collectives.means_by_dtype([tf.convert_to_tensor(v) for v in variables], name,
                                       process_set=opt.process_set)
    return tf.group([v.assign(m) for v, m in zip(variables, means)])


def apply_averages(opt, averages, variables, routes, apply_inner, count_finite_step):
    """Step 4: subtract the averaged updates of the cut variables (sparse or flushed) from
    them (then their constraints, as Keras applies them after a step), hand the dense-route
    variables' averaged gradients to ``apply_inner`` (the inner optimizer, as without
    sparse_hvd), and count the step once: by ``apply_inner``, or else by
    ``count_finite_step`` (an inner LossScaleOptimizer's count toward a larger scale) and the
    step count.

    The step's factor (``update_scale``, :mod:`.step_factor`) scales the whole step where
    anything is cut: the averaged updates and the inner optimizer's step on the dense-route
    variables alike (for SGD, with or without momentum, the step at the factor times the
    rate). A step with nothing cut (a trial's dense turn, every route held) is dense's, at the
    rate."""
    chosen = [routes[opt._get_variable_index(v)] for v in variables]
    cut = [route.sparse or route.flushed for route in chosen]
    scale = opt._step_factor.on_step(opt, any(cut))
    for average, variable, sparse in zip(averages, variables, cut):
        if not sparse:
            continue
        average = _scaled(average, scale)
        if isinstance(average, tf.IndexedSlices):
            subtract_at_positions(opt, variable, average)
        else:
            opt.assign_sub(variable, tf.cast(tf.reshape(average, variable.shape), variable.dtype))
        if getattr(variable, "constraint", None) is not None:
            opt.assign(variable, variable.constraint(variable))
    whole = [(g, v) for g, v, sparse in zip(averages, variables, cut) if not sparse]
    if whole:  # the inner optimizer counts the step (and moves its EMA of every variable)
        _scaled_step(opt, scale, apply_inner, [g for g, _ in whole], [v for _, v in whole])
        return
    count_finite_step()
    moving_average_step(opt._clipper)
    opt.inner_optimizer.iterations.assign_add(1)


def _scaled_step(opt, scale, apply_inner, grads, variables):
    """``apply_inner(grads, variables)``, each variable's step then taken ``scale`` times (its
    constraint applied again after)."""
    if _is_one(scale):
        apply_inner(grads, variables)
        return
    before = [tf.identity(v) for v in variables]
    with tf.control_dependencies(before):
        apply_inner(grads, variables)
    for variable, value in zip(variables, before):
        stepped = tf.convert_to_tensor(variable)
        opt.assign(variable, value + tf.cast(scale, variable.dtype) * (stepped - value))
        if getattr(variable, "constraint", None) is not None:
            opt.assign(variable, variable.constraint(variable))


def _scaled(average, scale):
    """``average`` times ``scale`` (as it is where that is 1)."""
    if _is_one(scale):
        return average
    if isinstance(average, tf.IndexedSlices):
        return tf.IndexedSlices(average.values * tf.cast(scale, average.values.dtype),
                                average.indices, average.dense_shape)
    return average * tf.cast(scale, average.dtype)


def _is_one(scale):
    """``scale`` is the number 1 (not a tensor: a warming-up factor)."""
    return isinstance(scale, (int, float)) and scale == 1


def subtract_at_positions(opt, variable, average):
    """``variable`` less ``average``, a ``tf.IndexedSlices`` of distinct flat positions and
    their averages (the exchange's, at positions): in place by the native kernel, only those
    entries written, each ``w - a``: the bits of subtracting the dense average, which is 0
    elsewhere. (Not TensorFlow's scatter ops: they switch the variable to copy-on-read, and
    every later read of the weights copies them.) Without the kernel, for a 16-bit variable,
    or where a subclass of the wrapper has its own ``assign_sub``: the dense average through
    ``opt.assign_sub``, as before."""
    target = variable.value if isinstance(variable, keras.Variable) else variable  # as Keras does
    native = kernels.subtract_at() if target.dtype in (tf.float32, tf.float64) else None
    if native is not None and type(opt).assign_sub is keras.optimizers.Optimizer.assign_sub:
        native(target.handle, average.indices, tf.cast(average.values, target.dtype))
        return
    dense = tf.reshape(tf.convert_to_tensor(average), variable.shape)
    opt.assign_sub(variable, tf.cast(dense, variable.dtype))


@contextlib.contextmanager
def _moving_average_off(optimizer):
    """``use_ema`` off while the inner optimizer steps on the local gradient (whose weights are
    then written back): the EMA follows the applied weights only (``moving_average_step``)."""
    saved = optimizer.use_ema
    optimizer.use_ema = False
    try:
        yield
    finally:
        optimizer.use_ema = saved


def moving_average_step(optimizer):
    """What Keras' optimizer does after a step with ``use_ema`` (its EMA of every trainable
    variable, and the overwrite every ``ema_overwrite_frequency`` steps), for a step in which
    it applied nothing itself."""
    if not optimizer.use_ema:
        return
    optimizer._update_model_variables_moving_average(optimizer._trainable_variables)
    if optimizer.ema_overwrite_frequency:
        due = (optimizer.iterations + 1) % optimizer.ema_overwrite_frequency == 0
        tf.cond(due, lambda: optimizer._overwrite_model_variables_with_average_value(
            optimizer._trainable_variables), lambda: None)
