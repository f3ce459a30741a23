"""Chrome/Perfetto trace files (chrome://tracing, ui.perfetto.dev) of what the scheduler did, and
``torch.profiler`` ranges around our own work on the training thread.

One process per rank, named "rank N", with named tracks:

- "forward": a slice per iteration, from the first forward pre-hook of the
  optimizer (the modules where the lazy step applies updates, Note [First
  read] in ``reads.py``) to the iteration's first gradient; inside it a slice
  per such module, from its pre-hook to the next one's. From the third
  iteration on: the hooks are placed during the second.
- "backward": a slice per iteration from its first gradient to its last, and
  an instant per gradient as it becomes ready.
- "channel c": a block is a slice from its launch to its completion, named by
  its tensors, with its window and release group in ``args``.

The simulator writes blocks, forwards and ready times in the same terms
(``python -m dcredit_opt simulate --timeline``), so a measured and a
simulated iteration can be opened side by side.

Note [Timeline writer]
----------------------
The training thread does as little as it can: a forward pre-hook appends one
(time, tensor) stamp, and the start of each backward hands the engine's rows
for the iteration before to a writer thread (one per file), which builds the
events and appends them. The file is a JSON object whose closing ``]}`` is
rewritten after every batch, so it is valid JSON after every batch, and so at
any clean shutdown; each batch reaches the path by a rename (Note [Whole
files] in files.py), so a reader never sees one half-written, and a process
killed in the middle of a batch leaves the file as it was before it.
``step()`` waits for the batch handed over in the backward before its own
(``settle``): the writer has had a whole iteration for it, so it is almost
always done, and the file a script reads after ``step()`` lags the scheduler
by at most one iteration. Waiting
for the batch of its own backward instead made a 2 ms iteration 1.4 ms
slower on a busy 2-core machine (``benchmarks/timeline_cost.py``).
``close()`` (from ``Core.close``, ``dc.shutdown()``, or at exit) adds the last
iteration and joins the writer. A writer that fails (disk full) says so once
and drops the rest; training never waits on it longer than ``_SETTLE_S``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Sequence

import torch
from torch.autograd.profiler import record_function

from .files import AppendedWhole, write_whole

log = logging.getLogger("dcredit_opt")

FORWARD_TID = 1
BACKWARD_TID = 2
CHANNEL_TID0 = 10  # channel c is thread CHANNEL_TID0 + c: after forward and backward in every viewer

_HEADER = b'{"displayTimeUnit":"ms","traceEvents":[\n'
_FOOTER = b"\n]}\n"
# Iterations handed over and not yet written. step() waits for each one, so more pile up only where
# step() is not called (synchronize() alone); beyond this, iterations are dropped (said once).
_MAX_BATCHES = 64
# Forward stamps kept between two backwards: about 200 bytes each, so an evaluation loop of many forwards
# and no backward stays under about 20 MB.
_MAX_FORWARD_STAMPS = 100_000
# The longest step() waits for the writer before going on without it (a stalled filesystem).
_SETTLE_S = 10.0

# The files this process's timelines have open (real paths): two optimizers given the same path (one
# DCREDIT_TIMELINE_PATH) would write over each other's batches, so the second gets ".opt<k>" added.
_open_paths: set[str] = set()
_open_lock = threading.Lock()


# ---- torch.profiler ranges ------------------------------------------------------------------

_profiler_enabled = torch._C._autograd._profiler_enabled
_NO_RANGE = contextlib.nullcontext()


def profiled(name: str):
    """A ``torch.profiler`` range (``record_function``) named ``name`` while a profiler records, else nothing.

    Entering a ``record_function`` costs tens of microseconds even with no
    profiler running (it dispatches an op); asking whether one runs costs tens
    of nanoseconds.
    """
    return record_function(name) if _profiler_enabled() else _NO_RANGE


def profiled_call(name: str):
    """Decorator: the call runs in a ``profiled(name)`` range."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not _profiler_enabled():
                return fn(*args, **kwargs)
            with record_function(name):
                return fn(*args, **kwargs)
        return call
    return wrap


# ---- events ---------------------------------------------------------------------------------


def metadata_events(pid: int, process: str) -> list[dict]:
    """Names and order of the process and of its forward and backward tracks."""
    events = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process}},
              {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}]
    for tid, name in ((FORWARD_TID, "forward"), (BACKWARD_TID, "backward")):
        events += thread_events(pid, tid, name)
    return events


