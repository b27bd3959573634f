"""The rules ``exchange="auto"``'s trials decide by (``sparse_hvd.steps.measured``), as pure
functions of the trial's numbers: which candidates are worth a trial, whether any can beat
dense, whether one that builds on another can still win and repay its trace, which one a trial
chooses, whether dense lost it beyond doubt, what the early re-check runs, and the line rank 0
logs for it.

Each takes its ``margin``: how much faster than dense's a sparse step must be to run, so that
dense, which needs no extra steps to a loss, keeps the steps a sparse exchange would win by
less. The rules that choose which candidates a trial runs are asked with the whole margin
(:func:`whole_margin`), the decision with the trial's (``measured.dense_margin``).
"""

from typing import List

import numpy as np

from .candidates import dense_bytes_per_entry

SAVING = 0.05  # a candidate that builds on another is tried only if it could save this share
# the slowest whole dense turn measured against the same job's other dense turns: the character
# LSTM at 1 Gbit/s once timed dense's step at 239 ms, 137 ms in every other trial (1.74x);
# a first trial's dense turn, while dense warms up, read up to 1.58x high (134 against 85 ms)
DENSE_TURN_SPREAD = 1.75
FEWEST_BYTES_FIRST = True  # ``turn_order``: False keeps the plans' order after the reference
TRACE_MUST_PAY = True  # ``pays_for_its_trace``: False tries whatever is within reach (before)


def wire_bytes(plan, density, value_bytes):
    """Bytes ``plan``'s exchange receives per entry of the model when every rank sends a share
    ``density`` of the entries as ``value_bytes``-byte values (``Exchange.wire_bytes_per_entry``
    times the density), or None where that is not known (dense)."""
    per_entry = plan.exchange.wire_bytes_per_entry(density, value_bytes)
    return None if per_entry is None else density * per_entry


def whole_margin(plans, default) -> float:
    """The margin over dense's step a trial of ``plans`` asks at the settled density: the one
    their sparse exchanges declare (``Exchange.dense_within``: the extra steps their averages
    cost to dense's loss), else ``default`` (``measured.DENSE_WITHIN``). ``exchange="auto"``'s
    candidates average one code (``Exchange.code``), so they declare alike; else the least."""
    declared = [plan.exchange.dense_within for plan in plans
                if plan.name != "dense" and plan.exchange.dense_within is not None]
    return min(declared) if declared else default


def worth_trying(plans, density, value_bytes, margin) -> List[bool]:
    """Which plans a trial at ``density`` runs: not a sparse exchange whose bytes on the wire
    alone (``Exchange.wire_bytes_per_entry``) are at least dense's over ``1 + margin``. Such
    an exchange cannot win: with the step's compute c and dense's transfer t, it would need
    ``m (c + r t) < c + t`` for m = 1 + margin, impossible for a ratio r of their bytes at or
    above 1/m (and its CPU work only adds). (At 8 workers and 25% density the allgather moved
    2x dense's bytes and ran at 2x dense's step.)"""
    limit = dense_bytes_per_entry(plans[0].exchange.size, value_bytes) / (1 + margin)
    sent = [wire_bytes(plan, density, value_bytes) for plan in plans]
    keep = [bytes_ is None or bytes_ < limit for bytes_ in sent]
    return keep if any(keep) else [True] * len(plans)


def sparse_can_win(step_seconds, compute_seconds, margin) -> bool:
    """Whether some exchange could make dense's step (``step_seconds``, of which
    ``compute_seconds`` are not its exchange) faster by more than ``margin``: at best a
    sparse step costs the compute alone."""
    return step_seconds > (1 + margin) * compute_seconds


def bound_seconds(candidate_bytes, reference_seconds, reference_bytes, dense_seconds,
                  dense_compute, dense_bytes):
    """The least step a candidate that builds on the reference exchange could take
    (``Exchange.builds_on``: its work and more, to send ``candidate_bytes`` per entry of the
    model instead of ``reference_bytes``): the reference's step less what its fewer bytes
    save on the link, priced at dense's exchange time per byte (``dense_seconds -
    dense_compute`` over ``dense_bytes``: an over-estimate of the link's cost per byte, since
    dense's exchange also holds its fixed costs, so the bound errs towards trying). None
    where a byte count is not known."""
    if None in (candidate_bytes, reference_bytes) or dense_bytes <= 0:
        return None
    price = max(dense_seconds - dense_compute, 0.0) / dense_bytes
    return reference_seconds - max(reference_bytes - candidate_bytes, 0.0) * price


