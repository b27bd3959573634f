"""The factor on a step that cuts a variable (``update_scale``), and the one state it keeps.

Error feedback moves the weights less per step than dense training at the same rate (an entry
held in a residual arrives late) and stays stable at rates where dense does not, so under the
update cut a step that cuts anything can be taken larger than dense's (steps that cut nothing
keep the rate; ``local_update.apply_averages``). ``update_scale`` is that factor: a number, or
a pair ``(at_peak, at_end)`` whose factor grows as the learning rate falls below the largest
rate seen so far. The default under SGD's momentum, RMSprop and Adagrad at 1% is such a pair
(``selection.defaults.SGD_UPDATE_SCALE``): late in a decaying schedule the residuals hold more
of what is owed per step taken, and a larger factor then lowered the final loss (measured in
the README's "Converging like dense"); below 1% the pair's start rises to its end, a constant
2.0 at 0.1% (``selection.defaults.sgd_update_scale``).

The factor at step t, on every rank alike (the rate is the schedule's, the same everywhere):

1. the rate r of the inner optimizer at this step and the peak p = max(p, r), a variable
   saved with the optimizer (it starts at 0: the first step's rate is its first peak);
2. f = at_peak + (at_end - at_peak) * g, g = clip(1 - r / (s p), 0, 1): growing from
   ``at_peak`` once r falls below the share s of the peak (:data:`GROWS_BELOW`) to
   ``at_end`` at r = 0 (``at_peak`` where p is 0);
3. over the first quarter of the density's warm-up of W steps (R = max(1, W // 4)):
   ``1 + (f - 1) * min(1, t / R)``, so that a nearly dense start is not taken at a larger
   rate (at the full factor from the first step, one seed of the LSTM at 8 workers fell into
   the slow regime dense falls into at 1.5x its rate);
4. with ``exchange="auto"``, 1 (the rate) in a run of sparse steps that began after dense
   steps chosen past those R steps (:meth:`StepFactor.restarted_if` notes where the sparse
   steps began, a variable saved with the optimizer). Such a switch continues a dense run, and
   the factor raised its loss: forced from dense to the allgather at the wide CNN's fourth
   warm-up trial (step 374 of 800), its validation loss rose from about 0.09 to 0.11-0.14
   over the next 100 steps on each of three seeds, at the factor at once or ramped over R
   steps, and the runs needed 1.21x and 1.20x dense's steps to its loss, 1.06x with this step
   (1.16x and 1.06x switched at the second trial, step 129;
   ``docs/steps_to_loss_late_switch.md``).
"""

import tensorflow as tf

RAMP_SHARE = 4  # the factor is reached over the first 1/RAMP_SHARE of the density's warm-up
# a pair's factor starts growing once the rate falls below this share of its peak
GROWS_BELOW = 1.0
AFTER_DENSE_AT_RATE = True  # False: step 4 left out, the factor whatever ran before (before)


def as_pair(update_scale):
    """``(at_peak, at_end)`` for an ``update_scale`` (a number: the same factor at any rate)."""
    if isinstance(update_scale, (tuple, list)):
        return float(update_scale[0]), float(update_scale[1])
    return float(update_scale), float(update_scale)


def normalized(update_scale):
    """The ``update_scale`` an optimizer keeps: a float, or a pair of floats where the factor
    follows the rate."""
    at_peak, at_end = as_pair(update_scale)
    return at_peak if at_peak == at_end else (at_peak, at_end)


