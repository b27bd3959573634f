import numpy as np
import pytest
import tensorflow as tf

import sparse_hvd
from sparse_hvd.selection.sparsifiers import register_sparsifier, topk
from helpers import numpy_topk_indices


@pytest.mark.parametrize("n,k", [(1, 1), (10, 1), (10, 3), (1000, 10), (4097, 41), (50, 50)])
def test_topk_keeps_exactly_the_k_largest_magnitudes(n, k):
    rng = np.random.RandomState(n + k)
    flat = rng.randn(n).astype("float32")
    selection = topk(tf.constant(flat), k)
    indices = np.sort(selection.indices.numpy())
    assert selection.indices.dtype == tf.int32
    assert len(np.unique(indices)) == k
    np.testing.assert_array_equal(indices, numpy_topk_indices(flat, k))
    # values are taken unchanged (same bits) from the input at those positions
    np.testing.assert_array_equal(
        selection.values.numpy(), flat[selection.indices.numpy()]
    )


def test_topk_prefers_large_negative_entries():
    flat = tf.constant([0.1, -5.0, 2.0, -0.3, 4.0])
    selection = topk(flat, 2)
    assert sorted(selection.indices.numpy().tolist()) == [1, 4]


def test_registry_lists_topk_and_rejects_unknown_names():
    assert "topk" in sparse_hvd.available_sparsifiers()
    assert isinstance(sparse_hvd.get_sparsifier("topk"), sparse_hvd.TopK)
    with pytest.raises(ValueError, match="Unknown `sparsifier` 'nope'.*topk"):
        sparse_hvd.get_sparsifier("nope")
    with pytest.raises(TypeError, match="sparsifier"):
        sparse_hvd.get_sparsifier(3)


def test_registering_a_name_twice_is_refused():
    with pytest.raises(ValueError, match="already exists"):
        register_sparsifier("topk")(topk)


def _fast_and_sorted(flat_grad, flat_residual, k):
    from sparse_hvd.feedback.error_feedback import compensate_and_select

    fast = compensate_and_select(tf.constant(flat_grad), tf.constant(flat_residual), sparse_hvd.TopK(), k)
    plain = compensate_and_select(tf.constant(flat_grad), tf.constant(flat_residual),
                                  sparse_hvd.TopK(fast=False), k)
    return fast, plain


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n,density", [(65536, 0.01), (300000, 0.001), (300000, 0.01), (131072, 0.2)])
def test_topk_from_candidates_equals_the_partial_sort_bit_for_bit(n, density, dtype):
    rng = np.random.RandomState(n % 97)
    grad = (rng.standard_cauchy(n) * rng.rand(n)).astype(dtype)  # heavy tails, like gradients
    residual = (rng.randn(n) * 0.3).astype(dtype)
    k = int(np.ceil(density * n))
    (fast, fast_rest), (plain, plain_rest) = _fast_and_sorted(grad, residual, k)
    order = np.argsort(fast.indices.numpy())
    np.testing.assert_array_equal(fast.indices.numpy()[order], np.sort(plain.indices.numpy()))
    np.testing.assert_array_equal(fast.values.numpy()[order],
                                  plain.values.numpy()[np.argsort(plain.indices.numpy())])
    np.testing.assert_array_equal(fast_rest.numpy(), plain_rest.numpy())
    np.testing.assert_array_equal(np.sort(fast.indices.numpy()),
                                  numpy_topk_indices(grad + residual, k))


def test_topk_falls_back_to_the_partial_sort_when_the_cut_misses():
    # Nine tenths of the entries share one magnitude: every cut below it takes far more than
    # 8k candidates, so the whole gradient is sorted; the answer must not change.
    n, k = 100000, 500
    rng = np.random.RandomState(1)
    grad = np.where(rng.rand(n) < 0.9, 1.0, rng.rand(n) * 0.5).astype("float32")
    residual = np.zeros(n, "float32")
    (fast, fast_rest), (plain, plain_rest) = _fast_and_sorted(grad, residual, k)
    np.testing.assert_array_equal(np.sort(fast.indices.numpy()), np.sort(plain.indices.numpy()))
    np.testing.assert_array_equal(fast_rest.numpy(), plain_rest.numpy())


def test_topk_settings_serialise():
    config = sparse_hvd.TopK(min_size=1000, fast=False).get_config()
    assert sparse_hvd.TopK.from_config(config).get_config() == {"min_size": 1000, "fast": False}


