"""Bounded staleness: does sparse exchange suffer less from stale updates than dense averaging?

What it measures
    Part 1, accuracy under staleness. The digits MLP of ``examples/train_digits.py``
    (167,178 parameters) trained by 2 and 4 workers under ``mpirun`` (loopback), plain SGD
    (``--momentum``, default 0: the setting of Candela et al.'s analysis; delayed updates and
    heavy momentum do not mix, see below), one learning rate for all, the same seeds, for:

    * ``dense``: ``SparseDistributedOptimizer(..., density=1.0, staleness=tau)``: every
      gradient averaged by allreduce, the average applied tau steps late;
    * ``topk_0.01``: top-k at 1% with error feedback, applied tau steps late;

    with tau in {0, 1, 2, 4} (0 is the synchronous baseline). Each (workers, method, tau, seed)
    is one job of ``scripts/benchmarks/convergence_worker.py``. Reported: final test accuracy (mean over
    seeds), its change from tau = 0 of the same method, and the per-epoch test loss and
    accuracy curves (plotted). The claim checked (Candela et al.): the accuracy lost to
    staleness is smaller for sparse than for dense.

    Momentum: staleness itself acts like extra momentum (Mitliagkas et al. 2016, "Asynchrony
    begets momentum"), so SGD with momentum 0.9 and lr 0.1, which trains this model well
    synchronously, oscillates once updates arrive one step late (one process, dense, 4 epochs:
    96.1% at tau = 0, 39.4% at tau = 1, 10% at tau = 2; plain SGD: 90.6%, 90.3%, 73.6%).

    Part 2, step time on a slow link. The same jobs for tau in {0, 1}, 2 workers, a few epochs,
    run across the emulated cluster of ``scripts/emulated_cluster.py`` (one network namespace
    per worker, links shaped with tc; ``--rate``, default 100 Mbit/s, so that this small
    model's dense exchange, 668 KB per step, is comparable to its compute). Reported: the median
    step time (slowest rank; the first 5 steps left out). With tau = 1 a step's exchange runs
    during the next step's computation, so the step time should fall from about compute +
    exchange towards max(compute, exchange). Needs root for the namespaces; skipped otherwise.

Run
    .venv/bin/python scripts/benchmarks/bench_staleness.py                  # everything (~25 min here)
    .venv/bin/python scripts/benchmarks/bench_staleness.py --quick          # smoke run: 1 seed, 2 epochs
    .venv/bin/python scripts/benchmarks/bench_staleness.py --no-link        # part 1 only

Outputs (``--out DIR``, default ``results/staleness/``): ``staleness.json`` (every run and the
summaries), ``table.md``, ``staleness.png`` (test accuracy and loss per epoch), ``runs/`` and
``logs/`` (each job's JSON and output).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # scripts/: launching, emulated_cluster
import launching  # noqa: E402  (scripts/launching.py: the launcher command lines)
WORKER = os.path.join(HERE, "convergence_worker.py")
EMULATED_CLUSTER = os.path.join(os.path.dirname(HERE), "emulated_cluster.py")
METHODS = ("dense", "topk_0.01")
LAST_EPOCHS = 5  # the summary's accuracy and loss: mean over these last epochs (and seeds)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="2,4", help="comma-separated worker counts (part 1)")
    parser.add_argument("--taus", default="0,1,2,4", help="comma-separated staleness values")
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per job")
    parser.add_argument("--no-link", action="store_true", help="skip part 2 (the slow link)")
    parser.add_argument("--link-only", action="store_true", help="skip part 1 (accuracy)")
    parser.add_argument("--summarise", metavar="JSON",
                        help="only rebuild the table and plot from a previous staleness.json")
    parser.add_argument("--rate", default="100mbit", help="link rate of part 2")
    parser.add_argument("--delay", default="0.1ms", help="one-way delay of part 2")
    parser.add_argument("--link-epochs", type=int, default=3)
    parser.add_argument("--link-repeats", type=int, default=2,
                        help="runs per configuration in part 2, interleaved (noise)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 seed, 2 epochs")
    parser.add_argument("--out", default=os.path.join(ROOT, "results", "staleness"))
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.epochs, args.link_epochs, args.link_repeats = "0", 2, 2, 1
    args.workers = [int(w) for w in args.workers.split(",")]
    args.taus = [int(t) for t in args.taus.split(",")]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    return args


def _env():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    if os.geteuid() == 0:  # Open MPI refuses root unless told
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def run_job(args, name, prefix, method, tau, seed, epochs):
    """Run one worker job (``prefix`` launches it); its result dict or one with ``error``."""
    runs, logs = os.path.join(args.out, "runs"), os.path.join(args.out, "logs")
    os.makedirs(runs, exist_ok=True)
    os.makedirs(logs, exist_ok=True)
    json_path, log_path = os.path.join(runs, name + ".json"), os.path.join(logs, name + ".log")
    if os.path.exists(json_path):
        os.remove(json_path)
    command = prefix + [
        sys.executable, WORKER, "--method", method, "--staleness", str(tau), "--seed", str(seed),
        "--epochs", str(epochs), "--lr", str(args.lr), "--momentum", str(args.momentum),
        "--batch-size", str(args.batch_size),
        "--json", json_path,
    ]
    started = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(" ".join(command) + "\n\n")
        log.flush()
        try:
            rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT,
                                timeout=args.timeout, start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - started
    if rc == 0 and os.path.exists(json_path):
        with open(json_path) as f:
            result = json.load(f)
        print(f"  {name}: test accuracy {result['test_accuracy']:.4f}, median step "
              f"{result['median_step_seconds'] * 1e3:.1f} ms, identical "
              f"{result['replicas_identical']}, {wall:.0f} s", flush=True)
        return result
    print(f"  {name}: FAILED ({rc}) after {wall:.0f} s, see {os.path.relpath(log_path, ROOT)}",
          flush=True)
    return {"error": f"job failed: {rc}", "log": os.path.relpath(log_path, ROOT)}


def accuracy_part(args):
    """Part 1: {workers: {method: {tau: [result per seed]}}}."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise SystemExit("mpirun not found: run scripts/setup.sh")
    results = {}
    for workers in args.workers:
        prefix = launching.mpirun_command(workers, [])
        for seed in args.seeds:
            for method in METHODS:
                for tau in args.taus:
                    name = f"np{workers}_{method}_tau{tau}_seed{seed}"
                    result = run_job(args, name, prefix, method, tau, seed, args.epochs)
                    results.setdefault(workers, {}).setdefault(method, {}).setdefault(tau, []).append(result)
    return results


