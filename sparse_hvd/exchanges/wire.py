"""How values travel: as int32 words, so one Horovod collective can carry any mix of them.

A grouped Horovod collective takes tensors of one dtype only, and Horovod has no bfloat16.
So the fused exchange bit-casts everything it sends to int32 words: a float32 value is one
word, a float64 value two, a float16 or bfloat16 value one (zero-extended from 16 bits).
Decoding gives back the very same bits: nothing is rounded on the way.

With ``compression`` (``sparse_hvd.exchanges.compression``) the values are already rounded to a 16-bit
type; :func:`to_half_words` then packs two of them into each int32 word (a rank's block padded
to an even count), and :func:`from_half_words` unpacks every rank's block and widens it back.
"""

import tensorflow as tf

SUPPORTED = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


def words_per_value(dtype) -> int:
    """int32 words that hold one value of ``dtype`` (1 or 2)."""
    return 2 if tf.as_dtype(dtype).size == 8 else 1


def to_words(values: tf.Tensor) -> tf.Tensor:
    """A 1-D tensor's bits as a 1-D int32 tensor (``words_per_value`` words a value)."""
    size = values.dtype.size
    if size == 4:
        return tf.bitcast(values, tf.int32)
    if size == 8:
        return tf.reshape(tf.bitcast(values, tf.int32), [-1])
    if size == 2:
        return tf.cast(tf.bitcast(values, tf.uint16), tf.int32)
    raise TypeError(f"cannot send values of dtype {values.dtype.name}")


def from_words(words: tf.Tensor, dtype) -> tf.Tensor:
    """The inverse of :func:`to_words`: int32 words back to a 1-D tensor of ``dtype``."""
    dtype = tf.as_dtype(dtype)
    if dtype.size == 4:
        return tf.bitcast(words, dtype)
    if dtype.size == 8:
        return tf.bitcast(tf.reshape(words, [-1, 2]), dtype)
    if dtype.size == 2:
        return tf.bitcast(tf.cast(words, tf.uint16), dtype)
    raise TypeError(f"cannot receive values of dtype {dtype.name}")


def to_half_words(values: tf.Tensor, half) -> tf.Tensor:
    """1-D ``values`` (exactly representable in ``half``) as int32 words, two values a word."""
    halves = tf.bitcast(tf.cast(values, half), tf.uint16)
    halves = tf.concat([halves, tf.zeros([tf.size(halves) % 2], tf.uint16)], 0)
    return tf.bitcast(tf.reshape(halves, [-1, 2]), tf.int32)


def from_half_words(words: tf.Tensor, counts, half, dtype) -> tf.Tensor:
    """The inverse of :func:`to_half_words` for blocks gathered from several ranks: rank r's
    block holds ``counts[r]`` values (padded to an even count); returns them all, in rank
    order, as ``dtype``."""
    halves = tf.reshape(tf.bitcast(words, tf.uint16), [-1])
    counts = tf.cast(counts, tf.int32)
    starts = tf.cumsum(counts + counts % 2, exclusive=True)
    kept = tf.gather(halves, tf.ragged.range(starts, starts + counts).flat_values)
    return tf.cast(tf.bitcast(kept, half), dtype)
