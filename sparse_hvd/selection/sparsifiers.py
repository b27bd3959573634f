"""Sparsifiers: which entries of a compensated gradient a worker sends this step.

A sparsifier is called as ``selection = sparsifier(flat, k)`` where ``flat`` is the 1-D
error-compensated gradient of one variable and ``k`` the number of entries the density policy
allows it to send (a Python int or a scalar int32 tensor, at least 1). It returns a
:class:`Selection`: the int32 ``indices`` of the chosen entries (no index twice) and their
``values`` taken from ``flat`` unchanged. Error feedback relies on both properties: the residual
is ``flat`` with exactly the sent positions zeroed, so sent + residual == flat, bit for bit.

Sparsifiers are looked up by name in a registry (:func:`get_sparsifier`), or passed as objects
when they need settings (``Threshold(0.01)``); both serialise through ``get_config``. The
optimizer only calls the registry, so a new algorithm needs no change anywhere else:

    @sparse_hvd.register_sparsifier("my_rule")
    def my_rule(flat, k):
        ...
        return sparse_hvd.Selection(values, indices)
"""

import math
from typing import NamedTuple, Optional

import tensorflow as tf

from .. import kernels
from .order_statistics import kth_largest
from .registry import (Selection, Sparsifier, available_sparsifiers,  # noqa: F401 (re-exported)
                       get_sparsifier, register_sparsifier, serialize_sparsifier)


def _selection_at(flat, indices) -> Selection:
    return Selection(values=tf.gather(flat, indices), indices=indices)


def _indices_of(mask):
    """int32 positions where ``mask`` is True, ascending."""
    return tf.cast(tf.reshape(tf.where(mask), [-1]), tf.int32)


def _mask_of(indices, n):
    """A bool [n] tensor, True at ``indices``."""
    return tf.scatter_nd(tf.expand_dims(indices, 1), tf.ones_like(indices, tf.bool), [n])


def _compensate_and_cut(grad, residual, cut):
    """Elementwise: c = grad + residual; passed = |c| >= cut; remainder = c with the passed
    entries zeroed. ``_compensate_and_cut_xla`` is the same, compiled into one pass by XLA."""
    compensated = grad + residual
    passed = tf.abs(compensated) >= tf.cast(cut, compensated.dtype)
    return tf.where(passed, tf.zeros_like(compensated), compensated), passed


_compensate_and_cut_xla = tf.function(_compensate_and_cut, jit_compile=True,
                                      reduce_retracing=True, autograph=False)


def _partial_sort_topk(k):
    """Error feedback's steps 1-3 for the exact top-``k`` by a partial sort of the whole of
    ``c = grad + residual``: ``(indices, values, remainder)``. About ten passes over the data
    on a CPU: the last resort."""
    def select(flat_grad, flat_residual):
        compensated = flat_grad + flat_residual
        _, largest = tf.math.top_k(tf.abs(compensated), k=k, sorted=False)
        cleared = tf.where(_mask_of(largest, compensated.shape[0]), tf.zeros_like(compensated),
                           compensated)
        return largest, tf.gather(compensated, largest), cleared

    return select


def _candidate_topk(k, min_size):
    """The exact top-``k`` as :class:`TopK` finds it (from candidates above a sampled cut, a
    partial sort only if that misses, or for layers under ``min_size``): the same result as
    :func:`_partial_sort_topk` at about the cost of one pass over the data."""
    def select(flat_grad, flat_residual):
        result = TopK(min_size=min_size).fused_compensate_select(flat_grad, flat_residual, k)
        if result is None:
            return _partial_sort_topk(k)(flat_grad, flat_residual)
        selection, remainder = result
        return selection.indices, selection.values, remainder

    return select


