"""A custom training loop (tf.GradientTape + tf.function) with sparse gradient exchange.

The same task as ``train_digits.py`` (scikit-learn's handwritten digits, nothing downloaded),
written as the loop you would copy into your own code. The three lines that matter:

1. wrap the optimizer: ``sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(...))``;
2. before the loop, build it and copy rank 0's model and optimizer state to every rank with
   ``sparse_hvd.broadcast_variables``;
3. in the step, ``optimizer.apply_gradients(zip(grads, model.trainable_variables))`` as usual:
   the optimizer averages the sparsified gradients over the workers. Keep ``jit_compile=False``.

Launch:

    horovodrun -np 2 python examples/custom_loop.py
    mpirun -np 2 --bind-to none python examples/custom_loop.py
    srun -n 2 python examples/custom_loop.py
    python examples/custom_loop.py                     # a single worker
"""

import argparse
import hashlib
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported

import sparse_hvd  # noqa: E402

hvd = sparse_hvd.init()  # horovod.tensorflow, started (None when Horovod is not installed)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description="custom training loop with sparse_hvd")
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--sparsifier", default="topk")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    rank, size = sparse_hvd.rank(), sparse_hvd.size()

    # Data: the same split on every rank; each rank trains on its own, equally long shard
    # (every step is a collective, so every rank must run the same number of steps).
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        (digits.data / 16.0).astype("float32"), digits.target.astype("int64"),
        test_size=0.2, random_state=args.seed, stratify=digits.target,
    )
    per_rank = len(x_train) // size
    x_train, y_train = x_train[rank::size][:per_rank], y_train[rank::size][:per_rank]
    train = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train))
        .shuffle(per_rank, seed=args.seed + rank, reshuffle_each_iteration=True)
        .batch(args.batch_size)
    )

    # Model and optimizer. Different initial weights per rank are fine: rank 0's are broadcast.
    keras.utils.set_random_seed(args.seed + rank)
    model = keras.Sequential([
        keras.Input(shape=(64,)),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10),
    ])
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(args.lr, momentum=0.9),
        density=args.density,
        sparsifier=args.sparsifier,
    )
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    # Start every rank from rank 0's state: the model's variables and the optimizer's (momentum,
    # iteration count), but not the error-feedback residuals, which are each rank's own.
    optimizer.build(model.trainable_variables)
    local = {id(v) for v in optimizer.local_variables}
    replicated = [v for v in optimizer.variables if id(v) not in local]
    sparse_hvd.broadcast_variables(model.variables + replicated, root_rank=0)

    # tf.function's options (Horovod's ops cannot be XLA-compiled); with exchange="auto" each
    # step runs a function traced for the exchange that step runs
    @sparse_hvd.function(optimizer, jit_compile=False, reduce_retracing=True)
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for epoch in range(args.epochs):
        losses = [float(train_step(x, y)) for x, y in train]
        if rank == 0 and (epoch + 1) % 5 == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: loss on rank 0's shard {np.mean(losses):.4f}",
                  flush=True)

    # Every rank evaluates the whole test set with the same weights.
    logits = model(x_test, training=False)
    test_loss = float(loss_fn(y_test, logits))
    test_accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))

    # The replicas must hold bit-identical weights: compare a hash of them across the ranks.
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in model.get_weights()))
    digests = [digest.hexdigest()]
    if size > 1:
        digests = hvd.allgather_object(digest.hexdigest(), name="custom_loop.weights_digest")
    identical = len(set(digests)) == 1

    stats = optimizer.communication_stats()
    if rank == 0:
        print(f"test accuracy: {test_accuracy:.4f}")
        print(f"test loss: {test_loss:.4f}")
        print(f"communication: sent {stats['bytes_sent']} bytes vs {stats['dense_bytes']} dense "
              f"({stats['dense_bytes'] / max(stats['bytes_sent'], 1):.1f}x less), "
              f"{stats['steps']} steps")
        print(f"replicas identical: {identical}", flush=True)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
