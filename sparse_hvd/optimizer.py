"""SparseDistributedOptimizer: a Keras 3 optimizer that exchanges sparse gradients over Horovod.

It wraps any Keras 3 optimizer the way Keras' own ``LossScaleOptimizer`` does: its own
variables (the error-feedback residuals) are made in ``build``, ``variables`` returns its own
followed by the inner optimizer's, ``learning_rate`` and ``iterations`` are the inner optimizer's,
and ``apply`` turns the local gradients into averaged ones before handing them to the inner
optimizer.
"""

import functools
import sys
import warnings
from typing import List, NamedTuple

import keras
import tensorflow as tf

from . import consistency, runtime
from .density import elements_to_send, get_density_policy, serialize_density_policy
from .error_feedback import accumulated_velocity, compensate_and_select, velocity_after_sending
from .exchange import Exchange
from .sparsifiers import get_sparsifier, serialize_sparsifier
from .staleness import DelayedExchange, PayloadLayout

try:  # the decorator Keras' own wrapper optimizers use; absent in some Keras versions
    from keras.src.utils.tracking import no_automatic_dependency_tracking
except ImportError:  # pragma: no cover
    def no_automatic_dependency_tracking(fn):
        return fn

_INDEX_BYTES = 4  # indices travel as int32

_NONFINITE_CHOICES = ("skip", "raise", "ignore")
_NONFINITE_MESSAGE = "sparse_hvd: non-finite (NaN or infinite) gradients on at least one rank."

_XLA_MESSAGE = (
    "SparseDistributedOptimizer cannot run inside an XLA-compiled function: Horovod's allgather "
    "and allreduce have no XLA lowering. Pass jit_compile=False to model.compile(...) (Keras' "
    "default jit_compile='auto' turns XLA on when a GPU is visible) or to tf.function(...)."
)


class _Route(NamedTuple):
    """How one variable's gradient travels, fixed when the optimizer is built."""

    num_elements: int
    sparse: bool  # False: dense allreduce (small, or larger sparse than dense)
    itemsize: int  # bytes per gradient value


class _Part:
    """Variables of one kind in a step: positions in the step's list, build indices, tensors."""

    def __init__(self):
        self.positions, self.keys, self.items = [], [], []

    def add(self, position, key, item):
        self.positions.append(position)
        self.keys.append(key)
        self.items.append(item)


class _Outgoing:
    """What one step sends, prepared before anything is written (see ``_outgoing``)."""

    def __init__(self):
        self.sparse = _Part()  # Selections
        self.dense = _Part()  # whole gradients, averaged by allreduce
        self.slices = _Part()  # row-sparse gradients (embeddings) on the dense route
        self.state_updates = []  # (variable, new value): written only if the step goes ahead
        self.local_finite = []  # one bool per gradient: finite on this rank
        self.gradients = []  # each gradient as processed (for timing)
        self.selected = []  # each selection's tensors (for timing)
        self.sent_per_variable = []  # (build index, entries sent)
        self.dense_bytes = 0  # what a dense float32 exchange would send
        self.bytes_sent = None  # int64 tensor: this rank's payload
        self.capped = None  # int64 tensor: selections a payload cap cut short


class _CommunicationCounters:
    """This rank's running totals, as plain tf.Variables.

    Kept out of ``variables`` on purpose: the totals are per rank (a broadcast from the root
    would overwrite them) and describe this process, not the training state a checkpoint holds.
    """

    def __init__(self, num_variables):
        def counter(name, shape=()):
            return tf.Variable(tf.zeros(shape, tf.int64), trainable=False, name=name)

        with tf.init_scope():
            self.steps = counter("steps")
            self.bytes_sent = counter("bytes_sent")
            self.dense_bytes = counter("dense_bytes")
            self.capped_selections = counter("capped_selections")
            self.skipped_steps = counter("skipped_steps")
            self.last_sent = counter("last_sent", [num_variables])  # entries, per variable
            # wall time from all gradients to all selections, and from there to all averages
            self.sparsify_seconds = tf.Variable(0.0, dtype=tf.float64, trainable=False)
            self.exchange_seconds = tf.Variable(0.0, dtype=tf.float64, trainable=False)

    def record(self, bytes_sent, dense_bytes, capped, sent_per_variable):
        self.steps.assign_add(1)
        self.bytes_sent.assign_add(tf.cast(bytes_sent, tf.int64))
        self.dense_bytes.assign_add(tf.cast(dense_bytes, tf.int64))
        self.capped_selections.assign_add(tf.cast(capped, tf.int64))
        if sent_per_variable:
            indices, counts = zip(*sent_per_variable)
            self.last_sent.scatter_nd_update(
                tf.constant([[i] for i in indices]), tf.cast(tf.stack(counts), tf.int64)
            )

    def record_times(self, gradients, selected, averaged):
        """Timestamps taken once the tensors they depend on exist (the data is used later, so
        Grappler keeps these orderings)."""
        with tf.control_dependencies(gradients):
            ready = tf.timestamp()
        with tf.control_dependencies(selected + [ready]):
            chosen = tf.timestamp()
        with tf.control_dependencies(averaged + [chosen]):
            done = tf.timestamp()
        self.sparsify_seconds.assign_add(chosen - ready)
        self.exchange_seconds.assign_add(done - chosen)

    def record_wait(self, started, done):
        """With staleness: the time a step waited for a delayed average (what was not hidden)."""
        self.exchange_seconds.assign_add(done - started)

    def as_dict(self):
        return {
            "sparsify_seconds": float(self.sparsify_seconds.numpy()),
            "exchange_seconds": float(self.exchange_seconds.numpy()),
            "steps": int(self.steps.numpy()),
            "bytes_sent": int(self.bytes_sent.numpy()),
            "dense_bytes": int(self.dense_bytes.numpy()),
            "capped_selections": int(self.capped_selections.numpy()),
            "skipped_steps": int(self.skipped_steps.numpy()),
        }