def _magnitude_cut_step(flat_grad, flat_residual, cut, low, high, fallback, fuse):
    """Error feedback's steps 1-3 for a rule "send every entry with |c| >= cut".

    1. one pass over the data: compensate, compare, the remainder and the selected positions
       (the native kernel of sparse_hvd/kernels where it is built, else XLA-fused TensorFlow
       ops when ``fuse``, else plain TensorFlow ops: all give the same bits);
    2. a count outside [low, high] is rejected (``high`` also bounds the kernel's memory);
    3. then ``fallback(flat_grad, flat_residual) -> (indices, values, remainder)`` (an exact
       top-k: :func:`_candidate_topk` or :func:`_partial_sort_topk`) is sent instead.

    Returns ``(selection, remainder)``; ``selection.capped`` is True when step 3 ran. Where no
    count can be rejected (``low`` 0 and ``high`` the length, Python numbers: the model-wide
    cut), steps 2-3 are not traced: the fallback's untaken branch was about a sixth of the
    operations of the allgather's traced step on the wide CNN, each about 1 ms of trace.
    """
    native = kernels.compensate_cut() if fuse and flat_grad.dtype in (tf.float32, tf.float64) else None
    finite = None
    if native is not None:
        remainder, indices, values, too_many, finite = native(
            flat_grad, flat_residual, tf.cast(cut, flat_grad.dtype), tf.cast(high, tf.int64)
        )
    else:
        step = _compensate_and_cut_xla if fuse else _compensate_and_cut
        remainder, passed = step(flat_grad, flat_residual, cut)
        indices = _indices_of(passed)
        too_many = tf.size(indices) > high
        # the same float additions as in the step: the same bits
        values = tf.gather(flat_grad, indices) + tf.gather(flat_residual, indices)
    length = flat_grad.shape[0]
    if isinstance(low, int) and isinstance(high, int) and length is not None and (
            low <= 0 and high >= length):
        return Selection(values=values, indices=indices, capped=tf.constant(False),
                         finite=finite), remainder
    rejected = tf.logical_or(too_many, tf.size(indices) < low)
    indices, values, remainder = tf.cond(
        rejected, lambda: fallback(flat_grad, flat_residual), lambda: (indices, values, remainder)
    )
    return Selection(values=values, indices=indices, capped=rejected, finite=finite), remainder


def _largest_above(flat_grad, flat_residual, cut, k, low, high, slow, fuse=True):
    """Error feedback's steps 1-3 for "the k largest entries of c = grad + residual among those
    with |c| >= cut", in one pass over the data plus work on the candidates:

    1. one pass: compensate, write the remainder, collect the candidates ``|c| >= cut`` in index
       order (at most ``high`` of them: the memory bound);
    2. fewer than ``low`` or more than ``high`` candidates: ``slow(flat_grad, flat_residual) ->
       (selection, remainder)`` instead (the caller's exact path for a missed cut estimate);
    3. at most k candidates: all are sent; more: the k largest (linear-time selection), and only
       the sent entries are zeroed in the remainder.

    The native kernel (``SparseHvdCompensateTopK``) does steps 1-3 in one op; without it (or with
    ``fuse=False``) TensorFlow ops compute the same selection and remainder. Returns
    ``(selection, remainder)``; ``selection.capped`` says whether k cut the candidates short.
    """
    k = tf.convert_to_tensor(k, tf.int32)
    native = (kernels.compensate_topk() if fuse and flat_grad.dtype in (tf.float32, tf.float64)
              else None)
    finite = None
    if native is not None:
        remainder, indices, values, missed, candidates, finite = native(
            flat_grad, flat_residual, tf.cast(cut, flat_grad.dtype), tf.cast(k, tf.int64),
            tf.cast(low, tf.int64), tf.cast(high, tf.int64))
        fast = Selection(values, indices, capped=candidates > tf.cast(k, tf.int64)), remainder
    else:
        step = _compensate_and_cut_xla if fuse else _compensate_and_cut
        remainder, passed = step(flat_grad, flat_residual, cut)
        indices = _indices_of(passed)
        count = tf.size(indices)
        missed = tf.logical_or(count < low, count > high)
        # the same float additions as in the step: the same bits
        values = tf.gather(flat_grad, indices) + tf.gather(flat_residual, indices)

        def keep_largest():
            _, chosen = tf.math.top_k(tf.abs(values), k=tf.minimum(k, count), sorted=False)
            kept = tf.scatter_nd(tf.expand_dims(chosen, 1), tf.ones_like(chosen, tf.bool),
                                 tf.shape(values))
            returned = tf.logical_not(kept)
            restored = tf.tensor_scatter_nd_update(
                remainder, tf.expand_dims(tf.boolean_mask(indices, returned), 1),
                tf.boolean_mask(values, returned))
            return tf.gather(indices, chosen), tf.gather(values, chosen), restored

        # skipped when missed (the slow path replaces it), so top_k never sees k > count
        sent_indices, sent_values, remainder = tf.cond(
            tf.logical_or(missed, count <= k), lambda: (indices, values, remainder), keep_largest)
        fast = Selection(sent_values, sent_indices, capped=count > k), remainder

    def slow_path():
        selection, slow_remainder = slow(flat_grad, flat_residual)
        return selection.values, selection.indices, selection.capped, slow_remainder

    values, indices, capped, remainder = tf.cond(
        missed, slow_path, lambda: (fast[0].values, fast[0].indices, fast[0].capped, fast[1]))
    return Selection(values, indices, capped=capped, finite=finite), remainder


