"""``exchange="topk_sign"``: the top-k entries exactly, and the sign of every other entry.

Top-k with error feedback moves 1 entry in 100 a lot and leaves the others waiting in the
residual for about 1/density steps; the scaled sign (``exchange="sign"``) moves every entry
a little, but with one scale per variable it gives every entry the same size, which SGD's
update, spread over orders of magnitude, does not survive (the LSTM under SGD never reached
dense's loss). This exchange sends both, in two stages of one compressor:

1. select: ``selection = top-k(c)`` by the configured sparsifier, density and budget (the
   model-wide cut by default), ``c`` the compensated tensor (the update plus the residual);
2. the rest: ``rest = c`` with the selected entries zeroed, ``scale = sum |rest| / (n - k)``
   (the mean magnitude of the entries not selected), and ``signs = scale`` where ``rest >= 0``,
   ``-scale`` elsewhere (one bit an entry: a selected entry's zero travels as +);
3. remember: the residual is ``rest - signs``, so ``selection + signs + residual == c``;
4. exchange: one ``grouped_allgather`` carries the fused allgather's header, indices and values
   (``FusedAllgather``) and each rank's sign words and scales (``exchanges.sign``); every rank
   averages the selections and the signs in rank order, and adds the two averages (natively:
   the selections' averages where they arrived, added into the signs' average in its buffer,
   :func:`plus_signs`).

The large entries travel exactly and at once (top-k's strength, which SGD's heavy-tailed
update needs), the rest move every step by their sign (the sign's strength: nothing waits a
hundred steps), and the sign's scale is that of the small entries only, so it is not inflated
by the large ones. Measured under SGD with momentum (``docs/steps_to_loss_topk_sign.md``, 3
seeds, steps to dense's half-run loss over dense's): a character LSTM 1.07 at 4 workers and
1.11 at 8, a CNN 1.05 and 0.89, where top-k at 1% of each worker's update needs 1.21, 1.23,
1.18 and 0.83. Under Adam it did worse than the sign code (a probe on the transformer). It
is not a default: its step costs more (a bit an entry, and about four more passes over each
cut variable: 1.22x top-k's step on the 4.35M MLP at 4 workers and 1 Gbit/s, README "The CPU
allocator"), and timed on the emulated 1 Gbit/s cluster the wide CNN reached dense's loss later
with it than with top-k alone (``docs/time_to_loss_topk_sign.md``).

Bytes: the selections' (8 bytes an entry, float32) plus n/8 + 4 per variable: at 1%, 0.051
of dense's float32 bytes a step (the top-k's 0.02 and the signs' 0.031); 0.068-0.070 over an
800-step run with the warm-up's first steps at 10%. Like the sign
exchange, it does not combine with ``momentum_correction`` (masking would clear every entry's
velocity), ``staleness``, ``AdaptiveDensity``, ``dense_fallback`` or
``grouping="layerwise"``; with ``compression`` the scales travel rounded to 16 bits, their
error kept in the residual. ``exchange="auto"`` never chooses it in place of an exchange that
averages something else (``Exchange.code``); ``selection.defaults.SIGNS_OF_REST`` (off) would
make it what ``exchange=None`` sends with SGD's momentum.

``exchange="topk_sign2"`` (also an option) replaces step 2 by two levels: the band, the
``(BAND - 1) x k`` largest entries below the top k (cut over the whole model with the
model-wide budget, else per variable), at its own mean magnitude, the rest at theirs, sent as
two layers of signs (:func:`two_level_signs`): two bits an entry. Measured at 4 workers, 3
seeds (``docs/steps_to_loss_topk_sign2.md``): the LSTM 1.02, the CNN 1.01, finals inside
dense's spread on average; not timed yet.

``exchange="topk_sign_pairs"`` (also an option) sends half the signs: one for each pair of
entries (2j, 2j + 1) of a variable, the sign of the pair's sum, at the least-squares scale
``sum |pair sums| / (n - k)`` (step 2 with ``group=2``); each rank sends ceil(n/2) bits a
variable and every rank spreads the averaged signs back over both entries of each pair. The
layer of signs the selection carries still has one per entry (equal within a pair), so the
residual, the compression of the scale and the one-worker step are topk_sign's. Why pairs: the
probes found that the signs help the LSTM by moving the rest on every step, not by their
resolution (``docs/steps_to_loss_ablations.md``, last section). Measured with the library at 4
workers, 3 seeds (``docs/steps_to_loss_topk_sign_pairs.md``): the LSTM 1.08x dense's steps, the
CNN 0.99x, at 0.053-0.055 of dense's bytes over the run (``topk_sign``: 1.07 and 1.05 at
0.068-0.070); at 8 workers 1.07x and 0.83x (``topk_sign`` 1.11 and 0.89). Not a default either:
its step is dearer than top-k's (on the 4.35M MLP, 2 workers with one thread each, 228 ms
against 213 since the addition and the packing were fused; at 4 workers of the emulated 1
Gbit/s cluster 560 against 346), since what costs is the passes over every entry (the signs,
their sum, a dense update), not the bits (README, "``exchange="topk_sign_pairs"``").
"""

