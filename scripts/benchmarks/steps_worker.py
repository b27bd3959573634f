"""One run of the steps-to-loss benchmark; every rank of an ``mpirun`` job runs this.

``scripts/benchmarks/bench_steps_to_loss.py`` launches it once per (workload, workers, method,
seed); by hand::

    mpirun -np 4 --oversubscribe --bind-to none .venv/bin/python \\
        scripts/benchmarks/steps_worker.py --workload cnn --method dense --options '{}' \\
        --steps 600 --json out.json

A method is the inner optimizer plus the keyword arguments of
``sparse_hvd.SparseDistributedOptimizer`` (``--options``, JSON; ``{"wrapper": null}`` trains
with a hand-written Horovod ``grouped_allreduce`` instead: the plain data-parallel baseline).
Every method runs the same custom loop (``tf.function``, ``jit_compile=False``), the same
initial weights (from ``--seed``, no broadcast needed), the same batches per rank and the same
learning-rate schedule (linear warm-up over the first 5% of the steps, then cosine decay to 0).
Every ``--eval-every`` steps rank 0 computes the validation loss and accuracy (the weights are
the same on every rank). Rank 0 writes the JSON: the curve, each rank's
``communication_stats()``, and whether the replicas ended bit-identical.
"""

import argparse
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", required=True)
    parser.add_argument("--label", default=None,
                        help="the workload's name written into the JSON (default: --workload)")
    parser.add_argument("--method", required=True, help="the name written into the JSON")
    parser.add_argument("--options", default="{}", help="JSON: inner optimizer and wrapper kwargs")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=16, help="per worker")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="TF threads per worker")
    parser.add_argument("--exchange", default="allgather",
                        help="the wrapper's default exchange: 'allgather' (what the sparse "
                             "exchange does step for step) or 'library' (the library's own "
                             "default, exchange='auto', as a user's run gets it)")
    parser.add_argument("--trace", choices=("per-exchange", "conditional"), default="per-exchange",
                        help="with exchange='auto', the train step: one function traced per exchange it "
                             "runs (sparse_hvd.function, the default) or one plain tf.function "
                             "holding every candidate as a branch of a conditional")
    parser.add_argument("--json", required=True)
    return parser.parse_args(argv)


FIRST_STEPS_KEPT = 600  # the JSON keeps rank 0's time of each of the first steps (a run
# reaches the target in its first half: where its time to the target goes, trials included)


class StepCounts:
    """Rank 0's ``communication_stats()`` step by step, read after each step outside its
    timing: the bytes the step sent, and the span from its gradients to its averages in
    milliseconds (the selection and the exchange: under ``auto`` the split between the two
    is not kept, its selection span reads the exchange too), so that a slow step can be told
    apart from one that sent more. Empty lists for dense."""

    def __init__(self, sparse):
        self.sparse = sparse
        self.kept = {"bytes": [], "span_ms": []}
        self.last = self.read() if sparse is not None else None

    def read(self):
        """The counters alone (``communication_stats()`` less its ``update_factor``, whose
        eager schedule read took 1.2 of its 1.5 ms on an idle core and 3-6 ms a read with 4
        ranks on 2 cores: work after every step that the dense runs do not do)."""
        return self.sparse._counters.as_dict()

    def after_step(self):
        if self.sparse is None:
            return
        now = self.read()
        self.kept["bytes"].append(now["bytes_sent"] - self.last["bytes_sent"])
        span = sum(now[k] - self.last[k] for k in ("sparsify_seconds", "exchange_seconds"))
        self.kept["span_ms"].append(round(span * 1e3, 2))
        self.last = now


def force_decisions(measured, forced):
    """``exchange="auto"``'s decisions made as ``forced`` names them, in order (None: the
    rule's), the same on every rank; the ones after the list by the rule. ``["dense"]``: the
    switch a noisy first trial, or a fast link, makes inside the warm-up; dense for the
    warm-up's first trials and a sparse exchange from a late one: the path of a run on a fast
    link whose late trial read dense slow."""
    rule = measured.MeasuredChoiceStep._decide

    def _decide(self, hopeless, step, trying, current):
        following, choice, trying = rule(self, hopeless, step, trying, current)
        made = len(self.decisions) - 1
        if made < len(forced) and forced[made] is not None:
            choice = [plan.name for plan in self.plans].index(forced[made])
            self.decisions[-1] = self.decisions[-1][:2] + (forced[made],)
        return following, choice, trying

    measured.MeasuredChoiceStep._decide = _decide


