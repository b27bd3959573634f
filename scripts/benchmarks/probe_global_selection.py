"""Probe: does the sparse run fall behind dense because each worker chooses its own entries?

Every rank of an ``mpirun`` job runs this (a hand-written loop, no ``sparse_hvd`` wrapper,
dense Horovod allreduces standing in for the sparse collectives: it measures convergence, not
time). Each step every worker w has its compensated gradient c_w = g_w + r_w, flat over the
whole model, and a budget of K = density(t) x n entries (the library's default schedule: 10%
decaying exponentially to ``density`` over the first 200 steps). Modes, by who chooses the
entries:

* ``local``: each worker its own top-K of |c_w| (the library's default, model-wide budget);
  the update is the mean of the sent parts; up to N x K distinct entries move;
* ``oracle``: one mask for all, the top-K of |mean_w c_w| (needs the dense sum: an upper
  bound of any shared choice); every worker sends its c_w on the mask, so the update is the
  mean compensated gradient on the mask and nothing chosen waits in another worker's residual;
* ``leader``: one mask for all, the top-K of the compensated gradient of worker t mod N
  (ScaleCom's cyclic local top-k, Chen et al. NeurIPS 2020): on a real wire the leader
  broadcasts K indices and the workers allreduce K values, ~2K(N-1)/N values, flat in N;
* ``union``: each worker picks K/N entries of its own, all workers send every entry of the
  union (an allgather of K indices, then an allreduce of K values);
* ``local_adam`` (an Adam workload): not a choice of entries but of what is cut: each worker
  runs Adam on its own gradient (its own moments) and its Adam *update* is compensated, cut
  locally and averaged; the mean is subtracted from the weights (DGC's local momentum, for
  Adam).
* ``local_update`` (any workload): the same with the workload's own Keras optimizer run on
  each worker's gradient (its SGD momentum or Adam moments; the library's ``sparsify="update"``).
* ``ef21`` (any workload): not error feedback but gradient *tracking* (EF21, Richtarik et al.
  NeurIPS 2021): each worker keeps h_w, its estimate of its own gradient, and sends the top-K
  of g_w - h_w; h_w moves by what it sent and every rank keeps h = mean_w h_w by adding the
  averaged sent parts. The inner optimizer applies h, dense, every step: an entry not sent
  moves by its last estimate instead of not at all;
* ``ef21_update``: the same tracking of each worker's own inner-optimizer *update* (its own
  moments or momentum, as in ``local_adam``), the weights moved by -h every step (EF21 with
  local momentum, in the spirit of Fatkhullin et al. NeurIPS 2023's EF21-SGDM).

``--flush-every H`` (``local`` and ``local_adam``): every H-th step each worker sends its
whole compensated vector (a dense allreduce; its residual starts clean), so no entry waits
longer than H steps (the periodic error reset of CSER, Xie et al. NeurIPS 2020, in its
simplest form). It costs 1/H of dense's bytes on top of the sparse steps.
``--residual-decay g``: the residual kept is g x (c_w - sent_w), so what is held back fades
(an entry's late sum is applied at most about 1/(1 - g) steps' worth).
``--compressor sign`` (``local``, ``local_adam``, ``local_update``): not a choice of entries
but of their precision. Every entry is sent every step as its sign, each variable's signs
scaled by the mean magnitude of its compensated vector (error feedback of the scaled sign:
EF-SignSGD, Karimireddy et al. ICML 2019; the compression of 1-bit Adam, Tang et al. ICML
2021), what was not sent kept in the residual. One bit an entry (1/32 of dense's float32
values, no index), about what the default's 1% with its warm-up moves (0.04 of dense's bytes):
an entry waits for no other, its size is what lags. No warm-up (``--density`` is not used).
Each worker receives every other's signs (an allgather: (N-1)/8 bytes an entry, N/64 of a ring
allreduce's float32).
``--compressor sign2``: the same in two phases whose traffic stays 1/32 of dense's at any N
(the compressed allreduce of 1-bit Adam): each worker sends the signs of chunk j of the flat
vector to worker j (a reduce-scatter), the owner averages them, adds its own residual, sends
that chunk's scaled signs to all (an allgather) and keeps what they missed. The scales are per
segment (a variable's part of a chunk). Every rank here computes every owner's part from the
same averages (an allreduce stands in for the reduce-scatter), so the owners' residuals are one
vector kept alike on every rank. An exact zero stays zero in both (on a wire of one bit it
would travel as + or -, or need a mark of its own: an embedding's rows that no batch has
touched are the exact zeros); ``--one-bit`` sends it as + (what a wire of one bit an entry
carries).
``--sign-every m`` and ``--sign-group g`` (``topk_sign``): what the signs of the rest buy,
asked at a fraction of their bits: the signs only on every m-th step (the rest waits in the
residual between), or on every step one sign for each run of g entries of a variable (the
sign of their sum). ``--compressor topk_lowrank --rank r``: the rest of each matrix (a
variable's last dimension its columns) as its rank-r approximation instead of signs, one
power iteration a step from the previous step's factors (PowerSGD, Vogels et al. NeurIPS
2019): each worker sends its share P P^T M_w (P the orthonormal basis of the workers' mean
of M_w Q), whose mean is the mean's approximation; vectors only in the top K.
``--compressor lowrank``: the same without the top K, vectors sent whole.
``--density 1`` with ``local`` is dense training (every entry sent each step): the probe's own
dense control, e.g. at another learning rate.
``--lr-scale s`` (any mode) and ``--second-moment mean_estimate`` (``local_adam``): each
worker's Adam sees its own gradient of a batch N times smaller than the step's, whose noise
variance is N times the mean gradient's, so its second moment is larger than dense Adam's and
its steps smaller where the gradient is mostly noise (up to sqrt(N) smaller). ``s`` scales the
learning rate; ``mean_estimate`` takes v - m^2 (bias-corrected) as the worker's noise and
divides it by N: ``m^2 + (v - m^2) / N`` estimates the second moment of the workers' mean
gradient. ``noise_estimate`` does the same with q, the beta_2 average of m_hat^2, in place of
m^2: v and q share one horizon, so a mean that was larger some hundred steps ago (v still holds
it, m^2 no longer) is not taken for noise; ``max(v - (1 - 1/N) s, v / N)`` with
``s = (v - q)(1 + beta_1) / (2 beta_1)``, the noise variance if it were stationary.

The residual is what was not sent: r_w = c_w - sent_w. The inner optimizer (the workload's,
with the benchmark's schedule) applies the update. Writes a record in the format of
``bench_steps_to_loss.py``'s ``runs.jsonl`` (report it beside dense's runs with ``--report``)::

    mpirun -np 4 --oversubscribe --bind-to none .venv/bin/python \\
        scripts/benchmarks/probe_global_selection.py --workload chartf --mode leader \\
        --seed 0 --jsonl results/probe/runs.jsonl
"""

