"""Compact indices: one rank's sorted entry positions in about 2 + log2(n / K) bits each.

An int32 index costs 4 bytes an entry, as much as a float32 value and twice a 16-bit one. The
positions of K entries chosen among n carry at least log2(C(n, K)) bits, about
``log2(n / K) + 1.44`` bits an entry (8.1 at 1%, 11.4 at 0.1%); the Elias-Fano code (Elias
1974, Fano 1971; as in Vigna, "Quasi-succinct indices", WSDM 2013) comes within 2 bits of that
for any set, with no table and no data-dependent branch, so it runs as a few vectorised
TensorFlow ops (the same ops on CPU and GPU; integer sums are exact in any order):

1. sort the K positions ``x`` (distinct, in ``[0, n)``); ``L = floor(log2(n / K))`` (0 when
   n < 2K): each position is ``(high << L) | low``;
2. the low halves: K x L bits, packed 32 to an int32 word;
3. the high halves: a bitmap of ``K + (n >> L) + 1`` bits with bit ``high_i + i`` set for the
   i-th position (``high`` never decreases, so these are distinct), packed 32 to a word;
4. decoding reverses it: the set bits of the bitmap at ``p_i`` give ``high_i = p_i - i``.

The bitmap costs at most 3 bits an entry (``(n >> L) / K < 2``), so an entry costs
``L + 1..3`` bits: 1.1 bytes at 1%, 1.5 bytes at 0.1%, against 4. Both sides know n and K (K
travels in the exchange's header), so the code needs no length field; the word counts follow
from them (:func:`encoded_words`).

On CPU, :func:`encode_in_any_order`, :func:`encode_entries` and :func:`decode_ranks` run as
one native pass each (``sparse_hvd/kernels/index_codec.cc``, the same words bit for bit); the
TensorFlow ops are the path on GPU and without the kernels. :func:`decode_host` decodes in
NumPy, for code that reached the host (the delayed pipeline's thread).
"""

import math

import numpy as np
import tensorflow as tf

from .. import kernels
from . import bit_packing


def bytes_per_index(density) -> float:
    """What an index costs in the code when ``density`` of the space is sent: about
    ``2 + log2(1 / density)`` bits (step 1's low bits plus the bitmap's), in bytes."""
    return (2 + math.log2(1 / density)) / 8


def low_bits(num_positions, space):
    """``L`` of step 1 for K = ``num_positions`` entries among ``space`` (int64 tensors)."""
    quotient = tf.math.floordiv(space, tf.maximum(num_positions, 1))
    estimate = tf.cast(tf.math.floor(tf.math.log(tf.cast(tf.maximum(quotient, 1), tf.float64))
                                     / tf.math.log(tf.constant(2.0, tf.float64))), tf.int64)
    # float rounding may put log2 of an exact power of two just below it: correct by one
    estimate = tf.where(tf.bitwise.left_shift(tf.constant(1, tf.int64), estimate + 1) <= quotient,
                        estimate + 1, estimate)
    estimate = tf.where(tf.bitwise.left_shift(tf.constant(1, tf.int64), estimate) > quotient,
                        estimate - 1, estimate)
    return tf.maximum(estimate, 0)


def encoded_words(num_positions, space):
    """``(low words, bitmap words)`` of the code of K = ``num_positions`` among ``space``."""
    num_positions = tf.cast(num_positions, tf.int64)
    space = tf.cast(space, tf.int64)
    shift = low_bits(num_positions, space)
    low = bit_packing.words_for(num_positions * shift)
    bitmap = bit_packing.words_for(num_positions + tf.bitwise.right_shift(space, shift) + 1)
    empty = tf.equal(num_positions, 0)
    return (tf.where(empty, tf.zeros_like(low), low),
            tf.where(empty, tf.zeros_like(bitmap), bitmap))


def encode(positions, space) -> tf.Tensor:
    """Steps 1-3 for ascending distinct ``positions`` (int, in ``[0, space)``): int32 words,
    the low halves' words then the bitmap's."""
    x = tf.cast(positions, tf.int64)
    count = tf.size(x, out_type=tf.int64)
    space = tf.cast(space, tf.int64)
    shift = low_bits(count, space)
    low_words, bitmap_words = encoded_words(count, space)
    # step 2: the L low bits of each entry, entry after entry
    mask = tf.bitwise.left_shift(tf.constant(1, tf.int64), shift) - 1
    lows = bit_packing.pack_fields(tf.bitwise.bitwise_and(x, mask), shift, low_words)
    # step 3
    places = tf.bitwise.right_shift(x, shift) + tf.range(count, dtype=tf.int64)
    return tf.concat([lows, bit_packing.bitmap(places, bitmap_words)], 0)


