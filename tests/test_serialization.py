"""get_config/from_config, Keras saving and tf.train.Checkpoint keep the residuals."""

import keras
import numpy as np
import tensorflow as tf

import sparse_hvd
from helpers import classification_data, mlp, weights_of


def _compiled(model, optimizer):
    model.compile(
        optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    return model


def test_get_config_round_trips_with_the_inner_optimizer():
    inner = keras.optimizers.Adam(learning_rate=3e-4, beta_1=0.8)
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        inner, density=0.05, sparsifier="topk", min_elements=10, name="sparse"
    )
    config = optimizer.get_config()
    clone = sparse_hvd.SparseDistributedOptimizer.from_config(config)
    assert clone.get_config() == config
    assert isinstance(clone.inner_optimizer, keras.optimizers.Adam)
    assert clone.inner_optimizer.get_config() == inner.get_config()
    assert (clone.density, clone.min_elements, clone.name) == (0.05, 10, "sparse")
    assert isinstance(clone.sparsifier, sparse_hvd.TopK)


def test_keras_serialize_and_deserialize_by_registered_name():
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), density=0.02)
    serialized = keras.saving.serialize_keras_object(optimizer)
    assert serialized["registered_name"] == "sparse_hvd>SparseDistributedOptimizer"
    clone = keras.saving.deserialize_keras_object(serialized)
    assert isinstance(clone, sparse_hvd.SparseDistributedOptimizer)
    assert clone.get_config() == optimizer.get_config()


def _trained_model(tmp_path, epochs=2):
    model = _compiled(mlp(seed=4), sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), density=0.01))
    x, y = classification_data(seed=5)
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return model, x, y


def test_model_save_and_load_model_restore_residuals_and_continue_identically(tmp_path):
    model, x, y = _trained_model(tmp_path)
    optimizer = model.optimizer
    assert np.count_nonzero(optimizer.residuals[0].numpy()) > 0
    path = str(tmp_path / "model.keras")
    model.save(path)

    loaded = keras.models.load_model(path)
    restored = loaded.optimizer
    assert isinstance(restored, sparse_hvd.SparseDistributedOptimizer)
    assert restored.get_config() == optimizer.get_config()
    assert len(restored.variables) == len(optimizer.variables)
    for a, b in zip(optimizer.variables, restored.variables):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))
    for a, b in zip(optimizer.residuals, restored.residuals):
        np.testing.assert_array_equal(a.numpy(), b.numpy())

    # Both continue from the same state: same weights after more training, bit for bit.
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    loaded.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(weights_of(model), weights_of(loaded)):
        np.testing.assert_array_equal(a, b)


def test_tf_train_checkpoint_restores_residuals(tmp_path):
    model, x, y = _trained_model(tmp_path)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    path = checkpoint.save(str(tmp_path / "ckpt"))

    fresh = _compiled(mlp(seed=99), sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), density=0.01))
    fresh.optimizer.build(fresh.trainable_variables)
    tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(path).assert_existing_objects_matched()
    for a, b in zip(model.optimizer.residuals, fresh.optimizer.residuals):
        assert np.count_nonzero(a.numpy()) == np.count_nonzero(b.numpy())
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for a, b in zip(weights_of(model), weights_of(fresh)):
        np.testing.assert_array_equal(a, b)


def test_residuals_saved_by_more_workers_are_scaled_to_keep_their_sum(tmp_path, capsys):
    model = _compiled(mlp(seed=6), sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(1.0), density=0.01))
    x, y = classification_data(seed=7)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    model.optimizer.residual_world_size.assign(4)  # as if 4 workers had shared them
    saved = [r.numpy().copy() for r in model.optimizer.residuals]
    path = str(tmp_path / "four.keras")
    model.save(path)

    loaded = keras.models.load_model(path)
    before = weights_of(loaded)
    zeros = [tf.zeros_like(v) for v in loaded.trainable_variables]
    loaded.optimizer.apply_gradients(zip(zeros, loaded.trainable_variables))
    sent = before[0] - weights_of(loaded)[0]  # SGD at learning rate 1: the step is what was sent
    np.testing.assert_allclose(sent + loaded.optimizer.residuals[0].numpy(), 4 * saved[0], rtol=1e-6)
    assert int(loaded.optimizer.residual_world_size.numpy()) == 1
    assert "saved by 4 workers, restored on 1" in capsys.readouterr().err
