"""dcredit-opt: a drop-in distributed optimizer with D-Credit gradient scheduling.

    import dcredit_opt as dc
    dc.init()
    opt = dc.DistributedOptimizer(opt, named_parameters=model.named_parameters())

Horovod's API is here too (``collectives/``), with Horovod's names and
meanings, on whichever backend runs the job, so that ``import dcredit_opt as
hvd`` runs a Horovod script; the Horovod names it lacks raise
``MissingHorovodName`` saying what to use instead (``collectives/missing.py``).

The C++ extension is loaded when an optimizer is built, so the pure-Python
planner (``dcredit_opt.planner``) works without it.
"""

from . import collectives
from .collectives import *  # Horovod's API: every name in collectives.__all__
from .collectives.missing import module_getattr as __getattr__  # noqa: F401 - Horovod names we lack: a clear error
from .config import Config
from .errors import CollectiveError, CollectiveTimeout, DCreditError, LaunchError, MismatchError
from .optimizer import DistributedOptimizer
from .optimizer.compression import Compression
from .reduce_ops import Adasum, Average, ReduceOp, Sum
from .world.job import init, shutdown
from .world.process_sets import ProcessSet
from .world.runtime import is_initialized, local_rank, rank, size

__version__ = "0.1.0"

__all__ = [
    "Adasum",
    "Average",
    "CollectiveError",
    "CollectiveTimeout",
    "Compression",
    "Config",
    "DCreditError",
    "DistributedOptimizer",
    "LaunchError",
    "MismatchError",
    "ProcessSet",
    "ReduceOp",
    "Sum",
    "init",
    "is_initialized",
    "local_rank",
    "rank",
    "shutdown",
    "size",
]
__all__ += collectives.__all__  # Horovod's API
__all__.sort()
