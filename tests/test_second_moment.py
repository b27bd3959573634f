"""``second_moment="noise_estimate"``'s step on tensors: the native pass and the TensorFlow
operations against an independent float64 NumPy computation, and against each other."""

import numpy as np
import pytest
import tensorflow as tf

from sparse_hvd import kernels
from sparse_hvd.feedback import second_moment

BETA_1, BETA_2, EPSILON = 0.9, 0.999, 1e-7


def _numpy_step(update, m, v, q, t, workers, taken=0.0):
    """The module doc's steps in float64; ``taken``: the weight decay the update holds, which
    the correction leaves as it is."""
    m_hat = m / (1 - BETA_1 ** t)
    explained = q + (m_hat ** 2 - q) * (1 - BETA_2)
    noise = np.maximum(v - explained, 0) * (1 + BETA_1) / (2 * BETA_1)
    v_mean = np.maximum(v - noise * (1 - 1 / workers), v / workers)
    factor = (np.sqrt(v) + EPSILON) / (np.sqrt(v_mean) + EPSILON)
    return (update - taken) * factor + taken, explained


def _state(n, seed):
    rng = np.random.RandomState(seed)
    m = rng.randn(n).astype("float32") * 0.1
    v = (m.astype("float64") ** 2 + rng.rand(n) * 0.01).astype("float32")
    q = (m.astype("float64") ** 2 * rng.rand(n) * 3).astype("float32")  # some above v: no noise
    v[:5] = 0.0  # a fresh entry: no second moment at all
    q[:5] = 0.0
    update = (rng.randn(n) * 1e-3).astype("float32")
    return update, m, v, q


def _decay(n, decayed):
    """AdamW's decay of weights of ``n`` entries (as large as the updates), or None."""
    if not decayed:
        return None, 0.0
    weights = np.random.RandomState(7).randn(n).astype("float32")
    decay = second_moment.Decay(tf.constant(weights), tf.constant(0.1), tf.constant(0.01))
    return decay, weights.astype("float64") * np.float32(0.1) * np.float32(0.01)


@pytest.mark.parametrize("decayed", [False, True])
@pytest.mark.parametrize("path", ["native", "tensorflow"])
@pytest.mark.parametrize("workers,t", [(2, 1), (4, 7), (8, 300)])
def test_the_noise_estimate_step_is_the_formula(monkeypatch, path, workers, t, decayed):
    if path == "native" and kernels.noise_estimate() is None:
        pytest.skip("native kernels not built")
    if path == "tensorflow":
        monkeypatch.setattr(kernels, "noise_estimate", lambda: None)
    update, m, v, q = _state(100_003, seed=workers)
    decay, taken = _decay(update.size, decayed)
    first = tf.constant(1 - BETA_1 ** t, tf.float32)
    corrected, explained = second_moment.noise_estimate_step(
        *map(tf.constant, (update, m, v, q)), first, BETA_1, BETA_2, EPSILON, workers, decay)
    want_corrected, want_explained = _numpy_step(*(a.astype("float64") for a in (update, m, v, q)),
                                                 t, workers, taken)
    np.testing.assert_allclose(explained.numpy(), want_explained, rtol=2e-6, atol=1e-12)
    # with the decay, its float32 product (about 1e-3) is rounded once more than NumPy's
    np.testing.assert_allclose(corrected.numpy(), want_corrected, rtol=2e-5,
                               atol=1e-9 if decayed else 1e-12)
    if decayed:  # the decay is not scaled: the step is, where the noise shrinks v
        assert np.any(np.abs(corrected.numpy() - update) > 1e-5)
        return
    # the correction only ever enlarges a step, by at most sqrt(N)
    ratio = np.abs(corrected.numpy()[5:]) / np.maximum(np.abs(update[5:]), 1e-30)
    assert np.all(ratio >= 1 - 1e-6) and np.all(ratio <= np.sqrt(workers) * (1 + 1e-5))
    assert np.any(ratio > 1.01)
    np.testing.assert_array_equal(corrected.numpy()[:5], update[:5])  # v = 0: unchanged


@pytest.mark.parametrize("decayed", [False, True])
def test_the_native_pass_and_tensorflow_give_the_same_bits(monkeypatch, decayed):
    if kernels.noise_estimate() is None:
        pytest.skip("native kernels not built")
    arrays = [tf.constant(a) for a in _state(70_001, seed=3)]
    decay, _ = _decay(70_001, decayed)
    first = tf.constant(1 - BETA_1 ** 5, tf.float32)
    native = second_moment.noise_estimate_step(*arrays, first, BETA_1, BETA_2, EPSILON, 4, decay)
    monkeypatch.setattr(kernels, "noise_estimate", lambda: None)
    fallback = second_moment.noise_estimate_step(*arrays, first, BETA_1, BETA_2, EPSILON, 4,
                                                 decay)
    for a, b in zip(native, fallback):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_adamws_decay_is_read_as_keras_takes_it_and_only_where_it_is_corrected():
    """``SecondMoment.decays``: ``w * weight_decay * learning_rate`` at the step about to be
    taken, None for a variable excluded from the decay, and nothing to take out where nothing
    is corrected (its own second moment, one worker, no decay)."""
    import keras

    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    adamw = keras.optimizers.AdamW(schedule, weight_decay=0.3)
    decayed, excluded = keras.Variable(np.arange(6, dtype="float32")), keras.Variable([2.0])
    adamw.exclude_from_weight_decay(var_list=[excluded])
    adamw.build([decayed, excluded])
    adamw.iterations.assign(3)  # the 4th step: a rate of 0.1 / 8
    weights = [tf.convert_to_tensor(v) for v in (decayed, excluded)]
    noise = second_moment.SecondMoment("noise_estimate")
    taken, untouched = noise.decays(adamw, [decayed, excluded], weights, workers=4)
    np.testing.assert_allclose(taken.amount().numpy(), np.arange(6) * 0.3 * 0.1 / 8, rtol=1e-6)
    assert untouched is None
    assert noise.decays(adamw, [decayed], weights[:1], workers=1) == [None]
    assert second_moment.SecondMoment("own").decays(adamw, [decayed], weights[:1], 4) == [None]
    adam = keras.optimizers.Adam(0.1)
    adam.build([decayed])
    assert noise.decays(adam, [decayed], weights[:1], workers=4) == [None]
