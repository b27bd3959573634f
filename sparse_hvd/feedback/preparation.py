"""Steps 1-3 of a step for every (gradient, variable) pair, and what the inner optimizer gets.

:func:`make_payload` brings each gradient to its variable's dtype (a row-sparse one stays rows
where it travels as rows), unscales it (an inner LossScaleOptimizer), lets the density policy
see it, clips it locally (``clipping="local"``), with ``sparsify="update"`` replaces a
sparse-route gradient by the inner optimizer's update on this rank (``feedback.local_update``),
asks the policy for each sparse variable's k (or one cut over the model, ``budget="model"``),
then compensates and selects by route (error feedback; with a plain SGD and the model-wide cut
the update, compensation and cut are one pass, ``feedback.fused_cut``), rounds for
``compression``, and returns the step's :class:`~sparse_hvd.feedback.payload.Payload`:
nothing is written yet (with ``sparsify="update"`` the inner optimizer's own state has moved;
the weights have not).
:func:`inner_gradients` turns the exchange's averages into what the inner optimizer takes.
What they use of the optimizer: its routes, density policy, sparsifier, budget, clipping,
error feedback, loss scaling, compression, exchange, ``nonfinite``, ``momentum_correction``,
``sparsify`` and ``process_set``.
"""

import tensorflow as tf

from ..runtime import startup as runtime
from . import clipping as clipping_rules
from . import fused_cut
from .application import own_step
from .local_update import local_updates
from .payload import PayloadBuilder


def with_tensor_parts(grad):
    """An IndexedSlices gradient with tensors for values and indices (Keras accepts Python
    sequences there)."""
    if isinstance(grad, tf.IndexedSlices) and not (
            tf.is_tensor(grad.indices) and tf.is_tensor(grad.values)):
        return tf.IndexedSlices(tf.convert_to_tensor(grad.values),
                                tf.convert_to_tensor(grad.indices), grad.dense_shape)
    return grad


def tensor_parts(gradients) -> list:
    """The tensors that make up ``gradients`` (a list of tensors, ``IndexedSlices`` or None):
    a row-sparse gradient's values and indices. Not ``tf.nest.flatten(...,
    expand_composites=True)``: an ``IndexedSlices`` whose ``dense_shape`` is a Python tuple (as
    Keras makes them) has no type spec to expand."""
    tensors = []
    for gradient in gradients:
        if isinstance(gradient, tf.IndexedSlices):
            tensors += [gradient.values, gradient.indices]
        elif gradient is not None:
            tensors.append(gradient)
    return tensors


def as_rows(grad: tf.IndexedSlices, variable, combine=False) -> tf.IndexedSlices:
    """A row-sparse gradient with values in the variable's dtype; with ``combine``, each row
    once, the sum of its repeats (in the order the rows first appear).

    An embedding's gradient has a row per lookup, so a batch of 16 sequences of 64 characters
    sends 1,024 rows of a 97-row table: 10x the table's bytes, gathered from every rank each
    step. Combined, a rank sends at most the table. The inner optimizer sums repeated rows as
    it receives them, so it applies the same sums; only the order of the additions differs,
    which is why one worker (no exchange) leaves the rows as Keras made them. Every rank
    receives the same combined rows, so the replicas stay identical (on a GPU the sum of a
    row's repeats may add in another order from run to run, as Keras' own scatter-add of
    repeated rows does)."""
    values = tf.cast(grad.values, variable.dtype)
    if not combine:
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    rows, where = tf.unique(grad.indices)
    return tf.IndexedSlices(tf.math.unsorted_segment_sum(values, where, tf.size(rows)), rows,
                            grad.dense_shape)


def as_dense(grad, variable) -> tf.Tensor:
    """``grad`` as a dense tensor of the variable's dtype; IndexedSlices rows are summed."""
    if isinstance(grad, tf.IndexedSlices):
        grad = tf.math.unsorted_segment_sum(grad.values, grad.indices, variable.shape[0])
    return tf.cast(grad, variable.dtype)


