"""The exchange registry: names, groupings, capabilities, and what exchange="auto" may choose."""

import math

import keras
import pytest

import sparse_hvd
from sparse_hvd import checks
from sparse_hvd.selection.adaptive import AdaptiveDensity
from sparse_hvd.exchanges.compression import Compression
from sparse_hvd.selection.density import ConstantDensity
from sparse_hvd.steps.candidates import Plan, warmup_trials
from sparse_hvd.steps.measured import DENSE_WITHIN
from sparse_hvd.steps.trace_cost import TraceCosts
from sparse_hvd.steps.trial_rules import (DENSE_TURN_SPREAD, SAVING, bound_seconds, decide,
                                          decision_message, decisive_loss, early_recheck, held,
                                          pays_for_its_trace, sparse_can_win, turn_order,
                                          whole_margin, within_reach, worth_trying)
from sparse_hvd.exchanges import available, create, exchange_class, groupings_of, register
from sparse_hvd.exchanges.base import Exchange, HEADER_FIELDS, _REGISTRY, header


def test_every_exchange_is_registered_with_its_groupings():
    assert set(available()) == {"dense", "allgather", "compact_allgather", "sparse_allreduce",
                                "plain_sparse_allreduce", "sign", "sign_per_variable", "topk_sign",
                                "topk_sign2", "topk_sign_pairs"}
    assert groupings_of("sign") == ("grouped",)
    assert exchange_class("sign").chooses_entries
    assert set(groupings_of("allgather")) == {"grouped", "layerwise"}
    assert set(groupings_of("compact_allgather")) == {"grouped", "layerwise"}
    assert set(groupings_of("sparse_allreduce")) == {"grouped", "layerwise"}
    assert set(groupings_of("plain_sparse_allreduce")) == {"grouped", "layerwise"}
    for grouping in ("grouped", "layerwise"):  # the same exchange, blocks coded or not
        assert exchange_class("sparse_allreduce", grouping).coded
        assert not exchange_class("plain_sparse_allreduce", grouping).coded
    assert exchange_class("sparse_allreduce", "layerwise").per_layer
    assert exchange_class("allgather", "layerwise").per_layer
    assert exchange_class("compact_allgather", "layerwise").per_layer
    assert exchange_class("compact_allgather", "layerwise").coded
    assert not exchange_class("allgather", "grouped").per_layer
    made = create("sparse_allreduce", name="t", compression=None)
    assert made.method == "sparse_allreduce" and made.returns_unsent


def test_unknown_names_and_groupings_are_refused_naming_what_exists():
    with pytest.raises(ValueError, match="`exchange` must be one of .*'allgather'.*'auto'.*got 'ring'"):
        exchange_class("ring")

    @register("test_grouped_only", grouping="grouped")
    class GroupedOnly(Exchange):
        grouping_reason = "it moves every variable in one collective."

    try:
        with pytest.raises(ValueError, match="exchange='test_grouped_only' cannot be combined "
                                             "with grouping='layerwise': it moves every"):
            sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1),
                                                  exchange="test_grouped_only",
                                                  grouping="layerwise")
    finally:
        del _REGISTRY[("test_grouped_only", "grouped")]


def test_auto_chooses_among_the_exchanges_whose_capabilities_fit():
    constant = ConstantDensity(0.01)
    # the plain sparse allreduce is never auto's: the coded one applies the same bits
    assert set(checks.exchange_candidates("auto", "grouped", 0, constant, Compression())) == {
        "allgather", "compact_allgather", "sparse_allreduce", "dense"}
    half = checks.exchange_candidates("auto", "grouped", 0, constant, Compression("float16"))
    assert set(half) == {"allgather", "compact_allgather", "sparse_allreduce", "dense"}
    assert set(checks.exchange_candidates("auto", "grouped", 2, constant, Compression())) == {
        "allgather", "compact_allgather", "dense"}  # staleness: what the pipeline can run
    assert set(checks.exchange_candidates("auto", "layerwise", 0, AdaptiveDensity(),
                                      Compression())) == {
        "allgather", "compact_allgather", "sparse_allreduce", "dense"}
    # signs: the exchange that chooses its entries, or dense; it starts with the one that sends
    assert checks.exchange_candidates("auto", "grouped", 0, constant, Compression(),
                                      code="signs") == ("sign", "dense")
    # the top entries and the signs of the rest: that exchange, or dense
    assert checks.exchange_candidates("auto", "grouped", 0, constant, Compression(),
                                      code="entries_and_signs") == ("topk_sign", "dense")
    assert checks.exchange_candidates("auto", "grouped", 0, constant, Compression())[0] == \
        "allgather"


