"""``exchange="sign"``: every entry of a cut variable as one bit, its sign, and a scale per block.

Top-k at 1% sends 1 entry in 100 at 8 bytes (value and index). This exchange sends every
entry at 1/8 byte: each rank sends, per variable, the signs of its compensated tensor ``c``
(its update, with ``sparsify="update"``, plus its residual) and, for each block of
:data:`BLOCK` (64) consecutive entries, a scale, the block's mean magnitude, rounded to
bfloat16 (16 bits, float32's range); what it stands for, ``scale * sign(c)``, is what is
averaged, and ``c - scale * sign(c)`` stays in the residual (error feedback: EF-SignSGD,
Karimireddy et al. 2019; the compressor of 1-bit Adam, Tang et al. 2021, with one scale per
tensor). So a worker sends 1.25 bits an entry, 1/26 of dense's bytes, and every entry moves a
little every step where top-k moves a few entries a lot.
Measured under Adam (``docs/steps_to_loss_sign.md``, 3 seeds, the steps to dense's half-run
loss over dense's), with one scale per variable: a character LSTM 1.01 at 4 workers and 1.08
at 8, a CNN 0.97, a small transformer 1.40, where top-k at 1% of each worker's update needs
1.22, 1.31, 1.03 and 1.90; so it is what ``exchange=None`` sends with Adam
(``selection.defaults.one_bit_by_default``). With Adam it comes with
``second_moment="noise_estimate"`` by default (``feedback.second_moment``;
``docs/steps_to_loss_noise_estimate.md``): the LSTM 0.83 and 0.91, the transformer 1.13 and
1.08 at 4 and 8 workers, the CNN 0.94 and 0.80 (one scale per variable). A scale per block of
64 gives each part of a tensor its own size (``docs/steps_to_loss_sign_blocks.md``).
``exchange="sign_per_variable"`` keeps one float32 scale per variable (the previous
``"sign"``: 1 bit an entry and 4 bytes a variable).
With SGD it is far worse than top-k (probes, one scale per variable: a sign's scale carries
no per-entry size, which Adam's normalised update does not need and SGD's does).

1. select (:class:`ScaledSign`, the error feedback's fused pass; on CPU two native passes):
   ``scale = mean |c|`` over each block, rounded to bfloat16, ``sent = scale`` where
   ``c >= 0`` and ``-scale`` elsewhere (an exact zero travels as +, one bit has no room for
   it), residual ``c - sent`` (the scale's rounding included: nothing is lost);
2. pack: each variable's scales (bfloat16 bits, two to an int32 word), then each variable's
   sign bits (1: negative) in int32 words (on CPU in one native pass, ``kernels/sign_sum.cc``;
   where more than one worker sends them unrounded, step 1's pass writes them so itself:
   ``ScaledSign.packing``), after the header (``base.header``) and with the small dense-route
   gradients (``base.pack_dense``): one ``grouped_allgather`` per step;
3. unpack: every rank in this step (the header, else every rank raises), then for each
   variable every rank's ``scale * (1 - 2 bit)``, summed in rank order from zero (the same
   bits on every rank) and divided by the number of workers: on CPU in one native pass
   (``kernels/sign_sum.cc``), elsewhere by TensorFlow ops that compute the same bits.

An allgather: a worker receives (N - 1) 1.25 n / 8 bytes per variable of n entries, N/51 of
what a ring allreduce of float32 moves per worker (2 (N - 1) / N of 4 n bytes): less up to 51
workers. It chooses what it sends itself, so ``sparsifier``, ``density`` (only the routes:
variables under ``min_elements`` go dense) and ``budget`` do not apply; it does not combine
with ``momentum_correction`` (masking would clear every entry's velocity), ``staleness``,
``AdaptiveDensity``, ``dense_fallback`` or ``grouping="layerwise"`` (``sparse_hvd.checks``).
With ``compression`` only the small dense-route gradients are rounded to its 16 bits: the
scales already travel in 16 bits, and float16 would lose the smallest (an Adam step of 1e-6
is a float16 subnormal; bfloat16 keeps float32's range). ``"sign_per_variable"`` rounds its
float32 scales to the compression's 16 bits (the error kept in the residual).
``exchange="auto"`` chooses between it and dense where ``exchange=None`` means signs (with
Adam), never between it and the top-k exchanges: it changes what is averaged, not only how it
travels.
"""

