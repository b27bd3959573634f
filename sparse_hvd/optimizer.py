"""SparseDistributedOptimizer: a Keras 3 optimizer that exchanges sparse gradients over Horovod.

It wraps any Keras 3 optimizer the way Keras' own ``LossScaleOptimizer`` does: its own
variables (the error-feedback residuals) are made in ``build``, ``variables`` returns its own
followed by the inner optimizer's, ``learning_rate`` and ``iterations`` are the inner optimizer's,
and ``apply`` turns the local gradients into averaged ones before handing them to the inner
optimizer.

This module is the Keras wrapper only. Each stage of a step has its own module, and ``apply``
reads as the list of them:

* ``payload``: routes, and what one step sends (built by :meth:`_payload`);
* ``error_feedback``: residuals and DGC velocities, and their lifecycle;
* ``steps``: how a step runs, chosen once: synchronous, or delayed (``staleness`` over
  ``pipeline``);
* ``exchanges`` (over ``collectives``): the averages over the workers, one module per exchange;
* ``nonfinite``: every rank's agreement on finite gradients, and the skip/raise guard;
* ``loss_scaling``: an inner LossScaleOptimizer's scale on the way in and out;
* ``accumulation``: ``backward_passes_per_step``; ``compression``: 16-bit values on the wire;
* ``lockstep``: every rank in the same step; ``watchdog`` (in ``collectives``): no endless wait;
* ``stats``: the counters behind ``communication_stats()`` and ``layer_stats()``;
* ``checks``: argument checks and their messages.
"""

import contextlib
import functools
from typing import List

import keras
import numpy as np
import tensorflow as tf

from . import checks, consistency, lockstep, nonfinite, runtime
from . import clipping as clipping_rules
from .accumulation import LocalAccumulation, take_over_keras_accumulation
from .compression import Compression
from .defaults import resolve_density
from .density import serialize_density_policy
from .error_feedback import ErrorFeedback
from .exchanges import create as create_exchange
from .loss_scaling import LossScaling
from .payload import PayloadBuilder, route_for
from .sparsifiers import get_sparsifier, serialize_sparsifier
from .steps import DelayedStep, SynchronousStep
from .stats import EMPTY, CommunicationCounters, layer_stats

try:  # the decorator Keras' own wrapper optimizers use; absent in some Keras versions
    from keras.src.utils.tracking import no_automatic_dependency_tracking
except ImportError:  # pragma: no cover
    def no_automatic_dependency_tracking(fn):
        return fn


# The base optimizer's options that belong to the inner optimizer (it applies them to the
# averaged gradients); on the wrapper they read and write the inner optimizer's.
INNER_OPTIONS = ("weight_decay", "clipnorm", "global_clipnorm", "clipvalue", "use_ema",
                 "ema_momentum", "ema_overwrite_frequency", "loss_scale_factor")


def _inner_option(option):
    """A property that forwards ``option`` to the inner optimizer (ignored while the base
    constructor sets its defaults, before there is an inner optimizer, and unset while the
    base build runs: the inner optimizer's EMA copies and accumulators are its own)."""
    def get(self):
        inner = self.__dict__.get("inner_optimizer")
        if inner is None or self.__dict__.get("_building_base"):
            return None
        return getattr(inner, option)

    def set_(self, value):
        inner = self.__dict__.get("inner_optimizer")
        if inner is not None:
            setattr(inner, option, value)

    return property(get, set_, doc=f"The inner optimizer's ``{option}``.")


def _write_through(inner, wrapper):
    """Make ``inner`` write its variables through ``wrapper``'s assign methods (looked up at
    each call, so an override or a patch of the wrapper's sees them)."""
    for method in ("assign", "assign_add", "assign_sub"):
        setattr(inner, method, functools.partial(_write, wrapper, method))


def _write(wrapper, method, variable, value):
    return getattr(wrapper, method)(variable, value)


def _with_tensor_parts(grad):
    """An IndexedSlices gradient with tensors for values and indices (Keras accepts Python
    sequences there)."""
    if isinstance(grad, tf.IndexedSlices) and not (
            tf.is_tensor(grad.indices) and tf.is_tensor(grad.values)):
        return tf.IndexedSlices(tf.convert_to_tensor(grad.values),
                                tf.convert_to_tensor(grad.indices), grad.dense_shape)
    return grad


