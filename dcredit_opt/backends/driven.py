"""Backends whose collectives are reachable only from Python: the shared machinery.

Note [Python-driven backend]
----------------------------
The C++ scheduler still decides every launch (which block, on which channel,
when); ``_C.Engine.manual`` queues its launches instead of starting them.
Two threads of ours carry them out:

- the *driver* takes launches in launch order (``next_launch``: a blocking
  wait in C++ with the GIL released) and starts the collective. It must start
  them in exactly that order: it is the order every rank agrees on (Note
  [Same order on every rank]), and MPI matches collectives on a communicator
  by their order, Horovod by a name that we derive from the block.
- the *completer* waits for the started collectives in the same order
  (Horovod's ``synchronize``, ``MPI_Wait``: both release the GIL), applies
  what is left to do to the block, and reports it with ``complete``; the
  scheduler turns that into returned credit and finished tensors.

Two threads, because a start must never wait behind an earlier completion
(that would shrink every window to one block). Waiting in launch order
reports a block late only when a later launch finished first; launches go in
priority order, so that is rare and costs at most the gap between the two.

Python runs per block on these two threads (a few microseconds each side,
see ``cost_per_block_us``), never inside the scheduler's lock; the training
thread feels it only as GIL contention while blocks are in flight.

Every wait here has a timeout, after which the thread looks at its stop flag
and waits again: idle is not an error. The one wait that cannot be bounded is
the collective itself (neither ``synchronize`` nor ``MPI_Wait`` takes a
timeout, and neither library can abandon a collective): when a peer dies, the
completer stays inside it, the training thread gets the scheduler's own
timeout error, and ``close()`` leaves that daemon thread behind rather than
hang, and tells the transport (``abandon()``): MPI would otherwise hang at
exit in ``MPI_Finalize``, which waits for the stalled peer.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref

from .. import _ext
from ..world import control, peers, runtime
from .base import Transport

log = logging.getLogger("dcredit_opt")


class DrivenBackend:
    """A backend made of a *transport* (``base.Transport``: how to start, wait for and finish one block's
    collective, its side channel, and ``abandon``) and the two threads of Note [Python-driven backend].
    """

    name = "?"

    def __init__(self, transport: Transport, timeout_s: float):
        self.engine = _ext.load().Engine.manual(float(timeout_s))
        self._transport = transport
        self._timeout_s = float(timeout_s)
        self._pump = _Pump(self.engine, transport, float(timeout_s), self.name, runtime.rank())
        # Closed when the optimizer is garbage collected without being closed,
        # and at interpreter exit. Our own atexit entry, registered after
        # Horovod and MPI were initialised, runs before their exit handlers
        # (weakref.finalize's single atexit hook may have been registered
        # long before them), so that they never shut down under our threads.
        self._finalizer = weakref.finalize(self, _Pump.close, self._pump)
        atexit.register(self._pump.close, True)

    reducible_dtypes = None

    def buffers_for_engine(self, buffers, wires):
        """Nothing for the engine: it only schedules, and we cut the views (``set_blocks``)."""
        return {"buffers": []}

    def set_blocks(self, buffers, wires, layout, postscale: float) -> None:
        """Flat views of every block, in block-id order; only while nothing is in flight. The transport
        reduces a block's wire view where it has one (Note [Wire dtype]): the pump casts into it before
        the start and back after the finish."""
        views, casts = [], []
        for s, o, n in zip(layout.block_segment, layout.block_offset, layout.block_numel):
            view = buffers[s].narrow(0, o, n)
            if wires[s].numel():
                wire = wires[s].narrow(0, o, n)
                views.append(wire)
                casts.append((view, wire))
            else:
                views.append(view)
                casts.append(None)
        self._transport.set_blocks(views, float(postscale), list(zip(layout.block_op, layout.block_after)))
        self._pump.casts = casts

    def sweep_collectives(self):
        """Blocking ``allreduce(tensor)`` and ``barrier()`` on this backend's own transport, for the profiler's
        sweep (nothing is in flight then); each waits at most ``timeout_s`` (a ``DCreditError`` past it)."""
        t = self._timeout_s
        return (self._bounded(lambda buf: self._transport.allreduce(buf, t), "profiling, the all-reduce sweep"),
                self._bounded(lambda: self._transport.barrier(t), "profiling, a barrier of the sweep"))

    def stage_collectives(self):
        """Blocking ``(reduce_scatter(buf), all_gather(buf))`` on this backend's own transport, for the
        profiler's stage sweep (``profiler.measure_stage_ratios``), bounded as ``sweep_collectives``."""
        t = self._timeout_s
        return (self._bounded(lambda buf: self._transport.reduce_scatter(buf, t), "profiling, the reduce-scatter sweep"),
                self._bounded(lambda buf: self._transport.all_gather(buf, t), "profiling, the all-gather sweep"))

    def _bounded(self, collective, where: str):
        """``collective`` raising its failure as a ``DCreditError`` that says where; one that never finished
        (a peer stopped or died) also makes the process able to exit (``abandon``: MPI_Finalize would wait
        for that peer forever)."""
        def run(*args):
            try:
                return collective(*args)
            except (RuntimeError, TimeoutError) as e:
                if isinstance(e, TimeoutError):
                    self._transport.abandon(True)
                raise peers.at_rank(e, where) from e
        return run

    def cost_per_block_us(self) -> tuple[float, float, int]:
        """Mean CPU time per block of the driver (launch taken -> collective started) and of the
        completer (collective done -> scheduler told), in microseconds, and the number of blocks."""
        return self._pump.cost_per_block_us()

    def start_tally(self, counts) -> None:
        """Start summing the CPU int32 tensor ``counts`` over ranks, in place (Note [Global usage] in
        usage.py), beside the blocks. One at a time: ``wait_tally`` before the next."""
        self._transport.start_tally(counts)

    def wait_tally(self, timeout_s: float) -> None:
        """Wait for the tally in flight, if any; polled, so that the wait has a deadline."""
        control.wait_polled(self._transport.tally_done, timeout_s, lambda: TimeoutError(
            f"{self.name}: the sum of which gradients each rank computed did not finish within {timeout_s:g} s "
            "(a peer may be gone or stalled)"))

    exchanges_rows = True  # every transport does (Note [Embedding rows] in rows.py)

    def exchange_rows(self, ids, values, flag: bool, timeout_s: float):
        """As ``TorchDistBackend.exchange_rows``, on the transport's side channel."""
        return self._transport.exchange_rows(ids, values, flag, timeout_s)

    def allreduce_side(self, tensor, timeout_s: float) -> None:
        self._transport.allreduce_side(tensor, timeout_s)

    def close(self) -> None:
        self._finalizer()


