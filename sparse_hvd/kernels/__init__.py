"""Native CPU kernels, compiled against the installed TensorFlow (``sparse_hvd.kernels.build``).

* ``compensate_cut()``: the ``SparseHvdCompensateCut`` op (compensate_cut.cc: error feedback's
  compensate/select/remember for a magnitude cut in one pass over the data);
* ``compensate_topk()``: the ``SparseHvdCompensateTopK`` op (compensate_cut.cc: the same for
  the exact top-k from the candidates above a cut, in one pass plus work on the candidates);
* ``scatter_mean()``: the ``SparseHvdScatterMean`` op (scatter_mean.cc: the gathered entries of
  every variable summed in rank order and divided where they arrived, in one walk);
* ``mean_at_positions()``: the ``SparseHvdMeanAtPositions`` op (scatter_mean.cc: the same
  averages as (positions, values) where entries arrived, no pass over the variable: the update
  cut subtracts them in place);
* ``subtract_at()``: the ``SparseHvdSubtractAt`` op (subtract_at.cc: those averages subtracted
  from the weights in place, the variable taken as TensorFlow's dense training ops take it);
* ``owner_sum()``: the ``SparseHvdOwnerSum`` op (owner_sum.cc: what a sparse allreduce owner
  received, summed in rank order, counted at the threshold's levels and kept, in one pass
  after a merge of two ranks' blocks or a radix sort);
* ``encode_values()`` and ``decode_values()``: the ``SparseHvdEncodeValues`` and
  ``SparseHvdDecodeValues`` ops (value_codec.cc: ``sparse_hvd.exchanges.value_coding``'s code
  in one sequential pass each way, the same words bit for bit);
* ``encode_positions()``, ``encode_entries()`` and ``decode_positions()``: the
  ``SparseHvdEncodePositions``, ``SparseHvdEncodeEntries`` (the code and the values in its
  order) and ``SparseHvdDecodePositions`` ops (index_codec.cc:
  ``sparse_hvd.exchanges.index_coding``'s Elias-Fano code, likewise);
* ``scatter_blocks()``: the ``SparseHvdScatterBlocks`` op (scatter_blocks.cc: the sparse
  allreduce's scatter, every owner's coded block of this rank's entries, in one op);
* ``decode_scatter()`` and ``decode_gather()``: the ``SparseHvdDecodeScatter`` and
  ``SparseHvdDecodeGather`` ops (decode_blocks.cc: every rank's coded blocks of the sparse
  allreduce's scatter, or of its gather, located and decoded in one op);
* ``divide_checked()``: the ``SparseHvdDivideChecked`` op (divide_checked.cc: the dense
  allreduce's sums divided into averages, and whether all are finite, in one pass).
* ``applied()`` and ``unapplied()``: the ``SparseHvdApplied`` and ``SparseHvdUnapplied`` ops
  (applied.cc: the sparse allreduce's kept sums that reach their variable's cut, or their
  averages, with their indices within the variables and a count per variable, in one walk;
  and the values of the entries a rank sent that were not applied, 0 for the others, by one
  merge walk);
* ``add_at()``: the ``SparseHvdAddAt`` op (add_at.cc: values added into a flat tensor at
  indices, in its own buffer when nothing else holds it; the sparse allreduce's unapplied
  entries going back into the residuals, and the ``topk_sign`` exchanges' averaged entries
  added into the averaged signs);
* ``kth_largest()``: the ``SparseHvdKthLargest`` op (kth_largest.cc: the k-th largest value
  of each segment of a flat tensor, by selection; the sparse allreduce's cut per variable);
* ``next_thresholds()``: the ``SparseHvdNextThresholds`` op (next_thresholds.cc: the sparse
  allreduce's cut, next threshold and forecast state for every variable, or for the model as
  one, in one op);
* ``sampled_magnitudes()``: the ``SparseHvdSampledMagnitudes`` op (sampled_magnitudes.cc:
  ``|gradient + residual|`` at the blocks the model-wide budget samples, for every variable
  in one op);
* ``compensate_sign()``, ``sign_pack()`` and ``sign_sum()``: the ``SparseHvdCompensateSign``,
  ``SparseHvdSignPack`` and ``SparseHvdSignSum`` ops (sign_sum.cc, ``exchange="sign"``: error
  feedback's scaled signs in two passes (``packed_compensate_sign()``,
  ``SparseHvdPackedCompensateSign``: the same passes writing the sign bits and scales as they
  travel, where a rank sends its signs); one rank's sign bits and scale in one pass; one
  variable's average from every rank's bits and scale, summed in rank order, in one pass;
  with ``stride=2`` and ``group=2``, ``exchange="topk_sign_pairs"``: one entry of each pair
  packed where it lies, and each pair's average written to both of its entries);
* ``signs_of_rest()``: the ``SparseHvdSignsOfRest`` op (signs_of_rest.cc,
  ``exchange="topk_sign"``: the signs of what the top-k left, and the residual, in two
  passes; with ``group=2`` one sign per pair of entries, ``exchange="topk_sign_pairs"``);
  ``packed_signs_of_rest()``: the ``SparseHvdPackedSignsOfRest`` op (the same passes writing
  the sign bits as they travel and the scale, where a rank sends its signs);
* ``local_adam()`` and ``local_sgd()``: the ``SparseHvdLocalAdam`` and ``SparseHvdLocalSgd``
  ops (local_step.cc, ``sparsify="update"`` with a plain Keras Adam or SGD: this worker's step
  as an update, the optimizer's state written (and Adam's noise estimate applied), in one
  pass, the weights untouched);
* ``apply_adam()``: the ``SparseHvdApplyAdam`` op (apply_adam.cc: a plain Keras Adam's step
  on averaged gradients, the weights and moments written in place in one pass, the variables
  taken as TensorFlow's dense training ops take them);
* ``local_sgd_cut()`` and ``sampled_local_sgd()``: the ``SparseHvdLocalSgdCut`` and
  ``SparseHvdSampledLocalSgd`` ops (local_sgd_cut.cc, the update cut with a plain SGD and the
  model-wide budget: the local step, error feedback and the cut in one pass per variable, and
  the cut's sample with the step computed at the sampled entries only);
* ``time_after()``: the ``SparseHvdTimeAfter`` op (time_after.cc: the clock once a tensor
  exists, an op that automatic control dependencies do not chain to the step's other
  timestamps; ``runtime.stamps``);
* ``watch_enter()``, ``watch_leave()`` and ``watch_table()``: the ``SparseHvdWatchEnter`` and
  ``SparseHvdWatchLeave`` ops and the C functions that read their table (watch.cc: the stall
  watchdog's brackets around a traced step's collectives).

The library is found, or compiled on first use, under a key of the imported TensorFlow (see
``sparse_hvd.kernels.build``: a TensorFlow upgrade leads to a rebuild, never to a stale
library). ``scripts/setup.sh`` compiles it ahead of time; ``pip install`` users get it
compiled the first time a job needs it (about a minute; the ranks of a job build it once).

Each getter returns None when a GPU is visible (these are CPU kernels: on GPU tensors they
would force copies to the host) or when ``SPARSE_HVD_NATIVE=0``; callers then use TensorFlow
ops that compute the same bits more slowly. When the library cannot be built or loaded, the
same fallback is taken with a warning, unless ``SPARSE_HVD_REQUIRE_NATIVE=1`` (CI sets it):
then :class:`NativeKernelsUnavailable` is raised.
"""

