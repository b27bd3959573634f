"""``exchange="auto"``: the exchange that makes this job's steps fastest, timed on its own steps.

A model of the network cannot see the CPU work around an exchange (selection, packing,
summing), which on a fast link decides whether a sparse step is faster than dense at all. So
the candidates (the exchanges that can run the optimizer's other settings: the dense allreduce
of everything, the allgather, the allgather with coded indices, the sparse allreduce) are
timed on the job's own steps. A variable, the same on every rank, says which one the next step
runs: traced once, the step holds every candidate as a branch of one ``tf.switch_case``; with
``traced_choice`` (``ExchangeChoiceCallback``, ``sparse_hvd.function``) each step runs a
function traced for its candidate alone (``traced``), which saves the conditional's cost.
Before the first trial the steps run dense (``first_mode``). The trials' bookkeeping (steps
1-3 below) runs on the host, in one ``numpy_function`` per trial step on the times every rank
gathered, so every rank keeps the same numbers; as graph operations it was about 500 of every
traced step's (a third of dense's step on the wide CNN), and each one costs trace time.

1. **Trial.** From step ``trial_start`` on, each candidate worth trying runs ``TRIAL_STEPS``
   steps in turn, dense first. The first of each is not timed (its first run sets up its
   collectives); a candidate's first turn in the job (every turn of the first trial but
   dense's, or a candidate first tried later) leaves its first ``FIRST_TRIAL_UNTIMED`` untimed:
   an exchange's first steps still pay for their start (the wide CNN at 4 workers and 1
   Gbit/s: the allgather's steps after its trace 0.52, 0.40, 0.32, then about 0.25 s). A timed
   step is the whole step, from the previous step's last write to this one's (on shared cores a
   candidate's CPU work slows the other ranks' backprop), as the mean over the ranks, so every
   rank holds the same numbers. Two timed steps in a row over ``ABORT_AFTER`` x the fastest
   median so far end their candidate's turn (one alone may be noise). Not worth trying
   (``worth_trying``): a sparse candidate whose bytes on the wire alone, at the trial's density,
   cannot beat dense by ``DENSE_WITHIN``. Dense's steps also time its exchange on every rank:
   the rank that reached the collective last waited only for the transfer, so the step less its
   time is the compute no exchange removes (``sparse_can_win``); where dense's step is within
   ``DENSE_WITHIN`` of it in two turns in a row (``HOPELESS_RETIMES``; a job's first steps can
   read dense 3-4x high), the trial ends with it and the sparse candidates are never traced or
   run (on the character LSTM at 1 Gbit/s their traces and trial steps made the first 20 steps
   2x dense's). After dense comes the reference (``Exchange.builds_on``: the coded allgather and
   the sparse allreduce do the allgather's work and more, to send fewer bytes), then the
   others, fewest bytes on the wire first (``turn_order``); at the end of each of these turns,
   those not run before leave the trial untraced where they could not become the choice, or
   beat the fastest step so far, even if their fewer bytes were all they changed
   (``within_reach``; where dense sits out, its last turn's step), or where what that would save
   a step until the next trial does not repay what a trace costs this job (``TraceCosts``,
   ``pays_for_its_trace``: with 4 ranks on 2 cores a trace took 2-6 s, 7-12 s of a 50 s run on
   10 Gbit/s links against dense's 44 s). One that ran in an earlier trial stays: it is traced
   already, its turn costs a few steps, and its measured step is worth more than the bound (at
   8 workers and 1 Gbit/s the bound once left out the sparse allreduce, traced before, and
   dense ran 66 more steps at 0.47 s; in another seed's trial it took half the allgather's step).
2. **Decision**, in the trial's last step, on every rank at once, by one rule on the same
   numbers: the fastest median, except that dense wins unless a sparse exchange's step is
   faster than dense's by more than ``DENSE_WITHIN`` (1.5x), or the margin the candidates'
   exchanges declare (``Exchange.dense_within``, ``whole_margin``: Adam's signs 1.2x): a
   sparse run needs more steps to the same loss (top-k's steps ratio: 0.94-1.07 on a CNN,
   1.40-1.78 on a character LSTM, ``docs/steps_to_loss.md``; the signs' 0.80-1.10), and a
   trial's medians on shared cores are noisy (with a margin of 1.2 top-k on the LSTM at 4
   workers and 1 Gbit/s reached dense's loss 0.81x as fast as dense). A warm-up's trials ask
   less (``dense_margin``: it shrinks with the square root of the settled density over the
   trial's, to 1.15x at the least), since their steps run at a density where a sparse step
   loses fewer steps; the trial at the warm-up's end and the re-checks ask the whole margin,
   as does step 1's ``within_reach`` (``pays_for_its_trace`` the trial's own). Rank 0 logs
   the times, the margin and the choice.
3. **Re-trials**, since the link and the density can change: during a warm-up, each time the
   density has halved since the last trial (``warmup_trials``: from 10% to 1% a sparse
   exchange often wins long before the warm-up ends, and a short run is mostly warm-up),
   each of them without the sparse candidates measured over ``PRUNE_AFTER`` x a trial's
   fastest (on a fast link the sparse exchanges at 25% density took 4-5x dense's step, and
   their re-trials made a 250-step run 1.7x slower than dense), without what builds on a
   pruned reference and was not tried with it, and without dense once sparse exchanges beat
   it in two trials in a row or in one by far (``_dense_beaten``); at the density policy's
   first settled step (the warm-up's end), with every candidate worth trying but a beaten
   dense; then every ``RECHECK_STEPS`` steps, all (``next_trial_after``). A job whose first
   decision no warm-up trial follows (no warm-up, or a restored job's first trial) re-checks
   it ``FIRST_RECHECK_STEPS`` after it: that trial's timings, on every candidate's first
   steps, are the job's least reliable (at 8 workers on the emulated 1 Gbit/s cluster one
   chose dense, whose step was 3.1x the fastest candidate's). After a loss of dense beyond
   doubt that re-check runs without it, or not at all (``early_recheck``). At the
   density of the trial that made the current choice, its median counts ``HOLD_WITHIN``
   (1.15x) shorter: a challenger must win by more than a trial's noise (Adam at 10 Gbit/s:
   the signs 1.4-1.7x faster a step, a re-check read 1.18x, under their 1.2x, and ran dense).

Switching keeps every replica identical (every rank runs the same branch) and error feedback
exact (``plan_step``): chosen, dense sends the residuals whole once and clears them (with
``sparsify="update"`` it also makes the inner state the mean over the ranks), then runs
Horovod's plain step; a trial's dense turn keeps the residuals for the sparse steps after it.
Other candidates' state (the sparse allreduce's thresholds) is not checkpointed: a restored
job measures again.
"""

