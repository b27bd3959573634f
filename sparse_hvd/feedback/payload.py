"""Routes and payloads: how each variable's gradient travels, and what one step sends.

A :class:`Route` is fixed per variable when the optimizer is built: sparse (selected (value,
index) pairs) or dense (the whole gradient, averaged by allreduce). A :class:`Payload` is what
one step of one rank has prepared for the exchange, before anything is written: three
:class:`Part`s (sparse selections, dense gradients, an embedding's row-sparse gradients on the
dense route), the state writes that go with it, whether this rank's gradients are finite, and
the figures the statistics count. It is immutable: built once by :class:`PayloadBuilder`, then
read by the exchange, the statistics and the commit.
"""

from typing import NamedTuple, Tuple

import tensorflow as tf

from ..exchanges.compression import NONE
from ..runtime.stamps import time_after
from ..selection.density import elements_to_send
from ..selection.sparsifiers import Selection
from . import nonfinite

INDEX_BYTES = 4  # indices travel as int32
DENSE_ITEM_BYTES = 4  # what a dense float32 exchange sends per entry (the statistics' yardstick)


class Route(NamedTuple):
    """How one variable's gradient travels, fixed when the optimizer is built."""

    num_elements: int
    sparse: bool  # False: dense allreduce (small, or larger sparse than dense)
    itemsize: int  # bytes per gradient value
    # a sparse-route variable sent whole (exchange="auto" running dense): its compensated
    # gradient travels and its residual is cleared, so no earlier unsent part is lost
    flushed: bool = False
    # a sparse-route variable sent whole in a trial of exchange="auto": its gradient travels
    # alone and its residual waits for the sparse steps after the trial (``ErrorFeedback.hold``)
    held: bool = False


def entries_in(shape) -> int:
    """Entries of a fully known shape."""
    n = 1
    for dim in shape:
        n *= int(dim)
    return n


def route_for(variable, density: float, min_elements: int, compression=NONE) -> Route:
    """Sparse when the variable has at least ``min_elements`` entries and its (value, index)
    pairs at ``density`` (the density the policy settles at; a warm-up may briefly send more)
    take fewer bytes than the dense gradient. ``itemsize``: bytes of a value on the wire (2
    with a 16-bit ``compression``, a ``sparse_hvd.exchanges.compression.Compression``)."""
    n = entries_in(variable.shape)
    itemsize = compression.itemsize(variable.dtype)
    k = elements_to_send(n, density)
    sparse = n >= min_elements and k * (itemsize + INDEX_BYTES) < n * itemsize
    return Route(num_elements=n, sparse=sparse, itemsize=itemsize)


class Part(NamedTuple):
    """The variables of one kind in a step, in processing order."""

    positions: Tuple[int, ...] = ()  # places in the step's (gradient, variable) list
    keys: Tuple[int, ...] = ()  # the variables' build indices (name the collectives)
    items: tuple = ()  # Selection, dense tensor or tf.IndexedSlices


class Payload(NamedTuple):
    """What one rank sends in one step, prepared before anything is written."""

    sparse: Part  # Selections
    dense: Part  # whole gradients, averaged by allreduce
    rows: Part  # row-sparse gradients (embeddings) on the dense route, exchanged as rows
    state_updates: Tuple[tuple, ...]  # (variable, new value): written only if the step goes ahead
    local_finite: Tuple[tf.Tensor, ...]  # one bool per gradient (none when not checked)
    gradients: Tuple[tf.Tensor, ...]  # each gradient as processed (for timing)
    sent_per_variable: Tuple[tuple, ...]  # (build index, entries sent)
    dense_bytes: int  # what a dense float32 exchange would send
    bytes_sent: tf.Tensor  # int64: this rank's payload in bytes
    capped: tf.Tensor  # int64: selections a payload cap cut short
    budgets: tuple = ()  # the density policy's k of each selection in ``sparse``
    ready_times: tuple = ()  # timestamps each selection waited for, once its input existed

    @property
    def selected(self):
        """Every selection's tensors (for timing): its values and indices, or the words and
        scales of packed signs (``Selection.packed``, made by the pass that made the rest;
        their ``indices``, every position, are counted but never made)."""
        return [t for s in self.sparse.items for t in (s.packed or (s.values, s.indices))]

    def finite_here(self) -> tf.Tensor:
        """True iff this rank's gradients are all finite (True when not checked)."""
        if not self.local_finite:
            return tf.constant(True)
        return tf.reduce_all(tf.stack(self.local_finite))


