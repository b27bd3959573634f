"""``exchange="topk_sign"`` in one process: the two-stage selection and its residual, the
default that chooses it (SGD with momentum) and what keeps top-k, the settings it refuses
(each naming the argument), its config, and one-worker steps in closed form, with and without
16-bit compression. Every rank's part: tests/distributed/test_topk_sign_exchange.py."""

import math
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from sparse_hvd.exchanges.topk_sign import SignsOfTheRest, signs_of_rest
from sparse_hvd.feedback.error_feedback import compensate_and_select
from sparse_hvd.selection.sparsifiers import Selection, get_sparsifier


def test_the_top_entries_travel_as_they_are_and_the_rest_as_signs_of_their_mean_magnitude():
    grad = tf.constant([0.5, -3.0, 0.0, 2.0, -0.25])
    residual = tf.constant([0.5, 0.0, -0.25, 0.0, 0.0])
    selection, remainder = compensate_and_select(grad, residual,
                                                 SignsOfTheRest(get_sparsifier("topk")), k=2)
    compensated = np.array([1.0, -3.0, -0.25, 2.0, -0.25], "float32")
    np.testing.assert_array_equal(np.sort(selection.indices.numpy()), [1, 3])
    np.testing.assert_array_equal(selection.values.numpy()[np.argsort(selection.indices)],
                                  [-3.0, 2.0])
    scale = (1.0 + 0.25 + 0.25) / 3  # the mean magnitude of the three entries left
    # the selected entries' zeros travel as +
    (signs,) = selection.signs  # one layer
    np.testing.assert_allclose(signs.numpy(), [scale, scale, -scale, scale, -scale], rtol=1e-7)
    sent = signs.numpy().copy()
    sent[[1, 3]] += [-3.0, 2.0]
    np.testing.assert_allclose(sent + remainder.numpy(), compensated, rtol=0, atol=1e-7)


def test_the_unfused_call_selects_the_same():
    flat = tf.constant(np.random.RandomState(0).randn(1000).astype("float32"))
    wrapped = SignsOfTheRest(get_sparsifier("topk"))
    called = wrapped(flat, 10)
    fused, remainder = wrapped.fused_compensate_select(flat, tf.zeros_like(flat), 10)
    np.testing.assert_array_equal(np.sort(called.indices), np.sort(fused.indices))
    np.testing.assert_allclose(called.signs[0], fused.signs[0], rtol=1e-6)
    expected_signs, expected_residual = signs_of_rest(
        tf.tensor_scatter_nd_update(flat, tf.reshape(fused.indices, [-1, 1]), tf.zeros([10])), 10)
    np.testing.assert_allclose(remainder, expected_residual, rtol=1e-6)


def _sgd_with_momentum(lr=0.1):
    return keras.optimizers.SGD(lr, momentum=0.9)


@pytest.mark.convergence_defaults
def test_by_default_sgd_momentum_keeps_top_k():
    """``SIGNS_OF_REST`` is off (measured slower in time: docs/time_to_loss_topk_sign.md)."""
    optimizer = sparse_hvd.SparseDistributedOptimizer(_sgd_with_momentum(), name="sgd_top_k")
    assert "topk_sign" not in optimizer._exchange_candidates
    assert "allgather" in optimizer._exchange_candidates


@pytest.mark.convergence_defaults
def test_with_signs_of_rest_on_sgd_momentum_chooses_between_topk_sign_and_dense(monkeypatch):
    monkeypatch.setattr(sparse_hvd.selection.defaults, "SIGNS_OF_REST", True)
    optimizer = sparse_hvd.SparseDistributedOptimizer(_sgd_with_momentum(), name="sgd_default")
    assert optimizer._exchange_candidates == ("topk_sign", "dense")
    assert optimizer._exchange.method == "topk_sign" and optimizer.sparsify == "update"
    # the top-k part keeps the defaults' warm-up and model-wide budget
    assert optimizer.budget == "model" and optimizer.warmup_steps == 400
    config = optimizer.get_config()
    assert config["exchange"] is None
    clone = sparse_hvd.SparseDistributedOptimizer.from_config(config)
    assert clone._exchange_candidates == ("topk_sign", "dense")
    assert clone.get_config() == config


