"""What a candidate's first steps cost ``exchange="auto"`` on this job, beyond its steady step
(``sparse_hvd.steps.measured``, step 1), so that a trial can ask whether a candidate not yet
traced would repay that before the next trial (``trial_rules.pays_for_its_trace``).

Traced for one candidate at a time (``traced_choice``), a candidate's first step in the job
runs right after its trace: the step's time (from the previous step's end) holds the trace,
the first run's graph set-up and the step itself. With 4 ranks on 2 cores that was 1.8-4.7 s
a candidate on the wide CNN against a step of 0.07-0.2 s. The cost counted is that first
step less the median of the turn's timed steps; the least measured so far stands for every
candidate (the reference, timed first, has the fewest operations of those that build on it,
so this errs towards trying). Nothing measured yet: 0, so every candidate pays (the rule
then asks what it asked before). With every candidate a branch of one traced step there is
no trace between steps, and the cost measured is the first run's alone.
"""

import numpy as np


class TraceCosts:
    """Each candidate's first step in the job (its trace included) and, once its turn is
    timed, the cost of its start; the same numbers on every rank (the steps' means over the
    ranks)."""

    def __init__(self, count):
        self.first = np.zeros([count])  # a first step not yet counted; 0: none pending
        self.costs = []  # seconds, one per candidate whose first turn was timed

    def began(self, candidate, elapsed):
        """``candidate``'s first step in the job took ``elapsed`` seconds."""
        self.first[candidate] = elapsed

    def timed(self, candidate, median):
        """``candidate``'s turn ended with its timed steps' ``median``: its start's cost
        counted, if its first step was its turn's."""
        if self.first[candidate] > 0:
            self.costs.append(max(float(self.first[candidate]) - float(median), 0.0))
            self.first[candidate] = 0.0

    @property
    def seconds(self) -> float:
        """What a trace costs this job: the least measured, 0 before any."""
        return min(self.costs) if self.costs else 0.0
