"""Moving gradients between workers and turning what arrives into dense averaged gradients.

Every collective has a name that is identical on every rank (Horovod matches collectives by
name) and independent of TensorFlow's name scopes. Two ways to group them:

* ``"grouped"`` (the default): ONE Horovod collective per step (:meth:`Exchange.average`,
  steps below). Every collective costs a negotiation round among the ranks before any byte
  moves, so a step that needs one instead of four (values, indices, the dense-route gradients,
  the non-finite check) saves three rounds. A group starts only when every variable's gradient
  is ready: after backprop.
* ``"layerwise"``: one allgather pair (or one allreduce) per variable. Each depends only on its
  own variable's gradient, so TensorFlow's executor starts it as soon as that gradient exists,
  while backprop of the layers below continues (the overlap LAGS-SGD relies on, Shi et al.
  2020). Horovod still fuses the collectives that become ready in the same cycle. Horovod's
  collective ops are not stateful in TensorFlow's sense, so automatic control dependencies do
  not chain them in program order.

The grouped exchange, step by step:

1. pack (``sparse_hvd.wire``): a header (entries per sparse variable, this rank's "all
   finite" flag, and its step and state: ``sparse_hvd.lockstep``), the selected values as
   int32 words (one tensor per dtype), every selected
   index, and the small dense-route gradients as int32 words: all int32, so that one
   ``grouped_allgather`` carries them (a Horovod group holds one dtype);
2. gather: every rank receives every rank's tensors, concatenated in rank order;
3. unpack: the headers, one row per rank, say which variable each gathered entry belongs to;
4. sum (``sparse_hvd.averaging``): each variable's entries are added into zeros rank by rank,
   so every rank adds the same numbers in the same order: the same bits everywhere; then
   divided by the number of workers;
5. the small dense-route gradients are summed over the ranks in rank order too;
   dense-route gradients too large to gather (``DENSE_GATHER_LIMIT``) are averaged by one
   ``grouped_allreduce`` per dtype instead, and embeddings' row-sparse gradients by allgathers
   of their rows (:meth:`Exchange.slices_average`);
6. the flags say whether every rank's gradients were finite (``nonfinite``), and the steps
   whether every rank is in the same step (``lockstep``: else every rank raises): no extra
   collective.

Sparse path: ranks may contribute different numbers of entries, none included. With
``method="sparse_allreduce"`` steps 1-4 are ``sparse_hvd.sparse_allreduce``'s instead (an
alltoall to the owners of index regions, then an allgather of the kept sums); the dense route
travels in its allgather the same way.

With a single worker no collective is called at all.
"""

from collections import OrderedDict
from typing import List, NamedTuple, Sequence

import tensorflow as tf

from . import collectives, lockstep, nonfinite, runtime, wire
from .averaging import average_entries, divided, sum_rows_in_order
from .payload import Payload, entries_in
from .sparse_allreduce import SparseAllreduce
from .sparsifiers import Selection

GROUPINGS = ("grouped", "layerwise")
METHODS = ("allgather", "sparse_allreduce")

# Dense-route gradients travel in the fused allgather while (workers x their entries) stays
# below this (1 MiB of float32 received): a separate allreduce would cost one more negotiation
# round, gathering costs (N - 2) x their size in extra bytes, which wins only while small.
DENSE_GATHER_LIMIT = 1 << 18


class Averaged(NamedTuple):
    """What the exchange hands back for one step."""

    gradients: list  # the average of each gradient, by its position in the step
    finite: tf.Tensor  # bool: every rank's gradients were finite (the same on every rank)
    # sparse allreduce: per sparse selection, the (values, indices) this rank sent that were not
    # applied, for its residual; empty for the allgather exchange (everything sent is applied)
    returned: tuple = ()


def _group_positions_by_dtype(tensors):
    """{dtype: [positions in ``tensors``]}, in first-seen order (deterministic on every rank)."""
    groups = OrderedDict()
    for position, tensor in enumerate(tensors):
        groups.setdefault(tensor.dtype, []).append(position)
    return groups


