"""``exchange="sign"`` in one process: the sign words, the scaled-sign selection and its
residual, the settings it refuses (each naming the argument), its config and a one-worker step
in closed form. Every rank's part: tests/distributed/test_sign_exchange.py."""

import math
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import ml_dtypes

import sparse_hvd
from sparse_hvd.exchanges.sign import ScaledSign, SignAllgather, pack_signs, unpack_signs
from sparse_hvd.feedback.error_feedback import compensate_and_select


def block_signs(compensated, block):
    """NumPy: each block's mean magnitude (in float64, then float32; with ``block`` > 0
    rounded to bfloat16 by ml_dtypes), signed as ``compensated`` (an exact zero as +)."""
    n = compensated.size
    size = block or max(n, 1)
    scales = np.array([np.abs(compensated[b:b + size]).astype("float64").mean()
                       for b in range(0, n, size)], "float32")
    if block:
        scales = scales.astype(ml_dtypes.bfloat16).astype("float32")
    return np.where(compensated < 0, -1, 1) * np.repeat(scales, size)[:n]


@pytest.mark.parametrize("n", [1, 31, 32, 33, 100])
def test_sign_words_hold_one_bit_an_entry_little_endian_and_read_back(n):
    rng = np.random.RandomState(n)
    values = rng.randn(n).astype("float32")
    values[0] = 0.0  # + on the wire
    words = pack_signs(tf.constant(values)).numpy()
    assert words.shape == (math.ceil(n / 32),)
    bits = np.unpackbits(words.view("<u4").view(np.uint8), bitorder="little")[:n]
    np.testing.assert_array_equal(bits, (values < 0).astype(np.uint8))
    signs = unpack_signs(tf.constant(words[None, :]), n).numpy()
    np.testing.assert_array_equal(signs[0], np.where(values < 0, -1.0, 1.0))


def test_the_selection_is_every_entry_at_the_mean_magnitude_and_the_rest_is_kept():
    grad = tf.constant([0.5, -1.5, 0.0, 2.0])
    residual = tf.constant([0.5, 0.5, -0.25, 0.0])
    selection, remainder = compensate_and_select(grad, residual, ScaledSign(), k=1)
    compensated = np.array([1.0, -1.0, -0.25, 2.0], "float32")
    scale = np.mean(np.abs(compensated))  # 1.0625
    np.testing.assert_array_equal(selection.indices.numpy(), np.arange(4))
    np.testing.assert_array_equal(selection.values.numpy(), [scale, -scale, -scale, scale])
    np.testing.assert_array_equal(remainder.numpy(), compensated - selection.values.numpy())


