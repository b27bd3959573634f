"""What ``exchange="auto"`` costs on top of the exchange it chose, and where it comes from.

Every variant trains its own copy of the 4.35M-parameter MLP (the same weights at the start)
at 1% with one model-wide budget, and every auto variant is made to choose ``--choice`` (the
allgather by default; ``steps.measured.decide`` replaced), so each runs that exchange's step
after its trial:

* ``allgather``: ``exchange="allgather"`` named; ``chosen``: ``exchange=<--choice>`` named (the
  reference);
* ``auto``: the default, its step a ``sparse_hvd.function`` (traced for the exchange it runs);
* ``auto_cond``: the default in a plain ``tf.function`` (every candidate a branch of one
  conditional);
* ``auto_no_trial``: a ``sparse_hvd.function`` whose trial never comes (the bookkeeping alone);
* ``auto_without_<candidate>``: a ``sparse_hvd.function`` whose trial skips that candidate.

With ``--try-all`` every trial tries every candidate (auto's reach rule answers yes and its
trace rule is off), as on a slow link, where the coded allgather and the sparse allreduce run
their turns too.

After each variant's trial, ``--phases`` phases of ``--rounds`` rounds: each round runs
``--steps`` steps of every variant in turn (interleaved), timed by the wall clock; rank 0
prints each variant's median step per phase.

    mpirun -np 2 --bind-to none -x PYTHONPATH=. .venv/bin/python scripts/benchmarks/bench_auto_overhead.py
"""

import argparse
import time

import numpy as np


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default="allgather,auto,auto_cond,auto_no_trial,"
                        "auto_without_sparse_allreduce,auto_without_dense")
    parser.add_argument("--choice", default="allgather",
                        help="the exchange every auto variant is made to choose")
    parser.add_argument("--try-all", action="store_true",
                        help="every trial tries every candidate (auto's reach rule says yes, "
                             "its trace rule is off)")
    parser.add_argument("--phases", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import keras
    import tensorflow as tf

    import sparse_hvd
    import sparse_hvd.steps.measured as measured

    sparse_hvd.init()
    rank = sparse_hvd.rank()
    measured.decide = lambda seconds, names, margin: names.index(args.choice)
    if args.try_all:
        import sparse_hvd.steps.trial_rules as trial_rules

        measured.within_reach = lambda *numbers: True
        trial_rules.TRACE_MUST_PAY = False
    rng = np.random.default_rng(rank)
    x_all = tf.constant(rng.standard_normal((4096, 64)).astype("float32"))
    y_all = tf.constant(rng.integers(0, 10, 4096).astype("int32"))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def build(variant):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(2048, activation="relu"),
                                  keras.layers.Dense(2048, activation="relu"),
                                  keras.layers.Dense(10)])
        variables = model.trainable_variables
        optimizer = sparse_hvd.SparseDistributedOptimizer(
            keras.optimizers.SGD(0.01, momentum=0.9), density=0.01, warmup_steps=0,
            budget="model", exchange={"allgather": "allgather", "chosen": args.choice}.get(
                variant, "auto"),
            name=f"overhead_{variant}")
        optimizer.build(variables)
        step_state = optimizer._step
        if variant == "auto_no_trial":
            step_state.trial_start.assign(10 ** 9)
        if variant.startswith("auto_without_"):
            left_out = variant[len("auto_without_"):]
            step_state.trying.assign([plan.name != left_out for plan in step_state.plans])
        decorate = (tf.function(jit_compile=False) if variant == "auto_cond"
                    else sparse_hvd.function(optimizer, jit_compile=False))

        @decorate
        def step(indices):
            x, y = tf.gather(x_all, indices), tf.gather(y_all, indices)
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return loss

        return optimizer, step

    def batch():
        return tf.constant(rng.integers(0, 4096, args.batch_size).astype("int32"))

    variants = args.variants.split(",")
    runs = {variant: build(variant) for variant in variants}
    for optimizer, step in runs.values():  # every trial, its decision and a step of the choice
        for _ in range(2 + measured.first_trial_length(len(getattr(optimizer._step, "plans", ())))):
            float(step(batch()))
    if rank == 0:
        for variant, (optimizer, _) in runs.items():
            print(variant, "trials:", optimizer.exchange_decisions, flush=True)
    for phase in range(args.phases):
        times = {variant: [] for variant in variants}
        for _ in range(args.rounds):
            for variant, (_, step) in runs.items():
                for _ in range(args.steps):
                    indices = batch()
                    start = time.perf_counter()
                    float(step(indices))
                    times[variant].append(time.perf_counter() - start)
        if rank == 0:
            print(f"phase {phase}: median ms a step:",
                  {v: round(float(np.median(t)) * 1e3, 1) for v, t in times.items()}, flush=True)


if __name__ == "__main__":
    main()
