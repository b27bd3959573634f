"""Compact values: a sent float as its sign and mantissa bits and 1-2 bits of exponent.

Top-k sends the largest entries of each variable (or of the model): their magnitudes lie
above one cut, mostly within a binade or two of it, so the 8 exponent bits of a float32
(5 of a float16) carry 1-2 bits of information (measured: 1.0-1.2 bits an exponent with this
code, ``scripts/benchmarks/bench_index_bytes.py``). The sign and mantissa bits are close to
random and travel as they are. Nothing is rounded: the bits that come out are the bits that
went in (zeros, subnormals, infinities and NaN payloads included).

1. split each value's bits (float32, float16 or bfloat16) into its sign-and-mantissa field
   (24, 11 or 8 bits) and its exponent ``e``;
2. per variable, ``base`` = its least nonzero exponent, less one if it sends a zero or a
   subnormal (exponent 0); the code is ``c = e - base``, or 0 for exponent 0. So ``c >= 0``,
   and ``c = 0`` means exponent 0 exactly where the variable sent one;
3. ``c`` is Rice coded (Rice, 1979): its ``W`` low bits as a fixed-width field, the rest
   ``c >> W`` in unary, as a bitmap with bit ``i + (c_0 >> W) + ... + (c_i >> W)`` set for
   the i-th value (how ``index_coding`` writes its high halves). ``W`` minimises the block's
   bits ``K W + sum(c >> W)``, computed from a histogram of ``c``;
4. one rank's block: the sign-and-mantissa fields, the low fields, the bitmap, each packed to
   whole int32 words. Its header (:func:`header_fields`) carries ``W``, the bitmap's bits and
   each variable's ``base`` (with its zero flag), so every rank knows every block's length
   before anything is decoded;
5. :func:`decode` reverses steps 1-4 for every rank's block at once.

On CPU both ways run as one native pass each (``sparse_hvd/kernels/value_codec.cc``, the same
words bit for bit); the TensorFlow ops below are the path on GPU and without the kernels.
:func:`decode_host` decodes one rank's block in NumPy (the delayed pipeline's thread).

A value then costs ``F + W + 1 + (c >> W)`` bits (F the field's width) against 32 or 16.
"""

from typing import NamedTuple

import numpy as np
import tensorflow as tf

from .. import kernels
from . import bit_packing


class Format(NamedTuple):
    """A float's bit layout: ``bits`` in all, ``exponent`` of them for the exponent."""

    bits: int
    exponent: int

    @property
    def mantissa(self) -> int:
        return self.bits - 1 - self.exponent

    @property
    def field(self) -> int:
        """Step 1's sign-and-mantissa field, in bits."""
        return self.bits - self.exponent


# bits an exponent costs on top of its field: measured 1.0-1.2 on the selections of the MLP
# and ResNet-50 under way (``scripts/benchmarks/bench_index_bytes.py``), priced with a margin
# (``exchange="auto"``'s byte gate and reach rule read it; the statistics count real words)
EXPONENT_BITS = 1.5

FORMATS = {tf.float32: Format(32, 8), tf.float16: Format(16, 5), tf.bfloat16: Format(16, 8)}


def coded_bytes(value_bytes) -> float:
    """What a float32 (``value_bytes`` 4) or 16-bit value costs coded, about: its exponent's
    8 or 5 bits replaced by ``EXPONENT_BITS``; a float64 travels as it is."""
    if value_bytes == 8:
        return 8
    exponent = 8 if value_bytes == 4 else 5  # float32's, float16's
    return value_bytes - (exponent - EXPONENT_BITS) / 8


def codable(dtype) -> bool:
    """Whether values of ``dtype`` can be coded here (float64 travels as it is)."""
    return tf.as_dtype(dtype) in FORMATS


class Block(NamedTuple):
    """One rank's coded values: its words and what :func:`header_fields` sends of it."""

    words: tf.Tensor  # int32
    width: tf.Tensor  # int64: W of step 3
    unary_bits: tf.Tensor  # int64: the bitmap's length
    bases: tf.Tensor  # int64 [variables]: 2 base + (sent a zero), step 2


def _raw_bits(values):
    """The bits of float ``values`` as int64 in ``[0, 2^bits)``."""
    if values.dtype.size == 4:
        return tf.bitwise.bitwise_and(tf.cast(tf.bitcast(values, tf.int32), tf.int64),
                                      0xFFFFFFFF)
    return tf.cast(tf.bitcast(values, tf.uint16), tf.int64)