def make_payload(opt, grads_and_vars, keep_rows=True):
    """Steps 1-3 for every (gradient, variable) pair, without writing state: a Payload.

    Each gradient is brought to its variable's dtype and unscaled (an inner
    LossScaleOptimizer); the density policy sees it; then by route: the sparse route
    compensates and selects (error feedback), the dense route sends it whole, and an
    embedding's row-sparse gradient on the dense route travels as rows (``keep_rows``;
    False densifies it, as the delayed pipeline needs). With the layer-wise exchange the
    variables are taken in backprop's order, output layers first.
    """
    builder = PayloadBuilder(check_finite=opt.nonfinite != "ignore",
                             sign_group=getattr(opt._exchange, "sign_group", 1))
    step = opt._policy_step()
    order = range(len(grads_and_vars))
    if opt._exchange.per_layer:
        order = reversed(order)
    prepared = []  # (position, index, route, rows, gradient as it travels)
    workers = runtime.size(opt.process_set)
    for position in order:
        grad, variable = grads_and_vars[position]
        index = opt._get_variable_index(variable)
        route = opt._routes[index]
        rows = (keep_rows and isinstance(grad, tf.IndexedSlices) and not route.sparse
                and not route.flushed and not route.held and not opt.momentum_correction)
        grad = opt._loss_scaling.unscale(
            as_rows(grad, variable, combine=workers > 1) if rows else as_dense(grad, variable))
        opt.density_policy.gradient_ready(index, grad.values if rows else grad)
        prepared.append((position, index, route, rows, grad))
    if opt.clipping == "local":
        clipped = clipping_rules.clipped_locally([p[-1] for p in prepared], opt._clipper,
                                                 runtime.size(opt.process_set))
        prepared = [p[:-1] + (grad,) for p, grad in zip(prepared, clipped)]
    # the inner optimizer's update where entries are cut, and where they were (a flushed route:
    # its residual holds steps, and the inner state is each rank's own, so it goes on as steps)
    cut = ([i for i, p in enumerate(prepared) if p[2].sparse or p[2].flushed]
           if opt.sparsify == "update" else [])
    budgets = {index: opt.density_policy.k(index, route.num_elements, step)
               for _, index, route, rows, _ in prepared if route.sparse and not rows}
    cut_variables = [grads_and_vars[prepared[i][0]][1] for i in cut]
    fused = None  # a plain SGD's local step, compensation and model-wide cut in one pass
    if fused_cut.usable(opt, prepared, cut, cut_variables, budgets):
        fused = fused_cut.selected(opt, prepared, cut, cut_variables, budgets,
                                   builder.ready_time)
    elif cut:
        updates = local_updates(opt, [prepared[i][-1] for i in cut], cut_variables, own_step)
        for i, update in zip(cut, updates):
            prepared[i] = prepared[i][:-1] + (update,)
    sparsifier = (None if fused is not None
                  else model_wide_sparsifier(opt, prepared, budgets) or opt._selector)
    # a rank that sends its signs as they are (not rounded by ``compression``) takes them
    # packed as they travel, from the selecting pass
    unrounded = opt._compression.wire_dtype(tf.float32) is None
    packing = getattr(sparsifier, "packing", None)  # exchange="sign": ``ScaledSign``
    if packing is not None and workers > 1 and (unrounded or sparsifier.own_wire_precision):
        sparsifier = packing()
    levels = getattr(opt._exchange, "levels", 0)  # exchange="topk_sign": the rest as signs
    if levels:
        from ..exchanges.topk_sign import BAND, SignsOfTheRest

        band_cut = None
        if levels > 1 and opt.budget == "model" and budgets:
            band_cut = model_wide_sparsifier(opt, prepared, budgets, scale=BAND).cut
        sparsifier = SignsOfTheRest(sparsifier, levels, band_cut,
                                    group=getattr(opt._exchange, "sign_group", 1),
                                    packed=workers > 1 and unrounded)
    for position, index, route, rows, grad in prepared:
        if rows:
            builder.add_rows(position, index, route, grad)
        elif route.sparse:
            k = budgets[index]
            if fused is not None:
                selection, updates = fused[index]
                if levels:  # exchange="topk_sign": the signs of the pass's remainder
                    selection, updates = sparsifier.after_fused_cut(selection, updates)
            else:
                with tf.control_dependencies([builder.ready_time(grad)]):
                    selection, updates = opt._feedback.select(index, grad, sparsifier, k,
                                                               opt._compression)
            builder.add_sparse(position, index, route, grad, selection, updates, budget=k)
        elif route.flushed:
            sent, updates = opt._feedback.flush(index, grad, opt._compression)
            builder.add_dense(position, index, route, grad, updates, sent=sent)
        elif route.held and opt._compression.wire_dtype(grad.dtype) is not None:
            sent, updates = opt._feedback.hold(index, grad, opt._compression,
                                               owed=opt.sparsify != "update")
            builder.add_dense(position, index, route, grad, updates, sent=sent)
        elif opt._compression.wire_dtype(grad.dtype) is not None:
            sent, updates = opt._feedback.round_dense(index, grad, opt._compression)
            builder.add_dense(position, index, route, grad, updates, sent=sent)
        else:
            builder.add_dense(position, index, route, grad)
    return builder.build()


