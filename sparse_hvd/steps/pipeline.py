"""The background exchange of bounded staleness: one thread that runs each step's exchange.

The optimizer side (``sparse_hvd.steps.staleness``) hands each step's payload to
:meth:`DelayedExchange.submit` (through ``tf.numpy_function``; it returns at once) and takes a
step's average back, tau steps later, with :meth:`DelayedExchange.take`. In between, the
pipeline's thread takes payloads in step order and runs the exchange, one step at a time: one
Horovod allgather for every variable's (values, indices) pairs and the rank's finiteness flag,
one allreduce for the dense-route gradients, and a rank-order sum (see
:meth:`DelayedExchange._exchange`). Horovod's own background loop moves the bytes while the
worker computes the next steps. Every rank submits the same steps in the same order and
receives the same gathered bytes, reduced the same way: every replica gets bit-identical
averages.

Why a thread running Horovod, rather than mpi4py's non-blocking ``Iallgatherv``: the same
transport as the rest of the library (MPI, Gloo and NCCL alike, so ``horovodrun --gloo`` works
too), Horovod's stall detection still ends a job whose peer died, and every rank reduces the
same gathered bits in the same order.
The cost is a copy of the payload to host memory and back, and per-step Python in the thread
(with ``exchange="compact_allgather"``, decoding every rank's codes there: about 3 ms a rank
at 43,500 entries, against 0.7 ms to unpack the int32 tables).
"""

import threading
from collections import deque
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from ..runtime import collectives
from ..exchanges import Exchange, index_coding, value_coding

_POLL_SECONDS = 1.0  # how often a waiting step re-checks that the thread is alive


class PayloadLayout(NamedTuple):
    """Which variables a step's payload carries, and how, in the order of its arrays.

    ``sparse``: variable indices sent as (values, indices) pairs; ``dense``: variable indices
    sent whole (averaged by allreduce); ``coded``: the sparse pairs are followed by what
    travels instead of them, coded in the step (``exchange="compact_allgather"``): the code of
    all their indices (``index_coding``), one block of values per group of ``value_groups``
    (positions in ``sparse`` of one dtype; ``value_coding``, or as they are for float64), and
    the blocks' header fields. Fixed for one traced step function.
    """

    sparse: Tuple[int, ...]
    dense: Tuple[int, ...]
    coded: bool = False
    value_groups: Tuple[Tuple[int, ...], ...] = ()


class Delayed(NamedTuple):
    """What the pipeline hands back for one step."""

    finite: bool  # every rank's gradients were finite: apply ``averages``
    averages: List[np.ndarray]  # flat average of every variable (zeros where absent)
    own: Dict[int, Tuple[np.ndarray, np.ndarray]]  # this rank's sent (values, indices), by variable


