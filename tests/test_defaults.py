"""The convergence default (the density warm-up) and the options the steps-to-loss benchmark
measured against it: a dense start, one budget for the whole model, unmasked momentum."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from sparse_hvd.selection.defaults import WARMUP_INITIAL_DENSITY, resolve_density
from sparse_hvd.selection.density import ConstantDensity, DenseStart, WarmupDensity
from helpers import numpy_topk_indices

SHAPE = (100, 100)  # 10,000 entries: sparse route


def _warmup_k(step, density, n, steps, initial=WARMUP_INITIAL_DENSITY):
    """WarmupDensity's k, computed independently: ceil(n * initial * (d/initial)^(t/T))."""
    if step >= steps:
        return math.ceil(density * n)
    return math.ceil(n * initial * (density / initial) ** (step / steps) - 1e-9)


def _sent_per_step(optimizer, variable, steps, seed=0):
    rng = np.random.RandomState(seed)
    sent = []
    for _ in range(steps):
        optimizer.apply_gradients([(tf.constant(rng.randn(*SHAPE).astype("float32")), variable)])
        sent.append(optimizer.layer_stats()[variable.path]["last_sent"])
    return sent


@pytest.mark.convergence_defaults
def test_a_numeric_density_warms_up_from_10_percent_over_400_steps():
    variable = keras.Variable(np.zeros(SHAPE, "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), density=0.01)
    assert isinstance(optimizer.density_policy, WarmupDensity)
    assert optimizer.warmup_steps == 400
    sent = _sent_per_step(optimizer, variable, 4)
    assert sent == [_warmup_k(t, 0.01, 10_000, steps=400) for t in range(4)]
    assert sent[0] == 1000
    assert optimizer.density == 0.01  # the density it settles at


@pytest.mark.convergence_defaults
def test_warmup_steps_zero_keeps_the_density_constant_from_the_first_step():
    variable = keras.Variable(np.zeros(SHAPE, "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), density=0.01,
                                                      warmup_steps=0)
    assert type(optimizer.density_policy) is ConstantDensity
    assert _sent_per_step(optimizer, variable, 3) == [100, 100, 100]


@pytest.mark.convergence_defaults
def test_resolution_of_density_and_warmup_steps():
    assert resolve_density(0.01, None).get_config() == {
        "density": 0.01, "initial_density": 0.1, "warmup_steps": 400}
    assert resolve_density(0.001, 50).get_config()["warmup_steps"] == 50
    # 400 steps at 0.1% and above, whatever the fall
    assert resolve_density(0.001, None).get_config() == {
        "density": 0.001, "initial_density": 0.1, "warmup_steps": 400}
    assert resolve_density(0.005, None).get_config()["warmup_steps"] == 400
    assert resolve_density(0.05, None).get_config()["warmup_steps"] == 400
    # below 0.1%, 0.1%'s pace: 200 steps for each tenfold fall from 10%
    assert resolve_density(0.0001, None).get_config()["warmup_steps"] == 600
    assert resolve_density(0.00003, None).get_config()["warmup_steps"] == round(
        200 * math.log10(0.1 / 0.00003))
    assert type(resolve_density(0.01, 0)) is ConstantDensity
    # a density at or above the warm-up's start needs none
    assert type(resolve_density(0.1, None)) is ConstantDensity
    assert resolve_density(0.099, None).get_config()["initial_density"] == 0.1
    assert type(resolve_density(1.0, None)) is ConstantDensity
    policy = DenseStart(0.01, dense_steps=5)
    assert resolve_density(policy, None) is policy  # a policy is used as given
    for bad in (-1, 1.5, True, "200"):
        with pytest.raises(ValueError, match="`warmup_steps` must be a non-negative int"):
            resolve_density(0.01, bad)


@pytest.mark.convergence_defaults
def test_the_resolved_warmup_round_trips_and_an_old_config_keeps_its_constant_density():
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), density=0.01)
    config = optimizer.get_config()
    assert config["warmup_steps"] == 400
    assert config["density"] == {"class_name": "warmup", "config": {
        "density": 0.01, "initial_density": 0.1, "warmup_steps": 400}}
    again = sparse_hvd.SparseDistributedOptimizer.from_config(config)
    assert again.density_policy.get_config() == optimizer.density_policy.get_config()
    # written by the release whose warm-up at 1% was 200 steps: it reloads as it ran
    previous = dict(config, warmup_steps=200, density={"class_name": "warmup", "config": {
        "density": 0.01, "initial_density": 0.1, "warmup_steps": 200}})
    reloaded = sparse_hvd.SparseDistributedOptimizer.from_config(previous)
    assert reloaded.warmup_steps == 200
    assert reloaded.density_policy.get_config()["warmup_steps"] == 200
    # written when the warm-up started at 25%: it reloads as it ran
    older = dict(config, density={"class_name": "warmup", "config": {
        "density": 0.01, "initial_density": 0.25, "warmup_steps": 200}})
    assert sparse_hvd.SparseDistributedOptimizer.from_config(
        older).density_policy.get_config()["initial_density"] == 0.25
    # written before the warm-up default existed: no warmup_steps key, a float density
    old = dict(config, density=0.01)
    del old["warmup_steps"]
    assert type(sparse_hvd.SparseDistributedOptimizer.from_config(old).density_policy) \
        is ConstantDensity


def test_dense_start_sends_everything_then_the_density():
    variable = keras.Variable(np.zeros(SHAPE, "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.1), density=DenseStart(0.01, dense_steps=2))
    assert _sent_per_step(optimizer, variable, 4) == [10_000, 10_000, 100, 100]
    # a step that sends everything leaves nothing behind
    assert DenseStart(0.02, 3).get_config() == {"density": 0.02, "dense_steps": 3}
    with pytest.raises(ValueError, match="`dense_steps` must be a non-negative int"):
        DenseStart(0.01, dense_steps=-1)


@pytest.mark.parametrize("dtype", ["float64", "float32"])  # float32: the one-pass kernel
def test_a_model_wide_budget_sends_the_largest_entries_of_all_layers_together(dtype):
    """budget="model": K = sum of the layers' k, the cut is the K-th largest |c| over both
    layers; a NumPy re-computation of three steps with error feedback, at lr 1."""
    rng = np.random.RandomState(5)
    shapes = [(50, 40), (30, 100)]  # 2,000 and 3,000 entries: k = 20 and 30 at 1%
    scales = [1.0, 0.2]  # the first layer's gradients are larger: it should send more
    variables = [keras.Variable(np.zeros(s, dtype), dtype=dtype) for s in shapes]
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(1.0), density=0.01,
                                                      budget="model")
    weights = [np.zeros(math.prod(s), dtype) for s in shapes]
    residuals = [np.zeros(math.prod(s), dtype) for s in shapes]
    for _ in range(3):
        grads = [(scale * rng.standard_cauchy(s)).astype(dtype)
                 for s, scale in zip(shapes, scales)]
        optimizer.apply_gradients([(tf.constant(g), v) for g, v in zip(grads, variables)])
        compensated = [g.ravel() + r for g, r in zip(grads, residuals)]
        cut = np.sort(np.abs(np.concatenate(compensated)))[::-1][20 + 30 - 1]
        sent_counts = []
        for i, c in enumerate(compensated):
            chosen = np.abs(c) >= cut
            weights[i] -= np.where(chosen, c, 0.0)
            residuals[i] = np.where(chosen, 0.0, c)
            sent_counts.append(int(chosen.sum()))
        assert sum(sent_counts) == 50
        for variable, w, r, residual in zip(variables, weights, residuals, optimizer.residuals):
            np.testing.assert_array_equal(variable.numpy().ravel(), w)
            np.testing.assert_array_equal(residual.numpy().ravel(), r)
    assert sent_counts[0] > 20  # the layer with the larger gradients took more than its k
    assert optimizer.get_config()["budget"] == "model"
    with pytest.raises(ValueError, match="`budget` must be 'layer' or 'model'"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), budget="global")


def test_momentum_correction_without_masking_keeps_the_velocity():
    """momentum_masking=False: u = m*u + g; c = u + r; r = c - sent; u is NOT cleared."""
    m = 0.9
    rng = np.random.RandomState(2)
    kernel = keras.Variable(np.zeros((50, 40)), dtype="float64")
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(1.0), density=0.01, momentum_correction=m, momentum_masking=False)
    u, r, w = np.zeros(2000), np.zeros(2000), np.zeros(2000)
    for _ in range(5):
        g = rng.randn(2000)
        optimizer.apply_gradients([(tf.constant(g.reshape(50, 40)), kernel)])
        u = m * u + g
        c = u + r
        chosen = numpy_topk_indices(c, 20)
        sent = np.zeros(2000)
        sent[chosen] = c[chosen]
        r = c - sent
        w -= sent
        np.testing.assert_allclose(kernel.numpy().ravel(), w, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(optimizer.local_variables[1].numpy().ravel(), u, rtol=1e-12)
    with pytest.raises(TypeError, match="momentum_masking"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), momentum_masking=1)