def factor_follows_rate(sparse_hvd, peak, against=False):
    """A probe of a schedule for ``update_scale`` (run with a constant ``update_scale``): the
    library's factor on this step (its ramp included), its excess over 1 times the inner
    optimizer's rate over the schedule's ``peak``, so that it falls back to 1 as a cosine
    schedule's rate falls to 0; ``against``: times 2 - rate/peak instead, so that its excess
    doubles as the rate falls to 0 (what the library's pair does since, with the peak read
    as the largest rate so far)."""
    import tensorflow as tf

    from sparse_hvd.feedback import local_update
    from sparse_hvd.feedback.step_factor import StepFactor

    library = StepFactor.on_step

    def on_step(self, opt, cuts):
        scale = library(self, opt, cuts)
        if local_update._is_one(scale):
            return scale
        rate = tf.minimum(tf.cast(opt.inner_optimizer.learning_rate, tf.float32) / float(peak),
                          1.0)
        weight = 2.0 - rate if against else rate
        return 1.0 + (tf.cast(scale, tf.float32) - 1.0) * weight

    StepFactor.on_step = on_step


def flushed_losses(sparse, hvd, variables, validation):
    """The validation loss at the end of the run with the ranks' mean residual applied too
    (every rank takes part in one allreduce; rank 0 evaluates): at the factor 1 and at the
    factor the next cutting step would take. Error feedback's analyses bound the loss of the
    weights less the residuals' mean (the "virtual" iterate, Stich et al. 2018); what this
    returns says how much of the end's gap to dense is steps still held in the residuals. The
    weights are put back before the function returns. None under the gradient cut (its
    residuals hold gradients, not steps) or where ranks hold no residuals."""
    import numpy as np

    if sparse.sparsify != "update" or not sparse.residuals:
        return None
    means = hvd.grouped_allreduce([np.asarray(r.numpy()) for r in sparse.residuals],
                                  op=hvd.Average, name="steps.flush")
    factor = sparse._step_factor.next_factor(sparse)
    kept = [v.numpy() for v in variables]
    result = {"factor": factor, "residual_norm": float(np.sqrt(sum(
        float(np.sum(np.square(m.numpy()))) for m in means)))}
    for name, scale in (("at_1", 1.0), ("at_factor", factor)):
        for variable, value, mean in zip(variables, kept, means):
            variable.assign(value - scale * np.reshape(mean.numpy(), value.shape))
        result[name] = validation()[0] if hvd.rank() == 0 else None
    for variable, value in zip(variables, kept):
        variable.assign(value)
    return result


