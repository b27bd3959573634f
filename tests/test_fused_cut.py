"""The update cut's local SGD step, compensation and model-wide cut in one native pass
(``sparse_hvd.feedback.fused_cut``, ``kernels/local_sgd_cut.cc``) against the ops it replaces
(``SparseHvdLocalSgd``, ``SparseHvdSampledMagnitudes``, ``SparseHvdCompensateCut``): the same
sample, selection, remainder and velocity, bit for bit; whole training steps the same bits as
the unfused path's; a non-finite gradient skips the step on both; the unfused path wherever
the fused one would not compute the same."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from helpers import native_op
from sparse_hvd import kernels
from sparse_hvd.selection import model_budget

# lengths: shorter than a block, shorter than its stride, a whole number of strides and not
SIZES = [7, 100, 3 * 4096, 3 * 4096 + 5, 65_536 + 3]
STRIDES = [0, 16 * 11, 16, 16 * 5, 16 * 7]
MOMENTUM = [0.05, 0.9, 0.0, 0.0]  # learning rate, momentum, decayed, weight decay
DECAYED = [0.05, 0.9, 1.0, 0.01]


def _bits(array):
    return np.atleast_1d(np.asarray(array)).view(np.uint8)


def _arrays(seed, sizes=SIZES, scale=1.0):
    rng = np.random.RandomState(seed)
    return [(scale * rng.randn(n)).astype("float32") for n in sizes]


def test_the_sample_is_the_unfused_sample_bit_for_bit():
    """``SparseHvdSampledLocalSgd`` against ``SparseHvdLocalSgd``'s updates sampled by
    ``SparseHvdSampledMagnitudes``: with momentum, with Nesterov's, without (no velocities),
    one variable decayed and the others not, a NaN gradient carried through; every stride set
    of the model-wide cut's (sampled, every entry, one block of each variable)."""
    sample = native_op(kernels.sampled_local_sgd)
    local, magnitudes = kernels.local_sgd(), kernels.sampled_magnitudes()
    grads, momenta, weights, residuals = (_arrays(seed) for seed in (1, 2, 3, 4))
    grads[1][3] = np.nan
    coefficients = [DECAYED if v == 2 else MOMENTUM for v in range(len(SIZES))]
    for momentum, nesterov in ((True, False), (True, True), (False, False)):
        updates = [local(tf.constant(g), tf.constant(m if momentum else np.zeros(0, "float32")),
                         tf.constant(w), tf.constant(c), nesterov=nesterov)[0]
                   for g, m, w, c in zip(grads, momenta, weights, coefficients)]
        for strides in (STRIDES, [0] * len(SIZES), [16 * 4097] * len(SIZES)):
            strides = tf.constant(strides, tf.int64)
            want = magnitudes(gradients=updates, residuals=[tf.constant(r) for r in residuals],
                              strides=strides, block=model_budget.BLOCK)
            got = sample(
                gradients=[tf.constant(g) for g in grads],
                momenta=[tf.constant(m if momentum else np.zeros(0, "float32")) for m in momenta],
                weights=[tf.constant(w) for w in weights],
                residuals=[tf.constant(r) for r in residuals],
                coefficients=tf.constant(np.concatenate(coefficients), tf.float32),
                strides=strides, block=model_budget.BLOCK, nesterov=nesterov)
            assert got.shape == want.shape
            np.testing.assert_array_equal(_bits(got), _bits(want))
            assert np.isnan(got.numpy()).any()  # the NaN gradient's entry, where sampled


@pytest.mark.parametrize("nesterov,coefficients", [(False, MOMENTUM), (True, DECAYED),
                                                   (False, [0.05, 0.0, 0.0, 0.0])])