def test_auto_takes_the_fastest_and_dense_unless_a_sparse_exchange_clearly_wins():
    names = ["allgather", "dense", "sparse_allreduce"]
    assert names[decide([3.0, 2.0, 1.0], names, DENSE_WITHIN)] == "sparse_allreduce"
    assert names[decide([1.0, 2.0, 3.0], names, DENSE_WITHIN)] == "allgather"
    # within DENSE_WITHIN of the fastest: dense (it needs no extra steps to a loss)
    margin = DENSE_WITHIN
    assert names[decide([1.0, 1.0 + margin * 0.9, 3.0], names, margin)] == "dense"
    assert names[decide([1.0, 1.0 + margin * 1.1, 3.0], names, margin)] == "allgather"
    # without dense among the candidates, ties go by name: the same on every rank
    assert decide([2.0, 2.0], ["sparse_allreduce", "allgather"], DENSE_WITHIN) == 1


def test_a_held_incumbent_counts_faster_by_the_hold_alone():
    """``held``: the incumbent's time over ``1 + hold``, every other time as it was; with no
    incumbent, nothing changes. Dense 1.18 s against the signs' 1.0 s at their 1.2x margin
    (the sixty-fifth session's early re-check): dense, unless the signs are the incumbent
    held by 1.15x (1.0 / 1.15 x 1.2 = 1.043 s < 1.18 s); dense 1.3 s: the signs, unless
    dense is the incumbent (1.3 / 1.15 = 1.13 s <= 1.2 s)."""
    names = ["dense", "sign"]
    assert held([1.18, 1.0], None, 0.15) == [1.18, 1.0]
    assert held([1.18, 1.0, 3.0], 1, 0.15) == [1.18, 1.0 / 1.15, 3.0]
    assert names[decide(held([1.18, 1.0], None, 0.15), names, 0.2)] == "dense"
    assert names[decide(held([1.18, 1.0], 1, 0.15), names, 0.2)] == "sign"
    assert names[decide(held([1.18, 1.0], 0, 0.15), names, 0.2)] == "dense"
    assert names[decide(held([1.3, 1.0], None, 0.15), names, 0.2)] == "sign"
    assert names[decide(held([1.3, 1.0], 1, 0.15), names, 0.2)] == "sign"
    assert names[decide(held([1.3, 1.0], 0, 0.15), names, 0.2)] == "dense"
    assert names[decide(held([1.3, 1.0], 0, 0.0), names, 0.2)] == "sign"  # no hold
    # rank 0's line says so where a hold counted, and only there
    times = {"dense": 0.0823, "sign": 0.0626}
    said = "sign, the choice until now, counts 1.15x faster"
    assert said in decision_message(118, names, 1, times, 0.0339, False, 0.2, 1, 0.15)
    assert said.split(",")[1] not in decision_message(118, names, 1, times, 0.0339, False, 0.2,
                                                      1, 0.0)
    assert said.split(",")[1] not in decision_message(118, names, 1, times, 0.0339, False, 0.2)