def _codes(values, counts):
    """Steps 1-2: ``(fields, c, bases)`` of 1-D ``values``, variable after variable
    (``counts``: a list of each variable's entries)."""
    form = FORMATS[values.dtype]
    raw = _raw_bits(values)
    exponent = tf.bitwise.bitwise_and(tf.bitwise.right_shift(raw, form.mantissa),
                                      (1 << form.exponent) - 1)
    sign = tf.bitwise.right_shift(raw, form.bits - 1)
    fields = tf.bitwise.bitwise_or(tf.bitwise.left_shift(sign, form.mantissa),
                                   tf.bitwise.bitwise_and(raw, (1 << form.mantissa) - 1))
    variables = len(counts)
    variable = tf.repeat(tf.range(variables, dtype=tf.int64), tf.stack(counts))
    nonzero = exponent > 0
    largest = (1 << form.exponent) - 1
    least = tf.minimum(tf.math.unsorted_segment_min(tf.where(nonzero, exponent, largest),
                                                    variable, variables), largest)
    zero = tf.maximum(tf.math.unsorted_segment_max(tf.cast(tf.logical_not(nonzero), tf.int64),
                                                   variable, variables), 0)
    base = least - zero  # an empty variable's segment min is the dtype's largest: clamped above
    codes = tf.where(nonzero, exponent - tf.gather(base, variable), tf.zeros_like(exponent))
    return fields, codes, 2 * base + zero


def _rice_width(codes, form):
    """Step 3's ``W``: the least ``K W + sum(c >> W)`` over ``W`` in ``[0, exponent bits]``."""
    span = 1 << form.exponent
    histogram = tf.math.bincount(tf.cast(codes, tf.int32), minlength=span, maxlength=span,
                                 dtype=tf.int64)
    widths = tf.range(form.exponent + 1, dtype=tf.int64)
    quotients = tf.bitwise.right_shift(tf.range(span, dtype=tf.int64)[tf.newaxis, :],
                                       widths[:, tf.newaxis])
    cost = (tf.size(codes, out_type=tf.int64) * widths
            + tf.reduce_sum(quotients * histogram[tf.newaxis, :], axis=1))
    return tf.argmin(cost, output_type=tf.int64)  # the first of equals: the same on every rank


def block_words(count, width, unary_bits, form):
    """``(field words, low words, bitmap words)`` of a block of ``count`` values (int64)."""
    return (bit_packing.words_for(count * form.field), bit_packing.words_for(count * width),
            bit_packing.words_for(unary_bits))


def _as_int32(values):
    """The bits of float ``values`` as the native ops take them (int32; a 16-bit value
    zero-extended): a float32's by one bitcast, where the int64 of :func:`_raw_bits`, a mask
    and the casts back took 0.8 ms of a step (4 ranks, 5% of the 4.35M MLP, op profile)."""
    if values.dtype.size == 4:
        return tf.bitcast(values, tf.int32)
    return tf.cast(tf.bitcast(values, tf.uint16), tf.int32)


def _from_raw(raw, form, dtype):
    """Raw bits (int64, or the native ops' int32) back to floats of ``dtype``."""
    if form.bits == 32:
        return tf.bitcast(raw if raw.dtype == tf.int32 else tf.cast(raw, tf.uint32), tf.float32)
    return tf.bitcast(tf.cast(raw, tf.uint16), dtype)


def encode(values, counts) -> Block:
    """Steps 1-4 for one rank's 1-D ``values`` (float32, float16 or bfloat16), ``counts[j]``
    of them for variable j, in that order."""
    form = FORMATS[values.dtype]
    native = kernels.encode_values()
    if native is not None:
        words, fields = native(_as_int32(values),
                               tf.cast(tf.stack(counts), tf.int32),
                               value_bits=form.bits, exponent_bits=form.exponent)
        return Block(words, fields[0], fields[1], fields[2:])
    fields, codes, bases = _codes(values, counts)
    width = _rice_width(codes, form)
    count = tf.size(codes, out_type=tf.int64)
    quotients = tf.bitwise.right_shift(codes, width)
    unary_bits = count + tf.reduce_sum(quotients)
    field_words, low_words, bitmap_words = block_words(count, width, unary_bits, form)
    lows = tf.bitwise.bitwise_and(codes, tf.bitwise.left_shift(tf.constant(1, tf.int64), width) - 1)
    places = tf.range(count, dtype=tf.int64) + tf.cumsum(quotients)
    words = tf.concat([bit_packing.pack_fields(fields, form.field, field_words),
                       bit_packing.pack_fields(lows, width, low_words),
                       bit_packing.bitmap(places, bitmap_words)], 0)
    return Block(words, width, unary_bits, bases)


def coded_words(values, counts) -> tf.Tensor:
    """How many int32 words :func:`encode` makes of ``values`` (int64); without the native
    kernels, without packing them."""
    form = FORMATS[values.dtype]
    if kernels.encode_values() is not None:
        return tf.size(encode(values, counts).words, out_type=tf.int64)
    _, codes, _ = _codes(values, counts)
    width = _rice_width(codes, form)
    count = tf.size(codes, out_type=tf.int64)
    unary_bits = count + tf.reduce_sum(tf.bitwise.right_shift(codes, width))
    return tf.add_n(list(block_words(count, width, unary_bits, form)))


def header_fields(block: Block) -> tf.Tensor:
    """What a rank's header carries of its block: ``[W, bitmap bits, *bases]`` (int64)."""
    return tf.concat([tf.stack([block.width, block.unary_bits]), block.bases], 0)


