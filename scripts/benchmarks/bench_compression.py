"""Compressed values and accumulated passes: bytes on the wire and digits accuracy, 3 seeds.

What it measures
    ``examples/train_digits.py`` (an MLP of 166k parameters on scikit-learn's handwritten
    digits, top-k at 1%, SGD with momentum) on 2 workers under mpirun, for each setting and seed
    (``--seeds``, default 3): the test accuracy after ``--epochs`` epochs, the payload bytes this
    rank sent per exchange and per training sample, and whether the replicas ended identical.
    Settings (``--settings``):

    * ``none``: float32 values (the default);
    * ``float16`` / ``bfloat16``: ``compression=`` (16-bit values, rounding kept in the residual);
    * ``passes2``: ``backward_passes_per_step=2`` (two batches a exchange), float32.

    Prints a table (mean and spread over the seeds, and each setting against ``none``) and, with
    ``--publish DIR``, writes ``DIR/bench_compression.{json,md}``.

Run::

    .venv/bin/python scripts/benchmarks/bench_compression.py --publish docs     # about 6 minutes
"""

import argparse
import json
import os
import sys
import statistics
import subprocess
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/
import launching  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SETTINGS = {
    "none": [],
    "float16": ["--compression", "float16"],
    "bfloat16": ["--compression", "bfloat16"],
    "passes2": ["--backward-passes", "2"],
}


def run(setting, seed, epochs, workdir):
    """One 2-worker training; its JSON result."""
    path = os.path.join(workdir, f"{setting}-{seed}.json")
    argv = [os.path.join(ROOT, "examples", "train_digits.py"), "--epochs", str(epochs),
            "--seed", str(seed), "--json", path] + SETTINGS[setting]
    command = launching.mpirun_command(2, launching.python_argv(argv), tcp_only=True)
    env = launching.mpi_environment(dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{setting} seed {seed} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    with open(path) as f:
        return json.load(f)


def summarise(results, samples_per_rank):
    rows = {}
    for setting, runs in results.items():
        accuracy = [r["test_accuracy"] for r in runs]
        per_exchange = [r["communication"]["bytes_sent"] / r["communication"]["steps"] for r in runs]
        epochs = runs[0]["epochs"]
        per_sample = [r["communication"]["bytes_sent"] / (epochs * samples_per_rank) for r in runs]
        rows[setting] = {
            "accuracy_mean": statistics.mean(accuracy), "accuracy_min": min(accuracy),
            "accuracy_max": max(accuracy), "accuracies": accuracy,
            "bytes_per_exchange": statistics.mean(per_exchange),
            "bytes_per_sample": statistics.mean(per_sample),
            "exchanges": runs[0]["communication"]["steps"],
            "replicas_identical": all(r["replicas_identical"] for r in runs),
        }
    return rows


def table(rows):
    base = rows.get("none")
    lines = ["| setting | test accuracy, mean (min-max) | vs none | bytes per exchange | vs none "
             "| bytes per sample | vs none | exchanges | replicas identical |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for setting, row in rows.items():
        against = (lambda key: f"{row[key] / base[key]:.2f}x") if base else (lambda key: "")
        lines.append(
            f"| {setting} | {row['accuracy_mean']:.4f} ({row['accuracy_min']:.4f}-"
            f"{row['accuracy_max']:.4f}) | "
            f"{(row['accuracy_mean'] - base['accuracy_mean']) * 100:+.2f} pts | "
            f"{row['bytes_per_exchange']:.0f} | {against('bytes_per_exchange')} | "
            f"{row['bytes_per_sample']:.1f} | {against('bytes_per_sample')} | "
            f"{row['exchanges']} | {row['replicas_identical']} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--publish", metavar="DIR")
    args = parser.parse_args()
    settings = args.settings.split(",")
    load = os.getloadavg()[0]
    started = time.time()
    results = {s: [] for s in settings}
    with tempfile.TemporaryDirectory() as workdir:
        for seed in range(args.seeds):
            for setting in settings:  # interleaved: every setting sees the same load
                results[setting].append(run(setting, seed, args.epochs, workdir))
                print(f"{setting} seed {seed}: accuracy {results[setting][-1]['test_accuracy']:.4f}",
                      flush=True)
    samples = 1437 // 2  # train_digits: 80% of 1797 examples, an equal shard per worker
    rows = summarise(results, samples)
    text = table(rows)
    header = (f"2 workers (mpirun, loopback), {args.epochs} epochs, {args.seeds} seeds; load "
              f"{load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; "
              f"{time.time() - started:.0f} s")
    print(header)
    print(text)
    if args.publish:
        os.makedirs(args.publish, exist_ok=True)
        with open(os.path.join(args.publish, "bench_compression.json"), "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=2)
            f.write("\n")
        with open(os.path.join(args.publish, "bench_compression.md"), "w") as f:
            f.write(f"# Compressed values and accumulated passes\n\n{header}\n\n{text}\n\n"
                    "Command: `.venv/bin/python scripts/benchmarks/bench_compression.py --publish docs`\n")


if __name__ == "__main__":
    main()
