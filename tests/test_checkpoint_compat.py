"""Checkpoints written by an earlier version load, and training continues the same way.

Keras saves optimizer variables by position, so the order in which SparseDistributedOptimizer
creates them is a compatibility contract. tests/fixtures/checkpoints_v1/ holds ``.keras`` files
written by the code before the optimizer was split into one module per role (see
tests/fixtures/make_checkpoints.py): one per feature that adds optimizer variables (momentum
correction, staleness, the adaptive policy, an inner LossScaleOptimizer with a threshold).
"""

import os

import keras
import numpy as np
import pytest

from fixtures.make_checkpoints import BATCH, FOLDER, STEPS_AFTER, configurations, data

NAMES = sorted(configurations())


def _role(path):
    """What a variable is, without the names Keras numbers per process: "residual",
    "velocity", "delayed", "momentum", "iteration", ... (the last word of its path)."""
    return str(path).rsplit("/", 1)[-1].rsplit("_", 1)[-1]


@pytest.mark.parametrize("name", NAMES)
def test_a_checkpoint_of_the_earlier_version_restores_every_optimizer_variable(name):
    expected = np.load(os.path.join(FOLDER, f"{name}.npz"))
    loaded = keras.models.load_model(os.path.join(FOLDER, f"{name}.keras"))
    variables = loaded.optimizer.variables
    assert [_role(v.path) for v in variables] == [_role(p) for p in expected["paths"]]
    for position, variable in enumerate(variables):
        assert variable.dtype == expected[f"variable_{position}"].dtype, variable.path
        np.testing.assert_array_equal(variable.numpy(), expected[f"variable_{position}"],
                                      err_msg=f"optimizer variable #{position} {variable.path}")


@pytest.mark.parametrize("name", NAMES)
def test_training_resumed_from_the_earlier_version_continues_as_it_did_then(name):
    expected = np.load(os.path.join(FOLDER, f"{name}.npz"))
    loaded = keras.models.load_model(os.path.join(FOLDER, f"{name}.keras"))
    x, y = data(int(expected["seed"]) + 100, STEPS_AFTER)
    loaded.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for position, weight in enumerate(loaded.get_weights()):
        # tolerance only for matmul kernels that differ between CPUs; same CPU: same bits
        np.testing.assert_allclose(weight, expected[f"weight_{position}"], rtol=1e-5, atol=1e-7,
                                   err_msg=f"weight #{position} after {STEPS_AFTER} more steps")