class StepFactor:
    """The factor of one optimizer's steps (see the module docstring)."""

    def __init__(self, update_scale):
        self.at_peak, self.at_end = as_pair(update_scale)
        self.peak = None  # the largest learning rate seen so far, where the factor follows it
        self.sparse_since = None  # where the sparse steps began (step 4), with a warm-up

    @property
    def follows_rate(self) -> bool:
        return self.at_end != self.at_peak

    @property
    def is_one(self) -> bool:
        return self.at_peak == 1 and self.at_end == 1

    def build(self, optimizer):
        """Create the peak as a variable of ``optimizer`` (after the second moment's in the
        checkpoint; none where the factor does not follow the rate), then step 4's start of
        the sparse steps (none without a factor or a warm-up)."""
        if self.follows_rate:
            self.peak = optimizer.add_variable((), dtype="float32", initializer="zeros",
                                               name="peak_learning_rate")
        if not self.is_one and optimizer.warmup_steps:
            self.sparse_since = optimizer.add_variable((), dtype="int64", initializer="zeros",
                                                       name="sparse_steps_since")

    @property
    def variables(self):
        """The state saved with the optimizer: the peak, where the factor follows the rate
        (a checkpoint without it loads with the peak at 0, and the first step after the
        restore then reads its rate as the peak)."""
        return [self.peak] if self.peak is not None else []

    @property
    def since_variables(self):
        """Step 4's start of the sparse steps, saved after the peak (a later release's: a
        checkpoint without it loads with 0, as if the sparse steps ran from the start)."""
        return [self.sparse_since] if self.sparse_since is not None else []

    def restarted_if(self, opt, restart):
        """Note this step as the sparse steps' start where ``restart`` (a boolean tensor: the
        first sparse step after dense steps that sent the residuals); an op, run before the
        step's factor."""
        if self.sparse_since is None or not AFTER_DENSE_AT_RATE:
            return tf.no_op()
        now = tf.cast(opt.iterations, tf.int64)
        return self.sparse_since.assign(tf.where(restart, now, self.sparse_since))

    def on_step(self, opt, cuts):
        """This step's factor (step 1's peak noted whether or not the step ``cuts``): a tensor
        where it varies, a float where it is constant, 1.0 for a step that cuts nothing."""
        rate, peak = self._rate_and_peak(opt)
        if peak is not None:
            opt.assign(self.peak, peak)
        if not cuts or self.is_one:
            return 1.0
        return self._factor(opt, rate, peak)

    def next_factor(self, opt) -> float:
        """Eager, for the logs (``communication_stats()["update_factor"]``): the factor the
        next step that cuts a variable will take, at the rate and the step count of now (the
        peak as that step will note it)."""
        if self.is_one:
            return 1.0
        return float(self._factor(opt, *self._rate_and_peak(opt)))

    def _rate_and_peak(self, opt):
        """Step 1: the rate now and the peak as a step now notes it (None, None for a constant
        factor; a peak not yet built counts as 0)."""
        if not self.follows_rate:
            return None, None
        rate = _rate(opt)
        noted = 0.0 if self.peak is None else tf.convert_to_tensor(self.peak)
        return rate, tf.maximum(noted, rate)

    def _factor(self, opt, rate, peak):
        """Steps 2-4: the factor at ``rate`` below ``peak`` (both None for a constant one),
        ramped over the density's warm-up, 1 where the sparse steps began after it."""
        factor = self.at_peak
        if self.follows_rate:
            share = GROWS_BELOW * tf.where(peak > 0, peak, 1.0)
            below = tf.where(peak > 0, tf.clip_by_value(1.0 - rate / share, 0.0, 1.0), 0.0)
            factor = self.at_peak + (self.at_end - self.at_peak) * below
        if not opt.warmup_steps:
            return factor
        ramp = max(1, opt.warmup_steps // RAMP_SHARE)
        progress = tf.minimum(tf.cast(opt.iterations, tf.float32) / float(ramp), 1.0)
        ramped = 1.0 + (tf.cast(factor, tf.float32) - 1.0) * progress
        if self.sparse_since is None or not AFTER_DENSE_AT_RATE:
            return ramped
        return tf.where(tf.convert_to_tensor(self.sparse_since) > ramp, 1.0, ramped)


def _rate(opt):
    """The inner optimizer's learning rate at its current step, as float32."""
    return tf.cast(opt._loss_scaling.base_optimizer.learning_rate, tf.float32)
