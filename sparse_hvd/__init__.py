"""sparse_hvd: sparse gradient exchange with error feedback for Keras 3 over Horovod.

Change one line of a Keras training script::

    opt = sparse_hvd.SparseDistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), density=0.01)

and launch it with ``horovodrun``, ``mpirun`` or ``srun``.
"""

__version__ = "0.1.0"

from .runtime import allocator

allocator.prefer_pooled()  # before TensorFlow makes its CPU allocator (runtime/allocator.py)

from . import _moved  # noqa: E402

_moved.install(__name__)  # the old module paths (sparse_hvd.density, ...) keep working


from .runtime.broadcast import average_variables, broadcast_variables
from .monitoring.callbacks import (
    AverageNonTrainableCallback,
    BroadcastGlobalVariablesCallback,
    MetricAverageCallback,
    ShareResidualsCallback,
)
from .runtime.data import equal_shards, steps_per_epoch
from .optimizer import SparseDistributedOptimizer
from .steps.traced_choice import ExchangeChoiceCallback, function
from .runtime.startup import init, local_rank, rank, size
from .selection.adaptive import AdaptiveDensity
from .selection.density import ConstantDensity, WarmupDensity
from .monitoring.monitor import CommunicationLogger
from .selection.sparsifiers import (
    ApproxTopK,
    RandomK,
    Selection,
    Sparsifier,
    Threshold,
    TopK,
    available_sparsifiers,
    get_sparsifier,
    register_sparsifier,
)

__all__ = [
    "SparseDistributedOptimizer",
    "BroadcastGlobalVariablesCallback",
    "MetricAverageCallback",
    "AverageNonTrainableCallback",
    "CommunicationLogger",
    "ShareResidualsCallback",
    "ExchangeChoiceCallback",
    "function",
    "broadcast_variables",
    "equal_shards",
    "steps_per_epoch",
    "average_variables",
    "init",
    "rank",
    "size",
    "local_rank",
    "Selection",
    "Sparsifier",
    "TopK",
    "ApproxTopK",
    "RandomK",
    "Threshold",
    "ConstantDensity",
    "WarmupDensity",
    "AdaptiveDensity",
    "available_sparsifiers",
    "get_sparsifier",
    "register_sparsifier",
]
