"""Checks that every rank is about to do the same thing, before a collective could hang on it.

Horovod matches collectives by name and waits, without limit, for a name that one rank never
submits. A model built differently on one rank (another layer width, one variable more) would
therefore hang the job or, worse, exchange mismatched tensors. Each check here gathers a small
description from every rank first (a single collective whose shape does not depend on the
model) and raises the same error on every rank when the descriptions differ.
"""

from . import collectives

_NAME_HINT = (
    " (the optimizer's collectives are named after it, and Keras numbers automatic names in the "
    "order optimizers are created in each process: create the same optimizers on every rank, "
    "or pass name=... explicitly)"
)


def describe_variables(variables):
    """A picklable description of a variable list: (path or name, shape, dtype) per variable."""
    described = []
    for variable in variables:
        label = getattr(variable, "path", None) or getattr(variable, "name", "?")
        described.append((str(label), tuple(int(d) for d in variable.shape), str(variable.dtype)))
    return described


def _first_difference(reference, other, other_rank):
    """A sentence naming the first place where rank 0's and ``other_rank``'s descriptions differ."""
    if len(reference) != len(other):
        return f"rank 0 has {len(reference)} variables, rank {other_rank} has {len(other)}"
    for position, (mine, theirs) in enumerate(zip(reference, other)):
        if mine[1:] != theirs[1:]:
            return (
                f"variable #{position} is {mine[0]} {mine[1]} {mine[2]} on rank 0 "
                f"but {theirs[0]} {theirs[1]} {theirs[2]} on rank {other_rank}"
            )
    return None


def check_same_on_all_ranks(what, description, settings=None, process_set=None, name=None):
    """Raise ValueError on every rank unless all ranks pass equal ``description`` and ``settings``.

    Args:
        what: what is being checked, for the message (e.g. "the optimizer's variables").
        description: output of :func:`describe_variables` for this rank.
        settings: an optional dict of hyper-parameters that must also agree (e.g. density).
        process_set: the Horovod process set whose ranks take part.
        name: the collective's name; must be the same on every rank.
    """
    mine = (description, settings or {})
    everyone = collectives.allgather_object(mine, name=name or "sparse_hvd.consistency", process_set=process_set)
    problems = []
    reference_description, reference_settings = everyone[0]
    for other_rank, (other_description, other_settings) in enumerate(everyone[1:], start=1):
        difference = _first_difference(reference_description, other_description, other_rank)
        if difference:
            problems.append(difference)
        for key in sorted(set(reference_settings) | set(other_settings)):
            mine, theirs = reference_settings.get(key), other_settings.get(key)
            if mine != theirs:
                problems.append(f"{key} is {mine!r} on rank 0 but {theirs!r} on rank {other_rank}"
                                + (_NAME_HINT if key == "name" else ""))
    if problems:
        raise ValueError(
            f"sparse_hvd: {what} differ between ranks, so their gradients cannot be exchanged. "
            "Every rank must build the same model with the same optimizer settings. "
            + "; ".join(problems)
        )
