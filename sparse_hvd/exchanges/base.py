"""What every exchange is: the interface, the registry, the shared header and the pieces that
every exchange uses (the dense route, embeddings' rows, one worker).

An exchange turns one step's payload (``sparse_hvd.feedback.payload``: each rank's selections, its
dense-route gradients and row-sparse gradients, its finiteness) into the average over the
workers of every gradient. Every collective has a name that is identical on every rank
(Horovod matches collectives by name) and independent of TensorFlow's name scopes.

A subclass implements :meth:`Exchange._average_many` (more than one worker) and, for the
lockstep check, :meth:`Exchange._announce`; it declares what it can do in class attributes,
which ``sparse_hvd.checks`` reads (never the class's name):

* ``per_layer``: its collectives are per variable and start while backprop goes on;
* ``layer_budgets``: a policy that sizes each layer from its own exchange's time
  (``AdaptiveDensity``) can run with it (best with ``per_layer``: it warns otherwise);
* ``compression``: it can carry 16-bit values (``sparse_hvd.exchanges.compression``);
* ``staleness``: the delayed pipeline (``sparse_hvd.steps.staleness``) can stand in for it;
* ``returns_unsent``: it may apply less than was sent, and hands back what goes to the residuals;
* ``sends_selections``: it moves sparse selections (else every variable is routed densely);
* ``auto_candidate``: ``exchange="auto"`` may choose it (not an exchange that only changes
  how the same averages travel, when another registered one does it better);
* ``chooses_entries``: it sends every entry of a cut variable in its own code, selected by
  its ``selector`` (a sparsifier with error feedback's fused pass), not by ``sparsifier``,
  ``density`` or ``budget`` (``exchange="sign"``).
* ``code``: what its averages are made of: ``"entries"`` (the selected entries as they are),
  ``"signs"`` (every entry's sign: ``exchange="sign"``) or ``"entries_and_signs"`` (the
  selected entries and the signs of the rest: ``exchange="topk_sign"``). ``exchange="auto"``
  chooses only among exchanges of one code (and dense): the others change what is averaged,
  not only how it travels.
* ``dense_within``: how much faster than dense's its step must be for ``exchange="auto"`` to
  run it, the price of the extra steps its averages need to dense's loss (None: the library's
  ``steps.measured.DENSE_WITHIN``, 1.5x; the sign exchanges 0.2).

The header every grouped exchange sends first (:func:`header`, read by
:func:`checked_headers`): one int32 row per rank, ``[all finite, lockstep fields, ...]``, the
rest the exchange's own (entry counts, ...). So one helper builds it and one reads it, and the
lockstep check (``sparse_hvd.runtime.lockstep``) runs on every exchange's step the same way.
"""

from collections import OrderedDict
from typing import Dict, List, NamedTuple, Sequence, Tuple, Type

import tensorflow as tf

from ..runtime import collectives, lockstep, startup as runtime
from ..feedback import nonfinite
from .averaging import average_entries, divided, sum_rows_in_order
from . import index_coding, value_coding
from .compression import NONE
from ..feedback.payload import INDEX_BYTES, Payload, entries_in, route_for
from ..selection.sparsifiers import Selection

# Dense-route gradients travel in a grouped exchange's allgather while (workers x their
# entries) stays below this (1 MiB of float32 received): a separate allreduce would cost one
# more negotiation round, gathering costs (N - 2) x their size in extra bytes, which wins only
# while small.
DENSE_GATHER_LIMIT = 1 << 18

_REGISTRY: Dict[Tuple[str, str], Type["Exchange"]] = OrderedDict()


def register(name: str, grouping: str = "grouped"):
    """Class decorator: the exchange ``exchange=name`` with ``grouping=grouping``."""
    def add(cls):
        _REGISTRY[(name, grouping)] = cls
        cls.registered_name = name
        return cls
    return add


def available() -> Tuple[str, ...]:
    """The registered exchange names (what ``exchange=`` takes, besides "auto")."""
    return tuple(OrderedDict.fromkeys(name for name, _ in _REGISTRY))


def groupings_of(name: str) -> Tuple[str, ...]:
    return tuple(grouping for (known, grouping) in _REGISTRY if known == name)


