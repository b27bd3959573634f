"""The model-wide budget's sample taken by one native op (``SparseHvdSampledMagnitudes``):
the same bits as the TensorFlow ops per variable, the same cut, the same training step."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from sparse_hvd import kernels
from sparse_hvd.selection import model_budget
from sparse_hvd.selection.order_statistics import kth_largest
from helpers import native_op

# lengths: shorter than a block, shorter than its stride, a whole number of strides and not
SIZES = [7, 100, 3 * 4096, 3 * 4096 + 5, 65_536 + 3]
STRIDES = [0, 16 * 11, 16, 16 * 5, 16 * 7]


def _arrays(seed=2):
    rng = np.random.RandomState(seed)
    grads = [rng.randn(n).astype("float32") for n in SIZES]
    residuals = [rng.randn(n).astype("float32") for n in SIZES]
    grads[1][3] = np.nan  # carried through as the TensorFlow ops carry it
    return grads, residuals


def _reference(grads, residuals, strides):
    """The TensorFlow path: each variable's |g + r| at ``sampled_blocks`` (stride 0: all)."""
    parts = []
    for g, r, stride in zip(grads, residuals, strides):
        flat = tf.abs(tf.constant(g) + tf.constant(r))
        parts.append(flat if stride == 0 else
                     model_budget.sampled_blocks(flat, tf.constant(stride, tf.int64)))
    return tf.concat(parts, 0).numpy()


def _native(op, grads, residuals, strides):
    """The native op's sample of NumPy ``grads`` and ``residuals`` (a tensor)."""
    return op(gradients=[tf.constant(g) for g in grads],
              residuals=[tf.constant(r) for r in residuals],
              strides=tf.cast(strides, tf.int64), block=model_budget.BLOCK)


def test_the_native_sample_is_the_tensorflow_ops_bit_for_bit():
    op = native_op(kernels.sampled_magnitudes)
    grads, residuals = _arrays()
    for strides in (STRIDES, [0] * len(SIZES), [16 * 4097] * len(SIZES)):
        got = _native(op, grads, residuals, strides).numpy()
        want = _reference(grads, residuals, strides)
        assert got.shape == want.shape, strides
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("strides,residual_sizes,message", [
    ([0, -16], [3, 40], r"strides\[1\] = -16 is negative"),
    ([0, 16], [3, 39], r"residuals\[1\] has 39 entries, gradients\[1\] 40"),
    ([0], [3, 40], "strides must be a vector of 2 entries"),
])
def test_the_native_sample_refuses_bad_input_naming_it(strides, residual_sizes, message):
    op = native_op(kernels.sampled_magnitudes)
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        op(gradients=[tf.zeros([3]), tf.zeros([40])],
           residuals=[tf.zeros([n]) for n in residual_sizes],
           strides=tf.constant(strides, tf.int64), block=16)


