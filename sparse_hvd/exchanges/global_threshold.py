"""Step 6 of the sparse allreduce (``exchanges.sparse_allreduce``): the cut of this step's sums
and the forecast of the next step's global threshold.

Each owner keeps (and sends to every rank) the summed entries that reach their variable's
threshold theta, which has to be set a step ahead. Every sum at or above the k-th largest is
applied, so the kept entries beyond k are wire spent for nothing, and a theta above the next
k-th largest applies fewer than k. What makes this hard is the sums' tail: error feedback
piles the residuals up just below the cut, so (the 4.35M MLP at 1%, 4 workers) the 1.45 k-th
largest sum is only 0.5% below the k-th, and 2% below it there are 3 k. A theta that merely
follows the last cut keeps 1.5-2 k while the residuals build up (the cut grows 2% a step),
and 3.4-5 k at 0.1% density. So theta is a forecast:

1. the cut: the k-th largest kept sum (what is applied is at or above it), or 0 when fewer
   than k were kept (then all of them are applied);
2. the growth: the cut over the previous step's cut, within [1 / MAX_GROWTH, MAX_GROWTH],
   where both are known; else the last growth observed (0 before there is one: taken as 1);
3. the miss: how far this step's forecast (theta before its margin) was from the cut, as a
   ratio of at least 1: the larger of cut / forecast and forecast / cut, or, with too few
   kept, forecast / the lowered theta of step 4 (about where the k-th sum was). Held as the
   larger of this miss and the square root of the last one: a miss widens the margin at once,
   and it narrows again within a few steps (the first is ``FIRST_MISS``; a forecast made
   without a known growth is not judged);
4. the next theta: the cut (or, with too few kept, theta lowered to where about k sums
   were: between the first of ``LEVELS`` that k sums reached and the level above it, where a
   straight line through their counts reaches k; the levels are fine near 1, the tail is
   steep) times the growth, over the miss squared. With theta 0 (every sum was kept) and
   fewer than k sums, it stays 0.

Measured (``scripts/benchmarks/probe_threshold.py``, the 4.35M MLP, SGD with momentum,
steps 21-200, the update cut): the owners keep 1.02-1.07 k at 1% (4 and 8 workers) and
1.06-1.16 k at 0.1%, where following the last cut kept 1.5-2.0 k and 3.4-5.0 k; with the
gradient cut (noisier sums) 1.09-1.28 k against 1.4-1.6 k. The price: a forecast that
overshoots applies fewer than k in that step (the exact top of the sums all the same; the
rest stays in the residuals): 0.99-0.999 k on average, at least 0.74 k in a step.

Only products, quotients, square roots and comparisons of float64: correctly rounded, so every
rank (and a NumPy re-computation) gets the same bits. On CPU one native op does steps 1-4 for
every variable (``kernels/next_thresholds.cc``, the same operations in the same order); the
TensorFlow ops below were about 45 small ops a step (60 with the model-wide budget's sums and
copies), each traced and run by every rank.
"""

from typing import NamedTuple

import tensorflow as tf

from .. import kernels
from ..selection.order_statistics import kth_largest_per_segment

# theta x these: the levels every owner counts; the first is the kept set itself. Fine near 1
# (2^-1/1024 is 0.07%): a theta a little too high is lowered a little
LEVELS = (1.0, 2 ** -(1 / 1024), 2 ** -(1 / 256), 2 ** -(1 / 64), 2 ** -(1 / 16), 2 ** -0.25,
          0.5, 0.25)
MAX_GROWTH = 1.25  # the largest growth (and 1 / the largest shrinking) a step forecast
FIRST_MISS = 1.01  # the miss assumed before any forecast was judged


class Forecast(NamedTuple):
    """Per variable (float64 [V] each), what the next theta is forecast from; not saved (a
    restored job forecasts again from its saved thetas)."""

    last_cut: tf.Tensor  # the previous step's cut; 0 when unknown (fewer than k were kept)
    growth: tf.Tensor  # the cut's last observed growth a step; 0 before one is known
    miss: tf.Tensor  # at least 1: how far recent forecasts missed the cut


def first_forecast(variables: int) -> Forecast:
    """The forecast state of a job's first step (nothing known yet)."""
    return Forecast(tf.zeros([variables], tf.float64), tf.zeros([variables], tf.float64),
                    tf.fill([variables], tf.constant(FIRST_MISS, tf.float64)))


def lowered_factor(level_counts, budgets):
    """Per variable, the factor of theta at which about k sums would have been kept this step
    (step 4 with too few kept): between the first (largest) level below 1 that k sums reached
    and the level above it, where a straight line through their two counts reaches k; the
    lowest level if none did (the search goes on next step). ``level_counts``: int32 [V,
    len(LEVELS)]; ``budgets``: int32 [V]."""
    levels = len(LEVELS)
    reached = level_counts[:, 1:] >= budgets[:, None]
    below = tf.where(tf.reduce_any(reached, 1),
                     tf.argmax(tf.cast(reached, tf.int32), axis=1, output_type=tf.int32) + 1,
                     levels - 1)  # the first level that reached k, or the lowest
    factors = tf.constant(LEVELS, tf.float64)
    upper, lower = tf.gather(factors, below - 1), tf.gather(factors, below)
    counts = tf.cast(level_counts, tf.float64)
    fewer = tf.gather(counts, below - 1, batch_dims=1)  # fewer than k
    more = tf.gather(counts, below, batch_dims=1)
    share = tf.math.divide_no_nan(tf.cast(budgets, tf.float64) - fewer, more - fewer)
    return tf.where(more >= tf.cast(budgets, tf.float64), upper - (upper - lower) * share, lower)