def _as_rows(grad: tf.IndexedSlices, variable) -> tf.IndexedSlices:
    """A row-sparse gradient with values in the variable's dtype."""
    return tf.IndexedSlices(tf.cast(grad.values, variable.dtype), grad.indices, grad.dense_shape)


def _as_dense(grad, variable) -> tf.Tensor:
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
    4. exchange: the selected (values, int32 indices) of all variables, each rank's finiteness
       flag and the small dense-route gradients go to every worker in ONE fused Horovod
       allgather; each worker adds what arrives in rank order and divides by the number of
       workers (``sparse_hvd.exchanges``);
    5. apply: the averaged gradients go to the inner optimizer.

    Variables with fewer than ``min_elements`` entries, and those whose (value, index) pairs
    would take more bytes than the dense gradient (density near or above 1/2 for float32), skip
    steps 1-4 and are averaged with a dense ``allreduce``; their residual stays zero. With one
    worker no collective runs at all.

    Args:
        optimizer: the Keras 3 optimizer that applies the averaged gradients (SGD, Adam, ...).
        density: fraction of each variable's entries a worker sends per step, in (0, 1], or a
            density policy (``sparse_hvd.density.WarmupDensity(...)``). A number below 25% is
            reached after a warm-up (``warmup_steps``).
        warmup_steps: the default warm-up (``sparse_hvd.defaults``): a numeric ``density``
            starts at 25% and decays exponentially to its value over this many steps (None:
            200). 0: the density is constant from the first step (the behaviour before the
            warm-up became the default). Ignored when ``density`` is a policy object.
        budget: ``"layer"`` (default): each variable sends its own k. ``"model"``: one budget
            for the whole model, the sum of the variables' k, spent on the entries of largest
            magnitude over all sparse variables together (``sparse_hvd.model_budget``; with
            the layer-wise exchange it waits for every gradient, so nothing overlaps).
        clipping: ``"after"`` (default): the inner optimizer's ``clipnorm``,
            ``global_clipnorm`` or ``clipvalue`` acts on the averaged gradient, as without
            sparse_hvd. ``"local"``: each rank clips its own gradient before error feedback
            (norms with the threshold times N^-1/2) and the average is not clipped again
            (DGC's local gradient clipping; ``sparse_hvd.clipping``).
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
        momentum_masking: with ``momentum_correction``, clear the local velocity of the entries
            sent (DGC's masking; default). False keeps the velocity, so the entries sent over
            the run add up to exactly what dense momentum SGD applies (error feedback on the
            momentum update).
        grouping: ``"grouped"`` (default): one fused collective per step, the fewest
            negotiation rounds. ``"layerwise"``: each variable's exchange
            starts as soon as its own gradient is ready, overlapping the rest of backprop
            (LAGS-SGD); use it with the adaptive density policy or on slow links.
        nonfinite: what a step with a NaN or infinite gradient on any rank does. "skip" (the
            default): every rank skips it (no residual, velocity or weight is written; the inner
            optimizer's step count does not advance), counts it in
            ``communication_stats()["skipped_steps"]`` and rank 0 logs it. "raise": every rank
            stops with an InvalidArgumentError. "ignore": no check (one reduction per gradient
            saved, and one tiny allreduce per step with the layer-wise exchange), non-finite values then enter the residuals.
        staleness: tau >= 0 (default 0: synchronous). With tau > 0 the average of step t is
            applied at step t + tau, and its exchange runs on a background thread while the next
            tau steps compute (Candela et al.: sparse updates with error feedback tolerate such
            delays; see ``sparse_hvd.staleness`` for the mechanism). The first tau steps apply
            nothing; ``model.fit`` applies what is still in flight when it ends, and a Keras
            checkpoint holds it (``hold_pending``), so a resumed job continues the same
            sequence. Every rank applies bit-identical updates at the same steps. Costs tau
            copies of the model's size in optimizer variables. Works under mpirun, horovodrun
            (MPI or Gloo) and srun alike; not with the adaptive policy. With
            ``momentum_correction`` the velocity is corrected and masked when a step is sent,
            and dense-route variables get their momentum when their average is applied. No
            collective runs in the step itself: whether a step was finite on every rank
            travels with its payload, and a step that was not is skipped on every rank when it
            is due (its sent entries go back to the residuals) or stops the job.
        dense_fallback: decide per layer, when the optimizer is built, whether the sparse path
            (sparsify, allgather, scatter-add) is faster than a dense allreduce on this job's
            network and CPUs, and send densely where it is not (``sparse_hvd.routing``; timed
            on the live job, averaged over the ranks, printed by rank 0). On a fast network
            this keeps sparse_hvd from being slower than dense averaging. Off by default: the
            decision depends on timings, so two runs may route differently.
        exchange: how the selections meet. ``"allgather"`` (default): every rank gathers every
            rank's selection and applies their average: (N - 1) k entries received per worker
            and step, best for a few workers. ``"sparse_allreduce"``
            (``sparse_hvd.exchanges.sparse_allreduce``, after Ok-Topk and SparCML): each rank sums one region of the
            index space and keeps the entries whose sum passes a global threshold (about k per
            layer), so about 2k (N - 1) / N entries per worker, flat in N; it applies a global
            top-k of the SUM of the selections, not the average of every selection, and what
            was sent but not kept goes back to the sender's residual (``grouping="layerwise"``:
            one per variable). Not with ``staleness``. ``"dense"``:
            Horovod's allreduce of every gradient (nothing selected). ``"auto"``: when the
            optimizer is built, whichever of those that can run the other options a latency /
            bandwidth model timed on the live job says is fastest for this N and density
            (the same choice on every rank, printed by rank 0, in ``layer_stats()``). The
            exchanges are plug-ins: ``sparse_hvd.exchanges``.
        compression: ``"none"`` (default), ``"float16"`` or ``"bfloat16"``: float32 gradient
            values travel as 16-bit floats, sparse and dense routes alike, and the rounding
            error stays in the residual (``sparse_hvd.compression``): half the value bytes, and
            unlike Horovod's fp16 compression nothing is lost. With every exchange and with
            ``staleness`` (the sparse allreduce sends 16-bit values to the owners; their sums
            travel in the gradients' dtype).
        backward_passes_per_step: B >= 1 (Horovod's name and meaning): each rank adds up B
            backward passes locally and exchanges once, so the bytes per sample drop B-fold; the
            inner optimizer steps once per B passes (``iterations`` counts exchanges). Keras'
            ``fit`` calls the optimizer once per batch: B batches make one step. Passes left over
            when ``fit`` ends stay in the accumulators (and in checkpoints). With
            ``staleness``, the B passes' sum is what the delayed step exchanges. See
            ``sparse_hvd.accumulation``.
        average_aggregated_gradients: with B > 1, divide the sum of the B passes by B (Keras'
            own accumulation averages; Horovod's default, False, sums).
        min_elements: variables smaller than this are exchanged densely (default 1024: below a
            few kilobytes a message costs its latency, whatever its size).
        process_set: Horovod process set to average over (the whole job by default), or an
            mpi4py communicator registered with ``sparse_hvd.init(process_sets=[...])``. Not
            serialised: a loaded optimizer uses the whole job.
        name: the optimizer's name; it prefixes the names of its collectives, so two of these
            optimizers in one job need different names (Keras' automatic names are fine).

    Use ``jit_compile=False``: Horovod's collectives cannot be XLA-compiled.

    The base optimizer's options (``clipnorm``, ``clipvalue``, ``global_clipnorm``,
    ``weight_decay``, ``use_ema``, ``loss_scale_factor``) are the inner optimizer's: set them
    there; they act on the averaged gradient, identically on every rank, and read through the
    wrapper (``model.optimizer.clipnorm``) they give the inner optimizer's values.
    ``exclude_from_weight_decay`` and ``set_weights`` reach the inner optimizer too.
    Keras' ``gradient_accumulation_steps=B`` on the inner optimizer is taken over by the wrapper
    (``sparse_hvd.accumulation``): B passes averaged locally, one exchange, one inner step.
    The inner optimizer writes its variables through the wrapper's ``assign``,
    ``assign_add`` and ``assign_sub``, as the wrapper writes its own (Keras' rule for
    optimizers: a subclass that overrides them sees every write of the step).
    """

    for _option in INNER_OPTIONS:
        locals()[_option] = _inner_option(_option)
    del _option

    @property
    def gradient_accumulation_steps(self):
        """Keras' gradient accumulation, taken over from the inner optimizer (None: off)."""
        if self.__dict__.get("_building_base"):
            return None
        return self.__dict__.get("_keras_accumulation")

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value):
        # the base constructor sets None before there is an inner optimizer
        if "inner_optimizer" in self.__dict__ and value != self.gradient_accumulation_steps:
            raise ValueError("`gradient_accumulation_steps` is fixed when the optimizer is "
                             "wrapped: set it on the inner optimizer before wrapping it")

    def __init__(
        self,
        optimizer,
        density=0.01,
        sparsifier="topk",
        min_elements=1024,
        error_feedback=True,
        momentum_correction=0.0,
        momentum_masking=True,
        warmup_steps=None,
        budget="layer",
        clipping="after",
        grouping="grouped",
        nonfinite="skip",
        staleness=0,
        dense_fallback=False,
        exchange="allgather",
        compression="none",
        backward_passes_per_step=1,
        average_aggregated_gradients=False,
        process_set=None,
        name=None,
        **kwargs,
    ):
        checks.check_backend()
        checks.check_inner_optimizer(optimizer, SparseDistributedOptimizer)
        keras_accumulation = take_over_keras_accumulation(optimizer, backward_passes_per_step)
        checks.check_no_base_options(kwargs)
        sparsify = get_sparsifier(sparsifier)
        policy = resolve_density(density, warmup_steps)
        clipping_rules.check(clipping)
        checks.check_min_elements(min_elements)
        checks.check_momentum_correction(momentum_correction, optimizer)
        checks.check_nonfinite(nonfinite)
        checks.check_staleness(staleness, policy)
        checks.check_boolean(error_feedback, "error_feedback")
        checks.check_boolean(momentum_masking, "momentum_masking")
        checks.check_boolean(dense_fallback, "dense_fallback")
        process_set = runtime.as_process_set(process_set)  # an mpi4py communicator too
        checks.check_process_set(process_set)
        checks.check_backward_passes(backward_passes_per_step)
        wire_compression = Compression(compression)
        candidates = checks.exchange_candidates(exchange, grouping, staleness, policy,
                                                wire_compression)
        checks.check_boolean(average_aggregated_gradients, "average_aggregated_gradients")
        super().__init__(learning_rate=0.0, name=name)
        self._keras_accumulation = keras_accumulation
        self.inner_optimizer = optimizer
        _write_through(optimizer, self)
        self.density_policy = policy
        self.warmup_steps = getattr(policy, "warmup_steps", 0)
        self.sparsifier = sparsify
        self.error_feedback = bool(error_feedback)
        self.momentum_correction = float(momentum_correction)
        self.momentum_masking = bool(momentum_masking)
        if budget not in ("layer", "model"):
            raise ValueError(f"`budget` must be 'layer' or 'model', got {budget!r}")
        self.budget = budget
        self.clipping = clipping
        self.nonfinite = nonfinite
        self.staleness = int(staleness)
        self.dense_fallback = bool(dense_fallback)
        self.min_elements = min_elements
        self.process_set = process_set
        self.exchange = exchange
        self.compression = wire_compression.name
        self._compression = wire_compression  # the one object every stage uses
        self._exchange_candidates = candidates  # exchange="auto" chooses among them at build
        first = "allgather" if "allgather" in candidates else candidates[0]
        self._exchange = create_exchange(first, grouping, name=self._prefix,
                                         process_set=process_set, compression=wire_compression)
        self._feedback = ErrorFeedback(self.error_feedback, self.momentum_correction,
                                       self.momentum_masking)
        self._loss_scaling = LossScaling(optimizer)
        # how a step runs (sparse_hvd.steps), chosen once
        self._step = DelayedStep(self, staleness) if staleness else SynchronousStep(self)
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.average_aggregated_gradients = bool(average_aggregated_gradients)
        self._accumulation = (
            LocalAccumulation(keras_accumulation, average=True) if keras_accumulation
            else LocalAccumulation(backward_passes_per_step, average_aggregated_gradients)
            if backward_passes_per_step > 1 else None)
        self._counters = None
        checks.warn_about_poor_combinations(optimizer, policy, grouping, self.density)

    @property
    def _prefix(self):
        """What the names of this optimizer's collectives start with."""
        return f"sparse_hvd.{self.name}"

    # ---- state ---------------------------------------------------------------------------------

    @no_automatic_dependency_tracking
    def build(self, var_list):
        """Make the optimizer's variables (their order is the checkpoint format: residuals,
        velocities, the residuals' worker count, the staleness slots, then the inner
        optimizer's, then a density policy's), fix each variable's route, and check that every
        rank builds the same."""
        checks.check_not_wrapped_in_loss_scaling(self)
        var_list = list(var_list)
        self._feedback.build(self, var_list, self.process_set)
        self._routes = [route_for(v, self.density, self.min_elements, self._compression)
                        for v in var_list]
        if not self._exchange.sends_selections:  # exchange="dense"
            self._routes = [route._replace(sparse=False) for route in self._routes]
        checks.check_index_range(var_list, self._routes)
        self._counters = CommunicationCounters(len(var_list))
        self._step.build(var_list, self._routes)
        self.inner_optimizer.build(var_list)
        self._building_base = True  # the base build must not copy the inner optimizer's state
        try:
            super().build(var_list)
        finally:
            self._building_base = False
        self._legacy_ema_at = len(self._variables)  # see load_own_variables
        # Every rank must route the same variables the same way, or the exchange would hang.
        consistency.check_same_on_all_ranks(
            "the model's variables or the optimizer's settings",
            consistency.describe_variables(var_list),
            settings={"name": self.name, **self._settings(),
                      "gradient_accumulation_steps": self.gradient_accumulation_steps},
            process_set=self.process_set,
            name="sparse_hvd.build_check",  # not the optimizer's name: it may differ by rank
        )
        if self.dense_fallback:
            self._route_densely_where_faster(var_list)
        if self.exchange == "auto" and not self.staleness:  # the delayed pipeline gathers
            self._choose_exchange()
        self.density_policy.prepare(self, var_list, self._routes)
        self._exchange.build(self, self._routes)
        if self._accumulation:
            self._accumulation.build(self, var_list)

    def _choose_exchange(self):
        """``exchange="auto"``: the exchange the cost model says is fastest on this job
        (``sparse_hvd.exchange_choice``; the same on every rank). "dense" routes every layer
        densely."""
        from .exchange_choice import choose_exchange

        with tf.init_scope():
            choice, _ = choose_exchange(self._routes, self.density, name=self._prefix,
                                        process_set=self.process_set,
                                        candidates=self._exchange_candidates)
        if choice == "dense":
            self._routes = [route._replace(sparse=False) for route in self._routes]
        self._exchange = create_exchange(choice, self._exchange.grouping, name=self._prefix,
                                         process_set=self.process_set,
                                         compression=self._compression)

    def _route_densely_where_faster(self, var_list):
        """``dense_fallback``: the layers a dense allreduce moves faster go dense
        (``sparse_hvd.routing``; timed on the live job, the same decision on every rank)."""
        from .routing import choose_dense_layers

        with tf.init_scope():
            slower = choose_dense_layers(
                self._routes, [tf.as_dtype(v.dtype).as_numpy_dtype for v in var_list],
                self.density, self.sparsifier, self.error_feedback,
                name=self._prefix, process_set=self.process_set,
            )
        for index in slower:
            self._routes[index] = self._routes[index]._replace(sparse=False)

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
            "momentum_masking": self.momentum_masking,
            "warmup_steps": self.warmup_steps,
            "budget": self.budget,
            "clipping": self.clipping,
            "grouping": self._exchange.grouping,
            "nonfinite": self.nonfinite,
            "staleness": self.staleness,
            "dense_fallback": self.dense_fallback,
            "exchange": self.exchange,
            "compression": self.compression,
            "backward_passes_per_step": self.backward_passes_per_step,
            "average_aggregated_gradients": self.average_aggregated_gradients,
        }

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    @property
    def residuals(self) -> List[keras.Variable]:
        """The error-feedback residuals, one per variable, in build order (rank-local state)."""
        return list(self._feedback.residuals)

    @property
    def local_variables(self) -> List[keras.Variable]:
        """State that is each rank's own and must not be broadcast: residuals and, with
        momentum correction, the local velocities; with ``backward_passes_per_step``, the
        accumulated gradients."""
        accumulated = list(self._accumulation.accumulators) if self._accumulation else []
        return self._feedback.local_variables + accumulated

    @property
    def residual_world_size(self):
        """The variable holding the number of workers the residuals belong to (saved with
        them; see :meth:`share_residuals`). None before the optimizer is built."""
        return self._feedback.world_size

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
        if not self.built:
            return
        self._feedback.share(self.process_set, name=f"{self._prefix}.share_residuals")

    def save_own_variables(self, store):
        self.hold_pending()  # the checkpoint must hold the exchanges in flight
        super().save_own_variables(store)

    def load_own_variables(self, store):
        self._step.discard()  # the restored slots replace whatever is in flight
        ours = len(self.variables)
        if (self.built and self.use_ema
                and len(store.keys()) == ours + len(self._trainable_variables)):
            # saved by an earlier version, whose base build kept a second, unused EMA copy of the model
            # after the wrapper's own variables: skip it
            first, count = self._legacy_ema_at, len(self._trainable_variables)
            values = [store[str(i)] for i in range(len(store.keys()))]
            values = values[:first] + values[first + count:]
            store = {str(i): value for i, value in enumerate(values)}
        super().load_own_variables(store)
        self._feedback.restored = True  # restored residuals: compare their worker count

    def rescale_residuals_after_restore(self):
        """Keep the residuals' sum over ranks when restored on another number of workers.

        Runs by itself at the first step after ``keras.models.load_model``/``load_weights``;
        call it (eagerly, on every rank) after restoring a ``tf.train.Checkpoint``.
        """
        self._feedback.rescale_after_restore(self.process_set)

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """Keras' ``exclude_from_weight_decay``, on the inner optimizer (which decays)."""
        self.inner_optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    def set_weights(self, weights):
        """Assign ``weights`` to :attr:`variables` in order: the wrapper's own (residuals, ...)
        then the inner optimizer's (its iteration count, moments), as ``variables`` lists them."""
        if not self.built:
            raise ValueError(
                "You are calling `set_weights()` on an optimizer that has not yet been built. "
                "Call `optimizer.build(trainable_variables)` before `set_weights()`.")
        variables = self.variables
        if len(weights) != len(variables):
            raise ValueError(f"`set_weights` got {len(weights)} arrays for the optimizer's "
                             f"{len(variables)} variables")
        for variable, weight in zip(variables, weights):
            if tuple(variable.shape) != tuple(np.shape(weight)):
                raise ValueError(f"Optimizer variable {variable.path} has shape "
                                 f"{tuple(variable.shape)}, not {tuple(np.shape(weight))}")
            self.assign(variable, weight)

    def update_step(self, gradient, variable, learning_rate):
        """The inner optimizer's update rule for one variable (Keras' per-variable hook; no
        exchange: :meth:`apply` is the distributed step)."""
        return self.inner_optimizer.update_step(gradient, variable, learning_rate)

    @property
    def _model_variables_moving_average(self):
        """The inner optimizer's EMA of the model's variables (``use_ema``), as Keras names it."""
        return getattr(self.inner_optimizer, "_model_variables_moving_average", None)

    @property
    def _accumulated_gradients(self):
        """Keras' accumulators (``gradient_accumulation_steps``), as Keras names them."""
        return self._accumulation.accumulators if self._accumulation else None

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
        # Keras calls this at the end of fit: with staleness, the last tau averages go in now;
        # and a rank whose data ran out early must not leave the others waiting in a step.
        self.apply_pending()
        self.assert_same_step(lockstep.FINISHED)
        self.inner_optimizer.finalize_variable_values(var_list)

    def assert_same_step(self, state=lockstep.EPOCH_END):
        """Raise on every rank unless every rank has taken the same number of steps and calls
        this too (``sparse_hvd.lockstep``).

        A collective, eager. ``model.fit`` calls it when it ends (``lockstep.FINISHED``) and
        sparse_hvd's epoch-end callbacks at each epoch end (``lockstep.EPOCH_END``): a rank
        whose data ran out early then ends the job with a message naming each rank's step,
        and a rank still in a training step receives it there and raises the same. Nothing is
        checked before the first step, or with ``grouping="layerwise"`` or ``staleness``
        (there the stall watchdog ends a job whose ranks disagree).
        """
        if self.built and self._step.checks_lockstep:
            self._exchange.assert_same_step(int(self.iterations.numpy()), state)

    # ---- staleness: the delayed averages (sparse_hvd.staleness) --------------------------------

    def hold_pending(self):
        """Wait for the exchanges in flight and keep their averages in optimizer variables.

        A checkpoint written afterwards holds them, and a job restored from it applies them at
        the steps they were due, as if never stopped. Keras' saving calls it by itself; call it
        before ``tf.train.Checkpoint.save``. Eager; no collective (only the rank that writes
        needs to call it). Nothing to do without staleness.
        """
        self._step.hold_pending()

    def apply_pending(self):
        """Apply every delayed average not applied yet, oldest first (eager, on every rank).

        ``model.fit`` calls it when it ends (through ``finalize_variable_values``), so the last
        ``staleness`` steps' updates are not lost. A later ``fit`` starts a new pipeline.
        """
        self._step.apply_pending()

    def pending_steps(self) -> List[int]:
        """With staleness: the exchanged steps whose averages are not applied yet and not held
        in the slots, oldest first (empty without staleness)."""
        return self._step.pending_steps()

    def held_steps(self) -> List[int]:
        """With staleness: the steps whose averages the slots hold (written by
        :meth:`hold_pending` or restored from a checkpoint), sorted."""
        return self._step.held_steps()

    # ---- statistics ----------------------------------------------------------------------------

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
        average: the part of the exchange the computation did not hide. ``measurement_bytes``:
        what the density policy sent for its own measurements (``AdaptiveDensity``'s probes),
        on top of ``bytes_sent``.
        """
        stats = dict(EMPTY) if self._counters is None else self._counters.as_dict()
        stats["measurement_bytes"] = self.density_policy.measurement_bytes()
        return stats

    def layer_stats(self):
        """Per variable (by path): entries, route, and entries/density sent in the last step."""
        if self._counters is None:
            return {}
        return layer_stats(self._trainable_variables, self._routes, self._counters,
                           self.density_policy, self.inner_optimizer.iterations,
                           self._exchange.method)

    # ---- the step ------------------------------------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        """One step: the sparse exchange of ``grads``, then the inner optimizer's update.

        Step 1-3 (per variable, nothing written yet): compensate, select, remember (the payload).
        Step 4: the exchange averages every gradient over the workers, and tells whether every
        rank's gradients were finite.
        Step 5: on that, the residuals are written and the inner optimizer applies the
        averages, or the step is skipped on every rank.
        With ``staleness`` the exchange runs in the background and a delayed step is applied;
        with ``backward_passes_per_step`` B > 1, only every B-th call runs steps 1-5, on the
        sum of B calls' gradients (``sparse_hvd.accumulation``).
        """
        checks.check_not_in_xla()
        grads = list(grads)
        if not grads:  # an empty list, as Keras allows
            return
        grads_and_vars = self._present(grads, trainable_variables)
        if self._accumulation:  # every B-th pass: the step on the B passes' sum
            self._accumulation.pass_or_step(grads_and_vars, self._get_variable_index,
                                            self._step.run)
        else:
            self._step.run(grads_and_vars)
        self._iterations.assign_add(1)  # backward passes, as Keras' own counter

    def _present(self, grads, trainable_variables):
        """The step's (gradient, variable) pairs with a gradient, after building the optimizer
        on the first call and rescaling restored residuals on the first step after a restore."""
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "Pass `trainable_variables` on the first call, or call "
                    "`optimizer.build(trainable_variables)` first."
                )
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        grads = list(grads)
        checks.check_gradients_match_variables(grads, trainable_variables)
        checks.check_some_gradient(grads, trainable_variables)
        grads = [_with_tensor_parts(g) for g in grads]
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        self._check_variables_are_known(trainable_variables)
        if self._feedback.restored:
            self.rescale_residuals_after_restore()
        return [(g, v) for g, v in zip(grads, trainable_variables) if g is not None]

    def _num_elements(self):
        return [route.num_elements for route in self._routes]

    def _policy_step(self):
        """The step the density policy sees: exchanged steps with staleness, else applied ones."""
        return self._step.policy_step()

    def _payload(self, grads_and_vars, keep_rows=True):
        """Steps 1-3 for every (gradient, variable) pair, without writing state: a Payload.

        Each gradient is brought to its variable's dtype and unscaled (an inner
        LossScaleOptimizer); the density policy sees it; then by route: the sparse route
        compensates and selects (error feedback), the dense route sends it whole, and an
        embedding's row-sparse gradient on the dense route travels as rows (``keep_rows``;
        False densifies it, as the delayed pipeline needs). With the layer-wise exchange the
        variables are taken in backprop's order, output layers first.
        """
        builder = PayloadBuilder(check_finite=self.nonfinite != "ignore")
        step = self._policy_step()
        order = range(len(grads_and_vars))
        if self._exchange.per_layer:
            order = reversed(order)
        prepared = []  # (position, index, route, rows, gradient as it travels)
        for position in order:
            grad, variable = grads_and_vars[position]
            index = self._get_variable_index(variable)
            route = self._routes[index]
            rows = (keep_rows and isinstance(grad, tf.IndexedSlices) and not route.sparse
                    and not self.momentum_correction)
            grad = self._loss_scaling.unscale(
                _as_rows(grad, variable) if rows else _as_dense(grad, variable))
            self.density_policy.gradient_ready(index, grad.values if rows else grad)
            prepared.append((position, index, route, rows, grad))
        if self.clipping == "local":
            clipped = clipping_rules.clipped_locally([p[-1] for p in prepared], self._clipper,
                                                     runtime.size(self.process_set))
            prepared = [p[:-1] + (grad,) for p, grad in zip(prepared, clipped)]
        budgets = {index: self.density_policy.k(index, route.num_elements, step)
                   for _, index, route, rows, _ in prepared if route.sparse and not rows}
        sparsifier = self._model_wide_sparsifier(prepared, budgets) or self.sparsifier
        for position, index, route, rows, grad in prepared:
            if rows:
                builder.add_rows(position, index, route, grad)
            elif route.sparse:
                k = budgets[index]
                selection, updates = self._feedback.select(index, grad, sparsifier, k,
                                                           self._compression)
                builder.add_sparse(position, index, route, grad, selection, updates, budget=k)
            elif self._compression.wire_dtype(grad.dtype) is not None:
                sent, updates = self._feedback.round_dense(index, grad, self._compression)
                builder.add_dense(position, index, route, grad, updates, sent=sent)
            else:
                builder.add_dense(position, index, route, grad)
        return builder.build()

    def _model_wide_sparsifier(self, prepared, budgets):
        """``budget="model"``: a sparsifier that keeps every entry at or above this step's
        model-wide cut (``sparse_hvd.model_budget``); None with per-layer budgets."""
        if self.budget != "model" or not budgets:
            return None
        from .model_budget import AtOrAbove, model_wide_cut

        compensated = [self._feedback.compensated(index, grad)
                       for _, index, route, rows, grad in prepared if index in budgets]
        return AtOrAbove(model_wide_cut(compensated, list(budgets.values())))

    def _inner_gradients(self, payload, averaged, variables):
        """The averages as the inner optimizer takes them (sparse ones reshaped; dense-route
        ones through momentum correction), and every state write of the step."""
        grads = list(averaged)
        state_updates = list(payload.state_updates)
        for position in payload.sparse.positions:
            grads[position] = tf.reshape(averaged[position], variables[position].shape)
        for position, index in zip(payload.dense.positions, payload.dense.keys):
            grads[position], updates = self._feedback.after_exchange(index, averaged[position])
            state_updates.extend(updates)
        return grads, state_updates

    def _apply_inner(self, grads, variables=None):
        """Hand averaged true gradients to the inner optimizer (re-scaled for an inner
        LossScaleOptimizer, which divides by its scale again: exact both ways)."""
        variables = self._trainable_variables if variables is None else variables
        clipped_already = self.clipping == "local"  # before the exchange
        with (clipping_rules.switched_off(self._clipper) if clipped_already
              else contextlib.nullcontext()):
            self.inner_optimizer.apply(self._loss_scaling.rescale(grads), variables)

    @property
    def _clipper(self):
        """The optimizer whose clipping options act (inside an inner LossScaleOptimizer)."""
        inner = self.inner_optimizer
        return getattr(inner, "inner_optimizer", inner)

    def _skip_step(self, what, sent=None):
        """A step not finite on every rank: give what this rank sent back to its residuals (a
        delayed step; a synchronous one wrote nothing), count it, lower an inner
        LossScaleOptimizer's scale, and say so (rank 0)."""
        if sent:
            self._feedback.give_back(sent)
        self._counters.record_skip()
        self._loss_scaling.report_overflow(self._trainable_variables)
        nonfinite.announce_skip(what, self.process_set)

    # ---- serialisation -------------------------------------------------------------------------

    def get_config(self):
        # Like LossScaleOptimizer: the base optimizer's options belong to the inner optimizer.
        inner = keras.saving.serialize_keras_object(self.inner_optimizer)
        if self.gradient_accumulation_steps:  # given on the inner optimizer: saved there
            inner["config"]["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        return {"name": self.name, "optimizer": inner, **self._settings()}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config.setdefault("warmup_steps", 0)  # written before the warm-up default existed
        inner = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)
