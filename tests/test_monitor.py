"""CommunicationLogger's records and the report built from them."""

import math

import keras
import numpy as np
import pytest

import sparse_hvd
from sparse_hvd import report
from helpers import classification_data, mlp


def _fit_with_logger(tmp_path, epochs=3, **logger_kwargs):
    model = mlp(input_dim=20, hidden=64, classes=5)
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), density=0.01)
    model.compile(optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    path = tmp_path / "comm.jsonl"
    logger = sparse_hvd.CommunicationLogger(path=str(path), **logger_kwargs)
    x, y = classification_data()
    model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, callbacks=[logger])
    return optimizer, path


def test_one_record_per_epoch_with_closed_form_bytes(tmp_path, capsys):
    optimizer, path = _fit_with_logger(tmp_path, per_layer=True)
    records = report.read(str(path))
    assert [r["epoch"] for r in records] == [0, 1, 2]
    sizes = [20 * 64, 64, 64 * 5, 5]
    sent = math.ceil(0.01 * sizes[0]) * 8 + sum(sizes[1:]) * 4
    for record in records:
        assert record["steps"] == 8
        assert record["bytes_sent_per_step"] == sent
        assert record["dense_bytes_per_step"] == sum(sizes) * 4
        assert record["compression"] == pytest.approx(sum(sizes) * 4 / sent)
        assert record["density_last_step"] == pytest.approx(13 / 1280)
        assert record["sparsify_ms_per_step"] > 0 and record["skipped_steps"] == 0
        assert len(record["layers"]) == 4
        assert record["update_factor"] == 1.0  # SGD without momentum: no larger step
    expected_norm = math.sqrt(sum(float((r.numpy().astype("float64") ** 2).sum()) for r in optimizer.residuals))
    assert records[-1]["residual_norm"] == pytest.approx(expected_norm)
    printed = capsys.readouterr().err
    assert printed.count("sparse_hvd: epoch") == 3 and "step factor" not in printed


def test_the_record_shows_the_factor_of_the_default_under_sgds_momentum(tmp_path, capsys):
    """Under SGD's momentum the default takes the sparse steps larger: each epoch's record and
    line show the factor of the next step (the pair's ``at_peak`` at a constant rate, once
    the ramp over the first quarter of the warm-up is done)."""
    model = mlp(input_dim=20, hidden=64, classes=5)
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), warmup_steps=8)
    model.compile(optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    path = tmp_path / "comm.jsonl"
    x, y = classification_data()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0,
              callbacks=[sparse_hvd.CommunicationLogger(path=str(path))])
    at_peak = sparse_hvd.selection.defaults.SGD_UPDATE_SCALE[0]
    assert [r["update_factor"] for r in report.read(str(path))] == pytest.approx([at_peak] * 2)
    assert capsys.readouterr().err.count(f"step factor {at_peak:.2f}") == 2


def test_report_prints_a_table_and_writes_a_plot(tmp_path, capsys):
    _, path = _fit_with_logger(tmp_path, epochs=2, verbose=False)
    assert report.main([str(path), "--out", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "B/step" in out and len(out.strip().splitlines()) >= 3
    assert out.strip().splitlines()[1].split()[-1] == "1.00"  # the factor
    older = [{k: v for k, v in r.items() if k != "update_factor"} for r in report.read(str(path))]
    assert report.table(older).splitlines()[1].split()[-1] == "-"  # a log from before it
    assert (tmp_path / "plots" / "communication.png").stat().st_size > 1000


def test_the_logger_needs_a_sparse_optimizer():
    model = mlp()
    model.compile(keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
    x, y = classification_data(n=16)
    with pytest.raises(ValueError, match="SparseDistributedOptimizer"):
        model.fit(x, np.zeros((16, 5)), epochs=1, verbose=0, callbacks=[sparse_hvd.CommunicationLogger()])


def test_tensorboard_scalars_match_the_records(tmp_path):
    import glob

    import tensorflow as tf

    _, path = _fit_with_logger(tmp_path, epochs=2, verbose=False, tensorboard_dir=str(tmp_path / "tb"))
    records = report.read(str(path))
    scalars = {}
    for event_file in glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(event_file):
            for value in event.summary.value:
                scalars[(value.tag, event.step)] = float(tf.make_ndarray(value.tensor))
    for record in records:
        for key in ("bytes_sent_per_step", "compression", "residual_norm", "density_last_step"):
            assert scalars[(f"sparse_hvd/{key}", record["epoch"])] == pytest.approx(record[key], rel=1e-6)