@pytest.mark.convergence_defaults
@pytest.mark.parametrize("inner,arguments", [
    (keras.optimizers.SGD, {}),  # plain SGD: the gradient cut, not measured with the signs
    (_sgd_with_momentum, {"exchange": "auto"}),  # the previous default, by name
    (_sgd_with_momentum, {"density": 0.001}),  # a density of one's own: top-k at it
    (keras.optimizers.SGD, {"momentum_correction": 0.9}),  # DGC: the gradient cut
    (_sgd_with_momentum, {"grouping": "layerwise"}),
    (_sgd_with_momentum, {"staleness": 1}),
    (_sgd_with_momentum, {"dense_fallback": True}),
    (keras.optimizers.RMSprop, {}),  # not measured: top-k
])
def test_anything_else_keeps_top_k(inner, arguments, monkeypatch):
    monkeypatch.setattr(sparse_hvd.selection.defaults, "SIGNS_OF_REST", True)
    optimizer = sparse_hvd.SparseDistributedOptimizer(inner(1e-3), name="keeps", **arguments)
    assert "topk_sign" not in optimizer._exchange_candidates


@pytest.mark.parametrize("exchange", ["topk_sign", "topk_sign2", "topk_sign_pairs"])
@pytest.mark.parametrize("arguments,named", [
    ({"momentum_correction": 0.9}, "`momentum_correction=0.9`"),
    ({"dense_fallback": True}, "`dense_fallback=True`"),
    ({"grouping": "layerwise"}, "grouping='layerwise'"),
    ({"staleness": 1}, "`staleness`"),
    ({"density": sparse_hvd.AdaptiveDensity(0.01)}, "AdaptiveDensity"),
])
def test_settings_topk_sign_cannot_take_are_refused_by_name(exchange, arguments, named):
    with pytest.raises(ValueError, match=f"exchange='{exchange}'.*{re.escape(named)}|"
                                         f"{re.escape(named)}.*exchange='{exchange}'"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), exchange=exchange,
                                              **arguments)


@pytest.mark.parametrize("exchange,n,compression", [
    ("topk_sign", 500, "none"), ("topk_sign", 500, "float16"), ("topk_sign_pairs", 501, "none"),
])
def test_one_worker_applies_both_stages_and_keeps_the_rest(exchange, n, compression):
    """SGD without momentum (the gradient cut) at 10% of n entries: the weights move by the
    learning rate times the top entries and the signs of the others (with pairs, one sign for
    each pair (2j, 2j + 1), the sign of its sum, on both entries; 501 entries: the last a pair
    of its own); the residual holds what neither carried, and sent + residual is the
    compensated gradient. A step sends the entries, a scale and ceil(n / 32) words of signs,
    with pairs ceil(251 / 32) = 8, not 16. (Two levels, every rank:
    tests/distributed/test_topk_sign_exchange.py.)"""
    group = 2 if exchange == "topk_sign_pairs" else 1
    rng = np.random.RandomState(3)
    start = rng.randn(n).astype("float32")
    variable = keras.Variable(start)
    lr, k = 0.5, math.ceil(0.1 * n)
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(lr), density=0.1, exchange=exchange, compression=compression,
        min_elements=1, name=f"one_{exchange}_{compression}")
    expected, residual = start.astype("float64"), np.zeros(n, "float32")
    for step in range(3):
        grad = (rng.randn(n) * np.exp(rng.randn(n))).astype("float32")
        optimizer.apply_gradients([(tf.constant(grad), variable)])
        compensated = grad + residual
        top = np.argsort(-np.abs(compensated))[:k]
        rest = compensated.copy()
        rest[top] = 0
        sums = np.add.reduceat(rest, np.arange(0, n, group))  # each group's float32 sum
        scale = np.float32(np.abs(sums).astype("float64").sum() / (n - k))
        values = compensated[top]
        if compression == "float16":
            scale, values = np.float32(np.float16(scale)), values.astype(np.float16)
        sent = np.repeat(np.where(sums < 0, -scale, scale), group)[:n].astype("float32")
        sent[top] += values
        residual = compensated - sent
        expected = expected - lr * sent.astype("float64")
        np.testing.assert_allclose(optimizer.residuals[0].numpy(), residual, rtol=0, atol=1e-6)
    np.testing.assert_allclose(variable.numpy(), expected, rtol=0, atol=1e-5)
    value_bytes = 2 if compression == "float16" else 4
    per_step = k * (value_bytes + 4) + 4 * (1 + math.ceil(math.ceil(n / group) / 32))
    assert optimizer.communication_stats()["bytes_sent"] == 3 * per_step