def link_part(args):
    """Part 2: {method: {tau: [median step seconds per repeat]}} on the emulated link."""
    if os.geteuid() != 0:
        print("part 2 skipped: the emulated link needs root (network namespaces)", flush=True)
        return None
    prefix = [sys.executable, EMULATED_CLUSTER, "--workers", "2", "--rate", args.rate,
              "--delay", args.delay, "--timeout", str(args.timeout), "--"]
    times = {}
    for repeat in range(args.link_repeats):  # interleaved, so drifting load hits every method
        for method in METHODS:
            for tau in (0, 1):
                name = f"link_{method}_tau{tau}_run{repeat}"
                result = run_job(args, name, prefix, method, tau, 0, args.link_epochs)
                if "error" not in result:
                    times.setdefault(method, {}).setdefault(tau, []).append(result["median_step_seconds"])
    return times


def summarise(results):
    summary = {}
    for workers, methods in results.items():
        for method, taus in methods.items():
            for tau, runs in taus.items():
                good = [r for r in runs if "error" not in r]
                if not good:
                    continue
                epochs = len(good[0]["curve"])
                curve = [
                    {key: statistics.fmean(r["curve"][e][key] for r in good)
                     for key in ("test_accuracy", "test_loss", "train_loss")}
                    for e in range(epochs)
                ]
                tail = curve[-LAST_EPOCHS:]
                summary.setdefault(workers, {}).setdefault(method, {})[tau] = {
                    # the last epochs' mean: one final point is at the mercy of oscillations
                    "last_epochs_accuracy": statistics.fmean(p["test_accuracy"] for p in tail),
                    "last_epochs_loss": statistics.fmean(p["test_loss"] for p in tail),
                    "test_accuracy": statistics.fmean(r["test_accuracy"] for r in good),
                    "test_loss": statistics.fmean(r["test_loss"] for r in good),
                    "seeds": len(good),
                    "failed": len(runs) - len(good),
                    "replicas_identical": all(r["replicas_identical"] for r in good),
                    "bytes_per_step": statistics.fmean(r["bytes_per_step"] for r in good),
                    "curve": curve,
                }
    return summary


