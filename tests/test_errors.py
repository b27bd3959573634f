"""Bad input gets a clear error that names the problem."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from helpers import classification_data, mlp


@pytest.mark.parametrize("density", [0, -0.5, 1.5, float("nan")])
def test_density_out_of_range(density):
    with pytest.raises(ValueError, match=r"`density` must be in \(0, 1\]"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), density=density)


def test_density_of_the_wrong_type():
    with pytest.raises(TypeError, match="`density` must be a number"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), density="1%")


def test_unknown_sparsifier_names_the_choices():
    with pytest.raises(ValueError, match=r"Unknown `sparsifier` 'top_k'; available: .*topk"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), sparsifier="top_k")


@pytest.mark.parametrize(
    "not_an_optimizer,message",
    [
        ("sgd", "must be a Keras 3 optimizer.*str"),
        (None, "must be a Keras 3 optimizer.*NoneType"),
        (keras.optimizers.SGD, "instance.*not the class SGD"),
        (tf.compat.v1.train.GradientDescentOptimizer(0.1), "must be a Keras 3 optimizer.*GradientDescentOptimizer"),
    ],
)
def test_wrapping_something_that_is_not_a_keras_optimizer(not_an_optimizer, message):
    with pytest.raises(TypeError, match=message):
        sparse_hvd.SparseDistributedOptimizer(not_an_optimizer)


def test_base_optimizer_options_belong_to_the_inner_optimizer():
    with pytest.raises(ValueError, match="does not take `clipnorm`.*inner `optimizer`"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), clipnorm=1.0)


@pytest.mark.parametrize("bad", [-1, 1.5, "10", True])
def test_min_elements_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError, match="`min_elements`"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), min_elements=bad)


def test_model_fit_with_jit_compile_says_to_turn_it_off():
    model = mlp()
    model.compile(
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    x, y = classification_data(n=32)
    with pytest.raises(ValueError, match="XLA.*jit_compile=False"):
        model.fit(x, y, epochs=1, verbose=0)


def test_xla_compiled_custom_loop_says_to_turn_it_off():
    variable = keras.Variable(np.zeros((40, 40), "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1))
    optimizer.build([variable])

    @tf.function(jit_compile=True)
    def step():
        optimizer.apply_gradients([(tf.ones((40, 40)), variable)])

    with pytest.raises(ValueError, match="XLA.*jit_compile=False"):
        step()


def test_gradient_count_must_match_variable_count():
    variable = keras.Variable(np.zeros((4,), "float32"))
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="2 gradients for 1 variables"):
        optimizer.apply([tf.ones(4), tf.ones(4)], [variable])


def test_broadcast_root_rank_is_checked():
    variable = keras.Variable(np.zeros((4,), "float32"))
    with pytest.raises(ValueError, match=r"`root_rank` must be in \[0, 1\)"):
        sparse_hvd.broadcast_variables([variable], root_rank=1)
    with pytest.raises(TypeError, match="`root_rank` must be an int"):
        sparse_hvd.broadcast_variables([variable], root_rank="0")


def test_unknown_grouping_names_the_choices():
    with pytest.raises(ValueError, match=r"`grouping` must be one of \('grouped', 'layerwise'\)"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), grouping="bucketed")


def test_wrapping_adafactor_warns_about_sparse_gradients():
    with pytest.warns(UserWarning, match="Adafactor.*Prefer Adam"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.Adafactor(), density=0.01)


@pytest.mark.parametrize("argument", ["error_feedback", "dense_fallback"])
@pytest.mark.parametrize("value", ["False", 0, None])
def test_boolean_options_take_only_booleans(argument, value):
    """"False" would otherwise count as True."""
    with pytest.raises(TypeError, match=f"`{argument}` must be True or False, got {value!r}"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), **{argument: value})


@pytest.mark.parametrize("value,error,message", [
    ("x", TypeError, "`process_set` must be a horovod ProcessSet.*got 'x'"),
    (3, TypeError, "`process_set` must be a horovod ProcessSet.*got 3"),
])
def test_process_set_is_checked(value, error, message):
    with pytest.raises(error, match=message):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), process_set=value)


def test_an_unregistered_process_set_is_named():
    hvd = pytest.importorskip("horovod.tensorflow")
    with pytest.raises(ValueError, match="is not registered with Horovod.*add_process_set"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1),
                                              process_set=hvd.ProcessSet([0]))


def test_a_sparse_optimizer_inside_another_is_refused():
    inner = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="is \\(or wraps\\) a SparseDistributedOptimizer already"):
        sparse_hvd.SparseDistributedOptimizer(inner)
    with pytest.raises(ValueError, match="is \\(or wraps\\) a SparseDistributedOptimizer already"):
        sparse_hvd.SparseDistributedOptimizer(keras.optimizers.LossScaleOptimizer(inner))


def test_a_variable_too_large_for_int32_indices_is_named_at_build():
    """Checked on the routes (a real 2^31-entry variable would take 8 GiB)."""
    from sparse_hvd import checks
    from sparse_hvd.feedback.payload import Route

    class Huge:
        path = "model/embedding/embeddings"

    routes = [Route(num_elements=(1 << 31), sparse=True, itemsize=4)]
    with pytest.raises(ValueError, match="model/embedding/embeddings has 2147483648 entries.*"
                                         "min_elements above 2147483648"):
        checks.check_index_range([Huge()], routes)
    checks.check_index_range([Huge()], [routes[0]._replace(sparse=False)])  # dense: fine
    checks.check_index_range([Huge()], [Route((1 << 31) - 1, True, 4)])  # the largest that fits


def test_layer_stats_of_an_empty_variable():
    empty = keras.Variable(np.zeros((0, 4), "float32"), name="empty")
    full = keras.Variable(np.ones((50, 40), "float32"), name="full")
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1), density=0.1)
    optimizer.apply([tf.zeros((0, 4)), tf.ones((50, 40))], [empty, full])
    stats = optimizer.layer_stats()
    assert stats[empty.path] == {"elements": 0, "route": "dense", "exchange": "dense",
                                 "target_density": 1.0, "last_sent": 0, "last_density": 0.0}
    assert stats[full.path]["last_sent"] == 200


def test_bfloat16_variables_train_in_one_process():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(300, dtype="bfloat16"),
                              keras.layers.Dense(1)])
    model.compile(sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse",
                  jit_compile=False)
    x = np.random.RandomState(0).randn(64, 8).astype("float32")
    before = model.layers[0].kernel.numpy().copy()
    model.fit(x, x.sum(1, keepdims=True), batch_size=16, epochs=1, verbose=0)
    after = model.layers[0].kernel.numpy()
    assert model.layers[0].kernel.dtype == "bfloat16"
    assert np.isfinite(after.astype(np.float32)).all() and (after != before).any()


def test_init_with_a_communicator_after_horovod_started_says_to_call_it_first():
    pytest.importorskip("horovod.tensorflow")
    sparse_hvd.init()  # starts Horovod (a job of one)
    with pytest.raises(ValueError, match="must come before anything starts Horovod"):
        sparse_hvd.init(comm=[0])
