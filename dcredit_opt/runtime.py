"""Process-level set-up: which world we are in, and the process groups that channels are made of.

``init()`` adopts whatever launched us: an initialised Horovod (``hvd.init()``
first), horovodrun's variables or ``backend="horovod"`` (Horovod, initialised
here if needed); an already-initialised ``torch.distributed``, torchrun's
``env://`` variables; mpirun/mpiexec's variables or ``backend="mpi"`` (MPI,
with Gloo groups of our own beside it for control, outside torch.distributed's
default group: Note [Private groups] in ``groups.py``); or nothing at all
(a world of one, as Horovod does). State lives in one ``_World`` object that
``shutdown()`` discards, so ``init()`` may be called again afterwards.

The control plane (``all_gather``, ``broadcast_``: the model check, the
broadcast helpers, the plan) runs on Horovod in a Horovod job, on our own
world group in an MPI job, and on torch.distributed's default group
otherwise, whichever backend carries the blocks. It is called from the
training thread only, so it never races a dispatch thread: blocks never go
on the control plane's group.

Channels are not shared: each backend (one per ``DistributedOptimizer``)
makes its own, here through ``channel_groups()`` for torch.distributed, and
destroys them when it closes. Two optimizers' dispatch threads launch
independently, so on shared channels their collectives would pair up across
ranks by timing rather than by block.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import itertools
import logging
import os
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist

from .errors import CollectiveError, CollectiveTimeout, DCreditError, LaunchError

log = logging.getLogger("dcredit_opt")

_LAUNCH_HELP = (
    "launch with `torchrun --nproc_per_node N train.py` (sets RANK, WORLD_SIZE, LOCAL_RANK, "
    "MASTER_ADDR, MASTER_PORT), or call torch.distributed.init_process_group() before dc.init(), "
    "or run without any launcher variables for a world of one"
)


@dataclasses.dataclass
class _World:
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
    """Backends made so far; the same count on every rank (Note [Same order on every rank])."""
    on_cpu: bool | None = None
    """In a Horovod job: whether it runs on CPUs, decided by every rank together (``horovod_on_cpu()``)."""
    store: object = None
    """Under MPI and Horovod: our own rendezvous store, for groups of our own (Note [Private groups] in
    ``groups.py``); None where torch.distributed's default group serves (torchrun, or the script's own)."""
    group: object = None
    """The control plane's group: ours over every rank with ``store``, else None (the default group)."""
    groups_made: int = 0
    """Groups made on ``store`` so far; the same count on every rank, so each has the same name everywhere."""


_world: _World | None = None
# Optimizers to close at shutdown(), in the order they were built: the same on every rank.
_users: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_user_numbers = itertools.count()


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
    _leave_at_exit()
    if kind == "horovod":
        from . import launchers

        hvd, owns_hvd = launchers.join_horovod()
        if owns_hvd:  # hvd.init() registered Horovod's exit handler just now: ours must still run before it
            _leave_at_exit(again=True)
        _world = _World(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(), owns_default_group=False,
                        timeout_s=timeout_s, kind="horovod", hvd=hvd, owns_horovod=owns_hvd)
        return
    if kind == "mpi":
        from . import launchers

        _, rank_, size_, local, store = launchers.join_mpi(timeout_s)
        world = _World(rank=rank_, size=size_, local_rank=local, owns_default_group=False, timeout_s=timeout_s,
                       kind="mpi", store=store)
        if store is not None:
            world.group = _private_group(world, "world", "joining the MPI job")
        _world = world
        _start_heartbeat(_world)
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
    _start_heartbeat(_world)


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
    if backend == "mpi" or (not torchrun and launchers.mpi_environment() is not None and not launchers.srun_pmi()):
        return "mpi"
    return "torch"


