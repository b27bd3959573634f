"""A train function traced for the exchange ``exchange="auto"`` runs, not a conditional over all.

Traced once, the auto step holds every candidate exchange as a branch of one
``tf.switch_case`` (``sparse_hvd.steps.measured``). That conditional costs about 3% of the
4.35M MLP's step at 2 workers (``docs/auto_exchange.md``): the exchange cannot start before
every gradient is ready, and TensorFlow rewrites a conditional's body less. A step traced
with one candidate alone has none of that, but a ``tf.function`` cannot change its graph
from inside, so the code that calls the train function changes which function it calls:

1. Before each call it reads which candidate the next step runs (the step writes that into a
   variable at its end, the same on every rank).
2. It calls the function traced for that candidate: kept from before, or made now and traced
   at its first call, with the step told the candidate (``MeasuredChoiceStep.traced``). Where
   dense was chosen after sparse steps, the residuals are first sent by a small function of
   their own where that can be done between steps (``flush_between``), and the step runs
   dense's plain function.

A job traces each candidate it runs once. Every rank reads the same variables at the same
step, so every rank runs the same graph. Two ways in:
:class:`ExchangeChoiceCallback` for ``model.fit``, :func:`function` for a custom loop.
Without them (``train_on_batch``, a plain ``tf.function``) the step keeps the conditional and
is just as correct.
"""

import keras
import tensorflow as tf

from ..runtime import startup as runtime
from . import flush_between, measured, plan_step


def _mode(optimizer):
    """The plan the optimizer's next step runs, or None when there is nothing to choose."""
    step = getattr(optimizer, "_step", None)
    if not hasattr(step, "wanted_mode"):
        return None
    if not optimizer.built:  # built in the first trace, whose steps run the first plan
        return measured.FIRST if runtime.size(optimizer.process_set) > 1 else None
    return step.wanted_mode() if len(step.plans) > 1 else None


class _PerMode:
    """One function per plan of ``optimizer``'s step, each made by ``make()`` when first
    needed; :meth:`current` tells the step the plan and returns that plan's function."""

    def __init__(self, optimizer, make):
        self.optimizer = optimizer
        self.make = make
        self.functions = {}

    def current(self):
        self._settle()
        mode = _mode(self.optimizer)
        step = getattr(self.optimizer, "_step", None)
        if mode == measured.DENSE_FLUSH and flush_between.usable(step):
            flush_between.flush(step)  # then dense's plain function, traced already
            mode = _mode(self.optimizer)
        if hasattr(step, "traced"):
            step.traced = mode  # what a trace (the first, or one for new shapes) sees
        if mode not in self.functions:
            self.functions[mode] = self.make()
        return self.functions[mode]

    def _settle(self):
        """The function traced before the optimizer was built ran its first plan: file it
        under that plan's index, once it is known."""
        if measured.FIRST in self.functions and self.optimizer.built:
            step = self.optimizer._step
            function = self.functions.pop(measured.FIRST)
            key = plan_step.first_traced(step) if len(step.plans) > 1 else None
            self.functions.setdefault(key, function)


class ExchangeChoiceCallback(keras.callbacks.Callback):
    """``model.fit`` runs each step traced for the exchange ``exchange="auto"`` (the default)
    chose, without the conditional over the candidates; with any other exchange, or one
    worker, it does nothing.

    Put it anywhere in ``model.fit``'s callbacks. It costs a read of one scalar before each
    call of the train function, and a trace the first time each candidate runs.
    """

    def __init__(self):
        super().__init__()
        self._modes = None

    def on_train_begin(self, logs=None):
        optimizer = getattr(self.model, "optimizer", None)
        if not hasattr(getattr(optimizer, "_step", None), "wanted_mode"):
            self._modes = None
            return
        known = self._modes is not None and self._modes.optimizer is optimizer and (
            self.model.train_function in self._modes.functions.values())
        if not known:  # a new optimizer, or Keras made a new function (compile)
            self._modes = _PerMode(optimizer, self._make)
        self._follow()

    def on_train_batch_begin(self, batch, logs=None):
        self._follow()

    def _make(self):
        self.model.make_train_function(force=True)
        return self.model.train_function

    def _follow(self):
        if self._modes is not None:
            self.model.train_function = self._modes.current()


class _Function:
    """``python_function`` as one ``tf.function`` per mode of ``optimizer``'s step."""

    def __init__(self, python_function, optimizer, options):
        self.python_function = python_function
        self._modes = _PerMode(optimizer, lambda: tf.function(python_function, **options))

    def __call__(self, *args, **kwargs):
        return self._modes.current()(*args, **kwargs)


def function(optimizer, **options):
    """A decorator like ``tf.function(**options)`` for a custom loop's train step that calls
    ``optimizer.apply_gradients``: with ``exchange="auto"`` each call runs a function traced for
    the exchange that step runs (see the module's docstring); otherwise it is ``tf.function``.

    Example::

        @sparse_hvd.function(opt, jit_compile=False)
        def train_step(x, y):
            ...
            opt.apply_gradients(zip(grads, model.trainable_variables))
    """
    def decorate(python_function):
        return _Function(python_function, optimizer, options)
    return decorate
