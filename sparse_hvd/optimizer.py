"""SparseDistributedOptimizer: a Keras 3 optimizer that exchanges sparse gradients over Horovod.

It wraps any Keras 3 optimizer the way Keras' own ``LossScaleOptimizer`` does (``wrapping``):
its own variables (the error-feedback residuals) are made in ``build``, ``variables`` returns
its own followed by the inner optimizer's, ``learning_rate`` and ``iterations`` are the inner
optimizer's, and ``apply`` turns the local gradients into averaged ones before handing them to
the inner optimizer. This module is the Keras wrapper only; the sub-packages hold the stages:

* ``selection``: sparsifiers, density policies (the defaults, LAGS), the dense fallback;
* ``feedback``: error feedback, a step's payload (``preparation``), accumulation, clipping,
  loss scaling, the non-finite guard;
* ``exchanges``: one module per exchange, their wire format, compression and averaging;
* ``steps``: synchronous, timed-choice (``exchange="auto"``) or delayed steps, chosen once;
* ``runtime``: start-up, named collectives, the watchdog, lockstep and consistency checks;
* ``monitoring``: Keras callbacks, the communication log and statistics.
"""

import keras
import tensorflow as tf

from . import checks
from .exchanges import create as create_exchange
from .feedback import nonfinite
from .feedback import application
from .feedback.accumulation import LocalAccumulation
from .feedback.error_feedback import ErrorFeedback
from .feedback.loss_scaling import LossScaling
from .feedback.preparation import with_tensor_parts
from .feedback.second_moment import SecondMoment
from .feedback.state import LocalState
from .feedback.step_factor import StepFactor
from .monitoring.stats import EMPTY, CommunicationCounters, layer_stats
from .runtime import allocator, consistency, lockstep
from .selection.density import serialize_density_policy
from .selection.routing import route_densely_where_faster
from .selection.sparsifiers import serialize_sparsifier
from .steps import DelayedStep, MeasuredChoiceStep, SynchronousStep
from .wrapping import InnerOptimizerFacade, no_automatic_dependency_tracking, write_through

# the constructor's options, in the order get_config writes them
SETTINGS = ("density", "sparsifier", "min_elements", "error_feedback", "momentum_correction",
            "momentum_masking", "warmup_steps", "budget", "clipping", "grouping", "nonfinite",
            "staleness", "dense_fallback", "exchange", "compression", "backward_passes_per_step",
            "average_aggregated_gradients", "sparsify", "second_moment", "update_scale")

# what a config written before an option (or its default) existed ran with
BEFORE_THE_OPTION = {"warmup_steps": 0, "budget": "layer", "sparsify": "gradient",
                     "second_moment": "own", "update_scale": 1.0}


