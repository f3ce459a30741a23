"""Joining and leaving the job: ``init()`` and ``shutdown()``.

``init()`` adopts whatever launched us: an initialised Horovod (``hvd.init()``
first), horovodrun's variables or ``backend="horovod"`` (Horovod, initialised
here if needed); an already-initialised ``torch.distributed``, torchrun's
``env://`` variables; mpirun/mpiexec's variables or ``backend="mpi"`` (MPI,
with Gloo groups of our own beside it for control, outside torch.distributed's
default group: Note [Private groups] in ``groups.py``); or nothing at all
(a world of one, as Horovod does). The world it joins is one ``World``
(``runtime.py``) that ``shutdown()`` discards, so ``init()`` may be called
again afterwards. ``shutdown()`` closes every optimizer first, then what
``init()`` made (Note [Orderly exit]).
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import logging
import os
import sys
import weakref

import torch
import torch.distributed as dist

from ..config import Config
from ..errors import CollectiveError, LaunchError
from . import launchers, peers, runtime
from .channels import destroy_group, private_group
from .launchers import before_default_group
from .runtime import World

log = logging.getLogger("dcredit_opt")

_LAUNCH_HELP = (
    "launch with `torchrun --nproc_per_node N train.py` (sets RANK, WORLD_SIZE, LOCAL_RANK, "
    "MASTER_ADDR, MASTER_PORT), or call torch.distributed.init_process_group() before dc.init(), "
    "or run without any launcher variables for a world of one"
)

# Optimizers to close at shutdown(), in the order they were built: the same on every rank.
_users: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_user_numbers = itertools.count()


def init(timeout_s: float = 30.0, backend: str | None = None) -> None:
    """Join the job; idempotent. See the module docstring for what is adopted.

    ``backend`` is ``Config.backend`` ("auto", "torch", "horovod", "mpi"; None
    reads ``DCREDIT_BACKEND``); "horovod" and "mpi" also say how to join a job
    whose launcher leaves no trace (``horovodrun --mpi`` looks like mpirun).
    """
    if runtime.is_initialized():
        return
    if backend is None:
        backend = Config.from_env().backend
    kind = _launcher(backend)
    _leave_at_exit()
    if kind == "horovod":
        hvd, owns_hvd = launchers.join_horovod()
        if owns_hvd:  # hvd.init() registered Horovod's exit handler just now: ours must still run before it
            _leave_at_exit(again=True)
        runtime.enter(World(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(), owns_default_group=False,
                            timeout_s=timeout_s, kind="horovod", hvd=hvd, owns_horovod=owns_hvd))
        return
    if kind == "mpi":
        _, rank_, size_, local, store = launchers.join_mpi(timeout_s)
        world = World(rank=rank_, size=size_, local_rank=local, owns_default_group=False, timeout_s=timeout_s,
                      kind="mpi", store=store)
        if store is not None:
            world.group = private_group(world, "world", "joining the MPI job")
        runtime.enter(world)
        peers.start_heartbeat(world)
        return
    owns = False
    if not dist.is_initialized():
        _init_default_group(timeout_s)
        owns = True
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")))
    world = runtime.enter(World(rank=dist.get_rank(), size=dist.get_world_size(), local_rank=local,
                                owns_default_group=owns, timeout_s=timeout_s))
    if world.size == 1 and owns:
        log.info("dcredit_opt: no launcher found, running as a world of one (no communication)")
    peers.start_heartbeat(world)


def _launcher(backend: str) -> str:
    """Who started this job: "horovod", "mpi", or "torch" (torchrun, the user's own init, or nobody)."""
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
    if backend == "mpi" or (not torchrun and launchers.mpi_environment() is not None and not launchers.srun_pmi()):
        return "mpi"
    return "torch"


def _init_default_group(timeout_s: float) -> None:
    env = os.environ
    launcher_vars = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    present = [v for v in launcher_vars if v in env]
    if not any(v in env for v in ("RANK", "WORLD_SIZE")):
        slurm = launchers.slurm_environment()
        if slurm is not None:  # srun: torchrun's variables from SLURM's, for env:// below
            env.update(slurm)
            present = list(launcher_vars)
            if slurm["RANK"] == "0":
                log.info("dcredit_opt: started by srun: %s ranks, rendezvous at %s:%s", slurm["WORLD_SIZE"],
                         slurm["MASTER_ADDR"], slurm["MASTER_PORT"])
    backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    before_default_group()
    if not present:
        # A world of one runs the path a larger world runs, on the backend a larger world would use: on a GPU
        # NCCL, whose collectives the host only enqueues. Gloo's CUDA all-reduce waits on the host for the
        # device, so every lazy update would too (Note [Stream-ordered waits]). Gloo beside it for CPU tensors.
        one = "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"
        dist.init_process_group(one, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
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
        store = _incarnation_store(timeout)
        dist.init_process_group(backend, store=store, rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                                timeout=timeout)
    except Exception as e:  # the store raises several types for "nobody answered"
        raise LaunchError(
            f"could not join the job at MASTER_ADDR={env['MASTER_ADDR']} MASTER_PORT={env['MASTER_PORT']} "
            f"within {timeout_s:g} s ({type(e).__name__}: {e}); {_LAUNCH_HELP}") from e


# Note [Incarnations]
# ------------------
# ``shutdown()`` then ``init()`` makes the default group again, and every
# optimizer after it its channel groups again, on the same rendezvous store:
# under torchrun that is the agent's store, which outlives our groups. c10d
# keys a group's rendezvous by its name, and ``destroy_process_group()``
# restarts the names from 0, so the second incarnation's groups would read
# the first one's addresses (long closed ports) from the store: Gloo's
# ``connectFullMesh`` then fails with "Connect timeout", on some ranks only,
# depending on who wrote first (4 of 6 runs failed). So each incarnation's
# groups live under a prefix of their own, ``dcredit_opt/<n>/``, ``n``
# counted by the store itself: each rank adds 1 to one key when it makes
# the default group, and ``n = (count - 1) // world_size``. Every rank gets
# the same ``n``: no rank starts incarnation n + 1 before every rank has
# added for n (its ``init_process_group`` for n needed every rank's address
# under n's prefix). The store itself is made once per process (the env://
# rendezvous) and kept, so rank 0 never reopens the server port while a
# peer may still reach the old server; ``_release_store()`` drops it at exit.
# The cost: where rank 0 hosts the store (not under torchrun, whose agent
# hosts it), a script that leaves us and then calls
# ``init_process_group("env://")`` itself finds MASTER_PORT taken on rank 0;
# ``dc.init()`` again, or another port, is the way back.

_store = None
"""``(key, store)``: the env:// rendezvous store, for the job that ``key`` (the launcher's variables) names."""


def _incarnation_store(timeout: datetime.timedelta):
    """The store for a new default group: this process's rendezvous store under this incarnation's prefix (Note
    [Incarnations]). Waits at most ``timeout`` for the rendezvous."""
    global _store
    env = os.environ
    key = tuple(env.get(v) for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                     "TORCHELASTIC_RESTART_COUNT"))
    if _store is None or _store[0] != key:
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        _store = (key, store)
    store = _store[1]
    store.set_timeout(timeout)
    count = store.add("dcredit_opt/incarnations", 1)
    return dist.PrefixStore(f"dcredit_opt/{(count - 1) // int(env['WORLD_SIZE'])}/", store)


def _release_store() -> None:
    """Drop the rendezvous store (at exit, after the groups): rank 0's server thread ends now, in order."""
    global _store
    _store = None


def register_user(obj) -> None:
    """``obj`` (a DistributedOptimizer's core) communicates through us; ``shutdown()`` closes it first."""
    _users[next(_user_numbers)] = obj


def users() -> list:
    """The optimizers that communicate through us and are not closed yet, in the order they were built."""
    return [u for u in _users.values() if not u.closed]


_exit_registered = False
_lost_at_exit: tuple | None = None
"""The peers the last ``shutdown()`` found lost: at exit, the process then ends non-zero (``_shutdown_at_exit``)."""


# Note [Orderly exit]
# -------------------
# Whatever we made is gone when ``shutdown()`` returns, threads included:
# each optimizer's engine (its dispatch thread joined, and its references to
# its process groups dropped: ``Engine.shutdown``), its channel groups, then
# the default group if we made it. Destroying a group ends its Gloo threads
# only when the last reference to it goes; c10d's Python maps hold one, the
# engine another, and so can a torch module imported while the group
# exists: ``torch.distributed.nn.functional`` takes ``group.WORLD`` as a
# default argument at import (``def all_reduce(..., group=group.WORLD)``),
# and our optimizer's first use of ``torch._dynamo`` imports it. Pinned so,
# the default group's threads outlived ``shutdown()`` into the interpreter's
# teardown. There a Gloo thread could still hold the script's last
# collective (it drops its reference to a finished work a moment after the
# waiter wakes, which under load can be long): the interpreter freed the
# script's tensors first, their Python objects stayed alive for that
# reference, and when the thread dropped it, it needed the GIL of an
# interpreter that was finalizing, which ended the thread by unwinding it
# through C++ code that may not throw: "terminate called without an active
# exception", SIGABRT after every rank had printed its result (5 in about
# 250 runs under load). So ``launchers.before_default_group()`` imports that module
# while there is no default group (its defaults are then None), and the exit
# handler below runs ``shutdown()`` before the interpreter's teardown, then
# drops the rendezvous store (Note [Incarnations]) and with it rank 0's
# store server thread.


def _leave_at_exit(again: bool = False) -> None:
    """A script that ends without ``shutdown()`` leaves the job at exit, in order: optimizers (drained by
    their own exit handlers, registered later, so run first), their channels, then the default group we made,
    before the interpreter's teardown and before mpi4py's and Horovod's own exit handlers (registered earlier,
    so run later). Left to the teardown, Gloo's and the store's threads may be destroyed while joinable, or
    wake in a finalizing interpreter, and abort the process ("terminate called without an active
    exception"; Note [Orderly exit]). ``again``: registered anew, to run before a handler registered since (Horovod's,
    when ``init()`` started Horovod itself: with a peer lost, it waits on Horovod's loop until Horovod's own Gloo
    timeout, 30 s by default, where ours ends the process at once, Note [Lost peers])."""
    global _exit_registered
    if again and _exit_registered:
        atexit.unregister(_shutdown_at_exit)
        _exit_registered = False
    if not _exit_registered:
        _exit_registered = True
        atexit.register(_shutdown_at_exit)


def _shutdown_at_exit() -> None:
    try:
        shutdown()
    except Exception as e:  # noqa: BLE001 - the job is ending; say why, do not mask the exit status
        log.warning("dcredit_opt: leaving the job at exit failed: %s", e)
    if _lost_at_exit and "mpi4py.MPI" not in sys.modules:
        # A peer is lost (Note [Lost peers]): an exit status of 0 (a script that caught the error, or one that
        # never called shutdown()) would leave the launcher waiting for it forever, and the exit handlers still
        # to run (Horovod's shutdown) would wait on it too. An MPI job ends with MPI_Abort at exit instead
        # (``_abort_mpi_if_lost``).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    _release_store()


def shutdown() -> None:
    """Leave the job: close every optimizer (and so its channels), destroy any channel groups still
    left, and the default group if we created it; their threads have ended when it returns (Note [Orderly
    exit]). ``init()`` may follow, and then new optimizers (Note [Incarnations]).

    Optimizers are closed first: after a lazy ``step()`` their last blocks are
    still travelling, and destroying the channels under them would cut off
    the peers that are still reducing those blocks.
    """
    global _lost_at_exit
    # In the order they were built, the same on every rank: closing destroys
    # each one's channels, and c10d notes that destroying an NCCL
    # communicator was a collective call in some NCCL versions.
    failed = []
    # A lost peer already named by an error (the user was told): not raised again below.
    told = peers.peer_lost()
    world = runtime.current() if runtime.is_initialized() else None
    with peers.activity("dc.shutdown()"):
        peers.check_host()
        for number, user in enumerate(list(_users.values())):
            before = _engine_failure(user)
            user.close()  # a failure while closing is logged there, and raised below once all is closed
            after = _engine_failure(user)
            if before is None and after is not None:
                failed.append(f"optimizer {number}: {after}")
        _users.clear()
        rank_ = f"rank {world.rank} of {world.size}" if world is not None else "a rank"
        note = peers.lost_peer_note() if failed else ""
    beating = peers.beating()
    lost = peers.leave_heartbeat(world.timeout_s if world is not None else 0.0)
    if beating:  # not again at exit, after a shutdown() that raised for a lost peer: kept for the exit
        _lost_at_exit = lost
    _abort_mpi_if_lost(lost)
    world = runtime.leave()
    if world is not None:
        for plane in world.set_planes.values():  # the collectives' process sets (Note [Process sets])
            plane.close()
        world.set_planes = {}
        for group in world.channel_groups:  # those of engines that were never closed
            destroy_group(group)
        world.channel_groups, world.group = [], None  # ours end with their last reference (Note [Private groups])
        if world.owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
        world.store = None  # rank 0's store server ends here, after every other rank left (_linger)
        if world.owns_horovod and not lost:  # with a peer lost it would wait on Horovod's loop, stuck on that peer
            world.hvd.shutdown()
    if failed:
        # Issue R1: a peer lost while the last step()'s blocks travelled. Everything is closed; the user learns
        # that the weights are not those of synchronous training (the last updates were not all applied).
        raise CollectiveError(
            f"{rank_}, dc.shutdown(): the last step()'s gradients did not all reduce ({'; '.join(failed)}), so "
            f"its updates were not all applied and the weights are not those of synchronous training{note}")
    if lost and not told:
        # Note [Lost peers]: lost after the last collective. Raised so that this rank exits non-zero and its
        # launcher ends the job, which would otherwise wait for the lost rank forever.
        plural = "s" if len(lost[0]) > 1 else ""
        raise CollectiveError(
            f"{rank_}, dc.shutdown(): a peer was lost after the last collective; every block this rank needed was "
            f"reduced, so the weights are those of synchronous training; raised so that the job ends (its "
            f"launcher would wait for the lost rank); lost peer{plural}: rank{plural} "
            f"{', '.join(map(str, lost[0]))} ({lost[1]})")


def _abort_mpi_if_lost(lost: tuple | None) -> None:
    """In an MPI job, MPI_Finalize at exit waits for every rank: for a stopped one, forever, even when this
    rank had every block it needed (the peer stopped after the last collective). So when ``shutdown()`` found
    a peer lost (Note [Lost peers]), the process ends with MPI_Abort at exit instead."""
    mpi = sys.modules.get("mpi4py.MPI")
    if not lost or mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    from mpi4py.run import set_abort_status

    log.warning("dcredit_opt: rank %s lost (%s): this MPI job ends with MPI_Abort at exit, since MPI_Finalize "
                "would wait for it forever", ", ".join(map(str, lost[0])), lost[1])
    set_abort_status(1)


def _engine_failure(user) -> str | None:
    """The error of ``user``'s engine, if its collectives failed (not a shutdown with an iteration unfinished)."""
    engine = getattr(user, "engine", None)
    error = engine.error() if engine is not None else None
    if error is None or error.startswith("scheduler shut down"):
        return None
    return error
