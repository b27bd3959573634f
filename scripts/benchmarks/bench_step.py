"""The cost of one training step, every exchange method side by side in one job.

Why: sparse_hvd only helps if its step is cheap. This benchmark times one training step of a
Keras model for each method, interleaved round by round in ONE job (so the load of a shared
machine falls on all methods alike), and says where a sparse step's extra time goes.

Methods (``--methods``, comma-separated):

* ``floor``: gradients applied locally, nothing exchanged: the compute-only floor;
* ``dense``: Horovod's ``grouped_allreduce(op=Average)`` of every gradient (the plain
  data-parallel baseline); ``dense_fp16``: the same with Horovod's fp16 compression;
* ``<sparsifier>@<density>``: ``SparseDistributedOptimizer`` with that sparsifier (``topk``,
  ``approx_topk``, ``randomk``) at that density; ``threshold@<d>``: a hard threshold whose
  lambda gives about density d (calibrated on the job's own top-k residuals in the warm-up);
  ``threshold_capped@<d>``: a threshold so low that every entry passes and the cap
  (``max_density=d``) decides; ``adaptive@<d>``: LAGS with ``grouping="layerwise"``;
  ``sar_<sparsifier>@<d>``: the same with ``exchange="sparse_allreduce"`` (coded blocks);
  ``psar_<sparsifier>@<d>``: with ``exchange="plain_sparse_allreduce"`` (int32 indices, raw
  values);
  ``compact_<sparsifier>@<d>``: with ``exchange="compact_allgather"`` (coded indices);
  ``topksign_<sparsifier>@<d>``: with ``exchange="topk_sign"`` (the top entries and the
  signs of the rest); ``topksignpairs_<sparsifier>@<d>``: with
  ``exchange="topk_sign_pairs"`` (one sign for each pair of the rest);
  ``sign@<d>``: ``exchange="sign"`` (every entry's sign and a scale per 64 entries; ``d`` is
  not used; with ``--inner adam`` and the update cut, the default second moment, the noise
  estimate); ``sign_own@<d>``: the same with ``second_moment="own"``;
  ``sign_per_variable@<d>``: ``exchange="sign_per_variable"`` (one scale per variable);
  ``<sparsifier>_model@<d>``: with one budget for the whole model (``budget="model"``, the
  default of the grouped exchanges); ``<...>_update@<d>`` (last): with ``sparsify="update"``
  (each worker's inner optimizer step is cut, ``feedback.local_update``);
  ``<...>_unscaled@<d>`` (after all others): with ``update_scale=1.0`` (every row else has
  the default, 1.5 under ``--inner momentum`` at 1% where the cut keeps top-k's entries).
  Every sparse row has ``budget="layer"`` unless it says ``_model``, and no warm-up
  (``warmup_steps=0``): the step of the steady state is timed;
* ``auto@<d>``: the default exchange (``exchange="auto"``: the candidates timed on the job's
  first steps, ``steps.measured``) with the default model-wide budget and the default cut
  (``sparsify=None``: the update's under ``--inner momentum`` or Adam, so ``auto`` is compared
  with the ``..._model_update`` rows), no warm-up; its untimed first steps cover the first
  trial and the first re-check (``FIRST_RECHECK_STEPS`` after it, as in any job: the first
  trial's timings are the job's least reliable), and the row says what each chose; later
  re-checks are put off past the timed steps, so the row is the steady step
  (``--auto-settle first``: timed from the first decision on; ``--auto-recheck`` times the
  re-checks); its step is a
  ``sparse_hvd.function`` (traced for the exchange it runs); ``auto_cond@<d>``: the same in a
  plain ``tf.function`` (every candidate a branch of one conditional: a custom loop that does
  not use ``sparse_hvd.function``);
* ``wrapped_dense@<d>``: the wrapper with ``exchange="dense"`` (what the wrapper itself adds to
  Horovod's allreduce); ``wrapped_dense_unchecked@<d>``: the same with ``nonfinite="ignore"``
  (without the non-finite guard's pass over the averages).

For each method: the median step (median over ranks of each rank's median), x floor, x dense,
bytes this rank handed to the exchange per step, the bytes its collectives received from the
other ranks per step (the data alone, counted exactly by ``collective_bytes.py``; an allreduce
as a ring's 2 (N - 1) / N of its bytes), on the emulated cluster (``--rate``) the
bytes its link received and sent per step (interface counters: the wire, which adds MPI's and
TCP's framing and Horovod's coordination), and separately what the density policy sent
for its own measurements (AdaptiveDensity's probes, per step over the whole run, the probe at
build included), the optimizer's own spans per step
(``sparsify``: gradients -> selections; ``exchange``: selections -> averaged gradients, from
``communication_stats()``), and with ``--timeline`` what Horovod's timeline shows per step:
the number of collectives, their negotiation time (waiting until every rank has submitted) and
their transfer time (the collective itself). Printed as a table, written as JSON (with the
commit) and drawn as a stacked bar chart (floor | sparsify | exchange | rest).

    .venv/bin/python scripts/benchmarks/bench_step.py                          # MLP, 2 workers, loopback
    .venv/bin/python scripts/benchmarks/bench_step.py --model resnet50 --rounds 3 --steps 5
    .venv/bin/python scripts/benchmarks/bench_step.py --timeline --publish docs  # + breakdown, docs/ files
    .venv/bin/python scripts/benchmarks/bench_step.py --np 4 --rate 1gbit        # emulated cluster (root)

The MLP is the time-to-accuracy benchmark's (64-2048-2048-10, 4.35M parameters, digits, batch
64 per worker, SGD momentum 0.9); ResNet-50 is ``keras.applications.ResNet50(weights=None)``
(25.6M parameters, 161 variables) on random 32x32 images (timing only).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # scripts/: launching, emulated_cluster
import collective_bytes  # noqa: E402  (scripts/benchmarks/: the collectives' data, counted)
import launching  # noqa: E402  (scripts/launching.py: the launcher command lines)

DEFAULT_METHODS = ("floor,dense,dense_fp16,topk@0.01,approx_topk@0.01,threshold@0.01,"
                   "threshold_capped@0.01,randomk@0.01,topk@0.001,approx_topk@0.001,"
                   "threshold@0.001,randomk@0.001")
DENSE_METHODS = ("floor", "dense", "dense_fp16")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--np", type=int, default=2, help="workers (mpirun on this machine)")
    parser.add_argument("--rate", default=None,
                        help="run on the emulated cluster (scripts/emulated_cluster.py, needs root) "
                        "with every worker's link shaped to this rate, e.g. 1gbit; default: "
                        "loopback")
    parser.add_argument("--model", choices=("mlp", "resnet50"), default="mlp")
    parser.add_argument("--inner", choices=("momentum", "adam", "adamw"), default="momentum",
                        help="the inner optimizer: SGD(0.01, momentum=0.9), Adam(1e-3) or "
                        "AdamW(1e-3, weight_decay=0.1)")
    parser.add_argument("--methods", default=DEFAULT_METHODS)
    parser.add_argument("--batch-size", type=int, default=None, help="per worker (mlp 64, resnet50 8)")
    parser.add_argument("--image-size", type=int, default=32, help="resnet50 input size")
    parser.add_argument("--rounds", type=int, default=5, help="rounds over the methods")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per method and round")
    parser.add_argument("--warmup-steps", type=int, default=8, help="untimed first steps per method")
    parser.add_argument("--threads", type=int, default=0,
                        help="TensorFlow intra/inter-op threads per worker (0: TensorFlow's choice)")
    parser.add_argument("--timeline", action="store_true",
                        help="also run a short job with Horovod's timeline for the breakdown")
    parser.add_argument("--auto-recheck", type=int, default=None, metavar="STEPS",
                        help="auto's re-trial interval (measured.RECHECK_STEPS, 1000 in the "
                        "library, and the first one's, FIRST_RECHECK_STEPS, 100): a short one "
                        "shows the first trial's times next to later ones; without it no "
                        "re-trial falls in the timed steps")
    parser.add_argument("--auto-settle", choices=("recheck", "first"), default="recheck",
                        help="auto's timed steps follow its first re-check (recheck, default: "
                        "what a job runs after its first FIRST_RECHECK_STEPS steps) or its "
                        "first decision, made on the job's first steps (first)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", default=os.path.join(ROOT, "results", "bench_step"))
    parser.add_argument("--publish", default=None, metavar="DIR",
                        help="also write bench_step_<model>.{json,md,png} into DIR (e.g. docs)")
    args = parser.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.batch_size is None:
        args.batch_size = 64 if args.model == "mlp" else 8
    return args


# ---- the worker (every rank) ---------------------------------------------------------------------

def parse_method(method):
    """``"topk@0.01"`` -> ("topk", 0.01); ``"dense"`` -> ("dense", None)."""
    if "@" in method:
        name, density = method.split("@", 1)
        return name, float(density)
    return method, None


def link_bytes():
    """(received, sent) bytes so far on the emulated cluster's link of this worker, or None
    outside the emulated cluster (the interface counters of its network namespace)."""
    iface = os.environ.get("EMULATED_CLUSTER_IFACE")
    if not iface:
        return None
    with open("/proc/net/dev") as handle:
        for line in handle:
            name, _, fields = line.partition(":")
            if name.strip() == iface:
                fields = fields.split()
                return int(fields[0]), int(fields[8])
    return None


def worker(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import sparse_hvd
    import sparse_hvd.steps.measured as measured

    hvd = sparse_hvd.init()
    # the steady step: no re-trial among the timed steps unless asked for
    measured.RECHECK_STEPS = args.auto_recheck or max(measured.RECHECK_STEPS,
                                                      args.rounds * args.steps + 10)
    # auto's timed steps follow its first re-check, unless asked otherwise
    settle = args.auto_settle == "recheck" and not args.auto_recheck
    if not settle:
        measured.FIRST_RECHECK_STEPS = measured.RECHECK_STEPS
    import keras
    import numpy as np
    import tensorflow as tf

    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    rank, size = sparse_hvd.rank(), sparse_hvd.size()
    # the bytes the collectives carry in (the data alone; the wire columns add the transport)
    counted = (collective_bytes.CollectiveBytes(tf, rank, size).install(
        sparse_hvd.runtime.collectives) if size > 1 else None)
    x_all, y_all, make_model = task(args, rank, size)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(1000 + rank)

    def batches():
        while True:
            order = rng.permutation(int(x_all.shape[0]))
            for start in range(0, len(order) - args.batch_size + 1, args.batch_size):
                yield tf.constant(order[start:start + args.batch_size], tf.int32)

    stream = batches()
    thresholds = {}

    def gather(obj, name):
        return hvd.allgather_object(obj, name=name) if size > 1 else [obj]

    def build(method, label=None):
        name, density = parse_method(method)
        keras.utils.set_random_seed(0)  # the same weights on every rank and for every method
        model = make_model()
        variables = model.trainable_variables
        inner = {"adam": lambda: keras.optimizers.Adam(1e-3),
                 "adamw": lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.1),
                 "momentum": lambda: keras.optimizers.SGD(0.01, momentum=0.9)}[args.inner]()
        sparse, second_moment = None, None
        if name not in DENSE_METHODS:
            grouping, policy, sparsifier, exchange = "grouped", density, name, "allgather"
            budget, sparsify, update_scale = "layer", "gradient", None
            if name.endswith("_unscaled"):  # the sparse step at the rate (update_scale=1.0)
                update_scale, name = 1.0, name[:-len("_unscaled")]
                sparsifier = name
            if name.endswith("_update"):  # the inner optimizer's update is cut (sparsify)
                sparsify, name = "update", name[:-len("_update")]
                sparsifier = name
            if name.endswith("_model"):  # one budget for the whole model (the default's)
                budget, name = "model", name[:-len("_model")]
                sparsifier = name
            if name.startswith("sar_"):
                exchange, name = "sparse_allreduce", name[len("sar_"):]
                sparsifier = name
            if name.startswith("psar_"):
                exchange, name = "plain_sparse_allreduce", name[len("psar_"):]
                sparsifier = name
            if name.startswith("compact_"):
                exchange, name = "compact_allgather", name[len("compact_"):]
                sparsifier = name
            if name.startswith("topksign_"):  # the top-k entries and the rest's signs
                exchange, name = "topk_sign", name[len("topksign_"):]
                sparsifier = name
            if name.startswith("topksignpairs_"):  # the same, one sign per pair of entries
                exchange, name = "topk_sign_pairs", name[len("topksignpairs_"):]
                sparsifier = name
            if name.startswith("sign"):  # every entry's sign (the density is not used)
                exchange, sparsifier = "sign", "topk"
                if name == "sign_own":  # Adam's own second moment (not the noise estimate)
                    second_moment = "own"
                if name == "sign_per_variable":  # one float32 scale per variable
                    exchange = "sign_per_variable"
            if name in ("auto", "auto_cond"):  # the default: the fastest, one model budget,
                # the default cut (the update's under SGD with momentum or Adam)
                exchange, budget, sparsifier, sparsify = "auto", "model", "topk", None
            nonfinite = "skip"
            if name in ("wrapped_dense", "wrapped_dense_unchecked"):  # the wrapper's own cost
                exchange, sparsifier = "dense", "topk"
                nonfinite = "ignore" if name.endswith("_unchecked") else "skip"
            if name == "threshold":
                sparsifier = sparse_hvd.Threshold(threshold=thresholds[density], max_density=0.05)
            elif name == "threshold_capped":
                sparsifier = sparse_hvd.Threshold(threshold=1e-30, max_density=density)
            elif name == "adaptive":
                grouping, sparsifier = "layerwise", "topk"
                policy = sparse_hvd.AdaptiveDensity(density, min_density=density / 10,
                                                    max_density=min(1.0, density * 10))
            # the steady state: no warm-up (its first steps send up to 25% of each layer)
            sparse = sparse_hvd.SparseDistributedOptimizer(
                inner, density=policy, sparsifier=sparsifier, grouping=grouping, exchange=exchange,
                warmup_steps=0, budget=budget, nonfinite=nonfinite, sparsify=sparsify,
                second_moment=second_moment, update_scale=update_scale,
                name=label or f"bench_{method.replace('@', '_').replace('.', '_')}")
        optimizer = sparse if sparse is not None else inner
        optimizer.build(variables)
        allreduce = name in ("dense", "dense_fp16") and size > 1
        compression = None
        if allreduce:
            compression = hvd.Compression.fp16 if name == "dense_fp16" else hvd.Compression.none
            dense_bytes = sum(int(np.prod(v.shape)) for v in variables) * (
                2 if name == "dense_fp16" else 4)

        # Horovod's collectives cannot be XLA-compiled; sparse_hvd.function: auto's step is
        # traced for the exchange it runs (plain tf.function for the other methods)
        decorate = (tf.function(jit_compile=False) if name == "auto_cond"
                    else sparse_hvd.function(optimizer, jit_compile=False))

        @decorate
        def step(indices):
            x = tf.gather(x_all, indices)
            y = tf.gather(y_all, indices)
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, variables)
            if allreduce:
                grads = hvd.grouped_allreduce(grads, op=hvd.Average, compression=compression,
                                              name=f"bench.{name}")
                counted.add_ring(dense_bytes)
            optimizer.apply_gradients(zip(grads, variables))
            return loss

        return model, sparse, step

    def implied_threshold(sparse):
        """The cut top-k applied: the mean over sparse layers of the largest residual left."""
        stats = sparse.layer_stats()
        total = weighted = 0.0
        for residual, (path, layer) in zip(sparse.residuals, stats.items()):
            if layer["route"] == "sparse":
                weighted += layer["elements"] * float(tf.reduce_max(tf.abs(residual)))
                total += layer["elements"]
        return weighted / total

    runs = {}
    for method in args.methods:
        name, density = parse_method(method)
        if name == "threshold" and density not in thresholds:
            _, calibration, step = build(f"topk@{density}", label=f"calibrate_{len(thresholds)}")
            for _ in range(args.warmup_steps):
                float(step(next(stream)))
            mine = implied_threshold(calibration)
            everyone = gather(mine, f"bench.lambda.{density}")
            thresholds[density] = float(np.mean(everyone))
        model, sparse, step = build(method)
        untimed = args.warmup_steps
        if name in ("auto", "auto_cond"):  # the whole trial, its decision, a step of the choice
            untimed = max(untimed, 2 + measured.first_trial_length(len(sparse._step.plans)))
        for _ in range(untimed):
            float(step(next(stream)))
        if name in ("auto", "auto_cond") and settle:
            auto = sparse._step
            for _ in range(10 * measured.FIRST_RECHECK_STEPS):  # on to the first re-check
                if len(sparse.exchange_decisions) >= 2:  # after the same step on every rank
                    break
                # none due soon: dense lost the first trial beyond doubt and one candidate
                # is left (the same numbers on every rank)
                if int(auto.trial_start.numpy()) > (int(auto.steps.numpy())
                                                    + measured.FIRST_RECHECK_STEPS):
                    break
                float(step(next(stream)))
        runs[method] = {"model": model, "step": step, "sparse": sparse, "times": [], "stats": [],
                        "link": [], "collectives": []}
    for _ in range(args.rounds):
        for method, run in runs.items():
            before = run["sparse"].communication_stats() if run["sparse"] else None
            link_before = link_bytes()
            counted_before = counted.read() if counted else None
            for _ in range(args.steps):
                indices = next(stream)
                t0 = time.perf_counter()
                float(run["step"](indices))
                run["times"].append(time.perf_counter() - t0)
            if counted:
                run["collectives"].append((counted.read() - counted_before) / args.steps)
            if link_before is not None:
                link_after = link_bytes()
                run["link"].append([(a - b) / args.steps for a, b in zip(link_after, link_before)])
            if before is not None:
                after = run["sparse"].communication_stats()
                run["stats"].append({k: (after[k] - before[k]) / args.steps for k in
                                     ("bytes_sent", "dense_bytes", "sparsify_seconds",
                                      "exchange_seconds", "capped_selections")})
    mine = {}
    for method, run in runs.items():
        entry = {"median_step": float(np.median(run["times"]))}
        for key in ("bytes_sent", "dense_bytes", "sparsify_seconds", "exchange_seconds",
                    "capped_selections"):
            if run["stats"]:
                entry[key] = float(np.median([s[key] for s in run["stats"]]))
        if run["collectives"]:
            entry["collective_received_bytes"] = float(np.median(run["collectives"]))
        if run["link"]:
            entry["wire_received_bytes"] = float(np.median([r for r, _ in run["link"]]))
            entry["wire_sent_bytes"] = float(np.median([t for _, t in run["link"]]))
        if run["sparse"] and run["sparse"].exchange == "auto":
            entry["auto_decisions"] = run["sparse"].exchange_decisions
        if run["sparse"]:
            # the policy's probes (AdaptiveDensity), averaged over every step of this run,
            # build-time probe included
            totals = run["sparse"].communication_stats()
            entry["measurement_bytes"] = totals["measurement_bytes"] / max(totals["steps"], 1)
        mine[method] = entry
    replicas = {m: weights_digest(run["model"]) for m, run in runs.items()}
    everyone = gather((mine, replicas), "bench.results")
    if rank == 0:
        parameters = int(sum(np.prod(v.shape) for v in make_model().trainable_variables))
        result = {"model": args.model, "parameters": parameters, "workers": size,
                  "batch_size": args.batch_size, "rounds": args.rounds, "steps": args.steps,
                  "thresholds": thresholds, "methods": {}}
        for method in mine:
            per_rank = [theirs[0][method] for theirs in everyone]
            merged = {key: float(np.median([r[key] for r in per_rank])) for key in per_rank[0]
                      if key != "auto_decisions"}
            if "auto_decisions" in per_rank[0]:  # the same on every rank
                merged["auto_decisions"] = per_rank[0]["auto_decisions"]
            # the floor trains one replica per rank on its own data: nothing to compare
            merged["replicas_identical"] = (None if method == "floor" else
                                            len({theirs[1][method] for theirs in everyone}) == 1)
            result["methods"][method] = merged
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)


def weights_digest(model):
    """A hash of a model's trainable weights (equal on every rank iff the replicas agree).
    Non-trainable ones are left out: BatchNormalization's moving statistics follow each rank's
    own batches, with any exchange (``AverageNonTrainableCallback`` averages them)."""
    import hashlib

    h = hashlib.sha256()
    for weight in model.trainable_weights:
        h.update(weight.numpy().tobytes())
    return h.hexdigest()


def task(args, rank, size):
    """(x, y, make_model) of ``args.model`` for this rank."""
    import keras
    import numpy as np
    import tensorflow as tf

    if args.model == "mlp":
        from tta_worker import load_digits_shards

        (x, y), _ = load_digits_shards(0, rank, size)

        def make_model():
            return keras.Sequential([keras.Input((64,)), keras.layers.Dense(2048, activation="relu"),
                                     keras.layers.Dense(2048, activation="relu"), keras.layers.Dense(10)])

        return tf.constant(x), tf.constant(y), make_model
    rng = np.random.default_rng(rank)
    count = 16 * args.batch_size
    x = rng.standard_normal((count, args.image_size, args.image_size, 3)).astype("float32")
    y = rng.integers(0, 10, count)

    def make_model():
        return keras.applications.ResNet50(weights=None, input_shape=x.shape[1:], classes=10,
                                           classifier_activation=None)  # logits, as the loss expects

    return tf.constant(x), tf.constant(y), make_model


# ---- Horovod's timeline -------------------------------------------------------------------------

def timeline_breakdown(path, methods):
    """Per method, per step (median over steps): what Horovod's timeline on rank 0 shows.

    ``tensors``: tensors the method hands to Horovod per step (a grouped collective shows each
    of its tensors); ``negotiation_ms``: from the first tensor's submission to the moment the
    last one was known to be ready on every rank (the NEGOTIATE_* spans); ``transfer_ms``: from
    the first collective's start to the last one's end (ALLGATHER, ALLREDUCE, ..., fusion-buffer
    copies included). Both are wall-clock spans, so collectives that overlap count once.
    Names tell the methods apart: ``bench.<name>`` for the dense methods,
    ``sparse_hvd.bench_<method>.*`` for the sparse ones.
    """
    with open(path) as handle:
        text = handle.read().rstrip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in e.get("args", {})}
    spans = {}  # tensor name -> {"negotiate": [(start, end)], "op": [(start, end)]} in step order
    open_spans = {}
    for event in events:
        pid = event.get("pid")
        if pid not in names or event.get("ph") not in ("B", "E"):
            continue
        stack = open_spans.setdefault(pid, [])
        if event["ph"] == "B":
            stack.append((event["name"], event["ts"]))
        elif stack:
            kind, start = stack.pop()
            if not stack:  # top-level spans only
                key = "negotiate" if kind.startswith("NEGOTIATE") else "op"
                spans.setdefault(names[pid], {"negotiate": [], "op": []})[key].append((start, event["ts"]))
    result = {}
    for method in methods:
        name, _ = parse_method(method)
        if name in DENSE_METHODS:  # Horovod names a group's tensors <name>_<i>of<count>
            pattern = re.compile(re.escape(f"bench.{name}_") + r"\d+of\d+$")
        else:
            pattern = re.compile(re.escape(
                f"sparse_hvd.bench_{method.replace('@', '_').replace('.', '_')}."))
        mine = [s for n, s in spans.items() if pattern.match(n) and "probe" not in n
                and ".build_check" not in n and ".lags." not in n]
        if not mine:
            continue
        steps = min(len(s["op"]) for s in mine)
        negotiation, transfer = [], []
        for step in range(1, steps):  # the first one includes tracing
            negotiate = [s["negotiate"][step] for s in mine if step < len(s["negotiate"])]
            ops = [s["op"][step] for s in mine]
            if negotiate:
                negotiation.append((max(e for _, e in negotiate) - min(b for b, _ in negotiate)) / 1e3)
            transfer.append((max(e for _, e in ops) - min(b for b, _ in ops)) / 1e3)
        result[method] = {"tensors": len(mine),
                          "negotiation_ms": statistics.median(negotiation) if negotiation else 0.0,
                          "transfer_ms": statistics.median(transfer) if transfer else 0.0}
    return result


# ---- the driver ---------------------------------------------------------------------------------

def run_job(args, json_path, extra_env=None, rounds=None, steps=None):
    argv = [sys.executable, __file__, "--worker", "--json", json_path, "--model", args.model,
            "--inner", args.inner, "--methods", ",".join(args.methods),
            "--batch-size", str(args.batch_size),
            "--image-size", str(args.image_size), "--rounds", str(rounds or args.rounds),
            "--steps", str(steps or args.steps), "--warmup-steps", str(args.warmup_steps),
            "--threads", str(args.threads)]
    if args.auto_recheck:
        argv += ["--auto-recheck", str(args.auto_recheck)]
    argv += ["--auto-settle", args.auto_settle]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(extra_env or {}))
    launching.run_benchmark_job(args.np, argv, args.rate, args.timeout, env=env, cwd=ROOT,
                                export=list(extra_env or {}))
    with open(json_path) as handle:
        return json.load(handle)


def git_commit():
    """The checkout's commit, with "+changes" when the library differs from it."""
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "sparse_hvd"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return commit + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def table(result):
    methods = result["methods"]
    floor = methods.get("floor", {}).get("median_step")
    dense = methods.get("dense", {}).get("median_step")
    breakdown = result.get("timeline", {})
    lines = [f"{result['model']} ({result['parameters']:,} parameters), {result['workers']} workers "
             f"({result.get('link') or 'loopback'}), "
             f"batch {result['batch_size']} per worker, commit {result.get('commit')}, "
             f"load {result.get('load')}",
             "",
             "| method | step ms | x floor | x dense | payload kB/step | probes kB/step "
             "| collectives in kB/step | wire in/out kB/step | sparsify ms | exchange ms "
             "| tensors | negotiation ms | transfer ms | replicas identical |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
             "| ---: | --- |"]
    for method, m in methods.items():
        step = m["median_step"]
        t = breakdown.get(method, {})
        payload = m.get("bytes_sent")
        if payload is None and method in ("dense", "dense_fp16"):
            payload = result["parameters"] * (2 if method == "dense_fp16" else 4)
        lines.append("| " + " | ".join([
            method, f"{step * 1e3:.1f}",
            f"{step / floor:.2f}" if floor else "", f"{step / dense:.2f}" if dense else "",
            f"{payload / 1e3:,.0f}" if payload is not None else "",
            f"{m['measurement_bytes'] / 1e3:,.1f}" if "measurement_bytes" in m else "",
            (f"{m['collective_received_bytes'] / 1e3:,.1f}"
             if "collective_received_bytes" in m else ""),
            (f"{m['wire_received_bytes'] / 1e3:,.0f} / {m['wire_sent_bytes'] / 1e3:,.0f}"
             if "wire_received_bytes" in m else ""),
            f"{m['sparsify_seconds'] * 1e3:.1f}" if "sparsify_seconds" in m else "",
            f"{m['exchange_seconds'] * 1e3:.1f}" if "exchange_seconds" in m else "",
            str(t.get("tensors", "")),
            f"{t['negotiation_ms']:.1f}" if t else "", f"{t['transfer_ms']:.1f}" if t else "",
            str(m.get("replicas_identical", "")),
        ]) + " |")
    for method, m in methods.items():
        for step, times, choice in m.get("auto_decisions", []):
            lines.append(f"\n{method}: at step {step} chose {choice} (trial medians, ms a step: "
                         + ", ".join(f"{n} {t * 1e3:.1f}" for n, t in times.items()) + ")")
    return "\n".join(lines)


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = result["methods"]
    floor = methods.get("floor", {}).get("median_step", 0.0)
    labels, parts = list(methods), {"floor": [], "sparsify": [], "exchange": [], "rest": []}
    for method in labels:
        m = methods[method]
        sparsify = m.get("sparsify_seconds", 0.0)
        exchange = m.get("exchange_seconds", 0.0)
        if method in ("dense", "dense_fp16"):
            exchange = max(m["median_step"] - floor, 0.0)
        base = min(floor, m["median_step"])
        parts["floor"].append(base * 1e3)
        parts["sparsify"].append(sparsify * 1e3)
        parts["exchange"].append(exchange * 1e3)
        parts["rest"].append(max(m["median_step"] - base - sparsify - exchange, 0.0) * 1e3)
    figure, axis = plt.subplots(figsize=(max(6, 0.8 * len(labels)), 4))
    bottom = [0.0] * len(labels)
    for part, values in parts.items():
        axis.bar(labels, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    axis.set_ylabel("ms per step (median)")
    axis.set_title(f"{result['model']}, {result['workers']} workers: where a step's time goes")
    axis.legend()
    plt.setp(axis.get_xticklabels(), rotation=45, ha="right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    os.makedirs(args.out, exist_ok=True)
    load = os.getloadavg()
    started = time.time()
    result = run_job(args, os.path.join(args.out, f"step_{args.model}.json"))
    if args.timeline:
        timeline = os.path.join(args.out, f"timeline_{args.model}.json")
        if os.path.exists(timeline):
            os.remove(timeline)
        run_job(args, os.path.join(args.out, f"step_{args.model}_timeline.json"),
                extra_env={"HOROVOD_TIMELINE": timeline}, rounds=1, steps=min(args.steps, 10))
        result["timeline"] = timeline_breakdown(timeline, args.methods)
    result.update(link=f"emulated cluster, {args.rate} links" if args.rate else "loopback",
                  commit=git_commit(), load=f"{load[0]:.1f} (1-min average at start)",
                  seconds=round(time.time() - started, 1))
    text = table(result)
    print(text)
    targets = [args.out] + ([args.publish] if args.publish else [])
    for folder in targets:
        os.makedirs(folder, exist_ok=True)
        link = f"_{args.rate}" if args.rate else ""
        stem = os.path.join(folder, f"bench_step_{args.model}_np{result['workers']}{link}")
        with open(stem + ".json", "w") as handle:
            json.dump(result, handle, indent=1)
        with open(stem + ".md", "w") as handle:
            handle.write(text + "\n")
        plot(result, stem + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