def within_reach(candidate_bytes, reference_seconds, reference_bytes, dense_seconds,
                 dense_compute, dense_bytes, fastest_seconds, margin) -> bool:
    """Whether a candidate that builds on the reference exchange could become the choice, from
    the trial's medians so far: the reference's step, dense's step, compute and bytes per
    entry, and the fastest step of any candidate (``fastest_seconds``).

    1. Its step is at least :func:`bound_seconds`.
    2. It could become the choice only if that bound beats dense by more than ``margin``,
       the reference by more than ``SAVING`` and the fastest step measured so far (another
       candidate that builds on the reference may have run before it).

    None for a byte count: not known, so within reach."""
    lower = bound_seconds(candidate_bytes, reference_seconds, reference_bytes, dense_seconds,
                          dense_compute, dense_bytes)
    if lower is None:
        return True
    return (lower * (1 + margin) < dense_seconds
            and lower * (1 + SAVING) < reference_seconds and lower < fastest_seconds)


def pays_for_its_trace(candidate_bytes, reference_seconds, reference_bytes, dense_seconds,
                       dense_compute, dense_bytes, fastest_seconds, margin, horizon,
                       trace_seconds) -> bool:
    """Whether a candidate not yet traced (a candidate that builds on the reference, as in
    :func:`within_reach`) could repay its trace before the next trial: at its bound
    (:func:`bound_seconds`) it would save, each step, the step of what would run without it
    (the fastest step so far where that beats dense by more than ``margin``, else dense's)
    less the bound, over ``horizon`` steps (to the next trial, which asks again, at its own
    density), against ``trace_seconds``, what a candidate's trace and first run cost this
    job (``measured``, step 1). ``margin``: the trial's decision's (``measured.dense_margin``),
    which decides what runs until the next trial.

    Asked at each trial, so a candidate whose bytes save little on a fast link waits until a
    trial whose horizon or density makes the trace pay (the settled density's trial holds
    ``RECHECK_STEPS``), and on a link where bytes cost it runs at once. On the emulated 10
    Gbit/s cluster at 4 workers (the wide CNN, ``docs/time_to_loss_10gbit_epyc_fast_400.md``)
    the sparse allreduce and the coded allgather were traced in the warm-up's first trial of
    two seeds of three (2.0-2.9 s each, against dense's 44 s to the target) and ran slower
    than the allgather there (117-141 ms a step against 90-98). None for a byte count: not
    known, so tried."""
    lower = bound_seconds(candidate_bytes, reference_seconds, reference_bytes, dense_seconds,
                          dense_compute, dense_bytes)
    if lower is None or not TRACE_MUST_PAY:
        return True
    running = fastest_seconds if fastest_seconds * (1 + margin) < dense_seconds else dense_seconds
    return (running - lower) * horizon > trace_seconds


def plans_within_reach(plans, bounded, reference, dense, medians, compute, fastest, density,
                       value_bytes, margin, rule=within_reach) -> np.ndarray:
    """``rule`` (:func:`within_reach`, or :func:`pays_for_its_trace` with its horizon and
    trace's cost bound) for each plan, at a trial's ``density`` and ``margin``:
    True for those that do not build on the reference (``bounded``). ``medians``: each
    plan's last (dense's step does not depend on the density: its last turn's stands where
    it sits out); ``reference``, ``dense``: their plans' indices; ``compute``: dense's step
    less its exchange; ``fastest``: the fastest median of the trial so far."""
    dense_bytes = dense_bytes_per_entry(plans[0].exchange.size, value_bytes)
    reference_bytes = wire_bytes(plans[reference], density, value_bytes)
    return np.array([not bounded[i] or rule(
        wire_bytes(plan, density, value_bytes), float(medians[reference]), reference_bytes,
        float(medians[dense]), float(compute), dense_bytes, float(fastest), margin)
        for i, plan in enumerate(plans)], np.bool_)


def turn_order(plans, first, reference, density, value_bytes) -> List[int]:
    """The order of a trial's turns, as plan indices: ``first`` (the plan the steps before
    the trial ran, dense's: its turn decides whether any sparse one can win), the reference
    (``within_reach`` bounds the others by its step), then the others by their bytes on the
    wire at ``density``, fewest first (ties: the plans' order), so that the one likeliest to
    win where bytes decide runs first and its step can leave the rest untraced (at 4 workers
    on the emulated 1 Gbit/s cluster the sparse allreduce's step was the fastest of each
    first trial, 140-146 ms, and the coded allgather's trace and turn cost about 2 s)."""
    def sent(index):
        bytes_ = wire_bytes(plans[index], density, value_bytes)
        return np.inf if bytes_ is None else bytes_

    leading = [first] + [i for i in [reference] if i not in (None, first)]
    rest = [i for i in range(len(plans)) if i not in leading]
    return leading + (sorted(rest, key=lambda i: (sent(i), i)) if FEWEST_BYTES_FIRST else rest)


