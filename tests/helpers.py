"""Small builders shared by the tests: models, data and an independent top-k in NumPy."""

import logging
import os

import numpy as np
import keras


def mlp(input_dim=20, hidden=64, classes=5, seed=0):
    """A two-layer MLP whose first kernel (input_dim*hidden) is large enough to be sparsified."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((input_dim,)),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(classes),
        ]
    )


def classification_data(n=128, input_dim=20, classes=5, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, input_dim).astype("float32")
    y = rng.randint(0, classes, size=n)
    return x, y


def training_step(model, optimizer, x, y, seen=None):
    """One training step as a ``tf.function`` (no XLA): the cross-entropy of ``(x, y)`` from
    the model's logits, its gradients applied by ``optimizer``; returns the loss. ``seen`` (a
    dict), when given, receives the gradients' ops as traced (``"gradients"``)."""
    import tensorflow as tf

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=False)
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        if seen is not None:
            seen["gradients"] = [g.op for g in grads]
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def ancestors(op):
    """Every operation ``op`` waits for in its graph: its inputs' and control inputs', on."""
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def numpy_topk_indices(values, k):
    """Positions of the k largest |values|, ties to the lower index (an independent reference)."""
    order = np.lexsort((np.arange(values.size), -np.abs(values)))
    return np.sort(order[:k])


def numpy_topk_split(compensated, k):
    """One error-feedback step in NumPy: (chosen positions, what is sent as a dense vector,
    the remainder: ``compensated`` with the chosen entries zeroed)."""
    chosen = numpy_topk_indices(compensated, k)
    sent = np.zeros_like(compensated)
    sent[chosen] = compensated[chosen]
    remainder = compensated.copy()
    remainder[chosen] = 0.0
    return chosen, sent, remainder


def weights_of(model):
    return [np.array(w) for w in model.get_weights()]


def each_ranks_inner_state(optimizer):
    """With ``sparsify="update"``, the inner optimizer's slots (momentum, moments), which follow
    each rank's own gradients: every variable of it but the step count and the learning rate
    (none of the tests' inner optimizers has an EMA). Empty with the gradient cut."""
    if optimizer.sparsify != "update":
        return []
    inner = optimizer.inner_optimizer
    return [v for v in inner.variables
            if v is not inner.iterations and not v.path.endswith("learning_rate")]


def elias_fano_words(n, k):
    """int32 words of the Elias-Fano code of k positions among n, by index_coding's module
    doc in plain integers (an independent reference)."""
    if k == 0:
        return 0
    low = max(0, (n // k).bit_length() - 1)  # floor(log2(n / K)), in integers
    return -(-k * low // 32) + -(-(k + (n >> low) + 1) // 32)


FLOAT_LAYOUTS = {"float32": (32, 8), "float16": (16, 5), "bfloat16": (16, 8)}  # bits, exponent


def coded_value_words(raw_bits, counts, dtype_name):
    """int32 words of value_coding's block for one rank's values given as their raw bits (ints),
    ``counts[j]`` of them for variable j, by its module doc in plain integers: the per-variable
    base, then the Rice width that costs least, found by trying every width."""
    bits, exponent_bits = FLOAT_LAYOUTS[dtype_name]
    mantissa = bits - 1 - exponent_bits
    exponents = [(int(b) >> mantissa) & ((1 << exponent_bits) - 1) for b in raw_bits]
    codes, start = [], 0
    for count in counts:
        mine = exponents[start:start + count]
        start += count
        nonzero = [e for e in mine if e > 0]
        base = (min(nonzero) if nonzero else (1 << exponent_bits) - 1) - (0 in mine)
        codes += [e - base if e > 0 else 0 for e in mine]
    k = len(codes)
    cost, width = min((k * w + sum(c >> w for c in codes), w) for w in range(exponent_bits + 1))
    unary = k + sum(c >> width for c in codes)
    return -(-k * (bits - exponent_bits) // 32) + -(-k * width // 32) + -(-unary // 32)


def raw_bits_of(values, dtype_name):
    """The bits of a NumPy array of floats in ``dtype_name`` as Python ints."""
    import tensorflow as tf

    narrow = tf.cast(tf.constant(values), dtype_name)
    view = tf.int32 if dtype_name == "float32" else tf.uint16
    return [int(b) & 0xFFFFFFFF for b in tf.bitcast(narrow, view).numpy().reshape(-1)]


def native_op(getter):
    """The native op ``getter()`` returns (``sparse_hvd.kernels``): skips the test in a run of
    the TensorFlow fallback (SPARSE_HVD_NATIVE=0), fails it when the kernels should be there
    and are not."""
    import pytest

    from sparse_hvd import kernels

    op = getter()
    if op is None:
        if os.environ.get("SPARSE_HVD_NATIVE") == "0":
            pytest.skip("this run tests the TensorFlow fallback (SPARSE_HVD_NATIVE=0)")
        pytest.fail(f"the native kernels {kernels.status()[1]}")
    return op


class NumpyAdam:
    """Keras' Adam update for one worker's gradients, in float64 (its formula, independently):
    ``update(grad)`` returns what Keras' Adam would subtract for this step."""

    def __init__(self, size, lr, epsilon, beta_1=0.9, beta_2=0.999):
        self.m, self.v, self.t = np.zeros(size), np.zeros(size), 0
        self.lr, self.epsilon, self.beta_1, self.beta_2 = lr, epsilon, beta_1, beta_2

    def update(self, grad):
        self.t += 1
        self.m += (grad - self.m) * (1 - self.beta_1)
        self.v += (grad * grad - self.v) * (1 - self.beta_2)
        alpha = (self.lr * np.sqrt(1 - self.beta_2 ** self.t) / (1 - self.beta_1 ** self.t))
        return self.m * alpha / (np.sqrt(self.v) + self.epsilon)


def built(optimizer, variables):
    """``optimizer`` built for ``variables`` before its first traced step, as Keras's ``fit``
    builds it: a first step that builds the optimizer makes TensorFlow trace the step twice
    (in the multi-rank tests, 1-4 s a trace on 2 shared cores)."""
    optimizer.build(list(variables))
    return optimizer


def force_auto_choice(monkeypatch, forced):
    """``exchange="auto"``'s trial runs to its end and chooses ``forced`` (a candidate's name)
    on every rank, whatever the timings."""
    import sparse_hvd.steps.measured as measured

    monkeypatch.setattr(measured, "ABORT_AFTER", float("inf"))
    monkeypatch.setattr(measured, "sparse_can_win", lambda step, compute, margin: True)
    monkeypatch.setattr(measured, "decide", lambda seconds, names, margin: names.index(forced))
    return measured


class RecordedMessages(logging.Handler):
    """A logging handler that keeps each message (add it to ``sparse_hvd``'s logger)."""

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())

