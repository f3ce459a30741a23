"""Horovod's API for a script, on whichever world runs the job: the collective operations
(``core.py``, ``allreduce.py``, ``gather.py``), the broadcast helpers (``functions.py``), what a
script asks about its job (``jobinfo.py``), and the names we lack (``missing.py``).

    import dcredit_opt as hvd          # a Horovod script, unchanged
    hvd.init()
    loss = hvd.allreduce(torch.tensor(loss), name="avg_loss").item()

Names, arguments and meanings are Horovod's (``horovod.torch``, 0.28):
``allreduce`` averages by default (``op=Sum``, ``Min``, ``Max``, ``Product``;
``Adasum``, an all-gather then Note [Adasum]: ``adasum.py``; the legacy ``average=``), with ``prescale_factor``/``postscale_factor`` and
``compression``; the ``_`` forms work in place; the ``_async`` forms return a
handle for ``poll`` and ``synchronize``; ``allgather`` concatenates along
dimension 0, whose length may differ between ranks; ``allreduce``,
``allgather`` and ``broadcast`` are differentiable, as Horovod's are.

Note [Collectives beside the optimizer]
---------------------------------------
- Under Horovod (``runtime.kind() == "horovod"``) every operation is
  Horovod's own, matched by name in its negotiation. Its allreduce lacks 8-
  and 16-bit integers and bfloat16: those are reduced as int32 / float32
  and cast back; allgather and broadcast move bytes, exact for any dtype.
- Otherwise they run on torch.distributed's default group: torchrun's, the
  user's, or the Gloo group that ``init()`` sets up beside an MPI job
  (``launchers.join_mpi``), which is also the control plane's. An
  optimizer's blocks never use that group (they have channels of their
  own), so these never pair up with blocks. Operations are matched by
  order, so every rank calls them in the same order (Horovod only needs
  the same names).
- ``process_set=`` runs an operation over some of the ranks, as in
  Horovod: under Horovod, Horovod's own operation on its set
  (``hvd.add_process_set``; ours is refused there, naming Horovod's);
  otherwise on a Gloo group of ours over the set's ranks
  (``dc.ProcessSet(ranks)``, a list of ranks, or a torch.distributed
  group), connected at the set's first operation and kept until
  ``shutdown()`` (Note [Process sets] in ``world/process_sets.py``: the
  set's ranks meet in the store, so a rank that calls on another set, or
  never calls, ends in a clear error within ``timeout_s``). Only the set's
  ranks call it; a rank outside the set gets a ``DCreditError`` naming
  ``process_set``. ``root_rank`` stays a global rank (Horovod's meaning),
  and must be one of the set's.
- Before each operation the ranks all-gather a small descriptor of it
  (operation, op, root, dtype, shape, name: ``describe``). Ranks that
  disagree all raise the same ``ValueError``, naming the ranks and what
  differs, instead of a hang or a wrong result; and ``allgather`` learns
  every rank's first dimension. That exchange is synchronous: an ``_async``
  call returns once every rank has made it, then the data moves in the
  background.
- Every wait has a deadline, ``runtime.timeout_s()`` (``init(timeout_s=)``):
  a peer that never calls raises ``TimeoutError`` instead of hanging.
  Horovod's ``synchronize`` has no deadline, so its handles are polled,
  with a sleep that grows to 10 ms: these are a script's metrics and checks,
  not the gradient path.
  Under NCCL a wait makes the stream wait, and the copy of the result to
  the CPU is what blocks: NCCL's own watchdog (the group's timeout, which
  is ``timeout_s`` when dcredit_opt created the group) bounds that.
- After a timeout the operation is still pending in the backend, so later
  collectives cannot be trusted: the error says to end the job. How the
  process then exits is the launcher's (MPI may abort it at exit).
"""

from .allreduce import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
)
from .core import Handle, Max, Min, Product, global_process_set, poll, synchronize
from .functions import broadcast_optimizer_state, broadcast_parameters
from .gather import (
    allgather,
    allgather_async,
    allgather_object,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    grouped_allgather,
    grouped_allgather_async,
)
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

__all__ = [
    "Handle",
    "Max",
    "Min",
    "MissingHorovodName",
    "Product",
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
    "is_homogeneous",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rocm_built",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
