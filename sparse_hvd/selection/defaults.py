"""The defaults that make ``SparseDistributedOptimizer(opt, density=d)`` train like ``opt``.

Top-k with error feedback alone trails dense training by many steps (``docs/steps_to_loss.md``
measures it: on a character LSTM at 1% it never reached dense's mid-run loss in 800 steps).
Of the aids measured there (``scripts/benchmarks/bench_steps_to_loss.py``), these are on unless
the user says otherwise:

* **Warm-up** (``warmup_steps``, default :func:`default_warmup_steps`): a numeric ``density``
  below :data:`WARMUP_INITIAL_DENSITY` becomes ``WarmupDensity(density, 0.10, warmup_steps)``:
  the density decays exponentially from 10% to ``density`` over the first steps, where
  gradients change fastest (Deep Gradient Compression's warm-up, Lin et al., ICLR 2018, starts
  at 25%), over :data:`WARMUP_STEPS` (400) steps at 0.1% and above, and below 0.1% at 0.1%'s
  pace (200 steps for each tenfold fall: 600 at 0.01%). At 1% it costs about ``0.08 x
  warmup_steps`` dense steps' worth of bytes in all (the mean density of the decay from 10% to
  1% is 3.9%, and a sparse entry is a value and an index); at 0.1% about ``0.04 x
  warmup_steps`` (a mean of 2.1%). Why 400 at 1% (200 before this release): measured under
  SGD's momentum (``docs/steps_to_loss_warmup_400.md``), the longer fall took fewer steps to
  dense's loss on the LSTM, the CNN and the residual network at 4 workers (the CNN 1.08x
  dense's steps over twelve seeds against 1.15x) and on the LSTM at 8, the image models at 8
  the same within their seeds' spread, for about 1.4x the run's bytes (0.05-0.06 of dense's);
  timed on the wide CNN at 1 Gbit/s it reached dense's loss as soon
  (``docs/time_to_loss_1gbit_epyc_warmup_400.md``). Under a plain SGD (the gradient cut) it
  took the CNN and the residual network to dense's loss in 0.94x and 0.92x dense's steps at 4
  workers, 0.98x and 0.82x at 8 (``docs/steps_to_loss_plain_sgd*.md``).
  ``warmup_steps=0`` keeps the density constant from the first step. A numeric density only:
  a policy object is used as given.

  Why 10% and not DGC's 25% (``docs/steps_to_loss_ablations.md``, "Where the warm-up
  starts"): on the character LSTM (one process standing in for 4 workers, 3 seeds, final
  validation loss after 800 steps) the start at 10% ends where the one at 25% does (1.489
  against 1.485, seeds within 0.012) and at 5% a little above (1.504); with no warm-up at all
  the seeds scatter from 1.514 to 1.633. In time the start matters more than in steps: at 4
  workers the allgather of 25% of the entries moves as many bytes as dense's ring allreduce,
  so ``exchange="auto"`` could only run those steps dense, where 10% moves 0.4x dense's bytes
  (on this machine's 2 shared cores the 10% allgather's CPU work still made its step about
  dense's, and auto ran the first ~70 steps dense in two seeds of three:
  ``docs/time_to_loss.md``).
* **One budget for the whole model** (``budget``, default :data:`BUDGET` with the grouped
  exchanges): the sum of the variables' k is spent on the largest entries of the whole model
  (``selection.model_budget``), so the same bytes travel, but a layer whose gradient is large
  for its size (an LSTM's bias and input kernel, an output layer, an embedding) sends more
  than ``density`` of itself and a large recurrent kernel less. With the warm-up it took the
  LSTM from never reaching dense's half-run loss to a steps ratio of 1.40, and the CNN from
  1.14 to 1.07 (4 workers, mean of 3 seeds; the README's table has every seed). Not with
  ``grouping="layerwise"`` (the cut waits for every gradient, undoing the overlap) or a policy
  that sizes each layer itself: there ``"layer"``.

* **The optimizer's update is cut, not its gradient** (``sparsify``, default
  :func:`resolve_sparsify`): with an inner optimizer that keeps a state per entry (SGD's
  momentum, Adam's moments) each worker runs it on its own gradient and its update is cut,
  error-fed and averaged (``feedback.local_update``); with a plain SGD the averaged gradient
  goes to it (``"gradient"``; the two differ there only in the update mode's extra copies).
  Measured at 4 workers, 3 seeds (``docs/steps_to_loss_ablations.md``, "What is cut,
  measured"): Adam on the transformer, the LSTM and the CNN (the previous release), SGD with
  momentum on the LSTM and the CNN (this release; with the per-layer budget of three releases
  ago it had been worse on both, with the model-wide budget it is better on the LSTM).
* **Under SGD's momentum, RMSprop and Adagrad, sparse steps 1.5x larger, 2x as the rate
  falls** (``update_scale``, default :func:`resolve_update_scale`): with a Keras SGD with
  momentum (or RMSprop, since the previous release, or Adagrad, since this one) under the
  update cut
  at the default density, every step that cuts a variable is taken 1.5 times larger at the
  largest learning rate seen so far, growing linearly to 2 as the rate falls to 0
  (:data:`SGD_UPDATE_SCALE`, ``feedback.step_factor``), reached over the warm-up's first quarter
  (100 steps at 1%; 50 with the 200-step warm-up it was measured with). Error
  feedback moves the weights less per step than dense at the same rate (a held entry arrives
  late) and stays stable where dense does not: at the LSTM's rate x2 the default ended below
  dense's best loss. Measured at 4 and 8 workers, 3 seeds, a constant 1.5
  (``docs/steps_to_loss_sgd_step_scale.md``) took the LSTM from 1.21 and 1.23x dense's steps to
  0.97 and 0.94, ending below dense's loss, and left the residual network's final loss above
  dense's spread; growing to 2 (``docs/steps_to_loss_scale_grows.md``) lowered every final
  loss or left it (the LSTM 1.3637 against 1.3777 at 4 workers, the residual network 0.0501
  against 0.0528 at 8, inside dense's spread), and took the CNN at 4 workers from 1.07 to 1.15x
  dense's steps over twelve seeds. Below 1% the factor at the peak rate rises to 2.0 at 0.1%
  and below (:func:`sgd_update_scale`): at 0.1% with the 200-step warm-up a constant 2.0 took
  the LSTM from never reaching dense's half-run loss to 1.39x dense's steps but slowed the CNN
  and the residual network (``docs/steps_to_loss_0001_update_scale_2.md``); with the 400-step
  warm-up it brought all three to about dense's steps (``docs/steps_to_loss_0001_warmup.md``).
  With Nesterov's momentum (the same defaults; ``docs/steps_to_loss_other_optimizers.md``) the
  CNN needed 1.11x dense's steps over six seeds, the residual network 0.86x, the LSTM 0.88x
  and 0.87x on two seeds while the third fell into a slow regime and never reached dense's loss.
  RMSprop (the previous release; ``docs/steps_to_loss_rmsprop_factor.md``, 4 workers at 1%; a
  reading of why: each worker divides by the mean square of its own gradient, which holds the
  noise of a batch N times smaller than dense's, so its step is smaller); with the factor the
  CNN's final loss went from 0.0542 to 0.0505 over six seeds (dense 0.0445-0.0505), the LSTM's
  from 1.2950 to 1.2644 (dense 1.2958-1.3185; its steps ratio from 0.86 to 0.81), the residual
  network's steps ratio from 0.56 to 0.69 (dense's own 0.86; a loose target, finals inside or
  below dense's spread). Below 1% it takes SGD's rule, measured under SGD only.
  Adagrad (this release; ``docs/steps_to_loss_adagrad_nadam.md``, the CNN and the residual
  network at 4 workers at 1%; its accumulator of squared gradients holds the same extra noise):
  with the factor the CNN's final loss went from 0.0698 to 0.0618 (lower on every seed; dense
  0.0606-0.0798), the residual network's from 0.0526 to 0.0511 (dense 0.0505-0.0534); at 1.0
  both had met issue 19's targets already. Nadam, Adamax and the rest keep 1.0 (Nadam's CNN:
  the factor did not lower its final loss; at 1.0 over six seeds 0.69x dense's steps, final
  inside dense's spread, ``docs/steps_to_loss_nadam_6seeds.md``).
* **With Adam, every entry's sign** (``exchange=None``, :func:`one_bit_by_default`): with a
  Keras Adam or AdamW under the update cut at the default density, each worker sends the
  sign of every entry of its compensated update and a scale per 64 entries
  (``exchanges.sign``), and ``exchange="auto"`` chooses between that and dense. Measured at 4
  and 8 workers, 3 seeds, with one scale per variable (``docs/steps_to_loss_sign.md``): the
  LSTM 1.01 and 1.08 (top-k of the update: 1.22, 1.31), the CNN 0.97 (1.03), the transformer
  1.40 (1.90); with the noise estimate and a scale per 64 entries
  (``docs/steps_to_loss_sign_blocks.md``): the transformer 1.10 and 1.06, the LSTM 0.95 and
  0.96, the CNN 0.94 (6 seeds) and 0.80 (one scale per variable: 1.13 and 1.08, 0.84 and
  0.91, 0.94 and 0.80).
* **With the signs, the noise estimate** (``second_moment=None``,
  :func:`resolve_second_moment`): each worker's Adam divides by an estimate of the mean
  gradient's second moment (``feedback.second_moment``): the transformer 1.13 and 1.08 at 4
  and 8 workers (``docs/steps_to_loss_noise_estimate.md``); with AdamW too (its decoupled
  weight decay kept out of the correction; ``docs/steps_to_loss_adamw.md``).
* **Not with SGD's momentum: the top entries and the signs of the rest** (``exchanges.topk_sign``,
  behind :data:`SIGNS_OF_REST`, off): measured at 4 and 8 workers, 3 seeds
  (``docs/steps_to_loss_topk_sign.md``), it takes fewer steps (the LSTM 1.07 and 1.11, top-k
  of the update 1.21 and 1.23; the CNN 1.05 and 0.89, top-k 1.18 and 0.83), but its step
  costs more (a bit an entry on the wire and four more passes over each cut variable), and
  timed on the emulated 1 Gbit/s cluster the wide CNN reached dense's loss later with it
  (2.17x sooner than dense against top-k's 3.27x; ``docs/time_to_loss_topk_sign.md``).
* **The exchange timed fastest on the job** (``exchange``, default :data:`EXCHANGE`):
  ``"auto"`` times the dense allreduce, the allgather and the sparse allreduce on the job's
  own first steps (``steps.measured``), so that a fast link runs dense and costs what dense
  costs.

The resolved settings go into ``get_config``, so a saved optimizer reloads as it ran; a config
written before a default existed reloads as it ran then (constant density, per-layer budget,
the gradient cut).

Measured and not made a default (the benchmark's rows say by how much): DGC's momentum
correction (helped the LSTM as much as the warm-up but not the CNN, and together with the
warm-up it was worse than the warm-up alone: masking clears a quarter of the velocity each
step at 25% density), a dense start, small variables dense, DGC's local gradient clipping,
LAGS' adaptive density (it follows the cost of communication, not the gradients: on loopback
it sent 1.6% of dense's bytes and trained far slower).
"""

