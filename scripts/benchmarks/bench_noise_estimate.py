"""What the noise estimate's correction costs a call, with and without AdamW's decay.

``second_moment="noise_estimate"`` corrects each worker's Adam step in one native pass
(``kernels/noise_estimate.cc``). With AdamW the step also holds the decoupled weight decay,
which the correction must leave unscaled. Three ways, timed interleaved on one thread (a rank
of a job sharing the machine's cores has about one), each the median of ``--rounds`` rounds
of ``--repeats`` calls inside one ``tf.function``:

* ``adam``: the pass alone (no decay);
* ``adamw_split``: the decay as TensorFlow operations around the pass (``d = w * wd * lr``,
  ``update - d`` before it, ``+ d`` after it: three more passes over the variable);
* ``adamw_fused``: the decay inside the pass (the weights one more input).

    .venv/bin/python scripts/benchmarks/bench_noise_estimate.py --entries 4200000
"""

import argparse
import statistics
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", type=int, default=4_200_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=20)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    # the repeated calls are alike: no graph rewriting that would merge them
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    from sparse_hvd import kernels
    from sparse_hvd.feedback.second_moment import Decay, noise_estimate_step

    if kernels.noise_estimate() is None:
        raise SystemExit("the native kernels are not built")
    rng = np.random.RandomState(0)
    n = args.entries

    def variable(values):  # variables, not constants: nothing to fold at trace time
        return tf.Variable(values.astype("float32"), trainable=False)

    m, v = variable(rng.randn(n) * 0.1), variable(rng.rand(n) * 0.02)
    q0, update = variable(rng.rand(n) * 0.01), variable(rng.randn(n) * 1e-3)
    decay = Decay(variable(rng.randn(n)), tf.constant(0.1), tf.constant(1e-3))
    first = tf.constant(0.5, tf.float32)

    def step(u, q, d):
        return noise_estimate_step(u, m, v, q, first, 0.9, 0.999, 1e-7, 4, d)

    def split(u, q):
        taken = decay.amount()
        corrected, explained = step(u - taken, q, None)
        return corrected + taken, explained

    ways = {
        "adam": lambda u, q: step(u, q, None),
        "adamw_split": split,
        "adamw_fused": lambda u, q: step(u, q, decay),
    }

    def repeated(way):
        @tf.function(jit_compile=False)
        def run():
            q, total = tf.convert_to_tensor(q0), tf.constant(0.0)
            for _ in range(args.repeats):  # each call on the q the last one left: all differ
                corrected, q = way(tf.convert_to_tensor(update), q)
                total += corrected[0]
            return total + q[0]
        return run

    functions = {name: repeated(way) for name, way in ways.items()}
    for function in functions.values():
        function()  # trace and warm
    times = {name: [] for name in functions}
    for _ in range(args.rounds):
        for name, function in functions.items():
            start = time.perf_counter()
            function().numpy()
            times[name].append((time.perf_counter() - start) / args.repeats * 1e3)
    print(f"{n:,} entries, one thread, median of {args.rounds} rounds x {args.repeats} calls")
    print("| way | ms a call |\n| --- | ---: |")
    for name, samples in times.items():
        print(f"| {name} | {statistics.median(samples):.2f} |")


if __name__ == "__main__":
    main()