from typing import NamedTuple

import tensorflow as tf

from .. import kernels
from ..feedback.error_feedback import compensate_and_select, scatter_add, zeroed_at
from ..selection.order_statistics import kth_largest
from ..selection.sparsifiers import Sparsifier
from .averaging import average_at_positions, average_entries
from .base import register
from .fused_allgather import FusedAllgather
from .sign import SignAllgather, spread

BAND = 10  # topk_sign2: the band is the (BAND - 1) x k largest entries below the top k


class PackedSigns(NamedTuple):
    """A layer of signs as it travels (``SignAllgather.pack``'s two parts for it): the sign
    bits in int32 words (one per ``group`` entries, 1: negative) and the scale (float32, [1])."""

    words: tf.Tensor
    scale: tf.Tensor


def signs_of_rest(remainder, selected, group=1, packed=False):
    """Steps 2-3 for one flat ``remainder`` (zero at the ``selected`` count of entries the
    selection took): ``((signs,), residual)``; on CPU in two native passes
    (``kernels/signs_of_rest.cc``; its scale summed in double). ``group=2``
    (``exchange="topk_sign_pairs"``): both entries of each pair (2j, 2j + 1) take the sign of
    the pair's sum, and the scale is ``sum |pair sums| / (n - selected)`` (the least-squares
    one over the entries not selected); a last odd entry is a pair of its own.

    ``packed`` (a rank that sends its signs as they are: more than one worker, no
    compression): on CPU the signs come as :class:`PackedSigns`, written by the second pass
    itself; the float layer, which only the packing would read, is never made (on the
    4.35M-entry MLP's size, 2.5 ms a step on one thread against 5.4 for the layer and its
    packing)."""
    native = kernels.signs_of_rest() if remainder.dtype == tf.float32 else None
    packing = kernels.packed_signs_of_rest() if native is not None and packed else None
    if packing is not None:
        words, scale, residual = packing(remainder, tf.cast(selected, tf.int32), group=group)
        return (PackedSigns(words, scale),), residual
    if native is not None:
        signs, residual = native(remainder, tf.cast(selected, tf.int32), group=group)
        return (signs,), residual
    n = tf.size(remainder)
    rest = tf.maximum(n - tf.cast(selected, n.dtype), 1)
    if group == 1:
        scale = tf.reduce_sum(tf.abs(remainder)) / tf.cast(rest, remainder.dtype)
        signs = tf.where(remainder < 0, -scale, scale)
        return (signs,), remainder - signs
    length = remainder.shape[0]  # static: a variable's size
    sums = tf.reduce_sum(tf.reshape(tf.pad(remainder, [[0, -length % group]]), [-1, group]), 1)
    scale = tf.reduce_sum(tf.abs(sums)) / tf.cast(rest, remainder.dtype)
    signs = spread(tf.where(sums < 0, -scale, scale), group, length)
    return (signs,), remainder - signs


def band_cut_of(remainder, selected, band=BAND):
    """One variable's own band cut (with a budget per layer; the model-wide budget cuts the
    band over the whole model): the ``(band - 1) x selected``-th largest ``|remainder|``,
    +inf where that is no entry."""
    magnitude = tf.abs(remainder)
    n = tf.size(magnitude)
    count = tf.minimum((band - 1) * tf.cast(selected, tf.int32), n - tf.cast(selected, tf.int32))
    return tf.cond(count > 0, lambda: kth_largest(magnitude, count),
                   lambda: tf.constant(float("inf"), magnitude.dtype))


