"""``exchange="sign"``: every entry of a cut variable as one bit, its sign, and one scale.

Top-k at 1% sends 1 entry in 100 at 8 bytes (value and index). This exchange sends every
entry at 1/8 byte: each rank sends, per variable, the signs of its compensated tensor ``c``
(its update, with ``sparsify="update"``, plus its residual) and one float32 scale, the mean
magnitude ``||c||_1 / n``; what it stands for, ``scale * sign(c)``, is what is averaged, and
``c - scale * sign(c)`` stays in the residual (error feedback: EF-SignSGD, Karimireddy et al.
2019; the compressor of 1-bit Adam, Tang et al. 2021). So a worker sends 1/32 of dense's
bytes, and every entry moves a little every step where top-k moves a few entries a lot.
Measured under Adam (``docs/steps_to_loss_sign.md``, 3 seeds, the steps to dense's half-run
loss over dense's): a character LSTM 1.01 at 4 workers and 1.08 at 8, a CNN 0.97, a small
transformer 1.40, where top-k at 1% of each worker's update needs 1.22, 1.31, 1.03 and 1.90;
so it is what ``exchange=None`` sends with Adam (``selection.defaults.one_bit_by_default``).
With Adam it comes with ``second_moment="noise_estimate"`` by default
(``feedback.second_moment``; ``docs/steps_to_loss_noise_estimate.md``): the LSTM 0.83 and
0.91, the transformer 1.13 and 1.08 at 4 and 8 workers, the CNN 0.94 and 0.80.
With SGD it is far worse than top-k (probes: a sign's scale carries no per-entry size, which
Adam's normalised update does not need and SGD's does).

1. select (:class:`ScaledSign`, the error feedback's fused pass; on CPU two native passes):
   ``scale = mean |c|``, ``sent = scale`` where ``c >= 0`` and ``-scale`` elsewhere (an exact
   zero travels as +, one bit has no room for it), residual ``c - sent``;
2. pack: each variable's sign bits (1: negative) in int32 words, after one word per variable
   holding its scale's bits (on CPU in one native pass, ``kernels/sign_sum.cc``), and the
   header (``base.header``) and the small dense-route gradients (``base.pack_dense``): one
   ``grouped_allgather`` per step;
3. unpack: every rank in this step (the header, else every rank raises), then for each
   variable every rank's ``scale * (1 - 2 bit)``, summed in rank order from zero (the same
   bits on every rank) and divided by the number of workers: on CPU in one native pass
   (``kernels/sign_sum.cc``), elsewhere by TensorFlow ops that compute the same bits.

An allgather: a worker receives (N - 1) n / 8 bytes per variable of n entries, N/64 of what a
ring allreduce of float32 moves per worker (2 (N - 1) / N of 4 n bytes): less up to 64
workers. It chooses what it sends itself, so ``sparsifier``, ``density`` (only the routes:
variables under ``min_elements`` go dense) and ``budget`` do not apply; it does not combine
with ``momentum_correction`` (masking would clear every entry's velocity), ``staleness``,
``AdaptiveDensity``, ``dense_fallback`` or ``grouping="layerwise"`` (``sparse_hvd.checks``).
With ``compression`` the scales travel rounded to 16 bits (the rounding error kept in the
residual, as for any value), and so do the small dense-route gradients. ``exchange="auto"``
chooses between it and dense where ``exchange=None`` means signs (with Adam), never between
it and the top-k exchanges: it changes what is averaged, not only how it travels.
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


def scaled_signs(flat):
    """``mean |flat|`` where ``flat >= 0`` and its negative elsewhere (step 1)."""
    scale = tf.reduce_mean(tf.abs(flat))
    return tf.where(flat < 0, -scale, scale)


class ScaledSign(Sparsifier):
    """Step 1: every entry, as its sign times the variable's mean magnitude; ``k`` is not
    used. With error feedback the residual is the difference from the compensated tensor (not
    the compensated tensor with the sent entries zeroed, as for the sparsifiers that send
    entries as they are)."""

    name = "scaled_sign"

    def __call__(self, flat, k):
        return Selection(scaled_signs(flat), tf.range(tf.size(flat, out_type=tf.int32)))

    def fused_compensate_select(self, flat_grad, flat_residual, k):
        native = kernels.compensate_sign() if flat_grad.dtype == tf.float32 else None
        if native is not None:  # two passes (kernels/sign_sum.cc)
            sent, remainder = native(flat_grad, tf.cast(flat_residual, tf.float32))
            return Selection(sent, tf.range(tf.size(sent, out_type=tf.int32))), remainder
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


@register("sign", grouping="grouped")
class SignAllgather(FusedAllgather):
    """Steps 1-3 of the module doc: the fused allgather's one collective (its lockstep
    announcement and bytes on the wire too), carrying signs instead of selections."""

    layer_budgets = False
    staleness = False
    chooses_entries = True
    code = "signs"
    grouping_reason = "its one allgather carries every variable's signs."
    selector = ScaledSign()

    def routes_for(self, variables, density, min_elements):
        """Sparse (cut and signed) from ``min_elements`` entries on, whatever the density."""
        return [route._replace(sparse=route.num_elements >= min_elements)
                for route in super().routes_for(variables, density, min_elements)]

    # the callers count entries at ``density`` (``Exchange``); this one sends every entry at
    # 1/8 byte, whatever the density: 1 / (8 density) bytes for each of those
    def sent_bytes_per_entry(self, density, value_bytes):
        return 1 / (8 * density)

    def _average_many(self, payload: Payload, sizes, step):
        size = self.size
        dense = list(payload.dense.items)
        dense_groups, dense_words = self.pack_dense(dense)
        words = self.pack(payload.sparse.items)  # step 2
        self._layout = (0, 1 + len(dense_words))  # no header fields of its own
        self._sent = self.coded_bytes_sent(payload, tf.size(words))
        gathered = collectives.grouped_allgather(
            [header(payload.finite_here(), step), words] + dense_words,
            name=f"{self.name}.fused", process_set=self.process_set, step=step)
        gathered, finite, _ = checked_headers(gathered, size)  # step 3
        rows = tf.reshape(gathered[1], [size, words.shape[0]])
        sparse = self.unpack(rows, payload.sparse.items, sizes)
        averaged_dense = self.unpack_dense(dense, dense_groups, gathered[2:],
                                           payload.dense.keys, step)
        return sparse, averaged_dense, finite, ()

    @staticmethod
    def pack(selections) -> tf.Tensor:
        """One rank's words: each selection's scale (float32 bits), then each one's signs."""
        if not selections:
            return tf.zeros([0], tf.int32)
        native = kernels.sign_pack()
        scales, words = [], []
        for selection in selections:
            values = tf.cast(tf.reshape(selection.values, [-1]), tf.float32)
            if native is not None:  # the same words and scale in one pass (sign_sum.cc)
                own, scale = native(values)
            else:
                own, scale = pack_signs(values), tf.reduce_max(tf.abs(values))
            words.append(own)
            scales.append(scale)
        return tf.concat([tf.bitcast(tf.stack(scales), tf.int32)] + words, 0)

    @staticmethod
    def unpack(rows, selections, sizes):
        """Each selection's average from every rank's words (``rows``: [ranks, words])."""
        size = rows.shape[0]
        scales = tf.bitcast(rows[:, :len(selections)], tf.float32)
        start, averages = len(selections), []
        native = kernels.sign_sum()
        for j, (selection, n) in enumerate(zip(selections, sizes)):
            width = words_for(n)
            own = rows[:, start:start + width]
            if native is not None:  # the same bits in one pass (kernels/sign_sum.cc)
                average = native(own, scales[:, j], num_elements=n)
            else:
                total = sum_rows_in_order(unpack_signs(own, n) * scales[:, j:j + 1])
                average = divided(total, size)
            averages.append(tf.cast(average, selection.values.dtype))
            start += width
        return averages