import os
import warnings

from . import build


class _State:
    """What this process knows of the library. Attributes of one object, not module globals
    that functions rebind: AutoGraph, when it converts a caller's code in a trace, may convert
    these functions too, and a global it rebinds there was seen to stay unset."""

    loaded = None  # the loaded library; False once a look found none
    path = None  # the loaded library's file
    problem = None  # why the kernels are not in use (None while they are, or before a look)
    table = None  # the library's C functions, through ctypes (``watch_table``)


_state = _State()


class NativeKernelsUnavailable(RuntimeError):
    """SPARSE_HVD_REQUIRE_NATIVE=1 and the native kernels cannot be used."""


def required() -> bool:
    return os.environ.get("SPARSE_HVD_REQUIRE_NATIVE", "0") == "1"


def status():
    """``(library path, None)`` when the kernels are loaded, else ``(None, why not)``; never
    raises (``python -m sparse_hvd.doctor`` reports it)."""
    try:
        library = _library()
    except NativeKernelsUnavailable:
        library = None
    return (_state.path, None) if library is not None else (None, _state.problem)


def _library():
    state = _state
    if state.loaded is None:
        state.loaded = False
        if os.environ.get("SPARSE_HVD_NATIVE", "1") == "0":
            state.problem = "turned off (SPARSE_HVD_NATIVE=0)"
            return None
        import tensorflow as tf

        from ..runtime.startup import gpu_visible

        if gpu_visible():
            state.problem = "a GPU is visible (the TensorFlow path runs on it instead)"
            return None
        try:
            path = build.ensure_built()
            state.loaded, state.path = tf.load_op_library(path), path
        except (build.BuildError, tf.errors.NotFoundError, OSError) as error:
            state.problem = f"cannot be built or loaded: {error}"
            if required():
                raise NativeKernelsUnavailable(
                    f"sparse_hvd's native kernels {state.problem} (SPARSE_HVD_REQUIRE_NATIVE=1)"
                ) from error
            warnings.warn(f"sparse_hvd: the native kernels {state.problem}. Using the slower "
                          "TensorFlow path (python -m sparse_hvd.doctor says more).", stacklevel=3)
    return state.loaded or None


