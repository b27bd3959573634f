"""One training run of the time-to-accuracy benchmark; every rank of an ``mpirun`` job runs this.

``scripts/benchmarks/bench_time_to_accuracy.py`` launches it once per (link, workers, method) across an
emulated cluster (``scripts/emulated_cluster.py``). It can also be run by hand::

    mpirun -np 2 --bind-to none .venv/bin/python scripts/benchmarks/tta_worker.py --method dense --json out.json

The task: scikit-learn's handwritten digits (8x8 pixels, 10 classes; 80% train split into equal
per-rank shards, 20% test) and a wide MLP, 64 -> 2048 -> 2048 -> 10 by default (4,349,962
parameters, 17.4 MB of float32 gradient per step: enough for the exchange to matter on a
1 Gbit/s link). Every method runs the same custom training loop (``tf.function``,
``jit_compile=False``), the same seeds, batches and number of steps, with SGD (momentum 0.9,
cosine learning-rate decay to 0 over the run):

* ``floor``: the compute-only floor: gradients are applied locally, nothing is exchanged (each
  worker trains its own replica; its accuracy is not comparable, its step time is the floor);
* ``dense``: Horovod's ``grouped_allreduce(op=Average)`` of every gradient, the plain
  data-parallel baseline (Horovod's Keras wrappers do not work with Keras 3, so the core op);
* ``dense_fp16``: the same with ``hvd.Compression.fp16`` (half the bytes);
* ``topk_0.01``, ``topk_0.001``, ``approx_topk_0.01``: ``sparse_hvd.SparseDistributedOptimizer``;
* ``threshold``: hard threshold ``sparse_hvd.Threshold(lambda, max_density)``; the launcher
  passes a lambda calibrated on the top-k 1% run (see its docstring);
* ``adaptive``: ``sparse_hvd.AdaptiveDensity`` (LAGS) with ``grouping="layerwise"``;
* ``default``: ``SparseDistributedOptimizer(inner, density=0.01)`` and nothing else: the
  library's defaults (``sparse_hvd.defaults``: the density warm-up, one budget for the whole
  model, ``exchange="auto"``; in the interleaved timing its untimed steps cover auto's first
  trial, and what it times is still the warm-up's density). The other sparse methods pass
  ``warmup_steps=0`` and their exchange: each is what its name says from the first step.

Timing: each step's wall time is taken around the call of the step function and the read of its
loss (which waits for the step to finish). Every ``--eval-every`` steps every rank evaluates the
test set (the same weights on every rank, so rank 0's accuracy is the job's); evaluation and
its bookkeeping happen outside the timed region. The first step (tracing and graph
optimisation) is reported apart and left out of the wall clock and of the median step time.

Bytes: ``payload`` is what a worker hands to Horovod per step (``communication_stats()`` for
sparse_hvd; 4 or 2 bytes per gradient entry for dense); ``wire`` is measured: the bytes the
worker's network interface transmitted during the timed steps (``/proc/net/dev`` of the
interface named by ``EMULATED_CLUSTER_IFACE``, which the emulated cluster sets; absent
otherwise), TCP/IP headers and Horovod's own coordination messages included.

Interleaved timing (``--timing METHODS``): instead of training, one job builds every listed
method and times them round-robin (a few steps of each in turn, after untimed warm-up steps),
so that load from other processes on a shared machine falls on all methods alike. The
benchmark uses these medians for the step-time ratios; the training runs' own step times are
reported too.

Rank 0 writes the JSON (``--json``).
"""

import argparse
import hashlib
import json
import os
import sys
import time

