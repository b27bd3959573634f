"""Error feedback: add what was not sent before, keep what is not sent now.

Top-k and its relatives are biased compressors: on their own they would drop the small
coordinates of the gradient forever. Error feedback (Alistarh et al. 2018; Karimireddy et al.
2019) keeps the unsent remainder in a per-variable residual and adds it to the next gradient, so
every coordinate is eventually applied, and 0.1%-1% density converges like dense SGD.

The functions are the arithmetic of one variable's step; :class:`ErrorFeedback` holds a rank's
state (residuals, DGC velocities) and its whole lifecycle.
"""

from typing import Dict, List, Tuple

import keras
import tensorflow as tf

from .. import kernels
from ..runtime import log, startup as runtime
from ..exchanges.compression import NONE
from ..selection.sparsifiers import Selection


def zeroed_at(flat, indices):
    """``flat`` with the entries at ``indices`` set to zero (exactly: no arithmetic)."""
    zeros = tf.zeros(tf.shape(indices), flat.dtype)
    return tf.tensor_scatter_nd_update(flat, tf.expand_dims(indices, 1), zeros)


def compensate_and_select(grad, residual, sparsifier, k, error_feedback=True):
    """One variable's sparsification step, without writing anything: ``(selection, remainder)``.

    1. compensate: ``c = flatten(grad) + flatten(residual)`` (just ``grad`` without feedback);
    2. select: ``selection = sparsifier(c, k)``;
    3. remember: ``remainder = c`` with the selected positions set to zero, so
       sent + remainder == c exactly, bit for bit. It is the new residual, flat; None without
       feedback. The caller writes it (the optimizer only once every rank's step is known to
       be finite, so a skipped step leaves the residual as it was).

    A sparsifier may do steps 1-3 itself in one pass over the data by defining
    ``fused_compensate_select(flat_grad, flat_residual, k) -> (selection, remainder)`` (or
    returning None from it to decline); the result must be the same as the three steps.

    Args:
        grad: the dense local gradient, shaped like ``residual``.
        residual: the variable's residual (a Keras or tf variable, or its value).
        sparsifier: a callable ``(flat, k) -> Selection``.
        k: entries to send (Python int or int32 scalar tensor).
        error_feedback: False drops the unsent remainder (for experiments only).
    """
    flat = tf.reshape(grad, [-1])
    if not error_feedback:
        return sparsifier(flat, k), None
    flat_residual = tf.reshape(tf.convert_to_tensor(residual), [-1])
    fused = getattr(sparsifier, "fused_compensate_select", None)
    if fused is not None:
        result = fused(flat, flat_residual, k)
        if result is not None:
            return result
    compensated = flat + flat_residual
    selection = sparsifier(compensated, k)
    return selection, zeroed_at(compensated, selection.indices)


def compensate_select_remember(grad, residual, sparsifier, k, error_feedback=True) -> Selection:
    """:func:`compensate_and_select`, then write the remainder into ``residual``."""
    selection, remainder = compensate_and_select(grad, residual, sparsifier, k, error_feedback)
    if remainder is not None:
        residual.assign(tf.reshape(remainder, residual.shape))
    return selection


def accumulated_velocity(grad, velocity, momentum) -> tf.Tensor:
    """DGC step 1: ``momentum * velocity + grad`` (the caller writes it)."""
    return tf.constant(momentum, dtype=velocity.dtype) * tf.convert_to_tensor(velocity) + grad


def velocity_after_sending(velocity_value, selection: Selection) -> tf.Tensor:
    """Momentum factor masking (DGC): the flat velocity with the sent entries zeroed.

    Those entries' momentum has been delivered with the sent value; keeping it would push the
    same contribution again on every later step.
    """
    return zeroed_at(tf.reshape(velocity_value, [-1]), selection.indices)