class DelayedExchange:
    """Runs each step's exchange on a background thread and hands back the averages later.

    Args:
        exchange: the :class:`~sparse_hvd.exchanges.Exchange` whose collectives move the data
            (its name must differ from every other collective's in the job).
        num_elements: entries of each trainable variable, in the optimizer's build order.
        dtypes: each variable's numpy dtype.

    Averages are returned for every variable; a variable absent from a step's payload gets
    zeros. Each payload carries its rank's finiteness flag: a step that was not finite on
    every rank comes back with ``finite=False`` on every rank, and with what this rank sent, so
    that the optimizer can return it to the residuals. No collective is needed in the training
    step itself, which would have to wait behind the exchanges in flight (Horovod runs one
    collective at a time).
    """

    def __init__(self, exchange: Exchange, num_elements: Sequence[int], dtypes: Sequence):
        self.exchange = exchange
        self.coded = bool(getattr(exchange, "coded", False))  # indices and values coded
        self.num_elements = list(num_elements)
        self.dtypes = [np.dtype(d) for d in dtypes]
        # what sparse values travel as: 16-bit with the exchange's compression
        self.wire_dtypes = [np.dtype((exchange.compression.wire_dtype(d) or tf.as_dtype(d))
                                     .as_numpy_dtype) for d in self.dtypes]
        self._queue = deque()  # (step, layout, finite, arrays), in submission order
        self._results: Dict[int, Delayed] = {}
        self._pending: List[int] = []  # submitted and not yet taken, in order
        self._error = None
        self._lock = threading.Condition()
        self._thread = None

    # ---- called from the training step (through tf.numpy_function) ----------------------------

    def submit(self, layout: PayloadLayout, step, finite, *arrays) -> np.int64:
        """Queue step ``step``'s payload: whether this rank's gradients were finite, then for
        each sparse variable its values and its indices, then (``layout.coded``) their codes
        (:class:`PayloadLayout`), then each dense variable's flat gradient. Returns at once."""
        step = int(step)
        copies = [np.array(a, copy=True) for a in arrays]  # TensorFlow may reuse its buffers
        with self._lock:
            self._raise_if_failed()
            if step in self._pending:
                raise RuntimeError(f"sparse_hvd: step {step} was submitted twice to the pipeline")
            self._pending.append(step)
            self._queue.append((step, layout, bool(finite), copies))
            self._start_thread()
            self._lock.notify_all()
        return np.int64(step)

    def take(self, step) -> Optional[Delayed]:
        """Step ``step``'s result, waiting for it if needed; None for a step that was never
        submitted or was already taken (before the first step, or taken from the slots)."""
        step = int(step)
        with self._lock:
            if step not in self._pending:
                return None
            while step not in self._results:
                self._raise_if_failed()
                if not self._thread.is_alive():
                    raise RuntimeError("sparse_hvd: the background exchange thread has stopped")
                self._lock.wait(_POLL_SECONDS)
            self._pending.remove(step)
            return self._results.pop(step)

    def take_for_step(self, layout: PayloadLayout, step) -> List[np.ndarray]:
        """:meth:`take` flattened for ``tf.numpy_function``: ``[present, finite, average_0, ...,
        (values, indices) sent by this rank for each variable of layout.sparse]``; the sent
        pairs are empty unless the step is to be undone (not finite everywhere, fine here)."""
        result = self.take(step)
        if result is None:
            averages = self._zeros_where_none([None] * len(self.num_elements))
        else:
            averages = result.averages
        sent = []
        for index in layout.sparse:
            values, indices = (result.own.get(index) if result and not result.finite else None) or (
                np.zeros(0, self.dtypes[index]), np.zeros(0, np.int32))
            sent += [values.astype(self.dtypes[index]), indices]  # 16-bit widened: exact
        return [np.bool_(result is not None), np.bool_(result is None or result.finite)] + averages + sent

    # ---- called eagerly, between steps ---------------------------------------------------------

    def pending_steps(self) -> List[int]:
        """Submitted steps whose average has not been taken yet, oldest first."""
        with self._lock:
            return list(self._pending)

    def discard(self):
        """Wait for every exchange in flight (the other ranks take part in them) and drop the
        results: for a restore that replaces the optimizer's state."""
        for step in self.pending_steps():
            self.take(step)

    # ---- the thread -----------------------------------------------------------------------------

    def _raise_if_failed(self):
        if self._error is not None:
            raise RuntimeError(
                f"sparse_hvd: a background gradient exchange failed: {self._error}"
            ) from self._error

    def _start_thread(self):
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._serve, name=f"{self.exchange.name}.pipeline", daemon=True
            )
            self._thread.start()

    def _serve(self):
        while True:
            with self._lock:
                while not self._queue:
                    self._lock.wait()
                step, layout, finite, arrays = self._queue.popleft()
            try:
                result = self._exchange(layout, finite, arrays)
            except Exception as error:  # handed to the training step, which raises it
                with self._lock:
                    self._error = error
                    self._lock.notify_all()
                return
            with self._lock:
                self._results[step] = result
                self._lock.notify_all()

    def _exchange(self, layout: PayloadLayout, finite: bool, arrays) -> Delayed:
        """One step's exchange: two eager Horovod collectives, everything else in NumPy.

        1. Each sparse variable's payload becomes one int32 table (:func:`pack`): its entry
           count, the values' bits (16-bit values with ``compression``, two to a word), then
           the indices. With ``layout.coded`` all of them make one table instead
           (:func:`pack_coded`): the counts, the value blocks' header fields, the value
           blocks, then the code of every index, all coded in the step
           (``exchange="compact_allgather"``). All tables, and the rank's
           finiteness flag, go to every rank in ONE ``grouped_allgather`` (an eager collective
           costs at least one Horovod cycle, and they run one after another here).
        2. The dense-route gradients are averaged by one ``grouped_allreduce`` per dtype.
        3. Each rank's entries are widened to the variable's dtype and added into a zero vector
           rank by rank (:func:`unpack_sum`; :func:`unpack_coded_sums` decodes them first);
           within one rank the indices are distinct, so the order of additions is fixed: the
           same bits on every rank. Then the sum is divided by the number of workers.

        Why so few TensorFlow ops: every eager op releases and re-takes Python's GIL, and while
        the training loop runs Python (Keras callbacks) each re-take can wait a whole switch
        interval (5 ms); with a dozen small ops per exchange that made steps 30x slower. Why
        eager at all: a traced function would run its ops on TensorFlow's inter-op thread pool,
        where the training step's ``take`` may hold the only thread while it waits for this
        very exchange (a deadlock seen with one inter-op thread).
        """
        size = self.exchange.size
        count = len(layout.sparse)
        averages = [None] * len(self.num_elements)
        own = {index: (arrays[2 * j], arrays[2 * j + 1]) for j, index in enumerate(layout.sparse)}
        sizes = [self.num_elements[index] for index in layout.sparse]
        if layout.coded:
            groups = len(layout.value_groups)
            counts = [len(arrays[2 * j + 1]) for j in range(count)]
            code = arrays[2 * count:2 * count + groups + 2]
            tables = [pack_coded(counts, code[-1], code[1:-1], code[0])]
            dense = arrays[2 * count + groups + 2:]
        else:
            tables = [pack(arrays[2 * j], arrays[2 * j + 1]) for j in range(count)]
            dense = arrays[2 * count:]
        flags = np.array([finite], np.int32)
        if size > 1:
            gathered = collectives.grouped_allgather(
                [tf.constant(t) for t in tables + [flags]], name=f"{self.exchange.name}.packed",
                process_set=self.exchange.process_set,
            )
            *tables, flags = [g.numpy() for g in gathered]
        everywhere = bool(np.all(flags))
        if not everywhere:  # nothing of this step is applied; skip the arithmetic
            return Delayed(False, self._zeros_where_none(averages), own if finite else {})
        if layout.coded:
            totals = unpack_coded_sums(tables[0], sizes, layout.value_groups,
                                       [self.dtypes[i] for i in layout.sparse],
                                       [self.wire_dtypes[i] for i in layout.sparse])
        else:
            totals = [unpack_sum(table, n, self.dtypes[index], self.wire_dtypes[index])
                      for index, table, n in zip(layout.sparse, tables, sizes)]
        for index, total in zip(layout.sparse, totals):
            averages[index] = total if size == 1 else total / total.dtype.type(size)
        if dense:
            averaged = self.exchange.dense_average([tf.constant(a) for a in dense], list(layout.dense))
            for index, average in zip(layout.dense, averaged):
                averages[index] = np.asarray(average).reshape(-1)
        return Delayed(True, self._zeros_where_none(averages), own)

    def _zeros_where_none(self, averages):
        """``averages`` with zeros for the variables a step did not carry (allocated only for
        those: the others are filled every step)."""
        return [np.zeros(n, d) if a is None else a
                for a, n, d in zip(averages, self.num_elements, self.dtypes)]


