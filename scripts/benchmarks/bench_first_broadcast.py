"""How long the start of a training waits for ``broadcast_variables``, the first call and the next.

Every job starts by making the replicas identical (``BroadcastGlobalVariablesCallback`` or
``sparse_hvd.broadcast_variables``); its first call traces the function that broadcasts every
variable. Run it under the launcher; each rank prints its own times, then rank 0 the slowest
rank's:

    mpirun -np 2 --bind-to none .venv/bin/python scripts/benchmarks/bench_first_broadcast.py

A model of ``--layers`` dense layers of ``--width`` units (2 variables each) is built the same
on every rank, broadcast from rank 0 twice, and checked equal on every rank.
"""

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args(argv)

    import horovod.tensorflow as hvd
    import keras
    import numpy as np

    import sparse_hvd

    sparse_hvd.init()
    rank = sparse_hvd.rank()
    keras.utils.set_random_seed(rank)  # different weights on every rank until the broadcast
    model = keras.Sequential([keras.Input((args.width,))]
                             + [keras.layers.Dense(args.width) for _ in range(args.layers)])
    seconds = []
    for _ in range(2):
        started = time.perf_counter()
        sparse_hvd.broadcast_variables(model.variables, root_rank=0)
        seconds.append(time.perf_counter() - started)
    print(f"rank {rank}: first broadcast {seconds[0]:.2f} s, second {seconds[1]:.3f} s "
          f"({len(model.variables)} variables)", flush=True)
    checksum = float(sum(np.sum(v.numpy(), dtype="float64") for v in model.variables))
    everyone = hvd.allgather_object((seconds[0], checksum))
    if rank == 0:
        same = len({c for _, c in everyone}) == 1
        print(f"the slowest rank's first broadcast: {max(s for s, _ in everyone):.2f} s; "
              f"weights identical on every rank: {same}")


if __name__ == "__main__":
    main()