def tables(summary, link, args):
    taus = sorted({int(t) for methods in summary.values() for row in methods.values() for t in row})
    lines = [f"Test accuracy % / test loss, mean over the last {LAST_EPOCHS} epochs and the seeds; "
             "change from tau=0 at the largest tau:", "",
             "| workers | method | " + " | ".join(f"tau={t}" for t in taus)
             + " | change at the largest tau | final accuracy (after fit) | replicas identical |",
             "|---|---|" + "---|" * len(taus) + "---|---|---|"]
    for workers, methods in sorted(summary.items(), key=lambda item: int(item[0])):
        for method in METHODS:
            row = {int(t): v for t, v in methods.get(method, {}).items()}
            if not row:
                continue
            cells = [f"{100 * row[t]['last_epochs_accuracy']:.2f} / {row[t]['last_epochs_loss']:.3f}"
                     if t in row else "-" for t in taus]
            base, worst = row.get(taus[0]), row.get(taus[-1])
            drop = (f"{100 * (worst['last_epochs_accuracy'] - base['last_epochs_accuracy']):+.2f} pp, "
                    f"loss x{worst['last_epochs_loss'] / base['last_epochs_loss']:.2f}"
                    if base and worst else "-")
            final = " / ".join(f"{100 * row[t]['test_accuracy']:.2f}" for t in taus if t in row)
            identical = all(v["replicas_identical"] for v in row.values())
            lines.append(f"| {workers} | {method} | " + " | ".join(cells)
                         + f" | {drop} | {final} | {identical} |")
    if link:
        lines += ["", f"Median step time on the emulated link ({args.rate}, {args.delay}, 2 workers):", "",
                  "| method | tau=0 | tau=1 | tau=1 / tau=0 |", "|---|---|---|---|"]
        for method in METHODS:
            row = link.get(method, {})
            if 0 in row and 1 in row:
                t0, t1 = statistics.median(row[0]), statistics.median(row[1])
                lines.append(f"| {method} | {t0 * 1e3:.1f} ms | {t1 * 1e3:.1f} ms | {t1 / t0:.2f} |")
    return "\n".join(lines)


def plot(summary, args, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worker_counts = sorted(summary)
    fig, axes = plt.subplots(2, len(worker_counts), figsize=(6 * len(worker_counts), 8), squeeze=False)
    colors = {tau: c for tau, c in zip(args.taus, ("black", "tab:blue", "tab:orange", "tab:red", "tab:green"))}
    for column, workers in enumerate(worker_counts):
        for method in METHODS:
            for tau, row in sorted(summary[workers].get(method, {}).items()):
                epochs = range(1, len(row["curve"]) + 1)
                style = "--" if method == "dense" else "-"
                label = f"{method}, tau={tau}"
                axes[0][column].plot(epochs, [100 * p["test_accuracy"] for p in row["curve"]],
                                     style, color=colors.get(tau), label=label)
                axes[1][column].plot(epochs, [p["test_loss"] for p in row["curve"]],
                                     style, color=colors.get(tau), label=label)
        axes[0][column].set_title(f"{workers} workers: test accuracy (%)")
        axes[1][column].set_title(f"{workers} workers: test loss")
        axes[1][column].set_yscale("log")
        for ax in (axes[0][column], axes[1][column]):
            ax.set_xlabel("epoch")
            ax.grid(alpha=0.3)
        axes[0][column].set_ylim(80, 100)
        axes[0][column].legend(fontsize=7)
    fig.suptitle("Bounded staleness: dense (dashed) vs top-k 1% with error feedback (solid)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.summarise:
        with open(args.summarise) as f:
            previous = json.load(f)
        runs = {int(w): {m: {int(t): rs for t, rs in taus.items()} for m, taus in methods.items()}
                for w, methods in previous["runs"].items()}
        link = previous.get("link_step_seconds")
        if link:
            link = {m: {int(t): v for t, v in row.items()} for m, row in link.items()}
        summary = summarise(runs)
        table = tables(summary, link, args)
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write(table + "\n")
        plot(summary, args, os.path.join(args.out, "staleness.png"))
        print(table)
        return 0
    started = time.perf_counter()
    print(f"part 1: accuracy, workers {args.workers}, tau {args.taus}, seeds {args.seeds}, "
          f"{args.epochs} epochs", flush=True)
    results = {} if args.link_only else accuracy_part(args)
    summary = summarise(results)
    link = None
    if not args.no_link:
        print(f"part 2: step time on the emulated link ({args.rate}, {args.delay})", flush=True)
        link = link_part(args)
    table = tables(summary, link, args)
    with open(os.path.join(args.out, "staleness.json"), "w") as f:
        json.dump({"settings": {k: v for k, v in vars(args).items()}, "summary": summary,
                   "link_step_seconds": link, "runs": results,
                   "seconds": time.perf_counter() - started}, f, indent=1)
        f.write("\n")
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table + "\n")
    if summary:
        plot(summary, args, os.path.join(args.out, "staleness.png"))
    print()
    print(table)
    print(f"\n{time.perf_counter() - started:.0f} s; outputs in {os.path.relpath(args.out, ROOT)}/")
    failed = sum(1 for m in results.values() for t in m.values() for rs in t.values()
                 for r in rs if "error" in r)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
