"""Small builders shared by the tests: models, data and an independent top-k in NumPy."""

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
