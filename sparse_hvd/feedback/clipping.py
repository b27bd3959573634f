"""``clipping="local"``: the inner optimizer's gradient clipping, done on each rank's own
gradient before error feedback (Deep Gradient Compression's local gradient clipping, Lin et
al., ICLR 2018, section 3.3).

Keras clips (``clipnorm``, ``global_clipnorm``, ``clipvalue``) inside the inner optimizer, so
by default (``clipping="after"``) it acts on the averaged gradient. With sparse exchange that
average is made of residual sums, entries held back for many steps and sent at once: its norm
is far larger than a gradient's, clipping scales the whole step down, and what it cuts is lost
(it never returns to a residual). Locally:

1. each rank clips its own gradient before it is added to the residual: ``clipnorm`` per
   variable and ``global_clipnorm`` over the variables with the threshold times N^-1/2 (if the
   ranks' gradients are independent, the norm of their sum grows as sqrt(N): the average then
   stays within the threshold, DGC's rule); ``clipvalue`` element by element, unchanged;
2. the inner optimizer then applies the average without clipping it again (its clipping
   options are switched off while it applies, and kept in its config).

With one worker and density 1 both orders give the same update.
"""

import contextlib
import math

import tensorflow as tf

CHOICES = ("after", "local")
OPTIONS = ("clipnorm", "global_clipnorm", "clipvalue")


def check(clipping):
    if clipping not in CHOICES:
        raise ValueError(f"`clipping` must be one of {CHOICES}, got {clipping!r}")


def clipped_locally(grads, optimizer, workers):
    """Step 1 of the module doc for a list of dense gradients (None kept)."""
    scale = 1.0 / math.sqrt(workers)
    if optimizer.clipnorm and optimizer.clipnorm > 0:
        return [None if g is None else tf.clip_by_norm(g, optimizer.clipnorm * scale)
                for g in grads]
    if optimizer.global_clipnorm and optimizer.global_clipnorm > 0:
        present = [g for g in grads if g is not None]
        clipped, _ = tf.clip_by_global_norm(present, optimizer.global_clipnorm * scale)
        clipped = iter(clipped)
        return [None if g is None else next(clipped) for g in grads]
    if optimizer.clipvalue and optimizer.clipvalue > 0:
        value = optimizer.clipvalue
        return [None if g is None else tf.clip_by_value(g, -value, value) for g in grads]
    return list(grads)


@contextlib.contextmanager
def switched_off(optimizer):
    """Step 2: ``optimizer``'s clipping options are None while it applies (Keras reads them
    when the step is traced); restored afterwards."""
    saved = {option: getattr(optimizer, option) for option in OPTIONS}
    try:
        for option in OPTIONS:
            setattr(optimizer, option, None)
        yield
    finally:
        for option, value in saved.items():
            setattr(optimizer, option, value)
