"""``exchange="sparse_allreduce"``: an exchange whose traffic per worker does not grow with N.

The allgather exchange hands every worker the selections of all N workers: (N - 1) k entries
received per step, so from about 100 workers at 1% density it moves more than a dense ring
allreduce. This exchange (after Ok-Topk, Li & Hoefler, PPoPP 2022, and SparCML, Renggli et
al., SC 2019) splits the work by index instead, with two Horovod collectives per step:

1. one index space: every sparse-route variable gets a contiguous range, in build order;
2. regions: the space is cut into N contiguous regions, one per rank (``boundaries``, the same
   on every rank); each worker sends each region's selected (index, value) pairs to the
   region's owner: ONE ``alltoall`` with splits for all variables together, one block per
   owner (``sparse_blocks``: the indices Elias-Fano coded among the region's entries and the
   values' exponents Rice coded, about 4.2 bytes an entry with float32 values and 2.6 with
   ``compression``; ``exchange="plain_sparse_allreduce"``: int32 indices and raw values, 8
   and 6 bytes);
3. each owner sums what it received, entry by entry in rank order (a sparse reduce-scatter; the
   same additions in the same order as the allgather exchange, so the same bits), 16-bit
   values widened to the gradients' dtype first; the sums stay in that dtype (a sum of 16-bit
   values is not one) for the rest of the step;
4. global selection: each owner keeps the summed entries whose magnitude reaches their
   variable's global threshold ``theta`` (identical on every rank), about k of the variable's
   entries in all; at the first step theta is 0 and every summed entry is kept. With the
   model-wide budget (``budget="model"``, the default with this exchange) the whole model is
   one variable here and in step 6: one theta, about the sum of the variables' k kept over
   all of them, as the selection spent that sum where the model's largest entries were
   (per variable, the owners applied 0.24-0.41 k at 2 workers and 0.45-0.67 k at 4: each
   variable's own k cut what the selection had sent to the variables whose entries were
   largest, and the rest went back to the residuals;
   ``scripts/benchmarks/probe_threshold.py --budget model``);
5. ONE ``allgather`` of the kept entries (a block of the same code, within the owner's
   region, the sums in their own dtype), the header per rank (``base.header``: whether its
   gradients were finite, its step and state for ``sparse_hvd.runtime.lockstep``; then per variable
   how many of its summed entries reach theta x each of ``LEVELS`` (1 down to 1/4), and where its
   own selected indices fall, then its block's code fields), and the small dense-route
   gradients (``base.pack_dense``);
6. every rank applies the same averages: of the kept sums, those at or above the k-th largest
   (the exact global top-k of this step's sums, ties included) or all of them if fewer than k
   were kept, divided by N (dense, or with ``sparsify="update"`` only where they are, which
   the weights lose in place); and computes the same next theta per variable
   (``global_threshold.next_thresholds``): a forecast of the next k-th largest sum, from this
   one, its growth a step and how far the last forecasts missed;
7. error feedback stays exact: an entry this rank sent whose sum was not applied goes back into
   its residual, so nothing of any gradient is lost: the sum over ranks of the residuals plus N
   times the applied average equals the sum over ranks of the previous residuals and the
   gradients;
8. the next boundaries: the mean over ranks of where each rank's selected indices divide into N
   equal parts (so each owner receives about as many entries).

At two ranks the scatter and the gather move about what one allgather of the selections
moves: each worker receives half of the other's k entries and half of the about 1.03-1.05 k
kept sums (``global_threshold``), where one allgather brings the other's k. So there the
exchange is ONE ``allgather`` (``SparseAllreduce.one_gather``): each rank's block holds all its
selections, coded among the whole index space, and every rank runs steps 3-4 over the whole
space itself (the same entries in the same rank order: the same sums, counts and kept set as
the owners', so the same averages, residuals and thresholds, bit for bit). It saves the second
collective's round trip, the split into regions and the kept sums' coding, and the first
steps' extra kept sums (up to 2.4 k while the forecast learns); the regions stay even.

What it computes is therefore a global top-k of the SUM of the workers' selections (found
with a threshold set one step ahead), not the average of every local top-k. Per worker, the
wire carries about k (N - 1) / N entries out and the kept entries in. The kept entries beyond
k are the price of setting the threshold a step ahead: with the forecast, 1.02-1.07 k at 1% and
1.06-1.16 k at 0.1% once the residuals have built up (the update cut; 1.09-1.28 k with the
gradient cut's noisier sums; ``global_threshold``), where following the last step's k-th
largest sum kept 1.5-2 k and 3.4-5 k. So about 2.1 k (N - 1) / N entries in all, flat in N,
where the allgather's grows as (N - 1) k; the first step (theta 0) keeps every sum, and the
first few, while the sums grow fastest, up to 4 k.

The thresholds are optimizer variables (saved with checkpoints; they do not depend on N). The
forecasts are not saved (a restored job forecasts again, which costs a few steps' bytes), and
a step that does not follow this exchange's last one (``exchange="auto"`` ran another in
between, or a restore went back) forecasts afresh too: a cut's growth over a gap of tens of
steps is not a step's, and taken as one it made the forecast swing between keeping 1.4 k
and 4.8 k sums over an auto re-trial's four steps at 8 workers (the update cut at 1%,
``scripts/benchmarks/probe_auto_trials.py``). The
boundaries only decide who sums what, never the result: they are re-derived (equal regions) when
the optimizer is built and re-balanced every step.
"""