def learning_rate(keras, peak, steps):
    """Linear warm-up over the first 5% of the steps, then cosine decay to 0."""
    warmup = max(1, steps // 20)
    return keras.optimizers.schedules.CosineDecay(
        0.0, decay_steps=steps - warmup, warmup_target=peak, warmup_steps=warmup)


def inner_optimizer(keras, spec, steps):
    """The user's optimizer: ``{"name": "sgd"|"adam"|"adamw"|"rmsprop"|"adagrad"|"nadam"|"lion",
    "lr": ..., "momentum": ..., "nesterov": ..., "weight_decay": ...}``."""
    lr = learning_rate(keras, spec["lr"], steps)
    clipnorm = spec.get("clipnorm")
    if spec["name"] == "sgd":
        return keras.optimizers.SGD(lr, momentum=spec.get("momentum", 0.9),
                                    nesterov=spec.get("nesterov", False), clipnorm=clipnorm)
    if spec["name"] == "rmsprop":
        return keras.optimizers.RMSprop(lr, clipnorm=clipnorm)
    if spec["name"] == "adam":
        return keras.optimizers.Adam(lr, clipnorm=clipnorm)
    if spec["name"] == "adagrad":
        return keras.optimizers.Adagrad(lr, clipnorm=clipnorm)
    if spec["name"] == "nadam":
        return keras.optimizers.Nadam(lr, clipnorm=clipnorm)
    if spec["name"] == "lion":
        return keras.optimizers.Lion(lr, clipnorm=clipnorm)
    if spec["name"] == "adamw":
        return keras.optimizers.AdamW(lr, weight_decay=spec["weight_decay"], clipnorm=clipnorm)
    raise SystemExit(f"unknown inner optimizer {spec['name']!r}")


def signs_named(sparse_hvd, inner, wrapper):
    """The wrapper's options for a step-based run: where ``exchange=None`` sends every entry's
    sign (Adam at the default density), the sign exchange named, not the top-k exchange that
    ``--exchange`` makes the default (the run measures the exchange, not auto's choice)."""
    import inspect

    from sparse_hvd.selection import defaults
    from sparse_hvd.selection.sparsifiers import get_sparsifier

    if wrapper.get("exchange") is not None:
        return wrapper
    signature = inspect.signature(sparse_hvd.SparseDistributedOptimizer.__init__)
    given = {name: parameter.default for name, parameter in signature.parameters.items()
             if parameter.default is not parameter.empty}
    given.update(wrapper)
    sparsify = defaults.resolve_sparsify(given["sparsify"], inner)
    signs = defaults.one_bit_by_default(
        None, inner, sparsify, given["density"], get_sparsifier(given["sparsifier"]),
        given["budget"], given["grouping"], given["staleness"], given["dense_fallback"])
    return {**wrapper, "exchange": "sign"} if signs else wrapper


def main(argv=None):
    args = parse_args(argv)
    started = time.perf_counter()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import sparse_hvd
    import sparse_hvd.selection.defaults

    # what the sparse exchange does step for step: exchange="auto" (the default) would pick by
    # this machine's speed, and may pick dense; timed runs (--exchange library) keep it
    if args.exchange != "library":
        sparse_hvd.selection.defaults.EXCHANGE = args.exchange

    hvd = sparse_hvd.init()
    import keras
    import numpy as np
    import tensorflow as tf

    from workloads import WORKLOADS

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    rank, size = sparse_hvd.rank(), sparse_hvd.size()
    options = json.loads(args.options)
    import sparse_hvd.exchanges
    import sparse_hvd.feedback.step_factor
    import sparse_hvd.steps.measured

    if "dense_within" in options:  # auto's dense margin, read when the optimizer is built
        sparse_hvd.steps.measured.DENSE_WITHIN = options["dense_within"]
    if "noise_within" in options:  # the smallest margin a warm-up's trial asks
        sparse_hvd.steps.measured.NOISE_WITHIN = options["noise_within"]
    if options.get("first_decision") == "dense":
        force_decisions(sparse_hvd.steps.measured, ["dense"])
    if "decisions" in options:  # auto's decisions named, in order
        force_decisions(sparse_hvd.steps.measured, options["decisions"])
    if "early_recheck" in options:  # what the early re-check runs, whatever dense's loss
        ruled = options["early_recheck"]
        sparse_hvd.steps.measured.early_recheck = lambda decisive, sparse_candidates: ruled
    if "sign_dense_within" in options:  # the signs' own margin over dense (None: the library's)
        for name in ("sign", "sign_per_variable"):
            sparse_hvd.exchanges.exchange_class(name).dense_within = options["sign_dense_within"]
    if "hopeless_retimes" in options:  # dense's turns read as compute-bound before none runs
        sparse_hvd.steps.measured.HOPELESS_RETIMES = options["hopeless_retimes"]
    if "hold_within" in options:  # how much a re-check's incumbent counts faster
        sparse_hvd.steps.measured.HOLD_WITHIN = options["hold_within"]
    if "scale_grows_below" in options:  # where a pair's factor starts growing
        sparse_hvd.feedback.step_factor.GROWS_BELOW = options["scale_grows_below"]
    if "scale_ramp_share" in options:  # the factor reached over 1/this of the warm-up
        sparse_hvd.feedback.step_factor.RAMP_SHARE = options["scale_ramp_share"]
    if "after_dense_at_rate" in options:  # the factor's step 4 (False: the factor as before)
        sparse_hvd.feedback.step_factor.AFTER_DENSE_AT_RATE = options["after_dense_at_rate"]
    if options.get("scale_follows_rate"):
        factor_follows_rate(sparse_hvd, options["inner"]["lr"],
                            against=options["scale_follows_rate"] == "against")
    workload = WORKLOADS[args.workload]
    data = workload.load(rank, size)

    keras.utils.set_random_seed(args.seed)  # the same initial weights on every rank
    model = workload.build_model(data)
    variables = model.trainable_variables
    inner = inner_optimizer(keras, options["inner"], args.steps)
    wrapper = options.get("wrapper")
    sparse = None
    if wrapper is not None:
        if args.exchange != "library":
            wrapper = signs_named(sparse_hvd, inner, wrapper)
        sparse = sparse_hvd.SparseDistributedOptimizer(inner, **wrapper)
    optimizer = sparse if sparse is not None else inner
    optimizer.build(variables)
    allreduce = sparse is None and size > 1
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    if args.trace == "per-exchange":  # auto: traced per exchange it runs
        decorate = sparse_hvd.function(optimizer, jit_compile=False)
    else:
        decorate = tf.function(jit_compile=False)

    @decorate
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, variables)
        if allreduce:
            grads = [tf.convert_to_tensor(g) for g in grads]
            grads = hvd.grouped_allreduce(grads, op=hvd.Average, name="steps.dense")
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    @tf.function(jit_compile=False)
    def evaluate(x, y):
        logits = model(x, training=False)
        loss = loss_fn(y, logits)
        hits = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), y),
                                      tf.float32))
        return loss, hits

    x_val = tf.constant(data.x_val)
    y_val = tf.constant(data.y_val.astype("int32"))

    def validation():
        loss, hits = evaluate(x_val, y_val)
        return float(loss), float(hits)

    rng = np.random.default_rng(args.seed * 1000 + rank)  # each rank's own batches
    curve = []
    if rank == 0:
        loss, acc = validation()
        curve.append({"step": 0, "val_loss": loss, "val_accuracy": acc})
    train_seconds = 0.0
    step_seconds = []
    step_counts = StepCounts(sparse)
    for step in range(1, args.steps + 1):
        x, y = data.sample(rng, args.batch_size)
        t0 = time.perf_counter()
        loss = float(train_step(tf.constant(x), tf.constant(y.astype("int32"))))
        step_seconds.append(time.perf_counter() - t0)
        train_seconds += step_seconds[-1]
        if step <= FIRST_STEPS_KEPT:
            step_counts.after_step()
        if not np.isfinite(loss):
            raise SystemExit(f"rank {rank}: training loss is {loss} at step {step}")
        if rank == 0 and (step % args.eval_every == 0 or step == args.steps):
            val_loss, acc = validation()
            # train_seconds: the training time so far, evaluations left out
            curve.append({"step": step, "val_loss": val_loss, "val_accuracy": acc,
                          "train_loss": loss, "train_seconds": train_seconds})
            print(f"[steps_worker] {args.workload} {args.method} x{size} seed {args.seed} "
                  f"step {step}: val loss {val_loss:.4f}, acc {acc:.4f}", flush=True)

    flushed = flushed_losses(sparse, hvd, variables, validation) if sparse is not None else None
    parameters = int(sum(np.prod(v.shape) for v in variables))
    stats = sparse.communication_stats() if sparse is not None else None
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(v.numpy()).tobytes()
                                     for v in variables)).hexdigest()
    mine = {"stats": stats, "digest": digest, "train_seconds": train_seconds,
            # the steady state: the second half of the run (a dense warm-up, traces, trials
            # and the first steps fall in the first)
            "median_step_seconds": float(np.median(step_seconds[len(step_seconds) // 2:]))}
    everyone = hvd.allgather_object(mine, name="steps.results") if size > 1 else [mine]
    if rank == 0:
        if sparse is None:
            sent_fraction = 1.0
        else:
            sent_fraction = float(np.mean([r["stats"]["bytes_sent"] / r["stats"]["dense_bytes"]
                                           for r in everyone]))
        result = {
            "workload": args.label or args.workload,
            "method": args.method,
            "options": options,
            "workers": size,
            "seed": args.seed,
            "steps": args.steps,
            "batch_size": args.batch_size,
            "parameters": parameters,
            "curve": curve,
            # what each worker handed to Horovod over the run, as a share of a dense float32
            # exchange of the same gradients (values, indices and dense-route gradients)
            "bytes_fraction": sent_fraction,
            "stats": [r["stats"] for r in everyone],
            "layer_stats": sparse.layer_stats() if sparse is not None else None,
            "replicas_identical": len({r["digest"] for r in everyone}) == 1,
            "train_seconds": train_seconds,
            "median_step_seconds": float(np.median([r["median_step_seconds"] for r in everyone])),
            # rank 0's first steps one by one: where a run's start-up (traces, trials) goes
            "first_step_seconds": [round(s, 4) for s in step_seconds[:FIRST_STEPS_KEPT]],
            # and what rank 0 sent and its exchange's span in each of them (StepCounts)
            "first_step_counts": step_counts.kept,
            "exchange": args.exchange,
            "final_flushed": flushed,
            "exchange_decisions": (getattr(sparse, "exchange_decisions", None)
                                   if sparse is not None else None),
            "seconds": time.perf_counter() - started,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