def _exact_topk_path(k):
    """A ``slow`` path for :func:`_largest_above`: the partial sort of the whole of c."""
    def slow(flat_grad, flat_residual):
        indices, values, remainder = _partial_sort_topk(k)(flat_grad, flat_residual)
        return Selection(values, indices, capped=tf.constant(False)), remainder

    return slow


@register_sparsifier("topk")
class TopK(Sparsifier):
    """Exact top-k by magnitude (Alistarh et al., NeurIPS 2018).

    Keeps the k entries of largest |c|. A partial sort of the whole gradient costs about ten
    passes over it on a CPU, so for layers of ``min_size`` entries and more, with error
    feedback, the same k entries are found from a small candidate set:

    1. estimate a cut below the k-th largest magnitude: the ``round(2k (s+1)/(n+1))``-th
       largest of ``s`` sampled magnitudes of c (0.2% of n, at least 1024), about where 2k
       entries lie above;
    2. one pass over the data: compensate, and collect the candidates ``|c| >= cut``;
    3. if there are at least k and at most 8k candidates, the exact top-k of the candidates is
       the top-k of c (every entry of the top-k is at or above the k-th largest, which is at
       or above the cut), and only those k are zeroed in the remainder; otherwise (a missed
       estimate) the whole of c is partially sorted.

    With the native kernel (``sparse_hvd/kernels``, built by scripts/setup.sh) steps 2-3 are
    one op: a pass over the data and a linear-time selection among the candidates (ties: the
    lower index, as the partial sort). Without it, TensorFlow ops do the same more slowly.

    Either way the selection and the remainder are those of the plain partial sort (tested).
    """

    def __init__(self, min_size=65536, fast=True):
        self.min_size = int(min_size)
        self.fast = bool(fast)

    def get_config(self):
        return {"min_size": self.min_size, "fast": self.fast}

    def __call__(self, flat, k):
        _, indices = tf.math.top_k(tf.abs(flat), k=k, sorted=False)
        return _selection_at(flat, indices)

    def fused_compensate_select(self, flat_grad, flat_residual, k=None):
        n = flat_grad.shape[0]
        if not self.fast or k is None or n is None or n < self.min_size:
            return None
        k = tf.convert_to_tensor(k, tf.int32)
        cut = _sampled_cut(flat_grad, flat_residual, 2 * k, _FIXED_SAMPLER)
        selection, remainder = _largest_above(flat_grad, flat_residual, cut, k, low=k,
                                              high=tf.minimum(8 * k, n), slow=_exact_topk_path(k))
        return selection._replace(capped=None), remainder


def topk(flat, k) -> Selection:
    """Exact top-k by magnitude as a plain function (see :class:`TopK`)."""
    return TopK()(flat, k)


