"""Channels: each backend's own process groups (``channel_groups``; one backend per ``DistributedOptimizer``,
Note [Same order on every rank]), and torch.distributed set up beside a Horovod job for them (Note [C++
channels under Horovod]).

Channels are not shared: each backend makes its own and destroys them when it closes. Two optimizers'
dispatch threads launch independently, so on shared channels their collectives would pair up across ranks by
timing rather than by block.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from ..errors import LaunchError
from . import groups, launchers, peers, runtime
from .control import all_gather, broadcast_, control_device
from .peers import at_rank

log = logging.getLogger("dcredit_opt")


def private_group(world: runtime.World, name: str, what: str, ranks: list | None = None):
    """A group of ours on ``world.store`` (Note [Private groups] in groups.py) over ``ranks`` (all by default),
    named ``name``; collective over those ranks."""
    ranks = list(range(world.size)) if ranks is None else ranks
    try:
        return groups.private_group(world.store, name, ranks.index(world.rank), len(ranks), world.timeout_s)
    except RuntimeError as e:  # the store or Gloo: a peer is gone, or the timeout passed
        raise LaunchError(f"rank {world.rank} of {world.size}, {what}: could not connect a group of ranks "
                          f"{ranks} within {world.timeout_s:g} s ({type(e).__name__}: {e})") from e


def channel_groups(count: int, backend: str | None = None) -> list:
    """``count`` new process groups over all ranks: one backend's channels, its own.

    Collective: every rank calls it in the same order (backends are built
    when optimizers are, Note [Same order on every rank]), so the k-th group
    made is the same communicator everywhere. Each new group then runs one
    tiny all-reduce, here on the training thread: under NCCL that creates its
    communicator now, in channel order, rather than at the first launch on
    whichever dispatch thread gets there first (Note [NCCL channels]); under
    Gloo the group is already connected and this costs one round trip.

    The groups inherit the default group's backend unless ``backend`` names
    one ("gloo": a CPU group beside NCCL ones). The caller owns them and
    gives them back with ``destroy_channel_groups``; ``shutdown()`` destroys
    any still left.
    """
    world = runtime.current()
    if world.store is None and not dist.is_initialized() and world.kind == "horovod":
        _torch_beside_horovod(world)
    if world.store is None and not dist.is_initialized():
        raise LaunchError(f"backend 'torch' needs torch.distributed, which this {world.kind} job does not use: "
                          f"pass Config(backend='{world.kind}') or 'auto', or launch with torchrun")
    timeout = datetime.timedelta(seconds=world.timeout_s)
    made = []
    try:
        for _ in range(count):
            if world.store is not None:  # Note [Private groups] in groups.py: Gloo, on our store
                made.append(private_group(world, f"channels/{world.groups_made}", "making a channel"))
                world.groups_made += 1
            else:
                made.append(dist.new_group(ranks=list(range(world.size)), timeout=timeout, backend=backend))
            world.channel_groups.append(made[-1])  # destroyed at shutdown() even if a later one fails
        device = torch.device("cpu") if backend == "gloo" or world.store is not None else control_device()
        for group in made:
            dist.all_reduce(torch.zeros(1, device=device), group=group)
    except RuntimeError as e:  # torch's DistBackendError: a peer is gone, or the timeout passed
        raise at_rank(e, f"making this optimizer's process groups ({len(made)} of {count} made)") from e
    return made


def _torch_beside_horovod(world: runtime.World) -> None:
    """Note [C++ channels under Horovod]: a store of our own over a Horovod job's ranks, for Gloo groups.

    Blocks on Horovod's Python API pay two Python calls and a negotiation
    cycle each, on two busy cores; blocks on c10d process groups are launched
    and completed in C++, as under torchrun. So in a Horovod job on CPUs the
    "auto" backend carries gradient blocks on process groups of our own, and
    the script keeps Horovod for everything else (its own allreduce,
    broadcasts, metrics). The rendezvous goes through one Horovod broadcast
    (``launchers.rendezvous_store``); the groups are ours alone, outside
    torch.distributed's default group (Note [Private groups] in ``groups.py``),
    which stays the script's. Collective: every rank builds its first "torch" backend at
    the same point. ``Config(backend="horovod")`` keeps the blocks on
    Horovod's operations (also the default on GPUs: NCCL channels beside
    Horovod are not built).

    Measured (2 ranks, 1 Gbit/s, 2 cores, two runs): VGG-like 1.366 and
    1.384 s against 1.339 and 1.357 s under torchrun and 1.643 and 1.619 s
    for stock Horovod; GPT-like 1.643 and 1.622 s against 1.591 and 1.534 s
    and 2.070 and 1.830 s; on Horovod's operations 1.406 / 1.919 s, erratic.

    Why this was opt-in for a while, and what it was: in Horovod's own
    ``test_force_allreduce`` (two dozen optimizers built one after another
    in one job), Horovod's background loop sometimes timed out on a Gloo receive
    with our channels and never with Horovod's operations (with
    ``HOROVOD_GLOO_TIMEOUT_SECONDS=5``: 4 of 11 runs against 0 of 5, on an
    idle machine). Horovod's test module sets ``HOROVOD_TIMELINE=DYNAMIC``,
    and then Horovod's timeline writer thread spins on ``sched_yield`` (0.93
    and 0.26 of a core on the two ranks; 0.07 for the busiest thread
    without it). On two cores that spinner, beside our channels' threads
    (one Gloo loop per process group, waking every 10 ms), kept a rank's
    threads off the cores for seconds (in one run a watcher saw every thread of one
    rank runnable and not run for 2 s), and with the garbage collector off
    (more groups alive) 7 of 8 runs failed. Without the variable, 6 of 6
    (garbage collector off) and 8 of 8 (on) passed with the 5 s timeout,
    each run faster (11-15 s instead of 20-30 s). The peer suite drops the
    variable (``tests/horovod_peer/no_timeline.py``), and
    ``launchers.warn_if_timeline_spins`` tells a user who sets it.
    """
    def broadcast(message) -> None:
        broadcast_(torch.from_numpy(message), 0, name="rendezvous")  # in place, into the numpy array

    world.store = launchers.rendezvous_store(world.rank, world.size, world.timeout_s, broadcast, "Horovod",
                                             "or pass Config(backend='horovod')")
    peers.start_heartbeat(world)
    launchers.warn_if_cycle_short(world.hvd)
    launchers.warn_if_timeline_spins(world.hvd)
    if world.rank == 0:
        log.warning("dcredit_opt: gradient blocks go on torch.distributed (Gloo) process groups beside Horovod "
                    "(Config(backend='horovod') keeps them on Horovod's operations)")


def horovod_on_cpu() -> bool:
    """A Horovod job on CPUs: where our own C++ channels replace Horovod's operations for the blocks (Note [C++
    channels under Horovod]). Decided once per job, by every rank together: a rank without CUDA makes it a CPU
    job for all (ranks that chose differently would wait for each other's collectives forever)."""
    world = runtime.current()
    if world.on_cpu is None:
        mine = torch.tensor([0 if torch.cuda.is_available() else 1], dtype=torch.int32)
        world.on_cpu = any(int(t) for t in all_gather(mine, name="cpu"))
    return world.on_cpu


def destroy_channel_groups(groups: list) -> None:
    """Destroy ``groups`` from ``channel_groups()``; only once nothing is in flight on them.

    Local under Gloo. Those already gone (``shutdown()`` came first) are skipped.
    """
    if not runtime.is_initialized():
        return
    world = runtime.current()
    for group in groups:
        if not any(g is group for g in world.channel_groups):
            continue
        world.channel_groups = [g for g in world.channel_groups if g is not group]
        destroy_group(group)


def destroy_group(group) -> None:
    groups.release(group)
