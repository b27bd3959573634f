"""``exchange="allgather"`` (the default): ONE Horovod collective per step.

Every collective costs a negotiation round among the ranks before any byte moves, so a step
that needs one instead of four (values, indices, the dense-route gradients, the non-finite
check) saves three rounds. The group starts only when every variable's gradient is ready:
after backprop.

1. pack (``sparse_hvd.exchanges.wire``): the header (``base.header``: this rank's "all finite" flag, its
   step and state for ``sparse_hvd.runtime.lockstep``, then the entries per sparse variable), the
   selected values as int32 words (one tensor per dtype; two 16-bit values to a word with
   ``compression``), every selected index, and the small dense-route gradients as int32
   words: all int32, so that one ``grouped_allgather`` carries them (a Horovod group holds one
   dtype);
2. gather: every rank receives every rank's tensors, concatenated in rank order;
3. unpack: the headers, one row per rank, say which variable each gathered entry belongs to;
   first, every rank in this step (else every rank raises before unpacking);
4. sum (``sparse_hvd.exchanges.averaging``): each variable's entries are added into zeros rank by rank,
   so every rank adds the same numbers in the same order: the same bits everywhere; then
   divided by the number of workers. With the update cut (whose averages are subtracted from
   the weights) and the native kernels, only the positions that received entries come back
   (``tf.IndexedSlices``, the same bits there): no pass over the whole variable;
5. the small dense-route gradients are summed over the ranks in rank order too; those too
   large to gather (``base.DENSE_GATHER_LIMIT``) are averaged by one ``grouped_allreduce`` per
   dtype instead, and embeddings' row-sparse gradients by allgathers of their rows;
6. the flags say whether every rank's gradients were finite (``nonfinite``): no extra
   collective.
"""

from typing import NamedTuple, Optional

import tensorflow as tf

from ..runtime import collectives, lockstep
from .averaging import average_at_positions, average_entries
from ..feedback.payload import Payload
from .base import Exchange, checked_headers, group_positions_by_dtype, header, register


class PackedSelections(NamedTuple):
    """A payload's selections as :meth:`FusedAllgather.pack_selections` packs them."""

    indices: tf.Tensor  # every selection's indices as one int32 tensor (or their code)
    selections: list  # the selections in the order their values travel
    counts: list  # int32 entries per selection
    value_groups: dict  # {dtype: positions in ``selections``}
    words: list  # one int32 tensor of values per group
    fields: tf.Tensor  # the int header fields the values need (coded: per group)
    sent: Optional[tf.Tensor]  # bytes sent, where codes change the payload's count; else None


