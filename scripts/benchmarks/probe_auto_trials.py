"""Probe: what each step of ``exchange="auto"`` costs, trial by trial, and why.

Every rank runs the 4.35M-parameter MLP on the digits shards (as ``bench_step.py``) with
``SGD(0.01, momentum=0.9)`` wrapped by the default exchange (``auto``, one budget for the
whole model, no warm-up) at ``--density``, its re-checks every ``--recheck`` steps instead of
the library's ``measured.RECHECK_STEPS`` (so the first trial, on steps that run each candidate
for the first time, can be compared with later ones). Rank 0 prints one line a step: the
candidate the step ran, its time, and for the sparse allreduce the sums its owners kept as a
multiple of k; then auto's decisions. ``--try-all`` runs every candidate in every trial (on
loopback dense's compute alone would leave the sparse ones untried).

Run (root, the emulated cluster; ``--rate`` off: plain ``mpirun`` on loopback)::

    .venv/bin/python scripts/benchmarks/probe_auto_trials.py --np 8 --rate 1gbit
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # scripts/: launching, emulated_cluster
import launching  # noqa: E402  (scripts/launching.py, the standard library only)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--np", type=int, default=8)
    parser.add_argument("--rate", default=None, help="emulated link rate, e.g. 1gbit (root)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--recheck", type=int, default=40)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--try-all", action="store_true",
                        help="every candidate runs its turn in every trial: the rules that "
                             "leave one out (dense's compute, the reach of fewer bytes, the "
                             "trace's cost) off")
    parser.add_argument("--json", default=None, help="also write the per-step records here")
    parser.add_argument("--timeout", type=float, default=1800)
    return parser.parse_args(argv)


def worker(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, HERE)
    import sparse_hvd
    import sparse_hvd.steps.measured as measured

    sparse_hvd.init()
    measured.RECHECK_STEPS = args.recheck
    if args.try_all:
        import sparse_hvd.steps.trial_rules as trial_rules

        measured.sparse_can_win = measured.within_reach = lambda *_: True
        trial_rules.TRACE_MUST_PAY = False
    import keras
    import tensorflow as tf

    import sparse_hvd.exchanges.global_threshold as threshold
    import sparse_hvd.exchanges.sparse_allreduce as sparse_allreduce
    from digits_mlp import training

    rank, size = sparse_hvd.rank(), sparse_hvd.size()
    kept_records = []
    rule = sparse_allreduce.next_thresholds

    def recorded(thetas, forecast, magnitudes, cuts, level_counts, budgets, whole=False):
        if whole:  # the model-wide budget: one variable, its numbers given to every slot
            return threshold.every_variable(recorded(*threshold.one_variable(
                thetas, forecast, magnitudes, level_counts, budgets)), level_counts.shape[0])
        kept = tf.reduce_sum(cuts[1:] - cuts[:-1])
        tf.numpy_function(lambda a, b: kept_records.append(float(a) / float(b)) or 0,
                          [kept, tf.reduce_sum(tf.cast(budgets, tf.int64))], tf.int64)
        return rule(thetas, forecast, magnitudes, cuts, level_counts, budgets)

    sparse_allreduce.next_thresholds = recorded
    optimizer, run_step = training(lambda: sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.01, momentum=0.9), density=args.density, warmup_steps=0,
        name="probe_auto"), rank, size)

    auto = optimizer._step
    names = [plan.name for plan in auto.plans]
    rows = []
    for number in range(1, args.steps + 1):
        branch = names[auto.wanted_mode()]
        before = len(kept_records)
        start = time.perf_counter()
        float(run_step())
        seconds = time.perf_counter() - start
        kept = kept_records[before] if len(kept_records) > before else None
        rows.append({"step": number, "branch": branch, "ms": seconds * 1e3, "kept_k": kept})
    if rank != 0:
        return
    for row in rows:
        kept = f"  kept {row['kept_k']:.2f} k" if row["kept_k"] is not None else ""
        print(f"step {row['step']:4d}  {row['branch']:18s} {row['ms']:9.1f} ms{kept}")
    for number, times, choice in optimizer.exchange_decisions:
        medians = ", ".join(f"{n} {t * 1e3:.1f}" for n, t in times.items())
        print(f"decision at step {number}: {choice} ({medians})")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "workers": size, "rows": rows,
                       "decisions": optimizer.exchange_decisions}, out)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--steps", str(args.steps),
            "--recheck", str(args.recheck), "--density", str(args.density)]
    if args.try_all:
        argv.append("--try-all")
    if args.json:
        argv += ["--json", os.path.abspath(args.json)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    launching.run_benchmark_job(args.np, argv, args.rate, args.timeout, env=env, cwd=ROOT)
    return None


if __name__ == "__main__":
    main()