def test_the_cut_is_the_local_step_then_compensate_cut_bit_for_bit(nesterov, coefficients):
    """``SparseHvdLocalSgdCut`` against ``SparseHvdLocalSgd`` then ``SparseHvdCompensateCut``
    at a cut passing about 1% (130,000 entries: two shards and a partial one): the velocity,
    the remainder, the positions and values; then the flags: a NaN gradient makes both false,
    an update that overflows only with its residual makes only ``finite`` false."""
    fused = native_op(kernels.local_sgd_cut)
    local, cut_op = kernels.local_sgd(), kernels.compensate_cut()
    n = 130_000
    grad, momentum, weights, residual = _arrays(5, [n] * 4)
    if coefficients[1] == 0.0:
        momentum = np.zeros(0, "float32")

    def both(grad, residual, cut):
        update, velocity, update_finite = local(
            tf.constant(grad), tf.constant(momentum), tf.constant(weights),
            tf.constant(coefficients), nesterov=nesterov)
        remainder, indices, values, _, finite = cut_op(
            update, tf.constant(residual), cut, tf.constant(n, tf.int64))
        unfused = (velocity, remainder, indices, values, update_finite, finite)
        return unfused, fused(tf.constant(grad), tf.constant(momentum), tf.constant(weights),
                              tf.constant(residual), tf.constant(coefficients), cut,
                              nesterov=nesterov)

    update = local(tf.constant(grad), tf.constant(momentum), tf.constant(weights),
                   tf.constant(coefficients), nesterov=nesterov)[0].numpy()
    cut = tf.constant(np.quantile(np.abs(update + residual), 0.99), tf.float32)
    unfused, got = both(grad, residual, cut)
    assert 1_000 <= got[2].shape[0] <= 1_600
    for part, (a, b) in enumerate(zip(got, unfused)):
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"output {part}")
    assert bool(got[4]) and bool(got[5])
    nan_grad = grad.copy()
    nan_grad[77_777] = np.nan
    big_grad = grad.copy()
    big_grad[5] = 1e34  # an update of about 1e33: finite, but not once added to the largest
    big_update = local(tf.constant(big_grad), tf.constant(momentum), tf.constant(weights),
                       tf.constant(coefficients), nesterov=nesterov)[0].numpy()[5]
    huge = residual.copy()
    huge[5] = np.copysign(np.finfo(np.float32).max, big_update)
    for bad_grad, bad_residual, flags in ((nan_grad, residual, (False, False)),
                                          (big_grad, huge, (True, False))):
        unfused, got = both(bad_grad, bad_residual, cut)
        assert (bool(got[4]), bool(got[5])) == flags
        assert (bool(unfused[4]), bool(unfused[5])) == flags


def _train(make_inner, native, steps=4, sizes=((600, 500), (5000,), (40,)), nan_step=None,
           **options):
    """``steps`` steps of one worker, the wrapper with ``options``: the weights, residuals and
    inner optimizer state after them, and the op types of the step's graph. ``native`` False
    runs the unfused path (no fused op)."""
    getter = kernels.local_sgd_cut
    if not native:
        kernels.local_sgd_cut = lambda: None
    try:
        rng = np.random.RandomState(8)
        variables = [keras.Variable(rng.randn(*shape).astype("float32")) for shape in sizes]
        optimizer = sparse_hvd.SparseDistributedOptimizer(
            make_inner(), **{"density": 0.01, "warmup_steps": 0, "budget": "model", **options})

        @tf.function(jit_compile=False)
        def step(*grads):
            optimizer.apply_gradients(zip(grads, variables))

        for t in range(steps):
            grads = [rng.randn(*v.shape).astype("float32") for v in variables]
            if t == nan_step:
                grads[0][1, 2] = np.nan
            step(*[tf.constant(g) for g in grads])
        definition = step.get_concrete_function(
            *[tf.TensorSpec(v.shape, tf.float32) for v in variables]).graph.as_graph_def()
        types = {node.op for node in definition.node}
        for function in definition.library.function:  # the bodies of conditionals
            types |= {node.op for node in function.node_def}
        state = [v.numpy() for v in variables + list(optimizer.residuals)
                 + list(optimizer.inner_optimizer.variables)]
        return state, types
    finally:
        kernels.local_sgd_cut = getter


