"""Only rank 0 logs: CommunicationLogger writes and prints nothing on the other ranks."""

import keras

import sparse_hvd
from conftest import gather
from helpers import classification_data, mlp


def test_only_rank_0_writes_and_prints(hvd, tmp_path, capsys):
    rank = hvd.rank()
    model = mlp(seed=1)
    model.compile(sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), density=0.01,
                                                        name="logging_opt"),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    x, y = classification_data(n=64, seed=rank)
    path = tmp_path / "comm.jsonl"
    model.fit(x, y, batch_size=16, epochs=2, verbose=0,
              callbacks=[sparse_hvd.BroadcastGlobalVariablesCallback(0),
                         sparse_hvd.CommunicationLogger(path=str(path))])
    printed = capsys.readouterr().err.count("sparse_hvd: epoch")
    lines = len(path.read_text().splitlines()) if path.exists() else 0
    everyone = gather(hvd, (printed, lines), name="logging.counts")
    assert everyone[0] == (2, 2)
    assert all(counts == (0, 0) for counts in everyone[1:])