def _check_momentum_correction(momentum, optimizer):
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise ValueError(f"`momentum_correction` must be a number in [0, 1), got {momentum!r}")
    if not momentum:
        return
    if not isinstance(optimizer, keras.optimizers.SGD):
        raise ValueError(
            "`momentum_correction` replaces SGD's momentum: wrap keras.optimizers.SGD(lr) "
            f"(momentum=0), not {type(optimizer).__name__}"
        )
    if float(optimizer.momentum) != 0.0:
        raise ValueError(
            "`momentum_correction` applies the momentum itself; the inner SGD has "
            f"momentum={optimizer.momentum}, which would apply it twice. Use SGD(lr) with momentum=0."
        )


def _check_staleness(staleness, momentum_correction, policy):
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise ValueError(
            f"`staleness` must be a non-negative int (steps an update is applied late), got {staleness!r}"
        )
    if not staleness:
        return
    if momentum_correction:
        raise ValueError(
            "`staleness` > 0 cannot be combined with `momentum_correction`: use the inner "
            "optimizer's momentum (e.g. SGD(lr, momentum=0.9)) instead."
        )
    if type(policy).__name__ == "AdaptiveDensity":
        raise ValueError(
            "`staleness` > 0 cannot be combined with AdaptiveDensity, which sizes each layer to "
            "hide its exchange inside the current step; use a constant or warm-up density."
        )


_WRAPPED_MESSAGE = (
    "SparseDistributedOptimizer is wrapped in a keras LossScaleOptimizer (Keras does this in "
    "compile() under the 'mixed_float16' policy). Its overflow check runs on each rank alone, "
    "so one rank could skip a step the others take, and the job would hang in the exchange. "
    "Put the loss scaling inside instead, and tell compile not to add its own: "
    "SparseDistributedOptimizer(keras.optimizers.LossScaleOptimizer(inner), ...) with "
    "model.compile(..., auto_scale_loss=False). sparse_hvd then decides overflows on all "
    "ranks together."
)


def _wrapping_loss_scale_optimizer(optimizer, depth=6):
    """The LossScaleOptimizer whose method is building ``optimizer``, if any.

    Keras' LossScaleOptimizer.build builds its inner optimizer; there is no other hook that
    tells an optimizer it has been wrapped, so the calling frames are looked at (build runs
    once, eagerly).
    """
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        caller = frame.f_locals.get("self")
        if (isinstance(caller, keras.optimizers.LossScaleOptimizer)
                and caller.inner_optimizer is optimizer):
            return caller
        frame = frame.f_back
    return None


def _in_xla_context() -> bool:
    from tensorflow.python.ops import control_flow_util

    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def _row_gradient(grad: tf.IndexedSlices, variable) -> tf.IndexedSlices:
    """A row-sparse gradient with values in the variable's dtype."""
    return tf.IndexedSlices(tf.cast(grad.values, variable.dtype), grad.indices, grad.dense_shape)


def _dense_gradient(grad, variable) -> tf.Tensor:
    """``grad`` as a dense tensor of the variable's dtype; IndexedSlices rows are summed."""
    if isinstance(grad, tf.IndexedSlices):
        grad = tf.math.unsorted_segment_sum(grad.values, grad.indices, variable.shape[0])
    return tf.cast(grad, variable.dtype)