INNERS = {
    "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "nesterov_decay_schedule": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=2, decay_rate=0.5),
        momentum=0.8, nesterov=True, weight_decay=0.01),
    "plain": lambda: keras.optimizers.SGD(0.05),
}


@pytest.mark.parametrize("sizes", [((600, 500), (5000,), (40,)), ((100, 200), (3000,))],
                         ids=["sampled_cut", "exact_cut"])
@pytest.mark.parametrize("inner", sorted(INNERS))
def test_training_steps_are_the_unfused_steps_bit_for_bit(inner, sizes):
    """Four steps with the default exchange's settings (the update cut, one budget for the
    model): weights, residuals, velocities and step count the same bits by the fused pass as
    by the unfused ops, with the model-wide cut sampled and exact; the fused step's graph has
    the fused ops and none of those it replaces, the unfused one the opposite."""
    native_op(kernels.local_sgd_cut)
    fused, fused_types = _train(INNERS[inner], True, sizes=sizes, sparsify="update")
    unfused, unfused_types = _train(INNERS[inner], False, sizes=sizes, sparsify="update")
    assert {"SparseHvdLocalSgdCut", "SparseHvdSampledLocalSgd"} <= fused_types
    assert not {"SparseHvdLocalSgd", "SparseHvdCompensateCut"} & fused_types
    assert "SparseHvdLocalSgdCut" not in unfused_types
    assert {"SparseHvdLocalSgd", "SparseHvdCompensateCut"} <= unfused_types
    for part, (a, b) in enumerate(zip(fused, unfused)):
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"state {part}")
    assert np.count_nonzero(fused[len(sizes)]) > 0  # residuals kept something


@pytest.mark.parametrize("inner,exchange", [("momentum", "topk_sign"),
                                            ("nesterov_decay_schedule", "topk_sign"),
                                            ("momentum", "topk_sign_pairs")])
def test_the_signs_of_the_rest_take_the_fused_remainder_bit_for_bit(inner, exchange):
    """``exchange="topk_sign"`` (and its pairs): its signs of the rest come from the fused
    pass's remainders (``SignsOfTheRest.after_fused_cut``), and four steps leave the same bits
    as the unfused ops (the local step, the compensate-and-cut, then the signs), the signs
    taken on both."""
    native_op(kernels.local_sgd_cut)
    fused, fused_types = _train(INNERS[inner], True, sparsify="update", exchange=exchange)
    unfused, unfused_types = _train(INNERS[inner], False, sparsify="update", exchange=exchange)
    assert {"SparseHvdLocalSgdCut", "SparseHvdSignsOfRest"} <= fused_types
    assert not {"SparseHvdLocalSgd", "SparseHvdCompensateCut"} & fused_types
    assert {"SparseHvdLocalSgd", "SparseHvdCompensateCut", "SparseHvdSignsOfRest"} <= (
        unfused_types)
    for part, (a, b) in enumerate(zip(fused, unfused)):
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"state {part}")
    assert np.count_nonzero(fused[3]) > 0  # residuals kept something


def test_a_nonfinite_gradient_skips_the_step_on_both_paths():
    """A NaN in the second step's gradient: that step moves nothing (weights, residuals,
    velocities and step count as after the first, the default ``nonfinite``), on the fused
    path as on the unfused one, and the steps after it go on the same on both."""
    native_op(kernels.local_sgd_cut)
    make = INNERS["momentum"]
    one, _ = _train(make, True, steps=1)
    skipped, _ = _train(make, True, steps=2, nan_step=1)
    for part, (a, b) in enumerate(zip(skipped, one)):
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"state {part}")
    fused, _ = _train(make, True, steps=4, nan_step=1)
    unfused, _ = _train(make, False, steps=4, nan_step=1)
    for part, (a, b) in enumerate(zip(fused, unfused)):
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"state {part}")