@pytest.mark.parametrize("n", [1, 64, 150, 4096])
def test_a_scale_per_block_is_each_blocks_mean_magnitude_rounded_to_bfloat16(n, monkeypatch):
    """``ScaledSign(64)``: blocks of 64 entries, the last one shorter; the residual keeps the
    rounding (sent + residual == c); the native pass and the TensorFlow path."""
    from sparse_hvd import kernels

    rng = np.random.RandomState(n)
    grad, residual = (rng.randn(n).astype("float32") * 1e-3 for _ in range(2))
    compensated = grad + residual
    for native in (True, False):
        with monkeypatch.context() as patch:
            if not native:
                patch.setattr(kernels, "compensate_sign", lambda: None)
            selection, remainder = compensate_and_select(
                tf.constant(grad), tf.constant(residual), ScaledSign(64), k=1)
        sent = selection.values.numpy()
        np.testing.assert_allclose(sent, block_signs(compensated, 64), rtol=1e-6)
        np.testing.assert_array_equal(remainder.numpy(), compensated - sent)
        magnitudes = np.abs(sent)  # bfloat16 values, one per block
        np.testing.assert_array_equal(magnitudes.astype(ml_dtypes.bfloat16).astype("float32"),
                                      magnitudes)
        assert len(np.unique(magnitudes)) <= -(-n // 64)


@pytest.mark.parametrize("block", [0, 64])
def test_pack_then_unpack_averages_every_ranks_scaled_signs_in_rank_order(block, monkeypatch):
    """The native passes and the TensorFlow path: the same words, the same averages."""
    from sparse_hvd import kernels

    rng = np.random.RandomState(0)
    sizes = [200, 7]
    ranks = [[rng.randn(n).astype("float32") for n in sizes] for _ in range(3)]
    selected = [[ScaledSign(block)(tf.constant(v), 0) for v in rank] for rank in ranks]
    for native in (True, False):
        with monkeypatch.context() as patch:
            if not native:
                patch.setattr(kernels, "sign_pack", lambda: None)
                patch.setattr(kernels, "sign_sum", lambda: None)
            rows = tf.stack([SignAllgather.pack(rank, block) for rank in selected])
            averages = SignAllgather.unpack(rows, [tf.float32] * 2, sizes, block)
        # the scales (two float32 words; or 4 and 1 bfloat16 scales in 2 and 1 words), then
        # 7 and 1 words of signs
        assert rows.shape == (3, (2 if block == 0 else 3) + 7 + 1)
        if block:  # the bfloat16 bits of the first variable's first two scales, in one word
            word = rows.numpy()[0, :1].view("<u2")
            first = np.abs(selected[0][0].values.numpy())[[0, 64]].astype(ml_dtypes.bfloat16)
            np.testing.assert_array_equal(word, first.view("<u2"))
        for j in range(2):
            expected = np.zeros(sizes[j], "float32")
            for rank in selected:  # rank order, each rank's own scales
                expected += rank[j].values.numpy()
            np.testing.assert_array_equal(averages[j].numpy(), expected / np.float32(3))


@pytest.mark.parametrize("arguments,named", [
    ({"sparsifier": "randomk"}, "`sparsifier='randomk'`"),
    ({"budget": "model"}, "`budget='model'`"),
    ({"momentum_correction": 0.9}, "`momentum_correction=0.9`"),
    ({"dense_fallback": True}, "`dense_fallback=True`"),
    ({"grouping": "layerwise"}, "grouping='layerwise'"),
    ({"staleness": 1}, "`staleness`"),
    ({"density": sparse_hvd.AdaptiveDensity(0.01)}, "AdaptiveDensity"),
])
@pytest.mark.parametrize("exchange", ["sign", "sign_per_variable"])
def test_settings_the_sign_exchange_cannot_take_are_refused_by_name(arguments, named, exchange):
    with pytest.raises(ValueError, match=f"exchange='{exchange}'.*{re.escape(named)}|"
                                         f"{re.escape(named)}.*exchange='{exchange}'"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), exchange=exchange,
                                              **arguments)


def test_its_config_round_trips():
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.Adam(1e-3),
                                                      exchange="sign", name="signs")
    config = optimizer.get_config()
    clone = sparse_hvd.SparseDistributedOptimizer.from_config(config)
    assert clone.get_config() == config and clone.exchange == "sign"
    assert (clone.budget, clone.sparsify) == ("layer", "update")


def _chooses_signs(optimizer):
    return (isinstance(optimizer._selector, ScaledSign)
            and optimizer._exchange_candidates == ("sign", "dense"))


@pytest.mark.convergence_defaults
@pytest.mark.parametrize("inner", [keras.optimizers.Adam, keras.optimizers.AdamW])
def test_with_adam_the_default_exchange_chooses_between_signs_and_dense(inner):
    assert _chooses_signs(sparse_hvd.SparseDistributedOptimizer(inner(1e-3), density=0.01))
    optimizer = sparse_hvd.SparseDistributedOptimizer(inner(1e-3), name="adam_default")
    assert _chooses_signs(optimizer) and optimizer._exchange.method == "sign"
    assert type(optimizer._step).__name__ == "MeasuredChoiceStep"
    # nothing to warm up or to budget over the model; with Adam and AdamW (whose decay is
    # kept out of the correction), the noise estimate
    assert optimizer.budget == "layer" and optimizer.warmup_steps == 0
    assert type(optimizer.density_policy).__name__ == "ConstantDensity"
    assert optimizer.second_moment == "noise_estimate"
    config = optimizer.get_config()
    assert config["exchange"] is None
    clone = sparse_hvd.SparseDistributedOptimizer.from_config(config)
    assert _chooses_signs(clone) and clone.get_config() == config
    # a config saved when AdamW's default was its own second moment reloads with it
    config["second_moment"] = "own"
    assert sparse_hvd.SparseDistributedOptimizer.from_config(config).second_moment == "own"
    # AMSGrad's step divides by the largest v so far, which the factor does not know
    amsgrad = sparse_hvd.SparseDistributedOptimizer(inner(1e-3, amsgrad=True), name="ams")
    assert _chooses_signs(amsgrad) and amsgrad.second_moment == "own"