def test_dense_loses_by_far_only_beyond_what_its_own_slowest_turn_explains():
    """Dense's median over (1 + margin) x ``DENSE_TURN_SPREAD`` x the fastest sparse median:
    the wide CNN's first trial at 1 Gbit/s and 4 workers on one seed (dense 0.402 s against
    the sparse allreduce's 0.125, 3.2x) is such a loss; another seed's (0.337 against 0.136,
    2.5x) is an ordinary one. Not where dense or every sparse candidate did not run."""
    names = ["allgather", "dense", "sparse_allreduce"]
    assert DENSE_TURN_SPREAD == 1.75
    assert decisive_loss([0.196, 0.402, 0.125], names, DENSE_WITHIN)
    assert not decisive_loss([0.210, 0.337, 0.136], names, DENSE_WITHIN)
    edge = (1 + DENSE_WITHIN) * DENSE_TURN_SPREAD * 2.0  # 5.25 against a fastest 2.0
    assert decisive_loss([math.inf, edge * (1 + 1e-9), 2.0], names, DENSE_WITHIN)
    assert not decisive_loss([math.inf, edge, 2.0], names, DENSE_WITHIN)
    assert not decisive_loss([3.0, edge * 2, 2.0], names, 2 * edge)  # the margin counts
    assert not decisive_loss([0.1, math.inf, 0.1], names, DENSE_WITHIN)
    assert not decisive_loss([math.inf, 9.0, math.inf], names, DENSE_WITHIN)
    assert not decisive_loss([0.1, 9.0], ["allgather", "sparse_allreduce"], DENSE_WITHIN)


def test_the_early_recheck_leaves_dense_out_only_after_a_loss_beyond_doubt():
    """After an ordinary loss (or a win) of dense the early re-check runs every candidate;
    after one beyond doubt it runs the sparse ones alone, and with one of them none at all
    (whatever number of sparse candidates an ordinary loss leaves)."""
    assert [early_recheck(False, n) for n in (0, 1, 3)] == ["all"] * 3
    assert [early_recheck(True, n) for n in (0, 1, 2, 3)] == ["none", "none", "sparse", "sparse"]


def test_the_signs_ask_a_margin_of_their_own_top_k_the_library_s(monkeypatch):
    """Adam's signs declare 1.2x (their averages need about dense's steps), the top-k
    exchanges none (the library's 1.5x); a trial of dense and the signs asks theirs, at the
    settled density and scaled like the library's in a warm-up; dense's own declaration, had
    it one, does not count. At 10 Gbit/s the signs took 55-61 ms a step against dense's
    79-99 (docs/time_to_loss_adam_10gbit_retime.md): 1.42-1.65x, which the 1.5x split."""
    import sparse_hvd.steps.measured as measured

    def plan(name):
        return Plan(name, exchange_class(name), [])

    assert exchange_class("sign").dense_within == 0.2
    assert exchange_class("sign_per_variable").dense_within == 0.2
    for name in ("dense", "allgather", "compact_allgather", "sparse_allreduce", "topk_sign",
                 "topk_sign_pairs"):
        assert exchange_class(name).dense_within is None, name
    signs = [plan("sign"), plan("dense")]
    top_k = [plan("dense"), plan("allgather"), plan("sparse_allreduce")]
    assert whole_margin(signs, DENSE_WITHIN) == 0.2
    assert whole_margin(top_k, DENSE_WITHIN) == DENSE_WITHIN
    monkeypatch.setattr(exchange_class("dense"), "dense_within", 0.05)
    assert whole_margin(top_k, DENSE_WITHIN) == DENSE_WITHIN
    names = ["sign", "dense"]
    assert names[decide([60.9, 86.4], names, whole_margin(signs, DENSE_WITHIN))] == "sign"
    assert names[decide([60.9, 86.4], names, DENSE_WITHIN)] == "dense"
    # a warm-up trial at 4x the settled density: half the whole margin, floored at the noise
    assert measured.dense_margin(0.04, 0.01, 0.2) == measured.NOISE_WITHIN
    assert measured.dense_margin(0.04, 0.01, 0.5) == 0.25


def test_the_dense_margin_is_1_5x_and_the_old_one_can_be_set_back(monkeypatch):
    """A sparse step 1.3x faster than dense's (the compute-bound LSTM's, about) runs dense; the
    README's way back to the previous margin (DENSE_WITHIN = 0.2) picks the sparse one."""
    import sparse_hvd.steps.measured as measured

    names = ["allgather", "dense"]
    assert measured.DENSE_WITHIN == 0.5
    settled = measured.dense_margin(0.01, 0.01)  # the margin of a trial at the settled density
    assert settled == 0.5
    assert names[decide([1.0, 1.3], names, settled)] == "dense"
    assert names[decide([1.0, 1.6], names, settled)] == "allgather"
    monkeypatch.setattr(measured, "DENSE_WITHIN", 0.2)
    assert names[decide([1.0, 1.3], names, measured.dense_margin(0.01, 0.01))] == "allgather"