METHODS = ("floor", "dense", "dense_fp16", "topk_0.01", "topk_0.001", "approx_topk_0.01",
           "threshold", "adaptive", "topk_0.01_warmup", "topk_0.01_mc", "approx_topk_0.01_warmup_mc",
           "sar_topk_0.01", "sar_topk_0.001", "default")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", choices=METHODS, help="train with this method")
    parser.add_argument("--timing", default=None, metavar="METHODS",
                        help="instead of training: time these comma-separated methods "
                             "interleaved in one job (see 'Interleaved timing')")
    parser.add_argument("--rounds", type=int, default=6, help="timing: rounds over the methods")
    parser.add_argument("--steps-per-round", type=int, default=5, help="timing: steps per method and round")
    parser.add_argument("--warmup-steps", type=int, default=6, help="timing: untimed first steps per method")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.1, help="peak learning rate")
    parser.add_argument("--lr-schedule", choices=("cosine", "constant"), default="cosine",
                        help="cosine: decays to 0 over --steps (a stable final accuracy)")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--hidden", type=int, default=2048, help="width of the hidden layers")
    parser.add_argument("--depth", type=int, default=2, help="number of hidden layers")
    parser.add_argument("--eval-every", type=int, default=10, help="steps between evaluations")
    parser.add_argument("--test-fraction", type=float, default=0.2,
                        help="share of the 1,797 digits held out for testing (stratified)")
    parser.add_argument("--threshold", type=float, default=None, help="lambda of 'threshold'")
    parser.add_argument("--max-density", type=float, default=0.05, help="cap of 'threshold'")
    parser.add_argument("--min-elements", type=int, default=1024,
                        help="sparse_hvd's min_elements: smaller variables are averaged densely "
                             "(1024, the library's default)")
    parser.add_argument("--dense-fallback", action="store_true",
                        help="sparse methods: dense_fallback=True (each layer whose dense allreduce "
                             "is faster on this job goes dense, decided when the optimizer is built)")
    parser.add_argument("--threads", type=int, default=1,
                        help="TensorFlow intra-/inter-op threads per worker (0: TF's default)")
    parser.add_argument("--json", required=True, help="rank 0 writes the result here")
    args = parser.parse_args(argv)
    if (args.method is None) == (args.timing is None):
        parser.error("give exactly one of --method and --timing")
    if args.timing:
        args.timing = [m.strip() for m in args.timing.split(",") if m.strip()]
        unknown = [m for m in args.timing if m not in METHODS]
        if unknown:
            parser.error(f"--timing: unknown {', '.join(unknown)}")
    return args


def interface_tx_bytes():
    """Bytes transmitted so far by the emulated link's interface, or None outside a cluster."""
    iface = os.environ.get("EMULATED_CLUSTER_IFACE")
    if not iface:
        return None
    with open("/proc/net/dev") as f:  # per network namespace
        for line in f:
            name, _, fields = line.partition(":")
            if name.strip() == iface:
                return int(fields.split()[8])
    return None


