"""What a Horovod script asks about its job: the node layout, the build, and the timeline switch.

Horovod's meanings: ``local_size()`` is the number of ranks on this node;
``cross_size()`` the number of ranks with this rank's ``local_rank()`` (the
number of nodes, when every node runs as many ranks), and ``cross_rank()``
this rank's place among them, in rank order; ``is_homogeneous()`` whether
every node runs as many ranks.

Under Horovod these are Horovod's answers. Under torchrun they come from its
variables (``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``).
Otherwise (mpirun, ``init_process_group`` by hand) the ranks exchange their
host names once, at the first of these calls, and the answer is kept for
the job: that first call is collective, so make it on every rank, as
scripts do when they scale a learning rate by ``local_size()``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import socket
import weakref

import torch
import torch.distributed as dist

from .. import timeline
from ..world import control, job, runtime
from ..world.runtime import require_world

log = logging.getLogger("dcredit_opt")


@dataclasses.dataclass(frozen=True)
class Layout:
    local_size: int
    cross_rank: int
    cross_size: int
    homogeneous: bool


def layout_of(hosts: list[str], local_ranks: list[int], rank: int) -> Layout:
    """The layout from every rank's host name and local rank (in rank order), seen from ``rank``."""
    mine = local_ranks[rank]
    peers = [r for r, lr in enumerate(local_ranks) if lr == mine]
    counts = [hosts.count(h) for h in dict.fromkeys(hosts)]
    return Layout(local_size=hosts.count(hosts[rank]), cross_rank=peers.index(rank), cross_size=len(peers),
                  homogeneous=len(set(counts)) == 1)


def torchrun_layout(environ) -> Layout | None:
    """The layout from torchrun's variables, or None when they are absent or do not fit a torchrun job."""
    try:
        local_size, node, nodes = (int(environ[v]) for v in ("LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"))
    except (KeyError, ValueError):
        return None
    if not (local_size > 0 and 0 <= node < nodes):
        return None
    return Layout(local_size=local_size, cross_rank=node, cross_size=nodes, homogeneous=True)


# One layout per world: a world that init() made after a shutdown() is asked again.
_layouts: dict[int, tuple[object, Layout]] = {}


def _layout(fn: str) -> Layout:
    kind = require_world(fn)
    if kind == "horovod":
        hvd = runtime.horovod()
        # horovod.torch has no is_homogeneous(): with as many ranks on every node, size = local_size * cross_size.
        homogeneous = hvd.size() == hvd.local_size() * hvd.cross_size()
        return Layout(hvd.local_size(), hvd.cross_rank(), hvd.cross_size(), homogeneous)
    if runtime.size() == 1:
        return Layout(1, 0, 1, True)
    world = runtime.current()  # the identity of this job's world, to know when the answer is stale
    cached = _layouts.get(id(world))
    if cached is not None and cached[0] is world:
        return cached[1]
    found = None
    if os.environ.get("WORLD_SIZE") == str(runtime.size()):
        found = torchrun_layout(os.environ)
    if found is None:
        mine = json.dumps([socket.gethostname(), runtime.local_rank()])
        rows = [json.loads(text) for text in control.all_gather_text(mine, "layout")]
        found = layout_of([h for h, _ in rows], [lr for _, lr in rows], runtime.rank())
    _layouts.clear()
    _layouts[id(world)] = (world, found)
    return found


def local_size() -> int:
    """The number of ranks on this node."""
    return _layout("local_size").local_size


def cross_rank() -> int:
    """This rank's place among the ranks with the same ``local_rank()`` (its node's, on homogeneous nodes)."""
    return _layout("cross_rank").cross_rank


def cross_size() -> int:
    """The number of ranks with this ``local_rank()`` (the number of nodes, on homogeneous nodes)."""
    return _layout("cross_size").cross_size


def is_homogeneous() -> bool:
    """Whether every node runs the same number of ranks (Horovod's common API; horovod.torch lacks it)."""
    return _layout("is_homogeneous").homogeneous


# ---- the build and the world: Horovod's *_built / *_enabled ----------------------------------
#
# "built": this installation can use it; "enabled": this job uses it. In a Horovod job, Horovod's answers.


