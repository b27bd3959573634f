"""The bytes sparse_hvd's collectives bring into one rank, counted exactly (for benchmarks).

Why: the emulated cluster's interface counters (``bench_step.py``'s wire columns) count all
that crosses a worker's link: the collectives' data, and also MPI's and TCP/IP's framing and
Horovod's own coordination, which runs every cycle whether a step exchanges anything or not.
With a small payload that is not small beside it: the compute-only floor, which calls no
collective, showed 5 kB a step on the wire at 4 workers on 2 cores, where the sparse
allreduce at 0.1% of the 4.35M MLP moves about 30 kB of data. Counting the data alone says
what an exchange's design moves (against Ok-Topk's bound, say), and the difference says what
the transport adds.

How: every collective of the library goes through ``sparse_hvd.runtime.collectives``, called
by attribute. :func:`install` replaces those functions with wrappers that add, to one int64
variable, what this rank received from the other ranks in each call (inside a traced step the
addition is a stateful op of the step, so it runs when the collective does, conditional
branches included):

1. ``allgather`` / ``grouped_allgather``: the gathered bytes less this rank's own;
2. ``alltoall``: the received bytes less the rows this rank sent itself;
3. ``allreduce`` / ``grouped_allreduce``: 2 (N - 1) / N times the tensors' bytes, what a ring
   allreduce receives (MPI chooses its own algorithm; the ring's is the bandwidth-optimal
   figure, and what a dense row's wire is compared with).

Objects gathered in Python (``allgather_object``) and broadcasts are not counted: neither runs
in a training step.
"""

import functools


def tensor_bytes(tf, tensor):
    """Bytes of ``tensor`` as an int64 scalar."""
    return tf.size(tensor, out_type=tf.int64) * tensor.dtype.size


class CollectiveBytes:
    """One rank's count of the bytes its collectives received from the others."""

    def __init__(self, tf, rank, size):
        self.tf = tf
        self.rank = rank  # in the process set the collectives use (the benchmarks': the job)
        self.size = size
        self.received = tf.Variable(0, dtype=tf.int64, trainable=False,
                                    name="collective_bytes_received")

    def read(self):
        """The count so far (an int)."""
        return int(self.received.numpy())

    def add(self, count):
        self.received.assign_add(count)

    def add_ring(self, total_bytes):
        """What a ring allreduce of ``total_bytes`` (an int64 scalar or an int) receives (also
        for an allreduce a benchmark calls itself, outside the library)."""
        self.add(self.tf.cast(total_bytes, self.tf.int64) * 2 * (self.size - 1) // self.size)

    def install(self, collectives):
        """Wrap ``collectives``' functions (the module ``sparse_hvd.runtime.collectives``)."""
        tf = self.tf

        def gathered(original):
            @functools.wraps(original)
            def wrapper(tensor, *args, **kwargs):
                result = original(tensor, *args, **kwargs)
                self.add(tensor_bytes(tf, result) - tensor_bytes(tf, tensor))
                return result
            return wrapper

        def grouped_gathered(original):
            @functools.wraps(original)
            def wrapper(tensors, *args, **kwargs):
                tensors = list(tensors)
                results = original(tensors, *args, **kwargs)
                self.add(tf.add_n([tensor_bytes(tf, r) - tensor_bytes(tf, t)
                                   for r, t in zip(results, tensors)]))
                return results
            return wrapper

        def alltoall(original):
            @functools.wraps(original)
            def wrapper(tensor, splits, *args, **kwargs):
                received, received_splits = original(tensor, splits, *args, **kwargs)
                rows = tf.maximum(tf.shape(tensor, out_type=tf.int64)[0], 1)
                row_bytes = tensor_bytes(tf, tensor) // rows
                own = tf.cast(received_splits[self.rank], tf.int64) * row_bytes
                self.add(tensor_bytes(tf, received) - own)
                return received, received_splits
            return wrapper

        def reduced(original, grouped):
            @functools.wraps(original)
            def wrapper(tensors, *args, **kwargs):
                result = original(tensors, *args, **kwargs)
                self.add_ring(tf.add_n([tensor_bytes(tf, t)
                                        for t in (tensors if grouped else [tensors])]))
                return result
            return wrapper

        collectives.allgather = gathered(collectives.allgather)
        collectives.grouped_allgather = grouped_gathered(collectives.grouped_allgather)
        collectives.alltoall = alltoall(collectives.alltoall)
        collectives.allreduce = reduced(collectives.allreduce, grouped=False)
        collectives.grouped_allreduce = reduced(collectives.grouped_allreduce, grouped=True)
        return self