def model_wide_sparsifier(opt, prepared, budgets, scale=1):
    """``budget="model"``: a sparsifier that keeps every entry at or above this step's
    model-wide cut (``selection.model_budget``), for ``scale`` times the budgets (the band of
    ``exchange="topk_sign2"``: 10); None with per-layer budgets."""
    if opt.budget != "model" or not budgets:
        return None
    from ..selection.model_budget import AtOrAbove, model_wide_cut

    chosen = [(index, grad) for _, index, route, rows, grad in prepared if index in budgets]

    def magnitudes_at(j, sample):
        index, grad = chosen[j]
        return tf.abs(tf.cast(opt._feedback.compensated_at(index, grad, sample), tf.float32))

    sizes = [opt._routes[index].num_elements for index, _ in chosen]
    return AtOrAbove(model_wide_cut(magnitudes_at, sizes, [scale * budgets[i] for i, _ in chosen],
                                    _native_sample(opt, chosen)))


def _native_sample(opt, chosen):
    """Every variable's sampled ``|gradient + residual|`` by one native op, where it computes
    what ``compensated_at`` does (float32, error feedback without momentum correction); else
    None."""
    from .. import kernels
    from ..selection.model_budget import BLOCK

    feedback = opt._feedback
    residuals = [feedback.residuals[index] for index, _ in chosen] if feedback.enabled else []
    if (feedback.momentum or not feedback.enabled
            or any(grad.dtype != tf.float32 for _, grad in chosen)
            or any(tf.as_dtype(residual.dtype) != tf.float32 for residual in residuals)):
        return None
    op = kernels.sampled_magnitudes()
    if op is None:
        return None
    return lambda strides: op(gradients=[grad for _, grad in chosen],
                              residuals=[tf.convert_to_tensor(r) for r in residuals],
                              strides=strides, block=BLOCK)


def inner_gradients(opt, payload, averaged, variables):
    """The averages as the inner optimizer takes them (sparse ones reshaped; dense-route
    ones through momentum correction), and every state write of the step."""
    grads = list(averaged)
    state_updates = list(payload.state_updates)
    for position in payload.sparse.positions:
        if not isinstance(averaged[position], tf.IndexedSlices):  # those stay flat positions
            grads[position] = tf.reshape(averaged[position], variables[position].shape)
    for position, index in zip(payload.dense.positions, payload.dense.keys):
        if opt._routes[index].flushed:  # momentum was applied before sending, as selected
            grads[position] = tf.reshape(averaged[position], variables[position].shape)
            continue
        grads[position], updates = opt._feedback.after_exchange(index, averaged[position])
        state_updates.extend(updates)
    return grads, state_updates
