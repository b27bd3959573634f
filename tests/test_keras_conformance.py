"""The wrapper behaves as the Keras optimizer it stands in for (density 1.0, one process): the
same weights as the plain inner optimizer, the inner optimizer's options readable and in effect,
Keras' own errors and warnings."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd

SHAPES = {"kernel": (40, 30), "bias": (30,)}


def _variables(seed=0):
    rng = np.random.RandomState(seed)
    return [keras.Variable(rng.randn(*shape).astype("float32"), name=name)
            for name, shape in SHAPES.items()]


def _gradients(step):
    rng = np.random.RandomState(100 + step)
    return [tf.constant(rng.randn(*shape).astype("float32") * 3) for shape in SHAPES.values()]


def _train(optimizer, steps=4, variables=None):
    variables = variables or _variables()
    for step in range(steps):
        optimizer.apply(_gradients(step), variables)
    return [v.numpy() for v in variables]


def _wrapped(inner):
    return sparse_hvd.SparseDistributedOptimizer(inner, density=1.0, min_elements=0)


OPTIONS = [
    ("SGD", dict(clipnorm=0.5)),
    ("SGD", dict(clipvalue=0.1)),
    ("SGD", dict(global_clipnorm=0.7)),
    ("Adam", dict(use_ema=True, ema_momentum=0.9)),
    ("AdamW", dict(weight_decay=0.1)),
    ("SGD", dict(loss_scale_factor=8.0)),
]


@pytest.mark.parametrize("name,options", OPTIONS)
def test_the_inner_optimizers_options_act_as_without_the_wrapper(name, options):
    make = getattr(keras.optimizers, name)
    plain = _train(make(learning_rate=0.05, **options))
    wrapped_optimizer = _wrapped(make(learning_rate=0.05, **options))
    wrapped = _train(wrapped_optimizer)
    for got, expected in zip(wrapped, plain):
        np.testing.assert_array_equal(got, expected)
    for option, value in options.items():
        assert getattr(wrapped_optimizer, option) == value  # read through the wrapper


def test_the_options_read_through_the_wrapper_are_the_inner_optimizers():
    inner = keras.optimizers.SGD(0.1, clipnorm=2.0)
    optimizer = _wrapped(inner)
    assert (optimizer.clipnorm, optimizer.clipvalue, optimizer.global_clipnorm) == (2.0, None, None)
    assert optimizer.use_ema is False and optimizer.gradient_accumulation_steps is None
    optimizer.clipnorm = 3.0
    assert inner.clipnorm == 3.0


def test_keras_accumulation_on_the_inner_optimizer_is_refused_with_the_alternative():
    with pytest.raises(ValueError, match="gradient_accumulation_steps=4.*backward_passes_per_step"):
        _wrapped(keras.optimizers.SGD(0.1, gradient_accumulation_steps=4))


@pytest.mark.parametrize("how", ["var_names", "var_list"])
def test_exclude_from_weight_decay_called_on_the_wrapper_excludes(how):
    def run(make_optimizer):
        variables = _variables()
        optimizer = make_optimizer()
        if how == "var_names":
            optimizer.exclude_from_weight_decay(var_names=["bias"])
        else:
            optimizer.exclude_from_weight_decay(var_list=[variables[1]])
        return _train(optimizer, variables=variables)

    plain = run(lambda: keras.optimizers.AdamW(0.01, weight_decay=0.5))
    wrapped = run(lambda: _wrapped(keras.optimizers.AdamW(0.01, weight_decay=0.5)))
    undecayed = run(lambda: keras.optimizers.AdamW(0.01, weight_decay=0.0))
    for got, expected in zip(wrapped, plain):
        np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(wrapped[1], undecayed[1])  # the bias did not decay
    assert not np.array_equal(wrapped[0], undecayed[0])  # the kernel did


def test_no_gradient_at_all_is_keras_error_and_a_missing_one_keras_warning():
    variables = _variables()
    optimizer = _wrapped(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="No gradients provided for any variable"):
        optimizer.apply([None, None], variables)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.apply([_gradients(0)[0], None], variables)
    assert any("Gradients do not exist for variables ['bias']" in str(w.message) for w in caught)


def test_set_weights_restores_the_inner_optimizers_state_too():
    variables = _variables()
    optimizer = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.Adam(0.01), density=0.1,
                                                      min_elements=0)
    _train(optimizer, steps=2, variables=variables)
    saved = [v.numpy() for v in optimizer.variables]
    _train(optimizer, steps=3, variables=variables)
    optimizer.set_weights(saved)
    assert int(optimizer.iterations.numpy()) == 2
    for variable, value in zip(optimizer.variables, saved):
        np.testing.assert_array_equal(variable.numpy(), value)
    with pytest.raises(ValueError, match="got 1 arrays"):
        optimizer.set_weights(saved[:1])


def test_indexed_slices_with_python_sequences_as_keras_takes_them():
    table = keras.Variable(np.ones((10, 4), "float32"))
    grad = tf.IndexedSlices(values=[[1.0] * 4, [2.0] * 4], indices=(1, 7), dense_shape=(10, 4))
    optimizer = _wrapped(keras.optimizers.SGD(0.5))
    optimizer.apply([grad], [table])
    expected = np.ones((10, 4), "float32")
    expected[1] -= 0.5
    expected[7] -= 1.0
    np.testing.assert_array_equal(table.numpy(), expected)
