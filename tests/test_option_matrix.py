"""The option matrix in one process: the pairwise cover is complete, the refused pairs are
refused with a message naming both options, and every combination trains with the
conservation identity (tests/distributed/test_option_matrix.py: on every rank)."""

import itertools

import numpy as np
import pytest

from option_matrix import (FACTORS, REFUSED, _pairs_of, all_pairs, label, make_optimizer,
                           pairwise_combinations, train)

COMBINATIONS = pairwise_combinations()


def test_every_pair_of_options_that_is_not_refused_is_covered():
    covered = set().union(*(_pairs_of(c) for c in COMBINATIONS))
    assert all_pairs() <= covered
    for combination in COMBINATIONS:
        assert set(combination) == set(FACTORS)
        for a, x, b, y in REFUSED:
            assert not (combination[a] == x and combination[b] == y)
    # every value of every option appears, with every value of every other option
    for (a, xs), (b, ys) in itertools.combinations(sorted(FACTORS.items()), 2):
        for x, y in itertools.product(xs, ys):
            refused = any({(a, x), (b, y)} == {(p, u), (q, v)} for p, u, q, v in REFUSED)
            assert refused or any(c[a] == x and c[b] == y for c in COMBINATIONS), (a, x, b, y)
    assert len(COMBINATIONS) <= 35  # the suite's time budget (34 with topk_sign2: 49 s on 3 ranks)


@pytest.mark.parametrize("refused", REFUSED, ids=lambda r: f"{r[0]}={r[1]}+{r[2]}={r[3]}")
def test_the_refused_pairs_are_refused_naming_both(refused):
    a, x, b, y = refused
    base = dict(COMBINATIONS[0], **{a: x, b: y})
    words = {"staleness": "staleness", "density": "AdaptiveDensity", "grouping": "layerwise",
             "momentum_correction": "momentum_correction", "sparsify": "sparsify",
             "dense_fallback": "dense_fallback"}
    first, second = (words.get(a, x), words.get(b, y))
    with pytest.raises(ValueError, match=f"(?s)(?=.*{first})(?=.*{second})"):
        make_optimizer(base, "refused")


@pytest.mark.parametrize("combination", COMBINATIONS, ids=label)
def test_every_combination_trains_alone_and_keeps_every_gradient(combination):
    weights, residuals, expected = train(combination, "m_" + label(combination), 0, 1)
    if combination["momentum_correction"]:
        # the inner SGD applies velocities, not gradients: the identity is not this one
        assert all(np.all(np.isfinite(w)) for w in weights)
        return
    for w, r, e in zip(weights, residuals, expected):
        # what is still owed plus what was applied is every gradient
        np.testing.assert_allclose(r.reshape(w.shape) - w.astype("float64"), e,
                                   rtol=0, atol=1e-4)
