"""Exchanges: how a step's payload moves between the workers and becomes averaged gradients.

One module per exchange, each a subclass of :class:`~sparse_hvd.exchanges.base.Exchange`
registered under the name ``exchange=`` takes and the ``grouping`` it runs:

============================  ===========  =========================================
``exchange``                  grouping     module
============================  ===========  =========================================
``"allgather"``               grouped      ``fused_allgather``: one grouped allgather
``"allgather"``               layerwise    ``layerwise``: an allgather pair per variable
``"compact_allgather"``       grouped      ``compact_allgather``: indices and values coded
``"compact_allgather"``       layerwise    ``layerwise``: the same, one per variable
``"sparse_allreduce"``        grouped      ``sparse_allreduce``: regions summed by owners,
                                           blocks coded (``sparse_blocks``)
``"sparse_allreduce"``        layerwise    ``sparse_allreduce``: the same, one per variable
``"plain_sparse_allreduce"``  both         ``sparse_allreduce``: int32 indices, raw values
``"dense"``                   both         ``dense``: Horovod's allreduce of every gradient
``"sign"``                    grouped      ``sign``: every entry's sign and a scale per
                                           64 entries, one allgather (chooses its entries)
``"sign_per_variable"``       grouped      ``sign``: the same, one scale per variable
``"topk_sign"``               grouped      ``topk_sign``: the top-k entries and the signs of
                                           the rest, one allgather
``"topk_sign2"``              grouped      ``topk_sign``: the same with two levels of signs
``"topk_sign_pairs"``         grouped      ``topk_sign``: the same with one sign for each
                                           pair of entries
============================  ===========  =========================================

``sparse_hvd.checks`` reads the classes' capabilities (``per_layer``, ``layer_budgets``,
``compression_capable``, ``staleness``, ``returns_unsent``, ``sends_selections``,
``auto_candidate``, ``chooses_entries``, ``code``), never their names. To add an exchange:
write a module with a subclass of ``Exchange`` that implements ``_average_many`` (and
``traced`` and ``_announce`` for the lockstep check; build its header with ``base.header``),
declare its capabilities, decorate it with ``@register("name", grouping=...)``, and import
the module below. The README's developer section walks through it.
"""

from . import (compact_allgather, dense, fused_allgather, layerwise,  # noqa: F401 (registration)
               sign, sparse_allreduce, topk_sign)
from .base import (DENSE_GATHER_LIMIT, Averaged, Exchange, available, create, exchange_class,
                   groupings_of, register)

__all__ = ["Averaged", "Exchange", "DENSE_GATHER_LIMIT", "available", "create",
           "exchange_class", "groupings_of", "register"]
