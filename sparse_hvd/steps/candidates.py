"""``exchange="auto"``'s candidates: a plan per exchange it may run, the warm-up's trial
schedule, and dense's bytes on the wire, which the trials' rules compare against
(``sparse_hvd.steps.measured``)."""

from typing import List, NamedTuple

from ..exchanges import create


class Plan(NamedTuple):
    """One candidate: its name, its exchange and the routes it runs with; for dense, also
    the routes once the residuals are clear and those of a trial's turn, which keeps the
    residuals (None: always ``routes``)."""

    name: str
    exchange: object
    routes: list
    clear_routes: list = None
    held_routes: list = None


def plans_for(optimizer, candidates, routes) -> List[Plan]:
    """A plan per candidate, the optimizer's current exchange first. A candidate that sends no
    selections (dense) runs every sparse route whole (``Route.flushed``)."""
    plans = [Plan(optimizer._exchange.method, optimizer._exchange, list(routes))]
    for name in candidates:
        if name == plans[0].name:
            continue
        # names of its own: no collective of one candidate shares a name (and Horovod's
        # cached response) with another's of other shapes
        exchange = create(name, optimizer._exchange.grouping, name=f"{optimizer._prefix}.{name}",
                          process_set=optimizer.process_set,
                          compression=optimizer._compression)
        exchange.saves_state = False
        if exchange.sends_selections:
            plans.append(Plan(name, exchange, list(routes)))
            continue
        flushing = [route._replace(sparse=False, flushed=route.sparse) for route in routes]
        # once flushed, a residual stays zero (or, with compression, holds the rounding error
        # that the dense route's own rounding keeps there too): plain dense routes then send
        # the same; with the update cut too, since the flushing step also makes the inner
        # state, each rank's own until then, the mean over the ranks (``MeasuredChoiceStep``;
        # with compression its rounding error, kept in the residual, is in steps and the next
        # dense step sends it with a gradient: a float16 rounding of one step, once a switch);
        # a trial's dense turn runs plain dense routes too, but keeps the residuals for the
        # sparse steps after it (``Route.held``); not with momentum correction, whose dense
        # route applies global momentum
        clear = held = None
        if not optimizer.momentum_correction:
            clear = [route._replace(sparse=False) for route in routes]
            held = [route._replace(sparse=False, held=route.sparse) for route in routes]
        plans.append(Plan(name, exchange, flushing, clear, held))
    return plans


def warmup_trials(policy, settled, trial_length) -> List[int]:
    """Step 3's re-trials before ``settled`` (the warm-up's last step, 0 for none): the first
    steps where the policy's density has halved since the previous trial, each at least two
    trials' length after the previous one and before the one at ``settled``, which is always
    made. The warm-up's density does not rise, so each is found by bisection."""
    if settled <= 0:
        return []
    starts, last = [], 1
    while True:
        half = policy.current_density(0, last) / 2
        low, high = last + 2 * trial_length, settled - 2 * trial_length
        if low > high or policy.current_density(0, high) > half:
            return starts + [settled]
        while low < high:  # the first step in [low, high] at or below half
            middle = (low + high) // 2
            if policy.current_density(0, middle) <= half:
                high = middle
            else:
                low = middle + 1
        starts.append(low)
        last = low


def dense_bytes_per_entry(workers, value_bytes) -> float:
    """What dense's ring allreduce receives per entry: ``2 (N - 1) / N`` values."""
    return 2 * (workers - 1) / workers * value_bytes
