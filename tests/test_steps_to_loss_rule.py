"""The steps-to-loss benchmark's target rule and its time to target, on curves whose answers
are known in closed form (linear losses, linear training time)."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "scripts", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "scripts"))

import bench_steps_to_loss as bench  # noqa: E402


def curve(slope, seconds_per_step, steps=800, every=100, start=2.0):
    """Validation loss ``start - slope * step``; ``seconds_per_step`` of training per step."""
    return [{"step": s, "val_loss": start - slope * s, "val_accuracy": 0.0,
             "train_seconds": seconds_per_step * s} for s in range(0, steps + 1, every)]


def run(method, seed, slope, seconds_per_step, link="1gbit", load=0.5):
    return {"workload": "w", "workers": 4, "method": method, "seed": seed, "steps": 800,
            "curve": curve(slope, seconds_per_step), "bytes_fraction": 1.0,
            "replicas_identical": True, "median_step_seconds": seconds_per_step,
            "link": link, "load_before": load, "max_load": 1.5,
            "exchange_decisions": [[1, {"dense": 0.1}, "dense"], [200, {}, "allgather"]]}


def test_steps_and_seconds_to_dense_half_run_loss_follow_the_closed_form():
    # dense: 2 - s/800, so its loss at step 400 is 1.5 (smoothing leaves a line unchanged
    # inside it); "slow" (2 - s/1000) reaches 1.5 at step 500: ratio 1.25. Dense takes 0.5 s a
    # step (200 s to step 400), "slow" 0.1 s (50 s to step 500): 4x sooner.
    runs = [run("dense", 0, 1 / 800, 0.5), run("dense", 1, 1 / 800, 0.5),
            run("slow", 0, 1 / 1000, 0.1), run("slow", 1, 1 / 1000, 0.1)]
    (group,) = bench.summarise(runs)
    assert group["link"] == "1gbit" and group["publishable"]
    assert group["target_loss"] == pytest.approx(1.5)
    rows = {r["method"]: r for r in group["rows"]}
    assert rows["slow"]["ratios"] == pytest.approx([1.25, 1.25])
    assert rows["slow"]["seconds_to_target"] == pytest.approx([50.0, 50.0])
    assert rows["dense"]["seconds_to_target_mean"] == pytest.approx(200.0)
    assert rows["slow"]["speedup_vs_dense"] == pytest.approx(4.0)
    text = bench.markdown([group])
    assert "| slow | 50 s (50, 50) | 4.00x | 1.25 (1.25, 1.25) | 100 ms |" in text
    assert "dense@1 allgather@200" in text


def test_a_run_that_never_reaches_the_target_counts_its_whole_training_time():
    runs = [run("dense", 0, 1 / 800, 0.5), run("flat", 0, 0.0, 0.1)]
    rows = {r["method"]: r for r in bench.summarise(runs)[0]["rows"]}
    assert rows["flat"]["never_reached"] == 1 and rows["flat"]["ratios"] == [2.0]
    assert rows["flat"]["seconds_to_target"] == pytest.approx([80.0])  # 800 steps x 0.1 s


def test_timed_and_loopback_runs_are_separate_groups_and_a_loaded_one_is_not_published(tmp_path):
    runs = [run("dense", 0, 1 / 800, 0.5, link=None), run("dense", 0, 1 / 800, 0.5, load=3.0)]
    for r in runs[:1]:
        del r["link"], r["load_before"], r["max_load"]
    groups = bench.summarise(runs)
    assert [(g["link"], g["publishable"]) for g in groups] == [(None, True), ("1gbit", False)]
    assert "seconds_to_target" not in groups[0]["rows"][0]
    out = tmp_path / "runs"
    out.mkdir()
    with open(out / "runs.jsonl", "w") as f:
        for r in runs:
            f.write(bench.json.dumps(r) + "\n")
    with pytest.raises(SystemExit, match="loaded machine"):
        bench.report(str(out), str(tmp_path / "published"))
    assert not (tmp_path / "published").exists()


def test_where_the_time_to_the_target_went_follows_the_step_times():
    # "slow" reaches dense's half-run loss at step 500 (as above); its rank 0 kept 600 step
    # times: a 2.0 s trace at step 1, a 0.5 s step at step 30 (over 4 x the steady 0.1 s), one
    # of 0.3 s at step 40 (under it), the rest 0.1 s. Its time to step 500: 2.0 + 0.5 + 0.3 +
    # 497 x 0.1 = 52.5 s; at the steady step 50 s; the first 20 steps 2.0 + 19 x 0.1 = 3.9 s;
    # the slow steps' excess (2.0 - 0.1) + (0.5 - 0.1) = 2.3 s.
    times = [0.1] * 600
    times[0], times[29], times[39] = 2.0, 0.5, 0.3
    slow = run("slow", 0, 1 / 1000, 0.1)
    slow["first_step_seconds"] = times
    short = run("short", 0, 1 / 1000, 0.1)
    short["first_step_seconds"] = times[:60]  # not kept to the target: no breakdown
    (group,) = bench.summarise([run("dense", 0, 1 / 800, 0.5), slow, short])
    rows = {r["method"]: r for r in group["rows"]}
    (spent,) = rows["slow"]["time_spent"]
    assert spent == pytest.approx({"sum": 52.5, "at_steady": 50.0, "first_20": 3.9,
                                   "slow_excess": 2.3})
    assert rows["short"]["time_spent"] == [None] and rows["dense"]["time_spent"] == [None]
    text = bench.markdown([group])
    assert "| slow | 52.5 s | 50.0 s | 3.9 s | 2.3 s |" in text
    assert "| short |" not in text.split("Where the time")[1]