@pytest.mark.convergence_defaults
@pytest.mark.parametrize("inner,arguments", [
    (keras.optimizers.SGD, {}),  # plain SGD: the gradient cut, top-k
    (keras.optimizers.SGD, {"density": 0.01}),
    (lambda lr: keras.optimizers.SGD(lr, momentum=0.9), {}),
    (keras.optimizers.Nadam, {}),  # not measured: top-k
    (keras.optimizers.Adam, {"exchange": "auto"}),  # the previous default, by name
    (keras.optimizers.Adam, {"sparsify": "gradient"}),
    (keras.optimizers.Adam, {"budget": "model"}),
    (keras.optimizers.Adam, {"grouping": "layerwise"}),
    (keras.optimizers.Adam, {"staleness": 1}),
    (keras.optimizers.Adam, {"density": sparse_hvd.WarmupDensity(0.01)}),
    (keras.optimizers.Adam, {"density": 0.001}),  # a density of one's own: top-k at it
    (keras.optimizers.Adam, {"density": 1.0}),  # every entry exactly
    (keras.optimizers.Adam, {"sparsifier": "randomk"}),
])
def test_anything_else_keeps_top_k(inner, arguments):
    optimizer = sparse_hvd.SparseDistributedOptimizer(inner(1e-3), name="keeps", **arguments)
    assert not _chooses_signs(optimizer)
    assert "sign" not in optimizer._exchange_candidates
    assert optimizer.second_moment == "own"  # the noise estimate is measured with signs only


@pytest.mark.convergence_defaults
@pytest.mark.parametrize("exchange", ["sign", "sign_per_variable"])
def test_the_sign_exchange_named_with_adam_also_estimates_the_mean_gradients_noise(exchange):
    named = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.Adam(1e-3), exchange=exchange)
    assert named.second_moment == "noise_estimate"
    assert named._exchange_candidates == (exchange,)
    own = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.Adam(1e-3), exchange=exchange,
                                                second_moment="own")
    assert own.second_moment == "own"
    assert sparse_hvd.SparseDistributedOptimizer.from_config(
        own.get_config()).second_moment == "own"


@pytest.mark.parametrize("exchange,block", [("sign", 64), ("sign_per_variable", 0)])
@pytest.mark.parametrize("compression", ["none", "float16"])
@pytest.mark.parametrize("size", [1.0, 1e-6])
def test_one_worker_applies_its_own_scaled_signs_and_keeps_the_rest(compression, exchange,
                                                                    block, size):
    """With one worker no collective runs: SGD moves each entry of a cut variable by the
    learning rate times its block's mean magnitude, signed; a variable under ``min_elements``
    gets its gradient; the residual is what the signs left out. With float16 compression one
    scale per variable is rounded to float16 (an entry of 1e-6 is a float16 subnormal: a
    coarse scale), the blocks' bfloat16 scales are not."""
    big = (np.linspace(-1.0, 2.0, 2048) * size).astype("float32")  # cut: min_elements
    small = np.array([1.0, -2.0], "float32")
    variables = [keras.Variable(np.zeros_like(big)), keras.Variable(np.zeros_like(small))]
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.1), exchange=exchange, compression=compression,
        name="one_sign")
    optimizer.apply_gradients(zip([tf.constant(big), tf.constant(small)], variables))
    sent = block_signs(big, block).astype("float32")
    if compression == "float16":
        if not block:
            sent = sent.astype("float16").astype("float32")
        small = small.astype("float16").astype("float32")  # exact here
    assert len(np.unique(np.abs(sent))) == (32 if block else 1)
    np.testing.assert_allclose(variables[0].numpy(), -np.float32(0.1) * sent, rtol=1e-6)
    np.testing.assert_allclose(variables[1].numpy(), -0.1 * small, rtol=1e-6)
    np.testing.assert_allclose(optimizer.residuals[0].numpy(), big - sent, rtol=0,
                               atol=1e-6 * size)
    assert [r.sparse for r in optimizer._routes] == [True, False]
    assert isinstance(optimizer._selector, ScaledSign) and optimizer.sparsifier.name == "topk"
    assert optimizer._selector.block == block


