"""How one block's collective is launched and completed.

The scheduler, windows and plans are the same for every backend
(``csrc/core``). A backend supplies the engine that launches blocks:

- ``torch``: torch.distributed process groups (Gloo, NCCL), launched and
  completed entirely in C++ (``_C.Engine.torch``); one process group per
  channel.
- Backends whose collectives are reachable only from Python (Horovod,
  mpi4py) use ``_C.Engine.manual``: the scheduler still decides every launch,
  and a driver thread of the backend takes launches in order
  (``next_launch``), starts them, and reports completions (``complete``).
"""

from __future__ import annotations

from .torch_dist import TorchDistBackend

KNOWN = ("torch", "horovod", "mpi")


def create(name: str, channels: int, timeout_s: float):
    """The backend called ``name`` ("auto" picks the one the job was launched with)."""
    if name == "auto":
        name = detect()
    if name == "torch":
        return TorchDistBackend(channels, timeout_s)
    if name == "horovod":
        from .horovod import HorovodBackend

        return HorovodBackend(channels, timeout_s)
    if name == "mpi":
        from .mpi import MPIBackend

        return MPIBackend(channels, timeout_s)
    raise ValueError(f"unknown backend {name!r}; known backends: auto, {', '.join(KNOWN)}")


def detect() -> str:
    """The backend the job was launched with; torch.distributed unless Horovod is initialised."""
    import sys

    hvd = sys.modules.get("horovod.torch")
    if hvd is not None:
        try:
            if hvd.is_initialized():
                return "horovod"
        except (AttributeError, ValueError):
            pass
    return "torch"
