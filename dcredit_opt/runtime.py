"""Process-level set-up: which world we are in, and the channels we reduce on.

``init()`` adopts whatever launched us: an initialised Horovod (``hvd.init()``
first), horovodrun's variables or ``backend="horovod"`` (Horovod, initialised
here if needed); an already-initialised ``torch.distributed``, torchrun's
``env://`` variables; mpirun/mpiexec's variables or ``backend="mpi"`` (MPI,
with torch.distributed Gloo set up beside it for control); or nothing at all
(a world of one, as Horovod does). State lives in one ``_World`` object that
``shutdown()`` discards, so ``init()`` may be called again afterwards.

The control plane (``all_gather``, ``broadcast_``: the model check, the
broadcast helpers, the plan) runs on Horovod in a Horovod job and on
torch.distributed otherwise, whichever backend carries the blocks.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import sys
import weakref

import torch
import torch.distributed as dist

log = logging.getLogger("dcredit_opt")

_LAUNCH_HELP = (
    "launch with `torchrun --nproc_per_node N train.py` (sets RANK, WORLD_SIZE, LOCAL_RANK, "
    "MASTER_ADDR, MASTER_PORT), or call torch.distributed.init_process_group() before dc.init(), "
    "or run without any launcher variables for a world of one"
)


class LaunchError(RuntimeError):
    """The launcher's environment is incomplete or its rendezvous does not answer."""


@dataclasses.dataclass
class _World:
    rank: int
    size: int
    local_rank: int
    owns_default_group: bool
    timeout_s: float
    channel_groups: list = dataclasses.field(default_factory=list)
    kind: str = "torch"
    """Who set up the world: "torch" (torchrun, the user, or a world of one), "horovod" or "mpi"."""
    hvd: object = None
    """``horovod.torch`` in a Horovod world."""
    owns_horovod: bool = False
    backends_created: int = 0
    """Backends made so far; the same count on every rank (Note [Same order on every rank])."""


_world: _World | None = None
_users: weakref.WeakSet = weakref.WeakSet()


def init(timeout_s: float = 30.0, backend: str | None = None) -> None:
    """Join the job; idempotent. See the module docstring for what is adopted.

    ``backend`` is ``Config.backend`` ("auto", "torch", "horovod", "mpi"; None
    reads ``DCREDIT_BACKEND``); "horovod" and "mpi" also say how to join a job
    whose launcher leaves no trace (``horovodrun --mpi`` looks like mpirun).
    """
    global _world
    if _world is not None:
        return
    if backend is None:
        from .config import Config

        backend = Config.from_env().backend
    kind = _launcher(backend)
    if kind == "horovod":
        from . import launchers

        hvd, owns_hvd = launchers.join_horovod()
        _world = _World(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(), owns_default_group=False,
                        timeout_s=timeout_s, kind="horovod", hvd=hvd, owns_horovod=owns_hvd)
        return
    if kind == "mpi":
        from . import launchers

        _, rank_, size_, local, owns = launchers.join_mpi(timeout_s)
        _world = _World(rank=rank_, size=size_, local_rank=local, owns_default_group=owns, timeout_s=timeout_s,
                        kind="mpi")
        return
    owns = False
    if not dist.is_initialized():
        _init_default_group(timeout_s)
        owns = True
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")))
    _world = _World(rank=dist.get_rank(), size=dist.get_world_size(), local_rank=local,
                    owns_default_group=owns, timeout_s=timeout_s)
    if _world.size == 1 and owns:
        log.info("dcredit_opt: no launcher found, running as a world of one (no communication)")


def _launcher(backend: str) -> str:
    """Who started this job: "horovod", "mpi", or "torch" (torchrun, the user's own init, or nobody)."""
    from . import launchers

    hvd = sys.modules.get("horovod.torch")
    try:
        hvd_up = hvd is not None and hvd.is_initialized()
    except (AttributeError, ValueError):
        hvd_up = False
    if backend == "horovod" or hvd_up or launchers.horovodrun_environment():
        return "horovod"
    if dist.is_initialized() and backend != "mpi":
        return "torch"
    torchrun = any(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    if backend == "mpi" or (not torchrun and launchers.mpi_environment() is not None):
        return "mpi"
    return "torch"


def _init_default_group(timeout_s: float) -> None:
    env = os.environ
    launcher_vars = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    present = [v for v in launcher_vars if v in env]
    backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if not present:
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timeout)
        return
    missing = [v for v in launcher_vars if v not in env]
    if missing:
        raise LaunchError(f"{', '.join(present)} set but {', '.join(missing)} not: {_LAUNCH_HELP}")
    for var in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        if not env[var].isdigit():
            raise LaunchError(f"{var}={env[var]!r} is not a non-negative integer: {_LAUNCH_HELP}")
    if int(env["RANK"]) >= int(env["WORLD_SIZE"]):
        raise LaunchError(f"RANK={env['RANK']} is not below WORLD_SIZE={env['WORLD_SIZE']}: {_LAUNCH_HELP}")
    try:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    except Exception as e:  # the store raises several types for "nobody answered"
        raise LaunchError(
            f"could not join the job at MASTER_ADDR={env['MASTER_ADDR']} MASTER_PORT={env['MASTER_PORT']} "
            f"within {timeout_s:g} s ({type(e).__name__}: {e}); {_LAUNCH_HELP}") from e