@pytest.mark.parametrize("block", [0, 64, 96])
@pytest.mark.parametrize("ranks,n", [(1, 5), (3, 100), (4, 70_001), (2, 131_072)])
def test_the_native_sum_of_the_signs_is_the_tensorflow_paths_bits(ranks, n, block):
    """kernels/sign_sum.cc against the TensorFlow ops of ``SignAllgather.unpack`` (shards of
    64K entries: n over one shard, ending inside a word; blocks of 96 span words in threes)."""
    from helpers import native_op
    from sparse_hvd import kernels
    from sparse_hvd.exchanges.averaging import divided, sum_rows_in_order
    from sparse_hvd.exchanges.sign import blocks_of, per_entry

    native = native_op(kernels.sign_sum)
    rng = np.random.RandomState(n)
    values = [rng.randn(n).astype("float32") for _ in range(ranks)]
    words = tf.stack([pack_signs(tf.constant(v)) for v in values])
    blocks = blocks_of(n, block)
    scales = tf.constant(rng.uniform(0.1, 2.0, (ranks, blocks)).astype("float32"))
    expected = divided(sum_rows_in_order(unpack_signs(words, n) * per_entry(scales, n, block)),
                       ranks)
    got = native(words, scales, num_elements=n, block=block)
    np.testing.assert_array_equal(got.numpy().view(np.uint32), expected.numpy().view(np.uint32))
    signs = np.where(np.stack(values) < 0, -1.0, 1.0).astype("float32")
    each = np.repeat(scales.numpy(), block or n, axis=1)[:, :n]
    np.testing.assert_allclose(got.numpy(), (signs * each).sum(0) / ranks, rtol=1e-6, atol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError, match="scales"):
        native(words, scales[:, :-1], num_elements=n, block=block)


def test_the_native_ops_refuse_a_block_that_splits_a_word():
    from helpers import native_op
    from sparse_hvd import kernels

    with pytest.raises(tf.errors.InvalidArgumentError, match="multiple of 32"):
        native_op(kernels.sign_pack)(tf.zeros([100]), block=48)


@pytest.mark.parametrize("block", [0, 64])
@pytest.mark.parametrize("n", [1, 31, 32, 33, 70_001])
def test_the_native_packing_is_the_tensorflow_paths_words_and_scales(n, block):
    """kernels/sign_sum.cc's pack against ``pack_signs`` and each block's largest magnitude."""
    from helpers import native_op
    from sparse_hvd import kernels

    native = native_op(kernels.sign_pack)
    values = ScaledSign(block)(
        tf.constant(np.random.RandomState(n).randn(n).astype("float32")), 0).values
    words, scales = native(values, block=block)
    np.testing.assert_array_equal(words.numpy(), pack_signs(values).numpy())
    size = block or n
    largest = [np.max(np.abs(values.numpy()[b:b + size])) for b in range(0, n, size)]
    np.testing.assert_array_equal(scales.numpy(), largest)
    assert words.shape == ((n + 31) // 32,)


@pytest.mark.parametrize("block", [0, 64])
@pytest.mark.parametrize("n", [1, 33, 70_001])
def test_the_native_compensation_sends_the_mean_magnitude_signed_and_keeps_the_rest(n, block):
    """kernels/sign_sum.cc's error-feedback step: c = gradient + residual, each block's mean
    |c| (in double; with blocks rounded to bfloat16) signed, and c minus it, exactly."""
    from helpers import native_op
    from sparse_hvd import kernels

    native = native_op(kernels.compensate_sign)
    rng = np.random.RandomState(n)
    grad, residual = (rng.randn(n).astype("float32") for _ in range(2))
    sent, remainder, finite = (t.numpy() for t in native(tf.constant(grad),
                                                         tf.constant(residual), block=block))
    assert finite
    compensated = grad + residual
    np.testing.assert_array_equal(sent, block_signs(compensated, block))
    np.testing.assert_array_equal(remainder, compensated - sent)
    selection, kept = compensate_and_select(tf.constant(grad), tf.constant(residual),
                                            ScaledSign(block), k=1)  # the optimizer's path
    np.testing.assert_array_equal(selection.values.numpy(), sent)
    np.testing.assert_array_equal(kept.numpy(), remainder)
    np.testing.assert_array_equal(selection.indices.numpy(), np.arange(n))


@pytest.mark.parametrize("block", [0, 64])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, "overflow"])
def test_the_native_compensation_finds_a_non_finite_entry_in_its_own_pass(bad, block):
    """The compensation's third output is the payload's finiteness check: False where one
    entry of c = gradient + residual is not finite (a float32 sum can overflow from finite
    parts), in any block; the payload then skips its own pass over the update."""
    from helpers import native_op
    from sparse_hvd import kernels

    native = native_op(kernels.compensate_sign)
    n = 1000
    grad, residual = np.ones(n, "float32"), np.zeros(n, "float32")
    for position in (0, 517, n - 1):
        broken = grad.copy()
        if bad == "overflow":
            broken[position], residual[position] = 3e38, 3e38
        else:
            broken[position] = bad
        _, _, finite = native(tf.constant(broken), tf.constant(residual), block=block)
        residual[:] = 0.0
        assert not finite.numpy(), position
    *_, finite = native(tf.constant(grad), tf.constant(residual), block=block)
    assert finite.numpy()
    selection, _ = ScaledSign(block).fused_compensate_select(tf.constant(grad),
                                                             tf.constant(residual), 1)
    assert selection.finite.numpy()  # handed to the payload