def _init_default_group(timeout_s: float) -> None:
    env = os.environ
    launcher_vars = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    present = [v for v in launcher_vars if v in env]
    if not any(v in env for v in ("RANK", "WORLD_SIZE")):
        from . import launchers

        slurm = launchers.slurm_environment()
        if slurm is not None:  # srun: torchrun's variables from SLURM's, for env:// below
            env.update(slurm)
            present = list(launcher_vars)
            if slurm["RANK"] == "0":
                log.info("dcredit_opt: started by srun: %s ranks, rendezvous at %s:%s", slurm["WORLD_SIZE"],
                         slurm["MASTER_ADDR"], slurm["MASTER_PORT"])
    backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    from .launchers import before_default_group

    before_default_group()
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


def _private_group(world: _World, name: str, what: str, ranks: list | None = None):
    """A group of ours on ``world.store`` (Note [Private groups] in groups.py) over ``ranks`` (all by default),
    named ``name``; collective over those ranks."""
    from . import groups

    ranks = list(range(world.size)) if ranks is None else ranks
    try:
        return groups.private_group(world.store, name, ranks.index(world.rank), len(ranks), world.timeout_s)
    except RuntimeError as e:  # the store or Gloo: a peer is gone, or the timeout passed
        raise LaunchError(f"rank {world.rank} of {world.size}, {what}: could not connect a group of ranks "
                          f"{ranks} within {world.timeout_s:g} s ({type(e).__name__}: {e})") from e


def control_group():
    """The control plane's process group: None for torch.distributed's default group, else ours (Note
    [Private groups] in groups.py)."""
    return _require().group


def control_backend() -> str | None:
    """The control plane's torch.distributed backend ("gloo", "nccl"), or None where it is Horovod's."""
    world = _require()
    if world.kind == "horovod":
        return None
    if world.group is not None:
        return "gloo"
    return dist.get_backend() if dist.is_initialized() else None


def _require() -> _World:
    if _world is None:
        raise DCreditError("dcredit_opt is not initialised: call dc.init() first")
    return _world


def is_initialized() -> bool:
    return _world is not None


def rank() -> int:
    return _require().rank


def size() -> int:
    return _require().size


def at_rank(e: Exception, where: str) -> DCreditError:
    """Error ``e`` of a collective again, saying which rank saw it and where, as a ``DCreditError``.

    The engine's errors (``_C.SchedulerError``, ``_C.Timeout``) already are
    ones and keep their type; another (torch.distributed's own, from a side
    group, or a plain ``TimeoutError``) becomes a ``CollectiveTimeout`` when it
    says the collective timed out, else a ``CollectiveError``.
    """
    rank_ = f"rank {rank()} of {size()}" if is_initialized() else "a rank that has shut down"
    during = f"{_activity}, " if _activity else ""
    message = f"{rank_}, {during}{where}: {e}"
    if "lost peer" not in message and "no peer lost" not in message:
        message += lost_peer_note()
    if isinstance(e, DCreditError):
        return type(e)(message)
    if timed_out(e):
        return CollectiveTimeout(message)
    return CollectiveError(message)


def timed_out(e: BaseException) -> bool:
    """Whether ``e`` says a collective ran out of time: a ``TimeoutError``, or torch.distributed's error
    for it (a ``DistBackendError``, a RuntimeError, whose message says "timed out" or "timeout")."""
    text = str(e).lower()
    return isinstance(e, TimeoutError) or "timed out" in text or "timeout" in text


def local_rank() -> int:
    return _require().local_rank


def timeout_s() -> float:
    return _require().timeout_s


def kind() -> str:
    """Who set up the world: "torch", "horovod" or "mpi"; ``Config.backend="auto"`` follows it."""
    return _require().kind


def require_world(fn: str) -> str:
    """:func:`kind`, for ``fn`` of the Horovod-style API: a ValueError naming ``fn`` before ``init()``."""
    if not is_initialized():
        raise ValueError(f"{fn}() called before init(): call hvd.init() (dcredit_opt.init()) first")
    return kind()