import math

import keras

from ..feedback.step_factor import normalized
from .density import ConstantDensity, DensityPolicy, WarmupDensity, get_density_policy

# what warmup_steps=None means at 0.1% and above (200 before this release); below 0.1%, half
# this many steps for each tenfold fall of the density from its start (default_warmup_steps)
WARMUP_STEPS = 400
WARMUP_INITIAL_DENSITY = 0.10  # 0.25 before this release (see the docstring)
BUDGET = "model"  # what budget=None means with the grouped exchanges
BUDGETS = ("layer", "model")
EXCHANGE = "auto"  # what exchange=None means
DENSITY = 0.01  # the constructor's default density
ONE_BIT = True  # exchange=None sends every entry's sign with Adam (one_bit_by_default)
# exchange=None adds the signs of the rest with SGD's momentum (code_by_default): off. It
# takes the LSTM from 1.21x dense's steps to 1.07x, but on the emulated 1 Gbit/s cluster the
# wide CNN reached dense's loss later than with top-k alone (66 s against 43 s; its step 96 ms
# against 64, and no fewer steps there): docs/time_to_loss_topk_sign.md. One sign per pair of
# entries (exchange="topk_sign_pairs": the LSTM 1.08, half the sign bits) finished later too,
# timed at 4 workers on that cluster, 3 seeds: the wide CNN 54 s against the default's 44
# (dense 151; docs/time_to_loss_topk_sign_pairs_faster_day.md), the LSTM 100 s against the
# default's 86, which ran dense there (dense 91; docs/time_to_loss_charlm_pairs.md).
SIGNS_OF_REST = False


