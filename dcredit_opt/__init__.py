"""dcredit-opt: a drop-in distributed optimizer with D-Credit gradient scheduling.

    import dcredit_opt as dc
    dc.init()
    opt = dc.DistributedOptimizer(opt, named_parameters=model.named_parameters())

The C++ extension is loaded when an optimizer is built, so the pure-Python
planner (``dcredit_opt.planner``) works without it.
"""

from .config import Config
from .errors import DCreditError
from .functions import broadcast_optimizer_state, broadcast_parameters
from .optimizer import Average, DistributedOptimizer, ReduceOp, Sum
from .runtime import LaunchError, init, is_initialized, local_rank, rank, shutdown, size

__version__ = "0.1.0"

__all__ = [
    "Average",
    "Config",
    "DCreditError",
    "DistributedOptimizer",
    "LaunchError",
    "ReduceOp",
    "Sum",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "init",
    "is_initialized",
    "local_rank",
    "rank",
    "shutdown",
    "size",
]
