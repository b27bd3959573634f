"""Probe: how many sums the sparse allreduce's owners keep, and how many are applied, against k.

Every rank of an ``mpirun`` job runs this: the 4.35M-parameter MLP on the digits shards (as
``bench_step.py``), ``SGD(0.01, momentum=0.9)`` wrapped with ``exchange=--exchange``, top-k at
``--density`` with per-layer budgets (``--budget model``: the model-wide one, the default's),
no warm-up and the default cut (the update, with SGD's
momentum; ``--sparsify gradient``: the gradient). Each step rank 0 records, over the
sparsely sent variables, the sums the owners kept (reaching the global threshold theta: what
the allgather carries) and the sums applied (the exact top-k), both as multiples of k, and
prints their mean and extremes per phase of the run (the residuals build up over the first
tens of steps, and the cut grows with them).

``--rule last-cut`` replaces the library's forecast (``sparse_hvd/exchanges/
global_threshold.py``) by the rule it replaced, kept here as the reference: the next theta is
the k-th largest sum times a lead, the square root of the cut's growth a step within [1, 1.25]
times 0.99, or theta lowered to the largest of the old levels (2^-1/32 ... 1/4) that k sums
reached. Bytes follow: the wire carries k (N - 1) / N entries out and kept (N - 1) / N in per
worker, so the kept multiple m puts the wire at (1 + m) / 2 x Ok-Topk's bound 2 k (N - 1) / N.

Run::

    mpirun -np 4 .venv/bin/python scripts/benchmarks/probe_threshold.py --steps 200
    mpirun -np 4 .venv/bin/python scripts/benchmarks/probe_threshold.py --rule last-cut
"""

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PHASES = ((1, 5), (6, 20), (21, 60), (61, 100), (101, 200), (201, 10 ** 9))
OLD_LEVELS = (1.0, 2 ** -0.03125, 2 ** -0.0625, 2 ** -0.125, 2 ** -0.25, 2 ** -0.5, 0.5, 0.25)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--budget", choices=("layer", "model"), default="layer",
                        help="model: the selection's budget over the whole model (the "
                        "default's), and one threshold and top-k over it")
    parser.add_argument("--exchange", default="plain_sparse_allreduce",
                        choices=("sparse_allreduce", "plain_sparse_allreduce"))
    parser.add_argument("--rule", choices=("forecast", "last-cut"), default="forecast")
    parser.add_argument("--sparsify", choices=("update", "gradient"), default="update",
                        help="what is cut (bench_step.py's rows without _update: gradient)")
    parser.add_argument("--json", default=None, help="also write the per-step records here")
    return parser.parse_args(argv)


def last_cut_rule(tf, threshold):
    """The replaced rule, as ``next_thresholds`` (its forecast's ``growth`` field holds the
    lead; the other two are unused)."""

    def rule(thetas, forecast, magnitudes, cuts, level_counts, budgets):
        budgets = tf.maximum(tf.cast(budgets, tf.int32), 1)
        leads = tf.where(forecast.growth > 0, forecast.growth, tf.ones_like(thetas))
        enough = cuts[1:] - cuts[:-1] >= budgets
        cut = tf.where(enough, threshold.kth_largest_per_segment(magnitudes, cuts, budgets),
                       tf.zeros_like(thetas))
        growth = tf.where(thetas > 0, tf.math.divide_no_nan(cut, thetas / leads),
                          tf.ones_like(thetas))
        led = tf.clip_by_value(tf.sqrt(growth), 1.0, 1.25) * 0.99
        factors = tf.constant(OLD_LEVELS[1:] + OLD_LEVELS[-1:], tf.float64)
        reached = tf.cast(level_counts[:, 1:] >= budgets[:, None], tf.int32)
        first = tf.argmax(tf.concat([reached, tf.ones_like(reached[:, :1])], 1), axis=1,
                          output_type=tf.int32)
        theta = tf.where(enough, cut * led, thetas * tf.gather(factors, first))
        lead = tf.where(enough, led, tf.ones_like(leads))
        return cut, theta, threshold.Forecast(forecast.last_cut, lead, forecast.miss)

    return rule


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, HERE)
    import sparse_hvd

    sparse_hvd.init()
    import keras
    import tensorflow as tf

    import sparse_hvd.exchanges.global_threshold as threshold
    import sparse_hvd.exchanges.sparse_allreduce as sparse_allreduce
    from digits_mlp import training

    rank, size = sparse_hvd.rank(), sparse_hvd.size()
    if args.rule == "last-cut":
        sparse_allreduce.LEVELS = OLD_LEVELS
    rule = last_cut_rule(tf, threshold) if args.rule == "last-cut" else threshold.next_thresholds
    records = []

    def recorded(thetas, forecast, magnitudes, cuts, level_counts, budgets, whole=False):
        if whole:  # the model-wide budget: one variable, its numbers given to every slot
            return threshold.every_variable(recorded(*threshold.one_variable(
                thetas, forecast, magnitudes, level_counts, budgets)), level_counts.shape[0])
        cut, theta, following = rule(thetas, forecast, magnitudes, cuts, level_counts, budgets)
        kept = cuts[1:] - cuts[:-1]
        variable_of = tf.searchsorted(cuts[1:], tf.range(tf.size(magnitudes)), side="right")
        applied = tf.math.unsorted_segment_sum(
            tf.cast(magnitudes >= tf.gather(cut, variable_of), tf.int32), variable_of,
            tf.size(kept))
        tf.numpy_function(lambda *counts: records.append([c.tolist() for c in counts]) or 0,
                          [kept, applied, tf.cast(budgets, tf.int32)], tf.int64)
        return cut, theta, following

    sparse_allreduce.next_thresholds = recorded
    _, run_step = training(lambda: sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.01, momentum=0.9), density=args.density, sparsifier="topk",
        exchange=args.exchange, warmup_steps=0, budget=args.budget, sparsify=args.sparsify,
        name="probe_threshold"), rank, size)

    for _ in range(args.steps):
        run_step()
    if rank != 0:
        return
    ratios = [(sum(kept) / sum(k), sum(applied) / sum(k)) for kept, applied, k in records]
    print(f"{args.rule} rule, {args.exchange}, {size} workers, density {args.density}, "
          f"the {args.sparsify} cut, budget {args.budget}, "
          f"{len(ratios)} steps")
    for first, last in PHASES:
        phase = ratios[first - 1:last]
        if not phase:
            break
        kept = [r[0] for r in phase]
        applied = [r[1] for r in phase]
        print(f"steps {first}-{first + len(phase) - 1}: kept {statistics.mean(kept):.3f} k "
              f"(max {max(kept):.2f}), applied {statistics.mean(applied):.3f} k "
              f"(min {min(applied):.2f}), wire {(1 + statistics.mean(kept)) / 2:.3f} x the bound")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "workers": size, "records": records}, out)


if __name__ == "__main__":
    main()