@pytest.mark.parametrize("make,options,why", [
    (INNERS["momentum"], {"budget": "layer"}, "a budget per layer"),
    (INNERS["momentum"], {"compression": "float16"}, "16-bit rounding of what is sent"),
    (lambda: type("MySGD", (keras.optimizers.SGD,), {})(0.05, momentum=0.9), {},
     "an SGD subclass"),
    (lambda: keras.optimizers.Adam(1e-3), {"exchange": "allgather"}, "Adam"),
    (INNERS["momentum"], {"exchange": "topk_sign2"}, "two levels of signs"),
])
def test_the_unfused_path_runs_where_the_fused_one_would_differ(make, options, why):
    native_op(kernels.local_sgd_cut)
    _, types = _train(make, True, steps=1, sparsify="update", **options)
    assert "SparseHvdLocalSgdCut" not in types, why


def test_bad_input_is_refused_with_a_message_naming_it():
    cut = native_op(kernels.local_sgd_cut)
    sample = kernels.sampled_local_sgd()
    ones = tf.ones([10])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="gradient, weights and residual must have as many entries"):
        cut(ones, ones, ones, tf.ones([9]), tf.constant(MOMENTUM), 1.0, nesterov=False)
    with pytest.raises(tf.errors.InvalidArgumentError, match="coefficients must hold 4 values"):
        cut(ones, ones, ones, ones, tf.ones([3]), 1.0, nesterov=False)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="m must be empty or have as many entries"):
        cut(ones, tf.ones([4]), ones, ones, tf.constant(MOMENTUM), 1.0, nesterov=False)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="variable 1: 0 entries in input group 1 where 5 are needed"):
        sample(gradients=[ones, tf.ones([5])], momenta=[ones, tf.zeros([0])],
               weights=[ones, tf.ones([5])], residuals=[ones, tf.ones([5])],
               coefficients=tf.ones([8]), strides=tf.zeros([2], tf.int64), block=16,
               nesterov=False)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="coefficients must hold 4 values for each of 2 variables"):
        sample(gradients=[ones, ones], momenta=[ones, ones], weights=[ones, ones],
               residuals=[ones, ones], coefficients=tf.ones([4]),
               strides=tf.zeros([2], tf.int64), block=16, nesterov=False)


@pytest.mark.parametrize("quantile", [0.99, 0.7, 0.0])
def test_both_cut_ops_select_what_numpy_selects_at_any_density(quantile):
    """``SparseHvdCompensateCut`` and ``SparseHvdLocalSgdCut`` against NumPy's cut of c = u + r
    where from 1% to nearly every entry passes, so that blocks of 16 hold one, several or 16
    passing entries (``kernels/passed_mask.h``): the positions ascending, the values, the
    remainder zeroed there; over two shards and a partial block; a NaN never passes."""
    compensate, fused = native_op(kernels.compensate_cut), native_op(kernels.local_sgd_cut)
    local = kernels.local_sgd()
    n = 2 * 65_536 + 37
    grad, momentum, weights, residual = _arrays(7, [n] * 4)
    grad[40_001] = np.nan
    update = local(tf.constant(grad), tf.constant(momentum), tf.constant(weights),
                   tf.constant(MOMENTUM), nesterov=False)[0].numpy()
    for name, c, run in (
            ("compensate_cut", grad + residual,
             lambda cut: compensate(tf.constant(grad), tf.constant(residual), cut,
                                    tf.constant(n, tf.int64))[:3]),
            ("local_sgd_cut", update + residual,
             lambda cut: fused(tf.constant(grad), tf.constant(momentum), tf.constant(weights),
                               tf.constant(residual), tf.constant(MOMENTUM), cut,
                               nesterov=False)[1:4])):
        cut = np.float32(np.nanquantile(np.abs(c), quantile))
        passed = np.abs(c) >= cut  # False for the NaN
        assert 0.005 * n < passed.sum() <= n - 1
        remainder, indices, values = run(tf.constant(cut))
        np.testing.assert_array_equal(indices.numpy(), np.flatnonzero(passed), err_msg=name)
        np.testing.assert_array_equal(_bits(values), _bits(c[passed]), err_msg=name)
        np.testing.assert_array_equal(_bits(remainder), _bits(np.where(passed, np.float32(0), c)),
                                      err_msg=name)