def _require() -> _World:
    if _world is None:
        raise RuntimeError("dcredit_opt is not initialised: call dc.init() first")
    return _world


def is_initialized() -> bool:
    return _world is not None


def rank() -> int:
    return _require().rank


def size() -> int:
    return _require().size


def local_rank() -> int:
    return _require().local_rank


def timeout_s() -> float:
    return _require().timeout_s


def kind() -> str:
    """Who set up the world: "torch", "horovod" or "mpi"; ``Config.backend="auto"`` follows it."""
    return _require().kind


def horovod():
    """``horovod.torch``, in a Horovod world."""
    world = _require()
    if world.kind != "horovod":
        raise RuntimeError(f"this is a {world.kind} job, not a Horovod one: call hvd.init() before dc.init(), "
                           "launch with horovodrun, or pass backend='horovod' to dc.init()")
    return world.hvd


def next_backend_id() -> int:
    """A number for a new backend, equal on every rank that builds its optimizers in the same order."""
    world = _require()
    world.backends_created += 1
    return world.backends_created - 1


# ---- the control plane: small collectives outside the scheduler ----------
#
# ``name`` identifies the operation to Horovod, which matches operations
# across ranks by name; it must be the same on every rank, and stable from
# one call to the next so that Horovod's response cache can serve it.

def control_device() -> torch.device:
    """Where control tensors live: the GPU under NCCL, else the CPU."""
    world = _require()
    if world.kind != "horovod" and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather(tensor: torch.Tensor, name: str) -> list:
    """Every rank's ``tensor`` (same shape and dtype on every rank), in rank order."""
    world = _require()
    if world.size == 1:
        return [tensor.clone()]
    if world.kind == "horovod":
        rows = world.hvd.allgather(tensor.reshape(1, -1).contiguous(), name=f"dc.ctl.{name}")
        return [row.reshape(tensor.shape) for row in rows.unbind(0)]
    gathered = [torch.empty_like(tensor) for _ in range(world.size)]
    dist.all_gather(gathered, tensor)
    return gathered


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str) -> None:
    """Overwrite the contiguous ``tensor`` (on ``control_device()``) with ``root_rank``'s, in place."""
    world = _require()
    if world.size == 1:
        return
    if world.kind == "horovod":
        if tensor.numel():
            # As bytes: exact, and independent of which dtypes Horovod supports.
            world.hvd.broadcast_(tensor.view(-1).view(torch.uint8), root_rank, name=f"dc.ctl.{name}")
        return
    dist.broadcast(tensor, src=root_rank)


def channel_groups(count: int) -> list:
    """``count`` process groups over all ranks, created collectively on first use.

    Every rank creates them in the same order, so channel ``c`` is the same
    communicator everywhere (Note [Same order on every rank]). They inherit
    the default group's backend; for NCCL see Note [NCCL channels] in
    ``backends/torch_dist.py``.
    """
    world = _require()
    if not dist.is_initialized():
        raise LaunchError(f"backend 'torch' needs torch.distributed, which this {world.kind} job does not use: "
                          f"pass Config(backend='{world.kind}') or 'auto', or launch with torchrun")
    timeout = datetime.timedelta(seconds=world.timeout_s)
    while len(world.channel_groups) < count:
        world.channel_groups.append(dist.new_group(ranks=list(range(world.size)), timeout=timeout))
    return world.channel_groups[:count]


def register_user(obj) -> None:
    """``obj`` (a DistributedOptimizer) uses our channels; ``shutdown()`` closes it first."""
    _users.add(obj)


def shutdown() -> None:
    """Leave the job: close every optimizer, drop our channels, and the default group if we created it.

    Optimizers are closed first: after a lazy ``step()`` their last blocks are
    still travelling, and destroying the channels under them would cut off
    the peers that are still reducing those blocks.
    """
    global _world
    for user in list(_users):
        user._dc_close()
    _users.clear()
    world, _world = _world, None
    if world is None:
        return
    for group in world.channel_groups:
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError):
            pass  # already gone with the default group
    if world.owns_default_group and dist.is_initialized():
        dist.destroy_process_group()
    if world.owns_horovod:
        world.hvd.shutdown()