@register_sparsifier("threshold")
class Threshold(Sparsifier):
    """Hard threshold: send every entry with ``|flat| >= threshold`` (Sahu et al., NeurIPS 2021).

    For a fixed communication budget, a constant threshold minimises the total compression error
    over the run and, unlike top-k, is not hurt by heterogeneous data. Its k is not fixed: it
    differs per layer, per step and per rank, and a layer may send nothing in a step. The
    density policy's k is ignored.

    One pass over the data selects the entries above lambda; when a sample says more will pass
    than the cap allows, the same pass collects the candidates above a sampled cut instead and
    keeps the cap's largest, as :class:`TopK` finds its k: one pass either way, never a partial
    sort of the whole layer.

    Args:
        threshold: lambda, the magnitude an entry needs to be sent (> 0).
        max_density: the payload cap: at most ``ceil(max_density * n)`` entries of a layer per
            step, so that a too-small lambda cannot blow up memory or time. When more entries
            pass the threshold, the largest ``cap`` of them are sent (the rest stay in the
            residual) and the selection is marked ``capped``, which the optimizer counts in its
            statistics (``capped_selections``).
        fuse: do compensate, compare, remainder and the selection in one pass over the data,
            with the native kernel (sparse_hvd/kernels, built by scripts/setup.sh) or else
            XLA-fused TensorFlow ops; False uses separate TensorFlow ops. Same bits either way.
    """

    def __init__(self, threshold=None, max_density=0.1, fuse=True):
        if threshold is None:
            raise TypeError("Threshold needs `threshold` (lambda), e.g. Threshold(threshold=0.01)")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 0:
            raise ValueError(f"`threshold` must be a positive number, got {threshold!r}")
        if isinstance(max_density, bool) or not isinstance(max_density, (int, float)) or not 0 < max_density <= 1:
            raise ValueError(f"`max_density` must be in (0, 1], got {max_density!r}")
        self.threshold = float(threshold)
        self.max_density = float(max_density)
        self.fuse = bool(fuse)

    def get_config(self):
        return {"threshold": self.threshold, "max_density": self.max_density, "fuse": self.fuse}

    def fused_compensate_select(self, flat_grad, flat_residual, k=None):
        """Error feedback's steps 1-3 in one pass over the data: ``(selection, remainder)``.
        ``k`` is ignored: lambda decides.

        1. estimate from a fixed sample the magnitude m with about 2 x cap entries above it;
        2. if m > lambda (the cap will be hit), candidates are the entries >= m, else >= lambda;
        3. one pass (:func:`_largest_above`): the candidates; at most ``cap`` of them are all
           sent, more are cut to the ``cap`` largest. With the raised cut it needs more than
           ``cap`` candidates (then more than ``cap`` entries pass lambda, and the ``cap``
           largest of them are among the candidates); too few, or more than 8 x cap, and the
           exact path below runs instead (a missed estimate: rare).

        Layers under ``TopK().min_size`` entries take the exact path directly: a pass with lambda,
        and if the cap is hit the exact top-``cap``.
        """
        n = flat_grad.shape[0]
        cap = max(1, math.ceil(self.max_density * n))
        threshold = tf.constant(self.threshold, flat_grad.dtype)

        def exact(grad, residual):
            return _magnitude_cut_step(grad, residual, threshold, 0, cap,
                                       _candidate_topk(cap, TopK().min_size), self.fuse)

        if n < TopK().min_size:
            return exact(flat_grad, flat_residual)
        estimate = _sampled_cut(flat_grad, flat_residual, 2 * cap, _FIXED_SAMPLER)
        raised = estimate > threshold
        cut = tf.where(raised, estimate, threshold)
        low = tf.where(raised, cap + 1, 0)
        return _largest_above(flat_grad, flat_residual, cut, cap, low, min(8 * cap, n), exact,
                              self.fuse)

    def __call__(self, flat, k):
        selection, _ = self.fused_compensate_select(flat, tf.zeros_like(flat), k)
        return selection


@register_sparsifier("randomk")
class RandomK(Sparsifier):
    """k distinct entries chosen uniformly at random: a baseline for experiments.

    Each rank draws its own positions (from ``seed`` and its rank: two runs with the same seed
    draw the same, ranks draw differently; ``seed=None``: a non-deterministic state). The
    exchange handles any index sets. Error feedback still delivers every entry eventually. The positions are the first k
    of a random permutation of the n positions, computed in O(k) (``index_shuffle``), not by
    shuffling all n.
    """

    def __init__(self, seed=0):
        self.seed = seed
        self._generator = None

    def get_config(self):
        return {"seed": self.seed}

    def __call__(self, flat, k):
        if self._generator is None:
            self._generator = _generator(self.seed)
        n = flat.shape[0]
        seed = self._generator.uniform_full_int([2], dtype=tf.int64)
        indices = tf.random.experimental.index_shuffle(
            tf.range(k, dtype=tf.int64), seed, max_index=n - 1
        )
        return _selection_at(flat, tf.cast(indices, tf.int32))


def _generator(seed):
    """A generator seeded from ``seed`` and this process's rank (reproducible runs, a stream of
    its own per rank), or a non-deterministic one for ``seed=None``."""
    from ..runtime.startup import rank

    with tf.init_scope():
        if seed is None:
            return tf.random.Generator.from_non_deterministic_state()
        return tf.random.Generator.from_seed(int(seed) * 1_000_003 + rank())


class _Sampler(NamedTuple):
    """Where to sample the compensated gradient: a generator, a fraction and a minimum."""

    generator: Optional[tf.random.Generator]  # None: a fixed, well-spread set of positions
    fraction: float = 0.002
    minimum: int = 1024


_FIXED_SAMPLER = _Sampler(None)


def spread_positions(count, n):
    """``count`` int64 positions in [0, n): i * p mod n for a large prime p. Deterministic and
    stateless (the same on every rank), and unlike an even stride they do not line up with the
    rows of a flattened matrix."""
    return tf.math.floormod(tf.range(count, dtype=tf.int64) * 2654435761, n)