def thread_events(pid: int, tid: int, name: str) -> list[dict]:
    return [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}},
            {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}}]


def block_events(rows: Iterable[Sequence[int]], names: Sequence[str], block_tensors: Sequence[Sequence[int]],
                 ready_ns: Sequence[int], pid: int, origin_ns: int, iteration: int) -> list[dict]:
    """Events for one iteration of the runtime; ``rows`` are ``Engine.trace()`` tuples."""
    events = []
    for block, channel, window, group, seq, release_ns, launch_ns, end_ns in rows:
        if launch_ns == 0 or end_ns == 0:
            continue
        tensors = block_tensors[block]
        label = names[tensors[0]] + (f" (+{len(tensors) - 1})" if len(tensors) > 1 else "")
        events.append({"name": f"block {block}: {label}", "ph": "X", "pid": pid, "tid": CHANNEL_TID0 + channel,
                       "ts": (launch_ns - origin_ns) / 1e3, "dur": (end_ns - launch_ns) / 1e3,
                       "args": {"iteration": iteration, "window": window, "group": group, "launch": seq,
                                "queued_us": (launch_ns - release_ns) / 1e3}})
    ready = [ns for ns in ready_ns if ns]
    if ready:
        events.append({"name": "backward", "ph": "X", "pid": pid, "tid": BACKWARD_TID,
                       "ts": (min(ready) - origin_ns) / 1e3, "dur": (max(ready) - min(ready)) / 1e3,
                       "args": {"iteration": iteration, "gradients": len(ready)}})
    for t, ns in enumerate(ready_ns):
        if ns:
            events.append({"name": f"ready {names[t]}", "ph": "i", "s": "t", "pid": pid, "tid": BACKWARD_TID,
                           "ts": (ns - origin_ns) / 1e3, "args": {"iteration": iteration, "tensor": t}})
    return events


def forward_events(stamps: Sequence[tuple[int, int]], end_ns: int, names: Sequence[str], pid: int,
                   origin_ns: int, iteration: int) -> list[dict]:
    """One forward: ``stamps`` are (time, first tensor) of each pre-hook in order; it ends at ``end_ns``.

    A module's slice is named by its first tensor's name without the last
    part ("layer1.0.conv1.weight" gives "forward layer1.0.conv1").
    """
    if not stamps:
        return []
    first = stamps[0][0]
    end_ns = max(end_ns, stamps[-1][0])
    events = [{"name": "forward", "ph": "X", "pid": pid, "tid": FORWARD_TID, "ts": (first - origin_ns) / 1e3,
               "dur": (end_ns - first) / 1e3, "args": {"iteration": iteration, "modules": len(stamps)}}]
    for k, (ns, tensor) in enumerate(stamps):
        until = stamps[k + 1][0] if k + 1 < len(stamps) else end_ns
        module = names[tensor].rpartition(".")[0] or names[tensor]
        events.append({"name": f"forward {module}", "ph": "X", "pid": pid, "tid": FORWARD_TID,
                       "ts": (ns - origin_ns) / 1e3, "dur": (until - ns) / 1e3,
                       "args": {"iteration": iteration, "tensor": tensor}})
    return events