import tensorflow as tf

from .. import kernels
from ..runtime import collectives
from ..feedback.payload import Payload
from ..selection.sparsifiers import Selection, Sparsifier
from .averaging import divided, sum_rows_in_order
from .base import checked_headers, header, register
from .bit_packing import pack_fields, words_for
from .fused_allgather import FusedAllgather


BLOCK = 64  # exchange="sign": entries a scale stands for (a multiple of 32)


def blocks_of(n, block):
    """The number of scales of a variable of ``n`` entries: one per ``block`` (0: one)."""
    return 1 if block == 0 else -(-n // block)


def in_blocks(flat, block):
    """The flat tensor as ``[blocks, block]`` rows (``block`` 0: one row of all of it), the
    last row padded with zeros, and each row's count of real entries (a list)."""
    n = flat.shape.num_elements()  # static: a variable's layout
    size, blocks = (block or n), blocks_of(n, block)
    rows = tf.reshape(tf.pad(flat, [[0, blocks * size - n]]), [blocks, size])
    return rows, [min(size, n - b * size) for b in range(blocks)]


def block_scales(magnitudes, block):
    """Each block's mean of the flat ``magnitudes`` (the last block's over what it holds), in
    float32; one mean with ``block`` 0."""
    rows, counts = in_blocks(tf.cast(magnitudes, tf.float32), block)
    return tf.reduce_sum(rows, 1) / tf.constant(counts, tf.float32)


def per_entry(scales, n, block):
    """``scales`` ([..., blocks]) repeated over their blocks' entries: [..., n]."""
    if block == 0:
        return scales
    return tf.repeat(scales, block, axis=-1)[..., :n]


def scaled_signs(flat, block=0):
    """Each entry's block's mean magnitude where ``flat >= 0``, its negative elsewhere (step
    1); with blocks the means rounded to bfloat16, as they travel."""
    scales = block_scales(tf.abs(flat), block)
    if block:
        scales = tf.cast(scales, tf.bfloat16)
    scale = per_entry(tf.cast(scales, flat.dtype), flat.shape.num_elements(), block)
    return tf.where(flat < 0, -scale, scale)


class ScaledSign(Sparsifier):
    """Step 1: every entry, as its sign times the mean magnitude of its block (``block``
    entries, 0: the whole variable); ``k`` is not used. With error feedback the residual is the
    difference from the compensated tensor (not the compensated tensor with the sent entries
    zeroed, as for the sparsifiers that send entries as they are).

    ``packed`` (:meth:`packing`: a rank that sends its signs as they are, more than one worker
    and its scales not rounded by ``compression``): on CPU the selecting pass writes the sign
    words and the scales as step 2 packs them (``Selection.packed``; ``kernels/sign_sum.cc``),
    and the [n] floats ``+-scale``, which only the packing would read, are never made: on one
    4.2M-entry variable, one thread, 4.3 ms against 5.6 for the pass and the packing (the same
    bits)."""

    name = "scaled_sign"

    def __init__(self, block=0, packed=False):
        self.block = block
        self.packed = packed
        # with blocks the scales travel as bfloat16 whatever ``compression`` says: rounding
        # them to float16 too would only lose the small ones (float16's range ends near 6e-8)
        self.own_wire_precision = block > 0

    def packing(self) -> "ScaledSign":
        """The same signs, made packed as they travel (see the class doc)."""
        return ScaledSign(self.block, packed=True)

    def __call__(self, flat, k):
        return Selection(scaled_signs(flat, self.block),
                         tf.range(tf.size(flat, out_type=tf.int32)))

    def fused_compensate_select(self, flat_grad, flat_residual, k):
        native = kernels.compensate_sign() if flat_grad.dtype == tf.float32 else None
        packing = kernels.packed_compensate_sign() if native is not None and self.packed else None
        if packing is not None:
            words, scales, remainder, finite = packing(
                flat_grad, tf.cast(flat_residual, tf.float32), block=self.block)
            return Selection(tf.zeros([0], flat_grad.dtype),
                             tf.range(tf.size(flat_grad, out_type=tf.int32)), finite=finite,
                             packed=(words, scales)), remainder
        if native is not None:  # two passes, the payload's finiteness found in them too
            sent, remainder, finite = native(flat_grad, tf.cast(flat_residual, tf.float32),
                                             block=self.block)
            return Selection(sent, tf.range(tf.size(sent, out_type=tf.int32)),
                             finite=finite), remainder
        compensated = flat_grad + tf.cast(flat_residual, flat_grad.dtype)
        selection = self(compensated, k)
        return selection, compensated - selection.values


def pack_signs(values) -> tf.Tensor:
    """``values``' sign bits (1 where negative), little-endian in int32 words."""
    n = values.shape.num_elements()  # static: the layout's lengths are the same every step
    return pack_fields(tf.cast(tf.reshape(values, [-1]) < 0, tf.int64), 1, words_for(n))


def unpack_signs(words, n) -> tf.Tensor:
    """``[rows, words_for(n)]`` int32 words as ``[rows, n]`` float32 signs, +1 or -1."""
    rows = tf.shape(words)[0]
    bits = tf.bitwise.bitwise_and(
        tf.bitwise.right_shift(tf.expand_dims(words, 2), tf.range(32, dtype=tf.int32)), 1)
    bits = tf.reshape(bits, [rows, -1])[:, :n]
    return 1.0 - 2.0 * tf.cast(bits, tf.float32)


def spread(per_group, group, length) -> tf.Tensor:
    """Each of ``per_group``'s values repeated for the ``group`` entries it stands for, the
    first ``length`` of them."""
    if group == 1:
        return per_group
    return tf.reshape(tf.repeat(tf.expand_dims(per_group, 1), group, axis=1), [-1])[:length]


def bfloat16_words(scales) -> tf.Tensor:
    """float32 ``scales`` (bfloat16 values: exact) as bfloat16 bits, two to an int32 word (the
    first in the low half on a little-endian machine); a last odd one is paired with 0."""
    halves = tf.cast(scales, tf.bfloat16)
    halves = tf.pad(halves, [[0, scales.shape[0] % 2]])  # static: one per block
    return tf.bitcast(tf.reshape(halves, [-1, 2]), tf.int32)


def bfloat16_scales(words, count) -> tf.Tensor:
    """The inverse of :func:`bfloat16_words` for ``[rows, words]``: ``[rows, count]`` float32."""
    rows = tf.shape(words)[0]
    halves = tf.reshape(tf.bitcast(words, tf.bfloat16), [rows, -1])[:, :count]
    return tf.cast(halves, tf.float32)


def scale_words(n, block) -> int:
    """int32 words a variable's scales take: one float32, or bfloat16 pairs per block."""
    return 1 if block == 0 else words_for(16 * blocks_of(n, block))


@register("sign", grouping="grouped")
class SignAllgather(FusedAllgather):
    """Steps 1-3 of the module doc: the fused allgather's one collective (its lockstep
    announcement and bytes on the wire too), carrying signs instead of selections; a scale per
    block of :data:`BLOCK` entries."""

    layer_budgets = False
    staleness = False
    chooses_entries = True
    averages_at_positions = False  # every entry has an average
    code = "signs"
    # under Adam, with the noise estimate, the signs needed 0.80-1.10x dense's steps to its
    # loss (the CNN, the character LSTM and the transformer at 4 and 8 workers, 3 seeds each,
    # README "Converging like dense"), top-k 1.22x to never: 1.2x prices that, with room for
    # a trial's noise (``steps.measured``, step 2)
    dense_within = 0.2
    grouping_reason = "its one allgather carries every variable's signs."
    block = BLOCK
    selector = ScaledSign(BLOCK)

    def routes_for(self, variables, density, min_elements):
        """Sparse (cut and signed) from ``min_elements`` entries on, whatever the density."""
        return [route._replace(sparse=route.num_elements >= min_elements)
                for route in super().routes_for(variables, density, min_elements)]

    # the callers count entries at ``density`` (``Exchange``); this one sends every entry at
    # 1/8 byte and a 16-bit scale per block (or 4 bytes per variable), whatever the density:
    # that over ``density`` for each of those
    def sent_bytes_per_entry(self, density, value_bytes):
        return (1 / 8 + (2 / self.block if self.block else 0)) / density

    def _average_many(self, payload: Payload, sizes, step):
        size = self.size
        dense = list(payload.dense.items)
        dense_groups, dense_words = self.pack_dense(dense)
        words = self.pack(payload.sparse.items, self.block)  # step 2
        self._layout = (0, 1 + len(dense_words))  # no header fields of its own
        self._sent = self.coded_bytes_sent(payload, tf.size(words))
        gathered = collectives.grouped_allgather(
            [header(payload.finite_here(), step), words] + dense_words,
            name=f"{self.name}.fused", process_set=self.process_set, step=step)
        gathered, finite, _ = checked_headers(gathered, size)  # step 3
        rows = tf.reshape(gathered[1], [size, words.shape[0]])
        sparse = self.unpack(rows, [s.values.dtype for s in payload.sparse.items], sizes,
                             self.block)
        averaged_dense = self.unpack_dense(dense, dense_groups, gathered[2:],
                                           payload.dense.keys, step)
        return sparse, averaged_dense, finite, ()

    @staticmethod
    def pack(selections, block=0, stride=1) -> tf.Tensor:
        """One rank's words: each selection's scales (``block`` 0: one, float32 bits; else one
        per block, bfloat16 bits two to a word), then each one's signs: of values 0,
        ``stride``, 2 x ``stride``, ... only (``exchange="topk_sign_pairs"``: one of each
        pair, both equal); a selection made packed (``Selection.packed``) as it is."""
        if not selections:
            return tf.zeros([0], tf.int32)
        parts = [SignAllgather.pack_one(s.values, block, stride) if s.packed is None
                 else SignAllgather.scale_and_sign_words(*s.packed, block) for s in selections]
        return tf.concat([scales for scales, _ in parts] + [words for _, words in parts], 0)

    @staticmethod
    def pack_one(values, block=0, stride=1):
        """:meth:`pack`'s two parts for one selection's ``values``: ``(scale words, sign
        words)``."""
        values = tf.cast(tf.reshape(values, [-1]), tf.float32)
        native = kernels.sign_pack()
        if native is not None:  # the same words and scales in one pass (sign_sum.cc)
            words, largest = native(values, block=block, stride=stride)
        else:
            values = values[::stride] if stride > 1 else values
            words = pack_signs(values)
            largest = tf.reduce_max(in_blocks(tf.abs(values), block)[0], 1)
        return SignAllgather.scale_and_sign_words(words, largest, block)

    @staticmethod
    def scale_and_sign_words(words, scales, block):
        """:meth:`pack_one`'s two parts from the sign ``words`` and float32 ``scales``: the
        scales as they travel (float32 bits for ``block`` 0, else bfloat16 pairs), and the
        words."""
        return (tf.bitcast(scales, tf.int32) if block == 0 else bfloat16_words(scales)), words

    @staticmethod
    def unpack(rows, dtypes, sizes, block=0, group=1):
        """Each variable's average (of ``sizes``' entries, as ``dtypes``) from every rank's
        words (``rows``: [ranks, words]), as :meth:`pack` packed them with ``stride=group``:
        each averaged sign written to the ``group`` entries it stands for."""
        size = rows.shape[0]
        signs = [-(-n // group) for n in sizes]
        start, scales = 0, []
        for m in signs:  # every selection's scales first, [ranks, blocks] float32
            width = scale_words(m, block)
            own = rows[:, start:start + width]
            scales.append(tf.bitcast(own, tf.float32) if block == 0
                          else bfloat16_scales(own, blocks_of(m, block)))
            start += width
        averages = []
        native = kernels.sign_sum()
        for dtype, n, m, scale in zip(dtypes, sizes, signs, scales):
            width = words_for(m)
            own = rows[:, start:start + width]
            if native is not None:  # the same bits in one pass (kernels/sign_sum.cc)
                average = native(own, scale, num_elements=n, block=block, group=group)
            else:
                total = sum_rows_in_order(unpack_signs(own, m) * per_entry(scale, m, block))
                average = spread(divided(total, size), group, n)
            averages.append(tf.cast(average, dtype))
            start += width
        return averages


@register("sign_per_variable", grouping="grouped")
class SignPerVariableAllgather(SignAllgather):
    """``exchange="sign_per_variable"``: the same with one float32 scale per variable (what
    ``exchange="sign"`` sent before its scales per block)."""

    block = 0
    selector = ScaledSign(0)
    auto_candidate = False  # its averages are coarser, not cheaper to move: never chosen