def load_digits_shards(seed, rank, size, test_fraction=0.2):
    """(x_shard, y_shard), (x_test, y_test): equal-length per-rank shards of the training split."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        (digits.data / 16.0).astype("float32"), digits.target.astype("int32"),
        test_size=test_fraction, random_state=seed, stratify=digits.target,
    )
    per_rank = len(x_train) // size
    x_shard = x_train[rank::size][:per_rank]
    y_shard = y_train[rank::size][:per_rank]
    return (np.ascontiguousarray(x_shard), np.ascontiguousarray(y_shard)), (x_test, y_test)


def main(argv=None):
    args = parse_args(argv)
    started = time.perf_counter()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import sparse_hvd

    hvd = sparse_hvd.init()
    import keras
    import numpy as np
    import tensorflow as tf

    if args.threads:  # several workers share this machine's cores
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    rank, size = sparse_hvd.rank(), sparse_hvd.size()
    if size > 1 and hvd is None:
        raise SystemExit("launched on several ranks but Horovod is not installed")

    (x_shard, y_shard), (x_test, y_test) = load_digits_shards(args.seed, rank, size, args.test_fraction)
    x_all = tf.constant(x_shard)
    y_all = tf.constant(y_shard)

    def build(method):
        """(model, variables, optimizer, sparse optimizer or None, traced step) of ``method``."""
        # The same initial weights on every rank and for every method, from the same seed: no
        # broadcast is needed, so no method pays for one and the floor stays communication-free.
        keras.utils.set_random_seed(args.seed)
        layers = [keras.Input(shape=(64,))]
        layers += [keras.layers.Dense(args.hidden, activation="relu") for _ in range(args.depth)]
        layers += [keras.layers.Dense(10)]
        model = keras.Sequential(layers)
        variables = model.trainable_variables
        lr = args.lr
        if args.lr_schedule == "cosine":
            lr = keras.optimizers.schedules.CosineDecay(args.lr, decay_steps=args.steps)
        # momentum correction (DGC) applies the momentum in the wrapper: the inner SGD has none
        corrected = method.endswith("_mc")
        inner = keras.optimizers.SGD(lr, momentum=0.0 if corrected else args.momentum)
        sparse = None
        def warmup():
            return sparse_hvd.WarmupDensity(0.01, initial_density=0.25,
                                            warmup_steps=max(1, args.steps // 5))

        if method not in ("floor", "dense", "dense_fp16"):
            if method == "threshold" and args.threshold is None:
                raise SystemExit("method threshold needs --threshold LAMBDA")
            # name -> (density, sparsifier, grouping). The threshold's density=0.01 only decides
            # which variables are routed sparsely (the same ones as top-k 1%).
            settings = {
                "topk_0.01": (0.01, "topk", "grouped"),
                "topk_0.001": (0.001, "topk", "grouped"),
                "approx_topk_0.01": (0.01, "approx_topk", "grouped"),
                "threshold": (0.01, lambda: sparse_hvd.Threshold(threshold=args.threshold,
                                                                 max_density=args.max_density),
                              "grouped"),
                "adaptive": (lambda: sparse_hvd.AdaptiveDensity(0.01, min_density=0.001,
                                                                max_density=0.1, refresh_steps=50,
                                                                first_refresh=5),
                             "topk", "layerwise"),
                # DGC's warm-up: 25% decaying exponentially to 1% over the first fifth of the run
                "topk_0.01_warmup": (warmup, "topk", "grouped"),
                "topk_0.01_mc": (0.01, "topk", "grouped"),
                "approx_topk_0.01_warmup_mc": (warmup, "approx_topk", "grouped"),
                # exchange="sparse_allreduce"
                "sar_topk_0.01": (0.01, "topk", "grouped"),
                "sar_topk_0.001": (0.001, "topk", "grouped"),
                "default": (0.01, "topk", "grouped"),
            }
            density, sparsifier, grouping = settings[method]
            if method == "default":  # the one-line change and nothing else
                sparse = sparse_hvd.SparseDistributedOptimizer(inner, density=0.01,
                                                               name="sparse_default")
            else:
                sparse = sparse_hvd.SparseDistributedOptimizer(
                    inner,
                    density=density() if callable(density) else density,
                    sparsifier=sparsifier() if callable(sparsifier) else sparsifier,
                    grouping=grouping,
                    min_elements=args.min_elements,
                    momentum_correction=args.momentum if corrected else 0.0,
                    exchange="sparse_allreduce" if method.startswith("sar_") else "allgather",
                    name=f"sparse_{method.replace('.', '_')}",
                    warmup_steps=0,
                    **({"dense_fallback": True} if args.dense_fallback else {}),
                )
        optimizer = sparse if sparse is not None else inner
        optimizer.build(variables)
        compression = None
        if hvd is not None:
            compression = hvd.Compression.fp16 if method == "dense_fp16" else hvd.Compression.none
        allreduce = method in ("dense", "dense_fp16") and size > 1

        # Horovod's collectives cannot be XLA-compiled; sparse_hvd.function: auto's step is
        # traced for the exchange it runs (plain tf.function for the other methods)
        @sparse_hvd.function(optimizer, jit_compile=False)
        def train_step(indices):
            x = tf.gather(x_all, indices)
            y = tf.gather(y_all, indices)
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, variables)
            if allreduce:
                grads = hvd.grouped_allreduce(grads, op=hvd.Average, compression=compression,
                                              name=f"tta.{method}")
            optimizer.apply_gradients(zip(grads, variables))
            return loss

        return model, variables, optimizer, sparse, train_step

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(args.seed * 1000 + rank)  # each rank's own batch order
    per_rank = len(x_shard)

    def batches():
        while True:
            order = rng.permutation(per_rank)
            for start in range(0, per_rank - args.batch_size + 1, args.batch_size):
                yield tf.constant(order[start:start + args.batch_size], tf.int32)

    stream = batches()
    if args.timing:
        return interleaved_timing(args, build, stream, hvd, rank, size, started)

    model, variables, optimizer, sparse, train_step = build(args.method)
    parameters = int(sum(np.prod(v.shape) for v in variables))

    @tf.function(jit_compile=False)
    def predict(x):
        return tf.argmax(model(x, training=False), axis=1, output_type=tf.int32)

    x_test_t, y_test_np = tf.constant(x_test), np.asarray(y_test)

    def accuracy():
        return float(np.mean(predict(x_test_t).numpy() == y_test_np))

    # Residual magnitudes after a top-k step: the cut-off top-k effectively used (for the
    # threshold calibration), sampled at evaluation points only (outside the timed region).
    sparse_paths = []
    if sparse is not None:
        sparse_paths = [(p, s["elements"]) for p, s in sparse.layer_stats().items() if s["route"] == "sparse"]
    implied = []

    def implied_threshold():
        if sparse is None or args.method not in ("topk_0.01",):
            return None
        total = weighted = 0.0
        residual_by_path = dict(zip(sparse.layer_stats(), sparse.residuals))
        for path, elements in sparse_paths:
            weighted += elements * float(tf.reduce_max(tf.abs(residual_by_path[path])))
            total += elements
        return weighted / total if total else None

    curve = [{"step": 0, "wall": 0.0, "accuracy": accuracy()}]
    step_times = []
    first_step_seconds = None
    wall = 0.0
    tx_start = None
    sent_entries = 0
    for step in range(1, args.steps + 1):
        indices = next(stream)
        t0 = time.perf_counter()
        loss = float(train_step(indices))
        elapsed = time.perf_counter() - t0
        if step == 1:
            first_step_seconds = elapsed
            tx_start = interface_tx_bytes()
        else:
            step_times.append(elapsed)
            wall += elapsed
        if not np.isfinite(loss):
            raise SystemExit(f"rank {rank}: loss is {loss} at step {step}")
        if sparse is not None and step > 1:
            sent_entries += sum(s["last_sent"] for p, s in sparse.layer_stats().items()
                                if s["route"] == "sparse")
        if step % args.eval_every == 0 or step == args.steps:
            curve.append({"step": step, "wall": wall, "accuracy": accuracy(), "loss": loss})
            cut = implied_threshold()
            if cut is not None:
                implied.append(cut)
    tx_end = interface_tx_bytes()
    timed_steps = args.steps - 1

    mine = {
        "rank": rank,
        "median_step_seconds": float(np.median(step_times)) if step_times else None,
        "wall_seconds": wall,
        "first_step_seconds": first_step_seconds,
        "wire_tx_bytes_per_step": (
            (tx_end - tx_start) / timed_steps if tx_start is not None and tx_end is not None else None
        ),
        "stats": sparse.communication_stats() if sparse is not None else None,
        "sparse_density": (
            sent_entries / (sum(e for _, e in sparse_paths) * timed_steps)
            if sparse is not None and sparse_paths and timed_steps else None
        ),
        "step_times": step_times,
    }
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(v.numpy()).tobytes() for v in variables))
    mine["digest"] = digest.hexdigest()
    everyone = hvd.allgather_object(mine, name="tta.results") if size > 1 else [mine]

    if rank == 0:
        payload_dense = 4 * parameters
        if args.method == "floor":
            payload = 0.0
        elif args.method == "dense":
            payload = float(payload_dense)
        elif args.method == "dense_fp16":
            payload = float(2 * parameters)
        else:
            payload = float(np.mean([r["stats"]["bytes_sent"] / max(r["stats"]["steps"], 1)
                                     for r in everyone]))
        wires = [r["wire_tx_bytes_per_step"] for r in everyone]
        result = {
            "method": args.method,
            "workers": size,
            "steps": args.steps,
            "seed": args.seed,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "lr_schedule": args.lr_schedule,
            "momentum": args.momentum,
            "hidden": args.hidden,
            "depth": args.depth,
            "eval_every": args.eval_every,
            "test_fraction": args.test_fraction,
            "test_examples": int(len(y_test)),
            "threads": args.threads,
            "min_elements": args.min_elements,
            "dense_fallback": bool(args.dense_fallback) if sparse is not None else None,
            # the variables exchanged sparsely (the dense fallback may have moved some to dense)
            "sparse_route_variables": (
                [p for p, st in sparse.layer_stats().items() if st["route"] == "sparse"]
                if sparse is not None else None
            ),
            # exchange="auto": (step, trial medians in seconds, choice) per trial
            "exchange_decisions": sparse.exchange_decisions if sparse is not None else None,
            "threshold": args.threshold if args.method == "threshold" else None,
            "max_density": args.max_density if args.method == "threshold" else None,
            "parameters": parameters,
            "train_examples_per_rank": per_rank,
            "dense_payload_bytes": payload_dense,
            "payload_bytes_per_step": payload,
            # A ring allreduce puts 2(N-1)/N of the payload on each worker's link; a ring
            # allgather puts (N-1) times the worker's own payload on it (models, not measured).
            "model_wire_bytes_per_step": (
                0.0 if args.method == "floor" else
                payload * 2 * (size - 1) / size if args.method.startswith("dense") else
                payload * (size - 1)
            ),
            "wire_bytes_per_step": (
                float(np.mean(wires)) if all(w is not None for w in wires) else None
            ),
            "median_step_seconds": float(np.median([r["median_step_seconds"] for r in everyone])),
            "rank0_median_step_seconds": mine["median_step_seconds"],
            "wall_seconds": wall,
            "first_step_seconds": first_step_seconds,
            "final_accuracy": curve[-1]["accuracy"],
            "curve": curve,
            "sparse_density": (
                float(np.mean([r["sparse_density"] for r in everyone]))
                if everyone[0]["sparse_density"] is not None else None
            ),
            "implied_threshold": float(np.mean(implied)) if implied else None,
            "capped_selections": (everyone[0]["stats"] or {}).get("capped_selections"),
            # sparse_hvd's own spans per step (rank 0): gradients -> selections -> averages.
            "sparsify_seconds_per_step": (
                mine["stats"]["sparsify_seconds"] / max(mine["stats"]["steps"], 1)
                if mine["stats"] else None
            ),
            "exchange_seconds_per_step": (
                mine["stats"]["exchange_seconds"] / max(mine["stats"]["steps"], 1)
                if mine["stats"] else None
            ),
            "replicas_identical": len({r["digest"] for r in everyone}) == 1,
            "per_rank": [{k: v for k, v in r.items() if k != "step_times"} for r in everyone],
            "step_times_rank0": step_times,
            "layer_stats": sparse.layer_stats() if sparse is not None else None,
            "seconds": time.perf_counter() - started,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print(f"[tta_worker] {args.method} x{size}: final accuracy {result['final_accuracy']:.4f}, "
              f"median step {result['median_step_seconds'] * 1e3:.1f} ms, payload "
              f"{payload:,.0f} B/step, wire {result['wire_bytes_per_step'] or 0:,.0f} B/step",
              flush=True)
    return 0


def interleaved_timing(args, build, stream, hvd, rank, size, started):
    """Time every method of ``args.timing`` in one job, round-robin, and write the JSON.

    Each method gets its own model (the same initial weights) and optimizer, and
    ``--warmup-steps`` untimed steps (tracing, graph optimisation, the adaptive policy's first
    decision). Then ``--rounds`` rounds run ``--steps-per-round`` timed steps of each method in
    turn, so load that other processes put on the machine falls on all methods alike.
    """
    import numpy as np

    runs = {}
    from sparse_hvd.steps import measured

    for method in args.timing:
        *_, sparse, step = build(method)
        untimed = args.warmup_steps
        if sparse is not None and len(getattr(sparse._step, "plans", [])) > 1:
            untimed = max(untimed, 2 + measured.first_trial_length(len(sparse._step.plans)))  # auto
        for _ in range(untimed):
            float(step(next(stream)))
        runs[method] = (step, [])
    for _ in range(args.rounds):
        for method, (step, times) in runs.items():
            for _ in range(args.steps_per_round):
                indices = next(stream)
                t0 = time.perf_counter()
                float(step(indices))
                times.append(time.perf_counter() - t0)
    mine = {m: float(np.median(times)) for m, (_, times) in runs.items()}
    everyone = hvd.allgather_object(mine, name="tta.timing") if size > 1 else [mine]
    if rank == 0:
        result = {
            "timing": "interleaved",
            "workers": size,
            "rounds": args.rounds,
            "steps_per_round": args.steps_per_round,
            "warmup_steps": args.warmup_steps,
            "threshold": args.threshold,
            # median over ranks of each rank's median step time
            "median_step_seconds": {m: float(np.median([r[m] for r in everyone])) for m in mine},
            "per_rank_median_step_seconds": everyone,
            "seconds": time.perf_counter() - started,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print("[tta_worker] interleaved timing: " + ", ".join(
            f"{m} {t * 1e3:.1f} ms" for m, t in result["median_step_seconds"].items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