class Exchange:
    """Averages gradients over the workers of one Horovod process set.

    Args:
        name: prefix of every collective's name; give two optimizers that run in the same job
            different names.
        process_set: Horovod process set (the global one by default).
        grouping: ``"grouped"`` or ``"layerwise"`` (see the module docstring).
        method: ``"allgather"`` (every rank gathers every selection, this module) or
            ``"sparse_allreduce"`` (``sparse_hvd.sparse_allreduce``: regions summed by their
            owners, a global selection kept; grouped only).
        compression: None, or the 16-bit dtype that float32/float64 values travel as
            (``sparse_hvd.compression``: the payload holds values already rounded to it; the
            allgather method only). Two values to a word in the fused exchange; float16 in a
            dense allreduce; a bfloat16 allreduce stays float32 (Horovod cannot reduce it).
    """

    def __init__(self, name: str, process_set=None, grouping="grouped", method="allgather",
                 compression=None):
        if grouping not in GROUPINGS:
            raise ValueError(f"`grouping` must be one of {GROUPINGS}, got {grouping!r}")
        if method not in METHODS:
            raise ValueError(f"`exchange` must be one of {METHODS + ('auto',)}, got {method!r}")
        self.name = name
        self.process_set = process_set
        self.grouping = grouping
        self.method = method
        self.compression = compression
        self.sparse_allreduce = None
        self._fused_layout = None  # what an empty fused payload holds (assert_same_step)
        self._announce = None  # assert_same_step's traced function
        self.use(method)

    def half_for(self, dtype):
        """The 16-bit dtype values of ``dtype`` travel as, or None (no compression, or values
        that are 16-bit already)."""
        if self.compression is None or tf.as_dtype(dtype).size <= 2:
            return None
        return self.compression

    def _encode(self, values):
        """1-D values as int32 words for a fused allgather."""
        half = self.half_for(values.dtype)
        return wire.to_words(values) if half is None else wire.to_half_words(values, half)

    def _decode(self, words, dtype, per_rank):
        """Gathered words back to values of ``dtype``; ``per_rank``: values each rank sent."""
        half = self.half_for(dtype)
        if half is None:
            return wire.from_words(words, dtype)
        return wire.from_half_words(words, per_rank, half, dtype)

    @property
    def size(self) -> int:
        return runtime.size(self.process_set)

    def use(self, method):
        """Switch to ``method`` (before the first step: ``exchange="auto"``'s choice)."""
        if method not in METHODS:
            raise ValueError(f"unknown exchange method {method!r}")
        self.method = method
        self.sparse_allreduce = (SparseAllreduce(self.name, self.process_set)
                                 if method == METHODS[1] else None)

    def average(self, payload: Payload, num_elements: Sequence[int], step=None) -> Averaged:
        """The average over workers of every gradient in ``payload`` (by its position in the
        step's list) and whether every rank's gradients were finite. ``num_elements``: entries
        of each variable, by build index; ``step``: the training step, which the grouped
        exchanges send along and check (``sparse_hvd.lockstep``) and the stall watchdog names.

        Sparse selections come back as flat dense tensors, dense gradients as they went,
        row-sparse gradients as IndexedSlices.
        """
        count = 1 + max(payload.sparse.positions + payload.dense.positions + payload.rows.positions,
                        default=-1)
        sizes = [num_elements[key] for key in payload.sparse.keys]
        returned = ()
        step = tf.constant(0, tf.int64) if step is None else step
        if self.size > 1 and self.sparse_allreduce is not None and payload.sparse.items:
            sparse, dense, finite, returned = self._sparse_allreduce(payload, sizes, step)
        elif self.size > 1 and self.grouping == "grouped":
            sparse, dense, finite = self._fused_average(payload, sizes, step)
        else:
            sparse = self.sparse_average(payload.sparse.items, sizes, payload.sparse.keys, step)
            dense = self.dense_average(payload.dense.items, payload.dense.keys, step)
            finite = self._finite_everywhere(payload, step)
        rows = self.slices_average(payload.rows.items, payload.rows.keys, step)
        averaged = [None] * count
        for part, results in ((payload.sparse, sparse), (payload.dense, dense), (payload.rows, rows)):
            for position, result in zip(part.positions, results):
                averaged[position] = result
        return Averaged(averaged, finite, tuple(returned))

    def assert_same_step(self, step, state):
        """Raise on every rank unless every rank calls this with the same ``step`` and ``state``
        (``sparse_hvd.lockstep``): the step's own collectives with an empty payload, so a rank
        still training receives it in its step and raises too. Called eagerly; the collectives
        run in a traced function, because Horovod names eager collectives by their op type, not
        by the name they are given. Nothing is checked before the first step was traced, with
        one worker, or with the layer-wise exchange (its collectives are per variable; the
        stall watchdog ends a job whose ranks disagree there).
        """
        if self.size == 1 or self.grouping != "grouped":
            return
        if self.sparse_allreduce is not None and self.sparse_allreduce.traced:
            announce = self.sparse_allreduce.announce
        elif self._fused_layout is not None:
            announce = self._announce_fused
        else:
            return
        if self._announce is None:
            self._announce = tf.function(announce, autograph=False)
        try:
            self._announce(tf.constant(step, tf.int64), tf.constant(state, tf.int32))
        except tf.errors.OpError as error:
            mismatch = lockstep.mismatch_error(error)
            if mismatch is None:
                raise
            raise mismatch from None

    def _announce_fused(self, step, state):
        """The fused exchange of a rank that sends nothing, with ``state`` for its fields."""
        selections, tensors = self._fused_layout
        header = tf.concat([tf.zeros([selections], tf.int32), [1], lockstep.fields(step, state)], 0)
        gathered = collectives.grouped_allgather(
            [header] + [tf.zeros([0], tf.int32)] * tensors, name=f"{self.name}.fused",
            process_set=self.process_set)
        return lockstep.check(tf.reshape(gathered[0], [self.size, -1])[:, selections + 1:])

    def _finite_everywhere(self, payload: Payload, step=None) -> tf.Tensor:
        """Whether every rank's gradients were finite, by one tiny allreduce (True, and no
        collective, when they are not checked or the job has one worker)."""
        if not payload.local_finite or self.size == 1:
            return payload.finite_here()
        return nonfinite.agree(payload.finite_here(), name=f"{self.name}.nonfinite",
                               process_set=self.process_set, step=step)

    def _fused_average(self, payload: Payload, sizes, step):
        """Steps 1-6 of the module doc: ``(sparse averages, dense averages, finite)``."""
        size = self.size
        selections = payload.sparse.items
        dense = list(payload.dense.items)
        dense_groups, dense_words = self._pack_dense(dense)
        # Step 1: pack
        counts = [tf.size(s.indices, out_type=tf.int32) for s in selections]
        flag = tf.cast(payload.finite_here(), tf.int32)
        header = tf.concat([tf.stack(counts + [flag]), lockstep.fields(step)], 0)
        value_groups = _group_positions_by_dtype([s.values for s in selections])
        words = [self._encode(tf.concat([selections[p].values for p in positions], 0))
                 for positions in value_groups.values()]
        indices = tf.concat([s.indices for s in selections] or [tf.zeros([0], tf.int32)], 0)
        self._fused_layout = (len(selections), 1 + len(words) + len(dense_words))
        # Step 2: gather
        gathered = collectives.grouped_allgather(
            [header, indices] + words + dense_words, name=f"{self.name}.fused",
            process_set=self.process_set, step=step)
        # Step 6: every rank in this step (else every rank raises before unpacking), and
        # every rank's flag
        width = len(selections) + 1 + lockstep.WIDTH
        gathered = lockstep.after_check(
            tf.reshape(gathered[0], [size, width])[:, len(selections) + 1:], gathered)
        headers = tf.reshape(gathered[0], [size, width])
        all_indices, gathered_words = gathered[1], gathered[2:2 + len(words)]
        gathered_dense = gathered[2 + len(words):]
        finite = tf.reduce_all(tf.equal(headers[:, len(selections)], 1))
        # Steps 3-4: each variable's entries in rank order, summed and averaged
        sparse = [None] * len(selections)
        counts = headers[:, :len(selections)]
        for (dtype, positions), group_words in zip(value_groups.items(), gathered_words):
            values = self._decode(group_words, dtype,
                                  tf.reduce_sum(tf.gather(counts, positions, axis=1), 1))
            averages = average_entries(all_indices, values, counts, positions,
                                       [sizes[p] for p in positions], size)
            for position, average in zip(positions, averages):
                sparse[position] = average
        # Step 5: the dense route
        averaged_dense = self._unpack_dense(dense, dense_groups, gathered_dense, payload.dense.keys,
                                            step)
        return sparse, averaged_dense, finite

    def _sparse_allreduce(self, payload: Payload, sizes, step):
        """The sparse allreduce (``sparse_hvd.sparse_allreduce``) with the small dense-route
        gradients in its allgather: ``(sparse averages, dense averages, finite, returned)``."""
        dense = list(payload.dense.items)
        dense_groups, dense_words = self._pack_dense(dense)
        result = self.sparse_allreduce.step(
            payload.sparse.items, payload.sparse.keys, sizes, payload.budgets,
            payload.finite_here(), dense_words, step)
        averaged_dense = self._unpack_dense(dense, dense_groups, result.dense_words,
                                            payload.dense.keys, step)
        return result.averages, averaged_dense, result.finite, result.returned

    def _pack_dense(self, dense):
        """Dense-route gradients small enough to travel in a fused allgather: ``(groups, words)``,
        one int32 tensor per dtype; none when they are too large (``DENSE_GATHER_LIMIT``)."""
        if not dense or self.size * sum(entries_in(t.shape) for t in dense) > DENSE_GATHER_LIMIT:
            return {}, []
        groups = _group_positions_by_dtype(dense)
        words = [self._encode(tf.concat([tf.reshape(dense[p], [-1]) for p in positions], 0))
                 for positions in groups.values()]
        return groups, words

    def _unpack_dense(self, dense, groups, gathered, keys, step=None):
        """The averages of ``dense``: summed over the ranks in rank order from what was gathered
        (:meth:`_pack_dense`), or by one ``grouped_allreduce`` per dtype if nothing was."""
        if not groups:
            return self.dense_average(dense, keys, step)
        size = self.size
        averaged = [None] * len(dense)
        for (dtype, positions), group_words in zip(groups.items(), gathered):
            lengths = [entries_in(dense[p].shape) for p in positions]
            values = self._decode(group_words, dtype, tf.fill([size], sum(lengths)))
            total = sum_rows_in_order(tf.reshape(values, [size, sum(lengths)]))
            average = divided(total, size)
            for position, piece in zip(positions, tf.split(average, lengths)):
                averaged[position] = tf.reshape(piece, tf.shape(dense[position]))
        return averaged

    def sparse_average(
        self, selections: Sequence[Selection], num_elements: Sequence[int], keys: Sequence[int],
        step=None,
    ) -> List[tf.Tensor]:
        """For each variable, the flat average over workers of what each worker selected.

        ``keys`` name the variables in the collectives' names (the same on every rank).
        """
        if not selections:
            return []
        size = self.size
        if size > 1:
            selections = self._allgather(selections, keys, step)
        return [average_entries(s.indices, s.values, tf.reshape(tf.size(s.indices), [1, 1]), [0],
                                [n], size)[0]
                for s, n in zip(selections, num_elements)]

    def dense_average(self, tensors: Sequence[tf.Tensor], keys: Sequence[int],
                      step=None) -> List[tf.Tensor]:
        """The element-wise average over workers of each tensor."""
        tensors = list(tensors)
        if self.size == 1 or not tensors:
            return tensors
        dtypes = [t.dtype for t in tensors]
        if self.compression == tf.float16:  # Horovod reduces float16 (not bfloat16)
            tensors = [t if self.half_for(t.dtype) is None else tf.cast(t, tf.float16)
                       for t in tensors]
        if self.grouping == "layerwise":
            averaged = [
                collectives.allreduce(tensor, name=f"{self.name}.dense.{key}",
                                      process_set=self.process_set, step=step)
                for tensor, key in zip(tensors, keys)
            ]
        else:
            averaged = self._per_dtype(collectives.grouped_allreduce, tensors,
                                       f"{self.name}.dense", step)
        return [tf.cast(a, dtype) for a, dtype in zip(averaged, dtypes)]

    def slices_average(self, slices: Sequence[tf.IndexedSlices], keys: Sequence[int], step=None):
        """Average row-sparse gradients (embeddings) over workers, keeping them row-sparse.

        The rows every rank sent are gathered (values and indices, one allgather each, named by
        ``keys``) and the values divided by the number of workers; rows sent by several ranks
        stay repeated, and the inner optimizer sums them, as it does within one rank. So the
        inner optimizer sees ``IndexedSlices`` exactly as it would without sparse_hvd (some
        optimizers, Adam among them, update only the rows present).
        """
        size = self.size
        if size == 1 or not slices:
            return list(slices)
        averaged = []
        for grad, key in zip(slices, keys):
            values = collectives.allgather(grad.values, name=f"{self.name}.rows.{key}",
                                           process_set=self.process_set, step=step)
            indices = collectives.allgather(grad.indices, name=f"{self.name}.row_indices.{key}",
                                            process_set=self.process_set, step=step)
            averaged.append(tf.IndexedSlices(
                values / tf.cast(size, values.dtype), indices, dense_shape=grad.dense_shape))
        return averaged

    def _allgather(self, selections: Sequence[Selection], keys, step=None) -> List[Selection]:
        """Every rank's selections, concatenated in rank order, variable by variable."""
        half = [self.half_for(s.values.dtype) for s in selections]
        wide = [s.values.dtype for s in selections]
        selections = [s if h is None else Selection(tf.cast(s.values, h), s.indices)
                      for s, h in zip(selections, half)]
        if self.grouping == "layerwise":
            return [
                Selection(
                    tf.cast(collectives.allgather(s.values, name=f"{self.name}.values.{key}",
                                                  process_set=self.process_set, step=step), dtype),
                    collectives.allgather(s.indices, name=f"{self.name}.indices.{key}",
                                          process_set=self.process_set, step=step),
                )
                for s, key, dtype in zip(selections, keys, wide)
            ]
        gathered_values = self._per_dtype(collectives.grouped_allgather,
                                          [s.values for s in selections], f"{self.name}.values",
                                          step)
        gathered_indices = collectives.grouped_allgather(
            [s.indices for s in selections], name=f"{self.name}.indices",
            process_set=self.process_set, step=step,
        )
        return [Selection(tf.cast(v, dtype), i)
                for v, i, dtype in zip(gathered_values, gathered_indices, wide)]

    def _per_dtype(self, grouped_collective, tensors, name, step=None):
        """``grouped_collective`` over ``tensors``, one group per dtype (a Horovod group holds
        one dtype), named ``<name>.<dtype>``; the results in the order of ``tensors``."""
        results = [None] * len(tensors)
        for dtype, positions in _group_positions_by_dtype(tensors).items():
            group = grouped_collective([tensors[p] for p in positions],
                                       name=f"{name}.{dtype.name}", process_set=self.process_set,
                                       step=step)
            for position, tensor in zip(positions, group):
                results[position] = tensor
        return results
