"""How the wrapper stands in for the optimizer it wraps, as Keras' ``LossScaleOptimizer`` does.

* The base optimizer's options (``clipnorm``, ``clipvalue``, ``global_clipnorm``,
  ``weight_decay``, ``use_ema``, ``loss_scale_factor``, ...) are the inner optimizer's: they
  act on the averaged gradient, identically on every rank, and read through the wrapper
  (``model.optimizer.clipnorm``) they give the inner optimizer's values;
  ``exclude_from_weight_decay`` and ``set_weights`` reach the inner optimizer too.
* Keras' ``gradient_accumulation_steps=B`` on the inner optimizer is taken over by the
  wrapper (``feedback.accumulation``): B passes averaged locally, one exchange, one inner step.
* The inner optimizer writes its variables through the wrapper's ``assign``, ``assign_add``
  and ``assign_sub``, as the wrapper writes its own (Keras' rule for optimizers: a subclass
  that overrides them sees every write of a step).
"""

import functools

import numpy as np

# The base optimizer's options that belong to the inner optimizer (it applies them to the
# averaged gradients); on the wrapper they read and write the inner optimizer's.
INNER_OPTIONS = ("weight_decay", "clipnorm", "global_clipnorm", "clipvalue", "use_ema",
                 "ema_momentum", "ema_overwrite_frequency", "loss_scale_factor")

try:  # the decorator Keras' own wrapper optimizers use; absent in some Keras versions
    from keras.src.utils.tracking import no_automatic_dependency_tracking
except ImportError:  # pragma: no cover
    def no_automatic_dependency_tracking(fn):
        return fn


def inner_option(option):
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


def write_through(inner, wrapper):
    """Make ``inner`` write its variables through ``wrapper``'s assign methods (looked up at
    each call, so an override or a patch of the wrapper's sees them)."""
    for method in ("assign", "assign_add", "assign_sub"):
        setattr(inner, method, functools.partial(_write, wrapper, method))


def _write(wrapper, method, variable, value):
    return getattr(wrapper, method)(variable, value)


def without_legacy_ema_copy(store, ours, first, count):
    """A checkpoint's variable ``store`` without the second, unused EMA copy of the model's
    ``count`` variables that earlier versions' base build kept at position ``first`` (when
    ``store`` holds ``ours + count`` values, the wrapper's ``ours`` and that copy)."""
    if len(store.keys()) != ours + count:
        return store
    values = [store[str(i)] for i in range(len(store.keys()))]
    values = values[:first] + values[first + count:]
    return {str(i): value for i, value in enumerate(values)}


class InnerOptimizerFacade:
    """What a wrapper optimizer forwards to ``self.inner_optimizer`` so that it reads and
    behaves as the optimizer it wraps (a mixin before ``keras.optimizers.Optimizer``): the
    base options, the learning rate, the step count, Keras' per-variable update rule, loss
    scaling, EMA and accumulation attributes, weight-decay exclusions and ``set_weights``."""

    for _option in INNER_OPTIONS:
        locals()[_option] = inner_option(_option)
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
