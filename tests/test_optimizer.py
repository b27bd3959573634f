"""Single-process behaviour of SparseDistributedOptimizer (a job of one: no collective runs)."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from helpers import classification_data, mlp, numpy_topk_indices, numpy_topk_split, weights_of

SHAPE = (50, 40)  # 2000 entries: above min_elements, so the sparse route is taken


def _step_function(optimizer, variable, mode):
    def step(grad):
        optimizer.apply_gradients([(grad, variable)])

    return tf.function(step) if mode == "function" else step


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("density", [0.01, 0.1, 0.3])
def test_each_step_sends_the_topk_of_the_compensated_gradient(mode, density):
    """A NumPy re-computation of error feedback, step by step, bit for bit.

    With plain SGD at learning rate 1 the variable moves by exactly what was sent.
    """
    rng = np.random.RandomState(7)
    start = rng.randn(*SHAPE).astype("float32")
    variable = keras.Variable(start)
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(1.0), density=density)
    step = _step_function(optimizer, variable, mode)
    k = math.ceil(density * start.size)

    expected_variable, residual = start.copy(), np.zeros(start.size, "float32")
    for _ in range(12):
        grad = rng.randn(*SHAPE).astype("float32")
        step(tf.constant(grad))
        compensated = grad.ravel() + residual
        _, sent, residual = numpy_topk_split(compensated, k)
        expected_variable = (expected_variable.ravel() - sent).reshape(SHAPE)

        np.testing.assert_array_equal(variable.numpy(), expected_variable)
        np.testing.assert_array_equal(optimizer.residuals[0].numpy().ravel(), residual)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_everything_sent_plus_final_residual_equals_the_sum_of_gradients(mode):
    rng = np.random.RandomState(3)
    start = rng.randn(*SHAPE).astype("float64")
    variable = keras.Variable(start, dtype="float64")
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(1.0), density=0.005)
    step = _step_function(optimizer, variable, mode)
    total = np.zeros(SHAPE)
    for _ in range(200):
        grad = rng.standard_cauchy(SHAPE)  # heavy tails: some entries wait many steps
        total += grad
        step(tf.constant(grad))
    sent = start - variable.numpy()
    residual = optimizer.residuals[0].numpy()
    assert np.count_nonzero(residual) > 0
    np.testing.assert_allclose(sent + residual, total, rtol=1e-9, atol=1e-9)


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.05),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(1e-3),
    "adamw": lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.01),
    "rmsprop": lambda: keras.optimizers.RMSprop(1e-3),
}


def _fit(model, optimizer, epochs=2):
    x, y = classification_data()
    model.compile(
        optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return weights_of(model)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_density_one_gives_exactly_the_inner_optimizers_result(name):
    plain = _fit(mlp(seed=1), OPTIMIZERS[name]())
    wrapped_optimizer = sparse_hvd.SparseDistributedOptimizer(OPTIMIZERS[name](), density=1.0)
    wrapped = _fit(mlp(seed=1), wrapped_optimizer)
    for a, b in zip(plain, wrapped):
        np.testing.assert_array_equal(a, b)
    assert all(np.count_nonzero(r.numpy()) == 0 for r in wrapped_optimizer.residuals)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sparse_training_with_each_inner_optimizer_moves_every_layer_and_keeps_residuals(name):
    model = mlp(seed=2)
    before = weights_of(model)
    optimizer = sparse_hvd.SparseDistributedOptimizer(OPTIMIZERS[name](), density=0.01)
    after = _fit(model, optimizer, epochs=1)
    assert all(np.all(np.isfinite(w)) for w in after)
    assert all(not np.array_equal(a, b) for a, b in zip(before, after))
    # only the first kernel (20*64 = 1280 entries) is large enough to be sparsified
    nonzero = [np.count_nonzero(r.numpy()) for r in optimizer.residuals]
    assert nonzero[0] > 0 and nonzero[1:] == [0, 0, 0]
    assert int(optimizer.iterations) == 8


def test_communication_stats_count_values_indices_and_dense_fallbacks():
    model = mlp(input_dim=20, hidden=64, classes=5)
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), density=0.01)
    assert optimizer.communication_stats() == {
        "steps": 0, "bytes_sent": 0, "dense_bytes": 0, "capped_selections": 0, "skipped_steps": 0,
        "sparsify_seconds": 0.0, "exchange_seconds": 0.0, "measurement_bytes": 0,
        "update_factor": 1.0}
    _fit(model, optimizer, epochs=1)  # 128 samples / 16 = 8 steps
    sizes = [20 * 64, 64, 64 * 5, 5]
    k_first = math.ceil(0.01 * sizes[0])
    per_step_sent = k_first * (4 + 4) + sum(sizes[1:]) * 4
    stats = optimizer.communication_stats()
    assert stats.pop("sparsify_seconds") > 0 and stats.pop("exchange_seconds") >= 0
    assert stats == {
        "steps": 8,
        "bytes_sent": 8 * per_step_sent,
        "dense_bytes": 8 * sum(sizes) * 4,
        "capped_selections": 0,
        "skipped_steps": 0,
        "measurement_bytes": 0,  # a constant density measures nothing
        "update_factor": 1.0,  # SGD without momentum: no larger step
    }
    layers = optimizer.layer_stats()
    assert [v["route"] for v in layers.values()] == ["sparse", "dense", "dense", "dense"]
    assert [v["last_sent"] for v in layers.values()] == [k_first] + sizes[1:]


def test_min_elements_and_the_size_rule_choose_the_dense_route():
    variable = keras.Variable(np.ones(SHAPE, "float32"))
    grad = tf.constant(np.random.RandomState(0).randn(*SHAPE).astype("float32"))
    # density 0.5: 8 bytes per (value, index) pair x 1000 >= 4 bytes x 2000: larger sparse than dense
    for kwargs in ({"density": 0.5, "min_elements": 0}, {"density": 0.01, "min_elements": 2001}):
        optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(1.0), **kwargs)
        variable.assign(np.ones(SHAPE, "float32"))
        optimizer.apply_gradients([(grad, variable)])
        np.testing.assert_array_equal(variable.numpy(), 1.0 - grad.numpy())
        assert np.count_nonzero(optimizer.residuals[0].numpy()) == 0


def test_none_gradients_are_skipped():
    used = keras.Variable(np.zeros(SHAPE, "float32"))
    unused = keras.Variable(np.ones(SHAPE, "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(1.0), density=0.01)
    grad = tf.constant(np.arange(2000, dtype="float32").reshape(SHAPE))
    optimizer.apply([grad, None], [used, unused])
    np.testing.assert_array_equal(unused.numpy(), np.ones(SHAPE))
    assert np.count_nonzero(used.numpy()) == 20
    assert np.count_nonzero(optimizer.residuals[1].numpy()) == 0
    assert optimizer.communication_stats()["dense_bytes"] == 2000 * 4


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_indexed_slices_gradients_of_an_embedding_are_sparsified(mode):
    keras.utils.set_random_seed(0)
    embedding = keras.layers.Embedding(200, 16)  # 3200 entries
    embedding.build((None, 4))
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(1.0), density=0.01)
    ids = tf.constant([[1, 5, 5, 9], [9, 9, 3, 1]])
    weights = tf.constant(np.random.RandomState(1).randn(2, 4, 16).astype("float32"))

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(embedding(ids) * weights)
        (grad,) = tape.gradient(loss, embedding.trainable_variables)
        optimizer.apply_gradients([(grad, embedding.embeddings)])
        return grad

    before = embedding.embeddings.numpy()
    grad = (tf.function(step) if mode == "function" else step)()
    assert isinstance(grad, tf.IndexedSlices)
    dense = np.zeros((200, 16), "float32")
    np.add.at(dense, grad.indices.numpy(), grad.values.numpy())
    chosen = numpy_topk_indices(dense.ravel(), 32)
    expected = before.ravel().copy()
    expected[chosen] -= dense.ravel()[chosen]
    np.testing.assert_allclose(embedding.embeddings.numpy().ravel(), expected, rtol=1e-6)


@pytest.mark.convergence_defaults  # the default exchange, "auto", whose timer met them
def test_row_gradients_whose_shape_is_a_python_tuple_are_applied_as_rows():
    """Keras builds row gradients with ``dense_shape`` a tuple (its own optimizer tests do); the
    default exchange's timer once passed them to ``tf.nest.flatten(...,
    expand_composites=True)``, which fails on them."""
    table = keras.Variable(np.zeros((30, 4), "float32"))  # 120 entries: dense route
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(1.0))
    values = np.arange(12, dtype="float32").reshape(3, 4)
    optimizer.apply_gradients([(tf.IndexedSlices(tf.constant(values), (2, 7, 7), (30, 4)), table)])
    expected = np.zeros((30, 4), "float32")
    np.add.at(expected, [2, 7, 7], -values)
    np.testing.assert_array_equal(table.numpy(), expected)


def test_variables_not_given_at_build_are_refused():
    a = keras.Variable(np.zeros(SHAPE, "float32"))
    b = keras.Variable(np.zeros(SHAPE, "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(1.0))
    optimizer.build([a])
    with pytest.raises(ValueError, match="[Uu]nknown variable"):
        optimizer.apply([tf.ones(SHAPE)], [b])


def test_learning_rate_and_iterations_are_the_inner_optimizers():
    inner = keras.optimizers.SGD(0.25)
    optimizer = sparse_hvd.SparseDistributedOptimizer(inner)
    assert float(optimizer.learning_rate) == 0.25
    optimizer.learning_rate = 0.5
    assert float(inner.learning_rate) == 0.5
    variable = keras.Variable(np.zeros(SHAPE, "float32"))
    optimizer.apply_gradients([(tf.ones(SHAPE), variable)])
    assert int(optimizer.iterations) == int(inner.iterations) == 1


def _embedding_model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((12,), dtype="int32")
    x = keras.layers.Flatten()(keras.layers.Embedding(500, 32)(inputs))
    return keras.Model(inputs, keras.layers.Dense(3)(x))


@pytest.mark.parametrize("name", ["sgd_momentum", "adam", "rmsprop"])
def test_density_one_with_an_embedding_keeps_row_sparse_updates_exactly(name):
    """Keras optimizers update only the rows an IndexedSlices gradient has (Adam's moments of
    other rows do not decay); at density 1 the embedding's rows reach the inner optimizer as
    rows, so the result is the inner optimizer's, bit for bit."""
    rng = np.random.RandomState(0)
    x, y = rng.randint(0, 500, (64, 12)), rng.randint(0, 3, 64)
    results = []
    for optimizer in (OPTIMIZERS[name](), sparse_hvd.SparseDistributedOptimizer(OPTIMIZERS[name](), density=1.0)):
        model = _embedding_model()
        model.compile(optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False)
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        results.append(weights_of(model))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_the_wrapper_runs_unconverted_by_autograph_in_a_custom_loop():
    """In a user's ``tf.function`` (AutoGraph on), the wrapper's step runs as written, as it
    does under ``model.fit``: none of its functions is converted (a converted function runs as
    a generated ``tf__<name>``), only the user's own step is."""
    import inspect

    from sparse_hvd.selection.sparsifiers import topk

    converted = []

    class Recording(sparse_hvd.Sparsifier):
        def __call__(self, flat, k):
            converted.append([frame.function for frame in inspect.stack()
                              if frame.function.startswith("tf__")])
            return topk(flat, k)

    variable = keras.Variable(np.zeros(SHAPE, "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(
        keras.optimizers.SGD(0.1), density=0.1, sparsifier=Recording(), warmup_steps=0)

    @tf.function
    def train_step(gradient):
        optimizer.apply([gradient], [variable])

    train_step(tf.ones(SHAPE))  # traced twice: the first trace creates the optimizer's variables
    assert converted and all(names == ["tf__train_step"] for names in converted), converted