@pytest.mark.parametrize("share", [0.001, 0.01, 0.25])  # 0.25: the warm-up's first steps
def test_the_model_wide_cut_of_a_large_model_sends_about_k(share):
    """Above SAMPLES entries the cut is the K-th largest of the magnitudes in evenly spread
    blocks, scaled: the entries at or above it number K within 10% (ties, zeros and
    subnormals included), traced or eager."""
    from sparse_hvd.selection import model_budget

    rng = np.random.RandomState(9)
    sizes = (200_000, 70_000, 3_000)
    arrays = [rng.standard_cauchy(n).astype("float32") * s for n, s in zip(sizes, (1.0, 0.1, 5.0))]
    arrays[1][:5000] = 0.0
    arrays[1][5000:6000] = 1e-40  # subnormal
    arrays[2][:] = np.round(arrays[2])  # ties
    budgets = [max(1, int(share * n)) for n in sizes]

    def magnitudes_at(j, sample):
        magnitudes = tf.abs(tf.constant(arrays[j]))
        return magnitudes if sample is None else sample(magnitudes)

    for function in (model_budget.model_wide_cut, tf.function(model_budget.model_wide_cut)):
        cut = float(function(magnitudes_at, sizes, budgets))
        sent = int(np.sum(np.abs(np.concatenate(arrays)) >= cut))
        assert abs(sent - sum(budgets)) <= 0.1 * sum(budgets), (sent, sum(budgets))