def horovod():
    """``horovod.torch``, in a Horovod world."""
    world = _require()
    if world.kind != "horovod":
        raise DCreditError(f"this is a {world.kind} job, not a Horovod one: call hvd.init() before dc.init(), "
                           "launch with horovodrun, or pass backend='horovod' to dc.init()")
    return world.hvd


def next_backend_id() -> int:
    """A number for a new backend, equal on every rank that builds its optimizers in the same order."""
    world = _require()
    world.backends_created += 1
    return world.backends_created - 1


# Note [Lost peers]
# -----------------
# A collective that fails says what failed, not who: Gloo reports "Connection
# closed by peer [address]:port" for a peer that died and only a timeout for
# one that stopped (SIGSTOP, a hung machine), as MPI and Horovod do for both.
# So in a job with a TCP rendezvous store (torchrun, our own rendezvous under
# mpirun and Horovod), every rank beats: a daemon thread of ours adds 1 to its
# key in the store every HEARTBEAT_S, on a connection of its own. When a
# collective fails, ``at_rank()`` asks the store (on a connection of its own,
# made at the start, with a short timeout) for every rank's count, and again
# until every other rank's has moved, for at most LOST_WINDOW_S: the ranks whose
# count did not move are named as lost, unless they said they left (``shutdown()``,
# at exit too, marks a rank's leaving: a peer that raised first and is gone is
# not lost). If the store itself no longer answers and rank 0 hosts it
# (everywhere but under torchrun, whose agent hosts it), rank 0 is the one
# lost. A rank that is lost never comes back, so the first answer that names
# one is kept; the cost, up to LOST_WINDOW_S, is paid on the error path only.
# The thread ends at ``shutdown()``.
#
# A peer may also be lost after the last collective (it stops in its own
# ``shutdown()``): a survivor then has every block it needs and nothing fails
# there, yet the job would never end, since every launcher (torchrun,
# horovodrun, mpiexec's MPI_Finalize) waits for the lost rank. So leaving is
# checked too (``_Heartbeat.leave()``): the store's host, at its
# ``shutdown()``, waits until every other rank has left, or has not beaten for
# EXIT_LOST_WINDOW_S (lost), for at most ``timeout_s``: its store goes with
# it, and because it waits, a store that is silent when another rank leaves
# means its host is lost, not that it finished first (one store read, on a
# thread of its own with a deadline). ``shutdown()`` then raises, naming the
# lost peer and saying the weights are those of synchronous training, so that
# the rank exits non-zero and its launcher ends the job (an MPI job with
# MPI_Abort at exit). A rank more than ``timeout_s`` later to leave than the
# host is taken for one whose host is lost: the same bound a collective gives.

HEARTBEAT_S = 0.25
LOST_WINDOW_S = 2.0
EXIT_LOST_WINDOW_S = 2 * LOST_WINDOW_S
"""At the host's ``shutdown()`` a peer is lost when it has not beaten for this long: wider than on the error path,
since here a wrong answer fails a job in which nothing failed."""
_BEAT_KEY = "dcredit_opt/beat/{}/{}"
_LEFT_KEY = "dcredit_opt/left/{}/{}"
_beats_started = 0
"""Heartbeats started by this process: the same count on every rank (Note [Incarnations]), so each
incarnation's keys are its own."""
_STORE_CLIENT_TIMEOUT = datetime.timedelta(seconds=2)
_BEAT_TIMEOUT = datetime.timedelta(seconds=10)
_activity: str | None = None
_lost_at_exit: tuple | None = None
"""The peers the last ``shutdown()`` found lost: at exit, the process then ends non-zero (``_shutdown_at_exit``)."""
"""What the process as a whole is doing when it is not training (``"dc.shutdown()"``); errors name it."""


