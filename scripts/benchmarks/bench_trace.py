"""What a job pays before its first step of each exchange: the trace and the first run.

``exchange="auto"`` traces one step function per candidate it tries (``steps.traced_choice``),
and with 4 ranks on 2 cores those traces were most of what the default spent beyond its
steady steps in the time-to-loss runs (README, "Time to dense's loss"). This prints, per
exchange, what rank 0 measured on a fresh job: ``get_concrete_function`` of a Keras train
step wrapped with ``SparseDistributedOptimizer(exchange=...)`` (the trace), its first call
(graph optimisation, Horovod's first negotiation), the median of the next steps, and the
number of operations at the top of the traced graph.

Each exchange runs as a job of its own (a trace in a fresh process is what a job pays), the
exchanges in turn, ``--rounds`` times, so that load that comes and goes falls on all of them;
the table gives each figure's median over the rounds.

    .venv/bin/python scripts/benchmarks/bench_trace.py                    # wide CNN, 2 ranks
    .venv/bin/python scripts/benchmarks/bench_trace.py --workload charlm --np 4
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # scripts/: launching
import launching  # noqa: E402  (scripts/launching.py: the launcher command lines)

EXCHANGES = ("dense", "allgather", "compact_allgather", "sparse_allreduce")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="cnn_wide", help="a name of workloads.py")
    parser.add_argument("--exchanges", default=",".join(EXCHANGES))
    parser.add_argument("--np", type=int, default=2, help="ranks (mpirun on this machine)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="steps timed after the first")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per job")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--exchange", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def worker(args):
    """One job: rank 0 writes ``{trace, first, step, operations}`` (seconds) to ``--json``."""
    sys.path.insert(0, ROOT)
    import keras
    import numpy as np
    import tensorflow as tf

    import sparse_hvd
    from workloads import WORKLOADS

    rank, size = sparse_hvd.rank(), sparse_hvd.size()
    workload = WORKLOADS[args.workload]
    data = workload.load(rank, size)
    keras.utils.set_random_seed(0)
    model = workload.build_model(data)
    variables = model.trainable_variables
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), density=0.01, exchange=args.exchange,
        warmup_steps=0)
    optimizer.build(variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=False)  # Horovod's collectives cannot be XLA-compiled
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    x, y = data.sample(np.random.default_rng(rank), args.batch_size)
    x, y = tf.constant(x), tf.constant(y.astype("int32"))
    started = time.perf_counter()
    concrete = train_step.get_concrete_function(x, y)
    traced = time.perf_counter()
    train_step(x, y).numpy()
    first = time.perf_counter()
    steps = []
    for _ in range(args.steps):
        begin = time.perf_counter()
        train_step(x, y).numpy()
        steps.append(time.perf_counter() - begin)
    if rank == 0:
        with open(args.json, "w") as handle:
            json.dump({"trace": traced - started, "first": first - traced,
                       "step": statistics.median(steps),
                       "operations": len(concrete.graph.get_operations())}, handle)


def run_job(args, exchange, json_path):
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--workload", args.workload,
            "--exchange", exchange, "--json", json_path, "--steps", str(args.steps),
            "--batch-size", str(args.batch_size)]
    env = launching.mpi_environment(dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    subprocess.run(launching.mpirun_command(args.np, argv), env=env, check=True,
                   timeout=args.timeout, cwd=ROOT, stdout=subprocess.DEVNULL)
    with open(json_path) as handle:
        return json.load(handle)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    exchanges = args.exchanges.split(",")
    print(f"load before: {os.getloadavg()[0]:.2f}", flush=True)
    runs = {exchange: [] for exchange in exchanges}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for exchange in exchanges:  # in turn: load that comes and goes falls on all
                path = os.path.join(scratch, f"{exchange}_{round_}.json")
                runs[exchange].append(run_job(args, exchange, path))
    print(f"load after: {os.getloadavg()[0]:.2f}")
    print(f"\n{args.workload}, {args.np} ranks, median of {args.rounds} jobs each\n")
    print("| exchange | trace s | first run s | trace + first s | step ms | operations |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for exchange, results in runs.items():
        median = {key: statistics.median(r[key] for r in results) for key in results[0]}
        print(f"| {exchange} | {median['trace']:.2f} | {median['first']:.2f} | "
              f"{statistics.median(r['trace'] + r['first'] for r in results):.2f} | "
              f"{median['step'] * 1e3:.1f} | {median['operations']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