@pytest.mark.parametrize("grid", ["signs", "walks", "mostly_zero", "zeros"])
@pytest.mark.parametrize("sizes", [(40_000, 20_000), (400_000, 200_000)])  # exact, sampled
def test_magnitudes_tied_at_the_cut_travel_only_where_that_is_nearer_the_budget(grid, sizes):
    """Magnitudes on a grid tie at the cut by the thousand: a Lion's first update (+-rate
    everywhere), error feedback's sums of such signs, a gradient mostly zero, an update at a
    learning rate of 0. The cut sends ``>= cut`` or ``> cut``, whichever count is nearer K,
    counted here in NumPy over the sample the cut was read from (every entry, or the blocks
    ``sample_stride`` spreads), and the selection's kernels send that many."""
    from sparse_hvd.selection import model_budget

    rng = np.random.RandomState(5)
    rate = np.float32(3e-4)
    if grid == "signs":
        arrays = [rng.choice([-rate, rate], n).astype("float32") for n in sizes]
    elif grid == "walks":  # the residual plus update after 9 steps of +-rate
        arrays = [(rng.choice([-1, 1], (9, n)).sum(0) * rate).astype("float32") for n in sizes]
    elif grid == "mostly_zero":  # 0.4% nonzero where the budget is 1%
        arrays = [np.where(rng.rand(n) < 0.004, rng.standard_normal(n), 0).astype("float32")
                  for n in sizes]
    else:  # an update at a learning rate of 0 (a schedule's warm-up from 0)
        arrays = [np.zeros(n, "float32") for n in sizes]
    budgets = [n // 100 for n in sizes]
    drawn = []

    def magnitudes_at(j, sample):
        magnitudes = tf.abs(tf.constant(arrays[j]))
        taken = magnitudes if sample is None else sample(magnitudes)
        drawn.append(taken.numpy())
        return taken

    cut = np.float32(model_budget.model_wide_cut(magnitudes_at, sizes, budgets))
    sample = np.concatenate(drawn)
    want = sum(budgets) if len(sample) == sum(sizes) else int(
        np.ceil(sum(budgets) / sum(sizes) * len(sample)))
    kth = np.sort(sample)[::-1][want - 1]
    at_or_above, above = int(np.sum(sample >= kth)), int(np.sum(sample > kth))
    if at_or_above - want > want - above:
        # the float above, at least the smallest normal one
        assert cut == max(np.nextafter(kth, np.float32(np.inf)),
                          np.finfo(np.float32).tiny), (cut, kth)
    else:
        assert cut == kth
    magnitudes = np.abs(np.concatenate(arrays))
    sent = int(np.sum(magnitudes >= cut))
    # what the selection's kernel sends at that cut (TensorFlow's CPU kernels flush subnormals
    # to zero: a cut just above 0 must be a normal float)
    selected = sum(int(tf.size(model_budget.AtOrAbove(tf.constant(cut))(tf.constant(a), 0)
                               .indices)) for a in arrays)
    fused = [model_budget.AtOrAbove(tf.constant(cut)).fused_compensate_select(
        tf.constant(a), tf.zeros_like(tf.constant(a))) for a in arrays]
    assert selected == sent
    assert sum(int(tf.size(selection.indices)) for selection, _ in fused) == sent
    if grid in ("signs", "zeros"):  # all tied: nothing (nearer 1% than everything is)
        assert sent == 0
    elif grid == "mostly_zero":  # the nonzeros, not every zero
        assert sent == sum(int(np.count_nonzero(a)) for a in arrays)
    else:  # the walk's top level |sum| = 9 (2 / 512 of the entries), not down to 7 (20 / 512)
        assert abs(sent / sum(sizes) - 2 / 512) < 0.001, sent


MLP_SIZES = (131_072, 2_048, 4_194_304, 2_048, 20_480, 10)  # the 4.35M MLP's variables


@pytest.mark.parametrize("sizes,share,binds", [
    (MLP_SIZES, 0.01, "ABOVE"), (MLP_SIZES, 0.001, "MOST_SAMPLED"),
    ((2_990_000, 10_000), 0.001, "FEWEST_ABOVE")])
def test_the_model_wide_cut_samples_at_most_an_eighth_where_that_keeps_enough(sizes, share,
                                                                               binds):
    """The sample holds about ABOVE / share entries (ABOVE of them then pass the cut), but
    where that is more than MOST_SAMPLED of the model, only that share, as long as at least
    FEWEST_ABOVE would pass: on the MLP at 1% 205k entries (ABOVE decides), at 0.1% 544k
    where ABOVE alone would read 2.05M, 47% (the eighth decides: 544 pass), on a 3M model at
    0.1% 512k (an eighth would keep 375 above the cut: FEWEST_ABOVE decides). Counted from the
    strides the cut asks the native sample for, as its blocks (``sampled_blocks``) take them
    (a sample over about a fifth of a variable reads all of it: its stride is one block)."""
    from sparse_hvd.selection import model_budget

    entries = sum(sizes)
    asked = []

    def drawn(strides):
        return sum(max(n // int(s), 1) * model_budget.BLOCK for n, s in zip(sizes, strides))

    def sampled_all(strides):
        asked.append(strides.numpy())
        return tf.ones([drawn(asked[-1])])

    budgets = [max(1, int(share * n)) for n in sizes]
    model_budget.model_wide_cut(None, sizes, budgets, sampled_all)
    share = sum(budgets) / entries  # the cut's own share: the budgets' sum over the entries
    bounds = {"ABOVE": model_budget.ABOVE / share,
              "MOST_SAMPLED": model_budget.MOST_SAMPLED * entries,
              "FEWEST_ABOVE": model_budget.FEWEST_ABOVE / share}
    wanted = min(bounds["ABOVE"], max(bounds["MOST_SAMPLED"], bounds["FEWEST_ABOVE"]))
    assert wanted == bounds[binds] and wanted < entries
    # sample_stride rounds each stride down (to no factor 2 or 3), so a little more is read
    assert wanted <= drawn(asked[0]) <= 1.25 * wanted, (drawn(asked[0]), wanted)


@pytest.mark.parametrize("count,n", [(1000, 4_194_304), (65_536, 65_536), (7, 10),
                                     (1, 1), (300, 2_000), (205, 4_194_304), (3, 100)])
def test_the_sampled_blocks_number_at_least_count_and_cover_every_column(count, n):
    """The blocks start BLOCK x s apart, s the largest at most n // (count + BLOCK) without
    a factor 2 or 3; a variable shorter than that gives its first block."""
    from sparse_hvd.selection import model_budget

    block = model_budget.BLOCK
    stride = int(model_budget.sample_stride(count, n))
    fits = [s for s in range(1, max(n // (count + block), 1) + 1) if s % 2 and s % 3]
    assert stride == block * max(fits)
    flat = np.arange(n, dtype=np.float32)
    taken = model_budget.sampled_blocks(tf.constant(flat), tf.constant(stride, tf.int64)).numpy()
    starts = range(0, max(n // stride, 1) * stride, stride)
    expected = np.concatenate([flat[s:s + block] for s in starts])
    np.testing.assert_array_equal(taken, expected)
    assert len(taken) >= min(count, n)  # at least the samples asked for
    # a 2048-wide matrix (and a 3 x 3 x 64 x 96 kernel's 96): every column, evenly
    for row in (2048, 96):
        if len(taken) >= 4 * row:
            columns = np.bincount(taken.astype(np.int64) % row, minlength=row)
            assert columns.min() > 0 and columns.max() <= 2 * columns.min()


def test_the_strides_of_many_variables_at_once_are_each_variables_own():
    """``sample_stride`` is elementwise: a vector of counts and lengths gives each pair's
    scalar stride."""
    from sparse_hvd.selection import model_budget

    pairs = [(1000, 4_194_304), (65_536, 65_536), (7, 10), (1, 1), (300.5, 2_000), (3, 100)]
    strides = model_budget.sample_stride(tf.constant([c for c, _ in pairs], tf.float64),
                                         tf.constant([n for _, n in pairs], tf.int64)).numpy()
    assert strides.tolist() == [int(model_budget.sample_stride(c, n)) for c, n in pairs]


def test_the_model_wide_cut_of_a_small_model_is_exact():
    from sparse_hvd.selection import model_budget

    rng = np.random.RandomState(3)
    arrays = [rng.standard_normal(n).astype("float32") for n in (40_000, 20_000)]
    def magnitudes_at(j, sample):
        magnitudes = tf.abs(tf.constant(arrays[j]))
        return magnitudes if sample is None else sample(magnitudes)

    cut = float(model_budget.model_wide_cut(magnitudes_at, (40_000, 20_000), [400, 200]))
    assert cut == np.sort(np.abs(np.concatenate(arrays)))[::-1][599]


@pytest.mark.convergence_defaults
def test_the_default_budget_is_model_wide_except_where_layers_are_sized_alone():
    def made(**kwargs):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), **kwargs)

    assert made().budget == "model"
    assert made(exchange="sparse_allreduce").budget == "model"
    assert made(grouping="layerwise").budget == "layer"  # the model-wide cut would wait
    assert made(density=sparse_hvd.AdaptiveDensity()).budget == "layer"
    assert made(budget="layer").budget == "layer"
    assert made(grouping="layerwise", budget="model").budget == "model"
    config = made().get_config()
    assert config["budget"] == "model"
    assert sparse_hvd.SparseDistributedOptimizer.from_config(config).budget == "model"
    del config["budget"]  # a config written before the option existed: as it ran
    assert sparse_hvd.SparseDistributedOptimizer.from_config(config).budget == "layer"
    with pytest.raises(ValueError, match="`budget` must be 'layer' or 'model'"):
        made(budget="global")


@pytest.mark.convergence_defaults
def test_the_default_exchange_is_the_timed_choice_and_round_trips():
    from sparse_hvd.steps import MeasuredChoiceStep, SynchronousStep

    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), density=0.01)
    # None is kept as given: with Adam it means signs (tests/test_sign_exchange.py)
    assert optimizer.exchange is None and isinstance(optimizer._step, MeasuredChoiceStep)
    config = optimizer.get_config()
    assert config["exchange"] is None
    clone = sparse_hvd.SparseDistributedOptimizer.from_config(config)
    assert clone.exchange is None and isinstance(clone._step, MeasuredChoiceStep)
    named = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), exchange="auto")
    assert isinstance(named._step, MeasuredChoiceStep) and named.get_config()["exchange"] == "auto"
    fixed = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), exchange="allgather")
    assert type(fixed._step) is SynchronousStep
    # one worker: nothing to choose, the step is the allgather's and no collective runs
    variable = keras.Variable(np.zeros(SHAPE, "float32"))
    optimizer.apply([tf.ones(SHAPE)], [variable])
    assert optimizer.layer_stats()[variable.path]["exchange"] == "allgather"
    assert len(optimizer._step.plans) == 1


