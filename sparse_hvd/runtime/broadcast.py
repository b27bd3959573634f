"""Making every replica start from the root rank's state, and keeping its local state in step.

Horovod's own ``broadcast_variables`` expects ``tf.Variable``s with unique names; Keras 3
variables are neither (``v.value`` is the underlying tf.Variable, and many share a short name
such as "kernel"). Here the collectives are named by position instead, after a check that every
rank passes the same list, so a model built differently on one rank fails with a message rather
than a hang.
"""

import numbers

import tensorflow as tf

from . import collectives, consistency, startup as runtime


def _tf_variable(variable):
    """The tf.Variable behind a Keras 3 variable (or the tf.Variable itself)."""
    inner = getattr(variable, "value", None)
    return inner if isinstance(inner, tf.Variable) else variable


# Compiled collectives by (kind, name, variables, process set), so that a callback calling
# average_variables every epoch reuses one traced function instead of tracing a new one each
# time. The cached entry holds the variables, so their ids cannot be reused while it exists.
_COMPILED = {}


def _collective_over(kind, what, variables, settings, process_set, name, build):
    """Check that every rank passes the same ``variables``, then run ``build``'s function.

    ``build(targets)`` returns the function (traced once, then reused) that runs the
    collective over the underlying tf.Variables ``targets``.
    """
    consistency.check_same_on_all_ranks(
        what, consistency.describe_variables(variables), settings=settings,
        process_set=process_set, name=f"{name}.check",
    )
    targets = [_tf_variable(v) for v in variables]
    set_id = runtime.process_set_or_global(process_set).process_set_id
    key = (kind, name, tuple(id(t) for t in targets), set_id)
    if key not in _COMPILED:
        # AutoGraph would convert Horovod's Python and ours on the first call (about 90% of
        # the 7-8 s a first broadcast took at 2 ranks); the function has no tensor-dependent
        # control flow to convert
        _COMPILED[key] = (targets, tf.function(build(targets), autograph=False))
    with tf.init_scope():
        _COMPILED[key][1]()


def broadcast_variables(variables, root_rank=0, process_set=None, name="sparse_hvd.from_root"):
    """Overwrite ``variables`` on every rank with their values on ``root_rank``.

    Args:
        variables: Keras 3 variables or tf.Variables, in the same order on every rank.
        root_rank: the rank whose values everyone takes.
        process_set: Horovod process set (the whole job by default).
        name: prefix of the collectives' names; must be the same on every rank.

    Runs eagerly (also when called from inside a traced function).
    """
    variables = list(variables)
    process_set = runtime.as_process_set(process_set)  # an mpi4py communicator too
    if isinstance(root_rank, bool) or not isinstance(root_rank, numbers.Integral):
        raise TypeError(f"`root_rank` must be an int, got {type(root_rank).__name__}")
    size = runtime.size(process_set)
    if not 0 <= root_rank < size:
        raise ValueError(f"`root_rank` must be in [0, {size}) for a job of {size}, got {root_rank}")
    if size == 1 or not variables:
        return

    def build(targets):
        def broadcast_all():
            # One graph: Horovod sees all broadcasts at once and fuses them into few messages.
            for position, variable in enumerate(targets):
                variable.assign(collectives.broadcast(
                    variable, root_rank, name=f"{name}.{position}", process_set=process_set))

        return broadcast_all

    _collective_over(f"broadcast{int(root_rank)}", "the variables to broadcast", variables,
                     {"root_rank": int(root_rank)}, process_set, name, build)


def average_variables(variables, process_set=None, name="sparse_hvd.average"):
    """Replace each of ``variables`` on every rank by its mean over the ranks (eagerly).

    Meant for state each rank updates from its own data, such as BatchNormalization's moving
    mean and variance: after it, every rank holds the same bits. Floating-point variables only.
    """
    variables = list(variables)
    process_set = runtime.as_process_set(process_set)  # an mpi4py communicator too
    for variable in variables:
        if not tf.as_dtype(variable.dtype).is_floating:
            raise TypeError(
                f"average_variables: {getattr(variable, 'path', variable.name)} has dtype "
                f"{variable.dtype}; only floating-point variables can be averaged"
            )
    if runtime.size(process_set) == 1 or not variables:
        return

    def build(targets):
        def average_all():
            averaged = collectives.grouped_allreduce(
                [tf.convert_to_tensor(v) for v in targets], name=name, process_set=process_set)
            for variable, value in zip(targets, averaged):
                variable.assign(value)

        return average_all

    _collective_over("average", "the variables to average", variables, None, process_set, name, build)
