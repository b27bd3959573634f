"""Replicas stay identical: broadcast, model.fit with sparse exchange, metric averaging."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from conftest import digest, gather
from helpers import classification_data, each_ranks_inner_state, mlp, weights_of


def test_size_and_rank_agree_with_the_launcher(hvd):
    assert sparse_hvd.size() == hvd.size() >= 2
    assert sparse_hvd.rank() == hvd.rank()
    ranks = gather(hvd, sparse_hvd.rank(), name="replicas.ranks")
    assert ranks == list(range(hvd.size()))


def test_broadcast_variables_copies_the_root_ranks_values(hvd):
    rank, size = hvd.rank(), hvd.size()
    root = size - 1
    variables = [
        keras.Variable(np.full((3, 4), rank, "float32")),
        keras.Variable(np.arange(5, dtype="int64") * (rank + 1), dtype="int64"),
    ]
    sparse_hvd.broadcast_variables(variables, root_rank=root)
    np.testing.assert_array_equal(variables[0].numpy(), np.full((3, 4), root))
    np.testing.assert_array_equal(variables[1].numpy(), np.arange(5) * (root + 1))


def test_broadcast_and_average_trace_their_collectives_unconverted(hvd, monkeypatch):
    """The traced function behind broadcast_variables and average_variables runs as written:
    AutoGraph, which converted Horovod's Python and ours on the first call (most of the 7-8 s
    of a first broadcast at 2 ranks), never sees it (a converted function runs as
    ``tf__<name>``)."""
    import inspect

    from sparse_hvd.runtime import collectives

    callers = []

    def recording(collective):
        def record(*args, **kwargs):
            callers.append([frame.function for frame in inspect.stack()
                            if frame.function.startswith("tf__")])
            return collective(*args, **kwargs)
        return record

    for name in ("broadcast", "grouped_allreduce"):
        monkeypatch.setattr(collectives, name, recording(getattr(collectives, name)))
    rank = hvd.rank()
    variable = keras.Variable(np.full((2, 3), float(rank), "float32"))
    sparse_hvd.broadcast_variables([variable], root_rank=0, name="replicas.unconverted")
    np.testing.assert_array_equal(variable.numpy(), 0.0)
    sparse_hvd.average_variables([variable], name="replicas.unconverted.average")
    np.testing.assert_array_equal(variable.numpy(), 0.0)
    assert len(callers) == 2 and callers == [[], []], callers


OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(1e-3),
    "rmsprop": lambda: keras.optimizers.RMSprop(1e-3),
}


@pytest.mark.parametrize("name,grouping", [(n, "grouped") for n in sorted(OPTIMIZERS)] + [("adam", "layerwise")])
def test_model_fit_leaves_weights_bit_identical_on_every_rank(hvd, name, grouping):
    rank = hvd.rank()
    model = mlp(seed=100 + rank)  # different initial weights on purpose: the callback syncs them
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        OPTIMIZERS[name](), density=0.01, grouping=grouping, name=f"fit_{name}_{grouping}")
    model.compile(
        optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False
    )
    x, y = classification_data(n=96, seed=rank)  # each rank its own data
    history = model.fit(
        x, y, batch_size=16, epochs=2, verbose=0,
        callbacks=[sparse_hvd.BroadcastGlobalVariablesCallback(0), sparse_hvd.MetricAverageCallback()],
    )
    digests = gather(hvd, digest(weights_of(model)), name=f"fit.digest.{name}.{grouping}")
    assert len(set(digests)) == 1, f"replicas differ after fit: {digests}"
    losses = gather(hvd, history.history["loss"], name=f"fit.loss.{name}.{grouping}")
    assert all(l == losses[0] for l in losses), "averaged metrics differ between ranks"
    stats = optimizer.communication_stats()
    assert stats["steps"] == 12 and 0 < stats["bytes_sent"] < stats["dense_bytes"]
    # the optimizer's replicated state (the step counts, the learning rate) is identical too;
    # with sparsify="update" (the default of every optimizer here, as each keeps a state) the
    # inner optimizer's momentum or moments are each rank's own
    own = each_ranks_inner_state(optimizer)
    replicated = [keras.ops.convert_to_numpy(v) for v in optimizer.variables
                  if all(v is not r for r in [*optimizer.local_variables, *own])]
    assert len(set(gather(hvd, digest(replicated), name=f"fit.opt.{name}.{grouping}"))) == 1
    assert optimizer.sparsify == "update"
    if own:  # each rank's moments followed its own data
        mine = [keras.ops.convert_to_numpy(v) for v in own]
        assert len(set(gather(hvd, digest(mine), name=f"fit.own.{name}.{grouping}"))) == hvd.size()


def test_metric_average_callback_averages_every_numeric_log(hvd):
    rank, size = hvd.rank(), hvd.size()
    callback = sparse_hvd.MetricAverageCallback()
    logs = {"loss": float(rank + 1), "accuracy": 2.0 * rank, "note": "text stays"}
    callback.on_epoch_end(0, logs)
    assert logs["loss"] == pytest.approx((size + 1) / 2)
    assert logs["accuracy"] == pytest.approx(size - 1)
    assert logs["note"] == "text stays"


def test_a_model_that_differs_in_shape_fails_on_every_rank(hvd):
    rank = hvd.rank()
    model = mlp(hidden=64 if rank == 0 else 65)
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), name="shape_mismatch")
    with pytest.raises(ValueError, match=r"differ between ranks.*variable #0.*\(20, 64\).*rank 0.*\(20, 65\) float32 on rank 1"):
        optimizer.build(model.trainable_variables)


def test_a_model_that_differs_in_variable_count_fails_on_every_rank(hvd):
    rank = hvd.rank()
    layers = [keras.Input((8,)), keras.layers.Dense(4)]
    if rank == 1:
        layers.append(keras.layers.Dense(4))
    model = keras.Sequential(layers)
    model.compile(
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), name="count_mismatch"),
        loss="mse", jit_compile=False,
    )
    x, y = np.zeros((8, 8), "float32"), np.zeros((8, 4), "float32")
    with pytest.raises(ValueError, match="differ between ranks.*rank 0 has 2 variables, rank 1 has 4"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[sparse_hvd.BroadcastGlobalVariablesCallback(0)])


def test_different_optimizer_settings_fail_on_every_rank(hvd):
    variable = keras.Variable(np.zeros((40, 40), "float32"))
    density = 0.01 if hvd.rank() == 0 else 0.02
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), density=density, name="settings_mismatch")
    with pytest.raises(ValueError, match="differ between ranks.*density is 0.01 on rank 0 but 0.02 on rank 1"):
        optimizer.build([variable])


def test_optimizers_named_differently_fail_on_every_rank_instead_of_hanging(hvd):
    """An extra optimizer created on rank 0 only shifts Keras' automatic names there; the
    collectives are named after the optimizer, so the build check (whose own name is fixed)
    must say so rather than wait for a name the other rank never uses."""
    if hvd.rank() == 0:
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1))  # never used
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1))
    names = hvd.allgather_object(optimizer.name)
    assert names[0] != names[1]
    with pytest.raises(ValueError, match=rf"differ between ranks.*name is '{names[0]}' on rank 0 "
                                         rf"but '{names[1]}' on rank 1.*pass name=\.\.\. explicitly"):
        optimizer.build([keras.Variable(np.zeros((40, 40), "float32"))])


def _batchnorm_model(rank):
    keras.utils.set_random_seed(rank)
    return keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.BatchNormalization(), keras.layers.Dropout(0.2), keras.layers.Flatten(),
        keras.layers.Dense(10),
    ])


def test_average_non_trainable_callback_makes_batchnorm_statistics_identical(hvd):
    rank, size = hvd.rank(), hvd.size()
    model = _batchnorm_model(rank)
    model.compile(
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.Adam(1e-3), name="bn_fit"),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False,
    )
    rng = np.random.RandomState(rank)
    x, y = rng.randn(64, 8, 8, 1).astype("float32"), rng.randint(0, 10, 64)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[
        sparse_hvd.BroadcastGlobalVariablesCallback(0), sparse_hvd.AverageNonTrainableCallback()])
    digests = gather(hvd, digest(weights_of(model)), name="bn.digest")
    assert len(set(digests)) == 1, "replicas differ after fit with BatchNormalization"


def test_average_variables_is_the_mean_over_ranks(hvd):
    rank, size = hvd.rank(), hvd.size()
    variable = keras.Variable(np.full((3,), float(rank), "float32"))
    sparse_hvd.average_variables([variable])
    np.testing.assert_allclose(variable.numpy(), np.full((3,), (size - 1) / 2), rtol=1e-7)
    with pytest.raises(TypeError, match="only floating-point variables"):
        sparse_hvd.average_variables([keras.Variable(np.zeros(2, "int32"), dtype="int32")])


@pytest.mark.parametrize("exchange,bad", [(None, np.nan), ("dense", np.nan), ("dense", -np.inf),
                                          ("allgather", np.inf)])
def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank(hvd, exchange, bad):
    """With the default (auto: its first steps run dense), the dense allreduce (the native
    divide-and-check on a CPU) and the allgather."""
    rank = hvd.rank()
    variable = keras.Variable(np.zeros((50, 40), "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.5), exchange=exchange,
        name=f"nonfinite_ranks_{exchange}_{str(bad).replace('-', 'minus_')}")
    step = tf.function(lambda g: optimizer.apply_gradients([(g, variable)]))
    rng = np.random.RandomState(rank)
    step(tf.constant(rng.randn(50, 40).astype("float32")))
    before = (variable.numpy().copy(), optimizer.residuals[0].numpy().copy())
    grad = rng.randn(50, 40).astype("float32")
    if rank == hvd.size() - 1:
        grad[1, 2] = bad
    step(tf.constant(grad))
    np.testing.assert_array_equal(variable.numpy(), before[0])
    np.testing.assert_array_equal(optimizer.residuals[0].numpy(), before[1])
    assert optimizer.communication_stats()["skipped_steps"] == 1
    assert int(optimizer.iterations) == 1
    assert len(set(gather(hvd, digest([variable.numpy()]), name=f"{optimizer.name}.digest"))) == 1


@pytest.mark.parametrize("inner", ["momentum", "adam_signs"])
def test_share_residuals_makes_them_the_mean_and_resuming_continues_exactly(hvd, tmp_path_factory,
                                                                            inner):
    """SGD's momentum with top-k; Adam with the signs and the noise estimate, whose q is each
    rank's own too."""
    rank, size = hvd.rank(), hvd.size()
    rng = np.random.RandomState(rank)
    x, y = rng.randn(64, 20).astype("float32"), rng.randint(0, 5, 64)

    def compiled(model):
        optimizer = (sparse_hvd.SparseDistributedOptimizer(
            keras.optimizers.SGD(0.05, momentum=0.9), name="resume") if inner == "momentum"
            else sparse_hvd.SparseDistributedOptimizer(
                keras.optimizers.Adam(0.01), exchange="sign", name="resume"))
        model.compile(optimizer, jit_compile=False,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    callbacks = [sparse_hvd.BroadcastGlobalVariablesCallback(0), sparse_hvd.ShareResidualsCallback()]
    model = compiled(mlp(seed=rank))
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    mine = model.optimizer.residuals[0].numpy()
    everyone = gather(hvd, digest([mine]), name="resume.shared")
    assert len(set(everyone)) == 1, "shared residuals differ between ranks"
    assert np.count_nonzero(mine) > 0
    # SGD's momentum is each rank's own with the default sparsify="update": shared as well
    velocities = [v.numpy() for v in each_ranks_inner_state(model.optimizer)]
    assert velocities and all(np.count_nonzero(v) > 0 for v in velocities)
    assert len(set(gather(hvd, digest(velocities), name="resume.velocities"))) == 1
    explained = [q.numpy() for q in model.optimizer._second_moment.variables]
    if inner == "adam_signs":  # the noise estimate's q, shared too
        assert model.optimizer.second_moment == "noise_estimate"
        cut = [q for q, route in zip(explained, model.optimizer._routes) if route.sparse]
        assert cut and all(np.count_nonzero(q) > 0 for q in cut)
    assert len(set(gather(hvd, digest(explained), name="resume.explained"))) == 1

    directory = gather(hvd, str(tmp_path_factory.mktemp("resume")), name="resume.dir")[0]
    path = f"{directory}/epoch1.keras"
    if rank == 0:
        model.save(path)
    gather(hvd, "saved", name="resume.barrier")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=callbacks[1:])
    uninterrupted = weights_of(model)

    resumed = keras.models.load_model(path)
    resumed.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    for a, b in zip(uninterrupted, weights_of(resumed)):
        np.testing.assert_array_equal(a, b)
