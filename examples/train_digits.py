"""Data-parallel ``model.fit`` with sparse gradient exchange: scikit-learn's handwritten digits.

What it shows:

* the one-line change that turns a Keras training script into a sparse data-parallel one::

      optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9),
                                                        density=0.01)

* the two callbacks that keep the replicas in step (initial weights broadcast from rank 0,
  per-epoch metrics averaged over the ranks);
* that sending 1% of each large gradient (top-k with error feedback) still trains the model:
  each worker sees only its shard of the data, yet the test accuracy matches dense training;
* how many bytes the exchange saved, and that every replica ends with bit-identical weights.

The data (1797 8x8 images, ``sklearn.datasets.load_digits``) ships inside scikit-learn: nothing
is downloaded.

Launch (each worker is one process; 2 workers on one machine):

    horovodrun -np 2 python examples/train_digits.py
    mpirun -np 2 --bind-to none python examples/train_digits.py
    sbatch scripts/slurm/train_digits.sbatch           # Slurm: srun --mpi=pmix, or mpirun
    python examples/train_digits.py                    # a single worker, no launcher needed
    bash scripts/demo.sh                               # set-up + a 2-worker run

Options: ``--epochs``, ``--batch-size`` (per worker), ``--lr``, ``--density``, ``--sparsifier``,
``--seed``, ``--json PATH`` (rank 0 writes the results there).

Checkpoints (``--checkpoint-dir DIR``, ``--resume``): only rank 0 writes, once per epoch, the
whole model (weights, optimizer state, residuals) to ``DIR/epoch-NNN.keras``. Residuals are
each rank's own, so ``sparse_hvd.ShareResidualsCallback`` runs on every rank just before: it
makes every rank's residuals their mean, and rank 0's file then stands for all of them. With
``--resume`` every rank loads the latest checkpoint rank 0 finds there and training continues
from its epoch up to ``--epochs`` (the total, as Keras counts); without a checkpoint it starts
afresh, so a requeued batch job can always pass ``--resume``. DIR must be visible to every rank
(a shared file system on a cluster)::

    mpirun -np 2 python examples/train_digits.py --epochs 10 --checkpoint-dir ckpt
    mpirun -np 2 python examples/train_digits.py --epochs 20 --checkpoint-dir ckpt --resume
"""

import argparse
import hashlib
import json
import os
import re
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported: hide its noise

import sparse_hvd  # noqa: E402

# Start Horovod (and pin one GPU per worker, if any) before TensorFlow touches the devices.
sparse_hvd.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--density", type=float, default=0.01,
                        help="fraction of each large gradient a worker sends per step")
    parser.add_argument("--sparsifier", default="topk",
                        help=f"one of: {', '.join(sparse_hvd.available_sparsifiers())}")
    parser.add_argument("--compression", default="none", choices=("none", "float16", "bfloat16"),
                        help="values on the wire as 16-bit floats, the rounding kept in the residual")
    parser.add_argument("--backward-passes", type=int, default=1, metavar="B",
                        help="backward_passes_per_step: B batches accumulated per exchange")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", metavar="PATH", help="rank 0 writes the results here")
    parser.add_argument("--comm-log", metavar="PATH",
                        help="rank 0 logs communication per epoch here (JSON lines; "
                             "python -m sparse_hvd.report PATH makes a table and plots)")
    parser.add_argument("--checkpoint-dir", metavar="DIR",
                        help="rank 0 saves the model with its optimizer state and residuals "
                             "there after every epoch (DIR/epoch-NNN.keras)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in --checkpoint-dir (model, "
                             "optimizer and its settings as saved) up to --epochs in total; "
                             "start afresh if there is none")
    args = parser.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    return args


def load_data(seed, rank, size):
    """This rank's shard of the training set, and the whole test set (same split on every rank)."""
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")  # pixels are 0..16
    y = digits.target.astype("int64")
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=seed, stratify=y
    )
    # Every rank must run the same number of steps (each step is a collective), so every shard
    # gets the same number of examples: rank::size striding, cut to the shortest shard's length.
    per_rank = len(x_train) // size
    x_train = x_train[rank::size][:per_rank]
    y_train = y_train[rank::size][:per_rank]
    return (x_train, y_train), (x_test, y_test)


