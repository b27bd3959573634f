"""The update cut with a plain Keras ``SGD`` and one budget for the whole model, in one native
pass per variable (``kernels/local_sgd_cut.cc``): the local step, error feedback's
compensation, the model-wide cut and the remainder together.

Why: unfused, the local step (``fused_step``) writes each variable's update u, the cut's
sample reads it back at a sixteenth of the blocks, and the compensate-and-cut pass reads it
again with the residual: eight passes over each large variable's memory a step, two of them
only to hand u on. Measured on one 4.2M-entry variable, one thread, caches cold (the state of a
training step): 10.7-10.8 ms unfused, 8.0-8.2 ms fused; caches warm 7.1-7.6 against 4.5-4.6
ms. Every step of the default with ``SGD(momentum=...)`` on the allgather exchanges and the
sparse allreduce takes this path.

Each step, on every rank, for the variables the update cut sends sparsely:

1. the cut's sample, ``|u + r|`` at the blocks ``model_budget.model_wide_cut`` samples, with
   u computed there only (``SparseHvdSampledLocalSgd``), and from it the cut;
2. per variable, one pass (``SparseHvdLocalSgdCut``): u, the velocity after the step, c = u +
   r, the remainder (c with the entries at or above the cut zeroed) and those entries;
3. the velocities are written where every u is finite (as ``local_update`` writes them), the
   remainders go into the payload's state writes (made only once every rank's step is known
   to be finite), and the selections are the payload's, as error feedback's would be.

The float32 operations are the unfused ops' own, in their order, so the cut, the selections,
the remainders and the velocities are the same bits (``tests/test_fused_cut.py``). Used only
where the unfused path would run exactly those ops: ``sparsify="update"`` with every cut
variable on the sparse route, ``budget="model"``, ``fused_step``'s native SGD step usable,
error feedback on without momentum correction, no ``compression`` rounding and not two levels
of signs (``exchange="topk_sign2"``, whose band is cut from the updates the pass does not write
out), float32 residuals, and the native kernels in use. With ``exchange="topk_sign"`` the
signs of the rest come from the pass's remainders (``SignsOfTheRest.after_fused_cut``).
"""

from typing import Dict, Tuple

import keras
import tensorflow as tf

from .. import kernels
from ..runtime import startup as runtime
from . import fused_step

Selected = Dict[int, Tuple[object, tuple]]  # variable index -> (Selection, state writes)


def usable(opt, prepared, cut, variables, budgets) -> bool:
    """Whether the fused pass computes what the unfused path would for this step:
    ``prepared`` as ``preparation.make_payload`` holds it, ``cut`` the positions in it of the
    variables the update cut takes, ``variables`` those variables, ``budgets`` the sparse
    variables' k."""
    if not cut or opt.budget != "model" or getattr(opt._exchange, "levels", 0) > 1:
        return False
    if any(not prepared[i][2].sparse or prepared[i][3] for i in cut):
        return False
    if set(budgets) != {prepared[i][1] for i in cut}:  # every selection is the pass's
        return False
    feedback = opt._feedback
    if not feedback.enabled or feedback.momentum:
        return False
    if opt._compression.wire_dtype(tf.float32) is not None:
        return False
    base = opt._loss_scaling.base_optimizer
    if type(base) is not keras.optimizers.SGD:
        return False
    grads = [prepared[i][-1] for i in cut]
    if not fused_step.usable(opt, base, grads, variables, runtime.size(opt.process_set)):
        return False
    if any(tf.as_dtype(feedback.residuals[prepared[i][1]].dtype) != tf.float32 for i in cut):
        return False
    return kernels.local_sgd_cut() is not None and kernels.sampled_local_sgd() is not None


def selected(opt, prepared, cut, variables, budgets, ready_time) -> Selected:
    """Steps 1-3 for ``variables``, at positions ``cut`` of ``prepared`` (where :func:`usable`):
    each one's selection and the state writes that go with it, by variable index. The
    velocities are written here, where every update is finite (``opt.nonfinite`` "ignore":
    always). ``ready_time(gradient)`` is the payload's timestamp of a gradient, the selection
    run after it."""
    from ..selection.model_budget import BLOCK, model_wide_cut
    from ..selection.registry import Selection

    sgd = opt._loss_scaling.base_optimizer
    indices = [prepared[i][1] for i in cut]
    grads = [tf.reshape(prepared[i][-1], [-1]) for i in cut]
    given = fused_step.sgd_inputs(sgd, variables)
    residuals = [tf.reshape(tf.convert_to_tensor(opt._feedback.residuals[index]), [-1])
                 for index in indices]
    nesterov = bool(sgd.nesterov)

    def sampled_all(strides):
        return kernels.sampled_local_sgd()(
            gradients=grads, momenta=[g.flat_velocity for g in given],
            weights=[g.flat_weights for g in given], residuals=residuals,
            coefficients=tf.concat([g.coefficients for g in given], 0), strides=strides,
            block=BLOCK, nesterov=nesterov)

    sizes = [opt._routes[index].num_elements for index in indices]
    cut_value = model_wide_cut(None, sizes, [budgets[index] for index in indices], sampled_all)
    native = kernels.local_sgd_cut()
    result, writes, flags = {}, [], []
    for index, gradient, inputs, residual, variable in zip(indices, grads, given, residuals,
                                                           variables):
        with tf.control_dependencies([ready_time(gradient)]):
            velocity, remainder, positions, values, update_finite, finite = native(
                gradient, inputs.flat_velocity, inputs.flat_weights, residual,
                inputs.coefficients, cut_value, nesterov=nesterov)
        if inputs.velocity is not None:
            writes.append((sgd, inputs.velocity, tf.reshape(velocity, variable.shape)))
        flags.append(update_finite)
        selection = Selection(values=values, indices=positions, capped=tf.constant(False),
                              finite=finite)
        result[index] = selection, ((opt._feedback.residuals[index], remainder),)
    if opt.nonfinite == "ignore":
        fused_step.assign_all(writes)
    else:
        tf.cond(tf.reduce_all(flags), lambda: fused_step.assign_all(writes), lambda: None)
    return result
