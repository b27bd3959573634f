"""``exchange="auto"``: which exchange moves a step's gradients fastest on this job.

When the optimizer is built, every rank times Horovod allgathers of two sizes bracketing the
step's payload (``sparse_hvd.selection.adaptive.probe_allgather_costs``) and fits ``t = alpha + beta x
bytes`` per rank's share; the fit is averaged over the ranks, so every rank decides the same.
With P the payload one rank sends per step (values and int32 indices at the density), D the
dense bytes of the same variables and N the workers, the fitted allgather of ``s`` bytes per
rank moves (N - 1) s bytes into every worker, so one worker's link carries ``beta / (N - 1)``
seconds per byte. The modelled step exchanges:

1. allgather: one allgather of P: ``alpha + beta P``;
2. sparse allreduce: an alltoall of P ((N - 1) / N of it on the wire) and an allgather of the
   kept entries (about P / N per rank): ``2 alpha + 2 beta P / N``;
3. dense: a ring allreduce of D (2 (N - 1) / N of it through every link):
   ``alpha + 2 beta D / N``.

The smallest of the candidates (the exchanges that can run the optimizer's other settings,
``checks.exchange_candidates``) wins; a tie goes to dense, which also skips the selection.
The model leaves out
the CPU work around each exchange (selection, summing), which is about the same for the two
sparse ones: it counts the network only.
"""

import tensorflow as tf

from ..runtime import collectives, log, startup as runtime
from ..selection.adaptive import fit_latency_bandwidth, probe_allgather_costs, probe_sizes_for
from ..selection.density import elements_to_send
from ..feedback.payload import INDEX_BYTES


def modelled_seconds(alpha, beta, payload_bytes, dense_bytes, workers):
    """Step 1-3 of the module doc: ``{"allgather", "sparse_allreduce", "dense"}: seconds``."""
    return {
        "allgather": alpha + beta * payload_bytes,
        "sparse_allreduce": 2 * alpha + 2 * beta * payload_bytes / workers,
        "dense": alpha + 2 * beta * dense_bytes / workers,
    }


CANDIDATES = ("allgather", "sparse_allreduce", "dense")


def decide(seconds, candidates=CANDIDATES):
    """The fastest of :func:`modelled_seconds` among ``candidates`` (ties: dense, then
    allgather)."""
    sparse = [m for m in ("allgather", "sparse_allreduce") if m in candidates]
    if not sparse:
        return "dense"
    fastest = min(sparse, key=lambda m: (seconds[m], m))
    return "dense" if "dense" in candidates and seconds["dense"] <= seconds[fastest] else fastest


def choose_exchange(routes, density, name, process_set=None, candidates=CANDIDATES):
    """``(choice, details)`` for the sparse ``routes`` at ``density`` among ``candidates``
    (eager; collectives on every rank). Rank 0 prints the choice and the model."""
    workers = runtime.size(process_set)
    sparse = [r for r in routes if r.sparse]
    payload = sum(elements_to_send(r.num_elements, density) * (r.itemsize + INDEX_BYTES)
                  for r in sparse)
    dense = sum(r.num_elements * r.itemsize for r in sparse)
    if workers == 1 or not sparse or len(candidates) == 1:
        first = "allgather" if "allgather" in candidates else candidates[0]
        return first, {"workers": workers, "payload_bytes": payload}
    sizes = probe_sizes_for([payload // 4, payload])
    times, _ = probe_allgather_costs(f"{name}.auto", sizes, repeats=3, process_set=process_set)
    alpha, beta = fit_latency_bandwidth(tf.constant(sizes, tf.float64), times)
    model = collectives.allreduce(tf.stack([alpha, beta]), name=f"{name}.auto.model",
                                  process_set=process_set)
    alpha, beta = float(model[0]), float(model[1])
    seconds = modelled_seconds(alpha, beta, payload, dense, workers)
    choice = decide(seconds, candidates)
    details = {"workers": workers, "payload_bytes": payload, "dense_bytes": dense,
               "alpha": alpha, "beta": beta, "modelled_seconds": seconds, "choice": choice}
    if runtime.rank(process_set) == 0:
        log.info(f"exchange='auto' chose {choice!r} for {workers} workers "
              f"(modelled ms per step: "
              + ", ".join(f"{m} {t * 1e3:.2f}" for m, t in seconds.items())
              + f"; alpha {alpha * 1e6:.0f} us, beta {beta * 1e9:.3f} ns/B)")
    return choice, details


def choose_for(optimizer):
    """``exchange="auto"`` for a ``SparseDistributedOptimizer`` being built: the exchange the
    model says is fastest among its candidates (the same on every rank) replaces its
    exchange; with "dense" every variable is routed densely."""
    from . import create

    with tf.init_scope():
        choice, _ = choose_exchange(optimizer._routes, optimizer.density,
                                    name=optimizer._prefix, process_set=optimizer.process_set,
                                    candidates=optimizer._exchange_candidates)
    if choice == "dense":
        optimizer._routes = [route._replace(sparse=False) for route in optimizer._routes]
    optimizer._exchange = create(choice, optimizer._exchange.grouping, name=optimizer._prefix,
                                 process_set=optimizer.process_set,
                                 compression=optimizer._compression)
