"""Does the inner optimizer's ``clipnorm`` act on a workload, and how much larger is one
worker's gradient than the workers' average?

Under ``sparsify="update"`` (the default with SGD's momentum) each rank's inner optimizer
clips its own gradient; dense clips the average. Where a worker's gradient is mostly noise,
its norm is up to sqrt(N) times the average's, so a clipping threshold that binds would
shrink the sparse steps and not dense's. This probe trains dense on one process standing in
for ``--workers`` workers (each step the mean of their gradients, the workload's inner SGD)
and prints, every ``--every`` steps, each variable's largest per-worker gradient norm, the
average's norm and their ratio (mean over the workers).

    python scripts/benchmarks/probe_gradient_norms.py --workload charlm --steps 300
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="charlm")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16, help="per worker")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import keras
    import tensorflow as tf

    import bench_steps_to_loss
    import workloads

    settings = bench_steps_to_loss.SETTINGS[args.workload]
    spec = settings["inner"]
    if spec["name"] != "sgd":
        raise SystemExit(f"{args.workload} trains with {spec['name']}; this probe runs SGD only")
    model_name = settings.get("model", args.workload)
    workload = workloads.WORKLOADS[model_name]
    data = workload.load(0, 1)
    keras.utils.set_random_seed(args.seed)
    model = workload.build_model(data)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.SGD(spec["lr"], momentum=spec.get("momentum", 0.0),
                                     clipnorm=spec.get("clipnorm"))
    rng = np.random.default_rng(args.seed)
    variables = model.trainable_variables

    def gradients(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]

    print(f"{args.workload}: clipnorm {spec.get('clipnorm')}; variables "
          + ", ".join(v.path for v in variables))
    for step in range(args.steps + 1):
        each = [gradients(*data.sample(rng, args.batch_size)) for _ in range(args.workers)]
        mean = [sum(g[i] for g in each) / args.workers for i in range(len(variables))]
        if step % args.every == 0:
            local = np.array([[float(tf.norm(g)) for g in grads] for grads in each])
            average = np.array([float(tf.norm(m)) for m in mean])
            print(f"step {step}: largest worker norm {np.round(local.max(0), 3).tolist()}, "
                  f"average's {np.round(average, 3).tolist()}, "
                  f"ratio {np.round(local.mean(0) / average, 2).tolist()}", flush=True)
        optimizer.apply(mean, variables)


if __name__ == "__main__":
    main()
