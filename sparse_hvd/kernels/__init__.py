"""Optional native CPU kernels, compiled against the installed TensorFlow by scripts/setup.sh.

* ``compensate_cut()``: the ``SparseHvdCompensateCut`` op (compensate_cut.cc: error feedback's
  compensate/select/remember for a magnitude cut in one pass over the data);
* ``compensate_topk()``: the ``SparseHvdCompensateTopK`` op (compensate_cut.cc: the same for
  the exact top-k from the candidates above a cut, in one pass plus work on the candidates);
* ``scatter_mean()``: the ``SparseHvdScatterMean`` op (scatter_mean.cc: the gathered entries of
  every variable summed in rank order and divided where they arrived, in one walk).

Each returns None when the library was not built here, or when a GPU is visible (these are CPU
kernels: on GPU tensors they would force copies to the host); callers then use TensorFlow ops
that compute the same bits more slowly. ``SPARSE_HVD_NATIVE=0`` turns the kernels off.
"""

import os
import warnings

LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sparse_hvd_kernels.so")

_loaded = None


def _library():
    global _loaded
    if _loaded is None:
        _loaded = False
        if os.environ.get("SPARSE_HVD_NATIVE", "1") != "0" and os.path.exists(LIBRARY):
            import tensorflow as tf

            if tf.config.list_physical_devices("GPU"):
                return None

            try:
                _loaded = tf.load_op_library(LIBRARY)
            except (tf.errors.NotFoundError, OSError) as error:
                warnings.warn(
                    f"sparse_hvd: cannot load {LIBRARY} ({error}); run scripts/setup.sh to "
                    "rebuild it. Using the slower TensorFlow path.",
                    stacklevel=3,
                )
    return _loaded or None


def compensate_cut():
    """The native compensate-and-cut op, or None."""
    library = _library()
    return None if library is None else library.sparse_hvd_compensate_cut


def scatter_mean():
    """The native scatter-and-average op, or None."""
    library = _library()
    return None if library is None else library.sparse_hvd_scatter_mean


def compensate_topk():
    """The native compensate-and-top-k op, or None."""
    library = _library()
    return None if library is None else library.sparse_hvd_compensate_top_k
