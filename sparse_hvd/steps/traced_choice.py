"""A train function traced for the exchange ``exchange="auto"`` runs, not a conditional over all.

Traced once, the auto step holds every candidate exchange as a branch of one
``tf.switch_case`` (``sparse_hvd.steps.measured``). That conditional costs 8-15% of a step on
its own: the exchange can no longer start while backprop still runs, and TensorFlow rewrites
a conditional's body less (``docs/auto_exchange.md``). A step traced with one candidate alone
has none of that, but a ``tf.function`` cannot change its graph from inside, so the code that
calls the train function changes which function it calls:

1. Before each call it reads the mode of the next step: which candidate runs (the step
   writes that into a variable at its end, the same on every rank) and, for dense, whether
   the residuals are clear (dense then runs fewer routes).
2. It calls the function traced for that mode: kept from before, or made now and traced at
   its first call, with the step told the mode (``MeasuredChoiceStep.traced``).

A job traces each mode once: one per candidate, plus dense's second. Every rank reads the same
variables at the same step, so every rank runs the same graph. Two ways in:
:class:`ExchangeChoiceCallback` for ``model.fit``, :func:`function` for a custom loop.
Without them (``train_on_batch``, a plain ``tf.function``) the step keeps the conditional and
is just as correct.
"""

import keras
import tensorflow as tf

from ..runtime import startup as runtime


def _mode(optimizer):
    """The mode the optimizer's next step runs in, or None when there is nothing to choose."""
    step = getattr(optimizer, "_step", None)
    if not hasattr(step, "wanted_mode"):
        return None
    if not optimizer.built:  # built in the first trace: its first step runs the first plan
        return (0, False) if runtime.size(optimizer.process_set) > 1 else None
    return step.wanted_mode() if len(step.plans) > 1 else None


class _PerMode:
    """One function per mode of ``optimizer``'s step, each made by ``make()`` when first
    needed; :meth:`current` tells the step the mode and returns that mode's function."""

    def __init__(self, optimizer, make):
        self.optimizer = optimizer
        self.make = make
        self.functions = {}

    def current(self):
        mode = _mode(self.optimizer)
        step = getattr(self.optimizer, "_step", None)
        if hasattr(step, "traced"):
            step.traced = mode  # what a trace (the first, or one for new shapes) sees
        if mode not in self.functions:
            self.functions[mode] = self.make()
        return self.functions[mode]


class ExchangeChoiceCallback(keras.callbacks.Callback):
    """``model.fit`` runs each step traced for the exchange ``exchange="auto"`` (the default)
    chose, without the conditional over the candidates; with any other exchange, or one
    worker, it does nothing.

    Put it anywhere in ``model.fit``'s callbacks. It costs a read of two scalars before each
    call of the train function, and a trace the first time each mode runs.
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
