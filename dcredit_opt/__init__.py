"""dcredit-opt: a drop-in distributed optimizer with D-Credit gradient scheduling.

    import dcredit_opt as dc
    dc.init()
    opt = dc.DistributedOptimizer(opt, named_parameters=model.named_parameters())

Horovod's collective API is here too, with Horovod's names and meanings, on
whichever backend runs the job (``collectives/``, ``jobinfo.py``), so that
``import dcredit_opt as hvd`` runs a Horovod script; the Horovod names it
lacks raise ``MissingHorovodName`` saying what to use instead (``missing.py``).

The C++ extension is loaded when an optimizer is built, so the pure-Python
planner (``dcredit_opt.planner``) works without it.
"""

from .collectives import (
    Handle,
    Max,
    Min,
    Product,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    global_process_set,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    poll,
    synchronize,
)
from .compression import Compression
from .config import Config
from .errors import CollectiveError, CollectiveTimeout, DCreditError, MismatchError
from .functions import broadcast_optimizer_state, broadcast_parameters
from .jobinfo import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
    start_timeline,
    stop_timeline,
)
from .missing import MissingHorovodName
from .missing import module_getattr as __getattr__  # noqa: F401 - Horovod names we lack: a clear error
from .optimizer import DistributedOptimizer
from .reduce_ops import Average, ReduceOp, Sum
from .runtime import LaunchError, init, is_initialized, local_rank, rank, shutdown, size

__version__ = "0.1.0"

__all__ = [
    "Average",
    "CollectiveError",
    "CollectiveTimeout",
    "Compression",
    "Config",
    "DCreditError",
    "DistributedOptimizer",
    "Handle",
    "LaunchError",
    "Max",
    "Min",
    "MismatchError",
    "MissingHorovodName",
    "Product",
    "ReduceOp",
    "Sum",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "init",
    "is_homogeneous",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "rocm_built",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
