"""CPU cost of one step's sparsification work on ResNet-50-shaped gradients, against a floor.

What it measures
    For the ~25.6 M parameters of ResNet-50 (161 tensors: conv kernels, BatchNorm gamma/beta,
    the 2048x1000 dense kernel and its bias, built from the architecture in code; no model is
    downloaded or built), the wall time of everything the optimizer does per step before the
    exchange, for every tensor it sends sparsely:
    ``sparse_hvd.error_feedback.compensate_select_remember(grad, residual, sparsifier, k)``:
    compensate (grad + residual), select (the sparsifier), remember (residual = compensated with
    the sent entries zeroed) and the payload (values, int32 indices), with
    ``k = max(1, ceil(0.01 * n))``. Methods: exact top-k as a partial sort of every tensor
    (``topk_sort``) and as the default ``topk`` does it (candidates above a sampled cut for
    tensors of 64 Ki entries and more, the same selection), ``approx_topk``, ``threshold``
    (hard threshold; one global lambda chosen from the data so that about 1% of entries pass),
    ``threshold_capped`` (lambda so small that every entry passes: the 1% cap decides) and
    ``randomk``, all at density 0.01. Each method is one ``tf.function`` (jit_compile=False)
    over all tensors of a step, returning the payloads.

    Gradients: float32, normal, fixed seed (``--seed``), each tensor with its own scale
    (log-uniform in [0.5, 2] x 1e-3, as real gradients differ per layer); residuals are
    ``tf.Variable`` zeros of the same shapes. With one global lambda the per-tensor density of
    ``threshold`` varies around 1% (printed), as it does in training.

    The reference ("floor") is one fused elementwise pass per tensor that reads the gradient and
    the residual and writes the residual once: ``residual.assign_add(grad)``. No sparsification
    with error feedback can move less memory than that: it must read the gradient and the
    residual and write the new residual.

Why
    Sparsification exists to save network time. If compensating and selecting costs a large
    multiple of a pass over memory, it eats the saving (on a fast network, or a CPU-only
    worker, it can cost more than it saves). Targets (issue 11): hard threshold, capped or not,
    <= 2x the floor, approximate top-k <= 2.5x, exact top-k <= 3x.

How
    Each method is warmed up (2 calls: tracing), then timed ``--repeats`` times, round-robin
    (the order rotates every repetition) so that machine noise hits all methods alike. Before
    every timed call, untimed: the residuals are reset to zero (so every call sees the same
    data; the zeros come from a ``tf.fill`` of a runtime scalar, because a constant-folded
    ``zeros_like`` would leave each residual sharing its buffer with a graph constant and make
    the floor's ``assign_add`` copy it first), and the CPU caches are flushed by writing a
    buffer twice the size of the last-level cache (``--no-flush`` skips this), so every method
    starts from gradients and residuals in main memory, as after a forward/backward pass. (Some
    server CPUs have an L3 larger than the 200 MB of gradients + residuals; without the flush
    the timings depend on what the previous method left in the cache.)
    Only tensors the optimizer sends sparsely (>= ``--min-elements`` entries, default 1024, the
    optimizer's default) are processed, by every method including the floor; the smaller ones
    (BatchNorm vectors of 64..512 channels, the dense bias) go to a dense allreduce in the
    optimizer and take no sparsification work. Since other processes on the machine disturb the
    timings, the share of CPU time they used during the timed calls is printed at the end.

    It calls sparse_hvd's ``sparsifiers`` and ``error_feedback`` modules in one process; no
    Horovod collective runs.

Run
    .venv/bin/python scripts/benchmarks/bench_sparsify.py                  # about 25 s on 2 cores
    .venv/bin/python scripts/benchmarks/bench_sparsify.py --repeats 15 --threads 2 --json results/bench.json
"""

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DENSITY = 0.01
METHODS = ("floor", "topk_sort", "topk", "approx_topk", "threshold", "threshold_capped", "randomk")
# max ratio of the median to the floor's (issue 11)
TARGETS = {"threshold": 2.0, "threshold_capped": 2.0, "approx_topk": 2.5, "topk": 3.0}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per method (default 10)")
    parser.add_argument(
        "--threads", type=int, default=None,
        help="tf.config.threading.set_intra_op_parallelism_threads (default: TF's default)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    parser.add_argument("--seed", type=int, default=0, help="seed of the gradients (default 0)")
    parser.add_argument(
        "--min-elements", type=int, default=1024,
        help="tensors smaller than this are left out of every method, as the optimizer sends "
        "them densely (default 1024; 0 processes all 161)",
    )
    parser.add_argument(
        "--no-flush", action="store_true",
        help="do not flush the CPU caches before each timed call (warm-cache timings)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


# ---- ResNet-50's trainable variables ------------------------------------------------------------


def resnet50_shapes():
    """(name, shape) of ResNet-50's trainable variables (v1.5 / torchvision layout, no conv bias).

    Stem: 7x7/2 conv 3->64 + BN. Four stages of bottleneck blocks (3, 4, 6, 3 blocks; widths 64,
    128, 256, 512; expansion 4): 1x1 reduce, 3x3, 1x1 expand, each followed by BN; the first
    block of each stage has a 1x1 projection shortcut + BN. Head: dense 2048 -> 1000 with bias.
    """
    shapes = []

    def conv_bn(name, kh, kw, cin, cout):
        shapes.append((f"{name}/kernel", (kh, kw, cin, cout)))
        shapes.append((f"{name}_bn/gamma", (cout,)))
        shapes.append((f"{name}_bn/beta", (cout,)))

    conv_bn("conv1", 7, 7, 3, 64)
    cin = 64
    for stage, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512)), start=2):
        for block in range(1, blocks + 1):
            prefix = f"conv{stage}_block{block}"
            if block == 1:
                conv_bn(f"{prefix}_0", 1, 1, cin, 4 * width)  # projection shortcut
            conv_bn(f"{prefix}_1", 1, 1, cin, width)
            conv_bn(f"{prefix}_2", 3, 3, width, width)
            conv_bn(f"{prefix}_3", 1, 1, width, 4 * width)
            cin = 4 * width
    shapes.append(("predictions/kernel", (2048, 1000)))
    shapes.append(("predictions/bias", (1000,)))
    return shapes