def decode(words, count, space) -> tf.Tensor:
    """Step 4: the ``count`` ascending positions (int64) that :func:`encode` made ``words`` of
    (exactly ``sum(encoded_words(count, space))`` words)."""
    count = tf.cast(count, tf.int64)
    space = tf.cast(space, tf.int64)
    shift = low_bits(count, space)
    low_words, _ = encoded_words(count, space)
    low = bit_packing.unpack_fields(words[:low_words], shift, count)
    places = bit_packing.set_bits(words[low_words:])
    high = places - tf.range(count, dtype=tf.int64)
    return tf.bitwise.bitwise_or(tf.bitwise.left_shift(high, shift), low)


def encode_in_any_order(positions, space):
    """``(words, order)``: :func:`encode` of distinct ``positions`` given in any order, and the
    permutation (int32) that sorts them."""
    positions = tf.cast(positions, tf.int64)
    native = kernels.encode_positions()
    if native is not None:
        return native(positions, tf.cast(space, tf.int64))
    order = tf.argsort(positions, stable=True)
    return encode(tf.gather(positions, order), space), order


def encode_entries(positions, values, space):
    """``(words, values in their order)``: :func:`encode` of distinct ``positions`` given in
    any order, and ``values`` (one per position) reordered as the code sends them. Natively,
    positions that arrive sorted hand back ``values`` itself, where a gather copied them."""
    positions = tf.cast(positions, tf.int64)
    native = kernels.encode_entries()
    if native is not None:
        return native(positions, values, tf.cast(space, tf.int64))
    words, order = encode_in_any_order(positions, space)
    return words, tf.gather(values, order)


def decode_ranks(words, counts, starts, space):
    """Every rank's indices within their variables (int32), rank after rank and variable
    after variable, from the gathered ``words`` of codes of one index space; ``counts``:
    [ranks, variables] entries (static shape), ``starts``: where each variable's entries begin
    in the space (a list of ints)."""
    native = kernels.decode_positions()
    if native is not None:
        return native(words, tf.cast(counts, tf.int32),
                      tf.constant(starts, tf.int64, shape=[len(starts)]), tf.cast(space, tf.int64))
    counts = tf.cast(counts, tf.int64)
    per_rank = tf.reduce_sum(counts, axis=1)
    low, bitmap = encoded_words(per_rank, space)
    lengths = low + bitmap
    firsts = tf.cumsum(lengths, exclusive=True)
    positions = tf.concat([decode(words[firsts[r]:firsts[r] + lengths[r]], per_rank[r], space)
                           for r in range(counts.shape[0])], 0)
    offsets = tf.repeat(tf.tile(tf.constant(starts, tf.int64, shape=[len(starts)]),
                                [counts.shape[0]]),
                        tf.reshape(counts, [-1]))
    return tf.cast(positions - offsets, tf.int32)


def host_layout(count: int, space: int):
    """``(L, low words, bitmap words)`` of the code of ``count`` positions among ``space``, in
    Python integers (:func:`low_bits` and :func:`encoded_words` for the host)."""
    if count == 0:
        return 0, 0, 0
    shift = max(0, (space // count).bit_length() - 1)  # floor(log2(space / count))
    return shift, -(-count * shift // 32), -(-(count + (space >> shift) + 1) // 32)


def decode_host(words, count: int, space: int):
    """Step 4 in NumPy, for code that travelled to the host (the delayed pipeline's thread,
    ``sparse_hvd.steps.pipeline``, which runs no TensorFlow op per step): the ``count``
    ascending positions (int64) of :func:`encode`'s ``words`` (exactly the words
    :func:`host_layout` counts)."""
    shift, low_words, bitmap_words = host_layout(count, space)
    if len(words) != low_words + bitmap_words:
        raise ValueError(f"a code of {count} positions among {space} has "
                         f"{low_words + bitmap_words} words, got {len(words)}")
    low = bit_packing.host_fields(bit_packing.host_readable(words), 0, count, shift)
    places = bit_packing.host_set_bits(words[low_words:])
    if len(places) != count:
        raise ValueError(f"a code of {count} positions has {len(places)} set bits in its bitmap")
    high = places - np.arange(count, dtype=np.int64)
    return (high << shift) | low