class _Heartbeat:
    def __init__(self, host: str, port: int, host_rank: int | None, rank_: int, size_: int, incarnation: int):
        self.host, self.port, self.host_rank, self.rank, self.size = host, port, host_rank, rank_, size_
        self.beat_keys = [_BEAT_KEY.format(incarnation, r) for r in range(size_)]
        self.left_keys = [_LEFT_KEY.format(incarnation, r) for r in range(size_)]
        self.lost: tuple | None = None
        self.asked = False  # find_lost() was called: a collective failed here
        # Connections made now, while the store answers: making one to a stopped store can hang past any
        # timeout, and a failed operation leaves its connection unusable, so neither is retried.
        self._beat_store = dist.TCPStore(host, port, is_master=False, timeout=_BEAT_TIMEOUT)
        self._read_store = dist.TCPStore(host, port, is_master=False, timeout=_STORE_CLIENT_TIMEOUT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dcredit-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        key = self.beat_keys[self.rank]
        while not self._stop.is_set():
            try:
                self._beat_store.add(key, 1)
            except Exception:  # noqa: BLE001 - the store is gone: nobody can read a beat any more
                return
            self._stop.wait(HEARTBEAT_S)
        try:  # said by this thread, so that close() never waits on a store that stopped answering
            self._beat_store.add(self.left_keys[self.rank], 1)
        except Exception as e:  # noqa: BLE001 - the store is gone: nobody will ask
            log.debug("dcredit_opt: could not mark this rank's leaving in the store: %s", e)

    def leave(self, timeout_s: float) -> tuple | None:
        """Leave the job (Note [Lost peers]): the peers found lost on the way out, ``(ranks, why)``, or None.
        The store's host first waits for the others (``_linger``, at most ``timeout_s``); another rank checks
        that the store still answers (``host_answers``). Then stop beating and say so: a rank that left in
        order (after an error of its own too) is not lost. Waits briefly for that: if the store no longer
        answers, the thread is left behind, a daemon."""
        lost = None
        if self.host_rank is not None:
            lost = self._linger(timeout_s) if self.rank == self.host_rank else self.host_answers()
        self._stop.set()
        self._thread.join(timeout=1.0 + HEARTBEAT_S)
        return lost

    def _linger(self, timeout_s: float) -> tuple | None:
        """Wait, at most ``timeout_s``, until every other rank has left or is lost (no beat for
        EXIT_LOST_WINDOW_S): the store goes with this process, and a peer still asking, or still to leave, would
        then take this rank for the lost one. The lost peers (those found before too), or None."""
        known = set(self.lost[0]) if self.lost else set()
        others = set(range(self.size)) - {self.rank} - known
        moved: dict = {}  # rank -> (its beat count, when it last moved)
        newly = []
        deadline = time.monotonic() + timeout_s
        try:
            while others and time.monotonic() < deadline:
                now = time.monotonic()
                for r in sorted(others):
                    if self._read_store.add(self.left_keys[r], 0):
                        others.discard(r)
                        continue
                    count = self._read_store.add(self.beat_keys[r], 0)
                    if moved.get(r, (None,))[0] != count:
                        moved[r] = (count, now)
                    elif now - moved[r][1] > EXIT_LOST_WINDOW_S:
                        newly.append(r)
                        others.discard(r)
                if others:
                    time.sleep(0.1)
        except Exception as e:  # noqa: BLE001 - our own store: only if this process is ending under us
            log.debug("dcredit_opt: waiting for the others to leave: %s", e)
        if newly:
            why = f"no heartbeat in the rendezvous store for {EXIT_LOST_WINDOW_S:g} s, and it did not leave"
            self.lost = (sorted(known | set(newly)), self.lost[1] if self.lost else why)
        return self.lost

    def host_answers(self) -> tuple | None:
        """The store's host waits at its ``shutdown()`` until this rank has left (``_linger``): if its store
        does not answer now, it is lost. One read, on a thread of its own with a deadline (an operation on a
        stopped store may not return). The lost peers (those found before too), or None."""
        if self.lost is not None:
            return self.lost
        answer: list = []

        def ask() -> None:
            try:
                self._read_store.add(self.left_keys[self.host_rank], 0)
                answer.append(None)
            except Exception as e:  # noqa: BLE001 - the store does not answer: said below
                answer.append(type(e).__name__)

        asker = threading.Thread(target=ask, name="dcredit-host-check", daemon=True)
        asker.start()
        asker.join(timeout=_STORE_CLIENT_TIMEOUT.total_seconds() + 0.5)
        if answer and answer[0] is None:
            return None
        why = answer[0] if answer else "TimeoutError"
        self.lost = ([self.host_rank], f"it hosts the rendezvous store, which no longer answers at exit: {why}")
        return self.lost

    def find_lost(self, silent_store_names_host: bool = True) -> tuple | None:
        """``(ranks, why)``: the ranks lost and how we know; ``([], why)`` when every rank still beats; None
        when the store cannot tell. Asked on a thread of its own, given up on after a deadline: an operation
        on a store whose host stopped may not return. A store that no longer answers names its host, unless
        ``silent_store_names_host`` is False: where nothing failed, the host may simply have finished first."""
        if self.lost is not None:
            return self.lost
        answer: list = []
        asker = threading.Thread(target=lambda: answer.append(self._ask()), name="dcredit-lost-peer", daemon=True)
        asker.start()
        asker.join(timeout=LOST_WINDOW_S + 1.5)
        found = answer[0] if answer else ("store", "TimeoutError")
        if found[0] == "store":
            if self.host_rank is None or self.host_rank == self.rank or not silent_store_names_host:
                return None
            self.lost = ([self.host_rank], f"it hosts the rendezvous store, which no longer answers: {found[1]}")
            return self.lost
        alive, left = found[1], found[2]
        lost = sorted(set(range(self.size)) - alive - left)
        if not lost:
            plural = "s" if len(left) > 1 else ""
            gone = f"rank{plural} {', '.join(map(str, sorted(left)))} left the job; " if left else ""
            return [], f"{gone}every other rank still beats"
        self.lost = (lost, f"no heartbeat in the rendezvous store for {LOST_WINDOW_S:g} s")
        return self.lost

    def _ask(self) -> tuple:
        """("alive", ranks whose beat moved within LOST_WINDOW_S, ranks that left), or ("store", why) if the
        store failed."""
        keys, store = self.beat_keys, self._read_store
        try:
            first = [store.add(k, 0) for k in keys]
            alive, left = {self.rank}, set()
            deadline = time.monotonic() + LOST_WINDOW_S
            while len(alive | left) < self.size and time.monotonic() < deadline:
                time.sleep(0.05)
                alive.update(r for r, k, n in zip(range(self.size), keys, first) if store.add(k, 0) != n)
                left.update(r for r in set(range(self.size)) - alive - left if store.add(self.left_keys[r], 0))
        except Exception as e:  # noqa: BLE001 - the store itself does not answer
            return "store", type(e).__name__
        return "alive", alive, left


_heartbeat: _Heartbeat | None = None


def _start_heartbeat(world: _World) -> None:
    """Note [Lost peers]: beat, when the job has a TCP store; collective (every rank starts it)."""
    global _heartbeat, _beats_started
    if _heartbeat is not None or world.size == 1 or (world.store is None and not dist.is_initialized()):
        return
    try:
        store = world.store if world.store is not None else dist.distributed_c10d._get_default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
    except (AttributeError, RuntimeError, ValueError):
        return
    if not isinstance(store, dist.TCPStore):
        return
    # torchrun's agent hosts the store; elsewhere (env://, our rendezvous over MPI and Horovod) rank 0 does.
    host_rank = None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" else 0
    try:
        _heartbeat = _Heartbeat(store.host, store.port, host_rank, world.rank, world.size, _beats_started)
        _beats_started += 1
    except Exception as e:  # noqa: BLE001 - the job runs on; its errors will not name a lost peer
        log.warning("dcredit_opt: no heartbeat (Note [Lost peers]): %s", e)


def _leave_heartbeat(timeout_s: float) -> tuple | None:
    """Stop beating and leave (Note [Lost peers]): the peers found lost, ``(ranks, why)``, or None."""
    global _heartbeat
    beat, _heartbeat = _heartbeat, None
    return beat.leave(timeout_s) if beat is not None else None


def peer_lost() -> bool:
    """Whether a peer is known lost (Note [Lost peers]): closing then waits only briefly for what is in flight."""
    beat = _heartbeat
    return beat is not None and beat.lost is not None


def lost_peer_note() -> str:
    """Note [Lost peers]: "; lost peer: rank N (why)" for an error message, or what is known instead."""
    beat = _heartbeat
    if beat is None:
        return ""
    beat.asked = True
    found = beat.find_lost()
    if found is None:
        return "; the lost peer is unknown (the rendezvous store does not answer)"
    lost, why = found
    if not lost:
        return f"; no peer lost ({why}): a peer may be slow or calling a different collective"
    return f"; lost peer: rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} ({why})"


# ---- the control plane: small collectives outside the scheduler ----------
#
# ``name`` identifies the operation to Horovod, which matches operations
# across ranks by name; it must be the same on every rank, and stable from
# one call to the next so that Horovod's response cache can serve it.
#
# Every wait has a deadline, ``timeout_s`` (``init(timeout_s=)``). On
# torch.distributed it is the default group's timeout, which Gloo's
# collectives honour (and NCCL's watchdog enforces). Horovod's synchronous
# calls and its ``synchronize`` have none, so in a Horovod job the async form
# is started and its handle polled (``_horovod_wait``) until the deadline.

def control_device() -> torch.device:
    """Where control tensors live: the GPU under NCCL, else the CPU."""
    if control_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Sleeps between polls of a Horovod handle: from 20 us, doubling, to at most 2 ms. The control plane's
# operations are small and usually done within a negotiation cycle or two, so the first polls are quick;
# a wait that goes on costs a poll every 2 ms, not a spinning core.
_POLL_FIRST_S = 20e-6
_POLL_MAX_S = 2e-3


def wait_polled(done, timeout_s: float, timeout_error) -> None:
    """Call ``done()`` until it is true, sleeping between calls as above; past ``timeout_s``, raise
    ``timeout_error()``. For operations whose own wait has no deadline (Horovod handles, MPI requests)."""
    deadline = time.monotonic() + timeout_s
    delay = _POLL_FIRST_S
    while not done():
        if time.monotonic() >= deadline:
            raise timeout_error()
        time.sleep(min(delay, max(deadline - time.monotonic(), 0.0)))
        delay = min(2 * delay, _POLL_MAX_S)


def _horovod_wait(hvd, handle, what: str, timeout_s: float, rank_: int, size_: int):
    """The result of Horovod operation ``handle`` (``hvd.synchronize``), polled with ``hvd.poll`` so that
    the wait ends within ``timeout_s``: past it, ``CollectiveTimeout`` (a TimeoutError) naming ``what``."""
    wait_polled(lambda: hvd.poll(handle), timeout_s, lambda: CollectiveTimeout(
        f"rank {rank_} of {size_}: control-plane operation {what} did not complete within {timeout_s:g} s "
        "(init(timeout_s=...)): a peer is gone or did not reach the same call (every rank must make the "
        "same dcredit_opt calls in the same order); the operation is still pending in Horovod, so end "
        "the job"))
    return hvd.synchronize(handle)


def horovod_wait(hvd, handle, what: str, timeout_s: float):
    """The result of Horovod operation ``handle``, waited for at most ``timeout_s`` (``CollectiveTimeout`` naming
    ``what`` past it); for backends' own operations beside the blocks."""
    return _horovod_wait(hvd, handle, what, timeout_s, rank(), size())


def all_gather(tensor: torch.Tensor, name: str) -> list:
    """Every rank's ``tensor`` (same shape and dtype on every rank), in rank order; waits at most
    ``timeout_s`` (``CollectiveTimeout``, a TimeoutError, past it)."""
    world = _require()
    if world.size == 1:
        return [tensor.clone()]
    if world.kind == "horovod":
        op = f"dc.ctl.{name}"
        handle = world.hvd.allgather_async(tensor.reshape(1, -1).contiguous(), name=op)
        rows = _horovod_wait(world.hvd, handle, f"all_gather {op!r}", world.timeout_s, world.rank, world.size)
        return [row.reshape(tensor.shape) for row in rows.unbind(0)]
    gathered = [torch.empty_like(tensor) for _ in range(world.size)]
    try:
        dist.all_gather(gathered, tensor, group=world.group)
    except RuntimeError as e:  # torch's DistBackendError: a peer is gone, or the timeout passed
        raise at_rank(e, f"control-plane all_gather {name!r}") from e
    return gathered


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str) -> None:
    """Overwrite the contiguous ``tensor`` (on ``control_device()``) with ``root_rank``'s, in place; waits at
    most ``timeout_s`` (``CollectiveTimeout``, a TimeoutError, past it)."""
    world = _require()
    if world.size == 1:
        return
    if world.kind == "horovod":
        if tensor.numel():
            # As bytes: exact, and independent of which dtypes Horovod supports.
            op = f"dc.ctl.{name}"
            handle = world.hvd.broadcast_async_(tensor.view(-1).view(torch.uint8), root_rank, name=op)
            _horovod_wait(world.hvd, handle, f"broadcast_ {op!r}", world.timeout_s, world.rank, world.size)
        return
    try:
        from . import groups

        groups.broadcast(tensor, root_rank, world.group)
    except RuntimeError as e:
        raise at_rank(e, f"control-plane broadcast {name!r} from rank {root_rank}") from e


