"""Does the layer-wise exchange overlap backprop? A timing experiment read from Horovod's timeline.

LAGS-SGD (Shi et al. 2020) rests on one property: a layer's sparsify-and-exchange depends only
on that layer's gradient, so it can run while backprop of the layers below continues. This
script trains the same MLP on 2 workers with ``grouping="grouped"`` (one fused allgather for all
layers after backprop) and ``grouping="layerwise"`` (one allgather per layer), with Horovod's
timeline on, and reads from rank 0's timeline, for every step after the warm-up:

* spread: time from the first exchange that every rank had submitted to the last one (0 when
  grouped: one group is submitted at once);
* early: exchanges that had already finished before the last one was submitted by every
  rank (that is the input layer's, whose gradient backprop produces last): those ran entirely
  behind the rest of backprop;
* the median step time of each grouping.

    .venv/bin/python scripts/benchmarks/bench_overlap.py [--steps 30] [--out results/overlap]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # scripts/: launching, emulated_cluster
import launching  # noqa: E402  (scripts/launching.py: the launcher command lines)


def worker(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np

    import sparse_hvd

    sparse_hvd.init()
    rank = sparse_hvd.rank()
    keras.utils.set_random_seed(0)
    layers = [keras.Input((args.width,))]
    layers += [keras.layers.Dense(args.width, activation="relu") for _ in range(args.depth)]
    model = keras.Sequential(layers + [keras.layers.Dense(10)])
    # the allgather named: the default (auto) may choose dense, which has no layer-wise form
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.01), density=0.01, grouping=args.grouping, exchange="allgather",
        warmup_steps=0)
    model.compile(optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    rng = np.random.RandomState(rank)
    x = rng.randn(args.batch * args.steps, args.width).astype("float32")
    y = rng.randint(0, 10, args.batch * args.steps)

    class StepTimes(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.start)

    times = []
    model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0,
              callbacks=[sparse_hvd.BroadcastGlobalVariablesCallback(0), StepTimes()])
    if rank == 0:
        with open(args.step_times, "w") as handle:
            json.dump(times, handle)


def read_timeline(path):
    """{tensor name: [(all ranks ready us, exchange start us, exchange end us), ...]} per step."""
    with open(path) as handle:
        text = handle.read().rstrip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in e.get("args", {})}
    per_tensor = {}
    state = {}
    for event in events:
        pid = event.get("pid")
        if pid not in names:
            continue
        current = state.setdefault(pid, {"stack": []})
        if event.get("ph") == "B":
            current["stack"].append(event["name"])
            if event["name"] in ("ALLGATHER", "ALLREDUCE") and len(current["stack"]) == 1:
                current["start"] = event["ts"]
        elif event.get("ph") == "E" and current["stack"]:
            finished = current["stack"].pop()
            if finished.startswith("NEGOTIATE_"):
                current["ready"] = event["ts"]  # every rank has submitted it
            if finished in ("ALLGATHER", "ALLREDUCE") and not current["stack"]:
                per_tensor.setdefault(names[pid], []).append(
                    (current.get("ready", current["start"]), current["start"], event["ts"])
                )
    return per_tensor


def analyse(per_tensor, warmup):
    """Per step after ``warmup``: spread of requests (ms) and exchanges done before the last."""
    sparse = {name: records for name, records in per_tensor.items()
              if any(part in name for part in (".fused_", ".values.", ".indices"))}
    steps = min(len(records) for records in sparse.values())
    spreads, early, total = [], [], 0
    for step in range(warmup, steps):
        records = [records[step] for records in sparse.values()]
        last_ready = max(r[0] for r in records)
        spreads.append((last_ready - min(r[0] for r in records)) / 1000.0)
        early.append(sum(1 for r in records if r[2] <= last_ready))
        total = len(records)
    return {
        "steps_analysed": len(spreads),
        "exchanges_per_step": total,
        "median_spread_ms": statistics.median(spreads),
        "median_exchanges_done_before_backprop_end": statistics.median(early),
    }


def launch(args, grouping, out):
    timeline = os.path.join(out, f"timeline_{grouping}.json")
    step_times = os.path.join(out, f"step_times_{grouping}.json")
    env = launching.mpi_environment(dict(os.environ, HOROVOD_TIMELINE=timeline,
                                         TF_CPP_MIN_LOG_LEVEL="2"))
    command = launching.mpirun_command(args.np, [
        sys.executable, __file__, "--worker",
        "--grouping", grouping, "--step-times", step_times, "--steps", str(args.steps),
        "--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)],
        export=["HOROVOD_TIMELINE"])
    subprocess.run(command, env=env, check=True, timeout=600)
    with open(step_times) as handle:
        times = json.load(handle)[args.warmup:]
    result = analyse(read_timeline(timeline), args.warmup)
    result["median_step_ms"] = 1000 * statistics.median(times)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--grouping", default="layerwise", help=argparse.SUPPRESS)
    parser.add_argument("--step-times", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(ROOT, "results", "overlap"))
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    os.makedirs(args.out, exist_ok=True)
    results = {grouping: launch(args, grouping, args.out) for grouping in ("grouped", "layerwise")}
    with open(os.path.join(args.out, "overlap.json"), "w") as handle:
        json.dump(results, handle, indent=2)
    print(f"\nMLP {args.width}x{args.depth}, batch {args.batch} per worker, {args.np} workers, "
          f"{args.steps - args.warmup} steps analysed each")
    print(f"{'grouping':<10} {'step ms':>8} {'exchanges':>9} {'spread ms':>9} {'done before backprop end':>25}")
    for grouping, r in results.items():
        print(f"{grouping:<10} {r['median_step_ms']:8.1f} {r['exchanges_per_step']:9d} "
              f"{r['median_spread_ms']:9.1f} {r['median_exchanges_done_before_backprop_end']:25.1f}")


if __name__ == "__main__":
    main()
