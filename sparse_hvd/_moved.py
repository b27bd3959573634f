"""Old import paths of the modules that moved into sub-packages, kept working.

Until this release every module sat directly in ``sparse_hvd/``; users may have imported some
of them (``from sparse_hvd.density import WarmupDensity``, ``sparse_hvd.sparsifiers``). A
finder on ``sys.meta_path`` answers each old name with the module at its new place (the same
module object, so ``isinstance`` checks and patches agree), imported on first use.
"""

import importlib
import importlib.abc
import importlib.util
import sys

# old name -> new name, both under sparse_hvd
MOVED = {
    "accumulation": "feedback.accumulation",
    "adaptive": "selection.adaptive",
    "averaging": "exchanges.averaging",
    "broadcast": "runtime.broadcast",
    "callbacks": "monitoring.callbacks",
    "clipping": "feedback.clipping",
    "collectives": "runtime.collectives",
    "compression": "exchanges.compression",
    "consistency": "runtime.consistency",
    "data": "runtime.data",
    "defaults": "selection.defaults",
    "density": "selection.density",
    "error_feedback": "feedback.error_feedback",
    "exchange_choice": "steps.measured",
    "lockstep": "runtime.lockstep",
    "log": "runtime.log",
    "loss_scaling": "feedback.loss_scaling",
    "model_budget": "selection.model_budget",
    "monitor": "monitoring.monitor",
    "nonfinite": "feedback.nonfinite",
    "payload": "feedback.payload",
    "pipeline": "steps.pipeline",
    "routing": "selection.routing",
    "sparsifiers": "selection.sparsifiers",
    "staleness": "steps.staleness",
    "stats": "monitoring.stats",
    "watchdog": "runtime.watchdog",
    "wire": "exchanges.wire",
}
# ``sparse_hvd.runtime`` and ``sparse_hvd.steps`` are packages now that re-export what the
# modules of those names held.


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, package):
        self.package = package

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, old = fullname.rpartition(".")
        if prefix == self.package and old in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        module = importlib.import_module(f"{self.package}.{MOVED[spec.name.rpartition('.')[2]]}")
        spec.loader_state = module.__spec__  # the import system replaces it: see exec_module
        return module

    def exec_module(self, module):
        """The module was executed at its new place. Loading it under the old name set its
        ``__spec__`` to the old name's, whose parent is not its ``__package__``: its relative
        imports would then raise an ImportWarning (an error under ``-W error``), so its own
        spec is put back."""
        module.__spec__ = module.__spec__.loader_state


def install(package):
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules(package))
