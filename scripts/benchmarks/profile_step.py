"""Where one training step's time goes, op by op, on rank 0 (TensorFlow's profiler).

The 4.35M-parameter MLP (64-2048-2048-10, batch 64 per worker, SGD momentum 0.9; ``--inner
adam``: Adam 1e-3), or with ``--workload`` a model of ``workloads.py`` (16 samples a worker, as
the time-to-loss runs: ``cnn_wide``), trained with ``SparseDistributedOptimizer`` at
``--density`` with ``--exchange`` and ``--budget`` (no density warm-up unless
``--warmup-steps``), or unwrapped: with a user's own ``hvd.grouped_allreduce`` (``--exchange
plain``) or with no exchange at all (``--exchange floor``). After ``--warmup`` steps,
``--steps`` steps run under ``tf.profiler``; rank 0 reads the trace it wrote (the ``/host:CPU``
plane's op events) and prints the wall time per step, each rank's CPU time per step (user and
system, from ``getrusage``: with more ranks than cores a step is bound by their sum, not by one
rank's ops; ``--per-thread`` splits it by thread) and the ops that took the most time per step,
summed over their runs. Ops of different threads overlap, so the column adds up to more than the
wall time.

    mpirun -np 2 --bind-to none .venv/bin/python scripts/benchmarks/profile_step.py \\
        --exchange allgather --budget model
"""

import argparse
import collections
import glob
import os
import resource
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
from workloads import WORKLOADS  # noqa: E402  (TensorFlow imported lazily)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--exchange", default="allgather",
                        help="an exchange name, plain (Horovod's grouped_allreduce) or floor "
                        "(no exchange: the inner optimizer on each rank's own gradients)")
    parser.add_argument("--budget", choices=("model", "layer", "default"), default="model",
                        help="default: the library's own (what the exchange needs)")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--inner", choices=("sgd", "adam"), default="sgd",
                        help="the wrapped optimizer: SGD momentum 0.9, or Adam 1e-3")
    parser.add_argument("--workload", default="mlp4m", choices=["mlp4m", *sorted(WORKLOADS)],
                        help="mlp4m (the 4.35M MLP above) or a model of workloads.py "
                        "(cnn_wide: 16 samples a worker, as the time-to-loss runs)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--per-thread", action="store_true",
                        help="also each rank's CPU time a step per thread (Linux: "
                        "/proc/self/task), e.g. TensorFlow's compute thread against "
                        "Horovod's background thread")
    parser.add_argument("--threads", type=int, default=0,
                        help="TensorFlow intra/inter-op threads (0: TensorFlow's choice); 1 "
                        "runs a rank's ops one at a time, so an op's time is its own")
    parser.add_argument("--warmup-steps", type=int, default=0,
                        help="the wrapper's warmup_steps (the density's warm-up; -1: the "
                        "library's default, 400 at 1%%)")
    parser.add_argument("--stats-each-step", action="store_true",
                        help="read communication_stats() after every step, outside its timing, "
                        "as steps_worker.py's StepCounts does (its cost shows in the next step "
                        "on shared cores); also prints what a read costs")
    parser.add_argument("--decide", default=None,
                        help="with --exchange auto: the name every decision of its trials "
                        "makes (steps_worker.force_decisions), e.g. dense: auto's dense "
                        "steps between trials against a named exchange's")
    return parser.parse_args(argv)


def thread_times():
    """{thread id: (name, user seconds, system seconds)} of this process's threads (Linux)."""
    ticks = os.sysconf("SC_CLK_TCK")
    times = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as handle:
                head, _, tail = handle.read().rpartition(")")
        except OSError:  # the thread ended
            continue
        fields = tail.split()  # from the state on: utime and stime are the 12th and 13th
        times[tid] = (head.partition("(")[2], int(fields[11]) / ticks, int(fields[12]) / ticks)
    return times


def per_thread(before, after, steps):
    """Each thread's user/system ms a step between two :func:`thread_times`, the busiest
    first, those under 0.1 ms left out."""
    rows = []
    for tid, (name, user, system) in after.items():
        _, user_0, system_0 = before.get(tid, (name, 0.0, 0.0))
        user, system = (user - user_0) / steps * 1e3, (system - system_0) / steps * 1e3
        if user + system >= 0.1:
            rows.append((user + system, f"{name}[{tid}] {user:.1f}/{system:.1f}"))
    return [text for _, text in sorted(rows, reverse=True)]


