"""``clipping="local"``: the inner optimizer's gradient clipping, done on each rank's own
gradient before error feedback (Deep Gradient Compression's local gradient clipping, Lin et
al., ICLR 2018, section 3.3).

Keras clips (``clipnorm``, ``global_clipnorm``, ``clipvalue``) inside the inner optimizer, so
by default (``clipping="after"``) it acts on the averaged gradient. With sparse exchange that
average is made of residual sums, entries held back for many steps and sent at once: its norm
is far larger than a gradient's, clipping scales the whole step down, and what it cuts is lost
(it never returns to a residual). Locally:

1. each rank clips its own gradient before it is added to the residual: ``clipnorm`` per
   variable and ``global_clipnorm`` over the variables with the threshold times N^(1/2);
   ``clipvalue`` element by element, unchanged;
2. the inner optimizer then applies the average without clipping it again (its clipping
   options are switched off while it applies, and kept in its config).

Why N^(1/2): the user's threshold is meant for the gradient dense training applies, the
average over the ranks. Where the ranks' gradients are independent (a gradient mostly noise),
the average of N gradients of norm t has norm about t N^(-1/2), so each rank clips at the
threshold times N^(1/2) and the average lands at the threshold, as dense's clipping of the
average would put it. DGC states its rule for the *sum* of the nodes' gradients (threshold
times N^(-1/2) per node); the sum is N times the average, so it is the same rule. Where the
ranks' gradients agree the average can reach N^(1/2) times the threshold (DGC's rule shares
that). Before this release the threshold was multiplied by N^(-1/2): the average of
independent gradients was clipped to 1/N of the threshold.

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
    scale = math.sqrt(workers)
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