def broadcast_text(text: str | None, root_rank: int) -> str:
    """``root_rank``'s ``text`` on every rank, as UTF-8 bytes in a uint8 tensor (no pickle)."""
    dev = control_device()
    if rank() == root_rank:
        payload = torch.tensor(list(text.encode()), dtype=torch.uint8, device=dev)
        length = torch.tensor([payload.numel()], dtype=torch.int64, device=dev)
    else:
        length = torch.zeros(1, dtype=torch.int64, device=dev)
    broadcast_(length, root_rank, "text.length")
    if rank() != root_rank:
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=dev)
    broadcast_(payload, root_rank, "text.payload")
    return bytes(payload.cpu().tolist()).decode()


def all_gather_text(text: str, name: str) -> list[str]:
    """Every rank's ``text``, in rank order, as UTF-8 bytes in uint8 tensors (no pickle): the lengths, then
    the bytes, each rank's padded to the longest."""
    dev = control_device()
    payload = torch.tensor(list(text.encode()), dtype=torch.uint8, device=dev)
    lengths = [int(n) for n in all_gather(torch.tensor([payload.numel()], dtype=torch.int64, device=dev),
                                          f"{name}.length")]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=dev)
    padded[:payload.numel()] = payload
    return [bytes(row[:n].cpu().tolist()).decode() for row, n in zip(all_gather(padded, f"{name}.data"), lengths)]


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
    world = _require()
    if world.store is None and not dist.is_initialized() and world.kind == "horovod":
        _torch_beside_horovod(world)
    if world.store is None and not dist.is_initialized():
        raise LaunchError(f"backend 'torch' needs torch.distributed, which this {world.kind} job does not use: "
                          f"pass Config(backend='{world.kind}') or 'auto', or launch with torchrun")
    timeout = datetime.timedelta(seconds=world.timeout_s)
    groups = []
    try:
        for _ in range(count):
            if world.store is not None:  # Note [Private groups] in groups.py: Gloo, on our store
                groups.append(_private_group(world, f"channels/{world.groups_made}", "making a channel"))
                world.groups_made += 1
            else:
                groups.append(dist.new_group(ranks=list(range(world.size)), timeout=timeout, backend=backend))
            world.channel_groups.append(groups[-1])  # destroyed at shutdown() even if a later one fails
        device = torch.device("cpu") if backend == "gloo" or world.store is not None else control_device()
        for group in groups:
            dist.all_reduce(torch.zeros(1, device=device), group=group)
    except RuntimeError as e:  # torch's DistBackendError: a peer is gone, or the timeout passed
        raise at_rank(e, f"making this optimizer's process groups ({len(groups)} of {count} made)") from e
    return groups