def test_a_warmup_trial_asks_less_of_a_sparse_step_by_the_root_of_its_density():
    """At the settled density (or above it, or with no warm-up) the whole margin; during a
    warm-up 0.5 x sqrt(settled / density), never under NOISE_WITHIN: 10% -> 1% asks 1.158x at
    its start, 4% 1.25x, 2% 1.354x. A sparse step 1.36x faster than dense's at 9.3% (the wide
    CNN's first trial at 4 workers on 1 Gbit/s, on a slow machine) runs sparse; at the
    settled density the same times run dense."""
    import sparse_hvd.steps.measured as measured

    margin = measured.dense_margin
    assert margin(0.01, 0.01) == margin(0.005, 0.01) == margin(0.3, 0.0) == 0.5
    assert margin(0.1, 0.01) == pytest.approx(0.5 * math.sqrt(0.1))
    assert margin(0.04, 0.01) == pytest.approx(0.25)
    assert margin(0.02, 0.01) == pytest.approx(0.5 / math.sqrt(2))
    assert margin(1.0, 0.001) == measured.NOISE_WITHIN == 0.15  # 0.0158 raised to the floor
    names = ["allgather", "dense"]
    times = [0.426, 0.578]
    assert names[decide(times, names, margin(0.093, 0.01))] == "allgather"
    assert names[decide(times, names, margin(0.01, 0.01))] == "dense"


def test_no_sparse_candidate_is_tried_where_compute_alone_is_within_the_margin():
    """A sparse step costs at least dense's compute (its step less its exchange): with a 172 ms
    step of which 40 ms are the exchange (the character LSTM on 1 Gbit/s links, about), even a
    free exchange would be 1.30x faster, under the 1.5x margin; with 280 of 363 ms (the wide
    CNN) it could be 4.4x faster."""
    assert not sparse_can_win(0.172, 0.172 - 0.040, DENSE_WITHIN)
    assert sparse_can_win(0.363, 0.363 - 0.280, DENSE_WITHIN)
    # the bound itself: exactly the margin is not enough, just over it is
    assert not sparse_can_win((1 + DENSE_WITHIN) * 0.1, 0.1, DENSE_WITHIN)
    assert sparse_can_win((1 + DENSE_WITHIN) * 0.1 + 1e-9, 0.1, DENSE_WITHIN)


