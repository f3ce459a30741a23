"""Lost peers (Note [Lost peers]): every rank beats in the rendezvous store, so that a failed collective names
the peer that was lost, and a peer lost after the last collective still ends the job; and the errors of
collectives, which say the rank, what it was doing and the lost peer (``at_rank``)."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time

import torch.distributed as dist

from ..errors import CollectiveError, CollectiveTimeout, DCreditError
from . import runtime

log = logging.getLogger("dcredit_opt")


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


def start_heartbeat(world: runtime.World) -> None:
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


def leave_heartbeat(timeout_s: float) -> tuple | None:
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


def beating() -> bool:
    """Whether this rank beats (Note [Lost peers]): a job with a TCP store, joined and not yet left."""
    return _heartbeat is not None


def check_host() -> None:
    """At ``shutdown()``, on a rank that does not host the store: the host waits for us there, so a store silent
    now means a lost host (kept, Note [Lost peers]), and closing need not wait the whole timeout for a last side
    collective that can no longer finish."""
    beat = _heartbeat
    if beat is not None and beat.host_rank not in (None, beat.rank):
        beat.host_answers()


@contextlib.contextmanager
def activity(what: str):
    """Errors raised meanwhile say that the process was doing ``what`` (``"dc.shutdown()"``)."""
    global _activity
    _activity = what
    try:
        yield
    finally:
        _activity = None


def at_rank(e: Exception, where: str) -> DCreditError:
    """Error ``e`` of a collective again, saying which rank saw it and where, as a ``DCreditError``.

    The engine's errors (``_C.SchedulerError``, ``_C.Timeout``) already are
    ones and keep their type; another (torch.distributed's own, from a side
    group, or a plain ``TimeoutError``) becomes a ``CollectiveTimeout`` when it
    says the collective timed out, else a ``CollectiveError``.
    """
    rank_ = f"rank {runtime.rank()} of {runtime.size()}" if runtime.is_initialized() else "a rank that has shut down"
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
