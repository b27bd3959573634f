"""Bounded staleness: exchange a step's gradients in the background, apply them tau steps later.

Candela et al. ("Sparsification as a remedy for staleness in distributed asynchronous SGD") show
that SGD applying delayed sparse updates with error feedback keeps the O(1/sqrt(T)) non-convex
rate. With ``SparseDistributedOptimizer(..., staleness=tau)`` a worker no longer waits for the
network inside its step:

1. step t (in the training step): compensate and select as usual, write the residuals, and hand
   the payload (each sparse variable's values and indices, each dense-route gradient) to the
   pipeline (:meth:`DelayedExchange.submit`, a ``tf.numpy_function``). It returns at once.
2. The pipeline's thread takes payloads in step order and runs the exchange eagerly, one
   step at a time: one Horovod allgather for every variable's (values, indices) pairs (values
   bit-cast beside their indices), one allreduce for the dense-route gradients, and the same
   rank-order scatter-add as the synchronous path. Horovod's own background loop moves the bytes while the worker computes steps
   t+1, t+2, ...
3. Still in step t, after submitting: the average of step t - tau is taken
   (:meth:`DelayedExchange.take`, which waits only if it has not arrived yet) and given to the
   inner optimizer. The first tau steps apply nothing. With tau = 1 a whole step's exchange
   overlaps the next step's forward and backward pass; a larger tau leaves the network (or a
   straggler) tau steps.
4. Every rank submits the same steps in the same order and receives the same gathered bytes,
   reduced the same way: every replica applies bit-identical updates at the same steps.
5. Before a checkpoint, the exchanges in flight are waited for and their averages written into
   optimizer variables (the ``delayed`` slots, tau per trainable variable), so the checkpoint
   holds them and a resumed job continues the same sequence; at the end of ``fit`` whatever is
   still pending is applied in step order, so no update is lost.

Why a thread running Horovod, rather than mpi4py's non-blocking ``Iallgatherv``: the same
transport as the rest of the library (MPI, Gloo and NCCL alike, so ``horovodrun --gloo`` works
too), the same reduction (rank-order scatter-add of bit-exact gathered entries, Horovod's
allreduce) as ``staleness=0``, and Horovod's stall detection still ends a job whose peer died.
The cost is a copy of the payload to host memory and back, and per-step Python in the thread.
"""

import threading
from collections import deque
from typing import Dict, List, NamedTuple, Sequence, Tuple

import numpy as np
import tensorflow as tf

from .exchange import Exchange
from .sparsifiers import Selection

_POLL_SECONDS = 1.0  # how often a waiting step re-checks that the thread is alive


class PayloadLayout(NamedTuple):
    """Which variables a step's payload carries, and how, in the order of its arrays.

    ``sparse``: variable indices sent as (values, indices) pairs; ``dense``: variable indices
    sent whole (averaged by allreduce). Fixed for one traced step function.
    """

    sparse: Tuple[int, ...]
    dense: Tuple[int, ...]


class DelayedExchange:
    """Runs each step's exchange on a background thread and hands back the averages later.

    Args:
        exchange: the :class:`~sparse_hvd.exchange.Exchange` whose collectives move the data
            (its name must differ from every other collective's in the job).
        num_elements: entries of each trainable variable, in the optimizer's build order.
        dtypes: each variable's numpy dtype.

    Averages are returned for every variable; a variable absent from a step's payload gets
    zeros.
    """

    def __init__(self, exchange: Exchange, num_elements: Sequence[int], dtypes: Sequence):
        self.exchange = exchange
        self.num_elements = list(num_elements)
        self.dtypes = [np.dtype(d) for d in dtypes]
        self._queue = deque()  # (step, layout, arrays), in submission order
        self._results: Dict[int, List[np.ndarray]] = {}
        self._pending: List[int] = []  # submitted and not yet taken, in order
        self._error = None
        self._lock = threading.Condition()
        self._thread = None

    # ---- called from the training step (through tf.numpy_function) ----------------------------

    def submit(self, layout: PayloadLayout, step, *arrays) -> np.int64:
        """Queue step ``step``'s payload: for each sparse variable its values then its indices,
        then each dense variable's flat gradient. Returns at once."""
        step = int(step)
        copies = [np.array(a, copy=True) for a in arrays]  # TensorFlow may reuse its buffers
        with self._lock:
            self._raise_if_failed()
            if step in self._pending:
                raise RuntimeError(f"sparse_hvd: step {step} was submitted twice to the pipeline")
            self._pending.append(step)
            self._queue.append((step, layout, copies))
            self._start_thread()
            self._lock.notify_all()
        return np.int64(step)

    def take(self, step) -> List:
        """``[present, average_0, average_1, ...]`` of step ``step``, waiting for it if needed.

        ``present`` is False (and the averages zeros) for a step that was never submitted or
        was already taken: a step before the first, or one skipped on every rank.
        """
        step = int(step)
        with self._lock:
            if step not in self._pending:
                return [np.bool_(False)] + [np.zeros(n, d) for n, d in zip(self.num_elements, self.dtypes)]
            while step not in self._results:
                self._raise_if_failed()
                if not self._thread.is_alive():
                    raise RuntimeError("sparse_hvd: the background exchange thread has stopped")
                self._lock.wait(_POLL_SECONDS)
            self._pending.remove(step)
            return [np.bool_(True)] + self._results.pop(step)

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
                step, layout, arrays = self._queue.popleft()
            try:
                averages = self._exchange(layout, arrays)
            except Exception as error:  # handed to the training step, which raises it
                with self._lock:
                    self._error = error
                    self._lock.notify_all()
                return
            with self._lock:
                self._results[step] = averages
                self._lock.notify_all()

    def _exchange(self, layout: PayloadLayout, arrays) -> List[np.ndarray]:
        """One step's exchange, eagerly: the synchronous path's collectives and reduction.

        Eager on purpose: a traced function would run its ops on TensorFlow's inter-op thread
        pool, where the training step's ``take`` may be holding the only thread while it waits
        for this very exchange (a deadlock seen with one inter-op thread). Eager ops run on
        this thread.
        """
        count = len(layout.sparse)
        selections = [
            Selection(tf.constant(arrays[2 * j]), tf.constant(arrays[2 * j + 1])) for j in range(count)
        ]
        # Eager collectives run one after another, each at least one Horovod cycle: one for
        # all (values, indices) pairs, one for the dense gradients.
        sparse = self.exchange.sparse_average_packed(
            selections, [self.num_elements[i] for i in layout.sparse], list(layout.sparse)
        )
        dense = self.exchange.dense_average([tf.constant(a) for a in arrays[2 * count:]],
                                            list(layout.dense))
        averages = [np.zeros(n, d) for n, d in zip(self.num_elements, self.dtypes)]
        for index, average in zip(layout.sparse + layout.dense, list(sparse) + list(dense)):
            averages[index] = average.numpy().reshape(-1)
        return averages