def next_thresholds(thetas, forecast: Forecast, magnitudes, cuts, level_counts, budgets,
                    whole=False):
    """Steps 1-4 for every variable at once: ``(cut, next theta, next forecast)``.

    ``thetas``: this step's thresholds (float64 [V]); ``magnitudes``: the kept sums'
    magnitudes (float64), variable after variable, variable v's from ``cuts[v]`` to
    ``cuts[v + 1]``; ``level_counts`` [V, len(LEVELS)]: summed over the owners; ``budgets``
    [V]: each k (taken as at least 1). ``whole``: the model as one variable (the model-wide budget):
    the cut is the K-th largest of all the magnitudes, K the budgets' sum, over the counts
    summed, with the first variable's theta and forecast, and every variable gets the same
    numbers (``cuts`` is not read)."""
    budgets = tf.cast(budgets, tf.int32)
    native = kernels.next_thresholds()
    if native is not None:
        if cuts is None:
            cuts = tf.zeros([0], tf.int32)
        cut, theta, *following = native(
            thetas, *forecast, magnitudes, cuts, level_counts, budgets,
            tf.constant(LEVELS, tf.float64), max_growth=MAX_GROWTH, whole=whole)
        return cut, theta, Forecast(*following)
    if whole:
        return _model_wide(thetas, forecast, magnitudes, level_counts, budgets)
    return _per_variable(thetas, forecast, magnitudes, cuts, level_counts, budgets)


def _model_wide(thetas, forecast, magnitudes, level_counts, budgets):
    """``next_thresholds(whole=True)`` with TensorFlow ops."""
    return every_variable(_per_variable(*one_variable(thetas, forecast, magnitudes,
                                                      level_counts, budgets)),
                          level_counts.shape[0])


def one_variable(thetas, forecast: Forecast, magnitudes, level_counts, budgets):
    """The model-wide budget's inputs as one variable's, in ``next_thresholds``' order: the
    first slot's theta and forecast (the slots are alike from the first step on; a checkpoint
    from before holds one per variable, and the first is taken), every kept magnitude, the
    counts and budgets summed."""
    return (thetas[:1], Forecast(*(state[:1] for state in forecast)), magnitudes,
            tf.stack([0, tf.size(magnitudes)]), tf.reduce_sum(level_counts, 0, keepdims=True),
            tf.reduce_sum(budgets, keepdims=True))


def every_variable(result, variables):
    """One variable's ``(cut, next theta, next forecast)`` given to each of ``variables``."""
    cut, theta, following = result
    # one op each: each tf.repeat traced 28 (12 not constants), 140 of the step's 1,496 at 4 ranks
    return (tf.tile(cut, [variables]), tf.tile(theta, [variables]),
            Forecast(*(tf.tile(state, [variables]) for state in following)))


def _per_variable(thetas, forecast: Forecast, magnitudes, cuts, level_counts, budgets):
    """``next_thresholds`` with TensorFlow ops, variable by variable."""
    budgets = tf.maximum(budgets, 1)
    zeros, ones = tf.zeros_like(thetas), tf.ones_like(thetas)
    enough = cuts[1:] - cuts[:-1] >= budgets
    cut = tf.where(enough, kth_largest_per_segment(magnitudes, cuts, budgets), zeros)  # Step 1
    known = tf.logical_and(enough, forecast.last_cut > 0)  # Step 2
    growth = tf.where(known, tf.clip_by_value(tf.math.divide_no_nan(cut, forecast.last_cut),
                                              1 / MAX_GROWTH, MAX_GROWTH), forecast.growth)
    lowered = thetas * lowered_factor(level_counts, budgets)  # Step 4 with too few kept
    base = tf.where(enough, cut, lowered)
    predicted = thetas * forecast.miss * forecast.miss  # Step 3: this step's forecast
    missed = tf.where(enough, tf.maximum(tf.math.divide_no_nan(cut, predicted),
                                         tf.math.divide_no_nan(predicted, cut)),
                      tf.math.divide_no_nan(predicted, lowered))
    judged = tf.logical_and(thetas > 0, forecast.growth > 0)
    miss = tf.where(judged, tf.maximum(missed, tf.sqrt(forecast.miss)), forecast.miss)
    step_growth = tf.where(growth > 0, growth, ones)
    theta = base * step_growth / (miss * miss)  # Step 4
    return cut, theta, Forecast(tf.where(enough, cut, zeros), growth, miss)