def build_model():
    """An MLP whose two large kernels (32768 and 131072 entries) are exchanged sparsely."""
    return keras.Sequential(
        [
            keras.Input(shape=(64,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


CHECKPOINT_NAME = re.compile(r"^epoch-(\d+)\.keras$")


class EpochCheckpoint(keras.callbacks.Callback):
    """Save the whole model to ``directory/epoch-NNN.keras`` after every epoch (NNN from 1).

    Give it to rank 0 only, after ``ShareResidualsCallback`` (which every rank runs). The file is
    written under a temporary name and then renamed: a job killed while saving (its time limit,
    a lost node) or a full disk leaves the previous checkpoint as the latest, never a truncated
    one.
    """

    def __init__(self, directory):
        super().__init__()
        self.directory = directory

    def on_epoch_end(self, epoch, logs=None):
        name = f"epoch-{epoch + 1:03d}.keras"
        partial = os.path.join(self.directory, f".partial-{name}")
        try:
            self.model.save(partial)
        except BaseException:  # e.g. a full disk: leave no partial file behind, then fail
            if os.path.exists(partial):
                os.remove(partial)
            raise
        os.replace(partial, os.path.join(self.directory, name))


def latest_checkpoint(directory):
    """(epoch, path) of the newest ``epoch-NNN.keras`` in ``directory``, or None."""
    found = []
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            match = CHECKPOINT_NAME.match(name)
            if match:
                found.append((int(match.group(1)), os.path.join(directory, name)))
    return max(found) if found else None


def checkpoint_to_resume(directory, rank, size):
    """The checkpoint every rank resumes from: the one rank 0 sees as the latest.

    Rank 0 decides and tells the others, so that every rank loads the same file even where a
    shared file system shows a new file to some nodes later than to others.
    """
    mine = latest_checkpoint(directory) if rank == 0 else None
    if size == 1:
        return mine
    import horovod.tensorflow as hvd

    return hvd.allgather_object(mine, name="train_digits.checkpoint")[0]


def weights_digest(model):
    """A SHA-256 of every weight's bytes, in order."""
    digest = hashlib.sha256()
    for weight in model.get_weights():
        digest.update(np.ascontiguousarray(weight).tobytes())
    return digest.hexdigest()


def replicas_identical(model, size):
    """True on every rank when all ranks hold bit-identical weights."""
    mine = weights_digest(model)
    if size == 1:
        return True
    import horovod.tensorflow as hvd

    return len(set(hvd.allgather_object(mine, name="train_digits.weights_digest"))) == 1


def main(argv=None):
    args = parse_args(argv)
    rank, size = sparse_hvd.rank(), sparse_hvd.size()
    started = time.perf_counter()

    (x_train, y_train), (x_test, y_test) = load_data(args.seed, rank, size)
    # A different seed per rank is fine: BroadcastGlobalVariablesCallback copies rank 0's
    # initial weights to everyone. It also makes each rank shuffle its shard differently.
    keras.utils.set_random_seed(args.seed + rank)
    resume_from = checkpoint_to_resume(args.checkpoint_dir, rank, size) if args.resume else None
    if resume_from:
        # Weights, the optimizer with its settings, momentum and residuals (rank 0's, which
        # ShareResidualsCallback made stand for every rank), and the compile options, as saved.
        initial_epoch, path = resume_from
        model = keras.models.load_model(path)
        optimizer = model.optimizer
        config = optimizer.get_config()
        density, sparsifier = config["density"], config["sparsifier"]
        lr = float(optimizer.learning_rate)
    else:
        initial_epoch = 0
        model = build_model()
        optimizer = sparse_hvd.SparseDistributedOptimizer(
            keras.optimizers.SGD(args.lr, momentum=0.9),
            density=args.density,
            sparsifier=args.sparsifier,
            compression=args.compression,
            backward_passes_per_step=args.backward_passes,
        )
        model.compile(
            optimizer=optimizer,
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
            jit_compile=False,  # Horovod's collectives cannot be XLA-compiled
        )
        density, sparsifier, lr = args.density, args.sparsifier, args.lr
    if rank == 0:
        print(f"{size} worker(s), {len(x_train)} training examples each, "
              f"{model.count_params()} parameters, density {density} ({sparsifier})",
              flush=True)

    callbacks = [
        sparse_hvd.BroadcastGlobalVariablesCallback(root_rank=0),  # first
        sparse_hvd.MetricAverageCallback(),
        sparse_hvd.ExchangeChoiceCallback(),  # exchange="auto": its choice traced alone
    ] + ([sparse_hvd.CommunicationLogger(path=args.comm_log)] if args.comm_log else [])
    if args.checkpoint_dir:
        # Every rank: residuals become their mean over the ranks (a collective) ...
        callbacks.append(sparse_hvd.ShareResidualsCallback())
        if rank == 0:
            # ... then rank 0 alone writes, and its file stands for every rank.
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            callbacks.append(EpochCheckpoint(args.checkpoint_dir))
            if resume_from and initial_epoch < args.epochs:
                print(f"resuming from {resume_from[1]}: epochs {initial_epoch + 1} to {args.epochs}",
                      flush=True)
            elif resume_from:
                print(f"resuming from {resume_from[1]}: its {initial_epoch} epochs reach --epochs "
                      f"{args.epochs}, nothing left to train", flush=True)
            elif args.resume:
                print(f"no checkpoint in {args.checkpoint_dir}: starting at epoch 1", flush=True)
            print(f"checkpoints: rank 0 writes {os.path.join(args.checkpoint_dir, 'epoch-NNN.keras')} "
                  f"after every epoch", flush=True)

    model.fit(
        x_train,
        y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        initial_epoch=initial_epoch,
        callbacks=callbacks,
        verbose=2 if rank == 0 else 0,
    )

    # Every rank evaluates the whole test set with the same weights: the same result everywhere.
    test_loss, test_accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    stats = optimizer.communication_stats()
    identical = replicas_identical(model, size)
    elapsed = time.perf_counter() - started

    if rank == 0:
        ratio = stats["dense_bytes"] / max(stats["bytes_sent"], 1)
        print(f"test accuracy: {test_accuracy:.4f}")
        print(f"test loss: {test_loss:.4f}")
        print(f"communication: sent {stats['bytes_sent']} bytes vs {stats['dense_bytes']} dense "
              f"({ratio:.1f}x less), {stats['steps']} steps")
        print(f"replicas identical: {identical}")
        print(f"time: {elapsed:.1f} s", flush=True)
        if args.json:
            result = {
                "test_accuracy": float(test_accuracy),
                "test_loss": float(test_loss),
                "communication": stats,
                "compression": ratio,
                "replicas_identical": identical,
                "size": size,
                "density": density,
                "sparsifier": sparsifier,
                "value_compression": args.compression,
                "backward_passes_per_step": args.backward_passes,
                "epochs": args.epochs,
                "batch_size": args.batch_size,
                "lr": lr,
                "seed": args.seed,
                "seconds": elapsed,
            }
            directory = os.path.dirname(os.path.abspath(args.json))
            os.makedirs(directory, exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
                f.write("\n")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