def test_auto_tries_what_builds_on_the_allgather_only_where_its_bytes_could_pay():
    """The bound: the reference's step less the bytes saved, priced at dense's exchange time
    per byte. 4 workers, 1%: dense receives 6 bytes an entry, the allgather 0.24, the sparse
    allreduce's lower bound 0.12. The numbers of a trial on 10 Gbit/s links (dense 104.9 ms,
    its compute 13.9, the allgather 88.4): 1.8 ms saved at most, 86.6 ms, not 1.5x under
    dense's. On 1 Gbit/s links (dense 336 ms, compute 46.5, the allgather 142.3 at the
    warm-up's 2.5%, 0.6 against 0.3 bytes): 14.5 ms saved, under the allgather's by 5%, and
    under the fastest step so far unless another candidate's step was at or under the bound
    (127.8 ms)."""
    inf = math.inf
    assert not within_reach(0.12, 0.0884, 0.24, 0.1049, 0.0139, 6.0, inf, DENSE_WITHIN)
    assert within_reach(0.3, 0.1423, 0.6, 0.336, 0.0465, 6.0, inf, DENSE_WITHIN)
    bound = 0.1423 - 0.3 * (0.336 - 0.0465) / 6.0
    assert bound == pytest.approx(0.127825)
    assert not within_reach(0.3, 0.1423, 0.6, 0.336, 0.0465, 6.0, bound, DENSE_WITHIN)
    assert within_reach(0.3, 0.1423, 0.6, 0.336, 0.0465, 6.0, bound + 1e-9, DENSE_WITHIN)
    # closed form at the edges: a bound of exactly dense's step over the margin is out, as is
    # one exactly the reference's over 1 + SAVING; just under both is in
    price = (1.0 - 0.5) / 5.0  # 0.1 s per byte of an entry
    edge = 1.0 / (1 + DENSE_WITHIN)  # the bound that ties the margin
    # the bound: the edge exactly
    assert not within_reach(0.0, edge + 0.2, 2.0, 1.0, 0.5, 5.0, inf, DENSE_WITHIN)
    assert within_reach(0.0, edge + 0.2 - 1e-9, 2.0, 1.0, 0.5, 5.0, inf, DENSE_WITHIN)
    tie = 0.3 * (1 + SAVING) / SAVING  # a reference whose step ties the bound at SAVING
    assert not within_reach(0.0, tie, 3.0, 100.0, 100.0 - 5.0 * price, 5.0, inf, DENSE_WITHIN)
    assert within_reach(0.0, tie * (1 - 1e-9), 3.0, 100.0, 100.0 - 5.0 * price, 5.0, inf,
                        DENSE_WITHIN)
    # more bytes than the reference never lowers the bound; unknown bytes are always tried
    assert not within_reach(0.5, 0.1, 0.24, 0.1049, 0.0139, 6.0, inf, DENSE_WITHIN)
    assert within_reach(None, 1.0, 0.24, 0.1, 0.0, 6.0, 0.0, DENSE_WITHIN)


def test_a_candidate_not_yet_traced_runs_only_where_its_saving_repays_its_trace():
    """The saving a step: what would run without the candidate (the fastest step so far where
    it beats dense by the trial's margin, else dense's) less the candidate's bound, times the
    steps to the next trial, against the trace's cost. Closed form: dense 1.0 s, of which
    0.5 s its exchange of 5 bytes an entry (0.1 s a byte); the reference 0.8 s at 2 bytes, the
    candidate 1 byte: its bound 0.7 s."""
    numbers = (1.0, 0.8, 2.0, 1.0, 0.5, 5.0)
    assert bound_seconds(*numbers) == pytest.approx(0.7)
    assert bound_seconds(None, *numbers[1:]) is None

    def pays(fastest, margin, horizon, trace):
        return pays_for_its_trace(*numbers, fastest, margin, horizon=horizon,
                                  trace_seconds=trace)

    # margin 0.5: the reference (0.8 x 1.5 >= 1.0) would not run, dense would: 0.3 s a step
    assert pays(0.8, 0.5, 10, 3.0 * (1 - 1e-9)) and not pays(0.8, 0.5, 10, 3.0 * (1 + 1e-9))
    # margin 0.2: the reference would run (0.96 < 1.0): 0.1 s a step
    assert pays(0.8, 0.2, 10, 1.0 * (1 - 1e-9)) and not pays(0.8, 0.2, 10, 1.0 * (1 + 1e-9))
    # a faster candidate ran before it (0.75 s): 0.05 s a step; under its bound, nothing
    assert pays(0.75, 0.2, 100, 4.9) and not pays(0.75, 0.2, 100, 5.1)
    assert not pays(0.69, 0.2, 10 ** 6, 0.0)
    # nothing measured yet: any saving pays; unknown bytes are always tried
    assert pays(0.8, 0.2, 1, 0.0)
    assert pays_for_its_trace(None, *numbers[1:], 0.8, 0.2, horizon=1, trace_seconds=1e9)
    # first trials of the wide CNN at 4 workers and 10% (logged on the emulated 10 and 1
    # Gbit/s clusters): dense 119.2 / 409.8 ms, its compute 53.5 / 98.7; the allgather 130.7 /
    # 289.2 ms at 2.4 bytes an entry, the sparse allreduce 0.578; a trace of 2.5 s, 110 steps
    # to the next trial: 0.9 s saved against 10.4 s
    assert not pays_for_its_trace(0.578, 0.1307, 2.4, 0.1192, 0.0535, 6.0, 0.1192, 0.158,
                                  horizon=110, trace_seconds=2.5)
    assert pays_for_its_trace(0.578, 0.2892, 2.4, 0.4098, 0.0987, 6.0, 0.2892, 0.158,
                              horizon=110, trace_seconds=2.5)


