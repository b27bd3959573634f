"""The checks SparseDistributedOptimizer makes of its arguments and of where it runs.

Each raises a TypeError or ValueError whose message names the argument and says what to do,
at construction (or at build), before any collective could start and hang on a mistake.
"""

import math
import sys
import warnings
from typing import NamedTuple, Optional

import keras
import tensorflow as tf

NONFINITE_CHOICES = ("skip", "raise", "ignore")

XLA_MESSAGE = (
    "SparseDistributedOptimizer cannot run inside an XLA-compiled function: Horovod's allgather "
    "and allreduce have no XLA lowering. Pass jit_compile=False to model.compile(...) (Keras' "
    "default jit_compile='auto' turns XLA on when a GPU is visible) or to tf.function(...)."
)

WRAPPED_MESSAGE = (
    "SparseDistributedOptimizer is wrapped in a keras LossScaleOptimizer (Keras does this in "
    "compile() under the 'mixed_float16' policy). Its overflow check runs on each rank alone, "
    "so one rank could skip a step the others take, and the job would hang in the exchange. "
    "Put the loss scaling inside instead, and tell compile not to add its own: "
    "SparseDistributedOptimizer(keras.optimizers.LossScaleOptimizer(inner), ...) with "
    "model.compile(..., auto_scale_loss=False). sparse_hvd then decides overflows on all "
    "ranks together."
)


def check_backend():
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            "SparseDistributedOptimizer needs the TensorFlow backend of Keras "
            f"(KERAS_BACKEND=tensorflow); the active backend is {keras.backend.backend()!r}"
        )


def check_inner_optimizer(optimizer, wrapper_type):
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
    inner = optimizer
    while inner is not None:
        if isinstance(inner, wrapper_type):
            raise ValueError(
                "`optimizer` is (or wraps) a SparseDistributedOptimizer already; wrapping it again "
                "would exchange every gradient twice. Wrap the plain Keras optimizer once."
            )
        inner = getattr(inner, "inner_optimizer", None)


def check_no_base_options(kwargs):
    """The base optimizer's options (clipnorm, weight_decay, ...) belong to the inner one."""
    if kwargs:
        raise ValueError(
            "SparseDistributedOptimizer does not take "
            f"`{'`, `'.join(sorted(kwargs))}`; set such options on the inner `optimizer`."
        )


def check_min_elements(min_elements):
    if isinstance(min_elements, bool) or not isinstance(min_elements, int) or min_elements < 0:
        raise ValueError(f"`min_elements` must be a non-negative int, got {min_elements!r}")


def check_nonfinite(nonfinite):
    if nonfinite not in NONFINITE_CHOICES:
        raise ValueError(f"`nonfinite` must be one of {NONFINITE_CHOICES}, got {nonfinite!r}")