class PayloadBuilder:
    """Collects a step's payload variable by variable, then freezes it (:meth:`build`).

    Args:
        check_finite: record, per gradient, whether it is finite on this rank.
        sign_group: entries per sign bit of a selection's layers of signs (2 with
            ``exchange="topk_sign_pairs"``), for the bytes it counts.
    """

    def __init__(self, check_finite: bool, sign_group: int = 1):
        self._check_finite = check_finite
        self._sign_group = sign_group
        self._parts = {"sparse": ([], [], []), "dense": ([], [], []), "rows": ([], [], [])}
        self._state_updates, self._local_finite, self._gradients, self._sent = [], [], [], []
        self._dense_bytes = 0
        self._bytes_sent = tf.constant(0, tf.int64)
        self._capped = tf.constant(0, tf.int64)
        self._budgets = []
        self._ready_times = []

    def ready_time(self, gradient) -> tf.Tensor:
        """A timestamp taken once ``gradient`` exists, and not later (``runtime.stamps``);
        the caller runs the gradient's selection under a control dependency on it, so the
        selection's time is measured from there (a timestamp that only depends on the
        gradients may run after the selections)."""
        stamp = time_after(gradient)
        self._ready_times.append(stamp)
        return stamp

    def _add(self, kind, position, key, item, route: Route, values, sent, bytes_sent,
             finite=None):
        positions, keys, items = self._parts[kind]
        positions.append(position)
        keys.append(key)
        items.append(item)
        self._gradients.append(values)
        if self._check_finite:  # ``finite``: already found in the selecting pass
            self._local_finite.append(nonfinite.all_finite(values) if finite is None else finite)
        self._dense_bytes += route.num_elements * DENSE_ITEM_BYTES
        self._bytes_sent += bytes_sent
        self._sent.append((key, sent))

    def add_sparse(self, position, key, route: Route, gradient, selection: Selection,
                   state_updates=(), budget=None):
        """A selection of ``gradient`` (as the sparsifier saw it), the state writes it needs and
        the density policy's k for it."""
        self._budgets.append(budget)
        sent = tf.cast(tf.size(selection.indices), tf.int64)  # ``values`` if packed: none
        bytes_sent = sent * (route.itemsize + INDEX_BYTES)
        signed = -(-route.num_elements // self._sign_group)
        for _ in selection.signs or ():  # a bit per sign in int32 words, and the scale
            bytes_sent += 4 * ((signed + 31) // 32 + 1)
        self._add("sparse", position, key, selection, route, gradient, sent, bytes_sent,
                  finite=selection.finite)
        self._state_updates.extend(state_updates)
        if selection.capped is not None:
            self._capped += tf.cast(selection.capped, tf.int64)

    def add_dense(self, position, key, route: Route, gradient, state_updates=(), sent=None):
        """A gradient sent whole (``sent``, when it differs from ``gradient``: compressed),
        and the state writes it needs; finiteness is judged on ``gradient``."""
        self._add("dense", position, key, gradient if sent is None else sent, route, gradient,
                  route.num_elements, tf.constant(route.num_elements * route.itemsize, tf.int64))
        self._state_updates.extend(state_updates)

    def add_rows(self, position, key, route: Route, gradient: tf.IndexedSlices):
        sent = tf.cast(tf.size(gradient.values), tf.int64)
        num_rows = tf.cast(tf.size(gradient.indices), tf.int64)
        self._add("rows", position, key, gradient, route, gradient.values, sent,
                  sent * route.itemsize + num_rows * gradient.indices.dtype.size)

    def build(self) -> Payload:
        parts = {kind: Part(tuple(p), tuple(k), tuple(i)) for kind, (p, k, i) in self._parts.items()}
        return Payload(
            sparse=parts["sparse"], dense=parts["dense"], rows=parts["rows"],
            state_updates=tuple(self._state_updates), local_finite=tuple(self._local_finite),
            gradients=tuple(self._gradients), ready_times=tuple(self._ready_times),
            sent_per_variable=tuple(self._sent),
            dense_bytes=self._dense_bytes, bytes_sent=self._bytes_sent, capped=self._capped,
            budgets=tuple(self._budgets),
        )


def write_state(state_updates, writer):
    """Write a payload's (variable, new flat value) pairs through ``writer.assign`` (the
    optimizer's: Keras' rule, so that a subclass or a sparse-aware backend sees every write)."""
    for variable, value in state_updates:
        writer.assign(variable, tf.reshape(value, variable.shape))