def exchange_class(kind: str, grouping: str = "grouped") -> Type["Exchange"]:
    """The class registered for ``kind`` and ``grouping``; ValueError naming what exists."""
    if kind not in available():
        raise ValueError(f"`exchange` must be one of {available() + ('auto',)}, got {kind!r}")
    cls = _REGISTRY.get((kind, grouping))
    if cls is None:
        raise ValueError(
            f"exchange={kind!r} cannot be combined with grouping={grouping!r}: "
            f"{_REGISTRY[(kind, groupings_of(kind)[0])].grouping_reason} Use grouping="
            f"{groupings_of(kind)[0]!r}, or another exchange.")
    return cls


def create(kind: str, grouping: str = "grouped", **kwargs) -> "Exchange":
    """An instance of the exchange registered for ``kind`` and ``grouping``; ``kwargs``: the
    constructor's (``name``, ``process_set``, ``compression``)."""
    return exchange_class(kind, grouping)(grouping=grouping, **kwargs)


def header(finite_here, step, state=lockstep.TRAINING, rest=()) -> tf.Tensor:
    """One rank's header: ``[all finite, lockstep fields, *rest]`` (int32)."""
    flag = tf.reshape(tf.cast(finite_here, tf.int32), [1])
    own = tf.cast(tf.reshape(rest, [-1]), tf.int32)  # a tensor or a list of scalars, maybe empty
    return tf.concat([flag, lockstep.fields(step, state), own], 0)


HEADER_FIELDS = 1 + lockstep.WIDTH  # what :func:`header` puts before the exchange's own


def checked_headers(gathered: List[tf.Tensor], size: int):
    """``gathered[0]`` holds every rank's header: check that every rank is in the same step
    (else every rank raises before anything is unpacked) and return ``(gathered, finite,
    rest)``: the tensors (after the check), whether every rank was finite, and each rank's
    own fields ``[size, -1]``."""
    rows = tf.reshape(gathered[0], [size, -1])
    gathered = lockstep.after_check(rows[:, 1:HEADER_FIELDS], gathered)
    rows = tf.reshape(gathered[0], [size, -1])
    return gathered, tf.reduce_all(tf.equal(rows[:, 0], 1)), rows[:, HEADER_FIELDS:]


class Averaged(NamedTuple):
    """What the exchange hands back for one step."""

    gradients: list  # the average of each gradient, by its position in the step
    finite: tf.Tensor  # bool: every rank's gradients were finite (the same on every rank)
    # per sparse selection, the (values, indices) this rank sent, for its residual: the values
    # not applied (0 where applied); empty when everything sent is applied
    returned: tuple = ()
    # int64: what this rank sent of the payload, as the exchange packed it (coded words); None:
    # the payload's own count (values and int32 indices), the statistics' ``bytes_sent``
    bytes_sent: tf.Tensor = None


def group_positions_by_dtype(tensors):
    """{dtype: [positions in ``tensors``]}, in first-seen order (deterministic on every rank)."""
    groups = OrderedDict()
    for position, tensor in enumerate(tensors):
        groups.setdefault(tensor.dtype, []).append(position)
    return groups


