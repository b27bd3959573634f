"""One training run of the convergence benchmark; every rank of an ``mpirun`` job runs this.

``scripts/benchmarks/bench_convergence.py`` launches it once per (method, seed), for example::

    mpirun -np 2 --bind-to none --oversubscribe .venv/bin/python scripts/benchmarks/convergence_worker.py \\
        --task mlp --method topk_0.01 --seed 0 --epochs 30 --json results/convergence/runs/x.json

Tasks:

* ``mlp``: the MLP of ``examples/train_digits.py`` (imported from there, with its data split and
  per-rank sharding) trained with ``model.fit``; at the end of every epoch rank 0 evaluates the
  held-out test set (the same weights are on every rank).
* ``logreg``: multinomial logistic regression (one ``Dense(10)`` softmax layer, L2 on the
  kernel) on the same shards, the convex case; at the end of every epoch rank 0 evaluates the
  training objective on the whole training set (not only its shard).

The methods are the tables :data:`METHODS` and :data:`CONVEX_METHODS` below: adding a
configuration is adding one entry (a description and a factory that wraps the inner optimizer).
This module imports nothing heavy at import time, so the launcher can read the tables cheaply.

Rank 0 writes a JSON with the per-epoch curves, the final test accuracy/loss, this job's
communication statistics (every rank's ``communication_stats()``), per-layer average densities,
and whether all replicas ended with bit-identical weights (SHA-256 of the weights, allgathered).
"""

import argparse
import json
import os
import sys
import time
from typing import Callable, NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Context(NamedTuple):
    """What a factory may need besides the inner optimizer."""

    steps_per_epoch: int
    threshold: float  # lambda of the hard-threshold method (None when not given)
    max_density: float  # payload cap of the hard-threshold method
    min_elements: int  # smaller variables are averaged densely (0 for the convex case)
    staleness: int = 0  # steps an average is applied late (sparse_hvd's bounded staleness)


class Method(NamedTuple):
    description: str
    # factory(sparse_hvd module, inner Keras optimizer, Context) -> SparseDistributedOptimizer
    factory: Callable


def _topk(density, error_feedback=True):
    def factory(shd, inner, ctx):
        return shd.SparseDistributedOptimizer(
            inner, density=density, error_feedback=error_feedback, min_elements=ctx.min_elements,
            staleness=ctx.staleness,
        )

    return factory


def _dense(shd, inner, ctx):
    # density=1.0: no variable is worth sparsifying (k = n pairs are larger than the gradient),
    # so every gradient goes through Horovod's dense grouped_allreduce (op=Average).
    return shd.SparseDistributedOptimizer(inner, density=1.0, min_elements=ctx.min_elements,
                                          staleness=ctx.staleness)


def _threshold(shd, inner, ctx):
    if ctx.threshold is None:
        raise ValueError("the threshold method needs --threshold LAMBDA")
    # density=0.01 only decides which variables are routed sparsely (the same ones as top-k at
    # 1%); the threshold sparsifier ignores the policy's k.
    return shd.SparseDistributedOptimizer(
        inner,
        density=0.01,
        sparsifier=shd.Threshold(threshold=ctx.threshold, max_density=ctx.max_density),
        min_elements=ctx.min_elements,
    )


def _warmup(shd, inner, ctx):
    # Deep Gradient Compression's schedule: 25% decaying exponentially to 1% over 4 epochs.
    return shd.SparseDistributedOptimizer(
        inner,
        density=shd.WarmupDensity(0.01, initial_density=0.25, warmup_steps=4 * ctx.steps_per_epoch),
        min_elements=ctx.min_elements,
    )


def _adaptive(shd, inner, ctx):
    # LAGS-SGD: each layer's density between 0.1% and 10%, chosen from the measured allgather
    # cost and the backward time left after its gradient; the layer-wise exchange it needs.
    return shd.SparseDistributedOptimizer(
        inner,
        density=shd.AdaptiveDensity(0.01, min_density=0.001, max_density=0.1,
                                    refresh_steps=ctx.steps_per_epoch),
        grouping="layerwise",
        min_elements=ctx.min_elements,
    )