def write(path: str, events: list[dict]) -> None:
    write_whole(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


# ---- one rank's file --------------------------------------------------------------------------


class RankTimeline:
    """One rank's trace file, appended to by a writer thread (Note [Timeline writer]).

    ``path`` is ``Config.timeline_path``: a ``{rank}`` in it is replaced by
    the rank; otherwise, with more than one rank, ``.rank<r>.json`` is
    appended. Recording stops at ``max_events``, which any viewer can still
    open, so that long jobs keep their file bounded. The file is opened here,
    so a path that cannot be written fails where the timeline is asked for.
    """

    def __init__(self, path: str, rank: int, size: int, max_events: int = 200_000):
        if "{rank}" in path:
            path = path.replace("{rank}", str(rank))
        elif size > 1:
            path = f"{path}.rank{rank}.json"
        self.path = path = _claim(path)
        self.rank = rank
        self.max_events = max_events
        self._forward: list[tuple[int, int]] = []  # stamps since the last record()
        self._dropped = 0
        self._slow = False  # settle() waited in vain once: it no longer waits
        self._batches = _Batches(_MAX_BATCHES)
        try:
            writer = _Writer(AppendedWhole(path), rank, max_events)  # the writer thread closes it
        except BaseException:
            _release(path)
            raise
        self._thread = threading.Thread(target=writer.run, args=(self._batches,), name=f"dcredit-timeline-{rank}",
                                        daemon=True)
        self._thread.start()
        # Dropped without close() (stop_timeline(), garbage collection, exit): the writer finishes
        # what it was given and closes the file. It holds no reference to self.
        self._finish = weakref.finalize(self, _finish, self._batches, self._thread)

    def on_forward(self, tensor: int) -> None:
        """A forward pre-hook of the module whose first tensor is ``tensor`` starts: the one cost on the hot path."""
        stamps = self._forward
        if len(stamps) < _MAX_FORWARD_STAMPS:
            stamps.append((time.perf_counter_ns(), tensor))

    def record(self, rows: Sequence[Sequence[int]], ready_ns: Sequence[int], names: Sequence[str],
               block_tensors: Sequence[Sequence[int]], iteration: int) -> None:
        """Hand one iteration (``Engine.trace()`` rows and ready times) to the writer, with the forward stamps
        taken since the last call (the next iteration's forward)."""
        if not self._finish.alive:
            return
        stamps, self._forward = self._forward, []
        if not self._batches.put((rows, ready_ns, stamps, names, block_tensors, iteration)):
            self._dropped += 1
            if self._dropped == 1:
                log.warning("dcredit_opt: the timeline writer of %s falls behind; iteration %d and others are "
                            "left out of it", self.path, iteration)

    def mark(self, name: str, args: dict) -> None:
        """An instant on the "backward" track now, across the process (a re-plan: profiling/replanner.py),
        with ``args`` (JSON-able) shown beside it."""
        if self._finish.alive:
            self._batches.put(("mark", time.perf_counter_ns(), name, dict(args)))

    def settle(self) -> None:
        """Wait until every iteration handed over is written but the last one (at most ``_SETTLE_S``, said
        once): the writer has a whole iteration for each batch, and the file lags at most one behind."""
        if self._slow or not self._thread.is_alive():
            return
        if not self._batches.wait_at_most(1, _SETTLE_S):
            self._slow = True
            log.warning("dcredit_opt: the timeline writer of %s did not keep up within %.0f s; training goes on "
                        "without waiting for it", self.path, _SETTLE_S)

    def flush(self, timeout_s: float = _SETTLE_S) -> bool:
        """Wait until every iteration handed over is written; False if that took longer than ``timeout_s``."""
        return self._batches.wait_at_most(0, timeout_s)

    def close(self, names: Sequence[str] | None = None) -> None:
        """Write what is left (forward stamps with no backward after them too), close the file. Idempotent."""
        if not self._finish.alive:
            return
        stamps, self._forward = self._forward, []
        if stamps and names is not None:
            self._batches.put((None, None, stamps, names, None, None))
        self._finish()


def _claim(path: str) -> str:
    """``path``, or ``path.opt<k>`` for the first k free, now taken by this process until ``_release``."""
    with _open_lock:
        candidate, k = path, 0
        while os.path.realpath(candidate) in _open_paths:
            k += 1
            candidate = f"{path}.opt{k}"
        _open_paths.add(os.path.realpath(candidate))
    if k:
        log.warning("dcredit_opt: timeline %s is being written by another optimizer of this process; this one "
                    "writes %s", path, candidate)
    return candidate


def _release(path: str) -> None:
    with _open_lock:
        _open_paths.discard(os.path.realpath(path))


def _finish(batches: _Batches, thread: threading.Thread) -> None:
    batches.close()
    if thread is not threading.current_thread():
        thread.join(_SETTLE_S)


class _Batches:
    """A bounded queue of batches for one writer, with a wait for it to be empty; ``None`` when closed."""

    def __init__(self, capacity: int):
        self._items: deque = deque()
        self._capacity = capacity
        self._busy = 0  # taken by the writer and not written yet
        self._closed = False
        self._cond = threading.Condition()

    def put(self, item) -> bool:
        with self._cond:
            if self._closed or len(self._items) >= self._capacity:
                return False
            self._items.append(item)
            self._cond.notify_all()
            return True

    def get(self):
        """The next batch (the writer marks it written with ``done()``), or None once closed and empty."""
        with self._cond:
            self._cond.wait_for(lambda: self._items or self._closed)
            if not self._items:
                return None
            self._busy += 1
            return self._items.popleft()

    def done(self) -> None:
        with self._cond:
            self._busy -= 1
            self._cond.notify_all()

    def wait_at_most(self, n: int, timeout_s: float) -> bool:
        """Wait until at most ``n`` batches are given and not written yet."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._items) + self._busy <= n, timeout_s)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class _Writer:
    """The writer thread's state: the file, the time origin, the channels named so far, the held forward."""

    def __init__(self, file, pid: int, max_events: int):
        self.file = file
        self.pid = pid
        self.max_events = max_events
        self.events = 0
        self.origin_ns: int | None = None
        self.channels: set[int] = set()
        self.forward: tuple = ()  # (stamps, names) of the forward whose backward has not been recorded yet
        self.iteration = 0  # the last one written
        self.failed = False
        self.end = 0  # where the footer starts
        self._append(metadata_events(pid, f"rank {pid}"), first=True)

    def run(self, batches: _Batches) -> None:
        try:
            while (batch := batches.get()) is not None:
                try:
                    if self.failed:
                        pass
                    elif isinstance(batch[0], str):
                        self._mark(*batch[1:])
                    else:
                        self._write(*batch)
                except Exception as e:  # noqa: BLE001 - said once; training goes on without the timeline
                    self.failed = True
                    log.warning("dcredit_opt: writing the timeline %s failed, nothing more is written: %s",
                                self.file.name, e)
                finally:
                    batches.done()
            if self.forward and not self.failed:
                self._write(None, None, (), self.forward[1], None, None)
        except Exception as e:  # noqa: BLE001
            log.warning("dcredit_opt: closing the timeline %s failed: %s", self.file.name, e)
        finally:
            self.file.close()
            _release(self.file.name)

    def _write(self, rows, ready_ns, stamps, names, block_tensors, iteration) -> None:
        """One batch: the held forward (it ends at this iteration's first gradient), this iteration's blocks
        and backward; the new stamps are held for the next batch. ``rows`` None: no iteration, only stamps."""
        if self.events >= self.max_events:
            return
        ready = [ns for ns in ready_ns or () if ns]
        if stamps and ready:  # a forward re-run during this backward (activation checkpointing) is no forward
            stamps = [s for s in stamps if s[0] > max(ready)]
        held, self.forward = self.forward, ((stamps, names) if stamps else ())
        if self.origin_ns is None:
            starts = ready + [r[6] for r in rows or () if r[6]] + [f[0][0][0] for f in (held, self.forward) if f]
            if not starts:
                return
            self.origin_ns = min(starts)
        events = []
        if held:
            held_stamps, held_names = held
            if ready:
                events += forward_events(held_stamps, min(ready), held_names, self.pid, self.origin_ns, iteration)
            else:  # a forward with no backward after it (an evaluation before shutdown)
                events += forward_events(held_stamps, held_stamps[-1][0], held_names, self.pid, self.origin_ns,
                                         self.iteration + 1)
        if rows is not None:
            self.iteration = iteration
            for row in rows:
                if row[6] and row[1] not in self.channels:
                    self.channels.add(row[1])
                    events += thread_events(self.pid, CHANNEL_TID0 + row[1], f"channel {row[1]}")
            events += block_events(rows, names, block_tensors, ready_ns, self.pid, self.origin_ns, iteration)
        if events:
            self._append(events)

    def _mark(self, ns: int, name: str, args: dict) -> None:
        if self.events >= self.max_events:
            return
        if self.origin_ns is None:
            self.origin_ns = ns
        self._append([{"name": name, "ph": "i", "s": "p", "pid": self.pid, "tid": BACKWARD_TID,
                       "ts": (ns - self.origin_ns) / 1e3, "args": args}])

    def _append(self, events: list[dict], first: bool = False) -> None:
        body = ",\n".join(json.dumps(e, separators=(",", ":")) for e in events).encode()
        f = self.file
        if first:
            f.write(_HEADER)
        else:
            f.seek(self.end)
            f.write(b",\n")
        f.write(body)
        self.end = f.tell()
        f.write(_FOOTER)
        f.flush()
        self.events += len(events)