@pytest.mark.parametrize("native", [True, False])
def test_the_rests_signs_native_and_tensorflow_against_numpy(native, monkeypatch):
    """The native pass sums |remainder| in double (its scale is NumPy's float64 mean rounded to
    float32, bit for bit); TensorFlow's float32 sum may differ in the last bit."""
    from sparse_hvd import kernels
    from sparse_hvd.exchanges import topk_sign

    if native and kernels.signs_of_rest() is None:
        pytest.skip("no native kernels here")
    if not native:
        monkeypatch.setattr(topk_sign.kernels, "signs_of_rest", lambda: None)
    rng = np.random.RandomState(7)
    remainder = (rng.randn(100_003) * np.exp(rng.randn(100_003))).astype("float32")
    remainder[rng.choice(remainder.size, 1000, replace=False)] = 0.0  # the selected entries
    (signs,), residual = topk_sign.signs_of_rest(tf.constant(remainder), tf.constant(1000))
    scale = np.float32(np.abs(remainder).astype("float64").sum() / (remainder.size - 1000))
    expected = np.where(remainder < 0, -scale, scale).astype("float32")
    if native:
        np.testing.assert_array_equal(signs.numpy(), expected)
        np.testing.assert_array_equal(residual.numpy(), remainder - expected)
        # a temporary remainder (the error feedback's): the residual written over its buffer
        traced = tf.function(lambda r: topk_sign.signs_of_rest(r * 1.0, tf.constant(1000)))
        (signs,), residual = traced(tf.constant(remainder))
        np.testing.assert_array_equal(signs.numpy(), expected)
        np.testing.assert_array_equal(residual.numpy(), remainder - expected)
    else:
        np.testing.assert_allclose(signs.numpy(), expected, rtol=1e-5)
        np.testing.assert_allclose(residual.numpy(), remainder - expected, rtol=0,
                                   atol=1e-5 * scale)


@pytest.mark.parametrize("native", [True, False])
def test_one_sign_per_pair_is_the_sign_of_its_sum_native_and_tensorflow_against_numpy(
        native, monkeypatch):
    """``group=2``: both entries of a pair take the sign of the pair's float32 sum (a zero sum
    as +), a last odd entry its own; the scale is NumPy's float64 sum of |pair sums| over the
    entries not selected, rounded to float32 (bit for bit natively)."""
    from sparse_hvd import kernels
    from sparse_hvd.exchanges import topk_sign

    if native and kernels.signs_of_rest() is None:
        pytest.skip("no native kernels here")
    if not native:
        monkeypatch.setattr(topk_sign.kernels, "signs_of_rest", lambda: None)
    rng = np.random.RandomState(11)
    remainder = (rng.randn(100_003) * np.exp(rng.randn(100_003))).astype("float32")
    remainder[rng.choice(remainder.size, 1000, replace=False)] = 0.0  # the selected entries
    remainder[[10, 11]] = [0.5, -0.5]  # a pair summing to zero: +
    (signs,), residual = topk_sign.signs_of_rest(tf.constant(remainder), tf.constant(1000),
                                                 group=2)
    sums = np.append(remainder[:-1].reshape(-1, 2).sum(1), remainder[-1])  # float32 sums
    scale = np.float32(np.abs(sums).astype("float64").sum() / (remainder.size - 1000))
    expected = np.repeat(np.where(sums < 0, -scale, scale), 2)[:remainder.size]
    assert expected[10] == expected[11] == scale
    if native:
        np.testing.assert_array_equal(signs.numpy(), expected)
        np.testing.assert_array_equal(residual.numpy(), remainder - expected)
    else:
        np.testing.assert_allclose(signs.numpy(), expected, rtol=1e-5)
        np.testing.assert_allclose(residual.numpy(), remainder - expected, rtol=0,
                                   atol=1e-5 * scale)