def check_boolean(value, argument):
    """``value`` is True or False (a string such as "False" would silently count as True)."""
    import numpy as np

    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{argument}` must be True or False, got {value!r}")


def check_process_set(process_set):
    """None (the whole job) or a Horovod ProcessSet that Horovod knows about."""
    if process_set is None:
        return
    try:
        from horovod.common.process_sets import ProcessSet
    except ImportError:
        raise ValueError(
            f"`process_set` needs Horovod, which cannot be imported; got {process_set!r}") from None
    if not isinstance(process_set, ProcessSet):
        raise TypeError(
            "`process_set` must be a horovod ProcessSet (hvd.ProcessSet([...]) registered with "
            f"hvd.init(process_sets=...) or hvd.add_process_set) or None, got {process_set!r}")
    if process_set.process_set_id is None:
        raise ValueError(
            f"`process_set` {process_set!r} is not registered with Horovod: pass it to "
            "hvd.init(process_sets=[...]) or hvd.add_process_set(...) on every rank first")


def check_index_range(variables, routes):
    """Every sparsely sent variable's entries can be numbered by int32 indices."""
    limit = (1 << 31) - 1
    for variable, route in zip(variables, routes):
        if route.sparse and route.num_elements > limit:
            label = getattr(variable, "path", None) or getattr(variable, "name", "?")
            raise ValueError(
                f"variable {label} has {route.num_elements} entries, more than the 2^31 - 1 that "
                "sparse_hvd's int32 indices can number. Split it into smaller variables, or "
                f"send it densely by setting min_elements above {route.num_elements}.")


def check_momentum_correction(momentum, optimizer):
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise ValueError(f"`momentum_correction` must be a number in [0, 1), got {momentum!r}")
    if not momentum:
        return
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):  # mixed precision
        optimizer = optimizer.inner_optimizer
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


SPARSIFY = ("gradient", "update")


def check_sparsify(sparsify, momentum_correction):
    if sparsify not in SPARSIFY:
        raise ValueError(f"`sparsify` must be one of {SPARSIFY}, got {sparsify!r}")
    if sparsify == "update" and momentum_correction:
        raise ValueError(
            "`sparsify='update'` runs the inner optimizer (its momentum too) on each worker "
            "before the cut, which is what `momentum_correction` does for SGD: use one of them "
            "(sparsify='update' with SGD(lr, momentum=...) is momentum correction without "
            "masking)")


def check_update_scale(update_scale, sparsify):
    if update_scale is None:  # resolved once the code is known (defaults.resolve_update_scale)
        return
    pair = isinstance(update_scale, (tuple, list))
    factors = tuple(update_scale) if pair else (update_scale,)
    if pair and len(factors) != 2:
        raise ValueError(
            "`update_scale` as a pair is (the factor at the largest learning rate seen so far, "
            f"the factor as the rate falls to 0), got {update_scale!r}")
    for factor in factors:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(
                f"`update_scale` must be a number or a pair of numbers, got {update_scale!r}")
        if not math.isfinite(factor) or factor <= 0:
            each = " (each of the pair)" if pair else ""
            raise ValueError(
                f"`update_scale` must be a positive finite number{each}, got {update_scale!r}")
    if any(factor != 1 for factor in factors) and sparsify != "update":
        raise ValueError(
            f"`update_scale={update_scale!r}` scales the averaged *update* of the cut variables, "
            f"which `sparsify={sparsify!r}` does not send (the inner optimizer steps on the "
            "averaged gradient there): use sparsify='update'")


def check_staleness(staleness, policy):
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise ValueError(
            f"`staleness` must be a non-negative int (steps an update is applied late), got {staleness!r}"
        )
    if not staleness:
        return
    if not policy.supports_staleness:
        raise ValueError(
            f"`staleness` > 0 cannot be combined with {type(policy).__name__}, which sizes each "
            "layer to hide its exchange inside the current step; use a constant or warm-up density."
        )


GROUPINGS = ("grouped", "layerwise")


def exchange_candidates(exchange, grouping, staleness, policy, compression, code="entries"):
    """The registered exchanges that can run these settings, by their capabilities
    (``sparse_hvd.exchanges``): ``exchange`` itself, or for ``"auto"`` every one that can
    (what it chooses among): those whose averages are made of ``code`` (``Exchange.code``:
    the entries, the signs, or both), and dense. The one to start with first (the
    allgather, else the first that sends selections). Raises a ValueError naming the setting
    an exchange cannot take."""
    from .exchanges import available, exchange_class, groupings_of

    if grouping not in GROUPINGS:
        raise ValueError(f"`grouping` must be one of {GROUPINGS}, got {grouping!r}")
    names = ((exchange,) if exchange != "auto"
             else tuple(name for name in available() if grouping in groupings_of(name)
                        and exchange_class(name, grouping).auto_candidate
                        and (exchange_class(name, grouping).code == code
                             or not exchange_class(name, grouping).sends_selections)))
    first = min(names, key=lambda name: (name != "allgather",
                                         not exchange_class(name, grouping).sends_selections))
    names = (first,) + tuple(name for name in names if name != first)
    # exchange_class names the exchanges and groupings there are
    refusals = {name: _refusal(name, exchange_class(name, grouping), staleness, policy,
                               compression) for name in names}
    candidates = tuple(name for name in names if refusals[name] is None)
    if not candidates:  # auto: the default exchange's reason is the one to give
        raise ValueError(refusals[exchange if exchange != "auto" else names[0]])
    return candidates


def _refusal(name, cls, staleness, policy, compression):
    """Why exchange ``name`` (class ``cls``) cannot run these settings, or None."""
    if staleness and not cls.staleness:
        return (f"exchange={name!r} cannot be combined with `staleness` > 0 (the delayed "
                "pipeline gathers every rank's selections). Use staleness=0, or "
                "exchange='allgather' or 'compact_allgather'.")
    if policy.requires_layerwise and not cls.layer_budgets:
        return (f"exchange={name!r} cannot be combined with {type(policy).__name__}, which "
                "sizes each layer from the time of that layer's own exchange: this exchange "
                "moves every layer in one collective. Use a constant or warm-up density, or "
                "exchange='allgather' with grouping='layerwise'.")
    if compression.enabled and not cls.compression_capable:
        return (f"`compression` cannot be combined with exchange={name!r}, which codes its "
                "values its own way (not as 16-bit floats). Use compression='none', or "
                "exchange='allgather'.")
    return None


def check_signs_of_rest(exchange, grouping, momentum_correction, dense_fallback):
    """An exchange that sends the signs of what the selection left (``code``
    ``"entries_and_signs"``: ``exchange="topk_sign"``) moves every entry a little: DGC's
    masking would clear every entry's velocity, and the dense fallback times a top-k exchange
    it would not run."""
    from .exchanges import exchange_class

    if exchange == "auto" or exchange_class(exchange, grouping).code not in (
            "entries_and_signs", "entries_and_two_signs", "entries_and_pair_signs"):
        return
    for refused, setting, instead in (
            (bool(momentum_correction), f"momentum_correction={momentum_correction!r}",
             "wrap SGD(momentum=...) without momentum_correction (sparsify='update')"),
            (dense_fallback, "dense_fallback=True", "leave dense_fallback=False")):
        if refused:
            raise ValueError(
                f"exchange={exchange!r} sends the sign of every entry the selection leaves, "
                f"so it cannot be combined with `{setting}`: {instead}.")


def cut_code(exchange, grouping, code) -> str:
    """What the sparse steps average: ``code`` (``defaults.code_by_default``) for
    ``exchange="auto"``, else the named exchange's own (known to exist by now)."""
    from .exchanges import exchange_class

    return code if exchange == "auto" else exchange_class(exchange, grouping).code


def sends_signs(exchange) -> bool:
    """Whether the exchange named ``exchange`` averages every entry's sign (``code``
    ``"signs"``: ``exchange="sign"`` or ``"sign_per_variable"``); False for "auto" and for a
    name no exchange has (refused later, naming it)."""
    from .exchanges import available, exchange_class, groupings_of

    return exchange in available() and any(exchange_class(exchange, grouping).code == "signs"
                                           for grouping in groupings_of(exchange))


def check_entries_chosen_by_exchange(exchange, grouping, sparsifier, budget,
                                     momentum_correction, dense_fallback):
    """An exchange that sends every entry of a cut variable in its own code (``chooses_entries``:
    ``exchange="sign"``) leaves nothing for a sparsifier or a model-wide budget to choose;
    DGC's masking would clear every entry's velocity, and the dense fallback times a top-k
    exchange it would not run. Returns whether ``exchange`` is such an exchange."""
    from .exchanges import exchange_class

    if exchange == "auto" or not exchange_class(exchange, grouping).chooses_entries:
        return False
    from .selection.defaults import is_default_sparsifier

    offending = [(not is_default_sparsifier(sparsifier), f"sparsifier={sparsifier.name!r}",
                  "leave `sparsifier` at its default"),
                 (budget == "model", "budget='model'", "use budget=None or 'layer'"),
                 (bool(momentum_correction), f"momentum_correction={momentum_correction!r}",
                  "wrap SGD(momentum=...) without momentum_correction (sparsify='update')"),
                 (dense_fallback, "dense_fallback=True", "leave dense_fallback=False")]
    for refused, setting, instead in offending:
        if refused:
            raise ValueError(
                f"exchange={exchange!r} sends every entry of each cut variable in its own code, "
                f"so it cannot be combined with `{setting}`: {instead}.")
    return True


def warn_about_poor_combinations(optimizer, policy, grouping, density):
    """Warnings for settings that work but are unlikely to be what the user wants."""
    if isinstance(optimizer, keras.optimizers.Adafactor) and density < 1:
        warnings.warn(
            "Adafactor's factored second moments become 0/0 where a whole row or column of "
            "the gradient is zero, which sparse gradients often have: NaN weights were seen "
            "with sparse_hvd at density 0.05. Prefer Adam, AdamW or SGD.",
            stacklevel=3,
        )
    if policy.requires_layerwise and grouping != "layerwise":
        warnings.warn(
            f"{type(policy).__name__} sizes each layer to hide its exchange behind the rest of "
            "backprop, which only the layer-wise exchange does: pass grouping='layerwise'.",
            stacklevel=3,
        )


def check_not_in_xla():
    """Horovod's collectives cannot be compiled by XLA: refuse before tracing any."""
    from tensorflow.python.ops import control_flow_util

    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError(XLA_MESSAGE)


def check_not_wrapped_in_loss_scaling(optimizer, depth=6):
    """Refuse to be built by a keras LossScaleOptimizer that wraps ``optimizer``.

    Keras' LossScaleOptimizer.build builds its inner optimizer; there is no other hook that
    tells an optimizer it has been wrapped, so the calling frames are looked at (build runs
    once, eagerly).
    """
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return
        caller = frame.f_locals.get("self")
        if (isinstance(caller, keras.optimizers.LossScaleOptimizer)
                and caller.inner_optimizer is optimizer):
            raise ValueError(WRAPPED_MESSAGE)
        frame = frame.f_back


def check_backward_passes(passes):
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"`backward_passes_per_step` must be an int >= 1, got {passes!r}")


def check_some_gradient(grads, variables):
    """Keras' behaviour for missing gradients: an error when there is none at all, a warning
    naming the variables without one."""
    if grads and all(g is None for g in grads):
        raise ValueError("No gradients provided for any variable.")
    missing = [getattr(v, "path", None) or getattr(v, "name", "?")
               for g, v in zip(grads, variables) if g is None]
    if missing:
        warnings.warn(
            f"Gradients do not exist for variables {missing} when minimizing the loss. If "
            "using `model.compile()`, did you forget to provide a `loss` argument?",
            stacklevel=4)


def check_gradients_match_variables(grads, variables):
    if len(grads) != len(variables):
        raise ValueError(
            f"Got {len(grads)} gradients for {len(variables)} variables; "
            "pass one gradient (or None) per variable."
        )


class Settings(NamedTuple):
    """The constructor's arguments that :func:`checked_settings` resolves into objects."""

    keras_accumulation: Optional[int]  # Keras' gradient_accumulation_steps, taken over
    sparsifier: object  # a Sparsifier
    policy: object  # a DensityPolicy
    process_set: object  # a Horovod ProcessSet or None
    compression: object  # a Compression
    candidates: tuple  # the exchanges that can run these settings ("auto" chooses among them)
    budget: str  # "layer" or "model"
    sparsify: str  # "gradient" or "update"
    second_moment: str  # "own", "mean_estimate" or "noise_estimate"
    selector: object  # what selects each step: the sparsifier, or the exchange's own code
    exchange: str  # "auto" or the exchange named
    code: str  # what exchange=None averages: entries, signs or both (``defaults.code_by_default``)
    update_scale: object  # the factor on sparse steps: a float or a pair (``feedback.step_factor``)


def checked_settings(optimizer, wrapper_type, base_options, *, density, warmup_steps,
                     sparsifier, min_elements, error_feedback, momentum_correction,
                     momentum_masking, budget, clipping, grouping, nonfinite, staleness,
                     dense_fallback, exchange, compression, backward_passes_per_step,
                     average_aggregated_gradients, process_set, sparsify=None,
                     second_moment=None, update_scale=None) -> Settings:
    """Every check of ``SparseDistributedOptimizer``'s arguments, in the order their errors are
    raised, and the objects the arguments stand for."""
    from .exchanges.compression import Compression
    from .feedback import clipping as clipping_rules
    from .feedback.accumulation import take_over_keras_accumulation
    from .runtime import startup
    from .selection.defaults import (code_by_default, resolve_budget,
                                     resolve_density, resolve_exchange, resolve_second_moment,
                                     resolve_sparsify, resolve_update_scale)
    from .selection.sparsifiers import get_sparsifier

    check_backend()
    check_inner_optimizer(optimizer, wrapper_type)
    keras_accumulation = take_over_keras_accumulation(optimizer, backward_passes_per_step)
    check_no_base_options(base_options)
    chosen_sparsifier = get_sparsifier(sparsifier)
    policy = resolve_density(density, warmup_steps)
    clipping_rules.check(clipping)
    check_min_elements(min_elements)
    check_momentum_correction(momentum_correction, optimizer)
    sparsify = resolve_sparsify(sparsify, optimizer)
    check_sparsify(sparsify, momentum_correction)
    check_update_scale(update_scale, sparsify)
    check_nonfinite(nonfinite)
    check_staleness(staleness, policy)
    check_boolean(error_feedback, "error_feedback")
    check_boolean(momentum_masking, "momentum_masking")
    check_boolean(dense_fallback, "dense_fallback")
    process_set = startup.as_process_set(process_set)  # an mpi4py communicator too
    check_process_set(process_set)
    check_backward_passes(backward_passes_per_step)
    wire_compression = Compression(compression)
    code = code_by_default(exchange, optimizer, sparsify, density, chosen_sparsifier,
                           budget, grouping, staleness, dense_fallback)
    signs = code == "signs"
    exchange = resolve_exchange(exchange)
    second_moment = resolve_second_moment(second_moment, sparsify, optimizer,
                                          signs=signs or sends_signs(exchange))
    candidates = exchange_candidates(exchange, grouping, staleness, policy, wire_compression,
                                     code)
    update_scale = resolve_update_scale(update_scale, optimizer, sparsify, density,
                                        cut_code(exchange, grouping, code))
    check_boolean(average_aggregated_gradients, "average_aggregated_gradients")
    check_signs_of_rest(exchange, grouping, momentum_correction, dense_fallback)
    selector = chosen_sparsifier
    if signs or check_entries_chosen_by_exchange(exchange, grouping, chosen_sparsifier, budget,
                                                 momentum_correction, dense_fallback):
        from .exchanges import exchange_class
        from .selection.density import ConstantDensity

        selector = exchange_class(candidates[0], grouping).selector  # the one that chooses
        budget, policy = "layer", ConstantDensity(policy.final_density)  # nothing to warm up
    budget = resolve_budget(budget, grouping, policy)
    return Settings(keras_accumulation, chosen_sparsifier, policy, process_set, wire_compression,
                    candidates, budget, sparsify, second_moment, selector, exchange, code,
                    update_scale)
