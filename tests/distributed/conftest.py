"""Every test in this folder runs on every rank of a job started by tests/test_distributed.py.

Inputs depend on the rank, and each rank checks the result against a closed-form or
independently computed expectation, so the tests hold for any number of ranks.
"""

import hashlib

import numpy as np
import pytest

import sparse_hvd
import sparse_hvd.steps.measured as _measured

LIBRARY_FIRST_TRIAL_UNTIMED = _measured.FIRST_TRIAL_UNTIMED  # before any test changes it


@pytest.fixture(autouse=True)
def first_trial_like_the_others(monkeypatch):
    """``exchange="auto"``'s schedule tests count every trial's turns as ``TRIAL_STEPS``
    steps with one untimed; the job's first trial has longer turns by default
    (``FIRST_TRIAL_UNTIMED``), which ``tests/distributed/test_auto_exchange.py`` tests with
    the library's value (``LIBRARY_FIRST_TRIAL_UNTIMED``)."""
    monkeypatch.setattr(_measured, "FIRST_TRIAL_UNTIMED", 1)


@pytest.fixture(scope="session")
def hvd():
    module = sparse_hvd.init()
    assert module is not None, "these tests must be launched with mpirun or horovodrun"
    return module


def digest(arrays):
    """A hash of arrays' bytes: equal digests mean bit-identical arrays."""
    h = hashlib.sha256()
    for array in arrays:
        array = np.ascontiguousarray(array)
        h.update(str((array.shape, array.dtype)).encode())
        h.update(array.tobytes())
    return h.hexdigest()


def gather(hvd, obj, name):
    """Every rank's ``obj`` in rank order."""
    return hvd.allgather_object(obj, name=name)