@pytest.mark.parametrize("n", [7, 8, 70_001, 131_075])
def test_pair_signs_packed_one_a_pair_come_back_spread_over_both_entries(n, monkeypatch):
    """``SignAllgather.pack(stride=2)`` and ``unpack(group=2)``, native (one sign of each pair
    packed in place, each average written to both entries: shards of 64K signs, an odd last
    pair) and TensorFlow's path: the same words, and every pair's average over 3 ranks of
    their signs times their scales, in rank order, on both of its entries."""
    from sparse_hvd import kernels
    from sparse_hvd.exchanges.sign import SignAllgather

    rng = np.random.RandomState(n)
    pairs = (n + 1) // 2
    per_pair = [np.where(rng.randn(pairs) < 0, -1.0, 1.0).astype("float32") * scale
                for scale in np.float32([0.5, 0.25, 2.0])]
    layers = [np.repeat(signs, 2)[:n] for signs in per_pair]  # equal within each pair
    expected = np.zeros(pairs, "float32")
    for signs in per_pair:
        expected += signs
    expected = np.repeat(expected / np.float32(3), 2)[:n]
    results = []
    for native in (True, False):
        with monkeypatch.context() as patch:
            if not native:
                patch.setattr(kernels, "sign_pack", lambda: None)
                patch.setattr(kernels, "sign_sum", lambda: None)
            rows = tf.stack([SignAllgather.pack([Selection(tf.constant(layer), None)],
                                                stride=2) for layer in layers])
            assert rows.shape == (3, 1 + -(-pairs // 32))  # the scale, then ceil(n/2) bits
            average, = SignAllgather.unpack(rows, [tf.float32], [n], group=2)
        np.testing.assert_array_equal(average.numpy(), expected)
        results.append(rows.numpy())
    np.testing.assert_array_equal(results[0], results[1])


def _numpy_sign_words(signs):
    """Little-endian int32 words of ``signs < 0``, computed bit by bit in NumPy."""
    bits = np.zeros(-(-signs.size // 32) * 32, np.uint64)
    bits[:signs.size] = signs < 0
    return (bits.reshape(-1, 32) << np.arange(32, dtype=np.uint64)).sum(1).astype(
        np.uint32).view(np.int32)


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("n,selected", [(1, 0), (2, 1), (31, 3), (32, 0), (33, 4), (63, 6),
                                        (64, 64), (65, 6), (127, 12), (100_003, 1000)])
def test_signs_packed_in_their_pass_are_the_layers_packed(group, n, selected):
    """``signs_of_rest(packed=True)`` (a rank that sends its signs): the words, the scale and
    the residual, against NumPy (a sign bit where the layer's value is negative: none when the
    scale is 0) and bit for bit against the float layer packed by ``SignAllgather.pack``,
    which is what went on the wire before; sizes around a word's 32 signs, an odd last
    entry, every entry selected."""
    from sparse_hvd import kernels
    from sparse_hvd.exchanges import topk_sign
    from sparse_hvd.exchanges.sign import SignAllgather

    if kernels.packed_signs_of_rest() is None:
        pytest.skip("no native kernels here")
    rng = np.random.RandomState(n + group)
    remainder = (rng.randn(n) * np.exp(rng.randn(n))).astype("float32")
    remainder[rng.choice(n, selected, replace=False)] = 0.0  # the selected entries
    (packed,), residual = topk_sign.signs_of_rest(tf.constant(remainder), tf.constant(selected),
                                                  group=group, packed=True)
    assert isinstance(packed, topk_sign.PackedSigns)
    per_sign = np.append(remainder, np.float32(0))[:group * -(-n // group)].reshape(
        -1, group).sum(1) if group == 2 else remainder
    scale = np.float32(np.abs(per_sign).astype("float64").sum() / max(n - selected, 1))
    signs = np.where(per_sign < 0, -scale, scale).astype("float32")
    np.testing.assert_array_equal(packed.words.numpy(), _numpy_sign_words(signs))
    np.testing.assert_array_equal(packed.scale.numpy(), [scale])
    np.testing.assert_array_equal(residual.numpy(),
                                  remainder - np.repeat(signs, group)[:n])
    (layer,), layer_residual = topk_sign.signs_of_rest(tf.constant(remainder),
                                                       tf.constant(selected), group=group)
    wire = SignAllgather.pack([Selection(layer, None)], stride=group)
    np.testing.assert_array_equal(topk_sign.pack_layers([packed], group).numpy(), wire.numpy())
    np.testing.assert_array_equal(residual.numpy(), layer_residual.numpy())


def test_packed_and_float_layers_are_laid_out_as_the_sign_exchange_lays_them_out():
    """``pack_layers``: every layer's scale, then every layer's sign words, in order, whether
    a layer came packed or as floats (a variable that is not float32 keeps its layer)."""
    from sparse_hvd.exchanges import topk_sign
    from sparse_hvd.exchanges.sign import SignAllgather

    rng = np.random.RandomState(5)
    layers = [np.where(rng.randn(n) < 0, -s, s).astype("float32")
              for n, s in ((40, 0.5), (70, 0.25))]
    packed = topk_sign.PackedSigns(tf.constant(_numpy_sign_words(layers[0])),
                                   tf.constant([np.float32(0.5)]))
    expected = SignAllgather.pack([Selection(tf.constant(layer), None) for layer in layers])
    mixed = topk_sign.pack_layers([packed, tf.constant(layers[1])], 1)
    np.testing.assert_array_equal(mixed.numpy(), expected.numpy())


def test_entries_that_came_at_positions_are_added_into_the_signs_average():
    """``plus_signs``: entries at positions (the native mean) added in the layer's buffer are
    the dense entries plus the layer, bit for bit; two dense layers are added in turn."""
    from sparse_hvd.exchanges.topk_sign import plus_signs

    rng = np.random.RandomState(3)
    layer, second = (rng.randn(50).astype("float32") for _ in range(2))
    where, values = np.array([40, 3, 17], "int32"), rng.randn(3).astype("float32")
    dense = np.zeros(50, "float32")
    dense[where] = values
    at_positions = tf.IndexedSlices(tf.constant(values), tf.constant(where), tf.constant([50]))
    np.testing.assert_array_equal(plus_signs(at_positions, [tf.constant(layer)]).numpy(),
                                  dense + layer)
    np.testing.assert_array_equal(
        plus_signs(tf.constant(dense), [tf.constant(layer), tf.constant(second)]).numpy(),
        (dense + layer) + second)


def test_two_levels_are_the_band_and_the_rest_at_their_own_mean_magnitudes():
    """``two_level_signs``' two layers add up to the band's mean magnitude times the sign in
    the band and the rest's outside it (the selected entries' zeros count in neither)."""
    from sparse_hvd.exchanges.topk_sign import band_cut_of, two_level_signs

    remainder = np.array([0.0, 4.0, -3.0, 0.5, -0.25, 0.0, 1.0, -0.5], "float32")  # 2 selected
    cut = band_cut_of(tf.constant(remainder), 2, band=2)  # the 2nd largest |r|: 3.0
    assert float(cut) == 3.0
    (first, second), residual = two_level_signs(tf.constant(remainder), 2, cut)
    band_scale, rest_scale = 3.5, (0.5 + 0.25 + 1.0 + 0.5) / 4
    scales = np.where(np.abs(remainder) >= 3.0, band_scale, rest_scale)
    expected = np.where(remainder < 0, -scales, scales)
    np.testing.assert_allclose(first.numpy() + second.numpy(), expected, rtol=1e-6)
    np.testing.assert_allclose(residual.numpy(), remainder - expected, rtol=0, atol=1e-6)
    no_band = band_cut_of(tf.constant(remainder), 0)  # nothing selected: no band
    assert np.isinf(float(no_band))
