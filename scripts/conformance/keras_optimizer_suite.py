"""Keras' own optimizer tests, with every optimizer they build wrapped by sparse_hvd.

What it checks
    Keras ships its optimizer tests inside the installed package
    (``keras/src/optimizers/*_test.py``). This script runs them with pytest after replacing
    each optimizer class those tests import (``keras.src.optimizers.<module>.<Class>`` and
    ``keras.src.optimizers.<Class>``) by a factory that returns
    ``SparseDistributedOptimizer(<Class>(...), density=1.0, min_elements=0)``: one process,
    every gradient "exchanged" with itself, so the wrapper must behave exactly as the
    optimizer it wraps. The public ``keras.optimizers`` names are left alone (sparse_hvd
    itself uses them).

    A failure is either a real difference (a bug to fix) or one of the structural differences
    the README lists, named in ``STRUCTURAL`` with the reason; the script exits non-zero when a
    test fails that is not listed there, and ``--report`` writes the table of failures.

Run
    .venv/bin/python scripts/conformance/keras_optimizer_suite.py [--report docs/keras_conformance.md]
"""

import argparse
import collections
import inspect
import os
import sys

import pytest

SUITES = ("adadelta", "adafactor", "adagrad", "adam", "adamax", "adamw", "ftrl", "lamb", "lion",
          "muon", "nadam", "rmsprop", "schedule_free_adamw", "sgd", "optimizer",
          "optimizer_sparse")


# test (class::name) -> why it cannot pass with a wrapper
_OWN_VARIABLES = ("the wrapper has variables of its own (its iteration count and learning rate "
                  "slot, the residuals): `variables` is longer than the inner optimizer's")
_PRIVATE = "reads a private helper of the inner optimizer, which the wrapper does not expose"
_REFUSED = ("LossScaleOptimizer around the wrapper is refused: its overflow check would run on "
            "each rank alone (README, Mixed precision)")
_DECAY_PATCH = ("patches `_apply_weight_decay` on the optimizer it holds: the inner optimizer's "
                "own (unpatched) weight decay then writes the variable directly")
STRUCTURAL = {
    "SGDTest::test_single_step": _OWN_VARIABLES,
    "OptimizerTest::test_setting_lr_to_callable_untracks_lr_var": _OWN_VARIABLES,
    "OptimizerTest::test_get_method": "`optimizers.get` returns the class Keras registered, not "
                                      "the wrapper",
    "OptimizerTest::test_optimizer_auto_naming": "the wrapper's automatic name is its own "
                                                 "(sparse_distributed_optimizer)",
    "NadamTest::test_build_with_empty_var_list": _PRIVATE,
    "MuonTest::test_Newton_Schulz": _PRIVATE,
    "MuonTest::test_lr_adjust_2d": _PRIVATE,
    "MuonTest::test_lr_adjust_none": _PRIVATE,
    "MuonTest::test_should_use_adamw": _PRIVATE,
    "MuonTest::test_adamw_weight_decay": _PRIVATE,
    "OptimizerSparseTest::test_sparse_correctness_loss_scale_optimizer_sgd": _REFUSED,
    "OptimizerSparseTest::test_sparse_gradients_loss_scale_optimizer_sgd": _REFUSED,
    "OptimizerSparseTest::test_sparse_gradients_adamw": _DECAY_PATCH,
    "OptimizerSparseTest::test_sparse_gradients_adamw_amsgrad": _DECAY_PATCH,
}