@register("allgather", grouping="grouped")
class FusedAllgather(Exchange):
    """Steps 1-6 of the module doc."""

    # its sparse averages may come back as (positions, averages) (step 4): False where a
    # subclass adds something dense to them (``with_extra``) or averages otherwise
    averages_at_positions = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._layout = None  # (header fields, tensors after the header): what _announce sends

    def build(self, optimizer, routes):
        """Step 4's form (``choose_averages_form``)."""
        self.choose_averages_form(optimizer)

    @property
    def traced(self) -> bool:
        return self._layout is not None

    def wire_bytes_per_entry(self, density, value_bytes):
        """Every other rank's entries, each as :meth:`sent_bytes_per_entry` says."""
        return (self.size - 1) * self.sent_bytes_per_entry(density, value_bytes)

    def _average_many(self, payload: Payload, sizes, step):
        size = self.size
        selections = payload.sparse.items
        dense = list(payload.dense.items)
        dense_groups, dense_words = self.pack_dense(dense)
        # Step 1: pack
        packed = self.pack_selections(payload, sizes)
        indices, selections, counts = packed.indices, packed.selections, packed.counts
        value_groups, words, value_fields = packed.value_groups, packed.words, packed.fields
        if packed.sent is not None:  # the statistics count the codes' words
            self._sent = packed.sent
        fields = tf.concat([tf.stack(counts) if counts else tf.zeros([0], tf.int32),
                            tf.cast(value_fields, tf.int32)], 0)
        extra = self.extra_words(selections)
        self._layout = (fields.shape[0], 1 + len(words) + len(extra) + len(dense_words))
        # Step 2: gather
        gathered = collectives.grouped_allgather(
            [header(payload.finite_here(), step, rest=fields), indices] + words + extra
            + dense_words, name=f"{self.name}.fused", process_set=self.process_set, step=step)
        # Steps 3 and 6: every rank in this step, every rank's flag, the counts
        gathered, finite, fields = checked_headers(gathered, size)
        fields = tf.reshape(fields, [size, self._layout[0]])  # static: the unpacking needs it
        counts = fields[:, :len(selections)]
        all_indices = self._unpack_indices(gathered[1], counts, sizes)
        gathered_words = gathered[2:2 + len(words)]
        gathered_extra = gathered[2 + len(words):2 + len(words) + len(extra)]
        gathered_dense = gathered[2 + len(words) + len(extra):]
        # Step 4: each variable's entries in rank order, summed and averaged
        sparse = [None] * len(selections)
        for (dtype, positions), group_words in zip(value_groups.items(), gathered_words):
            values = self._unpack_values(group_words, dtype, value_groups, counts,
                                         fields[:, len(selections):])
            averages = self._average(all_indices, values, counts, positions,
                                     [sizes[p] for p in positions], size)
            for position, average in zip(positions, averages):
                sparse[position] = average
        sparse = self.with_extra(sparse, gathered_extra, selections, sizes)
        # Step 5: the dense route
        averaged_dense = self.unpack_dense(dense, dense_groups, gathered_dense,
                                           payload.dense.keys, step)
        return sparse, averaged_dense, finite, ()

    def _average(self, indices, values, counts, positions, sizes, size):
        """Step 4 for the variables ``positions``: their averages at positions when
        :meth:`build` said so and the native kernel runs, else dense."""
        if self._at_positions:
            averages = average_at_positions(indices, values, counts, positions, sizes, size)
            if averages is not None:
                return averages
        return average_entries(indices, values, counts, positions, sizes, size)

    def extra_words(self, selections) -> list:
        """Int32 tensors this exchange sends in its collective besides the selections' entries
        (none here; ``exchange="topk_sign"``: the signs of what they left)."""
        return []

    def with_extra(self, sparse, gathered, selections, sizes) -> list:
        """The sparse averages with what :meth:`extra_words` carried (``gathered``: every
        rank's, in rank order) added in (nothing here)."""
        return sparse

    def pack_selections(self, payload: Payload, sizes) -> PackedSelections:
        """Step 1 for the sparse route (also the delayed pipeline's, ``steps.staleness``):
        ``payload``'s selections (``sizes``: their variables' sizes) as they travel."""
        indices, selections = self.pack_indices(payload.sparse.items, sizes)
        counts = [tf.size(s.indices, out_type=tf.int32) for s in selections]
        value_groups = group_positions_by_dtype([s.values for s in selections])
        words, fields = self.pack_values(selections, counts, value_groups)
        sent = None
        if self.coded and selections:
            sent = self.coded_bytes_sent(payload,
                                         tf.add_n([tf.size(indices)] + [tf.size(w) for w in words]))
        return PackedSelections(indices, selections, counts, value_groups, words, fields, sent)

    def pack_indices(self, selections, sizes):
        """Every selection's indices as one int32 tensor, and the selections in the order their
        values travel (here: as they are)."""
        indices = tf.concat([s.indices for s in selections] or [tf.zeros([0], tf.int32)], 0)
        return indices, selections

    def pack_values(self, selections, counts, value_groups):
        """Step 1 for the values: one int32 tensor per dtype group (``value_groups``: {dtype:
        positions}), and the int fields each rank's header carries for them (here: none)."""
        words = [self.compression.encode(tf.concat([selections[p].values for p in positions], 0))
                 for positions in value_groups.values()]
        return words, tf.zeros([0], tf.int32)

    def _unpack_values(self, words, dtype, value_groups, counts, value_fields):
        """Every rank's values of ``dtype`` (variables ``value_groups[dtype]``), in rank order,
        from their gathered ``words``; ``value_fields``: [ranks, -1], what :meth:`pack_values`
        put in each header."""
        positions = value_groups[dtype]
        return self.compression.decode(words, dtype,
                                       tf.reduce_sum(tf.gather(counts, positions, axis=1), 1))

    def _unpack_indices(self, gathered, counts, sizes):
        """The gathered indices, rank by rank and variable by variable (``counts``: [ranks,
        variables] entries), as int32 positions in their variables."""
        return gathered

    def _announce(self, step, state):
        """The fused exchange of a rank that sends nothing, with ``state`` for its fields."""
        fields, tensors = self._layout
        gathered = collectives.grouped_allgather(
            [header(True, step, state, rest=tf.zeros([fields], tf.int32))]
            + [tf.zeros([0], tf.int32)] * tensors, name=f"{self.name}.fused",
            process_set=self.process_set)
        return lockstep.check(tf.reshape(gathered[0], [self.size, -1])[:, 1:1 + lockstep.WIDTH])