def resolve_exchange(exchange) -> str:
    """The exchange for the optimizer's ``exchange`` argument (None: :data:`EXCHANGE`)."""
    return EXCHANGE if exchange is None else exchange


def one_bit_by_default(exchange, optimizer, sparsify, density, sparsifier, budget, grouping,
                       staleness, dense_fallback) -> bool:
    """Whether ``exchange=None`` sends every entry's sign (``exchange="auto"`` between
    ``"sign"`` and ``"dense"``): with a Keras Adam (AdamW too) under the update cut at the
    default ``density`` (:data:`DENSITY`), unless an argument asks for a choice of entries (a
    sparsifier, a budget of the whole model) or for what the sign exchange does not run
    (``grouping="layerwise"``, ``staleness``, ``dense_fallback``). Any other density (a
    number or a policy) asks for top-k at that density, and so does ``exchange="auto"``
    named explicitly."""
    if not ONE_BIT or exchange is not None or sparsify != "update":
        return False
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return (isinstance(optimizer, keras.optimizers.Adam)
            and isinstance(density, (int, float)) and not isinstance(density, bool)
            and density == DENSITY and is_default_sparsifier(sparsifier)
            and budget in (None, "layer") and grouping == "grouped" and not staleness
            and not dense_fallback)


def code_by_default(exchange, optimizer, sparsify, density, sparsifier, budget, grouping,
                    staleness, dense_fallback) -> str:
    """What ``exchange=None`` averages (``Exchange.code``; ``exchange="auto"`` chooses among
    the exchanges of that code and dense):

    * ``"signs"`` where :func:`one_bit_by_default` says so (Adam);
    * ``"entries_and_signs"`` (``exchange="topk_sign"``: the top-k entries and the signs of
      the rest), where :data:`SIGNS_OF_REST` is on (it is off: it finished later in time),
      with a Keras SGD with momentum (the update cut) at the default density, unless
      an argument asks for what that exchange does not run (``grouping="layerwise"``,
      ``staleness``, ``dense_fallback``): measured, 3 seeds, the LSTM under SGD from 1.21x
      dense's steps to 1.07x (``docs/steps_to_loss_topk_sign.md``);
    * ``"entries"`` (the top-k exchanges) otherwise, and with ``exchange="auto"`` named.
    """
    if one_bit_by_default(exchange, optimizer, sparsify, density, sparsifier, budget, grouping,
                          staleness, dense_fallback):
        return "signs"
    if not SIGNS_OF_REST or exchange is not None or sparsify != "update":
        return "entries"
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    if (isinstance(optimizer, keras.optimizers.SGD) and _is_default_density(density)
            and grouping == "grouped" and not staleness and not dense_fallback):
        return "entries_and_signs"
    return "entries"


