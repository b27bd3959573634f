"""Under horovodrun --gloo, mpi4py communicators are refused with a message that names Gloo;
used by tests/test_mpi4py.py. Each rank prints "rank R refused: <message>" per form."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
from mpi4py import MPI  # noqa: E402

import sparse_hvd  # noqa: E402

rank = int(os.environ.get("HOROVOD_RANK", "0"))
for form, attempt in (
    ("init(comm=...)", lambda: sparse_hvd.init(comm=MPI.COMM_WORLD)),
    ("init(process_sets=...)", lambda: sparse_hvd.init(process_sets=[MPI.COMM_WORLD])),
):
    try:
        attempt()
        print(f"rank {rank} accepted {form}, which it must not", flush=True)
    except ValueError as error:
        print(f"rank {rank} refused {form}: {error}", flush=True)
sparse_hvd.init()  # Gloo itself works
try:
    sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), process_set=MPI.COMM_WORLD)
    print(f"rank {rank} accepted process_set=communicator, which it must not", flush=True)
except ValueError as error:
    print(f"rank {rank} refused process_set=communicator: {error}", flush=True)
print(f"rank {sparse_hvd.rank()} of {sparse_hvd.size()} done", flush=True)