def _op(name):
    """The loaded library's op ``name``, or None when the kernels are not in use."""
    library = _library()
    return None if library is None else getattr(library, name)


def compensate_cut():
    """The native compensate-and-cut op, or None."""
    return _op("sparse_hvd_compensate_cut")


def scatter_mean():
    """The native scatter-and-average op, or None."""
    return _op("sparse_hvd_scatter_mean")


def mean_at_positions():
    """The native op giving each variable's averages only where entries arrived, as
    (positions, values), or None."""
    return _op("sparse_hvd_mean_at_positions")


def subtract_at():
    """The native op subtracting values at flat positions of a resource variable in place, or
    None."""
    return _op("sparse_hvd_subtract_at")


def compensate_topk():
    """The native compensate-and-top-k op, or None."""
    return _op("sparse_hvd_compensate_top_k")


def owner_sum():
    """The native owner-sum op of the sparse allreduce, or None."""
    return _op("sparse_hvd_owner_sum")


def encode_values():
    """The native value-coding op, or None."""
    return _op("sparse_hvd_encode_values")


def decode_values():
    """The native value-decoding op, or None."""
    return _op("sparse_hvd_decode_values")


def encode_positions():
    """The native Elias-Fano coding op, or None."""
    return _op("sparse_hvd_encode_positions")


def encode_entries():
    """The native Elias-Fano coding op that also puts values in the code's order, or None."""
    return _op("sparse_hvd_encode_entries")


def decode_positions():
    """The native Elias-Fano decoding op, or None."""
    return _op("sparse_hvd_decode_positions")


def scatter_blocks():
    """The native sparse allreduce's scatter blocks (``exchanges.sparse_blocks``), or None."""
    return _op("sparse_hvd_scatter_blocks")


def decode_scatter():
    """The native decoding of the blocks an owner of the sparse allreduce received, or None."""
    return _op("sparse_hvd_decode_scatter")


def decode_gather():
    """The native decoding of the sparse allreduce's gathered blocks of kept sums, or None."""
    return _op("sparse_hvd_decode_gather")


def divide_checked():
    """The native divide-and-check op of the dense allreduce, or None."""
    return _op("sparse_hvd_divide_checked")


