"""A training job in which one rank fails mid-training; used by tests/test_failures.py.

Usage: python job_rank_fails.py raise|kill|stall|none [STALENESS]
Rank 1 raises, is killed with SIGKILL, or stalls (sleeps, as if stuck outside any collective)
at its fourth batch while the other ranks keep training and wait for it in the gradient
exchange. The job must end with a non-zero status within a bounded time instead of hanging:
the stall through sparse_hvd's stall watchdog (SPARSE_HVD_STALL_TIMEOUT).

With STALENESS > 0 the exchanges run on the optimizer's background thread; the job also runs
TensorFlow with a single inter-op thread, where the training step waiting for a delayed
average must not starve that exchange. "none": no rank fails, the job must finish.
"""

import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import sparse_hvd  # noqa: E402


class FailOnRankOne(keras.callbacks.Callback):
    def __init__(self, how):
        super().__init__()
        self.how = how

    def on_train_begin(self, logs=None):
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == 3:
            # the test reads this: training had started on this rank before the failure
            print(f"rank {sparse_hvd.rank()} trained 3 steps", flush=True)

    def on_train_batch_begin(self, batch, logs=None):
        if sparse_hvd.rank() == 1 and batch == 3 and self.how != "none":
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.how == "stall":
                time.sleep(3600)
            raise RuntimeError("rank 1 fails on purpose")


def main(how, staleness=0):
    if staleness:
        import tensorflow as tf

        tf.config.threading.set_inter_op_parallelism_threads(1)
        tf.config.threading.set_intra_op_parallelism_threads(1)
    sparse_hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64), keras.layers.Dense(1)])
    model.compile(
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.01), staleness=staleness),
        loss="mse", jit_compile=False,
    )
    x = np.random.RandomState(sparse_hvd.rank()).randn(640, 32).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    epochs = 2 if how == "none" else 50
    model.fit(x, y, batch_size=8, epochs=epochs, verbose=0,
              callbacks=[sparse_hvd.BroadcastGlobalVariablesCallback(0), FailOnRankOne(how)])
    if how == "none":
        print(f"rank {sparse_hvd.rank()} finished training", flush=True)
    else:
        print(f"rank {sparse_hvd.rank()} finished training, which it must not", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
