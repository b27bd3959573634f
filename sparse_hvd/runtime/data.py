"""Shards of unequal length: giving every rank the same number of steps per epoch.

Every rank must run the same number of training steps: each step's exchange waits for every
rank (``sparse_hvd.runtime.lockstep`` stops a job whose ranks disagree). When the ranks' shards differ
in length, two ways keep them in step:

* NumPy arrays: :func:`equal_shards` cuts every rank's arrays to the shortest rank's length, so
  ``model.fit(x, y, batch_size=b)`` makes the same batches per epoch everywhere (the samples a
  longer shard has beyond that length are not used);
* a ``tf.data`` dataset: repeat it and pass :func:`steps_per_epoch` of its batches, the
  smallest over the ranks: ``model.fit(dataset.repeat(), steps_per_epoch=
  sparse_hvd.steps_per_epoch(len(dataset)))``; every rank then cycles through all of its own
  data, a longer shard over more than one epoch.

(Horovod's ``join`` would let finished ranks contribute nothing instead, but only to
allreduces: sparse_hvd's exchange is an allgather.) Both are collectives: every rank calls them.
"""

import numpy as np

from . import collectives, startup as runtime


def _smallest_over_ranks(count, what, process_set):
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
        raise ValueError(f"`{what}` must be a non-negative int, got {count!r}")
    counts = collectives.allgather_object(int(count), name=f"sparse_hvd.data.{what}",
                                          process_set=process_set)
    return min(counts)


def steps_per_epoch(num_batches, process_set=None) -> int:
    """The smallest ``num_batches`` over the ranks (every rank passes its own)."""
    steps = _smallest_over_ranks(num_batches, "num_batches", process_set)
    if steps == 0:
        raise ValueError("sparse_hvd.steps_per_epoch: a rank has no batch at all, so no rank "
                         "can take a step; give every rank some data")
    return steps


def equal_shards(*arrays, process_set=None):
    """Every rank's ``arrays`` (of one length on a rank) cut to the shortest rank's length.

    Returns one array when given one, else a tuple. Raises ValueError, on the rank concerned,
    when its arrays differ in length (every rank still takes part in the collective).
    """
    if not arrays:
        raise ValueError("sparse_hvd.equal_shards needs at least one array")
    lengths = {len(a) for a in arrays}
    mine = min(lengths)
    shortest = _smallest_over_ranks(mine, "num_samples", process_set)
    if len(lengths) > 1:
        raise ValueError(f"sparse_hvd.equal_shards: the arrays of rank {runtime.rank(process_set)} "
                         f"have different lengths {sorted(lengths)}; pass the inputs and targets "
                         "of one shard")
    cut = tuple(a[:shortest] for a in arrays)
    return cut[0] if len(cut) == 1 else cut
