"""``compression=``: gradient values travel as 16-bit floats, and the rounding error is kept.

Horovod's fp16 compression rounds each gradient to 16 bits and loses the difference. Here the
difference goes into the rank's residual, as everything else that was not sent does, so no
gradient is lost, only delayed:

1. the sparse route: the selected values ``v`` are rounded to the 16-bit type ``h``; the
   residual at the selected positions becomes ``v - float(h(v))`` (it was zero there), and
   the exchange carries ``h(v)``, two values to an int32 word (``sparse_hvd.wire``);
2. the dense route: ``c = gradient + residual`` (that residual is zero without compression) is
   rounded the same way, ``residual = c - float(h(c))``, and ``h(c)`` is exchanged;
3. what arrives is widened back to the variable's dtype before it is summed, rank by rank.

float16 saturates at +-65504: larger magnitudes are sent as +-65504 and the rest stays in the
residual. bfloat16 has float32's range and 8 bits of mantissa. The first step's rounding error
is applied one step later, as error feedback applies everything it holds.
"""

from typing import Optional

import tensorflow as tf

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
