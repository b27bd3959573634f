"""sparse_hvd's messages go through the "sparse_hvd" logger: to stderr by default, to a user's
own handler when they add one, and not at all below the level they set."""

import logging

import keras
import numpy as np
import tensorflow as tf

import sparse_hvd
from helpers import RecordedMessages
from sparse_hvd.runtime import log


def _skip_a_step(traced):
    variable = keras.Variable(np.ones(2000, "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), density=0.05)
    grad = tf.constant(np.full(2000, np.nan, "float32"))
    step = lambda: optimizer.apply([grad], [variable])  # noqa: E731
    tf.function(step)() if traced else step()
    return optimizer


def test_a_skipped_step_is_logged_eagerly_and_from_a_traced_step(capsys):
    logger = log.logger()
    records = RecordedMessages()
    logger.addHandler(records)
    try:
        for traced in (False, True):
            assert _skip_a_step(traced).communication_stats()["skipped_steps"] == 1
    finally:
        logger.removeHandler(records)
    skipped = [m for m in records.messages if m.startswith("non-finite") and "skipped" in m]
    assert len(skipped) == 2, records.messages
    assert capsys.readouterr().err.count("sparse_hvd: non-finite") == 2  # the default handler


def test_the_level_set_on_the_logger_quiets_it(capsys):
    logger = log.logger()
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        _skip_a_step(traced=False)
    finally:
        logger.setLevel(level)
    assert "sparse_hvd:" not in capsys.readouterr().err