from typing import List, NamedTuple, Sequence

import tensorflow as tf

from .. import kernels
from ..feedback.payload import Payload
from ..runtime import collectives, lockstep, startup as runtime
from .averaging import applied_at_positions, applied_averages, average_entries
from .base import HEADER_FIELDS, Exchange, checked_headers, header, register
from .compression import NONE
from .fused_allgather import FusedAllgather
from .global_threshold import LEVELS, Forecast, first_forecast, next_thresholds
from .owner_sums import owner_sums
from .regions import even_boundaries, sampled_quantiles, sorted_search
from .sparse_blocks import CodedBlocks, PlainBlocks

MAX_INDEX_SPACE = (1 << 31) - 1


class Result(NamedTuple):
    """One step of the sparse allreduce."""

    averages: List[tf.Tensor]  # flat average per selection, in the payload's order
    returned: List[tuple]  # per selection: (values, indices) this rank sent, 0 where applied
    finite: tf.Tensor  # every rank's gradients were finite
    dense_words: List[tf.Tensor]  # what every rank gathered of the packed dense gradients
    sent_words: tf.Tensor  # int32 words of this rank's blocks of its selections (step 2)


def applied_entries(kept, sums, magnitudes, cuts, starts, divisor=0):
    """Step 6's applied entries: of the ascending ``kept`` indices (int32, in the index space)
    and their ``sums`` and ``magnitudes`` (float64), those whose magnitude reaches their
    variable's cut (``cuts[v]`` for the indices from ``starts[v]`` (ascending) to the next
    start), as ``(indices, indices within their variables, sums, count per variable)``; with
    ``divisor`` >= 1 their averages instead of the sums (``averaging.applied_averages``).
    One native pass on CPU (``kernels.applied``), else searches, a comparison and gathers."""
    native = kernels.applied()
    if native is not None:
        return native(kept, sums, magnitudes, cuts, starts, divisor=divisor)
    slices = sorted_search(kept, tf.concat([starts, [tf.int32.max]], 0), "left")
    # each kept entry's variable: how many of the variables' ends it is at or past
    variable_of = sorted_search(slices[1:], tf.range(tf.size(magnitudes)), "right")
    at = tf.reshape(tf.where(magnitudes >= tf.gather(cuts, variable_of)), [-1])
    applied, variable_of = tf.gather(kept, at), tf.gather(variable_of, at)
    counts = tf.math.bincount(variable_of, minlength=tf.size(starts),
                              maxlength=tf.size(starts), dtype=tf.int32)
    sums = tf.gather(sums, at)
    return (applied, applied - tf.gather(starts, variable_of),
            applied_averages(sums, divisor) if divisor else sums, counts)


def unapplied(indices, applied, values, offset):
    """``values`` where their ``indices`` (int32) plus ``offset`` are absent from ``applied``
    (ascending, distinct), else 0: one merge walk on CPU (``kernels.unapplied``), else a
    binary search each and a select."""
    native = kernels.unapplied()
    if native is not None:
        return native(indices, applied, values, offset)
    indices = indices + offset
    last = tf.maximum(tf.size(applied) - 1, 0)
    padded = tf.concat([applied, [-1]], 0)  # never equal to an index: nothing applied at all
    at = tf.minimum(sorted_search(applied, indices, "left"), last)
    at = tf.where(tf.size(applied) > 0, at, tf.size(applied))
    absent = tf.not_equal(tf.gather(padded, at), indices)
    return tf.where(absent, values, tf.zeros_like(values))