import argparse
import hashlib
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

MODES = ("local", "oracle", "leader", "union", "local_adam", "local_update", "ef21",
         "ef21_update")
CUT_UPDATES = ("local_adam", "local_update")  # modes whose cut vector is a step, subtracted
# the library's default warm-up at 1% when this probe's results were published (400 steps
# since the seventy-ninth session; kept so that a re-run compares with them)
WARMUP_START, WARMUP_STEPS = 0.10, 200


def density_at(step, density):
    """The probe's schedule: 10% decaying exponentially to ``density`` over 200 steps."""
    if density >= WARMUP_START:
        return density
    progress = min(step, WARMUP_STEPS) / WARMUP_STEPS
    return WARMUP_START * (density / WARMUP_START) ** progress


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", required=True)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--flush-every", type=int, default=0,
                        help="send everything every H-th step (0: never)")
    parser.add_argument("--residual-decay", type=float, default=1.0,
                        help="keep this share of what was not sent (1: error feedback)")
    parser.add_argument("--lr-scale", type=float, default=1.0,
                        help="the learning rate's peak times this")
    parser.add_argument("--second-moment", choices=("own", "mean_estimate", "noise_estimate"),
                        default="own",
                        help="local_adam: Adam's second moment, the worker's own, or its "
                             "estimate for the workers' mean gradient (see the module doc)")
    parser.add_argument("--sign-block", type=int, default=0,
                        help="topk_sign: one scale per block of this many entries of a "
                             "variable (0: one per variable)")
    parser.add_argument("--scale-every", type=int, default=50,
                        help="sign_shared: steps between the refreshes of the shared scales")
    parser.add_argument("--band", type=float, default=10.0,
                        help="topk_band, topk_sign2: the band is the top band x K entries "
                             "below the top K")
    parser.add_argument("--compressor", choices=("topk", "sign", "sign2", "sign_shared",
                                                 "topk_sign", "topk_band", "topk_sign2",
                                                 "lowrank", "topk_lowrank"),
                        default="topk",
                        help="local, local_adam, local_update: the top-K entries, or every "
                             "entry's scaled sign (see the module doc)")
    parser.add_argument("--sign-every", type=int, default=1,
                        help="topk_sign: the signs of the rest only every this many steps "
                             "(the top-K every step; the rest waits in the residual between)")
    parser.add_argument("--sign-group", type=int, default=1,
                        help="topk_sign: one sign for each this many consecutive entries of a "
                             "variable (the sign of their sum), every entry moved every step")
    parser.add_argument("--rank", type=int, default=2,
                        help="lowrank, topk_lowrank: the rank of each matrix's approximation")
    parser.add_argument("--one-bit", action="store_true",
                        help="sign, sign2: an exact zero travels as + (one bit an entry)")
    parser.add_argument("--jsonl", required=True, help="append the run's record here")
    args = parser.parse_args(argv)
    if args.compressor != "topk" and args.mode not in ("local",) + CUT_UPDATES:
        parser.error(f"--compressor {args.compressor} goes with --mode local, local_adam or "
                     "local_update")
    for name in ("sign_every", "sign_group"):
        value = getattr(args, name)
        if value < 1 or (value > 1 and args.compressor != "topk_sign"):
            parser.error(f"--{name.replace('_', '-')} must be at least 1, and over 1 only "
                         "with --compressor topk_sign")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    started = time.perf_counter()
    import sparse_hvd

    hvd = sparse_hvd.init()
    import keras
    import numpy as np
    import tensorflow as tf

    from bench_steps_to_loss import SETTINGS
    from steps_worker import inner_optimizer, learning_rate
    from workloads import WORKLOADS

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    settings = dict(SETTINGS[args.workload])
    settings["inner"] = dict(settings["inner"], lr=settings["inner"]["lr"] * args.lr_scale)
    steps = args.steps or settings["steps"]
    eval_every = settings["eval_every"]
    rank, size = hvd.rank(), hvd.size()
    data = WORKLOADS[settings.get("model", args.workload)].load(rank, size)
    keras.utils.set_random_seed(args.seed)
    model = WORKLOADS[settings.get("model", args.workload)].build_model(data)
    variables = model.trainable_variables
    optimizer = inner_optimizer(keras, settings["inner"], steps)
    optimizer.build(variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    shapes = [v.shape for v in variables]
    sizes = [int(np.prod(s)) for s in shapes]
    n = sum(sizes)
    residual = tf.Variable(tf.zeros([n]), trainable=False)
    mode = args.mode
    estimate = tf.Variable(tf.zeros([n]), trainable=False)  # ef21: h_w
    tracked = tf.Variable(tf.zeros([n]), trainable=False)  # ef21: h, the same on every rank
    if mode == "local_adam":
        if settings["inner"]["name"] != "adam":
            raise SystemExit("--mode local_adam needs a workload trained with Adam")
        schedule = learning_rate(keras, settings["inner"]["lr"], steps)
        first = tf.Variable(tf.zeros([n]), trainable=False)
        second = tf.Variable(tf.zeros([n]), trainable=False)
        explained = tf.Variable(tf.zeros([n]), trainable=False)  # noise_estimate: q
        taken = tf.Variable(0.0, trainable=False)
        beta_1, beta_2, epsilon = 0.9, 0.999, 1e-7  # Keras Adam's defaults

    if mode in ("ef21_update", "local_update"):
        local_optimizer = inner_optimizer(keras, settings["inner"], steps)
        local_optimizer.build(variables)

    def local_update(grads):
        """This worker's inner-optimizer update of its own gradient (weights put back)."""
        before = [tf.identity(v) for v in variables]
        local_optimizer.apply_gradients(zip(grads, variables))
        moved = [b - v for b, v in zip(before, variables)]
        for variable, value in zip(variables, before):
            variable.assign(value)
        return tf.concat([tf.reshape(m, [-1]) for m in moved], 0)

    def local_adam_step(flat):
        """Keras Adam's update of this worker's own gradient (what it would subtract)."""
        lr = tf.cast(schedule(taken), tf.float32)
        taken.assign_add(1.0)
        first.assign(first + (flat - first) * (1 - beta_1))
        second.assign(second + (tf.square(flat) - second) * (1 - beta_2))
        alpha = lr * tf.sqrt(1 - tf.pow(beta_2, taken)) / (1 - tf.pow(beta_1, taken))
        moment = second
        if args.second_moment == "mean_estimate":
            # the part of the worker's second moment its first moment does not explain,
            # taken as noise, shrinks by the workers, as it would in their mean gradient
            # (bias-corrected moments: the two horizons differ)
            m_hat = first / (1 - tf.pow(beta_1, taken))
            v_hat = second / (1 - tf.pow(beta_2, taken))
            noise = tf.maximum(v_hat - tf.square(m_hat), 0.0)
            moment = (tf.square(m_hat) + noise / size) * (1 - tf.pow(beta_2, taken))
        elif args.second_moment == "noise_estimate":
            # as above, but what the first moment explains is averaged over v's own horizon
            # (q: the beta_2 average of m_hat^2), so a mean that was larger before is not
            # taken for noise; stationary, v_hat - q_hat = sigma^2 (2 beta_1 / (1 + beta_1))
            m_hat = first / (1 - tf.pow(beta_1, taken))
            explained.assign(explained + (tf.square(m_hat) - explained) * (1 - beta_2))
            noise = tf.maximum(second - explained, 0.0) * (1 + beta_1) / (2 * beta_1)
            moment = tf.maximum(second - noise * (1 - 1 / size), second / size)
        return first * alpha / (tf.sqrt(moment) + epsilon)

    def top_mask(magnitude, k):
        threshold = tf.math.top_k(magnitude, k, sorted=True).values[-1]
        return tf.cast(magnitude >= threshold, tf.float32)

    # segments: each variable's part of each of the N chunks (sign2), or each variable (sign)
    bounds = np.cumsum([0] + sizes)
    cuts = (np.union1d(bounds, np.linspace(0, n, size + 1).round().astype(int))
            if args.compressor == "sign2" else bounds)
    if args.sign_block:
        cuts = np.union1d(cuts, np.concatenate(
            [np.arange(a, b, args.sign_block) for a, b in zip(bounds[:-1], bounds[1:])]))
    segment_of = tf.constant(np.searchsorted(cuts, np.arange(n), side="right") - 1, tf.int32)
    segments = len(cuts) - 1
    # topk_sign --sign-group: runs of that many entries, none across a variable's bounds
    starts = np.concatenate([np.arange(a, b, args.sign_group)
                             for a, b in zip(bounds[:-1], bounds[1:])])
    group_of = tf.constant(np.searchsorted(starts, np.arange(n), side="right") - 1, tf.int32)
    groups = len(starts)
    owners_residual = tf.Variable(tf.zeros([n]), trainable=False)  # sign2: every owner's
    magnitude = tf.Variable(tf.zeros([n]), trainable=False)  # sign_shared: this worker's |c|
    shared_scale = tf.Variable(tf.zeros([n]), trainable=False)  # sign_shared: every rank's

    # lowrank, topk_lowrank: each variable of two or more dimensions as a matrix (its last
    # dimension the columns) and its right factor, warm-started from the previous step and
    # the same on every rank (PowerSGD, Vogels et al. NeurIPS 2019)
    matrices = [(int(np.prod(shape[:-1])), int(shape[-1])) if len(shape) >= 2 else None
                for shape in shapes]
    factors = []
    for j, m in enumerate(matrices):
        rank_j = min(args.rank, *m) if m else 0
        factors.append(tf.Variable(tf.random.stateless_normal([m[1], rank_j], seed=[args.seed, j]),
                                   trainable=False) if m else None)

    def low_rank(flat):
        """This worker's share of the averaged rank-``--rank`` approximation of each matrix of
        ``flat`` (P P^T M_w, P the orthonormal basis of the mean of M_w Q), whose mean over the
        workers is the approximation every rank applies; vectors are not approximated (zero).
        One power iteration a step, two allreduces of the factors."""
        parts = tf.split(flat, sizes)
        shares = []
        for part, m, q in zip(parts, matrices, factors):
            if m is None:
                shares.append(tf.zeros_like(part))
                continue
            matrix = tf.reshape(part, m)
            left = hvd.allreduce(matrix @ q, op=hvd.Average, name=f"probe.p{len(shares)}")
            basis, _ = tf.linalg.qr(left)
            right = tf.transpose(matrix) @ basis
            q.assign(hvd.allreduce(right, op=hvd.Average, name=f"probe.q{len(shares)}"))
            shares.append(tf.reshape(basis @ tf.transpose(right), [-1]))
        return tf.concat(shares, 0)

    factor_floats = sum((rows + cols) * min(args.rank, rows, cols)
                        for rows, cols in filter(None, matrices))
    vector_entries = sum(size for size, m in zip(sizes, matrices) if m is None)

    def scaled_signs(flat):
        """``flat``'s signs, each segment's times the segment's mean magnitude."""
        scales = tf.math.unsorted_segment_mean(tf.abs(flat), segment_of, segments)
        signs = tf.where(flat >= 0, 1.0, -1.0) if args.one_bit else tf.sign(flat)
        return signs * tf.gather(scales, segment_of)

    def apply(flat, subtract):
        """Subtract ``flat`` (an update) from the weights, or give it to the inner optimizer
        as their gradient."""
        parts = [tf.reshape(p, s) for p, s in zip(tf.split(flat, sizes), shapes)]
        if subtract:
            for variable, part in zip(variables, parts):
                variable.assign_sub(part)
        else:
            optimizer.apply_gradients(zip(parts, variables))

    @tf.function(jit_compile=False)
    def train_step(x, y, k, leader, flush, refresh_first, signs_due):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, variables)
        flat = tf.concat([tf.reshape(tf.convert_to_tensor(g), [-1]) for g in grads], 0)
        if mode == "local_adam":
            flat = local_adam_step(flat)
        elif mode in ("ef21_update", "local_update"):
            flat = local_update(grads)
        if mode.startswith("ef21"):  # track: send the top-K of what h_w misses
            difference = flat - estimate
            sent = difference * top_mask(tf.abs(difference), k)
            estimate.assign_add(sent)
            tracked.assign_add(hvd.allreduce(sent, op=hvd.Average, name="probe.ef21"))
            apply(tracked, subtract=mode == "ef21_update")
            return loss, tf.reduce_sum(tf.cast(tf.not_equal(sent, 0.0), tf.float32))
        compensated = flat + residual
        if args.compressor == "sign_shared":
            # each entry's sign times a scale of its own, the same on every rank: the mean
            # over the workers of their running |c|, refreshed by a dense allreduce every
            # --scale-every steps (and at the first)
            magnitude.assign(tf.where(refresh_first, tf.abs(compensated),
                                      0.9 * magnitude + 0.1 * tf.abs(compensated)))
            if_refresh = hvd.allreduce(magnitude, op=hvd.Average, name="probe.scales")
            shared_scale.assign(tf.where(flush, if_refresh, shared_scale))
            sent = tf.sign(compensated) * shared_scale
            residual.assign(compensated - sent)
            update = hvd.allreduce(sent, op=hvd.Average, name="probe.signs")
            apply(update, subtract=mode in CUT_UPDATES)
            return loss, tf.constant(n / 32.0)
        if args.compressor in ("topk_band", "topk_sign2"):
            # the top-K exactly; the next (band - 1) K entries as signs times their own mean
            # magnitude (per variable); the rest as signs times theirs (topk_sign2) or kept
            # back (topk_band)
            magnitude = tf.abs(compensated)
            mask = top_mask(magnitude, k)
            wide = tf.minimum(tf.cast(args.band * tf.cast(k, tf.float32), tf.int32), n)
            in_band = top_mask(magnitude, wide) - mask
            below = 1 - mask - in_band
            sent = compensated * mask
            for part in ((in_band, below) if args.compressor == "topk_sign2" else (in_band,)):
                counts = tf.math.unsorted_segment_sum(part, segment_of, segments)
                scales = (tf.math.unsorted_segment_sum(tf.abs(compensated) * part, segment_of,
                                                       segments) / tf.maximum(counts, 1.0))
                sent += tf.sign(compensated) * part * tf.gather(scales, segment_of)
            residual.assign(compensated - sent)
            update = hvd.allreduce(sent, op=hvd.Average, name="probe.signs")
            apply(update, subtract=mode in CUT_UPDATES)
            bits = 2.0 if args.compressor == "topk_sign2" else 1.0 + args.band * 0.01
            return loss, tf.cast(k, tf.float32) * 2.0 + n * bits / 32.0
        if args.compressor in ("lowrank", "topk_lowrank"):
            # the top-K exactly (topk_lowrank), each matrix's rest as its low-rank share,
            # vectors whole (lowrank) or only in the top-K (topk_lowrank)
            if args.compressor == "topk_lowrank":
                mask = top_mask(tf.abs(compensated), k)
            else:
                mask = tf.concat([tf.fill([size], 1.0 if m is None else 0.0)
                                  for size, m in zip(sizes, matrices)], 0)
            sent = compensated * mask + low_rank(compensated * (1 - mask))
            residual.assign(compensated - sent)
            update = hvd.allreduce(sent, op=hvd.Average, name="probe.lowrank")
            apply(update, subtract=mode in CUT_UPDATES)
            head = (tf.cast(k, tf.float32) * 2.0 if args.compressor == "topk_lowrank"
                    else float(vector_entries))
            return loss, head + float(factor_floats)
        if args.compressor == "topk_sign":
            # the top-K exactly, the rest as signs times each variable's mean |rest|, on the
            # steps ``--sign-every`` says (between them the rest waits in the residual); with
            # ``--sign-group g`` each run of g entries by the sign of its sum, the scale the
            # least-squares one, sum |group sums| / entries
            mask = top_mask(tf.abs(compensated), k)
            rest = compensated * (1 - mask)
            counts = tf.math.unsorted_segment_sum(1 - mask, segment_of, segments)
            signs = tf.sign(rest)
            magnitudes = tf.abs(rest)
            if args.sign_group > 1:
                sums = tf.math.unsorted_segment_sum(rest, group_of, groups)
                signs = tf.gather(tf.sign(sums), group_of) * (1 - mask)
                magnitudes = tf.gather(tf.abs(sums), group_of) * tf.gather(
                    1.0 / tf.maximum(tf.math.unsorted_segment_sum(1 - mask, group_of, groups),
                                     1.0), group_of) * (1 - mask)
            scales = (tf.math.unsorted_segment_sum(magnitudes, segment_of, segments)
                      / tf.maximum(counts, 1.0))
            due = tf.cast(signs_due, tf.float32)
            sent = compensated * mask + signs * tf.gather(scales, segment_of) * due
            residual.assign(compensated - sent)
            update = hvd.allreduce(sent, op=hvd.Average, name="probe.signs")
            apply(update, subtract=mode in CUT_UPDATES)
            return loss, tf.cast(k, tf.float32) * 2.0 + groups / 32.0 * due
        if args.compressor != "topk":
            sent = scaled_signs(compensated)
            residual.assign(compensated - sent)
            update = hvd.allreduce(sent, op=hvd.Average, name="probe.signs")
            if args.compressor == "sign2":  # the owners' signs of the averages
                owned = update + owners_residual
                update = scaled_signs(owned)
                owners_residual.assign(owned - update)
            apply(update, subtract=mode in CUT_UPDATES)
            return loss, tf.constant(n / 32.0)  # a bit an entry, in float32 values' worth
        if mode in ("local",) + CUT_UPDATES:
            mask = top_mask(tf.abs(compensated), k)
        elif mode == "oracle":
            mean = hvd.allreduce(compensated, op=hvd.Average, name="probe.oracle")
            mask = top_mask(tf.abs(mean), k)
        elif mode == "leader":
            mine = top_mask(tf.abs(compensated), k) * tf.cast(tf.equal(rank, leader), tf.float32)
            mask = hvd.allreduce(mine, op=hvd.Sum, name="probe.leader")
        else:  # union
            mine = top_mask(tf.abs(compensated), tf.maximum(k // size, 1))
            mask = tf.minimum(hvd.allreduce(mine, op=hvd.Sum, name="probe.union"), 1.0)
        mask = tf.where(flush, tf.ones_like(mask), mask)
        sent = compensated * mask
        residual.assign((compensated - sent) * args.residual_decay)
        update = hvd.allreduce(sent, op=hvd.Average, name="probe.update")
        # what moved: the entries of the update (indices and values of the union)
        apply(update, subtract=mode in CUT_UPDATES)
        return loss, tf.reduce_sum(tf.cast(tf.not_equal(update, 0.0), tf.float32))

    @tf.function(jit_compile=False)
    def evaluate(x, y):
        logits = model(x, training=False)
        hits = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), y),
                                      tf.float32))
        return loss_fn(y, logits), hits

    x_val, y_val = tf.constant(data.x_val), tf.constant(data.y_val.astype("int32"))
    rng = np.random.default_rng(args.seed * 1000 + rank)  # steps_worker's batches
    curve, moved_total = [], 0.0
    if rank == 0:
        loss, acc = evaluate(x_val, y_val)
        curve.append({"step": 0, "val_loss": float(loss), "val_accuracy": float(acc)})
    for step in range(1, steps + 1):
        x, y = data.sample(rng, 16)
        k = max(1, math.ceil(density_at(step - 1, args.density) * n))
        loss, moved = train_step(tf.constant(x), tf.constant(y.astype("int32")),
                                 tf.constant(k, tf.int32), tf.constant((step - 1) % size),
                                 tf.constant(
                                     (args.flush_every > 0 and step % args.flush_every == 0)
                                     or (args.compressor == "sign_shared"
                                         and (step - 1) % args.scale_every == 0)),
                                 tf.constant(step == 1),
                                 tf.constant(step % args.sign_every == 0))
        moved_total += float(moved)
        if rank == 0 and (step % eval_every == 0 or step == steps):
            val_loss, acc = evaluate(x_val, y_val)
            curve.append({"step": step, "val_loss": float(val_loss),
                          "val_accuracy": float(acc), "train_loss": float(loss)})
            print(f"[probe] {args.workload} {mode} seed {args.seed} step {step}: "
                  f"val loss {float(val_loss):.4f}", flush=True)
    digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in variables)).hexdigest()
    digests = hvd.allgather_object(digest, name="probe.digests")
    if rank == 0:
        method = (f"probe_{mode}" + (f"_d{args.density:g}" if args.density != 0.01 else "")
                  + (f"_flush{args.flush_every}" if args.flush_every else "")
                  + (f"_decay{args.residual_decay:g}" if args.residual_decay != 1 else "")
                  + (f"_lr{args.lr_scale:g}x" if args.lr_scale != 1 else "")
                  + {"own": "", "mean_estimate": "_meanv",
                     "noise_estimate": "_noisev"}[args.second_moment]
                  + (f"_{args.compressor}" if args.compressor != "topk" else "")
                  + ("_1bit" if args.one_bit else "")
                  + (f"_every{args.scale_every}" if args.compressor == "sign_shared" else "")
                  + (f"_block{args.sign_block}" if args.sign_block else "")
                  + (f"_signs{args.sign_every}" if args.sign_every != 1 else "")
                  + (f"_group{args.sign_group}" if args.sign_group != 1 else "")
                  + (f"_r{args.rank}" if args.compressor in ("lowrank", "topk_lowrank") else "")
                  + (f"_band{args.band:g}" if args.compressor in ("topk_band", "topk_sign2")
                     and args.band != 10 else ""))
        record = {"workload": args.workload, "method": method, "workers": size,
                  "seed": args.seed, "steps": steps, "parameters": n, "curve": curve,
                  # entries of the update over the run, as a share of dense's entries (the
                  # bytes depend on the wire; local and union also send indices)
                  "bytes_fraction": moved_total / (n * steps),
                  "replicas_identical": len(set(digests)) == 1, "median_step_seconds": 0.0,
                  "train_seconds": 0.0, "options": {"mode": mode, "density": args.density,
                                               "flush_every": args.flush_every,
                                               "residual_decay": args.residual_decay,
                                               "lr_scale": args.lr_scale,
                                               "second_moment": args.second_moment,
                                               "compressor": args.compressor,
                                               "one_bit": args.one_bit,
                                               "sign_every": args.sign_every,
                                               "rank": args.rank,
                                               "sign_group": args.sign_group},
                  "seconds": time.perf_counter() - started}
        os.makedirs(os.path.dirname(os.path.abspath(args.jsonl)), exist_ok=True)
        with open(args.jsonl, "a") as f:
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