class WrapEveryOptimizer:
    """A pytest plugin: patches Keras' optimizer classes before the test modules import them,
    and records each test's outcome."""

    def __init__(self):
        self.outcomes = collections.OrderedDict()
        self.errors = {}
        self._patch()

    @staticmethod
    def _patch():
        import keras
        import keras.src.optimizers as package

        import sparse_hvd

        base = keras.src.optimizers.optimizer.Optimizer
        for module_name in SUITES:
            if module_name.startswith("optimizer"):
                continue
            module = __import__(f"keras.src.optimizers.{module_name}", fromlist=["_"])
            for name, cls in list(vars(module).items()):
                if (inspect.isclass(cls) and issubclass(cls, base) and cls is not base
                        and cls.__module__ == module.__name__):
                    factory = _factory(cls, sparse_hvd.SparseDistributedOptimizer)
                    # the real class stays reachable under another name, so that pickle finds
                    # it by reference (pickle checks the module attribute is the class)
                    cls.__qualname__ = f"_unwrapped_{name}"
                    setattr(module, cls.__qualname__, cls)
                    setattr(module, name, factory)
                    if getattr(package, name, None) is cls:
                        setattr(package, name, factory)

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            self.outcomes[report.nodeid] = report.outcome
            if report.outcome == "failed":
                text = str(report.longrepr)
                lines = [line for line in text.splitlines() if line.startswith("E ")]
                self.errors[report.nodeid] = lines[0][1:].strip() if lines else text[:200]


def _factory(cls, wrapper):
    """A subclass of ``cls`` whose construction returns the wrapped optimizer."""

    def make(klass, *args, **kwargs):
        return wrapper(cls(*args, **kwargs), density=1.0, min_elements=0)

    return type(cls.__name__, (cls,), {"__new__": make, "__module__": cls.__module__})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", help="write a Markdown summary here")
    parser.add_argument("-k", help="pytest -k expression")
    args = parser.parse_args()
    import keras

    folder = os.path.dirname(keras.src.optimizers.__file__)
    files = [os.path.join(folder, f"{name}_test.py") for name in SUITES]
    files = [f for f in files if os.path.exists(f)]
    plugin = WrapEveryOptimizer()
    argv = ["-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", folder] + files
    if args.k:
        argv += ["-k", args.k]
    pytest.main(argv, plugins=[plugin])
    counts = collections.Counter(plugin.outcomes.values())
    total = sum(counts.values())
    print(f"\nKeras {keras.__version__} optimizer tests with the wrapper: "
          f"{counts['passed']} passed of {total} ({counts['failed']} failed, "
          f"{counts['skipped']} skipped)")
    by_error = collections.defaultdict(list)
    for nodeid, error in plugin.errors.items():
        by_error[error[:160]].append(nodeid.split("::", 1)[-1])
    for error, tests in sorted(by_error.items(), key=lambda e: -len(e[1])):
        print(f"  {len(tests):3d} x {error}\n        e.g. {tests[0]}")
    failed = [nodeid.split("::", 1)[-1] for nodeid in plugin.errors]
    unexplained = [test for test in failed if test not in STRUCTURAL]
    print(f"  structural (STRUCTURAL): {len(failed) - len(unexplained)}; "
          f"unexplained: {len(unexplained)} {unexplained}")
    if args.report:
        with open(args.report, "w") as f:
            f.write(f"# Keras {keras.__version__}'s optimizer tests with the wrapper\n\n"
                    "`python scripts/conformance/keras_optimizer_suite.py --report "
                    "docs/keras_conformance.md`: every optimizer Keras' own tests build "
                    "(`keras/src/optimizers/*_test.py`) is wrapped as "
                    "`SparseDistributedOptimizer(opt, density=1.0, min_elements=0)`.\n\n"
                    f"**{counts['passed']} passed of {total}** ({counts['failed']} failed, "
                    f"{counts['skipped']} skipped; {len(unexplained)} failures not explained "
                    "below).\n\n| failing test | why | first error line |\n|---|---|---|\n")
            for nodeid, error in plugin.errors.items():
                test = nodeid.split("::", 1)[-1]
                why = STRUCTURAL.get(test, "**unexplained**")
                f.write(f"| `{test}` | {why} | {error.replace('|', '/')[:160]} |\n")
    return 1 if unexplained or not counts["passed"] else 0


if __name__ == "__main__":
    sys.exit(main())
