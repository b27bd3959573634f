"""One variable's local SGD step and model-wide cut: the separate native ops against the fused
pass (``SparseHvdLocalSgd`` + ``SparseHvdCompensateCut`` against ``SparseHvdLocalSgdCut``), with
the caches warm and emptied before each call, one process, one thread.

In a training step the large variables' working set is larger than the cache, so the ops run
at the cold speed: that is the number that predicts the step (``docs/step_cost_fused_cut.md``).
Prints each variant's median milliseconds and checks that both give the same bits.

    .venv/bin/python scripts/benchmarks/probe_fused_cut.py [--entries 4194304] [--calls 15]
"""

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", type=int, default=2048 * 2048)
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--share", type=float, default=0.01, help="entries passing the cut")
    args = parser.parse_args(argv)
    import numpy as np
    import tensorflow as tf

    from sparse_hvd import kernels

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    local, cut_op, fused = kernels.local_sgd(), kernels.compensate_cut(), kernels.local_sgd_cut()
    if fused is None:
        raise SystemExit(f"the native kernels are not in use: {kernels.status()[1]}")
    n = args.entries
    rng = np.random.default_rng(0)
    g, m, w = (tf.Variable(rng.standard_normal(n).astype("float32")) for _ in range(3))
    r = tf.Variable((0.1 * rng.standard_normal(n)).astype("float32"))
    coefficients = tf.constant([0.05, 0.9, 0.0, 0.0])
    update = local(g, m, w, coefficients, nesterov=False)[0].numpy()
    cut = tf.constant(np.quantile(np.abs(update + r.numpy()), 1 - args.share), tf.float32)
    evict = np.ones(1 << 28, dtype=np.uint8)  # 256 MiB, more than any cache

    @tf.function
    def unfused():
        u, velocity, _ = local(g.read_value(), m.read_value(), w.read_value(), coefficients,
                               nesterov=False)
        remainder, indices, values, _, _ = cut_op(u, r.read_value(), cut,
                                                  tf.constant(n, tf.int64))
        return velocity, remainder, indices, values

    @tf.function
    def one_pass():
        velocity, remainder, indices, values, _, _ = fused(
            g.read_value(), m.read_value(), w.read_value(), r.read_value(), coefficients, cut,
            nesterov=False)
        return velocity, remainder, indices, values

    same = all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(unfused(), one_pass()))
    print(f"{n:,} entries, {int(tf.size(one_pass()[2])):,} passing the cut; same bits: {same}")
    for name, function in [("separate ops", unfused), ("one pass", one_pass)] * 2:
        warm, cold = [], []
        for _ in range(args.calls):
            start = time.perf_counter()
            function()
            warm.append(time.perf_counter() - start)
        for _ in range(args.calls):
            evict[::64] += 1
            start = time.perf_counter()
            function()
            cold.append(time.perf_counter() - start)
        print(f"{name}: warm {np.median(warm) * 1e3:.2f} ms, cold {np.median(cold) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