def two_level_signs(remainder, selected, band_cut):
    """``exchange="topk_sign2"``'s steps 2-3: the entries not selected at or above
    ``band_cut`` (the band) as their signs times their mean magnitude, the others as theirs.
    Sent as two layers of signs, each one bit an entry and one scale: ``a = (s_band +
    s_rest) / 2`` times every sign, and ``b = (s_band - s_rest) / 2`` times the sign in the
    band and its opposite outside it (they add up to ``s_band`` or ``s_rest`` times the
    sign). Returns ``((first, second), residual)``."""
    magnitude = tf.abs(remainder)
    in_band = tf.logical_and(magnitude >= tf.cast(band_cut, magnitude.dtype), magnitude > 0)
    n = tf.cast(tf.size(remainder), remainder.dtype)
    in_band_count = tf.reduce_sum(tf.cast(in_band, remainder.dtype))
    band_total = tf.reduce_sum(tf.where(in_band, magnitude, tf.zeros_like(magnitude)))
    band_scale = band_total / tf.maximum(in_band_count, 1)
    rest_count = tf.maximum(n - tf.cast(selected, remainder.dtype) - in_band_count, 1)
    rest_scale = (tf.reduce_sum(magnitude) - band_total) / rest_count
    half_sum, half_difference = (band_scale + rest_scale) / 2, (band_scale - rest_scale) / 2
    negative = remainder < 0
    first = tf.where(negative, -half_sum, half_sum)
    second = tf.where(tf.not_equal(negative, in_band), half_difference, -half_difference)
    return (first, second), remainder - (first + second)


class SignsOfTheRest(Sparsifier):
    """Steps 1-3 of the module doc around ``inner`` (the sparsifier that selects, or the
    model-wide cut): its selection with ``signs`` set (one layer, or two with ``levels=2``:
    ``exchange="topk_sign2"``), and the residual after both stages. ``band_cut``: the
    model-wide cut of the band (two levels), else each variable's own (:func:`band_cut_of`).
    ``group=2``: one sign for each pair of entries (``exchange="topk_sign_pairs"``; the layer
    still holds every entry's, equal within a pair, so the residual and the one-worker sum
    need nothing else; the exchange sends one in ``group``). ``packed``: one level's signs
    as they travel (:func:`signs_of_rest`), for a rank that sends them unrounded."""

    name = "signs_of_the_rest"

    def __init__(self, inner, levels=1, band_cut=None, group=1, packed=False):
        self.inner = inner
        self.levels = levels
        self.band_cut = band_cut
        self.group = group
        self.packed = packed

    def _signs(self, remainder, selected):
        if self.levels == 1:
            return signs_of_rest(remainder, selected, self.group, self.packed)
        cut = self.band_cut if self.band_cut is not None else band_cut_of(remainder, selected)
        return two_level_signs(remainder, selected, cut)

    def __call__(self, flat, k):
        selection = self.inner(flat, k)
        signs, _ = self._signs(zeroed_at(flat, selection.indices), tf.size(selection.indices))
        return selection._replace(signs=signs)

    def after_fused_cut(self, selection, writes):
        """Steps 2-3 on the remainder of the update cut's fused pass (``feedback.fused_cut``:
        the local step, compensation and model-wide cut in one pass, one level of signs only):
        the selection with its signs, and the residual's write after both stages."""
        (residual_variable, remainder), = writes
        signs, residual = self._signs(remainder, tf.size(selection.indices))
        return selection._replace(signs=signs), ((residual_variable, residual),)

    def fused_compensate_select(self, flat_grad, flat_residual, k):
        selection, remainder = compensate_and_select(flat_grad, flat_residual, self.inner, k)
        signs, residual = self._signs(remainder, tf.size(selection.indices))
        return selection._replace(signs=signs), residual


def _layers(selections):
    """Every selection's sign layers, in order: float layers or :class:`PackedSigns`."""
    return [layer for s in selections for layer in s.signs]


def _layer_dtype(layer):
    return tf.float32 if isinstance(layer, PackedSigns) else layer.dtype


