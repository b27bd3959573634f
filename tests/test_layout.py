"""The package layout: sub-packages by stage, the old module paths kept working, and the size
limits the layout is meant to keep (issue 20)."""

import importlib
import os

import pytest

import sparse_hvd
from sparse_hvd._moved import MOVED

PACKAGE = os.path.dirname(os.path.abspath(sparse_hvd.__file__))


@pytest.mark.parametrize("old,new", sorted(MOVED.items()))
def test_every_old_module_path_gives_the_moved_module(old, new):
    moved = importlib.import_module(f"sparse_hvd.{new}")
    assert importlib.import_module(f"sparse_hvd.{old}") is moved
    # the module keeps its own spec, so that its relative imports raise no ImportWarning
    assert moved.__spec__.name == f"sparse_hvd.{new}"
    assert moved.__spec__.parent == moved.__package__


def test_names_users_imported_from_old_paths():
    from sparse_hvd.density import WarmupDensity
    from sparse_hvd.runtime import init, rank, size  # noqa: F401
    from sparse_hvd.sparsifiers import TopK
    from sparse_hvd.steps import DelayedStep, SynchronousStep  # noqa: F401

    assert WarmupDensity is sparse_hvd.WarmupDensity and TopK is sparse_hvd.TopK


def _python_files():
    for folder, _, files in os.walk(PACKAGE):
        if "__pycache__" in folder or os.sep + "build" in folder:
            continue
        for name in files:
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def test_no_module_over_500_lines():
    long = {os.path.relpath(p, PACKAGE): n for p in _python_files()
            if (n := sum(1 for _ in open(p))) > 500}
    assert not long, long


def test_no_class_over_350_lines():
    import ast

    long = {}
    for path in _python_files():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 350:
                long[f"{os.path.relpath(path, PACKAGE)}:{node.name}"] = (
                    node.end_lineno - node.lineno + 1)
    assert not long, long
