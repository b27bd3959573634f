"""The options a user combines, and a pairwise covering set of combinations of them.

:data:`FACTORS` lists each option of ``SparseDistributedOptimizer`` (and the inner optimizer's
mixed precision) with the values worth trying; :data:`REFUSED` the pairs the optimizer refuses
(README, "Combinations"). :func:`pairwise_combinations` returns combinations such that every
pair of values of two different options that is not refused appears in at least one of them
(a covering array of strength 2, built greedily: each new combination starts from a pair not
covered yet and takes, option by option, the value that covers most new pairs). The
construction is deterministic, so every rank of a job builds the same list.

``tests/test_option_matrix.py`` checks the cover and the refusals in one process;
``tests/distributed/test_option_matrix.py`` trains every combination on every rank.
"""

import itertools

FACTORS = {
    "sparsifier": ("topk", "approx_topk", "randomk", "threshold"),
    "density": ("constant", "warmup", "adaptive"),
    "exchange": ("allgather", "compact_allgather", "sparse_allreduce", "dense", "auto", "sign",
                 "topk_sign", "topk_sign2"),
    "grouping": ("grouped", "layerwise"),
    "staleness": (0, 1),
    "compression": ("none", "float16"),
    "backward_passes_per_step": (1, 2),
    "momentum_correction": (0.0, 0.9),
    "dense_fallback": (False, True),
    "mixed_precision": (False, True),
    "nonfinite": ("skip", "raise", "ignore"),
    "budget": ("layer", "model"),
    "clipping": ("after", "local"),
    "sparsify": ("gradient", "update"),
}

# (option, value, option, value): refused at construction, with the reason in the README
REFUSED = (
    ("staleness", 1, "density", "adaptive"),
    ("staleness", 1, "exchange", "sparse_allreduce"),
    ("momentum_correction", 0.9, "sparsify", "update"),
    # the sign exchange sends every entry's sign: nothing for a sparsifier or a budget to
    # choose, no velocity to mask, no per-layer or delayed variant of it
    ("exchange", "sign", "sparsifier", "approx_topk"),
    ("exchange", "sign", "sparsifier", "randomk"),
    ("exchange", "sign", "sparsifier", "threshold"),
    ("exchange", "sign", "density", "adaptive"),
    ("exchange", "sign", "grouping", "layerwise"),
    ("exchange", "sign", "staleness", 1),
    ("exchange", "sign", "momentum_correction", 0.9),
    ("exchange", "sign", "dense_fallback", True),
    ("exchange", "sign", "budget", "model"),
    # the top entries and the rest's signs: every entry moves, so no velocity to mask; no
    # per-layer or delayed variant of it, nor a dense fallback that times top-k
    ("exchange", "topk_sign", "density", "adaptive"),
    ("exchange", "topk_sign", "grouping", "layerwise"),
    ("exchange", "topk_sign", "staleness", 1),
    ("exchange", "topk_sign", "momentum_correction", 0.9),
    ("exchange", "topk_sign", "dense_fallback", True),
    ("exchange", "topk_sign2", "density", "adaptive"),  # the same for its two levels
    ("exchange", "topk_sign2", "grouping", "layerwise"),
    ("exchange", "topk_sign2", "staleness", 1),
    ("exchange", "topk_sign2", "momentum_correction", 0.9),
    ("exchange", "topk_sign2", "dense_fallback", True),
)


def _refused(combination):
    return any(combination.get(a) == x and combination.get(b) == y for a, x, b, y in REFUSED)


def _pairs_of(combination):
    items = sorted(combination.items())
    return {(a, b) for a, b in itertools.combinations(items, 2)}


def all_pairs():
    """Every pair of values of two different options that is not refused."""
    names = sorted(FACTORS)
    pairs = set()
    for first, second in itertools.combinations(names, 2):
        for x in FACTORS[first]:
            for y in FACTORS[second]:
                if not _refused({first: x, second: y}):
                    pairs.add(((first, x), (second, y)))
    return pairs


def pairwise_combinations():
    """Combinations (dicts over every option of :data:`FACTORS`) covering :func:`all_pairs`."""
    uncovered = all_pairs()
    combinations = []
    while uncovered:
        (a, x), (b, y) = min(uncovered, key=repr)  # deterministic on every rank
        combination = {a: x, b: y}
        for name in sorted(FACTORS):
            if name in combination:
                continue
            best, best_gain = None, -1
            for value in FACTORS[name]:
                trial = dict(combination, **{name: value})
                if _refused(trial):
                    continue
                gain = len(_pairs_of(trial) & uncovered)
                if gain > best_gain:
                    best, best_gain = value, gain
            combination[name] = best
        combinations.append(combination)
        uncovered -= _pairs_of(combination)
    return combinations