def pack_layers(layers, stride):
    """One rank's sign words for ``layers`` (:func:`_layers`), as ``SignAllgather.pack``
    lays them out with one scale per layer (``block`` 0): every scale, then every layer's
    sign bits of entries 0, ``stride``, 2 x ``stride``, ...; a packed layer as it is."""
    if not layers:
        return tf.zeros([0], tf.int32)
    parts = [(tf.bitcast(layer.scale, tf.int32), layer.words) if isinstance(layer, PackedSigns)
             else SignAllgather.pack_one(layer, stride=stride) for layer in layers]
    return tf.concat([scale for scale, _ in parts] + [words for _, words in parts], 0)


def plus_signs(entries, layers):
    """Step 4's sum for one variable: its averaged entries plus its averaged ``layers`` of
    signs (dense, every entry). Entries that came where they arrived (``tf.IndexedSlices``,
    with one layer) are added into the layer at their positions, in its buffer (no dense
    pass of their own); dense entries have each layer added in turn."""
    if isinstance(entries, tf.IndexedSlices):
        (layer,) = layers
        return scatter_add(layer, entries.values, entries.indices)
    for layer in layers:
        entries = entries + tf.cast(layer, entries.dtype)
    return entries


@register("topk_sign", grouping="grouped")
class TopkSignAllgather(FusedAllgather):
    """Step 4 of the module doc: the fused allgather, its collective carrying the signs too."""

    code = "entries_and_signs"
    layer_budgets = False
    staleness = False
    grouping_reason = "its one allgather carries every variable's signs."
    levels = 1  # layers of signs
    sign_group = 1  # entries per sign
    averages_at_positions = False  # the signs add to every entry (``with_extra``)

    def sent_bytes_per_entry(self, density, value_bytes):
        """A selected entry's value and index, and the bits of the 1/density entries per
        selected one that travel as signs (one per ``sign_group`` of them)."""
        return (super().sent_bytes_per_entry(density, value_bytes)
                + 1 / (8 * self.sign_group * density))

    def extra_words(self, selections):
        return [pack_layers(_layers(selections), self.sign_group)]

    def _average(self, indices, values, counts, positions, sizes, size):
        """Step 4's entries where they arrived whatever ``sparsify`` is (with one layer of
        signs and the native kernel), for :func:`plus_signs` to add into the signs' average;
        else dense (two layers keep their order of additions: entries, then each layer)."""
        if self.levels == 1:
            averages = average_at_positions(indices, values, counts, positions, sizes, size)
            if averages is not None:
                return averages
        return average_entries(indices, values, counts, positions, sizes, size)

    def with_extra(self, sparse, gathered, selections, sizes):
        levels = self.levels
        rows = tf.reshape(gathered[0], [self.size, -1])
        layers = SignAllgather.unpack(rows, [_layer_dtype(layer) for layer in _layers(selections)],
                                      [n for n in sizes for _ in range(levels)],
                                      group=self.sign_group)
        return [plus_signs(entries, layers[j * levels:(j + 1) * levels])
                for j, entries in enumerate(sparse)]


@register("topk_sign2", grouping="grouped")
class TopkTwoSignsAllgather(TopkSignAllgather):
    """``exchange="topk_sign2"``: the same with two levels of signs (:func:`two_level_signs`):
    the band, the ``(BAND - 1) x k`` largest entries below the top k, at their own mean
    magnitude, the rest at theirs; two bits an entry."""

    code = "entries_and_two_signs"
    levels = 2

    def sent_bytes_per_entry(self, density, value_bytes):
        return super().sent_bytes_per_entry(density, value_bytes) + 1 / (8 * density)


@register("topk_sign_pairs", grouping="grouped")
class TopkPairSignsAllgather(TopkSignAllgather):
    """``exchange="topk_sign_pairs"``: the same with one sign for each pair of entries (the
    sign of their sum, at the least-squares scale; :func:`signs_of_rest` with ``group=2``):
    half an entry's bit. Every entry still moves every step, which is what the signs buy the
    LSTM under SGD (the probes: ``docs/steps_to_loss_ablations.md``, last section)."""

    code = "entries_and_pair_signs"
    sign_group = 2