def test_without_the_trace_rule_whatever_is_within_reach_is_tried(monkeypatch):
    """``TRACE_MUST_PAY = False``: the previous releases' rule, the reach rule alone."""
    import sparse_hvd.steps.trial_rules as trial_rules

    monkeypatch.setattr(trial_rules, "TRACE_MUST_PAY", False)
    assert pays_for_its_trace(0.578, 0.1307, 2.4, 0.1192, 0.0535, 6.0, 0.1192, 0.158,
                              horizon=110, trace_seconds=2.5)


def test_a_trace_costs_the_least_first_step_less_its_turns_median():
    """Each candidate's first step less its first turn's median; the least stands for all;
    0 before any; a turn without a first step counted (later turns) adds nothing; a first
    step faster than the median costs 0."""
    costs = TraceCosts(3)
    assert costs.seconds == 0.0
    costs.timed(1, 0.1)
    assert costs.seconds == 0.0 and costs.costs == []
    costs.began(1, 2.6)
    costs.timed(1, 0.1)
    assert costs.seconds == pytest.approx(2.5)
    costs.timed(1, 0.0)  # its later turn
    costs.began(2, 3.2)
    costs.timed(2, 0.2)
    assert costs.costs == pytest.approx([2.5, 3.0]) and costs.seconds == pytest.approx(2.5)
    costs.began(0, 0.05)
    costs.timed(0, 0.08)
    assert costs.seconds == 0.0


def test_auto_times_the_candidates_that_build_on_the_allgather_fewest_bytes_first(monkeypatch):
    """A trial's turns: the plan the steps before it ran (dense), the reference (the
    allgather), then the others by their bytes on the wire at the trial's density, fewest
    first, ties in the plans' order. The sparse allreduce receives 2 (N - 1) / N entries a
    sent entry, the coded allgather N - 1 (the same code per entry): a tie at two workers,
    the sparse allreduce first from three on. An exchange whose bytes are not known goes
    last."""
    import sparse_hvd.exchanges.base as base
    import sparse_hvd.steps.trial_rules as trial_rules

    names = ("allgather", "compact_allgather", "sparse_allreduce", "dense")
    for size in (2, 3, 4, 8):
        monkeypatch.setattr(base.runtime, "size", lambda process_set=None, n=size: n)
        plans = [Plan(name, create(name, "grouped", name="order"), []) for name in names]
        coded = plans[1].exchange.wire_bytes_per_entry(0.1, 4) / (size - 1)
        assert plans[2].exchange.wire_bytes_per_entry(0.1, 4) == pytest.approx(
            2 * (size - 1) / size * coded)
        expected = [3, 0, 1, 2] if size == 2 else [3, 0, 2, 1]
        assert turn_order(plans, 3, 0, 0.1, 4) == expected
        unknown = Plan("unknown", type("Unknown", (), {"wire_bytes_per_entry": lambda *a: None})(),
                       [])
        assert turn_order([unknown] + plans, 4, 1, 0.1, 4)[-1] == 0
    # no reference: the plan before the trial, then the rest by bytes (8 workers)
    assert turn_order(plans, 3, None, 0.1, 4) == [3, 2, 1, 0]
    # the previous releases' order: the rest as the plans come
    monkeypatch.setattr(trial_rules, "FEWEST_BYTES_FIRST", False)
    assert turn_order(plans, 3, 0, 0.1, 4) == [3, 0, 1, 2]