#: digits MLP: name -> Method. The first entry is the reference the others are compared with.
METHODS = {
    "dense": Method("dense averaging (density=1.0: Horovod allreduce, op=Average)", _dense),
    "topk_0.01": Method("top-k, density 0.01, error feedback", _topk(0.01)),
    "topk_0.001": Method("top-k, density 0.001, error feedback", _topk(0.001)),
    "threshold": Method("hard threshold lambda (~1% on average), error feedback", _threshold),
    "warmup": Method("top-k, warm-up density 0.25 -> 0.01 over 4 epochs, error feedback", _warmup),
    "adaptive": Method("top-k, layer-wise adaptive density (LAGS) in [0.001, 0.1], layer-wise exchange", _adaptive),
    "topk_0.01_noef": Method("top-k, density 0.01, NO error feedback", _topk(0.01, False)),
}

#: convex case (logistic regression): name -> Method; run with min_elements=0.
CONVEX_METHODS = {
    "dense": Method("dense averaging (density=1.0)", _dense),
    "topk_0.1": Method("top-k, density 0.1, error feedback", _topk(0.1)),
    "topk_0.1_noef": Method("top-k, density 0.1, NO error feedback", _topk(0.1, False)),
    "topk_0.01": Method("top-k, density 0.01, error feedback", _topk(0.01)),
    "topk_0.01_noef": Method("top-k, density 0.01, NO error feedback", _topk(0.01, False)),
}

CONVEX_L2 = 1e-4  # kernel regularizer of the convex case: objective = mean CE + L2 * ||W||^2