@pytest.mark.parametrize("budget", [50, 2_000])  # sampled, and exact (K under ABOVE)
def test_the_model_wide_cut_is_the_same_with_the_native_sample(budget):
    op = native_op(kernels.sampled_magnitudes)
    grads, residuals = _arrays(seed=4)
    grads[1][3] = 0.0  # a NaN would make the cut NaN either way

    def magnitudes_at(j, sample):
        flat = tf.constant(grads[j]) + tf.constant(residuals[j])
        return tf.abs(flat if sample is None else sample(flat))

    def sampled_all(strides):
        return _native(op, grads, residuals, strides)

    budgets = [max(1, budget * n // sum(SIZES)) for n in SIZES]
    plain = model_budget.model_wide_cut(magnitudes_at, SIZES, budgets)
    native = model_budget.model_wide_cut(magnitudes_at, SIZES, budgets, sampled_all)
    assert float(native) == float(plain) > 0


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("k", [1, 2_050, 40_000, 205_000])
def test_the_kth_largest_sample_is_the_same_by_selection_and_by_top_k(k, dtype, monkeypatch):
    """``order_statistics.kth_largest`` (the model-wide cut's, ``ApproxTopK``'s and the band
    cut's): the native selection and ``tf.math.top_k``'s least give numpy's k-th largest,
    with ties (a quarter of the samples rounded to one decimal); 16-bit values take top_k."""
    native_op(kernels.kth_largest)
    rng = np.random.RandomState(11)
    values = np.abs(rng.standard_cauchy(205_000)).astype(dtype)
    values[::4] = np.round(values[::4], 1)
    want = np.sort(values)[::-1][k - 1]
    native = kth_largest(tf.constant(values), tf.constant(k))
    assert model_budget.kth_largest is kth_largest  # the cut's
    monkeypatch.setattr(kernels, "kth_largest", lambda: None)
    plain = kth_largest(tf.constant(values), tf.constant(k))
    assert native.dtype == plain.dtype == tf.as_dtype(dtype)
    assert float(native) == float(plain) == want
    half = values.astype("float16")
    monkeypatch.setattr(kernels, "kth_largest", lambda: pytest.fail("native op on 16 bits"))
    got = kth_largest(tf.constant(half), tf.constant(k))
    assert float(got) == float(np.sort(half)[::-1][k - 1])


def test_a_model_budget_step_is_the_same_with_and_without_the_native_sample(monkeypatch):
    """Three steps of one worker with ``budget="model"``: the weights and residuals are the
    same bits whether the sample is native or TensorFlow's."""
    native_op(kernels.sampled_magnitudes)
    real = kernels.sampled_magnitudes
    used = []

    def train(native):
        monkeypatch.setattr(kernels, "sampled_magnitudes",
                            lambda: used.append(native) or (real() if native else None))
        optimizer = sparse_hvd.SparseDistributedOptimizer(
            keras.optimizers.SGD(0.1), density=0.01, warmup_steps=0, budget="model")
        variables = [keras.Variable(np.zeros(n, "float32")) for n in (300_000, 5_000)]
        rng = np.random.RandomState(8)

        @tf.function(jit_compile=False)
        def step(a, b):
            optimizer.apply_gradients([(a, variables[0]), (b, variables[1])])

        for _ in range(3):
            step(tf.constant(rng.randn(300_000).astype("float32")),
                 tf.constant(rng.randn(5_000).astype("float32")))
        return [v.numpy() for v in variables + list(optimizer.residuals)]

    with_native, without = train(True), train(False)
    assert True in used and False in used  # both paths were asked for
    for a, b in zip(with_native, without):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    assert np.count_nonzero(with_native[0]) > 0


@pytest.mark.parametrize("native", [True, False])
def test_the_cut_selects_at_or_above_it_and_traces_no_fallback(native, monkeypatch):
    """``AtOrAbove`` (each variable's step under the model-wide cut): every entry with ``|g +
    r| >= cut``, ascending, with its value ``g + r``, and the remainder ``g + r`` with those
    zeroed (NumPy), by the native kernel and by TensorFlow ops. No count can be rejected, so
    the exact top-k fallback is not traced: no ``TopKV2`` and no conditional in the step's
    graph (that untaken branch was a sixth of the allgather's traced step)."""
    from sparse_hvd.selection.model_budget import AtOrAbove

    if native:
        native_op(kernels.compensate_cut)
    else:
        monkeypatch.setattr(kernels, "compensate_cut", lambda: None)
    n = 50_000
    rng = np.random.RandomState(3)
    g, r = rng.randn(n).astype("float32"), rng.randn(n).astype("float32")
    c = g + r
    cut = np.float32(np.quantile(np.abs(c), 0.99))
    sparsifier = AtOrAbove(tf.constant(cut))
    step = tf.function(sparsifier.fused_compensate_select)
    spec = tf.TensorSpec([n], tf.float32)
    types = {op.type for op in step.get_concrete_function(spec, spec).graph.get_operations()}
    assert "TopKV2" not in types and not types & {"If", "StatelessIf"}, sorted(types)
    selection, remainder = step(tf.constant(g), tf.constant(r))
    want = np.flatnonzero(np.abs(c) >= cut)
    assert 0 < want.size < n
    np.testing.assert_array_equal(selection.indices.numpy(), want)
    np.testing.assert_array_equal(selection.values.numpy(), c[want])
    expected = c.copy()
    expected[want] = 0
    np.testing.assert_array_equal(remainder.numpy(), expected)