import functools
import math
from typing import List

import numpy as np
import tensorflow as tf

from ..feedback.preparation import tensor_parts
from ..runtime import collectives, log, startup as runtime
from .candidates import Plan, dense_bytes_per_entry, plans_for, warmup_trials  # noqa: F401
from .plan_step import (DENSE_FLUSH, DENSE_HELD, DENSE_PLAIN, FIRST, plan_step,  # noqa: F401
                        traced_mode, traced_plan)
from .strategies import SynchronousStep
from .trace_cost import TraceCosts
from .trial_rules import (decide, decision_message, decisive_loss, early_recheck, held,
                          median_of_samples, pays_for_its_trace, plans_within_reach,
                          sparse_can_win, turn_order, whole_margin, within_reach, worth_trying)

TRIAL_STEPS = 4  # steps each candidate runs in a trial; the first is not timed
FIRST_TRIAL_UNTIMED = 4  # a candidate's first turn in the job: its first steps not timed (step 1)
RECHECK_STEPS = 1000  # a new trial this many steps after a decision
FIRST_RECHECK_STEPS = 100  # sooner after a job's first decision if no warm-up trial follows
DENSE_WITHIN = 0.5  # dense wins unless a sparse exchange's step is faster by more than this
PRUNE_AFTER = 2.0  # a warm-up re-trial skips candidates slower than this x the fastest
ABORT_AFTER = 2.0  # a turn ends at two timed steps in a row slower than this x the best so far
BEATEN_TRIALS = 2  # dense sits out the warm-up's later trials after losing this many in a row
NOISE_WITHIN = 0.15  # the smallest margin: a trial's medians on shared cores vary about this much
HOPELESS_RETIMES = 1  # dense's turn timed again before a trial can end with it (step 1)
HOLD_WITHIN = NOISE_WITHIN  # a re-check's incumbent counts this much faster (step 3)


def first_turn_length() -> int:
    """The steps of a candidate's first turn in the job (step 1)."""
    return FIRST_TRIAL_UNTIMED + TRIAL_STEPS - 1


