"""The probes of scripts/benchmarks that patch the library's internals still run against it.

``probe_threshold.py`` and ``probe_auto_trials.py`` replace the sparse allreduce's threshold
forecast (``exchanges/sparse_allreduce.next_thresholds``) by a recording wrapper. When the
forecast's arguments changed, both broke and nothing noticed until a probe was run by hand.
Here each runs a few steps on 2 ranks under mpirun, and its records are checked against what
such a run must show.
"""

import json
import os
import sys

import pytest

from launch import launcher_available, launching, run_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBES = os.path.join(ROOT, "scripts", "benchmarks")
BOUND = 240  # seconds per job; a job still running then is killed and the test fails
CANDIDATES = {"dense", "allgather", "compact_allgather", "sparse_allreduce"}


def needs_mpirun():
    reason = launcher_available("mpirun")
    if reason:
        pytest.skip(reason)


def finished(result):
    assert not result.timed_out, f"the probe hung:\n{result.output[-5000:]}"
    assert result.returncode == 0, result.output[-5000:]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_threshold_probe_records_every_step_and_applies_exactly_k(tmp_path):
    """The sparse allreduce applies the exact top-k of the summed entries, ties at the cut
    included: every step's applied count is its budget k or a few more, its owners kept at
    least those sums, and k is the density's share of the model's entries (the model-wide
    budget)."""
    needs_mpirun()
    steps, density = 6, 0.01
    out = tmp_path / "threshold.json"
    finished(run_job("mpirun", 2, [os.path.join(PROBES, "probe_threshold.py"),
                                   "--steps", str(steps), "--density", str(density),
                                   "--budget", "model", "--exchange", "sparse_allreduce",
                                   "--json", str(out)], timeout=BOUND))
    probe = json.loads(out.read_text())
    assert probe["workers"] == 2
    records = probe["records"]
    assert len(records) == steps
    parameters = 4_349_962  # the probe's MLP (digits_mlp.py): 64-2048-2048-10
    for kept, applied, budgets in records:
        assert len(budgets) == 1, "the model-wide budget is one k"
        assert budgets[0] <= applied[0] <= kept[0]
        assert applied[0] - budgets[0] <= 0.001 * budgets[0], "more ties than float sums make"
        assert abs(budgets[0] - density * parameters) <= 0.001 * density * parameters


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_auto_trials_probe_records_every_step_and_every_candidate(tmp_path):
    """With ``--try-all`` the job's first trial runs every candidate in turn, dense first; each
    step is recorded with the candidate it ran, each of the sparse allreduce's with its
    owners' kept sums (the recording forecast ran), and the decision timed all four."""
    needs_mpirun()
    steps = 26  # dense's turn (4 steps), then each sparse candidate's first turn (7 each)
    out = tmp_path / "auto.json"
    # the probe starts its own mpirun job; its whole session is killed after the bound
    command = [sys.executable, os.path.join(PROBES, "probe_auto_trials.py"), "--np", "2",
               "--steps", str(steps), "--recheck", "100", "--try-all", "--json", str(out)]
    finished(launching.run_bounded(command, dict(os.environ), BOUND))
    probe = json.loads(out.read_text())
    rows = probe["rows"]
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    assert rows[0]["branch"] == "dense"
    assert {row["branch"] for row in rows} == CANDIDATES
    for row in rows:
        assert row["ms"] > 0
        if row["branch"] == "sparse_allreduce":
            assert row["kept_k"] is not None and row["kept_k"] > 0
        else:
            assert row["kept_k"] is None
    (_, times, choice), = probe["decisions"]
    assert set(times) == CANDIDATES and choice in CANDIDATES


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