def test_auto_tries_again_each_time_the_warmup_halves_the_density():
    import math

    from sparse_hvd.selection.density import ConstantDensity, WarmupDensity

    # 25% -> 1% over 200 steps halves the density every 200 ln 2 / ln 25 = 43.07 steps, so
    # 44 steps after each trial's start (the first at step 1): 45, 89, 133; 177 would leave less
    # than two 16-step trials before the warm-up's end at 200, which is always tried
    half = math.ceil(200 * math.log(2) / math.log(25))
    expected = [1 + j * half for j in (1, 2, 3)]
    assert expected == [45, 89, 133]
    assert warmup_trials(WarmupDensity(0.01, 0.25, 200), 200, 16) == expected + [200]
    # two trials' length apart at least: 16% -> 1% over 80 steps halves every 20 steps
    assert warmup_trials(WarmupDensity(0.01, 0.16, 80), 80, 16) == [33, 80]
    assert warmup_trials(ConstantDensity(0.01), 0, 16) == []


def test_auto_skips_a_candidate_whose_bytes_alone_cannot_beat_dense(monkeypatch):
    """Per entry of the model, dense's ring allreduce receives 2 (N - 1) / N values; a sparse
    exchange at density d receives d x its bytes per sent entry; it is tried only below dense's
    bytes over 1 + DENSE_WITHIN. At 8 workers and float32 values dense receives 7 bytes."""
    import sparse_hvd.exchanges.base as base

    monkeypatch.setattr(base.runtime, "size", lambda process_set=None: 8)
    names = ("allgather", "compact_allgather", "sparse_allreduce", "dense")
    plans = [Plan(name, create(name, "grouped", name="gate"), []) for name in names]
    limit = 7 / (1 + DENSE_WITHIN)

    def wire(name, d, value=4):  # bytes a worker receives per entry of the model
        index = {"allgather": 4, "compact_allgather": (2 + math.log2(1 / d)) / 8}.get(name, 4)
        if name == "compact_allgather":  # the exponent's 8 (float16: 5) bits become 1.5
            value -= ((8 if value == 4 else 5) - 1.5) / 8
        per_entry = 2 * 7 / 8 * (value + 4) if name == "sparse_allreduce" else 7 * (value + index)
        return d * per_entry

    # the warm-up's 25%: the allgather moves 14 bytes (2x dense), the coded one 6.45
    assert wire("allgather", 0.25) == 14 and wire("compact_allgather", 0.25) == 6.453125
    assert worth_trying(plans, 0.25, 4, DENSE_WITHIN) == [False, False, True, True]
    for d in (0.125, 0.0625, 0.01):
        assert worth_trying(plans, d, 4, DENSE_WITHIN) == [
            wire(n, d) < limit for n in names[:3]] + [True]
    assert worth_trying(plans, 0.125, 4, DENSE_WITHIN) == [False, True, True, True]
    assert worth_trying(plans, 0.01, 4, DENSE_WITHIN) == [True] * 4
    # 16-bit values: dense receives 3.5 bytes an entry, the indices weigh more
    half = [wire(n, 0.125, value=2) < 3.5 / (1 + DENSE_WITHIN) for n in names[:3]]
    assert worth_trying(plans, 0.125, 2, DENSE_WITHIN) == half + [True]
    assert half == [False, True, True]
    # with no candidate left (dense not among them) every one is tried
    assert worth_trying(plans[:2], 0.25, 4, DENSE_WITHIN) == [True, True]


def test_a_new_exchange_is_one_class_and_its_registration():
    @register("test_only", grouping="grouped")
    class Nothing(Exchange):
        compression_capable = False

    try:
        assert "test_only" in available()
        assert isinstance(create("test_only", name="x"), Nothing)
        with pytest.raises(ValueError, match="exchange='test_only'"):
            checks.exchange_candidates("test_only", "grouped", 0, ConstantDensity(0.01),
                                       Compression("bfloat16"))
    finally:
        del _REGISTRY[("test_only", "grouped")]


def test_the_shared_header_is_flag_then_lockstep_fields_then_the_exchanges_own():
    import tensorflow as tf

    row = header(tf.constant(False), tf.constant(7, tf.int64), rest=[tf.constant(3),
                                                                   tf.constant(4)]).numpy()
    assert row[0] == 0 and list(row[HEADER_FIELDS:]) == [3, 4]
    assert len(row) == HEADER_FIELDS + 2