def scatter_add(flat, values, indices):
    """``flat`` with ``values`` added at the flat ``indices``: on CPU in ``flat``'s own buffer
    when nothing else holds it (``kernels.add_at``; TensorFlow's scatter copies all of
    ``flat`` first), else a new tensor."""
    values = tf.cast(values, flat.dtype)
    native = kernels.add_at() if flat.dtype in (tf.float32, tf.float64) else None
    if native is not None:
        return native(flat, indices, values)
    return tf.tensor_scatter_nd_add(flat, tf.expand_dims(tf.cast(indices, tf.int64), 1), values)


class ErrorFeedback:
    """One rank's error-feedback state and its lifecycle.

    The state is each rank's own (never broadcast) and lives in optimizer variables, so a Keras
    checkpoint holds it:

    * ``residuals``: one per trainable variable, what was not sent yet;
    * ``velocities``: with DGC momentum correction, each rank's local velocity per variable;
    * ``world_size``: the number of workers the residuals belong to (see :meth:`share`).

    Lifecycle:

    1. :meth:`build` creates the variables, residuals first, then velocities, then the worker
       count (the order is part of the checkpoint format);
    2. each step, :meth:`select` compensates and selects one sparse-route gradient and returns
       the state writes, which the optimizer makes only if the step goes ahead; on the dense
       route, :meth:`after_exchange` applies the momentum to the averaged gradient;
    3. a delayed step that is skipped gives what it sent back (:meth:`give_back`);
    4. before a checkpoint written by one rank, :meth:`share` makes every rank's state the mean
       over the ranks; after a restore on another number of workers,
       :meth:`rescale_after_restore` keeps its sum.

    Args:
        enabled: keep and re-add what was not sent (False is for experiments).
        momentum: DGC's momentum correction factor (0: off).
        masking: with momentum correction, clear the velocity of the entries sent (DGC's
            momentum factor masking); False keeps it, so that what is sent over the run adds
            up to exactly what dense momentum SGD would have applied.
    """

    def __init__(self, enabled: bool, momentum: float, masking: bool = True):
        self.enabled = bool(enabled)
        self.momentum = float(momentum)
        self.masking = bool(masking)
        self.residuals: List[keras.Variable] = []
        self.velocities: List[keras.Variable] = []
        self.world_size = None
        self.restored = False  # restored state whose worker count is not checked yet

    def build(self, optimizer, var_list, process_set=None):
        """Create the state as variables of ``optimizer`` (a Keras optimizer), which also
        writes them (its ``assign`` methods, Keras' rule for an optimizer's writes)."""
        self.writer = optimizer
        self.residuals = [optimizer.add_variable_from_reference(v, name="residual") for v in var_list]
        if self.momentum:
            self.velocities = [optimizer.add_variable_from_reference(v, name="velocity")
                               for v in var_list]
        self.world_size = optimizer.add_variable(
            shape=(), dtype="int32", name="residual_world_size",
            initializer=keras.initializers.Constant(runtime.size(process_set)),
        )
        self.restored = False  # fresh residuals belong to this job

    @property
    def local_variables(self) -> List[keras.Variable]:
        """State that is each rank's own and must not be broadcast."""
        return self.residuals + self.velocities

    def select(self, index, grad, sparsifier, k,
               compression=NONE) -> Tuple[Selection, Tuple[tuple, ...]]:
        """Steps 1-3 of :func:`compensate_and_select` for variable ``index``, with DGC first.

        With momentum correction the rank's velocity ``u = m*u + g`` is sparsified instead of
        the gradient, and (with masking) the sent entries' velocity is cleared.
        With ``compression`` (``sparse_hvd.exchanges.compression``) the selected values are rounded by it
        and the rounding error stays in the residual at their positions (not where the
        sparsifier says its values travel in a 16-bit code of their own,
        ``own_wire_precision``: the sign exchange's bfloat16 scales).
        Returns the selection and the (variable, new flat value) writes; nothing is written.
        """
        updates = []
        if self.momentum:
            grad = accumulated_velocity(grad, self.velocities[index], self.momentum)
        selection, remainder = compensate_and_select(
            grad, self.residuals[index], sparsifier, k, self.enabled)
        if (compression.wire_dtype(grad.dtype) is not None
                and not getattr(sparsifier, "own_wire_precision", False)):
            sent, error = compression.round(selection.values)
            selection = selection._replace(values=sent)
            if remainder is not None:  # zero at the selected positions: now their error
                remainder = scatter_add(remainder, error, selection.indices)
            if selection.signs is not None:  # the scales of the signs too, their error kept
                rounded = [compression.round(layer) for layer in selection.signs]
                selection = selection._replace(signs=tuple(sent for sent, _ in rounded))
                if remainder is not None:
                    for _, error in rounded:
                        remainder = remainder + tf.cast(error, remainder.dtype)
        if remainder is not None:
            updates.append((self.residuals[index], remainder))
        if self.momentum:
            velocity = velocity_after_sending(grad, selection) if self.masking else grad
            updates.append((self.velocities[index], velocity))
        return selection, tuple(updates)

    def compensated_at(self, index, grad, sample=None) -> tf.Tensor:
        """What :meth:`select` hands the sparsifier for variable ``index``, flat, at the
        entries ``sample`` takes of a flat tensor (None: everywhere): the gradient (or, with
        momentum correction, the next velocity) plus the residual; only those entries are
        computed."""
        def at(tensor):
            flat = tf.reshape(tf.convert_to_tensor(tensor), [-1])
            return flat if sample is None else sample(flat)

        flat = at(grad)
        if self.momentum:
            flat = accumulated_velocity(flat, at(self.velocities[index]), self.momentum)
        return flat + at(self.residuals[index]) if self.enabled else flat

    def round_dense(self, index, grad, compression) -> Tuple[tf.Tensor, Tuple[tuple, ...]]:
        """A dense-route gradient to send with ``compression``: ``c = grad + residual``
        rounded, and the write ``residual = c - rounded`` (none without error feedback)."""
        if not self.enabled:
            return compression.round(grad)[0], ()
        residual = self.residuals[index]
        sent, error = compression.round(grad + tf.cast(tf.convert_to_tensor(residual), grad.dtype))
        return sent, ((residual, error),)

    def flush(self, index, grad, compression=NONE) -> Tuple[tf.Tensor, Tuple[tuple, ...]]:
        """Variable ``index`` sent whole although its route is sparse (``exchange="auto"``
        running the dense allreduce): what :meth:`select` would send with k = every entry.
        The compensated gradient ``c`` (with momentum correction: the next velocity plus the
        residual) is sent, rounded by ``compression``; the residual becomes the rounding error
        (zero without compression); with masking every velocity entry was sent and is
        cleared. So switching between sparse and dense steps loses nothing."""
        velocity = None
        if self.momentum:
            grad = velocity = accumulated_velocity(grad, self.velocities[index], self.momentum)
        compensated = grad
        if self.enabled:
            compensated = grad + tf.cast(tf.convert_to_tensor(self.residuals[index]), grad.dtype)
        updates = []
        if compression.wire_dtype(grad.dtype) is not None:
            sent, error = compression.round(compensated)
        else:
            sent, error = compensated, tf.zeros_like(compensated)
        if self.enabled:
            updates.append((self.residuals[index], error))
        if self.momentum:
            updates.append((self.velocities[index],
                            tf.zeros_like(velocity) if self.masking else velocity))
        return sent, tuple(updates)

    def hold(self, index, grad, compression, owed=True) -> Tuple[tf.Tensor, Tuple[tuple, ...]]:
        """Variable ``index`` sent whole with its residual kept (a trial's dense turn of
        ``exchange="auto"``), with a 16-bit ``compression``: the gradient rounded, and, if
        ``owed``, the write ``residual += grad - rounded``, so the rounding is owed like any
        unsent part (not with the update cut, whose residual holds steps, not gradients: there
        the rounding is dropped, as Horovod's float16 allreduce drops it). Without compression
        a held variable is sent as it is."""
        sent, error = compression.round(grad)
        if not (self.enabled and owed):
            return sent, ()
        residual = self.residuals[index]
        kept = tf.convert_to_tensor(residual) + tf.cast(error, residual.dtype)
        return sent, ((residual, kept),)

    def after_exchange(self, index, averaged) -> Tuple[tf.Tensor, Tuple[tuple, ...]]:
        """A dense-route variable's averaged gradient as the inner optimizer gets it: with
        momentum correction, the velocity ``m*u + average`` (ordinary momentum), to be written
        back; else the average itself."""
        if not self.momentum:
            return averaged, ()
        velocity = self.velocities[index]
        grad = accumulated_velocity(averaged, velocity, self.momentum)
        return grad, ((velocity, grad),)

    def give_back(self, sent: Dict[int, tuple]):
        """Add what this rank sent (``{index: (values, int32 flat indices)}``) back into its
        residuals: for a step that is not applied, so that no gradient is lost."""
        for index, (values, indices) in sent.items():
            residual = self.residuals[index]
            flat = scatter_add(tf.reshape(tf.convert_to_tensor(residual), [-1]), values, indices)
            self.writer.assign(residual, tf.reshape(flat, residual.shape))

    def add_back(self, keys, returned, state_updates):
        """``state_updates`` with ``returned`` (per key: ``(values, flat indices)`` this rank
        sent, each value 0 where the exchange applied it) added into the residuals' new
        values: those positions were zeroed when sent (or hold the rounding error), so each
        residual gets back exactly what was not applied. Dense ops only, never a scatter into
        the variable: after a resource scatter TensorFlow keeps a variable in copy-on-read mode
        for good, and each later dense read copies it (measured on 4.35M entries: a dense
        update took 2.4x as long ever after); the native add works in the new value's own
        buffer instead. Without error feedback there is no residual and they are dropped, as
        everything unsent is."""
        if not self.enabled or not returned:
            return list(state_updates)
        owed = {id(self.residuals[key]): item for key, item in zip(keys, returned)}
        updated = []
        for variable, value in state_updates:
            item = owed.pop(id(variable), None)
            if item is not None:
                value = scatter_add(tf.reshape(value, [-1]), *item)
            updated.append((variable, value))
        if owed:  # select() writes every sparse-route residual: nothing may be dropped
            raise RuntimeError("sparse_hvd internal error: returned entries for a residual "
                               "the step does not write")
        return updated

    def share(self, process_set=None, name="sparse_hvd.share_residuals"):
        """Make every rank's state its mean over the ranks (eager; a collective).

        Residuals are each rank's own, and a checkpoint written by rank 0 holds only rank 0's.
        After this, rank 0's copy stands for all: the sum over the ranks, the gradient still
        owed to the model, is unchanged, and it is what a restore brings back.
        """
        from ..runtime.broadcast import average_variables

        average_variables(self.local_variables, process_set=process_set, name=name)
        self.world_size.assign(runtime.size(process_set))

    def rescale_after_restore(self, process_set=None):
        """Scale restored state by saved_workers / workers, keeping its sum over the ranks."""
        self.restored = False
        with tf.init_scope():
            saved = int(tf.convert_to_tensor(self.world_size.value).numpy())
            now = runtime.size(process_set)
            if saved == now:
                return
            for variable in self.local_variables:
                self.writer.assign(variable, variable * tf.constant(saved / now, variable.dtype))
            self.world_size.assign(now)
            if runtime.rank(process_set) == 0:
                log.info("residuals saved by %d workers, restored on %d: scaled by %d/%d to "
                         "keep their sum", saved, now, saved, now)
