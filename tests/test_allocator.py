"""TensorFlow's CPU allocator under sparse_hvd (``sparse_hvd.runtime.allocator``): pooled unless
the environment chose, and a message when TensorFlow made it before sparse_hvd's import.

Each case runs in a fresh Python, since TensorFlow chooses its allocator once per process."""

import functools
import os
import subprocess
import sys
import textwrap

import pytest

from helpers import RecordedMessages

VARIABLE = "TF_CPU_ALLOCATOR_USE_BFC"
NOTE = "TensorFlow made its CPU allocator before sparse_hvd was imported"

# builds two optimizers with a sparse route (the message is said once) and prints the allocator
SCRIPT = """
import os, sys
import tensorflow as tf, keras
if sys.argv[1] == "tensorflow_first":
    tf.ones([4]).numpy()  # TensorFlow makes its CPU allocator here
import sparse_hvd
from sparse_hvd.runtime import allocator
for name in ("one", "two"):
    variable = keras.Variable(tf.zeros([64, 64]))
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), density=0.01,
                                                      name=name)
    optimizer.build([variable])
print("pooled", allocator.pooled_in_use(), "environment", os.environ.get(allocator.VARIABLE))
"""


def run(order, setting=None):
    environment = {k: v for k, v in os.environ.items()
                   if not k.startswith(("OMPI_", "PMI", "HOROVOD_", "SLURM_")) and k != VARIABLE}
    if setting is not None:
        environment[VARIABLE] = setting
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), order],
                            capture_output=True, text=True, env=environment, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip().splitlines()[-1], result.stderr


# TensorFlow alone, its own default allocator: whether it keeps statistics (on some machines
# TensorFlow's default CPU allocator is a pool of its own, which keeps them too)
BASELINE = """
import tensorflow as tf
tf.ones([4]).numpy()
try:
    tf.config.experimental.get_memory_info("CPU:0")
    print("pooled True")
except ValueError:
    print("pooled False")
"""


@functools.lru_cache(maxsize=None)
def default_is_pooled():
    """Whether TensorFlow's default CPU allocator on this machine keeps statistics, asked of
    TensorFlow without sparse_hvd and without the variable."""
    environment = {k: v for k, v in os.environ.items() if k != VARIABLE}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(BASELINE)],
                            capture_output=True, text=True, env=environment, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip().splitlines()[-1] == "pooled True"


def test_imported_with_tensorflow_and_keras_the_pooled_allocator_is_used_silently():
    line, errors = run("sparse_hvd_first")
    assert line == "pooled True environment true"
    assert NOTE not in errors


def test_the_users_choice_of_the_default_allocator_is_kept_silently():
    line, errors = run("sparse_hvd_first", setting="false")
    assert line == f"pooled {default_is_pooled()} environment false"
    assert NOTE not in errors


def test_an_allocator_made_before_the_import_is_named_once_with_the_remedy():
    line, errors = run("tensorflow_first")
    assert line == f"pooled {default_is_pooled()} environment true"
    if default_is_pooled():  # TensorFlow's own default pools here: nothing to say
        assert NOTE not in errors
    else:
        assert errors.count(NOTE) == 1, errors
        assert f"set {VARIABLE}=true in the job's environment" in errors


@pytest.mark.parametrize("pooled", [False, True])
def test_the_note_is_said_once_on_rank_0_when_the_allocator_in_use_is_not_pooled(pooled,
                                                                                  monkeypatch):
    """The message itself, on any machine: with the allocator's answer given."""
    from sparse_hvd.feedback.payload import Route
    from sparse_hvd.runtime import allocator, log, startup

    monkeypatch.setattr(allocator, "_state", allocator._State())
    monkeypatch.setattr(allocator, "pooled_in_use", lambda: pooled)
    monkeypatch.setattr(startup, "gpu_visible", lambda: False)
    monkeypatch.setattr(startup, "rank", lambda process_set=None: 0)
    routes = [Route(num_elements=4096, sparse=True, itemsize=4)]
    logger, handler = log.logger(), RecordedMessages()
    logger.addHandler(handler)
    try:
        allocator.note_if_unpooled(routes)
        allocator.note_if_unpooled(routes)
    finally:
        logger.removeHandler(handler)
    said = [message for message in handler.messages if NOTE in message]
    if pooled:
        assert said == []
    else:
        assert len(said) == 1 and f"set {VARIABLE}=true in the job's environment" in said[0]
