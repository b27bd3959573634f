"""How a step runs, chosen once: synchronous, synchronous with the exchange timed fastest
(``exchange="auto"``), or delayed by ``staleness`` (the delayed
averages' slots and the background pipeline that exchanges them)."""

from .measured import MeasuredChoiceStep
from .strategies import DelayedStep, SynchronousStep

__all__ = ["DelayedStep", "MeasuredChoiceStep", "SynchronousStep"]
