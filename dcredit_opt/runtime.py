"""Process-level set-up: which world we are in, and the channels we reduce on.

``init()`` adopts whatever launched us: an already-initialised
``torch.distributed``, torchrun's ``env://`` variables, or nothing at all (a
world of one, as Horovod does). State lives in one ``_World`` object that
``shutdown()`` discards, so ``init()`` may be called again afterwards.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os

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


_world: _World | None = None


def init(timeout_s: float = 30.0) -> None:
    """Join the job; idempotent. See the module docstring for what is adopted."""
    global _world
    if _world is not None:
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


def channel_groups(count: int) -> list:
    """``count`` process groups over all ranks, created collectively on first use.

    Every rank creates them in the same order, so channel ``c`` is the same
    communicator everywhere (Note [Same order on every rank]).
    """
    world = _require()
    timeout = datetime.timedelta(seconds=world.timeout_s)
    while len(world.channel_groups) < count:
        world.channel_groups.append(dist.new_group(ranks=list(range(world.size)), timeout=timeout))
    return world.channel_groups[:count]


def shutdown() -> None:
    """Leave the job: drop our channels, and the default group if we created it."""
    global _world
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