def label(combination):
    """A short, readable id for a combination (for test names and collective names)."""
    short = {False: "0", True: "1", "none": "-"}
    return "_".join(f"{short.get(v, v)}" for _, v in sorted(combination.items()))


# ---- training one combination (every rank of a job, or one process) ---------------------------

BIG, SMALL = (40, 64), (30,)  # 2560 entries: the sparse route; 30: the dense route
STEPS = 4  # exchanges; backward passes are STEPS x backward_passes_per_step
LOSS_SCALE = 16.0  # a power of two: scaling and unscaling are exact


def gradients(rank, passed):
    """Rank ``rank``'s gradients for backward pass ``passed`` (every rank can compute every
    rank's, so the expected sums need no collective)."""
    import numpy as np

    rng = np.random.RandomState(1000 * passed + rank)
    big = rng.standard_normal(BIG).astype("float32") * 0.3
    big[rank % BIG[0], :4] += 2.0  # some entries stand out, differently on each rank
    return big, rng.standard_normal(SMALL).astype("float32") * 0.3


def make_optimizer(combination, name):
    """``SparseDistributedOptimizer`` with ``combination``'s options around SGD(1.0), so that
    the weights move by exactly the averages applied."""
    import warnings

    import keras

    import sparse_hvd

    c = combination
    inner = keras.optimizers.SGD(1.0, clipnorm=1e6)  # clipping acts, never binds
    if c["mixed_precision"]:
        inner = keras.optimizers.LossScaleOptimizer(inner, initial_scale=LOSS_SCALE)
    density = {
        "constant": {"density": 0.05, "warmup_steps": 0},
        "warmup": {"density": 0.05, "warmup_steps": 3},
        "adaptive": {"density": sparse_hvd.AdaptiveDensity(0.05, min_density=0.01,
                                                           max_density=0.2, refresh_steps=2,
                                                           first_refresh=2)},
    }[c["density"]]
    sparsifier = c["sparsifier"]
    if sparsifier == "threshold":
        sparsifier = sparse_hvd.Threshold(threshold=0.5, max_density=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. the adaptive policy without grouping="layerwise"
        return sparse_hvd.SparseDistributedOptimizer(
            inner, sparsifier=sparsifier, exchange=c["exchange"], grouping=c["grouping"],
            staleness=c["staleness"], compression=c["compression"],
            backward_passes_per_step=c["backward_passes_per_step"],
            momentum_correction=c["momentum_correction"], dense_fallback=c["dense_fallback"],
            nonfinite=c["nonfinite"], budget=c["budget"], clipping=c["clipping"],
            sparsify=c["sparsify"], name=name, **density)


def train(combination, name, rank, size):
    """Train ``combination`` for :data:`STEPS` exchanges on this rank; returns ``(weights,
    residuals, expected)``: the final weights, this rank's residuals (flat) and the sum over
    every rank and pass of the gradients, for the conservation identity."""
    import keras
    import numpy as np
    import tensorflow as tf
    from helpers import built

    optimizer = make_optimizer(combination, name)
    big = keras.Variable(np.zeros(BIG, "float32"))
    small = keras.Variable(np.zeros(SMALL, "float32"))
    scale = LOSS_SCALE if combination["mixed_precision"] else 1.0
    built(optimizer, [big, small])

    @tf.function(jit_compile=False)
    def step(g_big, g_small):
        optimizer.apply_gradients([(g_big * scale, big), (g_small * scale, small)])

    passes = STEPS * combination["backward_passes_per_step"]
    for passed in range(passes):
        step(*map(tf.constant, gradients(rank, passed)))
    optimizer.apply_pending()  # staleness: what is still in flight (what fit's end does)
    expected = [sum(gradients(r, p)[i].astype("float64") for r in range(size)
                    for p in range(passes)) for i in (0, 1)]
    residuals = [v.numpy().astype("float64") for v in optimizer.residuals]
    return [big.numpy(), small.numpy()], residuals, expected


def tolerance(combination, expected, size):
    """How far the conservation identity may be off: float32 arithmetic, plus, with float16
    compression, Horovod's float16 allreduce of dense-route gradients, which rounds the sum
    over the ranks (half a unit in the last place of float16, 2^-11 relative, per addition;
    every rank's own rounding error is in its residual)."""
    import numpy as np

    rounding = 0.0
    if combination["compression"] == "float16":
        rounding = (size - 1) * 2.0 ** -11 * float(np.max(np.abs(expected))) * STEPS
    return 1e-4 + rounding