@keras.saving.register_keras_serializable(package="sparse_hvd")
class SparseDistributedOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras optimizer so that workers exchange only the significant part of each gradient.

    Each step, for every variable whose gradient is not None:

    1. compensate: ``c = gradient + residual`` (error feedback; the sparsifier is biased, and the
       residual carries what it left out into later steps, which is what makes 0.1%-1% density
       converge: Alistarh et al. 2018);
    2. select: the sparsifier picks entries of ``c``; for top-k, the density policy's
       ``k = ceil(density * n)`` (at least one);
    3. remember: ``residual = c`` with the selected entries set to zero, so that
       sent + residual == c exactly;
    4. exchange: the selected (values, int32 indices) of all variables go to every worker in two
       fused Horovod allgathers (values, indices); each worker scatter-adds what arrives and
       divides by the number of workers;
    5. apply: the averaged gradients go to the inner optimizer.

    Variables with fewer than ``min_elements`` entries, and those whose (value, index) pairs
    would take more bytes than the dense gradient (density near or above 1/2 for float32), skip
    steps 1-4 and are averaged with a dense ``allreduce``; their residual stays zero. With one
    worker no collective runs at all.

    Args:
        optimizer: the Keras 3 optimizer that applies the averaged gradients (SGD, Adam, ...).
        density: fraction of each variable's entries a worker sends per step, in (0, 1], or a
            density policy (``sparse_hvd.density.WarmupDensity(...)``).
        sparsifier: a registered name (``sparse_hvd.available_sparsifiers()``: "topk",
            "approx_topk", "randomk", ...) or a configured sparsifier such as
            ``sparse_hvd.sparsifiers.Threshold(threshold=0.01)``.
        error_feedback: keep and re-add what was not sent (default). False is for experiments
            that show why it matters: without it, top-k at 1% loses most of the gradient.
        momentum_correction: Deep Gradient Compression's momentum correction (Lin et al. 2018),
            for SGD-with-momentum users at low density: pass the momentum here (e.g. 0.9) and
            wrap a plain ``keras.optimizers.SGD(lr)``. Each worker then accumulates its local
            velocity ``u = m*u + g`` and sparsifies the velocity (plus residual) instead of the
            gradient, and clears the velocity of the entries it sent (momentum factor
            masking). Plain momentum applied after sparsification would instead keep pushing
            stale, already-sent values, which at 0.1% density and below costs accuracy.
            Dense-route variables get ordinary momentum on their averaged gradient.
        grouping: ``"grouped"`` (default): one fused allgather for all values and one for all
            indices per step, the fewest messages. ``"layerwise"``: each variable's exchange
            starts as soon as its own gradient is ready, overlapping the rest of backprop
            (LAGS-SGD); use it with the adaptive density policy or on slow links.
        nonfinite: what a step with a NaN or infinite gradient on any rank does. "skip" (the
            default): every rank skips it (no residual, velocity or weight is written; the inner
            optimizer's step count does not advance), counts it in
            ``communication_stats()["skipped_steps"]`` and rank 0 logs it. "raise": every rank
            stops with an InvalidArgumentError. "ignore": no check (one reduction per gradient
            and one tiny allreduce per step saved), non-finite values then enter the residuals.
        staleness: tau >= 0 (default 0: synchronous). With tau > 0 the average of step t is
            applied at step t + tau, and its exchange runs on a background thread while the next
            tau steps compute (Candela et al.: sparse updates with error feedback tolerate such
            delays; see ``sparse_hvd.staleness`` for the mechanism). The first tau steps apply
            nothing; ``model.fit`` applies what is still in flight when it ends, and a Keras
            checkpoint holds it (``hold_pending``), so a resumed job continues the same
            sequence. Every rank applies bit-identical updates at the same steps. Costs tau
            copies of the model's size in optimizer variables. Works under mpirun, horovodrun
            (MPI or Gloo) and srun alike; not with ``momentum_correction`` or the adaptive
            policy. No collective runs in the step itself: whether a step was finite on every
            rank travels with its payload, and a step that was not is skipped on every rank
            when it is due (its sent entries go back to the residuals) or stops the job.
        dense_fallback: decide per layer, when the optimizer is built, whether the sparse path
            (sparsify, allgather, scatter-add) is faster than a dense allreduce on this job's
            network and CPUs, and send densely where it is not (``sparse_hvd.routing``; timed
            on the live job, averaged over the ranks, printed by rank 0). On a fast network
            this keeps sparse_hvd from being slower than dense averaging. Off by default: the
            decision depends on timings, so two runs may route differently.
        min_elements: variables smaller than this are exchanged densely (default 1024: below a
            few kilobytes a message costs its latency, whatever its size).
        process_set: Horovod process set to average over (the whole job by default). Not
            serialised: a loaded optimizer uses the whole job.
        name: the optimizer's name; it prefixes the names of its collectives, so two of these
            optimizers in one job need different names (Keras' automatic names are fine).

    Use ``jit_compile=False``: Horovod's collectives cannot be XLA-compiled.
    """

    def __init__(
        self,
        optimizer,
        density=0.01,
        sparsifier="topk",
        min_elements=1024,
        error_feedback=True,
        momentum_correction=0.0,
        grouping="grouped",
        nonfinite="skip",
        staleness=0,
        dense_fallback=False,
        process_set=None,
        name=None,
        **kwargs,
    ):
        if keras.backend.backend() != "tensorflow":
            raise RuntimeError(
                "SparseDistributedOptimizer needs the TensorFlow backend of Keras "
                f"(KERAS_BACKEND=tensorflow); the active backend is {keras.backend.backend()!r}"
            )
        if isinstance(optimizer, type):
            raise TypeError(
                "`optimizer` must be an optimizer instance, e.g. keras.optimizers.SGD(0.1), "
                f"not the class {optimizer.__name__}"
            )
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "`optimizer` must be a Keras 3 optimizer (keras.optimizers.Optimizer), got "
                f"{type(optimizer).__module__}.{type(optimizer).__name__}"
            )
        if kwargs:
            raise ValueError(
                "SparseDistributedOptimizer does not take "
                f"`{'`, `'.join(sorted(kwargs))}`; set such options on the inner `optimizer`."
            )
        sparsify = get_sparsifier(sparsifier)
        policy = get_density_policy(density)
        if isinstance(min_elements, bool) or not isinstance(min_elements, int) or min_elements < 0:
            raise ValueError(f"`min_elements` must be a non-negative int, got {min_elements!r}")
        _check_momentum_correction(momentum_correction, optimizer)
        if nonfinite not in _NONFINITE_CHOICES:
            raise ValueError(f"`nonfinite` must be one of {_NONFINITE_CHOICES}, got {nonfinite!r}")
        _check_staleness(staleness, momentum_correction, policy)
        if not isinstance(dense_fallback, bool):
            raise TypeError(f"`dense_fallback` must be True or False, got {dense_fallback!r}")
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = optimizer
        self.density_policy = policy
        self.sparsifier = sparsify
        self.error_feedback = bool(error_feedback)
        self.momentum_correction = float(momentum_correction)
        self.nonfinite = nonfinite
        self.staleness = int(staleness)
        self.dense_fallback = dense_fallback
        self.min_elements = min_elements
        self.process_set = process_set
        self._exchange = Exchange(
            name=f"sparse_hvd.{self.name}", process_set=process_set, grouping=grouping
        )
        if isinstance(optimizer, keras.optimizers.Adafactor) and self.density < 1:
            warnings.warn(
                "Adafactor's factored second moments become 0/0 where a whole row or column of "
                "the gradient is zero, which sparse gradients often have: NaN weights were seen "
                "with sparse_hvd at density 0.05. Prefer Adam, AdamW or SGD.",
                stacklevel=2,
            )
        if type(policy).__name__ == "AdaptiveDensity" and grouping != "layerwise":
            warnings.warn(
                "AdaptiveDensity sizes each layer to hide its exchange behind the rest of "
                "backprop, which only the layer-wise exchange does: pass grouping='layerwise'.",
                stacklevel=2,
            )
        self._counters = None

    # ---- state ---------------------------------------------------------------------------------

    @no_automatic_dependency_tracking
    def build(self, var_list):
        if _wrapping_loss_scale_optimizer(self) is not None:
            raise ValueError(_WRAPPED_MESSAGE)
        var_list = list(var_list)
        self._residuals = [
            self.add_variable_from_reference(variable, name="residual") for variable in var_list
        ]
        self._velocities = []
        if self.momentum_correction:
            self._velocities = [
                self.add_variable_from_reference(variable, name="velocity") for variable in var_list
            ]
        # The number of workers the residuals belong to: saved with them, so that a restore on
        # another number of workers can keep their sum (see share_residuals).
        self._residual_world_size = self.add_variable(
            shape=(), dtype="int32", name="residual_world_size",
            initializer=keras.initializers.Constant(runtime.size(self.process_set)),
        )
        self._world_size_checked = True  # fresh residuals belong to this job
        self._routes = [self._route_for(variable) for variable in var_list]
        self._counters = _CommunicationCounters(len(var_list))
        if self.staleness:
            self._build_delayed_state(var_list)
        self.inner_optimizer.build(var_list)
        super().build(var_list)
        # Every rank must route the same variables the same way, or the exchange would hang.
        consistency.check_same_on_all_ranks(
            "the variables of the model being optimized",
            consistency.describe_variables(var_list),
            settings=self._settings(),
            process_set=self.process_set,
            name=f"sparse_hvd.{self.name}.build_check",
        )
        if self.dense_fallback:
            from .routing import choose_dense_layers

            with tf.init_scope():
                slower = choose_dense_layers(
                    self._routes, [tf.as_dtype(v.dtype).as_numpy_dtype for v in var_list],
                    self.density, self.sparsifier, self.error_feedback,
                    name=f"sparse_hvd.{self.name}", process_set=self.process_set,
                )
            for index in slower:
                self._routes[index] = self._routes[index]._replace(sparse=False)
        self.density_policy.prepare(self, var_list, self._routes)

    def _build_delayed_state(self, var_list):
        """Slots for the averages of the last ``staleness`` steps, and the step counter."""
        tau = self.staleness
        self._delayed = [
            self.add_variable(shape=(tau, *variable.shape), dtype=variable.dtype,
                              initializer="zeros", name="delayed")
            for variable in var_list
        ]
        # Which step each slot holds (-1: none). A slot is filled only by hold_pending.
        self._delayed_steps = self.add_variable(
            shape=(tau,), dtype="int64", initializer=keras.initializers.Constant(-1),
            name="delayed_steps",
        )
        self._exchange_step = self.add_variable(
            shape=(), dtype="int64", initializer="zeros", name="exchange_step"
        )
        self._pipeline = DelayedExchange(
            Exchange(name=f"sparse_hvd.{self.name}.delayed", process_set=self.process_set),
            [route.num_elements for route in self._routes],
            [tf.as_dtype(variable.dtype).as_numpy_dtype for variable in var_list],
        )

    @property
    def density(self) -> float:
        """The density the policy settles at (the constant density for a number)."""
        return self.density_policy.final_density

    def _settings(self):
        """The options that must agree on every rank (the inner optimizer's state is broadcast)."""
        return {
            "density": serialize_density_policy(self.density_policy),
            "sparsifier": serialize_sparsifier(self.sparsifier),
            "min_elements": self.min_elements,
            "error_feedback": self.error_feedback,
            "momentum_correction": self.momentum_correction,
            "grouping": self._exchange.grouping,
            "nonfinite": self.nonfinite,
            "staleness": self.staleness,
            "dense_fallback": self.dense_fallback,
        }

    def _route_for(self, variable) -> _Route:
        n = 1
        for dim in variable.shape:
            n *= int(dim)
        itemsize = tf.as_dtype(variable.dtype).size
        # Judged at the density the policy settles at: a warm-up may briefly send more.
        k = elements_to_send(n, self.density)
        sparse = n >= self.min_elements and k * (itemsize + _INDEX_BYTES) < n * itemsize
        return _Route(num_elements=n, sparse=sparse, itemsize=itemsize)

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    @property
    def residuals(self) -> List[keras.Variable]:
        """The error-feedback residuals, one per variable, in build order (rank-local state)."""
        return list(getattr(self, "_residuals", []))

    @property
    def local_variables(self) -> List[keras.Variable]:
        """State that is each rank's own and must not be broadcast: residuals and, with
        momentum correction, the local velocities."""
        return self.residuals + list(getattr(self, "_velocities", []))

    def share_residuals(self):
        """Make every rank's residuals (and local velocities) their mean over the ranks.

        Residuals are each rank's own, and a checkpoint written by rank 0 holds only rank 0's.
        Called on every rank just before such a checkpoint (``ShareResidualsCallback`` does it
        at each epoch end), it makes rank 0's copy stand for all: the sum over the ranks, the
        gradient still owed to the model, is unchanged, and it is what a restore brings back.
        Restored on a different number of workers, the residuals are scaled by
        saved_workers / workers at the first step, so that sum is kept there too. Eager; a
        collective: every rank must call it.
        """
        from .broadcast import average_variables

        if not self.built:
            return
        average_variables(self.local_variables, process_set=self.process_set,
                          name=f"sparse_hvd.{self.name}.share_residuals")
        self._residual_world_size.assign(runtime.size(self.process_set))

    def save_own_variables(self, store):
        self.hold_pending()  # the checkpoint must hold the exchanges in flight
        super().save_own_variables(store)

    def load_own_variables(self, store):
        if self.staleness and self.built:
            self._pipeline.discard()  # the restored slots replace whatever is in flight
        super().load_own_variables(store)
        self._world_size_checked = False  # restored residuals: compare their worker count

    def rescale_residuals_after_restore(self):
        """Keep the residuals' sum over ranks when restored on another number of workers.

        Runs by itself at the first step after ``keras.models.load_model``/``load_weights``;
        call it (eagerly, on every rank) after restoring a ``tf.train.Checkpoint``.
        """
        self._world_size_checked = True
        with tf.init_scope():
            saved = int(tf.convert_to_tensor(self._residual_world_size.value).numpy())
            now = runtime.size(self.process_set)
            if saved == now:
                return
            for variable in self.local_variables:
                variable.assign(variable * tf.constant(saved / now, variable.dtype))
            self._residual_world_size.assign(now)
            if runtime.rank(self.process_set) == 0:
                print(f"sparse_hvd: residuals saved by {saved} workers, restored on {now}: "
                      f"scaled by {saved}/{now} to keep their sum", file=sys.stderr, flush=True)

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        # Keras calls this at the end of fit: with staleness, the last tau averages go in now.
        self.apply_pending()
        self.inner_optimizer.finalize_variable_values(var_list)

    # ---- staleness: the delayed averages -------------------------------------------------------

    def hold_pending(self):
        """Wait for the exchanges in flight and keep their averages in optimizer variables.

        A checkpoint written afterwards holds them, and a job restored from it applies them at
        the steps they were due, as if never stopped. Keras' saving calls it by itself; call it
        before ``tf.train.Checkpoint.save``. Eager; no collective (only the rank that writes
        needs to call it). Nothing to do without staleness.
        """
        if not self.staleness or not self.built:
            return
        with tf.init_scope():
            for step in self._pipeline.pending_steps():
                result = self._pipeline.take(step)
                if not result.finite:  # nothing to apply later: undo it now
                    self._undo_step(result.own)
                    continue
                averages = result.averages
                slot = [[step % self.staleness]]
                for delayed, average in zip(self._delayed, averages):
                    delayed.value.scatter_nd_update(
                        slot, tf.reshape(tf.constant(average), [1, *delayed.shape[1:]]))
                self._delayed_steps.value.scatter_nd_update(slot, tf.constant([step], tf.int64))

    def _undo_step(self, sent):
        """A delayed step that was not finite on every rank: nothing of it is applied. What
        this rank sent goes back into its residuals (so no gradient is lost), the step is
        counted as skipped, and an inner LossScaleOptimizer lowers its scale. ``sent`` maps
        variable indices to this rank's (values, int32 flat indices); empty for the rank whose
        gradients were not finite (it wrote no residual in that step)."""
        for index, (values, indices) in sent.items():
            residual = self._residuals[index]
            flat = tf.reshape(tf.convert_to_tensor(residual), [-1])
            flat = tf.tensor_scatter_nd_add(
                flat, tf.expand_dims(tf.convert_to_tensor(indices, tf.int32), 1),
                tf.convert_to_tensor(values, flat.dtype))
            residual.assign(tf.reshape(flat, residual.shape))
        self._counters.skipped_steps.assign_add(1)
        self._report_overflow_to_loss_scaling()
        if runtime.rank(self.process_set) == 0:
            tf.print(_NONFINITE_MESSAGE, "A delayed step was skipped on every rank.",
                     output_stream=sys.stderr)

    def _release_slot(self, slot):
        """Mark a slot empty and zero it, so that every rank's slots agree again (only the
        rank that wrote a checkpoint filled them)."""
        for delayed in self._delayed:
            delayed.value.scatter_nd_update(
                [[slot]], tf.zeros([1, *delayed.shape[1:]], delayed.dtype))
        self._delayed_steps.value.scatter_nd_update([[slot]], tf.constant([-1], tf.int64))

    def apply_pending(self):
        """Apply every delayed average not applied yet, oldest first (eager, on every rank).

        ``model.fit`` calls it when it ends (through ``finalize_variable_values``), so the last
        ``staleness`` steps' updates are not lost. A later ``fit`` starts a new pipeline.
        """
        if not self.staleness or not self.built:
            return
        variables = self._trainable_variables
        with tf.init_scope():
            held = tf.convert_to_tensor(self._delayed_steps.value).numpy()
            in_slots = {int(step): slot for slot, step in enumerate(held) if step >= 0}
            for step in sorted(set(in_slots) | set(self._pipeline.pending_steps())):
                if step in in_slots:
                    averages = [tf.gather(d.value, in_slots[step]) for d in self._delayed]
                    self._release_slot(in_slots[step])
                else:
                    result = self._pipeline.take(step)
                    if not result.finite:
                        self._undo_step(result.own)
                        continue
                    averages = result.averages
                self._apply_inner(
                    [tf.reshape(tf.convert_to_tensor(a), v.shape) for a, v in zip(averages, variables)],
                    variables,
                )

    def communication_stats(self):
        """This rank's totals since the optimizer was built.

        ``steps``: exchanged steps (skipped ones included); ``bytes_sent``: payload this rank
        contributed (values, indices and densely averaged gradients); ``dense_bytes``: what a
        dense float32 exchange of the same gradients would have sent; ``capped_selections``:
        selections a payload cap cut short; ``skipped_steps``: steps skipped for non-finite
        gradients; ``sparsify_seconds``: wall time from all gradients to all selections;
        ``exchange_seconds``: from there to all averaged gradients (with the layer-wise
        exchange the two overlap backprop and each other, so they are spans, not costs). With
        ``staleness`` > 0, ``exchange_seconds`` is the time steps spent waiting for a delayed
        average: the part of the exchange the computation did not hide.
        """
        if self._counters is None:
            return {"steps": 0, "bytes_sent": 0, "dense_bytes": 0, "capped_selections": 0,
                    "skipped_steps": 0, "sparsify_seconds": 0.0, "exchange_seconds": 0.0}
        return self._counters.as_dict()

    def layer_stats(self):
        """Per variable (by path): entries, route, and entries/density sent in the last step."""
        if self._counters is None:
            return {}
        last = self._counters.last_sent.numpy()
        step = self.inner_optimizer.iterations
        stats = {}
        for index, (variable, route) in enumerate(zip(self._trainable_variables, self._routes)):
            stats[variable.path] = {
                "elements": route.num_elements,
                "route": "sparse" if route.sparse else "dense",
                "target_density": (
                    self.density_policy.current_density(index, step) if route.sparse else 1.0
                ),
                "last_sent": int(last[index]),
                "last_density": float(last[index]) / route.num_elements,
            }
        return stats

    # ---- the step ------------------------------------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        if _in_xla_context():
            raise ValueError(_XLA_MESSAGE)
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "Pass `trainable_variables` on the first call, or call "
                    "`optimizer.build(trainable_variables)` first."
                )
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        grads = list(grads)
        if len(grads) != len(trainable_variables):
            raise ValueError(
                f"Got {len(grads)} gradients for {len(trainable_variables)} variables; "
                "pass one gradient (or None) per variable."
            )
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        self._check_variables_are_known(trainable_variables)
        if not self._world_size_checked:
            self.rescale_residuals_after_restore()

        present = [(g, v) for g, v in zip(grads, trainable_variables) if g is not None]
        if self.staleness:
            with tf.name_scope("delayed_exchange"):
                self._apply_delayed(present)
            return
        if not present:
            return
        with tf.name_scope("sparse_exchange"):
            averaged, state_updates, finite = self._average_gradients(present)

        def commit():
            for variable, value in state_updates:
                variable.assign(tf.reshape(value, variable.shape))
            self._apply_inner(averaged, [v for _, v in present])

        self._go_ahead_if_finite(finite, commit)

    def _go_ahead_if_finite(self, finite, commit):
        """Run ``commit`` if every rank's gradients were finite; else skip or stop (``nonfinite``)."""

        def skip():
            self._counters.skipped_steps.assign_add(1)
            self._report_overflow_to_loss_scaling()
            if runtime.rank(self.process_set) == 0:
                tf.print(_NONFINITE_MESSAGE, "The step was skipped on every rank.",
                         output_stream=sys.stderr)

        if self.nonfinite == "skip":
            tf.cond(finite, commit, skip)
        elif self.nonfinite == "raise":
            with tf.control_dependencies([tf.debugging.Assert(finite, [_NONFINITE_MESSAGE])]):
                commit()  # nothing is written unless the check passed
        else:
            commit()

    # ---- loss scaling (an inner keras LossScaleOptimizer) ---------------------------------------

    def _loss_scale(self):
        """The inner LossScaleOptimizer's current scale (a power of two), or None."""
        if isinstance(self.inner_optimizer, keras.optimizers.LossScaleOptimizer):
            return self.inner_optimizer.dynamic_scale
        return None

    def _unscaled(self, grad):
        """Gradients arrive multiplied by the loss scale; residuals and the exchange work on
        true gradients, so that a change of scale never mixes units in a residual. Dividing
        by a power of two is exact."""
        scale = self._loss_scale()
        if scale is None:
            return grad
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(grad.values / tf.cast(scale, grad.values.dtype), grad.indices,
                                    grad.dense_shape)
        return grad / tf.cast(scale, grad.dtype)

    def _apply_inner(self, grads, variables):
        """Hand averaged true gradients to the inner optimizer (re-scaled for a
        LossScaleOptimizer, which divides by its scale again: exact both ways)."""
        scale = self._loss_scale()
        if scale is not None:
            grads = [
                tf.IndexedSlices(g.values * tf.cast(scale, g.values.dtype), g.indices, g.dense_shape)
                if isinstance(g, tf.IndexedSlices) else g * tf.cast(scale, g.dtype)
                for g in grads
            ]
        self.inner_optimizer.apply(grads, variables)

    def _report_overflow_to_loss_scaling(self):
        """A skipped step must still lower an inner LossScaleOptimizer's scale, or the next
        steps would overflow again: its own non-finite path is taken with one NaN gradient."""
        if self._loss_scale() is None:
            return
        variables = self._trainable_variables
        nan = tf.fill(variables[0].shape, tf.constant(float("nan"), variables[0].dtype))
        self.inner_optimizer.apply([nan] + [None] * (len(variables) - 1), variables)

    def _policy_step(self):
        """The step the density policy sees: exchanged steps with staleness, else applied ones."""
        return self._exchange_step if self.staleness else self.inner_optimizer.iterations

    def _apply_delayed(self, grads_and_vars):
        """One step with staleness tau (``sparse_hvd.staleness``): hand this step's payload and
        this rank's finiteness to the pipeline, then apply the average of step t - tau.

        No collective runs here: whether a step was finite on every rank travels with its
        payload and is acted on when the step is due (``nonfinite``: skip it on every rank and
        give this rank's sent entries back to its residuals, or stop).
        """
        step = tf.convert_to_tensor(self._exchange_step.value)
        layout = PayloadLayout((), ())
        if grads_and_vars:
            out = self._outgoing(grads_and_vars, keep_rows=False)
            finite = (tf.reduce_all(tf.stack(out.local_finite)) if out.local_finite
                      else tf.constant(True))
            layout = PayloadLayout(tuple(out.sparse.keys), tuple(out.dense.keys))
            payload = [t for s in out.sparse.items for t in (s.values, s.indices)]
            payload += [tf.reshape(g, [-1]) for g in out.dense.items]
            self._counters.record(out.bytes_sent, out.dense_bytes, out.capped, out.sent_per_variable)
            self._counters.record_times(out.gradients, out.selected, [])

            def write_state():
                for variable, value in out.state_updates:
                    variable.assign(tf.reshape(value, variable.shape))

            def keep_state():  # this rank's gradients were not finite: write nothing
                pass

            tf.cond(finite, write_state, keep_state)
            tf.numpy_function(functools.partial(self._pipeline.submit, layout),
                              [step, finite] + payload, tf.int64, stateful=True, name="submit")
            self.density_policy.end_step(step)
        self._apply_average_of(step - self.staleness, layout)
        self._exchange_step.assign_add(1)

    def _apply_average_of(self, due, layout):
        """Apply step ``due``'s average: from the slots after a restore, else from the pipeline
        (waiting for it if it has not arrived); nothing for a step never exchanged; undo it if
        it was not finite on every rank."""
        variables = self._trainable_variables
        dtypes = [tf.as_dtype(v.dtype) for v in variables]
        sent_dtypes = [t for i in layout.sparse for t in (dtypes[i], tf.int32)]
        slot = tf.math.floormod(due, self.staleness)
        held = tf.equal(tf.gather(self._delayed_steps.value, slot), due)

        def from_slots():
            averages = [tf.reshape(tf.gather(d.value, slot), [-1]) for d in self._delayed]
            with tf.control_dependencies(averages):
                self._release_slot(slot)
            nothing_sent = [tf.zeros([0], t) for t in sent_dtypes]
            return ([tf.constant(True), tf.constant(True)] + [tf.identity(a) for a in averages]
                    + nothing_sent)

        def from_pipeline():
            taken = tf.numpy_function(functools.partial(self._pipeline.take_for_step, layout),
                                      [due], [tf.bool, tf.bool] + dtypes + sent_dtypes,
                                      stateful=True, name="take")
            taken[0].set_shape([])
            taken[1].set_shape([])
            for average, route in zip(taken[2:], self._routes):
                average.set_shape([route.num_elements])
            for sent in taken[2 + len(variables):]:
                sent.set_shape([None])
            return taken

        started = tf.timestamp()
        with tf.control_dependencies([started]):
            results = tf.cond(tf.logical_and(due >= 0, held), from_slots, from_pipeline)
        present, finite = results[0], results[1]
        averages = results[2:2 + len(variables)]
        sent = results[2 + len(variables):]
        with tf.control_dependencies(averages):
            self._counters.record_wait(started, tf.timestamp())
        grads = [tf.reshape(a, v.shape) for a, v in zip(averages, variables)]

        def apply():
            self._apply_inner(grads, variables)

        def undo():
            pairs = {index: (sent[2 * j], sent[2 * j + 1]) for j, index in enumerate(layout.sparse)}
            self._undo_step(pairs)

        def nothing_due():
            pass

        if self.nonfinite == "raise":
            failed = tf.logical_and(present, tf.logical_not(finite))
            with tf.control_dependencies([tf.debugging.Assert(tf.logical_not(failed), [_NONFINITE_MESSAGE])]):
                tf.cond(present, apply, nothing_due)
        else:
            tf.cond(present, lambda: tf.cond(finite, apply, undo), nothing_due)

    def _outgoing(self, grads_and_vars, keep_rows=True) -> _Outgoing:
        """Steps 1-3 of the class doc for every (gradient, variable) pair, without writing state.

        ``keep_rows``: an embedding's row-sparse gradient on the dense route travels as rows
        (False densifies it, as the delayed pipeline needs).
        """
        out = _Outgoing()
        bytes_sent = tf.constant(0, tf.int64)
        capped = tf.constant(0, tf.int64)
        step = self._policy_step()
        order = range(len(grads_and_vars))
        if self._exchange.grouping == "layerwise":
            order = reversed(order)  # backprop's order: the output layers' gradients come first
        for position in order:
            grad, variable = grads_and_vars[position]
            index = self._get_variable_index(variable)
            route = self._routes[index]
            rows = (
                keep_rows and isinstance(grad, tf.IndexedSlices) and not route.sparse
                and not self.momentum_correction
            )
            grad = _row_gradient(grad, variable) if rows else _dense_gradient(grad, variable)
            grad = self._unscaled(grad)
            values = grad.values if rows else grad
            out.gradients.append(values)
            self.density_policy.gradient_ready(index, values)
            if self.nonfinite != "ignore":
                # A sum is non-finite iff an entry is (or it overflows 3e38): one cheap pass.
                out.local_finite.append(tf.math.is_finite(tf.reduce_sum(values)))
            out.dense_bytes += route.num_elements * 4
            if rows:  # an embedding's rows on the dense route: exchanged as rows
                out.slices.add(position, index, grad)
                sent = tf.cast(tf.size(grad.values), tf.int64)
                num_rows = tf.cast(tf.size(grad.indices), tf.int64)
                bytes_sent += sent * route.itemsize + num_rows * grad.indices.dtype.size
            elif route.sparse:
                if self.momentum_correction:
                    grad = accumulated_velocity(grad, self._velocities[index], self.momentum_correction)
                k = self.density_policy.k(index, route.num_elements, step)
                selection, remainder = compensate_and_select(
                    grad, self._residuals[index], self.sparsifier, k, self.error_feedback
                )
                if remainder is not None:
                    out.state_updates.append((self._residuals[index], remainder))
                if self.momentum_correction:
                    out.state_updates.append(
                        (self._velocities[index], velocity_after_sending(grad, selection))
                    )
                out.sparse.add(position, index, selection)
                out.selected += [selection.values, selection.indices]
                sent = tf.cast(tf.size(selection.values), tf.int64)
                bytes_sent += sent * (route.itemsize + _INDEX_BYTES)
                if selection.capped is not None:
                    capped += tf.cast(selection.capped, tf.int64)
            else:
                out.dense.add(position, index, grad)
                sent = route.num_elements
                bytes_sent += route.num_elements * route.itemsize
            out.sent_per_variable.append((index, sent))
        out.bytes_sent, out.capped = bytes_sent, capped
        return out

    def _average_gradients(self, grads_and_vars):
        """Steps 1-4 of the class doc, without writing any state.

        Returns ``(averaged, state_updates, finite)``: the averaged gradient of each pair in the
        same order; the (variable, new value) pairs of the residuals and velocities, which
        ``apply`` writes only if the step goes ahead; and whether every rank's gradients were
        finite (the same answer on every rank; True when ``nonfinite="ignore"``).
        """
        out = self._outgoing(grads_and_vars)
        state_updates = list(out.state_updates)
        averaged = [None] * len(grads_and_vars)
        sizes = [self._routes[index].num_elements for index in out.sparse.keys]
        for position, flat in zip(
            out.sparse.positions, self._exchange.sparse_average(out.sparse.items, sizes, out.sparse.keys)
        ):
            averaged[position] = tf.reshape(flat, grads_and_vars[position][1].shape)
        for position, grad in zip(
            out.dense.positions, self._exchange.dense_average(out.dense.items, out.dense.keys)
        ):
            if self.momentum_correction:
                velocity = self._velocities[self._get_variable_index(grads_and_vars[position][1])]
                grad = accumulated_velocity(grad, velocity, self.momentum_correction)
                state_updates.append((velocity, grad))
            averaged[position] = grad
        for position, grad in zip(
            out.slices.positions, self._exchange.slices_average(out.slices.items, out.slices.keys)
        ):
            averaged[position] = grad
        finite = self._finite_on_every_rank(out.local_finite)
        self._counters.record(out.bytes_sent, out.dense_bytes, out.capped, out.sent_per_variable)
        self._counters.record_times(
            out.gradients, out.selected,
            [a.values if isinstance(a, tf.IndexedSlices) else a for a in averaged],
        )
        with tf.control_dependencies(averaged):  # re-measure after this step's traffic
            self.density_policy.end_step(self._policy_step())
        return averaged, state_updates, finite

    def _finite_on_every_rank(self, local_finite):
        """True iff every rank's gradients are finite: one tiny allreduce, the same everywhere."""
        if self.nonfinite == "ignore":
            return tf.constant(True)
        bad = tf.cast(tf.logical_not(tf.reduce_all(tf.stack(local_finite))), tf.float32)
        if runtime.size(self.process_set) > 1:
            hvd = runtime.horovod()
            bad = hvd.allreduce(
                bad, op=hvd.Sum, name=f"sparse_hvd.{self.name}.nonfinite", ignore_name_scope=True,
                process_set=runtime.process_set_or_global(self.process_set),
            )
        return tf.equal(bad, 0.0)

    # ---- serialisation -------------------------------------------------------------------------

    def get_config(self):
        # Like LossScaleOptimizer: the base optimizer's options belong to the inner optimizer.
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            **self._settings(),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)
