"""Process groups of our own, made from a store, outside torch.distributed's registry.

Note [Private groups]
---------------------
Under mpirun/mpiexec and Horovod, the script launched with MPI or Horovod,
not torch.distributed: ``dist.is_initialized()`` must keep meaning what the
script did, and a script may call ``dist.init_process_group()`` itself later.
So there we make no default group. Rank 0 opens a TCPStore of our own
(``launchers.rendezvous_store``); every group we need (the control plane's
world group, each optimizer's channels, each process set's groups) is a
``ProcessGroup`` made here on that store under a name of its own, with a
Gloo backend, exactly as ``new_group`` builds one, but not registered in
c10d's maps. Such a group takes ``dist.all_reduce(..., group=g)``,
``all_gather``, ``barrier`` and the C++ engine as a registered one does;
``dist.broadcast`` (it maps global ranks through the registry) does not, so
``broadcast`` below calls the group itself with the root's rank in the group.
``dist.destroy_process_group(g)`` does not know it either: its Gloo threads
end when the last reference goes (``release``).

Names: every rank makes the same groups in the same order (Note [Same order
on every rank]), and the name says which (``world``, ``channels/<n>``,
``set/<ranks>/<n>/...``), so the k-th group of one rank meets the k-th of the
others under the same prefix of the store. Under torchrun nothing changes
for every rank's channels (``new_group`` on the default group, the script's
or ours); only process sets (Note [Process sets] in ``process_sets.py``) use
this construction there, on the default group's store.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

_GLOO = dist.ProcessGroup.BackendType.GLOO


def private_group(store, name: str, rank: int, size: int, timeout_s: float) -> dist.ProcessGroup:
    """A Gloo process group of ``size`` ranks (this one ``rank``) on ``store`` under ``name``; collective over
    those ranks (each connects to every other; waits at most ``timeout_s``)."""
    prefix = dist.PrefixStore(f"dcredit_opt/pg/{name}/", store)
    group = dist.ProcessGroup(prefix, rank, size)
    group._set_default_backend(_GLOO)
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", prefix), rank, size, timeout)
    backend._set_sequence_number_for_group()
    group._register_backend(torch.device("cpu"), _GLOO, backend)
    group._set_group_name(f"dcredit_opt/{name}")
    return group


def is_registered(group) -> bool:
    """Whether c10d's maps know ``group`` (the default group, or one from ``new_group``)."""
    if group is None:
        return True
    try:
        return group in dist.distributed_c10d._world.pg_group_ranks
    except AttributeError:  # a torch without the map: treat every group as its own
        return False


def broadcast(tensor: torch.Tensor, root: int, group=None, async_op: bool = False):
    """``dist.broadcast`` from ``root`` (a rank in ``group``, or global with the default group), also for a
    group of ours (Note [Private groups]). Returns the work with ``async_op``, else waits."""
    if is_registered(group):
        src = dist.get_global_rank(group, root) if group is not None else root
        return dist.broadcast(tensor, src=src, group=group, async_op=async_op)
    options = dist.BroadcastOptions()
    options.rootRank = root
    options.rootTensor = 0
    work = group.broadcast([tensor], options)
    if async_op:
        return work
    work.wait()
    return None


def release(group) -> None:
    """Let go of ``group``: c10d's maps for a registered one (``destroy_process_group``); nothing for ours,
    whose threads end with its last reference."""
    if not is_registered(group):
        return
    try:
        dist.destroy_process_group(group)
    except (RuntimeError, ValueError):
        pass  # already gone with the default group
