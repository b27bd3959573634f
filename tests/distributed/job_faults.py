"""Training jobs that a new user could write, each with one fault; used by tests/test_faults.py.

Usage: python job_faults.py CASE [OPTIONS...]

Cases (2 ranks, a small MLP, the README's one-line change, 3 epochs of batches of 16):
  uneven_callbacks   rank 1 has half as many batches (20 a epoch, rank 0 40), README callbacks:
                     every rank must raise the step-mismatch error at rank 1's first epoch end;
  uneven             the same without callbacks: every rank must raise when rank 1's fit ends;
  extra_optimizer    rank 0 creates one more, unused optimizer: every rank must raise;
  mismatched_model   rank 1's hidden layer has 65 units, rank 0's 64: every rank must raise;
  nan                one of rank 1's samples is NaN: its batch is skipped on every rank (once
                     an epoch), training finishes with identical replicas;
  good               three trainings that must work: the uneven data cut with
                     sparse_hvd.equal_shards; unequal tf.data shards, repeated, with
                     sparse_hvd.steps_per_epoch; a bfloat16 Dense layer (full data).
Options: "sparse_allreduce" uses exchange="sparse_allreduce".

Each rank prints "rank R finished CASE after S steps digest D" when a training finishes, and
"rank R raised: ..." (then exits with status 3) when one raises. (A stuck rank is in
job_rank_fails.py.)
"""

import hashlib
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import sparse_hvd  # noqa: E402


def _digest(model):
    digest = hashlib.sha256()
    for weight in model.trainable_weights:
        digest.update(np.asarray(weight.numpy(), dtype=np.float64).tobytes())
    return digest.hexdigest()[:16]


def train(case, options):
    rank = sparse_hvd.rank()
    keras.utils.set_random_seed(rank)
    dtype = "bfloat16" if case == "bfloat16" else "float32"
    width = 65 if case == "mismatched_model" and rank == 1 else 64
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(width, dtype=dtype),
                              keras.layers.Dense(1)])
    if case == "extra_optimizer" and rank == 0:
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.01))  # never used
    exchange = "sparse_allreduce" if "sparse_allreduce" in options else "allgather"
    model.compile(sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.01),
                                                        exchange=exchange),
                  loss="mse", jit_compile=False)
    samples = 320 if rank == 1 and case in ("uneven", "uneven_callbacks", "equal_shards",
                                            "repeat_dataset") else 640
    x = np.random.RandomState(rank).randn(samples, 32).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    if case == "nan" and rank == 1:
        x[100, 5] = np.nan
    callbacks = [sparse_hvd.BroadcastGlobalVariablesCallback(0)]
    if case in ("uneven_callbacks", "equal_shards", "repeat_dataset", "bfloat16"):
        callbacks += [sparse_hvd.MetricAverageCallback(), sparse_hvd.ShareResidualsCallback()]
    if case == "equal_shards":
        x, y = sparse_hvd.equal_shards(x, y)
    if case == "repeat_dataset":
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        steps = sparse_hvd.steps_per_epoch(len(dataset))
        model.fit(dataset.repeat(), steps_per_epoch=steps, epochs=3, verbose=0,
                  callbacks=callbacks)
    else:
        model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=callbacks)
    skipped = model.optimizer.communication_stats()["skipped_steps"]
    print(f"rank {rank} finished {case} after {int(model.optimizer.iterations.numpy())} steps "
          f"({skipped} skipped) digest {_digest(model)}", flush=True)


def main(case, options):
    sparse_hvd.init()
    for each in ("equal_shards", "repeat_dataset", "bfloat16") if case == "good" else (case,):
        train(each, options)


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2:])
    except Exception as error:  # what a user would see, on this rank
        print(f"rank {sparse_hvd.rank()} raised: {type(error).__name__}: {error}", flush=True)
        time.sleep(2)  # the other rank's message reaches the log before the launcher ends it
        sys.exit(3)