def decode(words, counts, fields, dtype) -> tf.Tensor:
    """Step 5: every rank's values, in rank order, from the gathered ``words`` of their blocks
    (``counts``: [ranks, variables] values; ``fields``: [ranks, 2 + variables], each rank's
    :func:`header_fields`), as ``dtype``."""
    form = FORMATS[tf.as_dtype(dtype)]
    native = kernels.decode_values()
    if native is not None:
        return _from_raw(native(words, tf.cast(counts, tf.int32), tf.cast(fields, tf.int64),
                                value_bits=form.bits, exponent_bits=form.exponent),
                         form, dtype)
    counts = tf.cast(counts, tf.int64)
    fields = tf.cast(fields, tf.int64)
    ranks, variables = counts.shape[0], counts.shape[1]
    per_rank = tf.reduce_sum(counts, axis=1)
    widths, unary_bits = fields[:, 0], fields[:, 1]
    field_words, low_words, bitmap_words = block_words(per_rank, widths, unary_bits, form)
    starts = tf.cumsum(field_words + low_words + bitmap_words, exclusive=True)
    rank = tf.repeat(tf.range(ranks, dtype=tf.int64), per_rank)  # of each value
    local = tf.range(tf.reduce_sum(per_rank)) - tf.gather(tf.cumsum(per_rank, exclusive=True),
                                                          rank)
    readable = bit_packing.readable(words)
    value_fields = bit_packing.fields_at(
        readable, 32 * tf.gather(starts, rank) + local * form.field, form.field)
    width = tf.gather(widths, rank)
    lows = bit_packing.fields_at(
        readable, 32 * tf.gather(starts + field_words, rank) + local * width, width)
    bitmap_starts = starts + field_words + low_words
    bitmaps = tf.gather(words, tf.ragged.range(bitmap_starts,
                                               bitmap_starts + bitmap_words).flat_values)
    places = bit_packing.set_bits(bitmaps) - 32 * tf.gather(
        tf.cumsum(bitmap_words, exclusive=True), rank)
    cumulative = places - local  # (c_0 >> W) + ... + (c_i >> W)
    quotients = cumulative - tf.where(local > 0, tf.roll(cumulative, 1, 0),
                                      tf.zeros_like(cumulative))
    codes = tf.bitwise.bitwise_or(tf.bitwise.left_shift(quotients, width), lows)
    variable = tf.repeat(tf.tile(tf.range(variables, dtype=tf.int64), [ranks]),
                         tf.reshape(counts, [-1]))
    bases = tf.gather(tf.reshape(fields[:, 2:], [-1]), rank * variables + variable)
    exponent = tf.where(tf.logical_and(tf.equal(codes, 0), tf.equal(bases % 2, 1)),
                        tf.zeros_like(codes), codes + tf.bitwise.right_shift(bases, 1))
    sign = tf.bitwise.right_shift(value_fields, form.mantissa)
    raw = tf.bitwise.bitwise_or(
        tf.bitwise.bitwise_or(tf.bitwise.left_shift(sign, form.bits - 1),
                              tf.bitwise.left_shift(exponent, form.mantissa)),
        tf.bitwise.bitwise_and(value_fields, (1 << form.mantissa) - 1))
    return _from_raw(raw, form, dtype)


def host_block_words(count: int, width: int, unary_bits: int, dtype) -> int:
    """The int32 words of one rank's block (:func:`block_words`, summed, in integers)."""
    form = FORMATS[tf.as_dtype(dtype)]
    return -(-count * form.field // 32) + -(-count * width // 32) + -(-unary_bits // 32)


def decode_host(words, counts, fields, dtype) -> np.ndarray:
    """Step 5 in NumPy for ONE rank's block: its values (``counts[j]`` of variable j) as
    ``dtype``, from its ``words`` and its :func:`header_fields` ``fields`` (integers)."""
    form = FORMATS[tf.as_dtype(dtype)]
    count, width, unary_bits = int(sum(counts)), int(fields[0]), int(fields[1])
    expected = host_block_words(count, width, unary_bits, dtype)
    if len(words) != expected:
        raise ValueError(f"a block of {count} values has {expected} words, got {len(words)}")
    field_words, low_words = -(-count * form.field // 32), -(-count * width // 32)
    readable = bit_packing.host_readable(words)
    value_fields = bit_packing.host_fields(readable, 0, count, form.field)
    lows = bit_packing.host_fields(readable, 32 * field_words, count, width)
    places = bit_packing.host_set_bits(words[field_words + low_words:])
    if len(places) != count:
        raise ValueError(f"a block of {count} values has {len(places)} set bits in its bitmap")
    quotients = np.diff(places - np.arange(count, dtype=np.int64), prepend=0)
    codes = (quotients << width) | lows
    bases = np.repeat(np.asarray(fields[2:], np.int64), np.asarray(counts, np.int64))
    exponent = np.where((codes == 0) & (bases % 2 == 1), 0, codes + (bases >> 1))
    raw = (((value_fields >> form.mantissa) << (form.bits - 1)) | (exponent << form.mantissa)
           | (value_fields & ((1 << form.mantissa) - 1)))
    unsigned = np.uint32 if form.bits == 32 else np.uint16
    return raw.astype(unsigned).view(tf.as_dtype(dtype).as_numpy_dtype)
