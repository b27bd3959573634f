"""Probe: what a job's first steps cost, step by step, and where the time goes (page faults,
system time), for the wrapper's step against a user's own Horovod step.

``exchange="auto"``'s first trial times dense's turn on the job's first steps
(``steps.measured``, step 1). In the time-to-loss runs under Adam at 10 Gbit/s those steps
read 3-4x dense's steady step, and the trial ran dense for 100 steps. This runs the first
``--steps`` steps of the wide CNN (``workloads.py``, 16 samples per worker, as
``steps_worker.py``: rank 0 evaluates before the first step) for each configuration in
turn, each a job of its own (a fresh process is what a job pays), ``--rounds`` times, and
prints per job the steps' times (the slowest rank's), the minor page faults (summed over the
ranks) and the system CPU time (the most of any rank), measured by ``getrusage`` around
each step.

Configurations (``--configs``): ``plain`` (the user's optimizer and Horovod's
``grouped_allreduce``), ``dense`` (``SparseDistributedOptimizer(exchange="dense")``),
``dense_keras_apply`` (the same with Keras' own step ops instead of the one-pass step of
``feedback.fused_apply``), ``dense_no_native`` (the same with ``SPARSE_HVD_NATIVE=0``: no
native kernel at all), ``auto`` (the defaults).

Run (root, the emulated cluster; ``--rate`` off: plain ``mpirun`` on loopback)::

    .venv/bin/python scripts/benchmarks/probe_first_steps.py --np 4 --rate 10gbit --inner adam
"""

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # scripts/: launching, emulated_cluster
import launching  # noqa: E402  (scripts/launching.py, the standard library only)

DENSE = {"exchange": "dense"}
CONFIGS = {"plain": None, "dense": DENSE, "dense_keras_apply": DENSE, "dense_no_native": DENSE,
           "auto": {}}
INNER = {"adam": {"name": "adam", "lr": 0.003}, "sgd": {"name": "sgd", "lr": 0.05, "momentum": 0.9}}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--rate", default=None, help="emulated link rate, e.g. 10gbit (root)")
    parser.add_argument("--inner", choices=sorted(INNER), default="adam")
    parser.add_argument("--configs", default="plain,dense,dense_keras_apply,dense_no_native")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    return parser.parse_args(argv)


def worker(args):
    """One job: rank 0 writes every rank's per-step records to ``--json``."""
    if args.config == "dense_no_native":
        os.environ["SPARSE_HVD_NATIVE"] = "0"  # read when sparse_hvd loads its kernels
    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    import resource

    import keras
    import numpy as np
    import tensorflow as tf

    import sparse_hvd
    from steps_worker import inner_optimizer
    from workloads import WORKLOADS

    if args.config == "dense_keras_apply":  # the caller falls back to Keras' apply
        import sparse_hvd.feedback.fused_apply as fused_apply

        fused_apply.apply_if_usable = lambda opt, grads, variables: False
    hvd = sparse_hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rank, size = sparse_hvd.rank(), sparse_hvd.size()
    workload = WORKLOADS["cnn_wide"]
    data = workload.load(rank, size)
    keras.utils.set_random_seed(0)
    model = workload.build_model(data)
    variables = model.trainable_variables
    inner = inner_optimizer(keras, INNER[args.inner], 800)
    wrapper = CONFIGS[args.config]
    optimizer = inner if wrapper is None else sparse_hvd.SparseDistributedOptimizer(
        inner, density=0.01, **wrapper)
    optimizer.build(variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    decorate = (tf.function(jit_compile=False) if wrapper is None
                else sparse_hvd.function(optimizer, jit_compile=False))

    @decorate
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, variables)
        if wrapper is None:
            grads = hvd.grouped_allreduce([tf.convert_to_tensor(g) for g in grads],
                                          op=hvd.Average, name="probe.dense")
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    @tf.function(jit_compile=False)
    def evaluate(x, y):
        return loss_fn(y, model(x, training=False))

    if rank == 0:  # as steps_worker.py: the start-of-run evaluation
        float(evaluate(tf.constant(data.x_val), tf.constant(data.y_val.astype("int32"))))
    rng = np.random.default_rng(rank)
    records = []
    for _ in range(args.steps):
        x, y = data.sample(rng, 16)
        before = resource.getrusage(resource.RUSAGE_SELF)
        started = time.perf_counter()
        float(train_step(tf.constant(x), tf.constant(y.astype("int32"))))
        seconds = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_SELF)
        records.append({"seconds": seconds, "faults": after.ru_minflt - before.ru_minflt,
                        "system": after.ru_stime - before.ru_stime})
    everyone = hvd.allgather_object(records, name="probe.records")
    if rank == 0:
        with open(args.json, "w") as f:
            json.dump(everyone, f)


def summary(everyone):
    """Per step: the slowest rank's seconds, the faults of all ranks, the most system time."""
    steps = range(len(everyone[0]))
    return ([max(r[i]["seconds"] for r in everyone) for i in steps],
            [sum(r[i]["faults"] for r in everyone) for i in steps],
            [max(r[i]["system"] for r in everyone) for i in steps])


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    configs = args.configs.split(",")
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"--configs: unknown {sorted(unknown)}; known: {sorted(CONFIGS)}")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    print(f"load before: {os.getloadavg()[0]:.2f}; {args.np} workers, "
          f"{args.rate or 'loopback'}, {args.inner}", flush=True)
    totals = {config: [] for config in configs}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for config in configs:  # interleaved: load that comes and goes falls on all
                path = os.path.join(scratch, f"{config}_{round_}.json")
                argv = [sys.executable, os.path.abspath(__file__), "--worker", "--config",
                        config, "--inner", args.inner, "--steps", str(args.steps),
                        "--json", path]
                launching.run_benchmark_job(args.np, argv, args.rate, args.timeout, env=env,
                                            cwd=ROOT)
                with open(path) as f:
                    seconds, faults, system = summary(json.load(f))
                after_first = sum(seconds[1:])
                totals[config].append(after_first)
                print(f"{config:>16} round {round_}: steps 2-{args.steps} {after_first:.2f} s; "
                      f"each {' '.join(f'{s:.2f}' for s in seconds)}; faults "
                      f"{' '.join(str(n) for n in faults)}; system s "
                      f"{' '.join(f'{s:.2f}' for s in system)}", flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")
    for config, values in totals.items():
        print(f"{config:>16}: steps 2-{args.steps}, the slowest rank's sum: "
              f"{' '.join(f'{v:.2f}' for v in values)} s")
    return None


if __name__ == "__main__":
    main()