def _is_default_density(density) -> bool:
    """``density`` is the constructor's default: :data:`DENSITY`, or the warm-up to it that
    ``get_config`` writes for it (so that a saved optimizer comes back with the same code)."""
    return _as_number(density) == DENSITY


def _as_number(density):
    """The number d where ``density`` is d, or the warm-up to d that ``get_config`` writes for
    a numeric d under the default warm-up; None for any other policy."""
    if isinstance(density, (int, float)) and not isinstance(density, bool):
        return float(density)
    from .density import serialize_density_policy

    try:
        policy = get_density_policy(density)
        written = resolve_density(policy.final_density, None)
    except (TypeError, ValueError):
        return None
    if serialize_density_policy(policy) == serialize_density_policy(written):
        return policy.final_density
    return None


def is_default_sparsifier(sparsifier) -> bool:
    """Whether ``sparsifier`` is the constructor's default, top-k with its default settings
    (nothing the user chose: an exchange that chooses its entries may stand in for it)."""
    from .sparsifiers import get_sparsifier, serialize_sparsifier

    return serialize_sparsifier(sparsifier) == serialize_sparsifier(get_sparsifier("topk"))


def default_warmup_steps(density: float) -> int:
    """What ``warmup_steps=None`` means for a constant ``density`` below the warm-up's start:
    :data:`WARMUP_STEPS` (400) at 0.1% and above, and below 0.1% half of it for each tenfold
    fall from :data:`WARMUP_INITIAL_DENSITY` (600 at 0.01%), the pace of 0.1%'s warm-up. Both
    lengths are measured (the README's "Converging like dense"): at 0.1% the 200-step warm-up
    fell a hundredfold where 1%'s fell tenfold and the LSTM never reached dense's half-run
    loss, 400 steps (with the factor, :func:`resolve_update_scale`) took it there in about
    dense's steps; at 1% 400 steps took fewer than 200 at 4 workers on every workload
    measured. Below 0.1% nothing was run: the pace is kept rather than the length."""
    tenfold_falls = math.log10(WARMUP_INITIAL_DENSITY / density)
    return max(WARMUP_STEPS, int(round(WARMUP_STEPS / 2 * tenfold_falls)))


