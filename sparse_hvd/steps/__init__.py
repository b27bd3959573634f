"""How a step runs, chosen once: synchronous, or delayed by ``staleness`` (the delayed
averages' slots and the background pipeline that exchanges them)."""

from .strategies import DelayedStep, SynchronousStep

__all__ = ["DelayedStep", "SynchronousStep"]
