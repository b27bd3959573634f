"""Single-process tests run here; tests/distributed/ runs on every rank of a launched job.

tests/test_distributed.py launches those with mpirun and horovodrun (SPARSE_HVD_RANK_TESTS=1
tells pytest, on each rank, to collect them).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

collect_ignore_glob = [] if os.environ.get("SPARSE_HVD_RANK_TESTS") else ["distributed/*"]


import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked ``extended`` (the same behaviour under another launcher or variant) run
    only with SPARSE_HVD_FULL_SUITE=1: the suite's 15-minute budget."""
    if os.environ.get("SPARSE_HVD_FULL_SUITE"):
        return
    skip = pytest.mark.skip(reason="extended: SPARSE_HVD_FULL_SUITE=1 (scripts/test.sh --full)")
    for item in items:
        if item.get_closest_marker("extended"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _mechanism_defaults(request, monkeypatch):
    """Most tests check a mechanism against a closed-form expectation for the density they
    pass (k = ceil(density * n) of each variable from the first step, the inner optimizer's
    own momentum, the exchange they name or the allgather), so the warm-up, the model-wide
    budget, the timed choice of exchange, Adam's signs and SGD's signs of the rest
    (``sparse_hvd.selection.defaults``) are off for them; tests marked
    ``convergence_defaults`` run with the defaults as users get them."""
    if request.node.get_closest_marker("convergence_defaults"):
        return
    import sparse_hvd.selection.defaults

    monkeypatch.setattr(sparse_hvd.selection.defaults, "WARMUP_STEPS", 0)
    monkeypatch.setattr(sparse_hvd.selection.defaults, "BUDGET", "layer")
    monkeypatch.setattr(sparse_hvd.selection.defaults, "EXCHANGE", "allgather")
    monkeypatch.setattr(sparse_hvd.selection.defaults, "ONE_BIT", False)
    monkeypatch.setattr(sparse_hvd.selection.defaults, "SIGNS_OF_REST", False)