def resolve_density(density, warmup_steps) -> DensityPolicy:
    """The density policy for the optimizer's ``density`` and ``warmup_steps`` arguments."""
    policy = get_density_policy(density)
    if warmup_steps is not None and (isinstance(warmup_steps, bool)
                                     or not isinstance(warmup_steps, int) or warmup_steps < 0):
        raise ValueError(f"`warmup_steps` must be a non-negative int, got {warmup_steps!r}")
    if type(policy) is not ConstantDensity or policy.density >= WARMUP_INITIAL_DENSITY:
        return policy
    if warmup_steps is None:
        warmup_steps = default_warmup_steps(policy.density)
    if warmup_steps == 0:
        return policy
    return WarmupDensity(policy.density, initial_density=WARMUP_INITIAL_DENSITY,
                         warmup_steps=warmup_steps)


def resolve_budget(budget, grouping, policy) -> str:
    """The entry budget for the optimizer's ``budget`` argument: None is :data:`BUDGET` with a
    grouped exchange, and ``"layer"`` with ``grouping="layerwise"`` or a policy that sizes each
    layer itself (a model-wide cut waits for every gradient, which would undo the layer-wise
    overlap, and would override the policy's per-layer choice)."""
    if budget is None:
        return "layer" if grouping == "layerwise" or policy.requires_layerwise else BUDGET
    if budget not in BUDGETS:
        raise ValueError(f"`budget` must be 'layer' or 'model' (or None), got {budget!r}")
    return budget


def resolve_sparsify(sparsify, optimizer) -> str:
    """What is cut for the optimizer's ``sparsify`` argument: None is ``"gradient"`` when the
    inner optimizer (inside a LossScaleOptimizer) is a plain SGD, without momentum, whose step
    is the gradient times the learning rate (cutting the update would only cost the step's
    extra copies), and ``"update"`` for every optimizer that keeps a state per entry: SGD's
    momentum, Adam's moments, RMSprop's mean square, any other Keras optimizer."""
    if sparsify is not None:
        return sparsify
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    plain_sgd = (isinstance(optimizer, keras.optimizers.SGD)
                 and float(optimizer.momentum) == 0.0)
    return "gradient" if plain_sgd else "update"


# what update_scale=None means with a Keras SGD with momentum under the update cut at the
# default density (top-k of the entries): the factor at the largest rate seen so far and as the
# rate falls to 0 (feedback.step_factor); below it see sgd_update_scale; 1.0 everywhere else
SGD_UPDATE_SCALE = (1.5, 2.0)
# at this density and below, the factor at the peak rate is the pair's end too (a constant 2.0)
LOW_DENSITY = 0.001