def _sampled_cut(flat_grad, flat_residual, count, sampler: _Sampler):
    """A magnitude with about ``count`` entries of |grad + residual| at or above it, estimated
    from ``s`` sampled entries: the r-th largest of s samples has about r (n+1)/(s+1) above."""
    n = flat_grad.shape[0]
    samples = min(n, max(sampler.minimum, math.ceil(sampler.fraction * n)))
    if sampler.generator is None:
        positions = tf.cast(spread_positions(samples, n), tf.int32)
    else:
        positions = sampler.generator.uniform([samples], 0, n, dtype=tf.int32)
    sampled = tf.abs(tf.gather(flat_grad, positions) + tf.gather(flat_residual, positions))
    rank = tf.math.round(tf.cast(count, tf.float64) * (samples + 1) / (n + 1))
    rank = tf.clip_by_value(tf.cast(rank, tf.int32), 1, samples)
    return kth_largest(sampled, rank)


@register_sparsifier("approx_topk")
class ApproxTopK(Sparsifier):
    """Fast approximate top-k for large layers: a threshold estimated from a random sample.

    Exact top-k partially sorts the whole gradient: on a CPU about ten times one pass over it.
    Deep Gradient Compression (Lin et al., ICLR 2018) instead estimates the k-th largest
    magnitude from a sample. Steps, for each layer and step:

    1. draw ``s`` random positions (``sample_fraction`` of n, at least ``min_samples``) and
       take the ``round(k * (s + 1) / (n + 1))``-th largest sampled magnitude of the compensated
       gradient as the estimated cut;
    2. in one pass (XLA-fused, as for :class:`Threshold`): every entry at or above the cut is
       selected, the rest is the remainder;
    3. the band: if the count is within ``[k / band, k * band]`` (default band 2) it is sent
       as is; otherwise the estimate missed badly and the exact top-k (found as :class:`TopK`
       finds it) is the correction.

    So the achieved count of a layer in a step is always within ``[k / band, k * band]``, and
    on average close to k (the estimate is unbiased up to sampling noise). Layers with fewer
    than ``min_size`` entries use exact top-k: for them the sample would be the whole layer.

    The sampled positions come from a generator seeded from ``seed`` (default 0) and the rank,
    so two runs with the same settings send the same entries; ``seed=None`` samples from a
    non-deterministic state.
    """

    def __init__(self, sample_fraction=0.002, min_samples=1024, band=2.0, min_size=65536,
                 fuse=True, seed=0):
        if not 0 < sample_fraction <= 1:
            raise ValueError(f"`sample_fraction` must be in (0, 1], got {sample_fraction!r}")
        if not band > 1:
            raise ValueError(f"`band` must be > 1, got {band!r}")
        self.sample_fraction = float(sample_fraction)
        self.min_samples = int(min_samples)
        self.band = float(band)
        self.min_size = int(min_size)
        self.fuse = bool(fuse)
        self.seed = seed
        self._generator = None

    def get_config(self):
        return {
            "sample_fraction": self.sample_fraction,
            "min_samples": self.min_samples,
            "band": self.band,
            "min_size": self.min_size,
            "fuse": self.fuse,
            "seed": self.seed,
        }

    def fused_compensate_select(self, flat_grad, flat_residual, k=None):
        """Steps 1-3 of the class doc with error feedback: ``(selection, remainder)``.

        Declines (returns None) for layers below ``min_size``, which use exact top-k.
        """
        n = flat_grad.shape[0]
        if n < self.min_size or k is None:
            return None
        if self._generator is None:
            self._generator = _generator(self.seed)
        k = tf.convert_to_tensor(k, tf.int32)
        sampler = _Sampler(self._generator, self.sample_fraction, self.min_samples)
        cut = _sampled_cut(flat_grad, flat_residual, k, sampler)
        low = tf.cast(tf.math.floor(tf.cast(k, tf.float64) / self.band), tf.int32)
        high = tf.cast(tf.math.ceil(tf.cast(k, tf.float64) * self.band), tf.int32)
        selection, remainder = _magnitude_cut_step(
            flat_grad, flat_residual, cut, low, high, _candidate_topk(k, self.min_size), self.fuse
        )
        return selection._replace(capped=None), remainder

    def __call__(self, flat, k):
        result = self.fused_compensate_select(flat, tf.zeros_like(flat), k)
        return topk(flat, k) if result is None else result[0]