def add_at():
    """The native add-at-indices op of error feedback, or None."""
    return _op("sparse_hvd_add_at")


def applied():
    """The native op of the sparse allreduce's applied entries, or None."""
    return _op("sparse_hvd_applied")


def unapplied():
    """The native op of the sparse allreduce's unapplied values, or None."""
    return _op("sparse_hvd_unapplied")


def kth_largest():
    """The native k-th-largest-per-segment op of the sparse allreduce, or None."""
    return _op("sparse_hvd_kth_largest")


def next_thresholds():
    """The native op of the sparse allreduce's threshold forecast, or None."""
    return _op("sparse_hvd_next_thresholds")


def sampled_magnitudes():
    """The native op of the model-wide budget's sampled magnitudes, or None."""
    return _op("sparse_hvd_sampled_magnitudes")


def sign_sum():
    """The native sign-summing op of the sign exchange, or None."""
    return _op("sparse_hvd_sign_sum")


def compensate_sign():
    """The native compensate-and-sign op of the sign exchange, or None."""
    return _op("sparse_hvd_compensate_sign")


def packed_compensate_sign():
    """The native compensate-and-sign op writing the signs as they travel (bits and each
    block's scale), or None."""
    return _op("sparse_hvd_packed_compensate_sign")


def sign_pack():
    """The native sign-packing op of the sign exchange, or None."""
    return _op("sparse_hvd_sign_pack")


def signs_of_rest():
    """The native second stage of ``exchange="topk_sign"`` (the rest's signs), or None."""
    return _op("sparse_hvd_signs_of_rest")


def packed_signs_of_rest():
    """The native second stage of ``exchange="topk_sign"`` writing the sign bits as they
    travel (``SignAllgather.pack``'s words and scale), or None."""
    return _op("sparse_hvd_packed_signs_of_rest")


def noise_estimate():
    """The native noise-estimate op of ``second_moment="noise_estimate"``, or None."""
    return _op("sparse_hvd_noise_estimate")


def local_adam():
    """The native local Adam step of ``sparsify="update"`` (``feedback.fused_step``), or None."""
    return _op("sparse_hvd_local_adam")


def apply_adam():
    """The native in-place Adam step on averaged gradients (``feedback.fused_apply``), or
    None."""
    return _op("sparse_hvd_apply_adam")


def local_sgd():
    """The native local SGD step of ``sparsify="update"`` (``feedback.fused_step``), or None."""
    return _op("sparse_hvd_local_sgd")


def local_sgd_cut():
    """The native local SGD step, compensation and model-wide cut in one pass
    (``feedback.fused_cut``), or None."""
    return _op("sparse_hvd_local_sgd_cut")


def sampled_local_sgd():
    """The native ``|update + residual|`` at the model-wide cut's sampled entries, the local
    SGD step computed there only (``feedback.fused_cut``), or None."""
    return _op("sparse_hvd_sampled_local_sgd")


def time_after():
    """The native timestamp ordered by its input alone (``runtime.stamps``), or None."""
    return _op("sparse_hvd_time_after")


def watch_enter():
    """The native stall-watchdog enter op, or None."""
    return _op("sparse_hvd_watch_enter")


def watch_leave():
    """The native stall-watchdog leave op, or None."""
    return _op("sparse_hvd_watch_leave")


def watch_table():
    """The loaded library through ctypes, for its C functions ``sparse_hvd_oldest_wait`` and
    ``sparse_hvd_open_waits`` (the table of the watch ops' waits), or None."""
    if _library() is None:
        return None
    if _state.table is None:
        import ctypes

        library = ctypes.CDLL(_state.path)  # the same file: the same loaded library and table
        library.sparse_hvd_oldest_wait.argtypes = [ctypes.POINTER(ctypes.c_int64)] * 3
        library.sparse_hvd_oldest_wait.restype = ctypes.c_int
        library.sparse_hvd_open_waits.argtypes = []
        library.sparse_hvd_open_waits.restype = ctypes.c_int64
        _state.table = library
    return _state.table