@pytest.mark.convergence_defaults
def test_the_default_cuts_the_update_of_every_optimizer_with_state_and_plain_sgds_gradient():
    def cut(inner, **options):
        return sparse_hvd.SparseDistributedOptimizer(inner, **options).sparsify

    assert cut(keras.optimizers.Adam()) == "update"
    assert cut(keras.optimizers.AdamW()) == "update"  # a subclass of Adam
    assert cut(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())) == "update"
    assert cut(keras.optimizers.SGD(0.1, momentum=0.9)) == "update"
    assert cut(keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True)) == "update"
    assert cut(keras.optimizers.RMSprop()) == "update"
    assert cut(keras.optimizers.Lion()) == "update"
    assert cut(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))) == "update"
    # plain SGD's step is the gradient times the learning rate: nothing to gain, copies to pay
    assert cut(keras.optimizers.SGD(0.1)) == "gradient"
    assert cut(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))) == "gradient"
    assert cut(keras.optimizers.Adam(), sparsify="gradient") == "gradient"
    assert cut(keras.optimizers.SGD(0.1), sparsify="update") == "update"
    # momentum correction (SGD) is not refused by the default
    assert cut(keras.optimizers.SGD(0.1), momentum_correction=0.9) == "gradient"
    config = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.Adam()).get_config()
    assert config["sparsify"] == "update"
    assert sparse_hvd.SparseDistributedOptimizer.from_config(config).sparsify == "update"
    del config["sparsify"], config["second_moment"]  # written before the options existed:
    # it reloads as it ran
    assert sparse_hvd.SparseDistributedOptimizer.from_config(config).sparsify == "gradient"


