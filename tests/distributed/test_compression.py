"""compression= on several ranks: every rank applies the rank-order average of every rank's
16-bit-rounded selections (and dense gradients), recomputed here in NumPy."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from conftest import digest, gather
from helpers import coded_value_words, elias_fano_words, raw_bits_of

HALF = {"float16": np.float16, "bfloat16": tf.bfloat16.as_numpy_dtype}


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
@pytest.mark.parametrize("grouping,exchange", [("grouped", "allgather"),
                                               ("grouped", "compact_allgather"),
                                               ("layerwise", "allgather"),
                                               ("layerwise", "compact_allgather")])
def test_every_rank_applies_the_average_of_the_rounded_selections(hvd, name, grouping, exchange):
    """With the compact allgather (either grouping) the 16-bit values and the indices travel
    coded: the same bits arrive, and the bytes counted are the codes' words (closed forms in
    helpers.py)."""
    rank, size = hvd.rank(), hvd.size()
    rng = np.random.RandomState(7 + rank)
    big, small = rng.randn(61, 33).astype("float32"), rng.randn(29).astype("float32")  # k odd
    variables = [keras.Variable(np.zeros((61, 33), "float32")), keras.Variable(np.zeros(29, "float32"))]
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(1.0), density=0.05, compression=name, grouping=grouping,
        exchange=exchange, name=f"half_{exchange}")
    optimizer.apply([tf.constant(big), tf.constant(small)], variables)

    everyone = gather(hvd, (big, small), f"compression.{name}.{grouping}")
    k = int(np.ceil(0.05 * big.size))
    total_big, total_small = np.zeros(big.size, np.float32), np.zeros(29, np.float32)
    for their_big, their_small in everyone:  # rank order
        flat = their_big.reshape(-1)
        chosen = np.argsort(-np.abs(flat), kind="stable")[:k]
        total_big[chosen] += flat[chosen].astype(HALF[name]).astype(np.float32)
        total_small = total_small + their_small.astype(HALF[name]).astype(np.float32)
    expected_big = -(total_big / np.float32(size))
    expected_small = -(total_small / np.float32(size))
    np.testing.assert_array_equal(variables[0].numpy().reshape(-1), expected_big)
    if grouping == "grouped":  # gathered and summed in rank order: the same bits
        np.testing.assert_array_equal(variables[1].numpy(), expected_small)
    else:  # a Horovod allreduce: its own order of additions (in float16 for "float16")
        np.testing.assert_allclose(variables[1].numpy(), expected_small, rtol=2e-3, atol=1e-3)
    sent = optimizer.communication_stats()["bytes_sent"]
    if exchange == "compact_allgather":
        mine = big.reshape(-1)[np.argsort(-np.abs(big.reshape(-1)), kind="stable")[:k]]
        words = (elias_fano_words(big.size, k)
                 + coded_value_words(raw_bits_of(mine.astype(HALF[name]).astype(np.float32),
                                                 name), [k], name))
        assert sent == 4 * words + 29 * 2 and 4 * words < k * 6
    else:
        assert sent == k * 6 + 29 * 2
    assert len(set(gather(hvd, digest([v.numpy() for v in variables]), "compression.replicas"))) == 1


def test_auto_with_compression_chooses_an_exchange_that_carries_16_bit_values(hvd):
    """exchange="auto" with compression: the sparse allreduce (which cannot carry 16-bit values)
    is not a candidate; the choice is the same on every rank and the replicas stay identical."""
    rank = hvd.rank()
    variables = [keras.Variable(np.zeros((80, 40), "float32")), keras.Variable(np.zeros(29, "float32"))]
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.5), density=0.05, compression="float16", exchange="auto",
        name="auto_half")
    for step in range(3):
        rng = np.random.RandomState(100 * step + rank)
        optimizer.apply([tf.constant(rng.randn(80, 40).astype("float32")),
                         tf.constant(rng.randn(29).astype("float32"))], variables)
    methods = {stats["exchange"] for stats in optimizer.layer_stats().values()}
    assert methods <= {"allgather", "dense"}, methods
    everyone = gather(hvd, (sorted(methods), digest([v.numpy() for v in variables])), "auto_half")
    assert all(e == everyone[0] for e in everyone), everyone
