"""Wire bytes per worker as the job grows: dense allreduce, allgather and sparse allreduce.

What it measures
    For N = 2, 4, 6, 8 workers (``--workers``) on the emulated cluster (``scripts/
    emulated_cluster.py``, every worker's link shaped to ``--rate``), one ``scripts/
    bench_step.py`` job per N times the 4.35M-parameter MLP's step for the default
    (``auto@d``, built first), dense Horovod allreduce, and top-k with the library's default
    cut and budget (the update of SGD with momentum, one budget for the model) on the
    allgather (``topk_model_update@d``), the coded allgather (``compact_...``) and the sparse
    allreduce (``sar_...``) at 1% and 0.1%, and reads every worker's interface counters: the
    bytes its link received and sent per step (TCP/IP headers and Horovod's coordination
    included). (Before this release the rows were the gradient cut with a budget per layer,
    ``topk@d`` and ``sar_topk@d``, and auto, which cuts the update, was compared with them.)
    Printed and written as ``docs/bench_scale.{json,md,png}`` (``--publish``):

    * per N and method: the received bytes per worker and step (the wire; also the
      collectives' data alone, counted exactly, ``collective_bytes.py``: the difference is
      what MPI's and TCP's framing and Horovod's coordination add), as a multiple of the payload P
      (k entries of value + int32 index) and of dense; for the sparse allreduce also against
      Ok-Topk's lower bound 2 k (N - 1) / N entries (the wire and the data) and against the
      allgather's wire and step
      (issue 21's targets: at most 1.2x the bound at N = 4..8, at N = 4 at most 0.6x the
      allgather's wire; its step no slower than the allgather's at N >= 4); for ``auto@d`` (the
      default exchange) its step against the fastest of its candidates in the run (dense and
      the sparse exchanges that cut what it cuts: ``auto_candidates``) and what it chose
      (target: at most 1.05x);
    * a projection to N = 16 ... 1024 for ResNet-50 (25.6M parameters) and BERT-large (340M) at
      10, 25 and 100 Gbit/s: per worker and step, bytes through its link / bandwidth plus a
      latency per message round (``--latency-us``, default 5 us, a fast cluster's) for: dense ring allreduce (2 (N - 1) / N D bytes, 2 (N - 1) rounds),
      allgather ((N - 1) P, N - 1 rounds) and sparse allreduce (c (N - 1) / N P with c fitted to
      the measured N <= 8 points, 2 (N - 1) rounds), plus for the sparse ones the selection
      cost measured by ``scripts/benchmarks/bench_sparsify.py`` on this machine (per parameter, exact
      top-k; ``--selection-ns``). Checked against the measurements: the model's bytes next to
      the measured ones for N <= 8.

Run (root, for the emulated cluster)::

    .venv/bin/python scripts/benchmarks/bench_scale.py --publish docs  # 33 min on slow 2 cores

Each method first runs ``--warmup-steps`` untimed steps (default 50): over the first tens the
residuals build up, the sums' cut grows fastest and the sparse allreduce's owners keep up to 4 k
sums (``probe_threshold.py``); a long run is the steady state after them. Before this option
the table was measured after 4.

Caveats: all N workers share this machine's 2 cores, so step times at N = 8 are many times a
real cluster's; the bytes are exact counts and do not depend on that.
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# auto first (built before the others, as in a job of its own), then the rows of its own cut
# (the update, under SGD with momentum) and budget, so that its step is compared like for like
METHODS = ("auto@0.01", "dense", "topk_model_update@0.01", "compact_topk_model_update@0.01",
           "sar_topk_model_update@0.01", "topk_model_update@0.001",
           "sar_topk_model_update@0.001")
MODELS = {"ResNet-50": 25.6e6, "BERT-large": 340e6}
RATES_GBIT = (10, 25, 100)
PROJECTED_N = (16, 32, 64, 128, 256, 512, 1024)
ENTRY_BYTES = 8  # float32 value + int32 index


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="2,4,6,8")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="bench_step.py methods (dense and the allgather rows are the "
                        "references)")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup-steps", type=int, default=50,
                        help="untimed first steps per method: the sparse allreduce's residuals "
                             "and threshold settle over the first tens (probe_threshold.py)")
    parser.add_argument("--latency-us", type=float, default=5.0,
                        help="smallest per-round latency of the projection (a fast cluster's)")
    parser.add_argument("--selection-ns", type=float, default=None,
                        help="selection cost per parameter (default: docs/bench_sparsify_resnet50.json)")
    parser.add_argument("--out", default=os.path.join(ROOT, "results", "bench_scale"))
    parser.add_argument("--publish", default=None, metavar="DIR")
    parser.add_argument("--from-json", default=None, help="redo tables and plots from a result")
    args = parser.parse_args(argv)
    args.workers = [int(w) for w in args.workers.split(",")]
    args.methods = args.methods.split(",")
    return args


def measure(args):
    points = {}
    for workers in args.workers:
        out = os.path.join(args.out, f"np{workers}")
        command = [sys.executable, os.path.join(HERE, "bench_step.py"), "--np", str(workers),
                   "--rate", args.rate, "--methods", ",".join(args.methods), "--rounds",
                   str(args.rounds), "--steps", str(args.steps),
                   "--warmup-steps", str(args.warmup_steps),
                   "--out", out]
        print(f"[bench_scale] {workers} workers", flush=True)
        subprocess.run(command, check=True, cwd=ROOT)
        with open(os.path.join(out, f"bench_step_mlp_np{workers}_{args.rate}.json")) as handle:
            points[workers] = json.load(handle)
    return points


def selection_ns(args):
    if args.selection_ns is not None:
        return args.selection_ns
    with open(os.path.join(ROOT, "docs", "bench_sparsify_resnet50.json")) as handle:
        report = json.load(handle)
    return report["methods"]["topk"]["median_s"] / report["tensors"]["processed_parameters"] * 1e9


def summarise(points):
    rows = []
    for workers, result in sorted(points.items(), key=lambda item: int(item[0])):
        workers = int(workers)
        methods = result["methods"]
        dense = methods["dense"]["wire_received_bytes"]
        for method, m in methods.items():
            payload = m.get("bytes_sent", result["parameters"] * 4)
            row = {"workers": workers, "method": method,
                   "wire_received": m["wire_received_bytes"],
                   "wire_sent": m["wire_sent_bytes"], "payload": payload,
                   "x_payload": m["wire_received_bytes"] / payload,
                   "vs_dense": m["wire_received_bytes"] / dense,
                   # the collectives' data alone (a result of an earlier release has none)
                   "collective_received": m.get("collective_received_bytes"),
                   "step_ms": m["median_step"] * 1e3,
                   "replicas_identical": m.get("replicas_identical")}
            name, _, density = method.partition("@")
            prefix = "psar_" if name.startswith("psar_") else "sar_"
            # the allgather with the same budget (sar_topk_model against topk_model)
            allgather = methods.get(f"{name[len(prefix):]}@{density}")
            if method.startswith(prefix):  # issue 21: against Ok-Topk's bound and the allgather
                row["x_lower_bound"] = m["wire_received_bytes"] / lower_bound(workers, payload)
                if row["collective_received"] is not None:
                    row["data_x_lower_bound"] = (row["collective_received"]
                                                 / lower_bound(workers, payload))
                if allgather:
                    row["x_allgather_wire"] = (m["wire_received_bytes"]
                                               / allgather["wire_received_bytes"])
                    row["x_allgather_step"] = m["median_step"] / allgather["median_step"]
            if method.startswith("auto@"):  # against the fastest of its candidates measured
                candidates = [methods[c]["median_step"]
                              for c in auto_candidates(methods, density)]
                row["x_fastest"] = m["median_step"] / min(candidates)
                row["choice"] = (m.get("auto_decisions") or [[None, None, None]])[-1][2]
            rows.append(row)
    return rows


def auto_candidates(methods, density):
    """The rows ``auto@density``'s step is compared with: dense and the sparse exchanges
    that cut what auto cuts. Under SGD with momentum auto cuts the update (the library's
    default), which ``bench_step.py``'s ``_model_update`` rows do; a result without such
    rows (an earlier release's) is compared with its gradient-cut rows, as it was then."""
    update = any(name.endswith(f"_model_update@{density}") for name in methods)
    budgets = ("_model_update",) if update else ("", "_model")
    names = ["dense"] + [f"{prefix}topk{budget}@{density}"
                         for prefix in ("", "sar_", "compact_") for budget in budgets]
    return [name for name in names if name in methods]


def lower_bound(workers, payload):
    """Ok-Topk's lower bound on what a worker receives for a global top-k: 2 k (N - 1) / N
    entries, with ``payload`` = k entries' bytes."""
    return 2 * (workers - 1) / workers * payload


def fitted_constant(rows):
    """c of the sparse allreduce's wire = c (N - 1) / N P, fitted to the measured points, with P
    as the projection prices it: k entries of ``ENTRY_BYTES`` (the payload of the allgather
    row with the same budget; a coded row's own payload counts its coded bytes). Fitted to the
    collectives' data where the rows have it: the transport's framing and coordination add a
    few kilobytes a step whatever the payload (11-12 kB at 4-8 workers on the emulated cluster),
    which the per-round latency stands for, so taken into c they would grow with the model."""
    payloads = {(r["workers"], r["method"]): r["payload"] for r in rows}
    ratios = []
    for r in rows:
        if r["method"].startswith("sar_"):
            entries = payloads.get((r["workers"], r["method"][len("sar_"):]), r["payload"])
            received = r.get("collective_received")
            received = r["wire_received"] if received is None else received
            ratios.append(received / ((r["workers"] - 1) / r["workers"] * entries))
    return sum(ratios) / len(ratios)


def projection(c, latency_s, select_ns):
    table = []
    for model, parameters in MODELS.items():
        dense_bytes = parameters * 4
        for density in (0.01, 0.001):
            payload = parameters * density * ENTRY_BYTES
            for rate in RATES_GBIT:
                seconds_per_byte = 8 / (rate * 1e9)
                select = parameters * select_ns * 1e-9
                for n in PROJECTED_N:
                    dense = 2 * (n - 1) / n * dense_bytes * seconds_per_byte + 2 * (n - 1) * latency_s
                    gather = (n - 1) * payload * seconds_per_byte + (n - 1) * latency_s + select
                    sparse = (c * (n - 1) / n * payload * seconds_per_byte
                              + 2 * (n - 1) * latency_s + select)
                    times = {"dense": dense, "allgather": gather, "sparse_allreduce": sparse}
                    table.append({"model": model, "density": density, "gbit": rate, "workers": n,
                                  **{f"{k}_ms": v * 1e3 for k, v in times.items()},
                                  "fastest": min(times, key=times.get)})
    return table


def markdown(result):
    lines = [f"Measured on the emulated cluster ({result['rate']} links), MLP 4.35M, load "
             f"{result['load']}, commit {result['commit']}, after "
             f"{result.get('warmup_steps', 4)} untimed steps per method", "",
             "| N | method | received / worker / step | x payload | vs dense "
             "| x 2k(N-1)/N (Ok-Topk's bound) | collectives' data / step | data x bound "
             "| wire x allgather | step ms "
             "| step x allgather (sar) or x fastest (auto) | replicas identical |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in result["measured"]:
        bound = f"{r['x_lower_bound']:.2f}" if "x_lower_bound" in r else ""
        data = (f"{r['collective_received'] / 1e3:,.1f} kB"
                if r.get("collective_received") is not None else "")
        data_bound = f"{r['data_x_lower_bound']:.2f}" if "data_x_lower_bound" in r else ""
        wire = f"{r['x_allgather_wire']:.2f}" if "x_allgather_wire" in r else ""
        step = (f"{r['x_allgather_step']:.2f}" if "x_allgather_step" in r else
                f"{r['x_fastest']:.2f} (chose {r['choice']})" if "x_fastest" in r else "")
        lines.append(f"| {r['workers']} | {r['method']} | {r['wire_received'] / 1e3:,.0f} kB "
                     f"| {r['x_payload']:.2f} | 1/{1 / r['vs_dense']:.1f} | {bound} | {data} "
                     f"| {data_bound} | {wire} "
                     f"| {r['step_ms']:.0f} | {step} | {r['replicas_identical']} |")
    fitted_to = ("the collectives' data above" if any(
        r.get("collective_received") is not None for r in result["measured"])
        else "the wire above")
    lines += ["", f"Sparse allreduce wire = c (N - 1) / N x payload with c = {result['c']:.2f} "
              f"(fitted to {fitted_to}). Projection: latency {result['latency_us']:.0f} us "
              f"per round, selection {result['selection_ns']:.2f} ns per parameter.", "",
              "| model | density | Gbit/s | N | dense ms | allgather ms | sparse allreduce ms "
              "| fastest |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for p in result["projection"]:
        lines.append(f"| {p['model']} | {p['density']:g} | {p['gbit']} | {p['workers']} "
                     f"| {p['dense_ms']:.1f} | {p['allgather_ms']:.1f} "
                     f"| {p['sparse_allreduce_ms']:.1f} | {p['fastest']} |")
    return "\n".join(lines)


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    measured = result["measured"]
    for method in dict.fromkeys(r["method"] for r in measured):
        points = [r for r in measured if r["method"] == method]
        axes[0].plot([r["workers"] for r in points], [r["wire_received"] / 1e6 for r in points],
                     marker="o", label=method)
    axes[0].set_xlabel("workers")
    axes[0].set_ylabel("MB received per worker and step")
    axes[0].set_yscale("log")
    axes[0].set_title(f"measured, MLP, {result['rate']}")
    axes[0].legend(fontsize=7)
    for axis, model in zip(axes[1:], MODELS):
        for method, style in (("dense", "-"), ("allgather", "--"), ("sparse_allreduce", ":")):
            for rate in (10, 100):
                points = [p for p in result["projection"]
                          if p["model"] == model and p["gbit"] == rate and p["density"] == 0.01]
                axis.plot([p["workers"] for p in points], [p[f"{method}_ms"] for p in points],
                          style, label=f"{method} {rate} Gbit/s")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("workers")
        axis.set_ylabel("modelled exchange ms per step (1%)")
        axis.set_title(f"projection: {model}")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None):
    args = parse_args(argv)
    if args.from_json:  # the fit and the projection are derived again from the measurements
        with open(args.from_json) as handle:
            result = json.load(handle)
        result["c"] = fitted_constant(result["measured"])
        result["projection"] = projection(result["c"], result["latency_us"] * 1e-6,
                                          result["selection_ns"])
    else:
        load = os.getloadavg()[0]
        points = measure(args)
        rows = summarise(points)
        latency = max(args.latency_us, 0.0) * 1e-6
        c = fitted_constant(rows)
        result = {"rate": args.rate, "load": f"{load:.1f} (1-min average at start)",
                  "commit": next(iter(points.values())).get("commit"),
                  "warmup_steps": args.warmup_steps,
                  "measured": rows, "c": c, "latency_us": latency * 1e6,
                  "selection_ns": selection_ns(args)}
        result["projection"] = projection(c, latency, result["selection_ns"])
        result["finished"] = time.strftime("%Y-%m-%d %H:%M")
    text = markdown(result)
    print(text)
    for folder in [args.out] + ([args.publish] if args.publish else []):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "bench_scale.json"), "w") as handle:
            json.dump(result, handle, indent=1)
        with open(os.path.join(folder, "bench_scale.md"), "w") as handle:
            handle.write(text + "\n")
        plot(result, os.path.join(folder, "bench_scale.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
