"""compression=: 16-bit values on the wire, the rounding error kept in the residual (one
process: the arithmetic and the bytes; tests/distributed/test_compression.py: the exchange)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from sparse_hvd.exchanges import wire
from sparse_hvd.exchanges.compression import rounded

HALF = {"float16": np.float16, "bfloat16": tf.bfloat16.as_numpy_dtype}


def _round(values, name):
    narrow = np.clip(values, -65504, 65504) if name == "float16" else values
    return narrow.astype(HALF[name]).astype(np.float32)


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_one_step_sends_rounded_values_and_keeps_every_rounding_error(name):
    rng = np.random.RandomState(0)
    big, small = rng.randn(50, 40).astype("float32"), rng.randn(30).astype("float32")
    big[0, 0] = 1e6  # beyond float16's range: saturates, the rest stays in the residual
    variables = [keras.Variable(np.ones((50, 40), "float32")), keras.Variable(np.ones(30, "float32"))]
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.5), density=0.05,
                                                      compression=name)
    optimizer.apply([tf.constant(big), tf.constant(small)], variables)

    flat = big.reshape(-1)
    chosen = np.argsort(-np.abs(flat), kind="stable")[:100]
    sent = np.zeros_like(flat)
    sent[chosen] = _round(flat[chosen], name)
    np.testing.assert_array_equal(variables[0].numpy(), 1 - (sent * np.float32(0.5)).reshape(50, 40))
    np.testing.assert_array_equal(optimizer.residuals[0].numpy().reshape(-1), flat - sent)
    dense_sent = _round(small, name)
    np.testing.assert_array_equal(variables[1].numpy(), 1 - dense_sent * np.float32(0.5))
    np.testing.assert_array_equal(optimizer.residuals[1].numpy(), small - dense_sent)
    # nothing lost: what was sent plus what is kept is the gradient, bit for bit
    np.testing.assert_array_equal(sent + optimizer.residuals[0].numpy().reshape(-1), flat)
    assert optimizer.communication_stats()["bytes_sent"] == 100 * (2 + 4) + 30 * 2
    if name == "float16":
        assert sent[0] == 65504 and optimizer.residuals[0].numpy()[0, 0] == 1e6 - 65504


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_the_next_step_sends_the_kept_error(name):
    """A dense-route gradient constant over steps: what the rounding kept is sent later, so the
    sum of what was applied over steps follows the sum of the gradients within one rounding."""
    gradient = np.float32([1 / 3, 2 / 3, 1e-4 / 3])
    variable = keras.Variable(np.zeros(3, "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(1.0), compression=name)
    steps = 50
    for _ in range(steps):
        optimizer.apply([tf.constant(gradient)], [variable])
    applied = -variable.numpy().astype(np.float64)
    residual = optimizer.residuals[0].numpy().astype(np.float64)
    np.testing.assert_allclose(applied + residual, steps * gradient.astype(np.float64), rtol=1e-5)
    assert np.all(np.abs(residual) <= np.abs(gradient) * 2.0 ** -7)  # one rounding, at most


def test_half_words_round_trip_with_odd_blocks():
    values = [np.float32([1.5, -2.25, 3.0]), np.float32([]), np.float32([0.125, 7.0])]
    words = [wire.to_half_words(tf.constant(v), tf.float16) for v in values]
    assert [int(tf.size(w)) for w in words] == [2, 0, 1]  # two values a word, padded
    back = wire.from_half_words(tf.concat(words, 0), tf.constant([3, 0, 2]), tf.float16, tf.float32)
    np.testing.assert_array_equal(back.numpy(), np.concatenate(values))


def test_rounded_is_exact_in_sum():
    values = tf.constant(np.random.RandomState(1).randn(1000).astype("float32") * 100)
    for half in (tf.float16, tf.bfloat16):
        sent, error = rounded(values, half)
        np.testing.assert_array_equal((sent + error).numpy(), values.numpy())


def test_compression_is_checked_and_serialised():
    with pytest.raises(ValueError, match="`compression` must be one of .*'float16'.*got 'fp16'"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), compression="fp16")
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), compression="bfloat16")
    assert sparse_hvd.SparseDistributedOptimizer.from_config(optimizer.get_config()).compression == "bfloat16"


def test_one_compression_object_holds_every_rule():
    from sparse_hvd.exchanges.compression import Compression

    half, brain, none = Compression("float16"), Compression("bfloat16"), Compression()
    assert (half.itemsize(tf.float32), half.itemsize(tf.bfloat16), none.itemsize(tf.float32)) == (2, 2, 4)
    assert half.wire_dtype(tf.bfloat16) is None and brain.wire_dtype(tf.float64) == tf.bfloat16
    values = tf.constant(np.random.RandomState(3).randn(7).astype("float32") * 1e5)
    sent, error = half.round(values)
    np.testing.assert_array_equal((sent + error).numpy(), values.numpy())
    assert np.abs(sent.numpy()).max() <= 65504.0
    words = half.encode(sent)  # 7 values: 4 words, the last half empty
    assert words.dtype == tf.int32 and int(tf.size(words)) == 4
    np.testing.assert_array_equal(half.decode(words, tf.float32, tf.constant([7])).numpy(),
                                  sent.numpy())
    assert half.for_allreduce(values).dtype == tf.float16
    assert brain.for_allreduce(values).dtype == tf.float32  # Horovod cannot reduce bfloat16
    assert none.round(values)[0] is values and not none.enabled