def make_gradients(shapes, seed):
    """Normal float32 gradients; each tensor's scale drawn log-uniformly in [0.5, 2] x 1e-3."""
    rng = np.random.default_rng(seed)
    grads = []
    for _, shape in shapes:
        scale = 1e-3 * math.exp(rng.uniform(math.log(0.5), math.log(2.0)))
        grads.append((rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)))
    return grads


def last_level_cache_bytes():
    """Size of the largest CPU cache Linux reports (0 if unknown)."""
    largest = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = os.listdir(base)
    except OSError:
        return 0
    for entry in entries:
        try:
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        value = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        largest = max(largest, value)
    return largest


class CacheFlusher:
    """Evicts gradients and residuals from the CPU caches by writing a larger buffer."""

    def __init__(self, nbytes):
        self.nbytes = nbytes
        self._buffer = np.ones(nbytes // 4, np.float32)

    def __call__(self):
        np.add(self._buffer, 1.0, out=self._buffer)


def machine_and_own_cpu_seconds():
    """(CPU seconds all processes have used, this process's CPU seconds); None if unknown."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    busy = sum(int(x) for x in fields[:8]) - int(fields[3]) - int(fields[4])  # minus idle, iowait
    own = os.times()
    return busy / ticks, own.user + own.system


# ---- the package's modules, without its __init__ (which needs Horovod) ---------------------------


def load_sparse_hvd_modules():
    from sparse_hvd.feedback import error_feedback
    from sparse_hvd.selection import sparsifiers

    return sparsifiers, error_feedback


# ---- the benchmark ------------------------------------------------------------------------------


def build_methods(tf, sparsifiers, error_feedback, residuals, ks, threshold):
    compensate_select_remember = error_feedback.compensate_select_remember

    @tf.function(jit_compile=False)
    def floor(grads):
        for grad, residual in zip(grads, residuals):
            residual.assign_add(grad, read_value=False)
        return tf.constant(0)  # no payload: the stateful assigns always run

    def sparse_method(sparsifier):
        @tf.function(jit_compile=False)
        def step(grads):
            payloads, capped = [], []
            for grad, residual, k in zip(grads, residuals, ks):
                selection = compensate_select_remember(grad, residual, sparsifier, k)
                payloads.append((selection.values, selection.indices))
                if selection.capped is not None:
                    capped.append(tf.cast(selection.capped, tf.int32))
            return payloads, (tf.add_n(capped) if capped else tf.constant(0))

        return step

    return {
        "floor": floor,
        # exact top-k by a partial sort of every tensor, and by candidates above a sampled cut
        "topk_sort": sparse_method(sparsifiers.TopK(fast=False)),
        "topk": sparse_method(sparsifiers.get_sparsifier("topk")),
        # seeded, so that every run samples the same positions
        "approx_topk": sparse_method(sparsifiers.ApproxTopK(seed=1)),
        "threshold": sparse_method(sparsifiers.Threshold(threshold=threshold, max_density=0.1)),
        # every entry passes lambda: the cap (1%) decides, in every tensor
        "threshold_capped": sparse_method(sparsifiers.Threshold(threshold=1e-30,
                                                                max_density=DENSITY)),
        "randomk": sparse_method(sparsifiers.RandomK(seed=2)),
    }


def main(argv=None):
    args = parse_args(argv)
    import tensorflow as tf

    if args.threads is not None:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    sparsifiers, error_feedback = load_sparse_hvd_modules()

    cores = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    print(f"machine: {platform.machine()} {platform.processor() or ''}".rstrip()
          + f", {cores} cores ({usable} usable by this process)")
    print(f"TensorFlow {tf.__version__}, intra-op threads: "
          f"{args.threads if args.threads is not None else 'TF default'} "
          f"(reported: {tf.config.threading.get_intra_op_parallelism_threads()}; 0 = all cores)")

    shapes = resnet50_shapes()
    sizes = [math.prod(shape) for _, shape in shapes]
    print(f"ResNet-50 trainable variables: {len(shapes)} tensors, {sum(sizes):,} parameters")
    chosen = [i for i, n in enumerate(sizes) if n >= args.min_elements]
    n_chosen = [sizes[i] for i in chosen]
    left_out = len(shapes) - len(chosen)
    print(f"processed by every method: {len(chosen)} tensors with >= {args.min_elements} entries, "
          f"{sum(n_chosen):,} parameters ({left_out} smaller tensors, "
          f"{sum(sizes) - sum(n_chosen):,} parameters, are sent densely by the optimizer and "
          "left out of all methods)")

    chosen_set = set(chosen)
    grads_np = [g for i, g in enumerate(make_gradients(shapes, args.seed)) if i in chosen_set]
    # One global lambda: the 99th percentile of |g| over all processed entries.
    all_magnitudes = np.abs(np.concatenate([g.ravel() for g in grads_np]))
    threshold = float(np.percentile(all_magnitudes, 100 * (1 - DENSITY)))
    passing = float(np.mean(all_magnitudes >= np.float32(threshold)))
    del all_magnitudes
    ks = [max(1, math.ceil(DENSITY * n)) for n in n_chosen]
    total = sum(n_chosen)
    print(f"density {DENSITY}: k = max(1, ceil({DENSITY} * n)) per tensor, {sum(ks):,} entries "
          f"in all; threshold lambda = {threshold:.6g} (99th percentile of |g| over all "
          f"processed entries; {passing:.4%} of entries pass it), max_density 0.1")
    print("floor = residual.assign_add(grad) per tensor: one fused pass reading grad and residual "
          "and writing the residual once")
    print(f"residuals reset to zero (untimed) before every call; {args.repeats} timed calls per "
          "method after 2 warm-up calls, round-robin")

    if args.no_flush:
        flush = None
        print("caches not flushed between calls (warm-cache timings)")
    else:
        llc = last_level_cache_bytes()
        flush = CacheFlusher(min(max(2 * llc, 256 << 20), 2 << 30))
        print(f"caches flushed (untimed) before every timed call: {flush.nbytes >> 20} MiB written "
              f"(last-level cache: {llc >> 20 if llc else 'unknown'} MiB)")

    grads = [tf.constant(g) for g in grads_np]
    residuals = [tf.Variable(tf.zeros_like(g)) for g in grads]
    zero = tf.constant(0.0)

    @tf.function(jit_compile=False)
    def reset_residuals(zero):
        for residual in residuals:
            residual.assign(tf.fill(tf.shape(residual), zero), read_value=False)

    methods = build_methods(tf, sparsifiers, error_feedback, residuals, ks, threshold)
    selected, capped_layers, per_tensor_density = {}, {}, {}

    def call(name, timed=True):
        reset_residuals(zero)
        if timed and flush is not None:
            flush()
        start = time.perf_counter()
        out = methods[name](grads)
        seconds = time.perf_counter() - start
        if name != "floor":
            payloads, capped = out
            counts = [int(v.shape[0]) for v, _ in payloads]
            selected[name] = sum(counts)
            capped_layers[name] = int(capped)
            per_tensor_density[name] = [c / n for c, n in zip(counts, n_chosen)]
        return seconds

    start = time.perf_counter()
    for name in METHODS:
        for _ in range(2):
            call(name, timed=False)
    print(f"warm-up (tracing) of all methods: {time.perf_counter() - start:.1f} s")

    times = {name: [] for name in METHODS}
    cpu_before, wall_before = machine_and_own_cpu_seconds(), time.perf_counter()
    for rep in range(args.repeats):
        order = METHODS[rep % len(METHODS):] + METHODS[:rep % len(METHODS)]
        for name in order:
            times[name].append(call(name))
    cpu_after, wall = machine_and_own_cpu_seconds(), time.perf_counter() - wall_before
    other_load = None
    if cpu_before is not None and cpu_after is not None:
        others = (cpu_after[0] - cpu_before[0]) - (cpu_after[1] - cpu_before[1])
        other_load = max(0.0, others / (wall * usable))

    floor_median = statistics.median(times["floor"])
    floor_min = min(times["floor"])
    results = {}
    for name in METHODS:
        median = statistics.median(times[name])
        results[name] = {
            "median_s": median,
            "min_s": min(times[name]),
            "ratio_to_floor": median / floor_median,
            "min_ratio_to_floor": min(times[name]) / floor_min,
            "density": None if name == "floor" else selected[name] / total,
            "capped_layers": capped_layers.get(name) if name.startswith("threshold") else None,
            "per_tensor_density": per_tensor_density.get(name) if name == "threshold" else None,
            "times_s": times[name],
        }

    print()
    header = (f"{'method':<12} {'median s':>9} {'min s':>9} {'x floor':>8} {'(min/min)':>9} "
              f"{'density':>8}  target (on the median ratio)")
    print(header)
    print("-" * len(header))
    for name in METHODS:
        r = results[name]
        density = "-" if r["density"] is None else f"{r['density']:.4%}"
        if name in TARGETS:
            met = r["ratio_to_floor"] <= TARGETS[name]
            target = f"<= {TARGETS[name]:g}x: {'met' if met else 'NOT met'}"
        else:
            target = "(reference)" if name in ("floor", "topk_sort") else "(baseline)"
        print(f"{name:<12} {r['median_s']:>9.4f} {r['min_s']:>9.4f} {r['ratio_to_floor']:>7.2f}x "
              f"{r['min_ratio_to_floor']:>8.2f}x {density:>8}  {target}")
    print("x floor = median / floor's median; (min/min) = fastest call / floor's fastest call")
    spread = per_tensor_density["threshold"]
    print(f"threshold: per-tensor density {min(spread):.3%} .. {max(spread):.3%}; "
          f"{results['threshold']['capped_layers']} of {len(chosen)} tensors capped "
          "(more than max_density passed lambda: the largest cap entries were sent); "
          f"threshold_capped: {results['threshold_capped']['capped_layers']} capped")
    for name, limit in TARGETS.items():
        met = results[name]["ratio_to_floor"] <= limit
        print(f"target {name} <= {limit:g}x floor: {'met' if met else 'NOT met'} "
              f"({results[name]['ratio_to_floor']:.2f}x)")
    print(f"exact topk: {results['topk']['ratio_to_floor']:.2f}x floor "
          f"({results['topk']['median_s']:.4f} s per step); as a partial sort: "
          f"{results['topk_sort']['ratio_to_floor']:.2f}x")
    if other_load is not None:
        print(f"other processes used {other_load:.0%} of the machine's CPU time during the timed "
              "calls" + ("; timings are disturbed, run again on a quiet machine"
                         if other_load > 0.1 else ""))

    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        report = {
            "machine": {"cores": cores, "usable_cores": usable, "platform": platform.platform(),
                        "tensorflow": tf.__version__, "intra_op_threads": args.threads},
            "tensors": {"resnet50_tensors": len(shapes), "resnet50_parameters": sum(sizes),
                        "processed_tensors": len(chosen), "processed_parameters": total,
                        "min_elements": args.min_elements},
            "density": DENSITY,
            "threshold_lambda": threshold,
            "floor": "residual.assign_add(grad) per tensor",
            "residuals": "reset to zero before every call",
            "cache_flush_bytes": None if flush is None else flush.nbytes,
            "other_processes_cpu_share": other_load,
            "repeats": args.repeats,
            "seed": args.seed,
            "methods": results,
            "targets": {name: {"max_ratio": limit,
                               "met": results[name]["ratio_to_floor"] <= limit}
                        for name, limit in TARGETS.items()},
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