def _torch_beside_horovod(world: _World) -> None:
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
    from . import launchers

    def broadcast(message) -> None:
        broadcast_(torch.from_numpy(message), 0, name="rendezvous")  # in place, into the numpy array

    world.store = launchers.rendezvous_store(world.rank, world.size, world.timeout_s, broadcast, "Horovod",
                                             "or pass Config(backend='horovod')")
    _start_heartbeat(world)
    launchers.warn_if_cycle_short(world.hvd)
    launchers.warn_if_timeline_spins(world.hvd)
    if world.rank == 0:
        log.warning("dcredit_opt: gradient blocks go on torch.distributed (Gloo) process groups beside Horovod "
                    "(Config(backend='horovod') keeps them on Horovod's operations)")


def horovod_on_cpu() -> bool:
    """A Horovod job on CPUs: where our own C++ channels replace Horovod's operations for the blocks (Note [C++
    channels under Horovod]). Decided once per job, by every rank together: a rank without CUDA makes it a CPU
    job for all (ranks that chose differently would wait for each other's collectives forever)."""
    world = _require()
    if world.on_cpu is None:
        mine = torch.tensor([0 if torch.cuda.is_available() else 1], dtype=torch.int32)
        world.on_cpu = any(int(t) for t in all_gather(mine, name="cpu"))
    return world.on_cpu


