"""Probe: why Adam after a sparse exchange trains a model far behind dense Adam.

One process stands in for 4 workers (a batch of 64, as 4 x 16; the wrapper's top-k then cuts
the batch's gradient, not each worker's), 800 steps of a workload of ``workloads.py`` under
Adam with the benchmark's schedule (linear warm-up over 5%, cosine decay), the validation loss
every 40 steps. Modes:

* ``dense``: Adam alone;
* ``sparse``: ``SparseDistributedOptimizer(Adam, density=D, exchange="allgather")``, the
  default's selection (``BUDGET=layer`` in the environment for a budget per layer);
* ``densev``: the same, but Adam's second moment is the EMA of the batch's *dense* gradient
  squared, not of the exchanged sums: Adam is then linear in what arrives, so an entry held
  back for T steps and sent as their sum moves as far as T dense steps would (the sum's
  square no longer inflates the divisor). Isolates Adam's normalisation from the delay;
* ``precond``: the gradient divided by the root of that second moment *before* the cut, so
  top-k picks by each entry's Adam step rather than its raw gradient; the wrapped optimizer
  is then Adam's first moment alone (momentum with Adam's bias correction).

    .venv/bin/python scripts/benchmarks/probe_sparse_adam.py MODE WORKLOAD LR SEED [DENSITY]

With ``ENERGY=1`` in the environment (``sparse``) each evaluation also prints the share of
the compensated gradient's energy (its squared norm, over the model) that the cut sent in that
step: 1 - |residual after|^2 / |gradient + residual before|^2 (the sent and kept entries are
disjoint). ``STEPS=N`` shortens the run.

Prints ``FINAL {json}`` with the curve. Findings: ``docs/steps_to_loss_ablations.md``,
"A transformer".
"""

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

STEPS = int(os.environ.get("STEPS", "800"))
ENERGY = os.environ.get("ENERGY") == "1"
BATCH = 64
BETA_2 = 0.999  # Keras Adam's default
EVAL_EVERY = 40


def main(argv):
    mode, workload, peak, seed = argv[0], argv[1], float(argv[2]), int(argv[3])
    density = float(argv[4]) if len(argv) > 4 else 0.01
    import sparse_hvd

    sparse_hvd.init()
    import keras
    import numpy as np
    import tensorflow as tf
    from keras import ops

    from steps_worker import learning_rate
    from workloads import WORKLOADS

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    data = WORKLOADS[workload].load(0, 1)
    keras.utils.set_random_seed(seed)
    model = WORKLOADS[workload].build_model(data)
    variables = model.trainable_variables
    # the EMA of the dense gradient squared, per variable (densev, precond)
    second = [tf.Variable(tf.zeros(v.shape), trainable=False) for v in variables]
    count = tf.Variable(0.0, trainable=False)

    class DenseSecondMomentAdam(keras.optimizers.Adam):
        def update_step(self, gradient, variable, learning_rate):
            index = self._get_variable_index(variable)
            step = ops.cast(self.iterations + 1, variable.dtype)
            alpha = (ops.cast(learning_rate, variable.dtype)
                     * ops.sqrt(1 - ops.power(self.beta_2, step))
                     / (1 - ops.power(self.beta_1, step)))
            m = self._momentums[index]
            self.assign_add(m, (ops.cast(gradient, variable.dtype) - m) * (1 - self.beta_1))
            self.assign_sub(variable, m * alpha / (ops.sqrt(second[index]) + self.epsilon))

    class FirstMomentAdam(keras.optimizers.Adam):
        def update_step(self, gradient, variable, learning_rate):
            step = ops.cast(self.iterations + 1, variable.dtype)
            m = self._momentums[self._get_variable_index(variable)]
            self.assign_add(m, (ops.cast(gradient, variable.dtype) - m) * (1 - self.beta_1))
            self.assign_sub(variable, m * ops.cast(learning_rate, variable.dtype)
                            / (1 - ops.power(self.beta_1, step)))

    schedule = learning_rate(keras, peak, STEPS)
    inner = {"densev": DenseSecondMomentAdam, "precond": FirstMomentAdam}.get(
        mode, keras.optimizers.Adam)(schedule)
    optimizer = inner if mode == "dense" else sparse_hvd.SparseDistributedOptimizer(
        inner, density=density, exchange="allgather", budget=os.environ.get("BUDGET", "model"))
    optimizer.build(variables)
    assert [inner._get_variable_index(v) for v in variables] == list(range(len(variables)))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=False)
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]
        if mode in ("densev", "precond"):
            count.assign_add(1.0)
            for g, v in zip(grads, second):
                v.assign(BETA_2 * v + (1 - BETA_2) * tf.square(g))
        if mode == "precond":
            grads = [g / (tf.sqrt(v / (1 - tf.pow(BETA_2, count))) + 1e-7)
                     for g, v in zip(grads, second)]
        if not ENERGY:
            optimizer.apply_gradients(zip(grads, variables))
            return loss, tf.constant(0.0)
        residuals = optimizer._feedback.residuals
        compensated = tf.add_n([tf.reduce_sum(tf.square(g + r)) for g, r in zip(grads, residuals)])
        with tf.control_dependencies([compensated]):
            optimizer.apply_gradients(zip(grads, variables))
        kept = tf.add_n([tf.reduce_sum(tf.square(tf.convert_to_tensor(r))) for r in residuals])
        return loss, 1.0 - kept / compensated

    @tf.function(jit_compile=False)
    def validation_loss(x, y):
        return loss_fn(y, model(x, training=False))

    rng = np.random.default_rng(seed * 1000)  # steps_worker.py's rank 0 batches
    x_val, y_val = tf.constant(data.x_val), tf.constant(data.y_val.astype("int32"))
    curve, started = [], time.time()
    for step in range(1, STEPS + 1):
        x, y = data.sample(rng, BATCH)
        _, sent_energy = train_step(tf.constant(x), tf.constant(y.astype("int32")))
        if step % EVAL_EVERY == 0:
            curve.append((step, round(float(validation_loss(x_val, y_val)), 4)))
            energy = f" sent energy {float(sent_energy):.3f}" if ENERGY else ""
            print(mode, workload, peak, seed, density, curve[-1], round(time.time() - started),
                  energy, flush=True)
    print("FINAL", json.dumps({"mode": mode, "workload": workload, "lr": peak, "seed": seed,
                               "density": density, "budget": os.environ.get("BUDGET", "model"),
                               "curve": curve}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
