"""The job's plumbing: Horovod start-up, rank and size (``startup``), every named collective
(``collectives``), the stall watchdog, the lockstep and consistency checks, broadcasts,
unequal shards and the ``sparse_hvd`` logger.

``sparse_hvd.runtime.init``/``rank``/``size``/... are the start-up functions, as before the
package existed."""

from .startup import as_process_set, horovod, init, local_rank, process_set_or_global, rank, size

__all__ = ["as_process_set", "horovod", "init", "local_rank", "process_set_or_global", "rank",
           "size"]
