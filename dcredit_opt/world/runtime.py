"""Which world we are in: its ranks, who set it up, and its timeout (``job.init()`` makes it, ``job.shutdown()``
discards it, so ``init()`` may be called again afterwards)."""

from __future__ import annotations

import dataclasses

from ..errors import DCreditError


@dataclasses.dataclass
class World:
    rank: int
    size: int
    local_rank: int
    owns_default_group: bool
    timeout_s: float
    channel_groups: list = dataclasses.field(default_factory=list)
    """Process groups made by ``channel_groups()`` and not destroyed yet; ``shutdown()`` destroys them."""
    kind: str = "torch"
    """Who set up the world: "torch" (torchrun, the user, or a world of one), "horovod" or "mpi"."""
    hvd: object = None
    """``horovod.torch`` in a Horovod world."""
    owns_horovod: bool = False
    backends_created: int = 0
    """Backends (and re-planners) over every rank made so far; the same count on every rank (Note [Same order on
    every rank]): each names its Horovod operations with its number."""
    on_cpu: bool | None = None
    """In a Horovod job: whether it runs on CPUs, decided by every rank together (``horovod_on_cpu()``)."""
    store: object = None
    """Under MPI and Horovod: our own rendezvous store, for groups of our own (Note [Private groups] in
    ``groups.py``); None where torch.distributed's default group serves (torchrun, or the script's own)."""
    group: object = None
    """The control plane's group: ours over every rank with ``store``, else None (the default group)."""
    groups_made: int = 0
    """Groups made on ``store`` so far; the same count on every rank, so each has the same name everywhere."""
    set_planes: dict = dataclasses.field(default_factory=dict)
    """The process sets the collectives' ``process_set=`` ran on, by their ranks (``process_sets.for_collectives``);
    ``shutdown()`` closes them."""


_world: World | None = None


def enter(world: World) -> World:
    """``world`` becomes the one we are in (``job.init()``)."""
    global _world
    _world = world
    return world


def leave() -> World | None:
    """We are in no world any more (``job.shutdown()``); the one we were in, if any."""
    global _world
    world, _world = _world, None
    return world


def current() -> World:
    """The world we are in; a ``DCreditError`` before ``init()``."""
    if _world is None:
        raise DCreditError("dcredit_opt is not initialised: call dc.init() first")
    return _world


def is_initialized() -> bool:
    return _world is not None


def rank() -> int:
    return current().rank


def size() -> int:
    return current().size


def local_rank() -> int:
    return current().local_rank


def timeout_s() -> float:
    return current().timeout_s


def kind() -> str:
    """Who set up the world: "torch", "horovod" or "mpi"; ``Config.backend="auto"`` follows it."""
    return current().kind


def require_world(fn: str) -> str:
    """:func:`kind`, for ``fn`` of the Horovod-style API: a ValueError naming ``fn`` before ``init()``."""
    if not is_initialized():
        raise ValueError(f"{fn}() called before init(): call hvd.init() (dcredit_opt.init()) first")
    return kind()


def horovod():
    """``horovod.torch``, in a Horovod world."""
    world = current()
    if world.kind != "horovod":
        raise DCreditError(f"this is a {world.kind} job, not a Horovod one: call hvd.init() before dc.init(), "
                           "launch with horovodrun, or pass backend='horovod' to dc.init()")
    return world.hvd


def next_backend_id() -> int:
    """A number for a new backend (or re-planner) over every rank, equal on every rank that builds its optimizers
    in the same order."""
    world = current()
    world.backends_created += 1
    return world.backends_created - 1
