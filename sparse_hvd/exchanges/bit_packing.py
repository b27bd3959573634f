"""Bit fields and bitmaps in int32 words: what the index and value codes are written with.

Every function is a few vectorised TensorFlow ops (the same on CPU and GPU; the integer sums
are exact in any order, so the words do not depend on thread timing). Bits are numbered
little-endian: bit ``b`` of the string is bit ``b % 32`` of word ``b // 32``. The ``host_``
functions read the same words in NumPy (the delayed pipeline's thread runs no TensorFlow op
per step).
"""

import numpy as np
import tensorflow as tf


def words_for(bits):
    """int32 words that hold ``bits`` bits (int64 tensors or integers)."""
    return (bits + 31) // 32


def pack_fields(fields, width, words):
    """int64 ``fields`` of ``width`` bits each (``0 <= width < 32``; a scalar), field i at
    bits ``[i w, i w + w)``, as ``words`` int32 words. Each field lands in at most two words;
    the fields' bit ranges are disjoint, so adding them is setting their bits."""
    starts = tf.range(tf.size(fields, out_type=tf.int64), dtype=tf.int64) * width
    shifted = tf.bitwise.left_shift(fields, tf.bitwise.bitwise_and(starts, 31))  # < 2^63
    word = tf.bitwise.right_shift(starts, 5)
    low = tf.bitwise.bitwise_and(shifted, 0xFFFFFFFF)
    packed = (tf.math.unsorted_segment_sum(low, word, words + 2)
              + tf.math.unsorted_segment_sum(tf.bitwise.right_shift(shifted, 32),
                                             word + 1, words + 2))[:words]
    return tf.bitcast(tf.cast(packed, tf.uint32), tf.int32)


def readable(words):
    """int32 ``words`` as int64 in ``[0, 2^32)``, with two zero words after them (a field's
    second word), for :func:`fields_at`."""
    as_uint = tf.cast(tf.bitcast(tf.reshape(words, [-1]), tf.uint32), tf.int64)
    return tf.concat([as_uint, tf.zeros([2], tf.int64)], 0)


def fields_at(readable_words, starts, width):
    """The fields of ``width`` bits (``< 32``; a scalar, or one per field) that start at bits
    ``starts`` (int64) of :func:`readable` words."""
    word = tf.bitwise.right_shift(starts, 5)
    pair = tf.bitwise.bitwise_or(tf.gather(readable_words, word),
                                 tf.bitwise.left_shift(tf.gather(readable_words, word + 1), 32))
    mask = tf.bitwise.left_shift(tf.constant(1, tf.int64), width) - 1
    return tf.bitwise.bitwise_and(
        tf.bitwise.right_shift(pair, tf.bitwise.bitwise_and(starts, 31)), mask)


def unpack_fields(words, width, count):
    """The inverse of :func:`pack_fields`: ``count`` int64 fields of ``width`` bits."""
    starts = tf.range(count, dtype=tf.int64) * width
    return fields_at(readable(words), starts, width)


def bitmap(places, words):
    """``words`` int32 words with the bits at ``places`` set (distinct, int64)."""
    packed = tf.math.unsorted_segment_sum(
        tf.bitwise.left_shift(tf.constant(1, tf.int64), tf.bitwise.bitwise_and(places, 31)),
        tf.bitwise.right_shift(places, 5), words)
    return tf.bitcast(tf.cast(packed, tf.uint32), tf.int32)


def set_bits(words):
    """Where the set bits of int32 ``words`` are, ascending (int64 bit numbers)."""
    as_uint = tf.cast(tf.bitcast(tf.reshape(words, [-1]), tf.uint32), tf.int64)
    shifted = tf.bitwise.right_shift(tf.expand_dims(as_uint, 1), tf.range(32, dtype=tf.int64))
    return tf.reshape(tf.where(tf.equal(tf.reshape(tf.bitwise.bitwise_and(shifted, 1), [-1]), 1)),
                      [-1])


def host_readable(words) -> np.ndarray:
    """int32 ``words`` as uint64 with two zero words after them (NumPy :func:`readable`)."""
    return np.concatenate([np.asarray(words, "<i4").view("<u4").astype(np.uint64),
                           np.zeros(2, np.uint64)])


def host_fields(readable, start: int, count: int, width: int) -> np.ndarray:
    """``count`` int64 fields of ``width`` bits (``< 32``) one after another from bit
    ``start`` of :func:`host_readable` words: :func:`unpack_fields` in NumPy."""
    if width == 0 or count == 0:
        return np.zeros(count, np.int64)
    starts = np.uint64(start) + np.arange(count, dtype=np.uint64) * np.uint64(width)
    word = starts >> np.uint64(5)
    pair = readable[word] | (readable[word + np.uint64(1)] << np.uint64(32))
    mask = np.uint64((1 << width) - 1)
    return ((pair >> (starts & np.uint64(31))) & mask).astype(np.int64)


def host_set_bits(words) -> np.ndarray:
    """Where the set bits of int32 ``words`` are, ascending (NumPy :func:`set_bits`)."""
    bits = np.unpackbits(np.ascontiguousarray(words, "<i4").view(np.uint8), bitorder="little")
    return np.flatnonzero(bits).astype(np.int64)
