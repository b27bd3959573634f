"""Two independent trainings in one MPI job, each on its own sub-communicator.

An MPI application that embeds training splits ``MPI.COMM_WORLD`` and gives each part its own
job: here the even ranks train one model (density 1%) and the odd ranks another (density 5%,
another seed), at the same time, in one ``mpirun``. Two ways, as Horovod offers them:

* ``--via init`` (default): ``sparse_hvd.init(comm=sub)``: the sub-communicator IS the job for
  this process (``sparse_hvd.size()`` is its size); nothing else changes in the script;
* ``--via process_set``: Horovod runs on the whole world, the sub-communicators are registered
  with ``sparse_hvd.init(process_sets=[sub])`` and passed as ``process_set=sub`` to the
  optimizer and the callbacks (a rank that leaves shuts this one Horovod down for every rank,
  so the ranks wait for each other at the end).

Each rank prints ``group G rank R of N: accuracy A digest D``; inside a group the digests
(of the trained weights) must be equal. Needs MPI: under ``horovodrun --gloo`` the
communicators are refused with a message that says so.

    mpirun -np 4 python examples/two_trainings.py
    mpirun -np 4 python examples/two_trainings.py --via process_set
"""

import argparse
import hashlib
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import sparse_hvd  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--via", choices=("init", "process_set"), default="init")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    world = MPI.COMM_WORLD
    group = world.Get_rank() % 2
    sub = world.Split(color=group, key=world.Get_rank())
    if args.via == "init":
        sparse_hvd.init(comm=sub)
        process_set = None  # the sub-communicator is the whole job here
    else:
        sparse_hvd.init(comm=world, process_sets=[sub])
        process_set = sub
    rank, size = sub.Get_rank(), sub.Get_size()
    assert sparse_hvd.size(process_set) == size and sparse_hvd.rank(process_set) == rank

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    per_rank = len(x) // size
    x, y = x[rank::size][:per_rank], y[rank::size][:per_rank]

    keras.utils.set_random_seed(100 + group)  # the two groups train different models
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), density=0.01 if group == 0 else 0.05,
        process_set=process_set)
    model.compile(optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                  jit_compile=False)
    history = model.fit(x, y, batch_size=32, epochs=args.epochs, verbose=0, callbacks=[
        sparse_hvd.BroadcastGlobalVariablesCallback(0, process_set=process_set),
        sparse_hvd.MetricAverageCallback(process_set=process_set),
    ])
    digest = hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.get_weights()))
    print(f"group {group} rank {rank} of {size}: accuracy {history.history['accuracy'][-1]:.3f} "
          f"digest {digest.hexdigest()[:16]}", flush=True)
    if args.via == "process_set":
        # One Horovod runs the whole world here, and a rank that leaves shuts it down for all:
        # wait until both trainings are done.
        world.Barrier()


if __name__ == "__main__":
    main()