def convex_optimum(x, y, l2=CONVEX_L2, classes=10):
    """min over (W, b) of mean cross-entropy(softmax(xW + b), y) + l2 * ||W||^2, in float64.

    The exact objective the convex runs minimise (Keras' L2 regulariser adds l2 * sum(W^2)),
    solved to high precision with L-BFGS, so each run's final suboptimality f - f* is known.
    """
    import numpy as np
    from scipy.optimize import minimize

    x = np.asarray(x, np.float64)
    n, p = x.shape
    onehot = np.eye(classes)[y]

    def objective(theta):
        w, b = theta[: p * classes].reshape(p, classes), theta[p * classes:]
        z = x @ w + b
        z -= z.max(axis=1, keepdims=True)
        log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        value = -log_p[np.arange(n), y].mean() + l2 * (w ** 2).sum()
        residual = (np.exp(log_p) - onehot) / n
        grad = np.concatenate([(x.T @ residual + 2 * l2 * w).ravel(), residual.sum(axis=0)])
        return value, grad

    solution = minimize(
        objective, np.zeros(p * classes + classes), jac=True, method="L-BFGS-B",
        options={"maxiter": 10000, "gtol": 1e-10, "ftol": 1e-15},
    )
    return float(solution.fun)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=("mlp", "logreg"), default="mlp")
    parser.add_argument("--method", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--threshold", type=float, default=None, help="lambda of 'threshold'")
    parser.add_argument("--max-density", type=float, default=0.25, help="cap of 'threshold'")
    parser.add_argument("--threads", type=int, default=1,
                        help="TensorFlow intra-op threads per worker (0: TF's default)")
    parser.add_argument("--staleness", type=int, default=0,
                        help="apply each average this many steps late (dense and top-k methods)")
    parser.add_argument("--json", metavar="PATH", required=True, help="rank 0 writes here")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    table = METHODS if args.task == "mlp" else CONVEX_METHODS
    if args.method not in table:
        raise SystemExit(f"unknown method {args.method!r} for task {args.task}: {', '.join(table)}")
    started = time.perf_counter()

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_digits  # the example's model, data split and replica check (it starts Horovod)

    import sparse_hvd
    import sparse_hvd.selection.defaults

    # what the sparse exchange does step for step: exchange="auto" (the default) would pick by
    # this machine's speed, and may pick dense
    sparse_hvd.selection.defaults.EXCHANGE = "allgather"

    sparse_hvd.init()
    import keras
    import numpy as np
    import tensorflow as tf

    if args.threads:  # 2 workers share 2 cores here: one compute thread each avoids thrashing
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)

    rank, size = sparse_hvd.rank(), sparse_hvd.size()
    (x_train, y_train), (x_test, y_test) = train_digits.load_data(args.seed, rank, size)
    (x_full, y_full), _ = train_digits.load_data(args.seed, 0, 1)  # whole training set
    steps_per_epoch = -(-len(x_train) // args.batch_size)

    keras.utils.set_random_seed(args.seed + rank)  # rank 0's initial weights are broadcast
    if args.task == "mlp":
        model = train_digits.build_model()
        min_elements = 1024  # the optimizer's default
    else:
        model = keras.Sequential(
            [
                keras.Input(shape=(64,)),
                keras.layers.Dense(
                    10, activation="softmax", kernel_regularizer=keras.regularizers.L2(CONVEX_L2)
                ),
            ]
        )
        min_elements = 0  # the 640-entry kernel would otherwise be averaged densely

    ctx = Context(steps_per_epoch, args.threshold, args.max_density, min_elements, args.staleness)
    inner = keras.optimizers.SGD(args.lr, momentum=args.momentum)
    optimizer = table[args.method].factory(sparse_hvd, inner, ctx)
    model.compile(
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        jit_compile=False,  # Horovod's collectives cannot be XLA-compiled
    )

    def evaluate(x, y):
        """(mean cross-entropy, accuracy, objective with the L2 term) of the current weights."""
        probabilities = model(x, training=False)
        ce = float(keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y, probabilities)))
        accuracy = float(np.mean(np.argmax(keras.ops.convert_to_numpy(probabilities), 1) == y))
        penalty = sum(float(keras.ops.convert_to_numpy(l)) for l in model.losses)
        return ce, accuracy, ce + penalty

    class Recorder(keras.callbacks.Callback):
        """Per-epoch curves (rank 0 evaluates) and per-layer sent entries (every step)."""

        def __init__(self):
            super().__init__()
            self.curve = []
            self.layer_sent = {}
            self.layer_info = {}
            self.implied = {}  # per layer: sum over steps of max|residual| (top-k: the cut-off)
            self._sparse = []
            self.step_times = []  # seconds from each batch's start to its end, this rank

        def on_train_begin(self, logs=None):  # after the broadcast callback built the optimizer
            for path, stat in optimizer.layer_stats().items():
                self.layer_info[path] = {"elements": stat["elements"], "route": stat["route"]}
                self.layer_sent[path] = 0
            if optimizer.error_feedback:
                self._sparse = [
                    (path, residual)
                    for (path, info), residual in zip(self.layer_info.items(), optimizer.residuals)
                    if info["route"] == "sparse"
                ]
                self.implied = {path: 0.0 for path, _ in self._sparse}
            self._epoch_implied = {path: 0.0 for path, _ in self._sparse}
            self._epoch_steps = 0
            self.train_started = self.batch_started = time.perf_counter()

        def on_train_batch_begin(self, batch, logs=None):
            self.batch_started = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.step_times.append(time.perf_counter() - self.batch_started)
            for path, stat in optimizer.layer_stats().items():
                self.layer_sent[path] += stat["last_sent"]
            # After a top-k step the largest unsent magnitude is the (k+1)-th largest entry of the
            # compensated gradient: the threshold top-k effectively used in that step.
            for path, residual in self._sparse:
                value = float(tf.reduce_max(tf.abs(residual)))
                self.implied[path] += value
                self._epoch_implied[path] += value
            self._epoch_steps += 1

        def on_epoch_end(self, epoch, logs=None):
            stats = optimizer.communication_stats()
            point = {
                "epoch": epoch + 1,
                "train_loss": float(logs.get("loss", float("nan"))),  # averaged over ranks
                "train_accuracy": float(logs.get("accuracy", float("nan"))),
                "steps": stats["steps"],
                "bytes_sent": stats["bytes_sent"],
                "capped_selections": stats["capped_selections"],
                "train_seconds": time.perf_counter() - self.train_started,
                "implied_threshold": {
                    path: total / max(self._epoch_steps, 1)
                    for path, total in self._epoch_implied.items()
                },
            }
            self._epoch_implied = {path: 0.0 for path in self._epoch_implied}
            self._epoch_steps = 0
            if rank == 0:
                point["test_loss"], point["test_accuracy"], _ = evaluate(x_test, y_test)
                if args.task == "logreg":
                    ce, acc, objective = evaluate(x_full, y_full)
                    point.update(full_train_ce=ce, full_train_accuracy=acc, objective=objective)
            self.curve.append(point)

    recorder = Recorder()
    history = model.fit(
        x_train,
        y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        callbacks=[
            sparse_hvd.BroadcastGlobalVariablesCallback(root_rank=0),  # first
            sparse_hvd.MetricAverageCallback(),
            recorder,
        ],
        verbose=0,
    )
    del history

    test_loss, test_accuracy, _ = evaluate(x_test, y_test)
    full_ce, full_accuracy, objective = evaluate(x_full, y_full)
    identical = train_digits.replicas_identical(model, size)
    mine = {
        "median_step_seconds": float(np.median(recorder.step_times[5:] or recorder.step_times)),
        "stats": optimizer.communication_stats(),
        "layer_sent": recorder.layer_sent,
        "implied_threshold": recorder.implied,
    }
    everyone = sparse_hvd.collectives.allgather_object(mine, name="bench_convergence.stats")

    if rank == 0:
        steps = mine["stats"]["steps"]
        sparse_elements = sum(
            i["elements"] for i in recorder.layer_info.values() if i["route"] == "sparse"
        )
        per_rank = []
        for theirs in everyone:
            s = theirs["stats"]
            sparse_sent = sum(
                theirs["layer_sent"][p] for p, i in recorder.layer_info.items() if i["route"] == "sparse"
            )
            per_rank.append(
                {
                    **s,
                    "bytes_per_step": s["bytes_sent"] / max(s["steps"], 1),
                    "dense_bytes_per_step": s["dense_bytes"] / max(s["steps"], 1),
                    # entries sent / entries of the sparsely routed variables, over all steps
                    # (1.0 when nothing is routed sparsely: every entry is averaged densely)
                    "sparse_density": (
                        sparse_sent / max(sparse_elements * s["steps"], 1) if sparse_elements else 1.0
                    ),
                    "layer_density": {
                        p: theirs["layer_sent"][p] / (i["elements"] * max(s["steps"], 1))
                        for p, i in recorder.layer_info.items()
                    },
                    "implied_threshold": {
                        p: t / max(s["steps"], 1) for p, t in theirs["implied_threshold"].items()
                    },
                }
            )
        result = {
            "task": args.task,
            "method": args.method,
            "description": table[args.method].description,
            "seed": args.seed,
            "size": size,
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "momentum": args.momentum,
            "threshold": args.threshold if args.method == "threshold" else None,
            "max_density": args.max_density if args.method == "threshold" else None,
            "min_elements": min_elements,
            "staleness": args.staleness,
            # the slowest rank's median step (first 5 steps, the tracing, left out)
            "median_step_seconds": max(theirs["median_step_seconds"] for theirs in everyone),
            "parameters": int(model.count_params()),
            "steps": steps,
            "layers": recorder.layer_info,
            "test_accuracy": test_accuracy,
            "test_loss": test_loss,
            "full_train_loss": full_ce,
            "full_train_accuracy": full_accuracy,
            "objective": objective,
            "objective_optimum": convex_optimum(x_full, y_full) if args.task == "logreg" else None,
            "bytes_per_step": sum(r["bytes_per_step"] for r in per_rank) / len(per_rank),
            "dense_bytes_per_step": per_rank[0]["dense_bytes_per_step"],
            "sparse_density": sum(r["sparse_density"] for r in per_rank) / len(per_rank),
            "per_rank": per_rank,
            "curve": recorder.curve,
            "replicas_identical": bool(identical),
            "seconds": time.perf_counter() - started,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print(
            f"[worker] {args.task} {args.method} seed {args.seed}: test accuracy "
            f"{test_accuracy:.4f}, objective {objective:.4f}, "
            f"{result['bytes_per_step']:.0f} B/step, replicas identical {identical}, "
            f"{result['seconds']:.1f} s",
            flush=True,
        )
    return 0 if identical else 3


if __name__ == "__main__":
    sys.exit(main())