@pytest.mark.parametrize("fuse", [True, False])
def test_a_capped_threshold_on_a_large_layer_sends_the_caps_top_entries_as_top_k_would(fuse):
    # lambda so low that every entry passes: the cap decides. The cap's largest must be found
    # (from candidates, not by a partial sort of the layer) with the same residual bits.
    from sparse_hvd.feedback.error_feedback import compensate_and_select

    n, cap_density = 200000, 0.01
    rng = np.random.RandomState(3)
    grad = (rng.standard_cauchy(n) * rng.rand(n)).astype("float32")
    residual = (rng.randn(n) * 0.3).astype("float32")
    capped, capped_rest = compensate_and_select(
        tf.constant(grad), tf.constant(residual),
        sparse_hvd.Threshold(threshold=1e-30, max_density=cap_density, fuse=fuse), None)
    plain, plain_rest = compensate_and_select(tf.constant(grad), tf.constant(residual),
                                              sparse_hvd.TopK(fast=False), int(cap_density * n))
    assert bool(capped.capped)
    order, plain_order = np.argsort(capped.indices.numpy()), np.argsort(plain.indices.numpy())
    np.testing.assert_array_equal(capped.indices.numpy()[order], plain.indices.numpy()[plain_order])
    np.testing.assert_array_equal(capped.values.numpy()[order], plain.values.numpy()[plain_order])
    np.testing.assert_array_equal(capped_rest.numpy(), plain_rest.numpy())


def _numpy_threshold(compensated, threshold, cap):
    """The hard threshold's rule in NumPy: every |c| >= lambda; more than ``cap`` of them: the
    ``cap`` largest (ties: the lower index). (sorted indices, remainder, capped)."""
    passing = np.flatnonzero(np.abs(compensated) >= threshold)
    capped = passing.size > cap
    if capped:
        order = np.lexsort((passing, -np.abs(compensated[passing])))
        passing = np.sort(passing[order[:cap]])
    remainder = compensated.copy()
    remainder[passing] = 0
    return passing, remainder, capped


def _sampled_positions(n):
    """Where the sparsifiers' fixed sampler looks (sparsifiers._sampled_cut, 1024 samples here)."""
    return (np.arange(1024, dtype=np.int64) * 2654435761) % n


def _threshold_case(case, n, cap):
    rng = np.random.RandomState(7)
    grad = (rng.standard_cauchy(n) * rng.rand(n)).astype("float32")
    residual = (rng.randn(n) * 0.3).astype("float32")
    magnitudes = np.sort(np.abs(grad + residual))[::-1]
    if case.startswith("passing_x"):  # lambda that about (factor x cap) entries pass
        factor = float(case[len("passing_x"):])
        return grad, residual, float(magnitudes[int(factor * cap)])
    if case == "everything_passes":
        return grad, residual, 1e-30
    if case == "sample_overestimates":
        # the sampled entries are large, the rest small but above lambda: the raised cut finds
        # fewer than cap candidates and the exact path must run (ties decided by index)
        grad = np.full(n, 1e-3, "float32")
        grad[_sampled_positions(n)] = 10.0
        return grad, np.zeros(n, "float32"), 5e-4
    if case == "sample_underestimates":
        # the sampled entries are 0, every other passes lambda: far more than 8 x cap candidates
        grad = np.ones(n, "float32")
        grad[_sampled_positions(n)] = 0.0
        return grad, np.zeros(n, "float32"), 0.5
    raise AssertionError(case)


@pytest.mark.parametrize("path", ["native", "xla", "plain"])
@pytest.mark.parametrize("case", ["passing_x0.5", "passing_x1.5", "passing_x3", "passing_x20",
                                  "everything_passes", "sample_overestimates",
                                  "sample_underestimates"])
def test_threshold_on_a_large_layer_follows_the_rule_in_one_pass(case, path, monkeypatch):
    # Every branch of Threshold.fused_compensate_select (lambda or raised cut, all candidates
    # sent or the cap's largest, a missed sample) against the rule computed in NumPy.
    from sparse_hvd import kernels
    from sparse_hvd.feedback.error_feedback import compensate_and_select

    if path == "native" and kernels.compensate_topk() is None:
        pytest.skip("native kernels not built")
    if path == "xla":
        monkeypatch.setattr(kernels, "compensate_topk", lambda: None)
        monkeypatch.setattr(kernels, "compensate_cut", lambda: None)
    n, cap_density = 200000, 0.01
    cap = int(cap_density * n)
    grad, residual, threshold = _threshold_case(case, n, cap)
    selection, remainder = compensate_and_select(
        tf.constant(grad), tf.constant(residual),
        sparse_hvd.Threshold(threshold=threshold, max_density=cap_density, fuse=path != "plain"),
        None)
    compensated = grad + residual
    expected, expected_remainder, expected_capped = _numpy_threshold(compensated, threshold, cap)
    indices, values = selection.indices.numpy(), selection.values.numpy()
    order = np.argsort(indices)
    np.testing.assert_array_equal(indices[order], expected)
    np.testing.assert_array_equal(values[order], compensated[expected])
    np.testing.assert_array_equal(remainder.numpy(), expected_remainder)
    assert bool(selection.capped) == expected_capped