def first_trial_length(candidates) -> int:
    """How many steps the job's first trial takes with ``candidates`` tried, dense among
    them (step 1): dense's turn is a later trial's length, the others' their first turn's."""
    return TRIAL_STEPS + (candidates - 1) * first_turn_length() if candidates else 0


def next_trial_after(step, warmup_trials, first_decision) -> int:
    """The trial after a decision at ``step`` (step 3): the warm-up's next, else a re-check
    ``FIRST_RECHECK_STEPS`` after the process's first decision, ``RECHECK_STEPS`` after others."""
    upcoming = [start for start in warmup_trials if start > step]
    if upcoming:
        return upcoming[0]
    return step + (min(FIRST_RECHECK_STEPS, RECHECK_STEPS) if first_decision else RECHECK_STEPS)


def dense_margin(density, settled_density, whole=None) -> float:
    """How much faster than dense's a sparse step must be to run, decided at a trial whose
    density is ``density`` in a run that settles at ``settled_density`` (step 2).

    ``whole`` (default ``DENSE_WITHIN``) prices the extra steps a sparse run needs at its
    settled density. A warm-up trial decides the steps until the next one, all at a higher
    density, where error feedback holds each entry back for fewer steps and a sparse step loses
    less per step: whole runs at 5% needed 1.04x dense's steps on the CNN (1.26x at 1%) and
    1.26x on the character LSTM (at 1% it never reached dense's loss;
    ``docs/steps_to_loss_ablations.md``). So the margin shrinks with the square root of the
    densities' ratio (slower than those measurements, erring towards dense), down to
    ``NOISE_WITHIN``, below which a trial's noise would decide. The settled density and the
    later re-checks keep the whole margin."""
    whole = DENSE_WITHIN if whole is None else whole
    if density <= settled_density or settled_density <= 0:
        return whole
    return min(whole, max(NOISE_WITHIN, whole * math.sqrt(settled_density / density)))


