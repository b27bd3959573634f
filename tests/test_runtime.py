"""Where a process stands in the job, with and without Horovod."""

import builtins

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from sparse_hvd.runtime import startup as runtime


@pytest.fixture
def no_horovod(monkeypatch):
    """Make `import horovod...` fail, as on a machine without Horovod."""
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "horovod" or name.startswith("horovod."):
            raise ImportError("No module named 'horovod'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    for var in runtime._LAUNCHER_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)


def test_without_horovod_a_plain_process_is_a_job_of_one(no_horovod):
    assert runtime.horovod() is None
    assert (sparse_hvd.size(), sparse_hvd.rank(), sparse_hvd.local_rank()) == (1, 0, 0)
    variable = keras.Variable(np.zeros((40, 40), "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(1.0), density=0.01)
    optimizer.apply_gradients([(tf.ones((40, 40)), variable)])
    assert np.count_nonzero(variable.numpy()) == 16


def test_without_horovod_a_launched_process_is_an_error(no_horovod, monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    with pytest.raises(ImportError, match="one of 4 workers.*horovod.tensorflow cannot be imported"):
        sparse_hvd.size()


def test_with_horovod_and_no_launcher_the_job_has_one_worker():
    if runtime.horovod() is None:
        pytest.skip("Horovod is not installed")
    assert sparse_hvd.size() == 1 and sparse_hvd.rank() == 0