class Exchange:
    """Averages a step's payload over the workers of one Horovod process set.

    Args:
        name: prefix of every collective's name; give two optimizers that run in the same job
            different names.
        process_set: Horovod process set (the global one by default).
        grouping: the grouping it was registered for (``"grouped"`` or ``"layerwise"``).
        compression: a ``sparse_hvd.exchanges.compression.Compression`` (the payload holds values
            already rounded by it); None: none.
    """

    registered_name = None
    per_layer = False
    layer_budgets = True
    compression_capable = True
    staleness = True
    returns_unsent = False
    sends_selections = True
    saves_state = True  # its state (if any) is checkpointed; exchange="auto"'s extras are not
    # the registered exchange whose per-step work this one does too, and more, to send fewer
    # bytes: exchange="auto" tries it only where its fewer bytes could pay for that (None: always)
    builds_on = None
    auto_candidate = True  # exchange="auto" may choose it
    chooses_entries = False  # True: ``selector`` makes the selections (every entry, coded)
    code = "entries"  # what is averaged: "entries", "signs" or "entries_and_signs"
    # how much faster than dense's its step must be for exchange="auto" to run it: the price of
    # the extra steps its averages need to dense's loss (None: ``steps.measured.DENSE_WITHIN``)
    dense_within = None
    # True: with the update cut its sparse averages can come back as ``tf.IndexedSlices`` of
    # the positions that received entries, which the optimizer subtracts in place
    # (``feedback.local_update``); ``choose_averages_form`` decides at build
    averages_at_positions = False
    _at_positions = False
    selector = None
    coded = False  # its indices and values travel coded (index_coding, value_coding)
    grouping_reason = ""  # why the other grouping is not registered (for the message)

    def __init__(self, name: str, process_set=None, grouping="grouped", compression=None):
        self.name = name
        self.process_set = process_set
        self.grouping = grouping
        self.compression = NONE if compression is None else compression
        self._announce_function = None
        self._sent = None  # bytes a coded step sends (_count_sent), handed on by average()

    @property
    def method(self) -> str:
        """The name this exchange is registered under."""
        return self.registered_name

    @property
    def size(self) -> int:
        return runtime.size(self.process_set)

    def routes_for(self, variables, density, min_elements):
        """Each variable's route with this exchange (``payload.route_for``): sparse where its
        selection at ``density`` is worth it, none with an exchange that sends no selections."""
        routes = [route_for(v, density, min_elements, self.compression) for v in variables]
        return [route if self.sends_selections else route._replace(sparse=False)
                for route in routes]

    def build(self, optimizer, routes):
        """Create the exchange's own state as ``optimizer``'s variables (none by default)."""

    def choose_averages_form(self, optimizer):
        """At build: averages at positions where this exchange can give them and they are
        updates that the weights lose (``sparsify="update"``), else dense."""
        self._at_positions = self.averages_at_positions and optimizer.sparsify == "update"

    # ---- the step ----------------------------------------------------------------------------

    def average(self, payload: Payload, num_elements: Sequence[int], step=None) -> Averaged:
        """The average over workers of every gradient in ``payload`` (by its position in the
        step's list) and whether every rank's gradients were finite. ``num_elements``: entries
        of each variable, by build index; ``step``: the training step, which grouped
        exchanges send along and check (``sparse_hvd.runtime.lockstep``) and the stall watchdog names.

        Sparse selections come back as flat dense tensors, dense gradients as they went,
        row-sparse gradients as IndexedSlices. With one worker no collective runs.
        """
        count = 1 + max(payload.sparse.positions + payload.dense.positions + payload.rows.positions,
                        default=-1)
        sizes = [num_elements[key] for key in payload.sparse.keys]
        step = tf.constant(0, tf.int64) if step is None else step
        self._sent = None
        if self.size == 1:
            sparse = [average_entries(s.indices, s.values, tf.reshape(tf.size(s.indices), [1, 1]),
                                      [0], [n], 1)[0]
                      for s, n in zip(payload.sparse.items, sizes)]
            sparse = [sum((tf.cast(layer, a.dtype) for layer in s.signs or ()), a)
                      for a, s in zip(sparse, payload.sparse.items)]
            dense, finite, returned = list(payload.dense.items), payload.finite_here(), ()
        else:
            sparse, dense, finite, returned = self._average_many(payload, sizes, step)
        sent, self._sent = self._sent, None
        rows = self.slices_average(payload.rows.items, payload.rows.keys, step)
        averaged = [None] * count
        for part, results in ((payload.sparse, sparse), (payload.dense, dense), (payload.rows, rows)):
            for position, result in zip(part.positions, results):
                averaged[position] = result
        return Averaged(averaged, finite, tuple(returned), sent)

    def _average_many(self, payload: Payload, sizes, step):
        """``(sparse averages, dense averages, finite, returned)`` with more than one worker."""
        raise NotImplementedError

    def sent_bytes_per_entry(self, density: float, value_bytes: int) -> float:
        """Bytes one entry this rank sends takes on the wire at ``density`` with
        ``value_bytes``-byte values: its value and its int32 index, or with ``coded`` the
        value's code and the index's Elias-Fano code at that density. ``AdaptiveDensity``
        sizes its layers' payloads by it."""
        if not self.coded:
            return value_bytes + INDEX_BYTES
        return value_coding.coded_bytes(value_bytes) + index_coding.bytes_per_index(density)

    def wire_bytes_per_entry(self, density: float, value_bytes: int):
        """Bytes a worker receives per entry each rank sends, with every rank sending a share
        ``density`` of the entries as ``value_bytes``-byte values, or None where that is not
        known (``exchange="auto"`` then never skips this exchange for its bytes)."""
        return None

    def _count_sent(self, payload: Payload, words):
        """For a coded exchange's ``_average_many``: :meth:`coded_bytes_sent`, which
        :meth:`average` hands back as ``Averaged.bytes_sent``."""
        self._sent = self.coded_bytes_sent(payload, words)

    def coded_bytes_sent(self, payload: Payload, words) -> tf.Tensor:
        """What a step sends of ``payload``: its count with the selections' values and int32
        indices replaced by the ``words``, int32, they were coded into."""
        plain = tf.constant(0, tf.int64)
        for selection in payload.sparse.items:
            per_entry = INDEX_BYTES + self.compression.itemsize(selection.values.dtype)
            plain += tf.size(selection.indices, out_type=tf.int64) * per_entry
        return payload.bytes_sent - plain + 4 * tf.cast(words, tf.int64)

    # ---- the lockstep check ------------------------------------------------------------------

    def assert_same_step(self, step, state):
        """Raise on every rank unless every rank calls this with the same ``step`` and ``state``
        (``sparse_hvd.runtime.lockstep``): the step's own collectives with an empty payload, so a rank
        still training receives it in its step and raises too. Called eagerly; the collectives
        run in a traced function, because Horovod names eager collectives by their op type, not
        by the name they are given. Nothing is checked with one worker or before the first
        step was traced (:meth:`_announce` returns None then), nor by exchanges without it.
        """
        if self.size == 1 or not self.traced:
            return
        if self._announce_function is None:
            self._announce_function = tf.function(self._announce, autograph=False)
        try:
            self._announce_function(tf.constant(step, tf.int64), tf.constant(state, tf.int32))
        except tf.errors.OpError as error:
            mismatch = lockstep.mismatch_error(error)
            if mismatch is None:
                raise
            raise mismatch from None

    @property
    def traced(self) -> bool:
        """Whether :meth:`assert_same_step` can announce a step (a step was traced)."""
        return False

    def _announce(self, step, state):
        """The step's collectives as a rank that sends nothing, with ``state`` in its header."""
        raise NotImplementedError

    # ---- pieces every exchange uses ----------------------------------------------------------

    def finite_everywhere(self, payload: Payload, step=None) -> tf.Tensor:
        """Whether every rank's gradients were finite, by one tiny allreduce (True, and no
        collective, when they are not checked or the job has one worker)."""
        if not payload.local_finite or self.size == 1:
            return payload.finite_here()
        return nonfinite.agree(payload.finite_here(), name=f"{self.name}.nonfinite",
                               process_set=self.process_set, step=step)

    def pack_dense(self, dense):
        """Dense-route gradients small enough to travel in an allgather: ``(groups, words)``,
        one int32 tensor per dtype; none when they are too large (``DENSE_GATHER_LIMIT``)."""
        if not dense or self.size * sum(entries_in(t.shape) for t in dense) > DENSE_GATHER_LIMIT:
            return {}, []
        groups = group_positions_by_dtype(dense)
        words = [self.compression.encode(
                     tf.concat([tf.reshape(dense[p], [-1]) for p in positions], 0))
                 for positions in groups.values()]
        return groups, words

    def unpack_dense(self, dense, groups, gathered, keys, step=None):
        """The averages of ``dense``: summed over the ranks in rank order from what was gathered
        (:meth:`pack_dense`), or by one ``grouped_allreduce`` per dtype if nothing was."""
        if not groups:
            return self.dense_average(dense, keys, step)
        size = self.size
        averaged = [None] * len(dense)
        for (dtype, positions), group_words in zip(groups.items(), gathered):
            lengths = [entries_in(dense[p].shape) for p in positions]
            values = self.compression.decode(group_words, dtype, tf.fill([size], sum(lengths)))
            total = sum_rows_in_order(tf.reshape(values, [size, sum(lengths)]))
            average = divided(total, size)
            for position, piece in zip(positions, tf.split(average, lengths)):
                averaged[position] = tf.reshape(piece, tf.shape(dense[position]))
        return averaged

    def dense_average(self, tensors: Sequence[tf.Tensor], keys: Sequence[int],
                      step=None) -> List[tf.Tensor]:
        """The element-wise average over workers of each tensor: one allreduce per variable
        (``per_layer``) or one ``grouped_allreduce`` per dtype."""
        tensors = list(tensors)
        if self.size == 1 or not tensors:
            return tensors
        dtypes = [t.dtype for t in tensors]
        tensors = [self.compression.for_allreduce(t) for t in tensors]
        if self.per_layer:
            averaged = [
                collectives.allreduce(tensor, name=f"{self.name}.dense.{key}",
                                      process_set=self.process_set, step=step)
                for tensor, key in zip(tensors, keys)
            ]
        else:
            averaged = self.per_dtype(collectives.grouped_allreduce, tensors,
                                      f"{self.name}.dense", step)
        return [tf.cast(a, dtype) for a, dtype in zip(averaged, dtypes)]

    def slices_average(self, slices: Sequence[tf.IndexedSlices], keys: Sequence[int], step=None):
        """Average row-sparse gradients (embeddings) over workers, keeping them row-sparse.

        The rows every rank sent (each once: ``feedback.preparation.as_rows`` combines a rank's
        repeats) are gathered (values and indices, one allgather each, named by ``keys``) and
        the values divided by the number of workers; rows sent by several ranks stay
        repeated, and the inner optimizer sums them, as it does within one rank. So the
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

    def sparse_average(self, selections: Sequence[Selection], num_elements: Sequence[int],
                       keys: Sequence[int], step=None) -> List[tf.Tensor]:
        """For each variable, the flat average over workers of what each worker selected:
        every rank's selections gathered (one allgather pair per variable with ``per_layer``,
        else one grouped allgather per dtype and one of the indices), summed in rank order.
        ``keys`` name the variables in the collectives' names (the same on every rank)."""
        if not selections:
            return []
        size = self.size
        if size > 1:
            selections = self._gather_selections(selections, keys, step)
        return [average_entries(s.indices, s.values, tf.reshape(tf.size(s.indices), [1, 1]), [0],
                                [n], size)[0]
                for s, n in zip(selections, num_elements)]

    def _gather_selections(self, selections, keys, step=None) -> List[Selection]:
        """Every rank's selections, concatenated in rank order, variable by variable."""
        half = [self.compression.wire_dtype(s.values.dtype) for s in selections]
        wide = [s.values.dtype for s in selections]
        selections = [s if h is None else Selection(tf.cast(s.values, h), s.indices)
                      for s, h in zip(selections, half)]
        if self.per_layer:
            return [
                Selection(
                    tf.cast(collectives.allgather(s.values, name=f"{self.name}.values.{key}",
                                                  process_set=self.process_set, step=step), dtype),
                    collectives.allgather(s.indices, name=f"{self.name}.indices.{key}",
                                          process_set=self.process_set, step=step),
                )
                for s, key, dtype in zip(selections, keys, wide)
            ]
        gathered_values = self.per_dtype(collectives.grouped_allgather,
                                         [s.values for s in selections], f"{self.name}.values",
                                         step)
        gathered_indices = collectives.grouped_allgather(
            [s.indices for s in selections], name=f"{self.name}.indices",
            process_set=self.process_set, step=step,
        )
        return [Selection(tf.cast(v, dtype), i)
                for v, i, dtype in zip(gathered_values, gathered_indices, wide)]

    def per_dtype(self, grouped_collective, tensors, name, step=None):
        """``grouped_collective`` over ``tensors``, one group per dtype (a Horovod group holds
        one dtype), named ``<name>.<dtype>``; the results in the order of ``tensors``."""
        results = [None] * len(tensors)
        for dtype, positions in group_positions_by_dtype(tensors).items():
            group = grouped_collective([tensors[p] for p in positions],
                                       name=f"{name}.{dtype.name}", process_set=self.process_set,
                                       step=step)
            for position, tensor in zip(positions, group):
                results[position] = tensor
        return results