def decisive_loss(seconds, names, margin) -> bool:
    """Whether dense lost a trial (``seconds``: each candidate's median, inf where it did not
    run) by more than a slow turn of its own explains: its median over ``1 + margin`` times
    ``DENSE_TURN_SPREAD`` times the fastest sparse median. Dense would have lost by the margin
    even had its turn been as slow, against its true step, as the slowest turn measured."""
    if "dense" not in names:
        return False
    dense = seconds[names.index("dense")]
    sparse = [s for name, s in zip(names, seconds) if name != "dense" and np.isfinite(s)]
    return bool(sparse and np.isfinite(dense)
                and dense > (1 + margin) * DENSE_TURN_SPREAD * min(sparse))


def early_recheck(decisive, sparse_candidates) -> str:
    """What the early re-check of a job's first decision runs (``measured``, step 3): ``"all"``
    the candidates worth trying, ``"sparse"`` them without dense, ``"none"``: no early
    re-check (the next trial is the regular one, dense in it). That re-check is there for a
    wrong first choice on the job's least reliable timings; after a loss of dense beyond
    its own slowest turns (``decisive``, :func:`decisive_loss`), whose sparse medians read
    high if anything, only the choice among the ``sparse_candidates`` is left to ask. With
    Adam's signs (dense and the signs the only candidates) at 4 workers on the emulated 1
    Gbit/s cluster dense lost the first trial by 4.6-7.3x on every seed of two sets, and its
    turn in the re-check (a first step of 1.5-2.2 s and three of 0.33-0.42 s) made rank 0's
    steps 110-125 take 3.4-4.9 s against 1.2-1.3 s without it
    (``docs/time_to_loss_adam_early_recheck.md``)."""
    if not decisive:
        return "all"
    return "sparse" if sparse_candidates > 1 else "none"


def held(seconds, incumbent, hold) -> List[float]:
    """The times :func:`decide` compares at a re-check: the ``incumbent``'s (the choice a
    trial at the same density made; None: none) counted ``1 + hold`` times shorter, so that a
    challenger must beat it by more than the trials' noise (``measured``, step 3)."""
    return [s / (1 + hold) if i == incumbent else s for i, s in enumerate(seconds)]


def decide(seconds, names, margin) -> int:
    """The index of the chosen candidate given each one's time (seconds): the fastest, but
    dense unless it is slower than the fastest by more than ``margin``; ties by name, so
    every rank picks alike."""
    fastest = min(range(len(names)), key=lambda i: (seconds[i], names[i]))
    if "dense" in names:
        dense = names.index("dense")
        if seconds[dense] <= seconds[fastest] * (1 + margin):
            return dense
    return fastest


def decision_message(step, names, choice, times, compute, alone, margin, incumbent=None,
                     hold=0.0) -> str:
    """Rank 0's line for a decision at the trial's ``margin``; ``alone``: only dense ran,
    because of its compute; ``incumbent``: the choice until now, whose time counted ``1 +
    hold`` times shorter (:func:`held`)."""
    why = ""
    if alone:
        why = (f"; {compute * 1e3:.1f} ms of dense's step are compute, so no exchange "
               f"can make it {1 + margin:.3g}x faster: the others were not tried")
    elif "dense" in times:
        why = (f"; dense's compute {compute * 1e3:.1f}; a sparse step must be "
               f"{1 + margin:.3g}x faster")
    if incumbent is not None and hold > 0 and names[incumbent] in times and not alone:
        why += f"; {names[incumbent]}, the choice until now, counts {1 + hold:.3g}x faster"
    untried = [name for name in names if name not in times]
    why += f"; not tried: {', '.join(untried)}" if untried and not alone else ""
    medians = ", ".join(f"{n} {t * 1e3:.1f}" for n, t in times.items())
    return f"exchange='auto' at step {step}: {names[choice]} (median ms a step: {medians}{why})"


def median_of_samples(samples):
    """The median of a trial's timed samples (the last axis, an odd count; NumPy)."""
    return np.sort(samples, axis=-1)[..., (samples.shape[-1] - 1) // 2]
