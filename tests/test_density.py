import math

import pytest

from sparse_hvd.selection.density import elements_to_send, validate_density


@pytest.mark.parametrize(
    "n,density,expected",
    [(100, 0.07, 7), (100, 0.01, 1), (1000, 0.001, 1), (10, 0.001, 1), (10, 1.0, 10),
     (333, 0.1, 34), (25_600_000, 0.001, 25_600), (3, 0.5, 2)],
)
def test_k_is_the_ceiling_of_density_times_n(n, density, expected):
    assert elements_to_send(n, density) == expected


def test_k_is_at_least_one_and_at_most_n():
    for n in (1, 2, 7, 1000):
        for density in (1e-9, 0.3, 1.0):
            k = elements_to_send(n, density)
            assert 1 <= k <= n
            assert k == max(1, min(n, math.ceil(density * n - 1e-9)))


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.0001, 2, float("nan"), float("inf")])
def test_density_outside_the_unit_interval_is_a_value_error(bad):
    with pytest.raises(ValueError, match=r"`density` must be in \(0, 1\]"):
        validate_density(bad)


@pytest.mark.parametrize("bad", ["0.1", None, True, [0.1]])
def test_density_that_is_not_a_number_is_a_type_error(bad):
    with pytest.raises(TypeError, match="`density` must be a number"):
        validate_density(bad)