def sgd_update_scale(density: float):
    """The default factor under SGD's momentum at a density at or below the default:
    :data:`SGD_UPDATE_SCALE` at 1%, its end (2.0) at every rate at :data:`LOW_DENSITY` (0.1%)
    and below, and between the two the factor at the peak rate moving linearly in the
    density's logarithm (1.65 at 0.5%; to two decimals). A lower density holds each entry
    back longer; at 0.1% with the warm-up of :func:`default_warmup_steps` the constant 2.0
    took the LSTM, the CNN and the residual network to dense's loss in about dense's steps
    where the 1% pair trailed on each (the README's "Converging like dense"); in between
    nothing was measured."""
    at_peak, at_end = SGD_UPDATE_SCALE
    share = math.log10(DENSITY / density) / math.log10(DENSITY / LOW_DENSITY)
    share = min(1.0, max(0.0, share))
    return normalized((round(at_peak + (at_end - at_peak) * share, 2), at_end))


def resolve_update_scale(update_scale, optimizer, sparsify, density, code):
    """The factor on every sparse step for the optimizer's ``update_scale`` argument: a number
    or a pair as given (``feedback.step_factor.normalized``); None is
    :func:`sgd_update_scale` with an optimizer whose larger sparse step was measured
    (:func:`takes_larger_steps`; inside a LossScaleOptimizer too) under the update cut at the
    default density or below (a number, or the warm-up ``get_config`` writes for one), where
    the entries are cut (``code == "entries"``), and 1.0 otherwise (above 1% and with other
    optimizers nothing was measured)."""
    if update_scale is not None:
        return normalized(update_scale)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    number = _as_number(density)
    if (takes_larger_steps(optimizer) and sparsify == "update" and code == "entries"
            and number is not None and number <= DENSITY):
        return sgd_update_scale(number)
    return 1.0


def takes_larger_steps(optimizer) -> bool:
    """Whether ``update_scale=None`` gives ``optimizer`` the larger sparse step: a Keras SGD
    with momentum (Nesterov's too), a Keras RMSprop (since the previous release: at 1% and 4
    workers its CNN's final loss ended above dense's spread at 1.0 and at its top with SGD's
    pair) or a Keras Adagrad (since this release; the README's "Converging like dense")."""
    if isinstance(optimizer, (keras.optimizers.RMSprop, keras.optimizers.Adagrad)):
        return True
    return isinstance(optimizer, keras.optimizers.SGD) and float(optimizer.momentum) > 0.0


SECOND_MOMENT = "own"  # what second_moment=None means where a correction can act ...
SECOND_MOMENT_WITH_SIGNS = "noise_estimate"  # ... and where every entry's sign is sent


def resolve_second_moment(second_moment, sparsify, optimizer, signs=False) -> str:
    """Each worker's Adam under the update cut: ``"own"`` (its own second moment),
    ``"mean_estimate"`` or ``"noise_estimate"`` (``feedback.second_moment``). None is, where a
    correction can act, :data:`SECOND_MOMENT_WITH_SIGNS` when the exchange sends every entry's
    sign (``signs``: ``exchange="sign"``, or the default with Adam) and :data:`SECOND_MOMENT`
    otherwise; else ``"own"``."""
    from ..feedback.second_moment import SECOND_MOMENTS, estimates_the_mean

    can_act = sparsify == "update" and estimates_the_mean(optimizer)
    if second_moment is None:
        if not can_act:
            return "own"
        return SECOND_MOMENT_WITH_SIGNS if signs else SECOND_MOMENT
    if second_moment not in SECOND_MOMENTS:
        raise ValueError(f"`second_moment` must be one of {SECOND_MOMENTS} (or None), got "
                         f"{second_moment!r}")
    if second_moment != "own" and not can_act:
        raise ValueError(
            f"`second_moment={second_moment!r}` corrects each worker's Adam step under "
            "sparsify='update': it needs sparsify='update' and a keras.optimizers.Adam "
            f"(AdamW too) without amsgrad (got sparsify={sparsify!r} and "
            f"{type(optimizer).__name__})")
    return second_moment