def _value_words(count: int, dtype) -> int:
    """int32 words that hold ``count`` values of ``dtype`` (two 16-bit values to a word)."""
    return -(-count * np.dtype(dtype).itemsize // 4)


def pack(values: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """One rank's selection as flat int32 words: ``[m, the m values' bits (padded to a whole
    word), the m indices]``; 16-bit values (``compression``) take half a word each."""
    m = len(values)
    words = _value_words(m, values.dtype)
    table = np.zeros(1 + words + m, np.int32)
    table[0] = m
    table[1:1 + words].view(np.uint8)[:values.nbytes] = values.view(np.uint8)
    table[1 + words:] = indices
    return table


def unpack_sum(table: np.ndarray, num_elements: int, dtype, wire_dtype=None) -> np.ndarray:
    """The sum in ``dtype``, added rank by rank in rank order, of the selections (values of
    ``wire_dtype``, default ``dtype``) packed one after another in ``table``."""
    dtype = np.dtype(dtype)
    wire_dtype = dtype if wire_dtype is None else np.dtype(wire_dtype)
    total = np.zeros(num_elements, dtype)
    at = 0
    while at < len(table):
        m = int(table[at])
        words = _value_words(m, wire_dtype)
        values = table[at + 1:at + 1 + words].view(np.uint8)[:m * wire_dtype.itemsize]
        indices = table[at + 1 + words:at + 1 + words + m]
        total[indices] += values.view(wire_dtype).astype(dtype)  # distinct within one rank
        at += 1 + words + m
    return total


def pack_coded(counts, fields, value_blocks, code) -> np.ndarray:
    """One rank's coded selections of every sparse variable as flat int32 words (all made in
    the step): ``[the entry count of each variable, the value blocks' header fields, each
    group's block of values, the code of all their indices as one set of positions]``
    (variable j's positions offset by the entries of the variables before it, its values in
    its positions' order)."""
    parts = [np.asarray(counts, np.int32), np.asarray(fields, np.int32)]
    parts += [np.asarray(block, np.int32) for block in value_blocks]
    return np.concatenate(parts + [np.asarray(code, np.int32)])


def unpack_coded_sums(table, sizes, value_groups, dtypes, wire_dtypes):
    """Each variable's sum (in its dtype) of the :func:`pack_coded` selections one after
    another in ``table``, added rank by rank in rank order; ``sizes``: each variable's entries
    (the code's space is their sum); ``value_groups``: the variables of each value block."""
    space, variables = int(sum(sizes)), len(sizes)
    offsets = np.cumsum([0] + list(sizes[:-1]))
    totals = [np.zeros(n, d) for n, d in zip(sizes, dtypes)]
    coded = [value_coding.codable(wire_dtypes[group[0]]) for group in value_groups]
    field_count = sum(2 + len(group) for group, c in zip(value_groups, coded) if c)
    at = 0
    while at < len(table):
        counts = [int(c) for c in table[at:at + variables]]
        fields = table[at + variables:at + variables + field_count]
        at += variables + field_count
        values, first_field = [None] * variables, 0
        for group, is_coded in zip(value_groups, coded):
            wire, group_counts = wire_dtypes[group[0]], [counts[j] for j in group]
            if is_coded:
                own = fields[first_field:first_field + 2 + len(group)]
                first_field += 2 + len(group)
                words = value_coding.host_block_words(sum(group_counts), own[0], own[1], wire)
                block = value_coding.decode_host(table[at:at + words], group_counts, own, wire)
            else:  # float64: as it is
                words = _value_words(sum(group_counts), wire)
                block = table[at:at + words].view(wire)
            at += words
            for j, piece in zip(group, np.split(block, np.cumsum(group_counts)[:-1])):
                values[j] = piece
        _, low_words, bitmap_words = index_coding.host_layout(sum(counts), space)
        positions = index_coding.decode_host(table[at:at + low_words + bitmap_words],
                                             sum(counts), space)
        at += low_words + bitmap_words
        first = 0
        for j, m in enumerate(counts):  # the variables' ranges of the space follow in order
            indices = positions[first:first + m] - offsets[j]
            totals[j][indices] += values[j].astype(totals[j].dtype)  # distinct within one rank
            first += m
    return totals
