"""How one block's collective is launched and completed.

The scheduler, windows and plans are the same for every backend
(``csrc/core``). A backend supplies the engine that launches blocks:

- ``torch``: torch.distributed process groups (Gloo, NCCL), launched and
  completed entirely in C++ (``_C.Engine.torch``); one process group per
  channel.
- ``horovod`` (``horovod.py``) and ``mpi`` (mpi4py, ``mpi.py``): their
  collectives are reachable only from Python, so they use
  ``_C.Engine.manual``: the scheduler still decides every launch, a driver
  thread takes launches in order (``next_launch``) and starts them, and a
  completer thread reports completions (``complete``); see Note
  [Python-driven backend] in ``driven.py``.

What every backend offers is ``base.Backend``, a protocol; what only some do
is a protocol of its own (``base.DelayedSums``).

A backend serves one optimizer and owns its channels (process groups, MPI
communicators, Horovod names), made when it is built and released when it
closes: several optimizers in one process launch independently of each
other, so they must never share one.

"auto" follows whoever set up the world (``runtime.kind()``): in a Horovod
job on CPUs, torch.distributed process groups of our own beside Horovod (the
C++ path, Note [C++ channels under Horovod] in ``world/channels.py``;
``backend="horovod"`` keeps Horovod's operations, and so does a Horovod job
on GPUs, whose NCCL channels beside Horovod are not built), mpi4py in a job
that mpirun/mpiexec started and dcredit_opt joined (the user launched with
MPI, so MPI carries the gradients; pass "torch" for Gloo's C++ path
instead), torch.distributed otherwise.
"""

from __future__ import annotations

from ..config import BACKENDS
from ..errors import DCreditError
from ..world import channels, runtime
from .base import Backend
from .horovod import HorovodBackend
from .mpi import MPIBackend
from .torch_dist import TorchDistBackend


def create(name: str, channels: int, timeout_s: float, members=None, *, device_windows: bool = False,
           reduction: str = "sum") -> Backend:
    """The backend called ``name`` ("auto" picks the one the job was launched with), over ``members`` (the ranks
    of a process set, ``process_sets``: its channels and control plane, and Horovod's set for the Horovod
    backend; None: every rank). ``device_windows``: ``Config.device_windows``, for the torch backend's CUDA blocks
    (the others have none). ``reduction``: what every block's collective does, "sum", "min", "max" or "product"
    (Note [Reduce ops] in reduce_ops.py)."""
    if name == "auto":
        name = detect(members)
    if name == "torch":
        return TorchDistBackend(channels, timeout_s, members, device_windows=device_windows, reduction=reduction)
    if name == "horovod":
        if members is not None and not members.everyone and members.horovod_set is None and members.size > 1:
            raise DCreditError(f"process_set={members.ranks}: blocks on Horovod's operations (Config(backend="
                               "'horovod')) need Horovod's process set (hvd.add_process_set); Config(backend='torch') "
                               "reduces over the set on Gloo channels of its own")
        return HorovodBackend(channels, timeout_s, members, reduction=reduction)
    if name == "mpi":
        return MPIBackend(channels, timeout_s, members, reduction=reduction)
    raise ValueError(f"unknown backend {name!r}; known backends: auto, {', '.join(BACKENDS)}")


def detect(members=None) -> str:
    """The backend of the launcher that set up the world (see the module docstring); under Horovod on CPUs,
    process groups of our own beside it (Note [C++ channels under Horovod] in world/channels.py), decided among
    ``members`` (a process set's ranks) or every rank."""
    kind = runtime.kind()
    if kind == "horovod" and (channels.horovod_on_cpu() if members is None else members.on_cpu()):
        return "torch"
    return kind