@pytest.mark.convergence_defaults
def test_the_default_takes_larger_sparse_steps_under_sgd_momentum_rmsprop_and_adagrad_only():
    from sparse_hvd.selection.defaults import SGD_UPDATE_SCALE

    def scale(inner, **options):
        return sparse_hvd.SparseDistributedOptimizer(inner, **options).update_scale

    momentum = keras.optimizers.SGD(0.1, momentum=0.9)
    assert SGD_UPDATE_SCALE == (1.5, 2.0)  # larger at the peak rate, larger still as it falls
    assert scale(momentum) == SGD_UPDATE_SCALE
    assert scale(keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True)) == SGD_UPDATE_SCALE
    assert scale(keras.optimizers.LossScaleOptimizer(momentum)) == SGD_UPDATE_SCALE
    assert scale(momentum, exchange="sparse_allreduce", warmup_steps=0) == SGD_UPDATE_SCALE
    # below 1% the factor at the peak rate rises to the end's 2.0 at 0.1%, linearly in the
    # density's logarithm; the warm-up get_config writes for a number counts as the number
    assert scale(momentum, density=0.001) == 2.0
    assert scale(momentum, density=0.0001) == 2.0
    assert scale(momentum, density=0.005) == (round(1.5 + 0.5 * math.log10(2), 2), 2.0)
    assert scale(momentum, density=WarmupDensity(0.001, 0.1, 400)) == 2.0
    # what was not measured keeps every step at the rate: above 1%, a policy of one's own
    assert scale(momentum, density=0.05) == 1.0
    assert scale(momentum, density=WarmupDensity(0.001, 0.1, 300)) == 1.0
    assert scale(momentum, density=0.001, update_scale=1.0) == 1.0  # the behaviour before
    assert scale(momentum, exchange="sign") == 1.0  # every entry's sign, not the top entries
    assert scale(momentum, exchange="topk_sign") == 1.0
    assert scale(keras.optimizers.SGD(0.1)) == 1.0  # the gradient cut
    assert scale(keras.optimizers.Adam()) == 1.0
    # RMSprop takes SGD's momentum's factor at each density (this release; 1.0 before)
    rmsprop = keras.optimizers.RMSprop()
    assert scale(rmsprop) == SGD_UPDATE_SCALE
    assert scale(keras.optimizers.LossScaleOptimizer(rmsprop)) == SGD_UPDATE_SCALE
    assert scale(rmsprop, density=0.001) == 2.0
    assert scale(rmsprop, density=0.05) == 1.0
    assert scale(rmsprop, update_scale=1.0) == 1.0  # the behaviour before
    # ... and so does Adagrad (this release; 1.0 before); an optimizer not measured keeps 1.0
    adagrad = keras.optimizers.Adagrad()
    assert scale(adagrad) == SGD_UPDATE_SCALE
    assert scale(keras.optimizers.LossScaleOptimizer(adagrad)) == SGD_UPDATE_SCALE
    assert scale(adagrad, density=0.001) == 2.0
    assert scale(adagrad, update_scale=1.0) == 1.0  # the behaviour before
    assert scale(keras.optimizers.Nadam()) == 1.0
    assert scale(keras.optimizers.Adamax()) == 1.0
    assert scale(keras.optimizers.Lion()) == 1.0  # measured: the factor 3 helped only the CNN
    assert scale(momentum, update_scale=1.0) == 1.0  # the behaviour before the default
    assert scale(momentum, update_scale=1.5) == 1.5  # the previous release's default
    # the resolved factor is saved; a config written before the option reloads at 1.0
    config = sparse_hvd.SparseDistributedOptimizer(momentum).get_config()
    assert config["update_scale"] == SGD_UPDATE_SCALE
    assert sparse_hvd.SparseDistributedOptimizer.from_config(config).update_scale == SGD_UPDATE_SCALE
    del config["update_scale"]
    assert sparse_hvd.SparseDistributedOptimizer.from_config(config).update_scale == 1.0
    config = sparse_hvd.SparseDistributedOptimizer(momentum, density=0.001).get_config()
    assert config["update_scale"] == 2.0
    restored = sparse_hvd.SparseDistributedOptimizer.from_config(config)
    assert restored.update_scale == 2.0 and restored.warmup_steps == 400