class SparseAllreduce:
    """The state and the step of the sparse allreduce for one optimizer.

    Args:
        name: prefix of the collectives' names (the same on every rank).
        process_set: Horovod process set (the global one by default).
    """

    def __init__(self, name, process_set=None, compression=NONE, coded=True):
        self.name = name
        self.process_set = process_set
        self.compression = compression
        self.blocks = (CodedBlocks if coded else PlainBlocks)(compression)
        self.thresholds = None
        self._layout = None  # (header length, dense tensors): for announce()

    def build(self, optimizer, routes, size, saved=True):
        """Fix the index space of the sparse routes (step 1) and create the state: the global
        thresholds (an optimizer variable, one per variable; a variable outside the
        checkpoint when not ``saved``) and the boundaries."""
        self.offsets, total = {}, 0
        for key, route in enumerate(routes):
            if route.sparse:
                self.offsets[key] = total
                total += route.num_elements
        if total > MAX_INDEX_SPACE:
            raise ValueError(
                f"exchange='sparse_allreduce' indexes all sparse variables together: {total} "
                "entries do not fit int32 indices; use exchange='allgather'")
        self.total = total
        self.size = size
        # two ranks: one allgather (the module doc)
        self.one_gather = size == 2
        # one threshold and one top-k over all the variables, as the selection's budget
        self.model_wide = getattr(optimizer, "budget", "layer") == "model"
        if saved:
            self.thresholds = optimizer.add_variable(shape=(len(routes),), dtype="float64",
                                                     name="global_threshold")
        with tf.init_scope():
            if not saved:
                self.thresholds = tf.Variable(tf.zeros([len(routes)], tf.float64),
                                              trainable=False, name="global_threshold")
            # not checkpointed: a restored job forecasts again from its saved thresholds
            self.forecast = Forecast(*(
                tf.Variable(initial, trainable=False, name=f"sparse_allreduce_{field}")
                for field, initial in zip(Forecast._fields, first_forecast(len(routes)))))
            self.boundaries = tf.Variable(tf.constant(even_boundaries(total, size), tf.int64),
                                          trainable=False, name="sparse_allreduce_boundaries")
            # the training step this exchange last ran: the forecast holds for the next one only
            self.last_step = tf.Variable(tf.constant(-1, tf.int64), trainable=False,
                                         name="sparse_allreduce_last_step")

    def step(self, selections: Sequence, keys: Sequence[int], sizes: Sequence[int], budgets,
             finite_here, dense_words=(), step=0, at_positions=False) -> Result:
        """Steps 2-8 for this step's ``selections`` (of the variables ``keys``, with ``sizes``
        entries and density budgets ``budgets``); ``dense_words``: int32 tensors to gather
        along (step 5); ``step``: the training step (sent along and checked);
        ``at_positions``: the averages as ``tf.IndexedSlices`` of the applied positions
        (``averaging.applied_at_positions``) instead of dense."""
        size = self.size
        dtype = selections[0].values.dtype
        if any(s.values.dtype != dtype for s in selections):
            raise ValueError("exchange='sparse_allreduce' needs one dtype for every sparsely "
                             f"sent gradient, got {sorted({s.values.dtype.name for s in selections})}; "
                             "use exchange='allgather'")
        order = sorted(range(len(keys)), key=lambda j: keys[j])  # ascending in the index space
        starts = tf.constant([self.offsets[keys[j]] for j in order], tf.int32)

        # Steps 2-5: with regions, or at two ranks in one gather
        indices = tf.concat([s.indices + self.offsets[key] for s, key in zip(selections, keys)],
                            0)
        values = tf.concat([s.values for s in selections], 0)
        thresholds = tf.gather(tf.convert_to_tensor(self.thresholds), [keys[j] for j in order])
        form = self._summed_in_one_gather if self.one_gather else self._summed_by_owners
        kept, kept_values, level_counts, finite, dense_gathered, sent_words, quantiles = form(
            indices, values, starts, thresholds, len(keys), finite_here, dense_words, step, dtype)

        # Step 6: for every variable at once (a slice of the ascending kept entries each), the
        # next threshold and what is applied: the k largest kept sums (ties included), or all
        # of them if fewer were kept
        positions = [[keys[j]] for j in order]
        magnitudes = tf.abs(tf.cast(kept_values, tf.float64))
        this_step = tf.cast(step, tf.int64)
        following = tf.equal(this_step, self.last_step + 1)  # else forecast afresh (module doc)
        forecast = Forecast(*(tf.where(following, tf.gather_nd(tf.convert_to_tensor(state),
                                                                positions), afresh)
                              for state, afresh in zip(self.forecast, first_forecast(len(keys)))))
        budget = tf.stack([tf.cast(budgets[j], tf.int32) for j in order])
        if self.model_wide and len(keys) > 1:
            cut, next_theta, next_forecast = next_thresholds(  # one cut for the model
                thresholds, forecast, magnitudes, None, level_counts, budget, whole=True)
        else:
            cut, next_theta, next_forecast = next_thresholds(
                thresholds, forecast, magnitudes,
                sorted_search(kept, tf.concat([starts, [tf.int32.max]], 0), "left"),
                level_counts, budget)
        kept, local, kept_values, counts = applied_entries(  # averages at positions
            kept, kept_values, magnitudes, cut, starts, divisor=size if at_positions else 0)
        per_variable = tf.reshape(counts, [1, len(keys)])
        cuts = tf.concat([[0], tf.cumsum(counts)], 0)
        if at_positions:
            in_order = applied_at_positions(local, kept_values, cuts, [sizes[j] for j in order])
        else:
            in_order = average_entries(local, kept_values, per_variable, range(len(keys)),
                                       [sizes[j] for j in order], size)
        averages = [None] * len(keys)
        for place, j in enumerate(order):
            averages[j] = in_order[place]

        # Step 7: what this rank sent that was not applied goes back (an applied entry goes
        # back as 0, which leaves its residual entry as it is)
        returned = [(unapplied(s.indices, kept, s.values, self.offsets[key]), s.indices)
                    for s, key in zip(selections, keys)]

        # Steps 6 and 8: the next thresholds and boundaries, identical on every rank
        for state, values in zip((self.thresholds,) + tuple(self.forecast),
                                 (next_theta,) + tuple(next_forecast)):
            updated = tf.tensor_scatter_nd_update(tf.convert_to_tensor(state), positions,
                                                  values)
            state.assign(tf.where(finite, updated, state))
        self.last_step.assign(this_step)
        if quantiles is not None:
            self.boundaries.assign(tf.concat(
                [[0], tf.reduce_sum(quantiles, 0) // size, [self.total]], 0))
        return Result(averages, returned, finite, dense_gathered, sent_words)

    def _summed_by_owners(self, indices, values, starts, thresholds, variables, finite_here,
                          dense_words, step, dtype):
        """Steps 2-5 with regions: ``(kept indices, kept sums, level counts [variables,
        levels], every rank finite, the gathered dense words, the int32 words this rank's
        blocks hold, each rank's quantiles for step 8)``."""
        size, levels = self.size, len(LEVELS)
        boundaries = tf.convert_to_tensor(self.boundaries)
        # Step 2: each owner's block of the entries in its region (``sparse_blocks``)
        blocks, splits = self.blocks.scatter_blocks(indices, values, boundaries)
        received, from_each = collectives.alltoall(blocks, splits,
                                        name=f"{self.name}.sparse_allreduce.scatter",
                                        process_set=self.process_set, step=step)

        # Steps 3-4: the sums, in rank order (the blocks arrive rank by rank), ascending by
        # index; kept where they reach their variable's threshold; every level counted
        me = runtime.rank(self.process_set)
        start, length = boundaries[me], boundaries[me + 1] - boundaries[me]
        received_indices, received_values, per_rank = self.blocks.unpack_scatter(
            received, tf.ensure_shape(from_each, [size]), dtype, start, length)
        kept_here, kept_sums, counts = owner_sums(received_indices, received_values, per_rank,
                                                  starts, thresholds, LEVELS)

        # Step 5: gather the kept entries, the headers and the dense words
        quantiles = sampled_quantiles(indices, size, boundaries[1:-1])
        parts, fields = self.blocks.gather_parts(kept_here, kept_sums, start, length)
        own = tf.concat([tf.reshape(counts, [-1]), tf.cast(quantiles, tf.int32), fields], 0)
        own_quantiles = levels * variables
        own_fields = own_quantiles + size - 1
        self._layout = (own_fields + self.blocks.header_fields, len(dense_words))
        gathered = collectives.grouped_allgather(
            [header(finite_here, step, rest=own)] + parts + list(dense_words),
            name=f"{self.name}.sparse_allreduce.gather", process_set=self.process_set, step=step)
        gathered, finite, headers = checked_headers(gathered, size)  # headers: the own fields
        # ascending: the owners' regions in rank order, each ascending
        kept, kept_values = self.blocks.unpack_gather(
            gathered[1:1 + len(parts)], headers[:, own_fields:], boundaries, dtype)
        level_counts = tf.reduce_sum(
            tf.reshape(headers[:, :own_quantiles], [size, variables, levels]), 0)
        return (kept, kept_values, level_counts, finite, gathered[1 + len(parts):],
                tf.reduce_sum(splits), tf.cast(headers[:, own_quantiles:own_fields], tf.int64))

    def _summed_in_one_gather(self, indices, values, starts, thresholds, variables,
                              finite_here, dense_words, step, dtype):
        """Steps 2-5 at two ranks (``one_gather``, the module doc), as
        :meth:`_summed_by_owners` returns them (no quantiles: the regions stay): this rank's
        block of all its entries (the scatter's block for one region, the whole space)
        gathered with the headers, which carry each block's length, and the dense words;
        then steps 3-4 over every rank's block, rank by rank."""
        space = [tf.constant(0, tf.int64), tf.constant(self.total, tf.int64)]
        block, _ = self.blocks.scatter_blocks(indices, values, tf.stack(space))
        self._layout = (1, len(dense_words))
        gathered = collectives.grouped_allgather(
            [header(finite_here, step, rest=tf.size(block)), block] + list(dense_words),
            name=f"{self.name}.sparse_allreduce.gather", process_set=self.process_set, step=step)
        gathered, finite, headers = checked_headers(gathered, self.size)
        received_indices, received_values, per_rank = self.blocks.unpack_scatter(
            gathered[1], headers[:, 0], dtype, *space)
        kept, kept_values, counts = owner_sums(received_indices, received_values, per_rank,
                                               starts, thresholds, LEVELS)
        return kept, kept_values, counts, finite, gathered[2:], tf.size(block), None

    @property
    def traced(self) -> bool:
        """Whether a step was traced (and :meth:`announce` knows what to send)."""
        return self._layout is not None

    def announce(self, step, state):
        """One step's collectives (two; one at two ranks) with nothing to send, as a rank that
        is not training (``lockstep.FINISHED`` or ``EPOCH_END`` after ``step`` steps); raises
        unless every rank does the same. In a trace (``Exchange.assert_same_step``), after a
        step was (:attr:`traced`)."""
        own_length, dense = self._layout
        # Horovod's ops are not marked stateful: grappler's constant folding would run (and
        # re-run) a collective whose inputs are all constants while it optimizes the function.
        # So the splits (all zero) are computed from an argument.
        nothing = tf.minimum(tf.cast(state, tf.int32), 0)
        empty = tf.zeros([0], tf.int32) + nothing
        parts = 1
        if not self.one_gather:
            received, _ = collectives.alltoall(
                empty, tf.fill([self.size], nothing),
                name=f"{self.name}.sparse_allreduce.scatter", process_set=self.process_set)
            # in the step's order: the gather starts once the scatter is done
            empty = empty + tf.reduce_sum(received[:0])
            parts = self.blocks.gathered_parts
        first = tf.concat([header(True, step, state, rest=tf.zeros([own_length], tf.int32)),
                           empty], 0)
        gathered = collectives.grouped_allgather(
            [first] + [empty] * (parts + dense),
            name=f"{self.name}.sparse_allreduce.gather", process_set=self.process_set)
        return lockstep.check(tf.reshape(gathered[0], [self.size, -1])[:, 1:HEADER_FIELDS])


@register("sparse_allreduce", grouping="grouped")
class SparseAllreduceExchange(FusedAllgather):
    """The exchange around :class:`SparseAllreduce`: the small dense-route gradients travel in
    its allgather (step 5); a step without sparse selections is the fused allgather's."""

    staleness = False
    returns_unsent = True
    # with the update cut the applied sums come back at their positions (step 6), which the
    # optimizer subtracts in place
    averages_at_positions = True
    # the allgather's selection, plus the split into regions, the owners' sums and their top-k
    # (measured slower than the allgather's step on this project's machines: issue-12 note)
    builds_on = "allgather"

    coded = True  # its blocks' indices and values coded (``sparse_blocks``)

    def wire_bytes_per_entry(self, density, value_bytes):
        """Ok-Topk's lower bound: 2 (N - 1) / N entries a sent entry (regions, then sums)."""
        return 2 * (self.size - 1) / self.size * self.sent_bytes_per_entry(density, value_bytes)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sparse_allreduce = SparseAllreduce(self.name, self.process_set, self.compression,
                                                coded=self.coded)

    def build(self, optimizer, routes):
        super().build(optimizer, routes)
        self.sparse_allreduce.build(optimizer, routes, self.size, saved=self.saves_state)

    def _average_many(self, payload: Payload, sizes, step):
        if not payload.sparse.items:
            return super()._average_many(payload, sizes, step)
        dense = list(payload.dense.items)
        dense_groups, dense_words = self.pack_dense(dense)
        result = self.sparse_allreduce.step(
            payload.sparse.items, payload.sparse.keys, sizes, payload.budgets,
            payload.finite_here(), dense_words, step, at_positions=self._at_positions)
        if self.coded:
            self._count_sent(payload, result.sent_words)
        averaged_dense = self.unpack_dense(dense, dense_groups, result.dense_words,
                                           payload.dense.keys, step)
        return result.averages, averaged_dense, result.finite, result.returned

    @property
    def traced(self) -> bool:
        return self.sparse_allreduce.traced or super().traced

    def _announce(self, step, state):
        if self.sparse_allreduce.traced:
            return self.sparse_allreduce.announce(step, state)
        return super()._announce(step, state)


@register("sparse_allreduce", grouping="layerwise")
class LayerwiseSparseAllreduce(Exchange):
    """``grouping="layerwise"``: one sparse allreduce per variable (its own alltoall and
    allgather, named by the variable's key), which TensorFlow starts as soon as that variable's
    gradient exists, while backprop of the layers below goes on (as the layer-wise allgather
    does). Each variable is an index space of its own, with its own regions and threshold;
    steps 2-8 of the module doc are otherwise the same. Dense-route gradients: one allreduce
    each. Whether every rank was finite comes with the headers of the sparse variables'
    allgathers (a tiny allreduce when there are none)."""

    per_layer = True
    builds_on = "allgather"
    staleness = False
    returns_unsent = True
    coded = True
    averages_at_positions = True  # with the update cut (``SparseAllreduceExchange``)

    def build(self, optimizer, routes):
        self.choose_averages_form(optimizer)
        self.parts = {}
        for key, route in enumerate(routes):
            if route.sparse:
                part = SparseAllreduce(f"{self.name}.{key}", self.process_set, self.compression,
                                       coded=self.coded)
                part.build(optimizer, [route], self.size, saved=self.saves_state)
                self.parts[key] = part

    def _average_many(self, payload: Payload, sizes, step):
        finite_here = payload.finite_here()
        averages, returned, finite, sent_words = [], [], [], []
        for selection, key, n, budget in zip(payload.sparse.items, payload.sparse.keys, sizes,
                                             payload.budgets):
            result = self.parts[key].step([selection], [0], [n], [budget], finite_here,
                                          step=step, at_positions=self._at_positions)
            averages += result.averages
            returned += result.returned
            finite.append(result.finite)
            sent_words.append(result.sent_words)
        if self.coded and sent_words:
            self._count_sent(payload, tf.add_n(sent_words))
        finite = tf.reduce_all(finite) if finite else self.finite_everywhere(payload, step)
        dense = self.dense_average(payload.dense.items, payload.dense.keys, step)
        return averages, dense, finite, returned


@register("plain_sparse_allreduce", grouping="grouped")
class PlainSparseAllreduce(SparseAllreduceExchange):
    """The sparse allreduce with int32 indices and raw values on the wire (8 bytes an entry
    with float32 values): the same averages as ``"sparse_allreduce"``, without the coding's
    CPU work. ``exchange="auto"`` does not try it."""

    coded = False
    auto_candidate = False


@register("plain_sparse_allreduce", grouping="layerwise")
class PlainLayerwiseSparseAllreduce(LayerwiseSparseAllreduce):
    """``grouping="layerwise"`` with int32 indices and raw values."""

    coded = False
    auto_candidate = False
