"""The optimizer: the drop-in wrapper (``wrapper.py``) and the objects that own its state, composed by its
core (``core.py``); see docs/design.md."""

from .wrapper import DistributedOptimizer, reduce_op

__all__ = ["DistributedOptimizer", "reduce_op"]