@keras.saving.register_keras_serializable(package="sparse_hvd")
class SparseDistributedOptimizer(InnerOptimizerFacade, LocalState, keras.optimizers.Optimizer):
    """Wraps a Keras optimizer so that workers exchange only the significant part of each gradient.

    Each step, for every variable whose gradient is not None: (1) compensate, ``c = gradient
    + residual`` (error feedback: the sparsifier is biased, and the residual carries what it
    left out into later steps, which is what makes 0.1%-1% density converge, Alistarh et al.
    2018); (2) select entries of ``c`` (top-k: the density policy's ``k = ceil(density * n)``);
    (3) remember, ``residual = c`` with the selected entries zeroed (sent + residual == c
    exactly); (4) exchange the selections, each rank's finiteness flag and the small dense-route
    gradients (one fused allgather by default; ``sparse_hvd.exchanges``) and average them in
    rank order; (5) hand the averages to the inner optimizer. Variables under ``min_elements``
    entries, and those whose (value, index) pairs would outweigh the dense gradient, are
    averaged densely. With one worker no collective runs.

    Args:
        optimizer: the Keras 3 optimizer that applies the averaged gradients (SGD, Adam, ...).
        density: fraction of each variable's entries a worker sends per step, in (0, 1], or a
            density policy (``sparse_hvd.WarmupDensity(...)``, ``AdaptiveDensity``, ...).
        warmup_steps: a numeric ``density`` below 10% starts at 10% and decays exponentially
            to it over this many steps (None: 400 at 0.1% and above, was 200 at 1%; below
            0.1%, 200 a tenfold fall: 600 at 0.01%; ``selection.defaults``); 0 keeps it
            constant from the first step. Ignored for a policy object.
        budget: ``"model"``: the sum of the variables' k spent on the largest entries of the
            whole model; ``"layer"``: each variable sends its own k. None (default): "model"
            with the grouped exchanges, "layer" with ``grouping="layerwise"`` or
            ``AdaptiveDensity`` (``selection.defaults``).
        clipping: ``"after"`` (default): the inner optimizer's, where it steps (on the average;
            under the update cut on each rank's gradient); ``"local"``: each rank's before error
            feedback, norm thresholds times N^(1/2) (DGC's rule), the average not clipped again.
        sparsifier: a registered name (``sparse_hvd.available_sparsifiers()``) or a configured
            sparsifier such as ``sparse_hvd.Threshold(threshold=0.01)``.
        error_feedback: keep and re-add what was not sent (default; False for experiments).
        momentum_correction: DGC's momentum correction (Lin et al. 2018): pass the momentum
            (e.g. 0.9) and wrap ``SGD(lr)`` without momentum; each worker sparsifies its local
            velocity ``u = m*u + g`` (plus residual) and clears the velocity it sent
            (``momentum_masking``, default True; False: error feedback on the momentum update).
            Dense-route variables get ordinary momentum on their average.
        grouping: ``"grouped"`` (default): one fused collective per step; ``"layerwise"``:
            each variable's exchange starts when its gradient is ready (LAGS-SGD's overlap).
        nonfinite: a step with a NaN or Inf gradient on any rank: ``"skip"`` (default) skips
            it on every rank (nothing written, counted in ``communication_stats()``),
            ``"raise"`` stops every rank, ``"ignore"`` does not check.
        staleness: tau >= 0 (default 0): apply the average of step t at step t + tau, its
            exchange running on a background thread (Candela et al.; ``steps.staleness``). The
            first tau steps apply nothing; the end of ``fit`` applies what is in flight and a
            checkpoint holds it. Costs tau copies of the model in optimizer variables.
        dense_fallback: time the sparse path of each layer against a dense allreduce when the
            optimizer is built and send densely where that is faster (``selection.routing``;
            the same decision on every rank; off by default, as timings differ run to run).
        exchange: ``"auto"`` (default, None: the candidate below that runs this job's steps
            fastest, timed on its first steps and re-timed every so often, CPU included;
            ``steps.measured``), ``"allgather"`` (every rank gathers every selection, (N - 1) k
            entries received per worker), ``"sparse_allreduce"`` (Ok-Topk/SparCML: owners sum
            regions and keep a global top-k of the sums, about 2k (N - 1) / N coded entries
            per worker; what is not applied goes back to the residual), ``"dense"`` (Horovod's
            allreduce of every gradient) and more (``sparse_hvd.exchanges``).
        compression: ``"none"`` (default), ``"float16"`` or ``"bfloat16"``: values travel as
            16-bit floats, each rank's rounding error kept in its residual.
        backward_passes_per_step: B >= 1 (Horovod's): B backward passes are added up locally
            and exchanged once; ``iterations`` counts exchanges (``feedback.accumulation``).
        average_aggregated_gradients: with B > 1, divide the sum of the B passes by B.
        min_elements: variables smaller than this are exchanged densely (default 1024).
        sparsify: ``"update"``: each worker's inner optimizer steps on its own gradient and
            that update is cut, error-fed and averaged (``feedback.local_update``);
            ``"gradient"``: the average goes to the inner optimizer. None (default): "gradient"
            for a plain SGD, else "update" (``selection.defaults``).
        second_moment: Adam (AdamW too, not AMSGrad) under the update cut: ``"own"``,
            ``"mean_estimate"`` or ``"noise_estimate"`` (README).
        update_scale: a step that cuts is taken this many times larger (dense steps keep the
            rate), or a pair (at the largest rate so far, as the rate falls to 0). None
            (default): (1.5, 2.0) with a Keras SGD with momentum, RMSprop or Adagrad at the
            default density, else 1.0 (``feedback.step_factor``; README, "Converging like dense").
        process_set: a Horovod process set (or an mpi4py communicator registered with
            ``sparse_hvd.init(process_sets=[...])``); the whole job by default. Not serialised.
        name: the optimizer's name; it prefixes its collectives' names, so two of these
            optimizers in one job need different names (Keras' automatic names are fine).

    The README says more of each (what it costs, what was measured, what is refused). Use
    ``jit_compile=False``: Horovod's collectives cannot be XLA-compiled.

    The base optimizer's options (``clipnorm``, ``weight_decay``, ``use_ema``, ...) are the
    inner optimizer's and act on the averaged gradient (with ``sparsify="update"``: on each
    worker's own; ``sparse_hvd.wrapping``); Keras' ``gradient_accumulation_steps`` on the
    inner optimizer is taken over (one exchange per B).
    """

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
        budget=None,
        clipping="after",
        grouping="grouped",
        nonfinite="skip",
        staleness=0,
        dense_fallback=False,
        exchange=None,
        compression="none",
        backward_passes_per_step=1,
        average_aggregated_gradients=False,
        sparsify=None,
        second_moment=None,
        update_scale=None,
        process_set=None,
        name=None,
        **kwargs,
    ):
        settings = checks.checked_settings(
            optimizer, SparseDistributedOptimizer, kwargs, density=density,
            warmup_steps=warmup_steps, sparsifier=sparsifier, min_elements=min_elements,
            error_feedback=error_feedback, momentum_correction=momentum_correction,
            momentum_masking=momentum_masking, budget=budget, clipping=clipping,
            grouping=grouping, nonfinite=nonfinite, staleness=staleness,
            dense_fallback=dense_fallback, exchange=exchange, compression=compression,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, process_set=process_set,
            sparsify=sparsify, second_moment=second_moment, update_scale=update_scale)
        keras_accumulation, policy = settings.keras_accumulation, settings.policy
        process_set, wire_compression = settings.process_set, settings.compression
        candidates = settings.candidates
        super().__init__(learning_rate=0.0, name=name)
        self._keras_accumulation = keras_accumulation
        self.inner_optimizer = optimizer
        write_through(optimizer, self)
        self.density_policy = policy
        self.warmup_steps = getattr(policy, "warmup_steps", 0)
        self.sparsifier = settings.sparsifier
        self._selector = settings.selector  # exchange="sign": its own, else the sparsifier
        self.error_feedback = bool(error_feedback)
        self.momentum_correction = float(momentum_correction)
        self.momentum_masking = bool(momentum_masking)
        self.sparsify, self.second_moment = settings.sparsify, settings.second_moment
        self.update_scale = settings.update_scale  # a float, or a pair (feedback.step_factor)
        self._step_factor = StepFactor(self.update_scale)
        self.budget = settings.budget
        self.clipping = clipping
        self.nonfinite = nonfinite
        self.staleness = int(staleness)
        self.dense_fallback = bool(dense_fallback)
        self.min_elements = min_elements
        self.process_set = process_set
        self.exchange = exchange  # as given: None is the default (checks.Settings.signs)
        self.compression = wire_compression.name
        self._compression = wire_compression  # the one object every stage uses
        self._exchange_candidates = candidates  # exchange="auto" chooses among them at build
        self._exchange = create_exchange(candidates[0], grouping, name=self._prefix,
                                         process_set=process_set, compression=wire_compression)
        self._feedback = ErrorFeedback(error_feedback, momentum_correction, momentum_masking)
        self._second_moment = SecondMoment(self.second_moment)
        self._loss_scaling = LossScaling(optimizer)
        # how a step runs (sparse_hvd.steps), chosen once
        self._step = (DelayedStep(self, staleness) if staleness
                      else MeasuredChoiceStep(self) if settings.exchange == "auto"
                      else SynchronousStep(self))
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
        velocities, the residuals' worker count, the second moment's, the factor's, the
        staleness slots, the inner optimizer's, a density policy's), fix each variable's
        route, and check that every rank builds the same."""
        checks.check_not_wrapped_in_loss_scaling(self)
        var_list = list(var_list)
        self._feedback.build(self, var_list, self.process_set)
        self._second_moment.build(self, var_list)
        self._step_factor.build(self)
        self._routes = self._exchange.routes_for(var_list, self.density, self.min_elements)
        checks.check_index_range(var_list, self._routes)
        allocator.note_if_unpooled(self._routes, self.process_set)
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
            route_densely_where_faster(self, var_list)
        self.density_policy.prepare(self, var_list, self._routes)
        self._exchange.build(self, self._routes)
        if isinstance(self._step, MeasuredChoiceStep):  # exchange="auto": time the candidates
            self._step.choose_among(self._exchange_candidates, self._routes)
        if self._accumulation:
            self._accumulation.build(self, var_list)

    @property
    def density(self) -> float:
        """The density the policy settles at (the constant density for a number)."""
        return self.density_policy.final_density

    def _settings(self):
        """The options that must agree on every rank (the inner optimizer's state is broadcast),
        as ``get_config`` writes them."""
        special = {"density": serialize_density_policy(self.density_policy),
                   "sparsifier": serialize_sparsifier(self.sparsifier),
                   "grouping": self._exchange.grouping}
        return {name: special[name] if name in special else getattr(self, name)
                for name in SETTINGS}

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    def assert_same_step(self, state=lockstep.EPOCH_END):
        """Raise on every rank unless every rank has taken the same number of steps and calls
        this too (``runtime.lockstep``; a collective, eager). The end of ``model.fit`` and
        sparse_hvd's epoch-end callbacks call it. Not checked before the first step, nor by
        per-layer exchanges or with ``staleness`` (the stall watchdog ends such a job)."""
        if self.built and self._step.checks_lockstep:
            self._step.current_exchange().assert_same_step(int(self.iterations.numpy()), state)

    # ---- statistics ----------------------------------------------------------------------------

    def communication_stats(self):
        """This rank's totals since the optimizer was built (the keys are explained in
        ``sparse_hvd.monitoring.stats``); ``measurement_bytes``: what the density policy sent
        for its own measurements (``AdaptiveDensity``'s probes), on top of ``bytes_sent``;
        ``update_factor``: the factor the next step that cuts a variable takes
        (``update_scale``; 1.0 where it is 1)."""
        stats = dict(EMPTY) if self._counters is None else self._counters.as_dict()
        stats["measurement_bytes"] = self.density_policy.measurement_bytes()
        stats["update_factor"] = self._step_factor.next_factor(self)
        return stats

    exchange_decisions = property(lambda self: list(getattr(self._step, "decisions", ())), doc=(
        'exchange="auto": each trial\'s (step, {candidate: median seconds}, choice).'))

    def layer_stats(self):
        """Per variable (by path): entries, route, and entries/density sent in the last step."""
        if self._counters is None:
            return {}
        exchange, routes = self._step.current_exchange(), self._step.current_routes()
        return layer_stats(self._trainable_variables, routes, self._counters,
                           self.density_policy, self.inner_optimizer.iterations, exchange.method)

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None):
        """One step: steps 1-3 make the payload (nothing written yet), step 4 averages it over
        the workers (and whether every rank was finite), step 5 writes the residuals and applies
        the averages, or skips the step on every rank. The step strategy (``steps``) runs them,
        every B-th call on the sum of B passes. Never converted by AutoGraph (README)."""
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
        trainable_variables = list(trainable_variables)  # ``grads``: a list (``apply``)
        checks.check_gradients_match_variables(grads, trainable_variables)
        checks.check_some_gradient(grads, trainable_variables)
        grads = [with_tensor_parts(g) for g in grads]
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        self._check_variables_are_known(trainable_variables)
        if self._feedback.restored:
            self.rescale_residuals_after_restore()
        return [(g, v) for g, v in zip(grads, trainable_variables) if g is not None]

    _num_elements = lambda self: [route.num_elements for route in self._routes]  # noqa: E731

    def _policy_step(self):
        """The step the density policy sees: exchanged steps with staleness, else applied ones."""
        return self._step.policy_step()

    def _apply_inner(self, grads, variables=None):
        """Step 5: the averages reach the weights (``feedback.application``)."""
        application.apply_averages(self, grads, variables)

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
        config = {**BEFORE_THE_OPTION, **config}
        inner = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)
