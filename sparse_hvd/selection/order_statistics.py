"""The k-th largest of a set of values, found by selection: the model-wide budget's cut, the
sampled threshold of ``ApproxTopK``, the band cut of ``exchange="topk_sign2"`` and the sparse
allreduce's cut per variable all need one order statistic, not the k largest values.

On CPU the native ``SparseHvdKthLargest`` (``kernels/kth_largest.cc``: ``std::nth_element``,
or among the entries above a sampled bound where k is small) selects it; where the kernels
are not in use (a GPU visible, ``SPARSE_HVD_NATIVE=0``) or for 16-bit values, TensorFlow ops
give the same value. On the 4.35M MLP at 1% (the model-wide cut: the 2,050th of 205,000
samples) the selection took 0.5 ms a step, ``tf.math.top_k`` 1.7 ms with two threads and
2.7 ms with one.
"""

import tensorflow as tf

from .. import kernels

_NATIVE_DTYPES = (tf.float32, tf.float64)


def kth_largest(values, k):
    """The ``k``-th largest of 1-D ``values`` (1 <= k <= its length), ties counted: the least
    of the k largest."""
    native = kernels.kth_largest() if values.dtype in _NATIVE_DTYPES else None
    if native is not None:
        size = tf.size(values, out_type=tf.int32)
        return native(values, tf.stack([0, size]), tf.reshape(tf.cast(k, tf.int32), [1]))[0]
    return tf.reduce_min(tf.math.top_k(values, k=k, sorted=False).values)


def kth_largest_per_segment(values, cuts, k):
    """Per segment ``values[cuts[v]:cuts[v + 1]]``, its ``k[v]``-th largest (0 where ``k[v]``
    is not within 1 and its length): one selection each natively, else one stable sort of all
    of them by segment, then by value descending. ``cuts[0]`` is 0 and ``cuts[-1]`` the number
    of values (int32, as ``k``)."""
    native = kernels.kth_largest() if values.dtype in _NATIVE_DTYPES else None
    if native is not None:
        return native(values, cuts, k)
    counts = cuts[1:] - cuts[:-1]
    segment = tf.repeat(tf.range(tf.size(counts)), counts)
    descending = tf.argsort(values, direction="DESCENDING", stable=True)
    order = tf.gather(descending, tf.argsort(tf.gather(segment, descending), stable=True))
    ranked = tf.concat([tf.gather(values, order), tf.zeros([1], values.dtype)], 0)
    valid = tf.logical_and(k >= 1, k <= counts)
    at = tf.where(valid, cuts[:-1] + k - 1, tf.size(values))  # the padding 0
    return tf.gather(ranked, at)