def destroy_channel_groups(groups: list) -> None:
    """Destroy ``groups`` from ``channel_groups()``; only once nothing is in flight on them.

    Local under Gloo. Those already gone (``shutdown()`` came first) are skipped.
    """
    world = _world
    if world is None:
        return
    for group in groups:
        if not any(g is group for g in world.channel_groups):
            continue
        world.channel_groups = [g for g in world.channel_groups if g is not group]
        _destroy_group(group)


def _destroy_group(group) -> None:
    from . import groups

    groups.release(group)


def register_user(obj) -> None:
    """``obj`` (a DistributedOptimizer's core) communicates through us; ``shutdown()`` closes it first."""
    _users[next(_user_numbers)] = obj


_exit_registered = False


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
    global _world, _activity
    # In the order they were built, the same on every rank: closing destroys
    # each one's channels, and c10d notes that destroying an NCCL
    # communicator was a collective call in some NCCL versions.
    failed = []
    _activity = "dc.shutdown()"
    # A lost peer already named by an error (the user was told): not raised again below.
    told = peer_lost()
    try:
        if _heartbeat is not None and _heartbeat.host_rank not in (None, _heartbeat.rank):
            # Its host waits for us at its shutdown(): a store silent now means a lost host, and closing need
            # not wait the whole timeout for a last side collective that can no longer finish.
            _heartbeat.host_answers()
        for number, user in enumerate(list(_users.values())):
            before = _engine_failure(user)
            user.close()  # a failure while closing is logged there, and raised below once all is closed
            after = _engine_failure(user)
            if before is None and after is not None:
                failed.append(f"optimizer {number}: {after}")
        _users.clear()
        rank_ = f"rank {_world.rank} of {_world.size}" if _world is not None else "a rank"
        note = lost_peer_note() if failed else ""
    finally:
        _activity = None
    global _lost_at_exit
    beating = _heartbeat is not None
    lost = _leave_heartbeat(_world.timeout_s if _world is not None else 0.0)
    if beating:  # not again at exit, after a shutdown() that raised for a lost peer: kept for the exit
        _lost_at_exit = lost
    _abort_mpi_if_lost(lost)
    world, _world = _world, None
    if world is not None:
        for group in world.channel_groups:  # those of engines that were never closed
            _destroy_group(group)
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