class MeasuredChoiceStep(SynchronousStep):
    """A synchronous step that runs the candidate exchange the trials timed fastest."""

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self.plans: List[Plan] = []
        self.decisions = []  # (step, {name: seconds}, choice), as rank 0 logged them
        # None: every candidate is a branch of one tf.switch_case; a plan's index: the step
        # is traced with that plan alone (``traced_choice``); FIRST: the plan steps run
        # before the first trial (the index is known once the optimizer is built)
        self.traced = None
        self.dense_index = None  # dense's plan, when it is a candidate
        self.reference_index = None  # the plan others build on (``Exchange.builds_on``)
        self.bounded = []  # per plan: whether it builds on the reference
        self._exchange_seconds = None  # in a trace: the exchange's time in the step being made

    def choose_among(self, candidates, routes):
        """Make the plans (at build, once the routes are fixed); with one worker or one
        candidate there is nothing to choose and the step is the synchronous one."""
        opt = self.optimizer
        self.plans = plans_for(opt, candidates, routes)
        if runtime.size(opt.process_set) == 1:
            self.plans = self.plans[:1]
        for plan in self.plans[1:]:
            plan.exchange.build(opt, plan.routes)
        count = len(self.plans)
        names = [plan.name for plan in self.plans]
        self.dense_index = names.index("dense") if "dense" in names else None
        bases = {plan.exchange.builds_on for plan in self.plans} & set(names)
        # one reference: the plan most others build on (every registered one builds on the
        # allgather); ties by name, so every rank picks alike
        reference = min(bases, key=lambda base: (-sum(
            plan.exchange.builds_on == base for plan in self.plans), base), default=None)
        self.reference_index = names.index(reference) if reference else None
        self.bounded = [reference is not None and plan.exchange.builds_on == reference
                        for plan in self.plans]
        policy = opt.density_policy
        settled = int(getattr(policy, "warmup_steps", 0) or 0)
        value_bytes = 2 if opt._compression.half is not None else max(
            [route.itemsize for route in routes if route.sparse], default=4)
        self.value_bytes = value_bytes
        self.within = whole_margin(self.plans, DENSE_WITHIN)  # the candidates' margin (step 2)
        with tf.init_scope():  # eager, also when the first step's trace builds the optimizer
            retrials = warmup_trials(policy, settled, count * TRIAL_STEPS)
            # the candidates worth trying at each trial's density (later: the last row's)
            starts = [1] + retrials
            self.gate_densities = [float(policy.current_density(0, start)) if settled
                                   else float(policy.final_density) for start in starts]
            # each trial's margin over dense in its decision (its density's ``dense_margin``);
            # which candidates run is asked with the whole margin (step 2)
            self.decision_margins = [dense_margin(density, float(policy.final_density),
                                                  self.within) for density in self.gate_densities]
        self.gate_starts = np.array(starts, np.int64)
        self.gates = np.array([worth_trying(self.plans, density, value_bytes, self.within)
                               for density in self.gate_densities], np.bool_)
        self.warmup_trials = retrials
        # the trials' own numbers, on the host (the same on every rank), not checkpointed
        self.trial_row = 0  # the next trial's row in the gates
        self.samples = np.zeros([count, TRIAL_STEPS - 1])  # each candidate's timed steps
        self.computes = np.zeros([TRIAL_STEPS - 1])  # dense's less its last arrival's exchange
        self.best = np.inf  # the fastest median so far in a trial
        self.pruned = np.zeros([count], np.bool_)  # over PRUNE_AFTER x the fastest: out
        self.dense_losses = 0  # warm-up trials in a row that dense lost (``_dense_beaten``)
        self.retimed = 0  # times dense's turn in this trial was timed again (``_record``)
        self.decided_at = None  # the density of the trial that made the choice (``_decide``)
        first = self.first_mode()
        # each candidate: has run its first steps (dense's ran before the trial; a sparse
        # first plan's steps after its trace are still slow, step 1)
        self.warmed = np.zeros([count], np.bool_)
        if self.dense_index is not None:
            self.warmed[self.dense_index] = True
        self.traces = TraceCosts(count)  # what a candidate's first steps cost (step 1)
        self.turn_lengths = self._next_turn_lengths()  # in the coming trial
        # what the graph reads: not optimizer variables, so not checkpointed either
        with tf.init_scope():
            self.choice = tf.Variable(first, dtype=tf.int32, trainable=False, name="auto_choice")
            self.steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="auto_steps")
            self.trial_start = tf.Variable(1, dtype=tf.int64, trainable=False,
                                           name="auto_trial_start")
            # which candidates the next trial runs, in the order of ``order``: dense first,
            # so that a sparse candidate far slower than it can end its turn early
            self.trying = tf.Variable(self.gates[0], trainable=False, name="auto_trying")
            # each candidate's turn in the next trial: its first one is longer (step 1)
            self.turn_steps = tf.Variable(self.turn_lengths, trainable=False,
                                          name="auto_turn_steps")
            # dense first, the reference, the rest fewest bytes first: the others can be skipped
            self.turn_order = np.array(turn_order(self.plans, first, self.reference_index,
                                                  self.gate_densities[0], value_bytes), np.int32)
            self.order = tf.constant(self.turn_order)
            self.next_branch = tf.Variable(first, dtype=tf.int32, trainable=False,
                                           name="auto_next_branch")
            self.next_in_trial = tf.Variable(False, trainable=False, name="auto_next_in_trial")
            # no residual is owed: none yet, or a dense step that went ahead sent them whole
            # and no sparse step came after it (False after a restore: they count)
            self.clear = tf.Variable(True, trainable=False, name="auto_residuals_clear")
            # with the update cut: the inner state may differ across the ranks (a sparse step
            # ran, or a restore, since it was last made their mean)
            self.own_state = tf.Variable(False, trainable=False, name="auto_inner_state_own")
            self.last_end = tf.Variable(0.0, dtype=tf.float64, trainable=False,
                                        name="auto_last_step_end")

    def discard(self):
        self.residuals_restored()

    def residuals_restored(self):
        """A restore replaced the residuals: the next dense step sends them again."""
        if len(self.plans) > 1:
            with tf.init_scope():  # also when asked in a trace: once, not in every step
                self.clear.assign(False)
                self.own_state.assign(True)

    def _current(self) -> Plan:
        """The plan running now (eager)."""
        return self.plans[int(self.choice.numpy())] if len(self.plans) > 1 else None

    def current_exchange(self):
        plan = self._current()
        return plan.exchange if plan else super().current_exchange()

    def current_routes(self):
        plan = self._current()
        return plan.routes if plan else super().current_routes()

    def wanted_mode(self) -> int:
        """What the next step's function is traced for (eager): its plan, or dense's way."""
        return traced_mode(self, int(self.next_branch.numpy()))

    def first_mode(self) -> int:
        """The plan steps run before the first trial: dense where it is a candidate (the
        exchange the user had before sparse_hvd, and the safe choice before any measurement)."""
        names = [plan.name for plan in self.plans]
        return names.index("dense") if "dense" in names else 0

    def _due(self):
        """This step's place in the schedule: (phase, in a trial, the trial's candidate, the
        branch due: the candidate in a trial, else the choice)."""
        trying = tf.cast(tf.gather(self.trying, self.order), tf.int64)
        # where each turn ends, in order (a candidate not trying has none)
        ends = tf.cumsum(trying * tf.gather(self.turn_steps, self.order))
        length = ends[-1]
        phase = self.steps - self.trial_start
        in_trial = tf.logical_and(phase >= 0, phase < length)
        # the candidate whose turn is the first to end after this phase
        passed = tf.cast(ends > tf.clip_by_value(phase, 0, length - 1), tf.int32)
        candidate = tf.gather(self.order, tf.argmax(passed, output_type=tf.int32))
        return phase, in_trial, candidate, tf.where(in_trial, candidate, self.choice)

    def run(self, grads_and_vars):
        if len(self.plans) < 2:
            return super().run(grads_and_vars)
        phase, in_trial, candidate, branch = self._due()
        if self.traced is None:  # in a trial the branch is the candidate's
            ended = tf.switch_case(branch, [plan_step(self, plan, grads_and_vars, in_trial)
                                            for plan in self.plans])
        else:
            index, way = traced_plan(self)
            trial_step = tf.logical_and(in_trial, tf.equal(candidate, index))
            ended = plan_step(self, self.plans[index], grads_and_vars, trial_step, way)()
            # a trial step due for another candidate waits until a step traced for it (only
            # when one call runs several steps: the callback re-traces before each call)
            put_off = tf.logical_and(in_trial, tf.not_equal(candidate, index))
            self.trial_start.assign_add(tf.cast(put_off, tf.int64))
            in_trial = tf.logical_and(in_trial, tf.logical_not(put_off))
        ended, exchanged = ended
        elapsed = ended - self.last_end  # the whole step: since the previous step's end
        self.last_end.assign(ended)
        tf.cond(in_trial, lambda: self._time(elapsed, exchanged, phase, candidate), lambda: None)
        self.steps.assign_add(1)
        _, in_trial, _, branch = self._due()
        self.next_branch.assign(branch)
        self.next_in_trial.assign(in_trial)

    def _time(self, elapsed, exchanged, phase, candidate):
        """Step 1's timing of one trial step (and step 2 at the trial's end): every rank's
        step and exchange times gathered, then :meth:`_record` on the host, whose results
        (the next trial's start, the choice, the candidates trying) the graph writes."""
        opt = self.optimizer
        times = collectives.allgather(tf.reshape(tf.stack([elapsed, exchanged]), [1, 2]),
                                      name=f"{opt._prefix}.auto.step",
                                      process_set=opt.process_set, step=self.steps)
        start, choice, trying, turn_steps = tf.numpy_function(
            self._record, [times, phase, candidate, self.steps, self.trial_start, self.choice,
                           self.trying], [tf.int64, tf.int32, tf.bool, tf.int64], stateful=True)
        self.trial_start.assign(tf.reshape(start, []))
        self.choice.assign(tf.reshape(choice, []))
        self.trying.assign(tf.reshape(trying, [len(self.plans)]))
        self.turn_steps.assign(tf.reshape(turn_steps, [len(self.plans)]))

    def _record(self, times, phase, candidate, step, start, choice, trying):
        """:meth:`_time` on the host. Every rank records the same numbers (the step's mean
        over the ranks; the step less the shortest exchange, dense's compute) and decides
        alike. A candidate whose last two timed steps each took over ``ABORT_AFTER`` x the
        fastest median so far ends its turn there (the faster of them stands for the samples
        it skips: at the warm-up's high densities a sparse step can take several times
        dense's). After dense's turn, a trial no sparse exchange can win ends (step 1); after
        the reference's, what cannot come within reach leaves it."""
        elapsed = float(np.mean(times[:, 0]))
        compute = elapsed - float(np.min(times[:, 1]))
        candidate, trying = int(candidate), np.array(trying, np.bool_)
        turn_start, turn_length = self._turn(candidate, trying)
        slot = int(phase) - turn_start - (turn_length - TRIAL_STEPS + 1)
        last_slot = TRIAL_STEPS - 2
        if slot < 0:  # the turn's first steps: not timed
            if int(phase) == turn_start and not self.warmed[candidate]:
                self.traces.began(candidate, elapsed)  # its trace ran just before
            return np.int64(start), np.int32(choice), trying, self.turn_lengths
        self.warmed[candidate] = True
        self.samples[candidate, slot] = elapsed
        over = slot >= 1 and min(self.samples[candidate, slot - 1:slot + 1]) > (
            ABORT_AFTER * self.best)
        skipped = last_slot - slot if slot < last_slot and over else 0
        if skipped:
            self.samples[candidate, slot + 1:] = min(self.samples[candidate, slot - 1:slot + 1])
        start -= skipped
        turn_done = slot + skipped == last_slot
        median = median_of_samples(self.samples[candidate])
        if turn_done:
            self.best = min(self.best, median)
            self.traces.timed(candidate, median)
        hopeless = False
        if self.dense_index is not None:
            if candidate == self.dense_index:
                self.computes[slot] = compute
            compute = median_of_samples(self.computes)
            hopeless = (turn_done and candidate == self.dense_index
                        and not sparse_can_win(median, compute, self.within))
            if hopeless and self.retimed < HOPELESS_RETIMES and np.count_nonzero(trying) > 1:
                # dense's turn again, its timed steps (step 1)
                self.retimed, self.best, start = self.retimed + 1, np.inf, start + TRIAL_STEPS - 1
                return np.int64(start), np.int32(choice), trying, self.turn_lengths
            if (turn_done and any(self.bounded) and trying[self.reference_index]
                    and (candidate == self.reference_index or self.bounded[candidate])
                    and np.all(self.samples[self.dense_index] > 0)):
                # a candidate that ran before (traced) stays: its turn costs a few steps; one
                # not traced runs if it could win and repay its trace by the next trial
                numbers = (self.plans, self.bounded, self.reference_index, self.dense_index,
                           median_of_samples(self.samples), compute, self.best,
                           self.gate_densities[self.trial_row], self.value_bytes)
                horizon = next_trial_after(int(step), self.warmup_trials, not self.decisions)
                pays = functools.partial(pays_for_its_trace, horizon=horizon - int(step),
                                         trace_seconds=self.traces.seconds)
                trying &= self.warmed | (plans_within_reach(*numbers, self.within, within_reach)
                                         & plans_within_reach(
                                             *numbers, self.decision_margins[self.trial_row], pays))
        length = int(np.sum(np.where(trying, self.turn_lengths, 0)))
        if (turn_done and int(phase) + skipped == length - 1) or hopeless:
            start, choice, trying = self._decide(hopeless, int(step), trying, int(choice))
            self.turn_lengths = self._next_turn_lengths()
        return np.int64(start), np.int32(choice), trying, self.turn_lengths

    def _next_turn_lengths(self):
        """The next trial's turns: those who have run their first steps are timed sooner."""
        return np.where(self.warmed, TRIAL_STEPS, first_turn_length()).astype(np.int64)

    def _turn(self, candidate, trying):
        """(its first phase, its length) of ``candidate``'s turn in a trial of ``trying``."""
        lengths = np.where(trying, self.turn_lengths, 0)[self.turn_order]
        position = int(np.flatnonzero(self.turn_order == candidate)[0])
        end = int(np.sum(lengths[:position + 1]))
        return end - int(lengths[position]), int(lengths[position])

    def exchange(self, payload, gradients):
        """Step 4, timed on this rank from its gradients' existence to its averages' (read by
        ``plan_step``'s step, in whose trace this runs); with nothing to choose, untimed."""
        if len(self.plans) < 2:
            return super().exchange(payload, gradients)
        with tf.control_dependencies(tensor_parts(gradients)):
            began = tf.timestamp()
        with tf.control_dependencies([began]):
            averaged = super().exchange(payload, gradients)
        done = tensor_parts(averaged.gradients) + [averaged.finite]
        with tf.control_dependencies(done):
            self._exchange_seconds = tf.timestamp() - began
        return averaged

    def _decide(self, hopeless, step, trying, current):
        """Step 2 and the next trial (step 3), on the host: ``(its start, the choice, the
        candidates it runs)``; ``hopeless``: the trial ended with dense's turn, which only
        dense ran; ``current``: the choice until now. The same on every rank (same numbers,
        one rule), recorded, and logged by rank 0."""
        count = len(self.plans)
        if hopeless:
            trying = np.arange(count) == self.dense_index
        medians = np.where(trying, median_of_samples(self.samples), np.inf)
        self.best, self.retimed = np.inf, 0
        names, seconds = [plan.name for plan in self.plans], [float(s) for s in medians]
        margin = self.decision_margins[self.trial_row]
        density = self.gate_densities[self.trial_row]
        # the incumbent, where this trial's density is that of the one that chose it (step 3)
        incumbent, self.decided_at = (current if density == self.decided_at else None), density
        choice = decide(held(seconds, incumbent, HOLD_WITHIN), names, margin)
        times = {name: float(s) for name, s in zip(names, medians) if np.isfinite(s)}
        self.decisions.append((step, times, names[choice]))
        if runtime.rank(self.optimizer.process_set) == 0:
            compute = median_of_samples(self.computes)
            log.info("%s", decision_message(step, names, choice, times, compute, hopeless,
                                            self.within if hopeless else margin, incumbent,
                                            HOLD_WITHIN))
        upcoming = [start for start in self.warmup_trials if start > step]
        following = next_trial_after(step, self.warmup_trials, len(self.decisions) == 1)
        # within the warm-up only those that can still win: halving the density at most
        # halves a sparse step's exchange, so one over ``PRUNE_AFTER`` x the fastest cannot
        # win the next trial; the warm-up's last trial and later ones forget the pruning
        slow = trying & (medians > PRUNE_AFTER * np.min(medians))
        if self.dense_index is not None:  # dense leaves by ``_dense_beaten`` alone
            slow[self.dense_index] = False
        pruned = (self.pruned | slow) & (len(upcoming) > 1)
        if any(self.bounded):
            # what builds on a pruned reference and was not tried (``within_reach`` found its
            # bytes short) goes with it: else the next trial would run those alone, and trace
            # them, while the reference they cannot beat by much waits for the warm-up's end
            orphaned = np.array(self.bounded) & ~trying
            pruned |= orphaned & pruned[self.reference_index]
        self.pruned = pruned
        dense = np.arange(count) == self.dense_index
        decisive = self.dense_index is not None and decisive_loss(seconds, names, self.within)
        # beaten: by the whole margin, which the warm-up's last trial will ask (a sparse
        # exchange chosen by a warm-up trial's smaller one may still lose there)
        if self.dense_index is not None and self._dense_beaten(
                trying[self.dense_index], decide(seconds, names, self.within) != self.dense_index,
                decisive, bool(upcoming)):
            pruned = pruned | dense
        if not upcoming and following - step < RECHECK_STEPS:
            # the early re-check (``next_trial_after``; no warm-up trial left: the gates' last row)
            runs = early_recheck(decisive, np.count_nonzero(~(pruned | dense) & self.gates[-1]))
            pruned = pruned | (dense & (runs == "sparse"))
            following = step + RECHECK_STEPS if runs == "none" else following
        # and only those whose bytes can win at the next trial's density (``worth_trying``)
        self.trial_row = max(int(np.sum(self.gate_starts <= following)) - 1, 0)
        return following, choice, ~pruned & self.gates[self.trial_row]

    def _dense_beaten(self, ran, lost, decisive, warming) -> bool:
        """Whether dense sits out the next trial, one of the warm-up's (``warming``): a sparse
        exchange was chosen over it (it beat dense by more than ``DENSE_WITHIN``) in
        ``BEATEN_TRIALS`` of the warm-up's trials in a row in which dense ran (``ran``; this
        one ``lost`` or not), or in one it lost by more than its own slowest turns explain
        (``decisive``, ``trial_rules.decisive_loss``). Dense's step does not depend on the
        density and a sparse step's does not grow as the warm-up lowers it, so dense cannot
        win the later ones; the re-checks try it again (the link may have changed). Not after
        any one loss: one slow dense turn once kept the character LSTM sparse for its run."""
        if ran:
            losses = self.dense_losses + 1 if lost else 0
            self.dense_losses = BEATEN_TRIALS if decisive else losses
        if not warming:
            self.dense_losses = 0
        return self.dense_losses >= BEATEN_TRIALS
