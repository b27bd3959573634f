"""Benchmark: the native cut ops alone, one thread, at several densities.

``SparseHvdLocalSgdCut`` (the update cut's local SGD step, error feedback and cut in one pass:
SGD momentum 0.9, learning rate 0.05) and ``SparseHvdCompensateCut`` (c = g + r and its cut) on
one flat variable of ``--entries`` entries (the wide CNN's classifier has 3.3M), each density's
cut read from the op's own c so that that fraction of the entries passes. Prints each op's
median and fastest time over ``--repeats`` calls. A density near 0 shows the pass over memory
alone; what grows above it is the selection's cost. To compare two commits, run it from a
checkout of each in turn (each loads its own kernels)::

    .venv/bin/python scripts/benchmarks/bench_cut_kernels.py --densities 0.001,0.01,0.05,0.1
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", type=int, default=3_276_800)
    parser.add_argument("--densities", default="0.001,0.01,0.05,0.1")
    parser.add_argument("--repeats", type=int, default=40)
    return parser.parse_args(argv)


def timed(function, repeats):
    """(median, fastest) seconds of ``function()`` over ``repeats`` calls after a first one."""
    import numpy as np

    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), min(times)


def main(argv=None):
    args = parse_args(argv)
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from sparse_hvd import kernels

    local_sgd_cut, compensate_cut = kernels.local_sgd_cut(), kernels.compensate_cut()
    if local_sgd_cut is None or compensate_cut is None:
        raise SystemExit(f"the native kernels are not available: {kernels.status()[1]}")
    rng = np.random.default_rng(0)
    g, m, w = (tf.constant(rng.standard_normal(args.entries).astype("float32")) for _ in range(3))
    r = tf.constant((0.1 * rng.standard_normal(args.entries)).astype("float32"))
    coefficients = tf.constant([0.05, 0.9, 0.0, 0.0], tf.float32)  # lr, momentum, no decay
    cap = tf.constant(args.entries, tf.int64)

    def fused(cut):
        return local_sgd_cut(gradient=g, m=m, weights=w, residual=r, coefficients=coefficients,
                             cut=cut, nesterov=False)

    def compensated(cut):
        return compensate_cut(grad=g, residual=r, cut=cut, cap=cap)

    every = {"local_sgd_cut": (fused, fused(tf.constant(0.0))[3].numpy(), 2, 4),
             "compensate_cut": (compensated, (g + r).numpy(), 1, 4)}
    print(f"{args.entries} entries, one thread, {args.repeats} calls each; "
          f"load {os.getloadavg()[0]:.2f}")
    for density in (float(d) for d in args.densities.split(",")):
        for name, (op, c, indices_at, finite_at) in every.items():
            cut = tf.constant(np.quantile(np.abs(c), 1 - density).astype("float32"))
            passed = int(tf.size(op(cut)[indices_at]))
            median, fastest = timed(lambda: op(cut)[finite_at].numpy(), args.repeats)
            print(f"{name:>15} at {density:g}: {passed} passed, median {median * 1e3:.2f} ms, "
                  f"fastest {fastest * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