@pytest.mark.parametrize("block", [0, 64])
@pytest.mark.parametrize("n", [1, 33, 64, 70_001])
def test_the_packed_compensation_writes_the_words_and_scales_as_they_travel(n, block):
    """``SparseHvdPackedCompensateSign`` (a rank that sends its signs as they are): the sign
    bits of the NumPy expectation's +-scale in little-endian words, each block's scale, and the
    same remainder, exactly; the selection it makes packs (``SignAllgather.pack``) to the
    unpacked selection's words."""
    from helpers import native_op
    from sparse_hvd import kernels

    native = native_op(kernels.packed_compensate_sign)
    rng = np.random.RandomState(n + 7)
    grad, residual = (rng.randn(n).astype("float32") for _ in range(2))
    grad[: n // 3] = 0.0  # some c = 0: + with its block's scale
    residual[: n // 3] = 0.0
    words, scales, remainder, finite = (t.numpy() for t in native(
        tf.constant(grad), tf.constant(residual), block=block))
    assert finite
    compensated = grad + residual
    sent = block_signs(compensated, block).astype("float32")
    bits = np.zeros(-(-n // 32) * 32, np.uint64)
    bits[:n] = sent < 0
    expected_words = (bits.reshape(-1, 32) << np.arange(32, dtype=np.uint64)).sum(1)
    np.testing.assert_array_equal(words.view(np.uint32), expected_words.astype(np.uint32))
    size = block or n
    np.testing.assert_array_equal(scales, [np.abs(sent[b:b + size]).max()
                                           for b in range(0, n, size)])
    np.testing.assert_array_equal(remainder, compensated - sent)
    packed, kept = compensate_and_select(tf.constant(grad), tf.constant(residual),
                                         ScaledSign(block).packing(), k=1)
    plain, _ = compensate_and_select(tf.constant(grad), tf.constant(residual), ScaledSign(block),
                                     k=1)
    assert packed.values.shape == (0,) and packed.indices.shape == (n,)
    np.testing.assert_array_equal(kept.numpy(), remainder)
    np.testing.assert_array_equal(SignAllgather.pack([packed], block).numpy(),
                                  SignAllgather.pack([plain], block).numpy())


@pytest.mark.parametrize("block", [0, 64])
def test_the_packed_compensation_finds_a_non_finite_entry_and_packs_as_the_plain_pass(block):
    """Non-finite entries: the packed pass's flag, words, scales and remainder are the plain
    pass's and its packing's (a NaN block's scale 0, as the packing's maximum gives it)."""
    from helpers import native_op
    from sparse_hvd import kernels

    values = np.random.RandomState(3).randn(256).astype("float32")
    values[[3, 70, 140]] = [np.nan, np.inf, -np.inf]
    grad, residual = tf.constant(values), tf.zeros([256])
    sent, remainder, finite = native_op(kernels.compensate_sign)(grad, residual, block=block)
    words, scales = native_op(kernels.sign_pack)(sent, block=block)
    packed = native_op(kernels.packed_compensate_sign)(grad, residual, block=block)
    assert not finite.numpy() and not packed[3].numpy()
    for got, expected in zip(packed[:3], (words, scales, remainder)):
        np.testing.assert_array_equal(got.numpy(), expected.numpy())
    with pytest.raises(tf.errors.InvalidArgumentError, match="1-D and alike"):
        native_op(kernels.packed_compensate_sign)(grad, tf.zeros([255]), block=block)


@pytest.mark.parametrize("exchange,block", [("sign", 64), ("sign_per_variable", 0)])
def test_the_bytes_an_entry_the_exchange_prices_are_what_it_packs(exchange, block):
    """``sent_bytes_per_entry`` (what auto's network model and the adaptive policy price) is
    counted at ``density`` entries; the packed words of a large variable agree with it."""
    from sparse_hvd.exchanges import create

    n, density = 64 * 1000, 0.01
    words = SignAllgather.pack([ScaledSign(block)(tf.constant(np.ones(n, "float32")), 0)],
                               block)
    priced = create(exchange, name=f"{exchange}_bytes").sent_bytes_per_entry(density, 4)
    assert priced * density == pytest.approx(0.125 + 0.03125 if block else 0.125, rel=1e-12)
    assert 4 * words.shape[0] == pytest.approx(n * priced * density + (0 if block else 4),
                                               rel=1e-12)
