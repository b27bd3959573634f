"""``compression=``: gradient values travel as 16-bit floats, and the rounding error is kept.

Horovod's fp16 compression rounds each gradient to 16 bits and loses the difference. Here the
difference goes into the rank's residual, as everything else that was not sent does, so no
gradient is lost, only delayed:

1. the sparse route: the selected values ``v`` are rounded to the 16-bit type ``h``; the
   residual at the selected positions becomes ``v - float(h(v))`` (it was zero there), and
   the exchange carries ``h(v)``, two values to an int32 word (``sparse_hvd.exchanges.wire``);
2. the dense route: ``c = gradient + residual`` (that residual is zero without compression) is
   rounded the same way, ``residual = c - float(h(c))``, and ``h(c)`` is exchanged;
3. what arrives is widened back to the variable's dtype before it is summed, rank by rank.
   The exception is a dense-route gradient that goes through Horovod's allreduce (with
   ``grouping="layerwise"``, or too large to travel in the fused allgather): with float16
   Horovod sums the 16-bit values in float16, so the sum over the ranks is rounded (to half a
   float16 unit in the last place per addition), as with Horovod's own fp16 compression; each
   rank's own rounding error is still kept. bfloat16 is summed in float32 (Horovod cannot
   reduce it), so nothing is rounded there.

One :class:`Compression` object holds the setting, and every part that touches values uses it:
the routes (bytes per value), error feedback (:meth:`Compression.round`), and every exchange
(:meth:`Compression.encode`/:meth:`~Compression.decode` for allgathers, two 16-bit values to
an int32 word; :meth:`Compression.for_allreduce` for Horovod's allreduce, which reduces float16
but not bfloat16).

float16 saturates at +-65504: larger magnitudes are sent as +-65504 and the rest stays in the
residual. bfloat16 has float32's range and 8 bits of mantissa. The first step's rounding error
is applied one step later, as error feedback applies everything it holds.
"""

from typing import Optional

import tensorflow as tf

from . import wire

CHOICES = {"none": None, "float16": tf.float16, "bfloat16": tf.bfloat16}
FLOAT16_MAX = 65504.0


def resolve(compression) -> Optional[tf.DType]:
    """The 16-bit dtype for ``compression`` ("none", "float16", "bfloat16"; None is "none")."""
    if compression is None:
        return None
    if not isinstance(compression, str) or compression not in CHOICES:
        raise ValueError(f"`compression` must be one of {tuple(CHOICES)}, got {compression!r}")
    return CHOICES[compression]


def rounded(values, half):
    """``(sent, error)``: ``values`` rounded to ``half`` (saturated for float16) and widened
    back to their dtype, and ``values - sent``; ``sent + error == values`` exactly when
    ``values`` are float32 (the difference of two floats this close is exact)."""
    narrow = values
    if half == tf.float16:
        narrow = tf.clip_by_value(values, -FLOAT16_MAX, FLOAT16_MAX)
    sent = tf.cast(tf.cast(narrow, half), values.dtype)
    return sent, values - sent


class Compression:
    """One ``compression=`` setting (``"none"``, ``"float16"`` or ``"bfloat16"``)."""

    def __init__(self, name="none"):
        self.half = resolve(name)
        self.name = "none" if name is None else name

    @property
    def enabled(self) -> bool:
        return self.half is not None

    def wire_dtype(self, dtype) -> Optional[tf.DType]:
        """The 16-bit dtype values of ``dtype`` travel as, or None (no compression, or values
        that are 16-bit already)."""
        if self.half is None or tf.as_dtype(dtype).size <= 2:
            return None
        return self.half

    def itemsize(self, dtype) -> int:
        """Bytes a value of ``dtype`` takes on the wire."""
        half = self.wire_dtype(dtype)
        return tf.as_dtype(half or dtype).size

    def round(self, values):
        """``(sent, error)`` of :func:`rounded` for ``values`` (``error`` zero when their dtype
        travels as it is)."""
        half = self.wire_dtype(values.dtype)
        if half is None:
            return values, tf.zeros_like(values)
        return rounded(values, half)

    def encode(self, values) -> tf.Tensor:
        """1-D values as int32 words for an allgather (two 16-bit values to a word)."""
        half = self.wire_dtype(values.dtype)
        return wire.to_words(values) if half is None else wire.to_half_words(values, half)

    def decode(self, words, dtype, per_rank) -> tf.Tensor:
        """Gathered words back to values of ``dtype``; ``per_rank``: values each rank sent."""
        half = self.wire_dtype(dtype)
        if half is None:
            return wire.from_words(words, dtype)
        return wire.from_half_words(words, per_rank, half, dtype)

    def for_allreduce(self, tensor) -> tf.Tensor:
        """``tensor`` as Horovod's allreduce should carry it: float16 with float16 compression
        (bfloat16 stays wide: Horovod cannot reduce it)."""
        if self.half == tf.float16 and self.wire_dtype(tensor.dtype) is not None:
            return tf.cast(tensor, tf.float16)
        return tensor

    def __repr__(self):
        return f"Compression({self.name!r})"


NONE = Compression("none")