def _hvd_or_none():
    return runtime.horovod() if runtime.is_initialized() and runtime.kind() == "horovod" else None


def mpi_built() -> bool:
    hvd = _hvd_or_none()
    return bool(hvd.mpi_built()) if hvd else importlib.util.find_spec("mpi4py") is not None


def gloo_built() -> bool:
    hvd = _hvd_or_none()
    return bool(hvd.gloo_built()) if hvd else dist.is_gloo_available()


def nccl_built() -> bool:
    hvd = _hvd_or_none()
    return bool(hvd.nccl_built()) if hvd else dist.is_nccl_available()


def cuda_built() -> bool:
    hvd = _hvd_or_none()
    return bool(hvd.cuda_built()) if hvd else torch.backends.cuda.is_built()


def rocm_built() -> bool:
    hvd = _hvd_or_none()
    return bool(hvd.rocm_built()) if hvd else torch.version.hip is not None


def ddl_built() -> bool:
    hvd = _hvd_or_none()
    return bool(hvd.ddl_built()) if hvd else False  # IBM DDL: never used outside Horovod


def ccl_built() -> bool:
    hvd = _hvd_or_none()
    return bool(hvd.ccl_built()) if hvd else False  # oneCCL: never used outside Horovod


def mpi_enabled() -> bool:
    kind = require_world("mpi_enabled")
    return bool(runtime.horovod().mpi_enabled()) if kind == "horovod" else kind == "mpi"


def gloo_enabled() -> bool:
    kind = require_world("gloo_enabled")
    if kind == "horovod":
        return bool(runtime.horovod().gloo_enabled())
    return "gloo" in (control.control_backend() or "")  # "gloo", or "cpu:gloo,cuda:nccl" for a world of one


def mpi_threads_supported() -> bool:
    """Whether MPI allows calls from several threads; False where the job does not use MPI."""
    kind = require_world("mpi_threads_supported")
    if kind == "horovod":
        hvd = runtime.horovod()
        return bool(hvd.mpi_enabled() and hvd.mpi_threads_supported())
    if kind != "mpi":
        return False
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


# ---- the timeline switch --------------------------------------------------------------------

# Optimizers whose timeline start_timeline() replaced, with the one they had (Config.timeline_path's, or None).
_switched: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record every live ``DistributedOptimizer``'s blocks into ``file_path`` from its next iteration.

    Differs from Horovod's: the file is a Chrome trace of the scheduler's
    blocks (``timeline.py``, as ``Config.timeline_path`` writes), one per
    rank: ``{rank}`` in the path is replaced by the rank, otherwise
    ``.rank<r>.json`` is appended when there are several ranks; with several
    optimizers, ``.opt<k>`` is added for all but the first. Optimizers built
    later are not switched (use ``Config.timeline_path``). ``mark_cycles`` is
    accepted and has no effect (there are no negotiation cycles).
    """
    require_world("start_timeline")
    if not isinstance(file_path, (str, os.PathLike)) or not str(file_path):
        raise TypeError(f"start_timeline: file_path must be a path, got {file_path!r}")
    if not isinstance(mark_cycles, bool):
        raise TypeError(f"start_timeline: mark_cycles must be a bool, got {mark_cycles!r}")
    users = job.users()
    if not users:
        log.warning("dcredit_opt: start_timeline(%r): no DistributedOptimizer is live, so there is nothing to "
                    "record; build the optimizer first, or pass Config(timeline_path=...)", str(file_path))
    for k, opt in enumerate(users):
        path = str(file_path) if k == 0 else f"{file_path}.opt{k}"
        previous = opt.use_timeline(timeline.RankTimeline(path, runtime.rank(), runtime.size()))
        _switched.setdefault(opt, previous)


def stop_timeline() -> None:
    """Stop what ``start_timeline`` started; each optimizer goes back to its own ``Config.timeline_path``.
    The files keep what was recorded."""
    require_world("stop_timeline")
    for opt, previous in list(_switched.items()):
        opt.use_timeline(previous)
    _switched.clear()