class _Pump:
    """The driver and completer threads of one backend. Holds no reference to the
    backend, so that an optimizer dropped without being closed is still freed."""

    def __init__(self, engine, transport, timeout_s: float, label: str, rank: int):
        self._engine = engine
        self._transport = transport
        self._timeout_s = timeout_s
        self._label = label
        self._rank = rank
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # (block, handle) in launch order; None ends
        self.casts: list = []  # per block: None, or (view, wire) to cast before the start and after the finish
        self._closing = False
        self._closed = False
        self._launch_ns = 0
        self._complete_ns = 0
        self._blocks = 0
        self._driver = threading.Thread(target=self._drive, name=f"dcredit-{label}-driver", daemon=True)
        self._completer = threading.Thread(target=self._complete, name=f"dcredit-{label}-completer", daemon=True)
        self._driver.start()
        self._completer.start()

    def _drive(self) -> None:
        engine, transport, put = self._engine, self._transport, self._queue.put
        clock = time.thread_time_ns  # this thread's CPU time: the cost, without waits for the GIL or a core
        try:
            while True:
                launch = engine.next_launch(self._timeout_s)
                if launch is None:  # timed out idle, or closed
                    if self._closing:
                        break
                    continue
                t0 = clock()
                block, channel = launch
                try:
                    cast = self.casts[block]
                    if cast is not None:
                        cast[1].copy_(cast[0])
                    handle = transport.start(block, channel)
                except Exception as e:  # noqa: BLE001 - this block's failure; the scheduler raises it
                    engine.complete(block, False, self._failure("start", block, e))
                    continue
                put((block, handle))
                self._launch_ns += clock() - t0
        finally:
            put(None)  # after every started handle: the completer drains them, then stops

    def _complete(self) -> None:
        engine, transport, get = self._engine, self._transport, self._queue.get
        clock = time.thread_time_ns
        while True:
            try:
                item = get(timeout=self._timeout_s)
            except queue.Empty:
                if self._closing and not self._driver.is_alive():
                    break
                continue
            if item is None:
                break
            block, handle = item
            try:
                transport.wait(block, handle)
                t0 = clock()
                transport.finish(block)
                cast = self.casts[block]
                if cast is not None:
                    cast[0].copy_(cast[1])
            except Exception as e:  # noqa: BLE001 - this block's failure; the scheduler raises it
                engine.complete(block, False, self._failure("all-reduce", block, e))
                continue
            engine.complete(block, True, "")
            self._complete_ns += clock() - t0
            self._blocks += 1

    def _failure(self, what: str, block: int, e: Exception) -> str:
        return (f"{self._label} {what} of block {block} ({self._transport.describe(block)}) failed on rank "
                f"{self._rank}: {type(e).__name__}: {e}")

    def cost_per_block_us(self) -> tuple[float, float, int]:
        n = max(1, self._blocks)
        return self._launch_ns / n / 1e3, self._complete_ns / n / 1e3, self._blocks

    def close(self, at_exit: bool = False) -> None:
        """Stop both threads (waiting at most the timeout for collectives in flight), then the engine."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._closing = True
        self._engine.close_launches()
        # After a failure (typically a timeout: a peer is gone) what is in
        # flight will not finish; do not make the exit wait for it again.
        grace = 1.0 if self._engine.error() is not None or peers.peer_lost() else self._timeout_s
        for thread in (self._driver, self._completer):
            if thread is not threading.current_thread():
                thread.join(grace)
        stuck = [t.name for t in (self._driver, self._completer) if t.is_alive()]
        self._engine.shutdown()
        # The last tally (Note [Global usage] in usage.py) may still wait for a slower peer: its
        # buffer must outlive it, so the transport is closed only after it (or keeps it, past the grace).
        try:
            control.wait_polled(self._transport.tally_done, grace, TimeoutError)
        except TimeoutError:
            log.warning("dcredit_opt: the last sum of which gradients each rank computed did not finish "
                        "within %g s (a peer may be gone)", grace)
        if stuck:
            log.warning("dcredit_opt: %s still waits for a collective after %g s (a peer may be gone); "
                        "leaving it behind", ", ".join(stuck), grace)
            self._transport.abandon(at_exit)
        else:
            self._transport.close()
