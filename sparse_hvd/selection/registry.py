"""The sparsifier interface and its registry: :class:`Selection` (what one worker sends for one
variable), :class:`Sparsifier` (the callable with a name and a config) and the functions that
register, list, look up and serialise sparsifiers by name. The algorithms themselves are in
``sparse_hvd.selection.sparsifiers``, which registers them when imported (and re-exports
everything here).
"""

from typing import Callable, Dict, NamedTuple, Optional

import tensorflow as tf


class Selection(NamedTuple):
    """What one worker sends for one variable."""

    values: tf.Tensor  # [m] the chosen entries, same dtype as the gradient
    indices: tf.Tensor  # [m] int32 positions in the flattened variable, all distinct
    capped: Optional[tf.Tensor] = None  # bool scalar: a payload cap cut this selection short
    # bool scalar: every compensated entry was finite, found in the selecting pass itself (the
    # native kernels); None: the payload checks the gradient with a pass of its own
    finite: Optional[tf.Tensor] = None
    # with exchange="topk_sign": layers of [n] signs, each +-its scale, of what the selection
    # left (``exchanges.topk_sign``: one layer, or two); they travel as bits beside the entries
    signs: Optional[tuple] = None
    # with exchange="sign" on a rank that sends its signs as they are: (int32 sign words,
    # float32 scales), made by the selecting pass (``exchanges.sign.ScaledSign``); ``values``
    # then has no entries (``indices`` still counts every entry sent)
    packed: Optional[tuple] = None


class Sparsifier:
    """Base class of configurable sparsifiers: a callable with a Keras-style config."""

    name = None  # set by register_sparsifier

    def __call__(self, flat: tf.Tensor, k) -> Selection:
        raise NotImplementedError

    def get_config(self) -> dict:
        return {}

    @classmethod
    def from_config(cls, config: dict) -> "Sparsifier":
        return cls(**config)

    def __repr__(self):
        settings = ", ".join(f"{key}={value!r}" for key, value in self.get_config().items())
        return f"{type(self).__name__}({settings})"


class _FunctionSparsifier(Sparsifier):
    """A plain function ``fn(flat, k) -> Selection`` registered by name."""

    def __init__(self, fn, name):
        self._fn = fn
        self.name = name

    def __call__(self, flat, k):
        return self._fn(flat, k)

    def __repr__(self):
        return f"sparsifier {self.name!r}"


_REGISTRY: Dict[str, Callable[[], Sparsifier]] = {}


def register_sparsifier(name: str):
    """Decorator that makes a sparsifier selectable by ``name``.

    Decorate either a function ``fn(flat, k) -> Selection`` or a :class:`Sparsifier` subclass
    (whose constructor arguments all have defaults if it is to be selectable by name alone).
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_sparsifier: `name` must be a non-empty string, got {name!r}")

    def decorate(target):
        if name in _REGISTRY:
            raise ValueError(f"register_sparsifier: a sparsifier named {name!r} already exists")
        if isinstance(target, type) and issubclass(target, Sparsifier):
            target.name = name
            _REGISTRY[name] = target
        elif callable(target):
            _REGISTRY[name] = lambda: _FunctionSparsifier(target, name)
        else:
            raise TypeError(f"register_sparsifier({name!r}) decorates a function or a Sparsifier class")
        return target

    return decorate


def available_sparsifiers():
    """The registered names, sorted."""
    return sorted(_REGISTRY)


def get_sparsifier(spec) -> Sparsifier:
    """A sparsifier from a registered name, a Sparsifier instance, or a serialised config.

    Raises a ValueError naming the choices for an unknown name, a TypeError for anything else.
    """
    if isinstance(spec, Sparsifier):
        return spec
    if isinstance(spec, dict) and "name" in spec:
        factory = _lookup(spec["name"])
        config = spec.get("config", {})
        if isinstance(factory, type):
            return factory.from_config(config)
        return factory()
    if isinstance(spec, str):
        factory = _lookup(spec)
        try:
            return factory()
        except TypeError as error:
            raise ValueError(
                f"`sparsifier` {spec!r} needs settings: pass an instance, e.g. "
                f"sparse_hvd.sparsifiers.{factory.__name__}(...) ({error})"
            ) from None
    raise TypeError(
        "`sparsifier` must be a registered name (str) or a sparse_hvd Sparsifier, got "
        f"{type(spec).__name__}"
    )


def serialize_sparsifier(sparsifier: Sparsifier):
    """What :func:`get_sparsifier` turns back into an equal sparsifier: the registered name when
    there are no settings, else ``{"name": ..., "config": {...}}``."""
    config = sparsifier.get_config()
    return {"name": sparsifier.name, "config": config} if config else sparsifier.name


def _lookup(name):
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"Unknown `sparsifier` {name!r}; available: {', '.join(available_sparsifiers())}"
        ) from None