def op_times(logdir, steps):
    """{op name: (ms a step, runs a step)} from the newest trace under ``logdir``."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    path = max(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True),
               key=os.path.getmtime)
    space = xplane_pb2.XSpace()
    with open(path, "rb") as handle:
        space.ParseFromString(handle.read())
    totals, runs = collections.Counter(), collections.Counter()
    for plane in space.planes:
        if plane.name != "/host:CPU":
            continue
        names = {key: meta.name for key, meta in plane.event_metadata.items()}
        for line in plane.lines:
            if not line.name.startswith("tf_Compute"):  # the executor's op threads
                continue
            for event in line.events:
                name = names.get(event.metadata_id, "?")
                totals[name] += event.duration_ps / 1e9 / steps
                runs[name] += 1
    return {name: (ms, runs[name] / steps) for name, ms in totals.items()}


def main(argv=None):
    args = parse_args(argv)
    import horovod.tensorflow as hvd
    import keras
    import numpy as np
    import tensorflow as tf

    import sparse_hvd

    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    sparse_hvd.init()
    if args.decide:
        from steps_worker import force_decisions
        force_decisions(sparse_hvd.steps.measured, [args.decide] * 100)
    rank = hvd.rank()
    rng = np.random.default_rng(rank)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    keras.utils.set_random_seed(0)
    if args.workload == "mlp4m":
        x_all = rng.standard_normal((4096, 64)).astype("float32")
        y_all = rng.integers(0, 10, 4096).astype("int32")
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(2048, activation="relu"),
                                  keras.layers.Dense(2048, activation="relu"),
                                  keras.layers.Dense(10)])
        batch_size = 64

        def batch():
            chosen = rng.integers(0, len(x_all), batch_size)
            return tf.constant(x_all[chosen]), tf.constant(y_all[chosen])
    else:
        workload = WORKLOADS[args.workload]
        data = workload.load(rank, hvd.size())
        model = workload.build_model(data)
        batch_size = 16

        def batch():
            x, y = data.sample(rng, batch_size)
            return tf.constant(x), tf.constant(y.astype("int32"))
    variables = model.trainable_variables
    unwrapped = args.exchange in ("plain", "floor")  # the inner optimizer alone
    inner = (keras.optimizers.Adam(1e-3) if args.inner == "adam"
             else keras.optimizers.SGD(0.01, momentum=0.9))
    optimizer = inner if unwrapped else sparse_hvd.SparseDistributedOptimizer(
        inner, density=args.density, exchange=args.exchange,
        budget=None if args.budget == "default" else args.budget,
        warmup_steps=None if args.warmup_steps < 0 else args.warmup_steps, name="profile")
    optimizer.build(variables)

    # exchange="auto": each step runs the function traced for the exchange it chose
    decorate = (tf.function(jit_compile=False) if unwrapped
                else sparse_hvd.function(optimizer, jit_compile=False))

    @decorate
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, variables)
        if args.exchange == "plain":
            grads = hvd.grouped_allreduce(grads, op=hvd.Average)
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    for _ in range(args.warmup):
        float(step(*batch()))
    logdir = tempfile.mkdtemp(prefix="sparse_hvd_profile_")
    if rank == 0:
        tf.profiler.experimental.start(logdir)
    threads_before = thread_times() if args.per_thread else {}
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    stats_seconds = 0.0
    for _ in range(args.steps):
        float(step(*batch()))
        if args.stats_each_step and not unwrapped:
            begun = time.perf_counter()
            optimizer.communication_stats()
            stats_seconds += time.perf_counter() - begun
    wall = (time.perf_counter() - start - stats_seconds) / args.steps
    after = resource.getrusage(resource.RUSAGE_SELF)
    threads = per_thread(threads_before, thread_times(), args.steps) if args.per_thread else []
    cpu = hvd.allgather_object([(after.ru_utime - before.ru_utime) / args.steps,
                                (after.ru_stime - before.ru_stime) / args.steps, threads],
                               name="profile.cpu")
    if rank == 0:
        tf.profiler.experimental.stop()
        times = op_times(logdir, args.steps)
        print(f"{args.exchange}, budget {args.budget}, density {args.density}: "
              f"{wall * 1e3:.1f} ms a step (wall, rank 0)")
        if args.stats_each_step:
            print(f"communication_stats() after each step: {stats_seconds / args.steps * 1e3:.2f} "
                  "ms a read on rank 0 (left out of the step's wall time)")
        print("CPU ms a step, user/system, each rank: "
              + " ".join(f"{user * 1e3:.1f}/{system * 1e3:.1f}" for user, system, _ in cpu))
        for index, (_, _, threads) in enumerate(cpu):
            if threads:
                print(f"  rank {index}, per thread: " + "; ".join(threads))
        print("| ms a step | runs a step | op |\n| ---: | ---: | --- |")
        for name, (ms, runs) in sorted(times.items(), key=lambda item: -item[1][0])[:args.top]:
            print(f"| {ms:.2f} | {runs:.0f} | {name[:120]} |")
    shutil.rmtree(logdir, ignore_errors=True)


if __name__ == "__main__":
    main()
