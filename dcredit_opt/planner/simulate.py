"""A discrete-event replay of one steady-state iteration of a plan.

The scheduler rules are those of the runtime, to the letter (see
``plan.py``, Note [Same order on every rank] and Note [Credit window], and
``csrc/core/scheduler.cc``): events are processed strictly in
``plan.order``, each at the time its own gradient *and every earlier one in
``order``* is ready; at event ``i`` the blocks whose tensors have all been
processed enter the heap and ``phase1_windows[i]`` of them are released, in
(priority, block id) order, as one group; at the end of backward the rest
is released in groups of ``phase2_windows``. The head of the launch
sequence launches when fewer than its group's window are in flight and the
byte credit allows; launch ``n`` goes on channel ``n % channels``.

Note [Group window]
-------------------
A group released with a positive count ``w`` has window ``w`` even when the
heap held fewer than ``w`` blocks; a group released with ``ALL`` has the
number of blocks it took. This is the runtime's rule (``Release`` in
``scheduler.cc``). Consequence used by the planner: windows only limit
*concurrency*, so a group of one block with window 4 may launch while three
blocks of earlier groups are still in flight.

Note [Two-stage blocks in the simulator]
----------------------------------------
A decoupled block (``Plan.decoupled``) is two collectives, as the runtime
lays it out (``plan.stages_of``): a reduce-scatter that takes part in
phase 1 like any block, and an all-gather that enters the heap only at the
flush and launches only once its reduce-scatter has completed (a waiting
head stops the launch sequence at its place, as in ``scheduler.cc``). Each
stage has its own start-up and per-byte time (``Profile.stage_cost``: by
default half an all-reduce's, the ring formula; measured on the live job);
its transfer is served by the one link as ``beta_stage / beta`` times its
bytes. The credit counts a stage's full bytes, as the runtime's does. Block ids, ``BlockTiming`` and the launch sequence are the
runtime's, stage by stage.

Network model
-------------
Only the network is a shared resource; backward, forward and the optimizer
run on a separate compute resource. A collective of ``n`` bytes, once
started, first spends ``alpha`` seconds of latency that uses no bandwidth,
then its ``n`` bytes are served by one link of rate ``1/beta`` bytes per
second shared equally among the collectives transferring at that moment
(processor sharing). So ``k`` blocks launched together finish at
``alpha + beta * (their total bytes)``: the window cost ``T(k)`` of
DESIGN.md section 4, and a collective never finishes before
``alpha + beta * n`` after it starts. By default a collective starts at its
launch whatever its channel (channels are recorded, as the runtime assigns
them); with ``channel_fifo=True`` a collective starts only when the
previous one on its channel has finished, which is how one process group
behaves when it executes its collectives in order.

Iteration
---------
Time 0 is the start of backward. Backward runs the tensors in the
profile's ready order, each taking ``bwd_s``; a gradient is ready at the end
of its backward. Then:

* ``overlap_forward=True`` (phase 2, lazy step): the forward of tensor ``l``
  (forward order) starts at ``max(fwd_end[l-1], done(l))`` plus that
  tensor's share of the optimizer update, where ``done(l)`` is the end of
  the last block covering ``l``; ``fwd_end[-1]`` is the end of backward.
* ``overlap_forward=False``: ``step()`` waits for everything; the forward
  starts at ``max(backward end, last block end) + update_s`` and runs
  without waits.

``iteration_s`` is the end of the last forward (backward, plus the
communication that is not hidden, plus forward) plus the collectives' host
work: ``Profile.host_s_per_collective`` per collective, host time that
no link model hides. In steady state the next
backward starts right then, so it is the period of training.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math

from .plan import ALL, Plan, PlanError, stages_of, validate
from .profile import Profile, bytes_of
from .sharing import pause


@dataclasses.dataclass(frozen=True)
class BlockTiming:
    """One block's life in the simulated iteration (seconds from the start of backward)."""

    block_id: int
    tensors: tuple[int, ...]
    offset: int
    numel: int
    nbytes: int
    priority: int
    group: int
    """Release group, numbered in release order (the runtime's ``group``)."""
    event: int
    """The event whose processing released it; ``len(plan.order)`` for the flush."""
    window: int
    """The group's window (Note [Group window])."""
    release_s: float
    launch_s: float
    end_s: float
    launch_index: int
    """Position in the launch sequence (the runtime's ``seq``)."""
    channel: int
    op: int = 0
    """The collective (``blockops.ALL_REDUCE``, ``REDUCE_SCATTER`` or ``ALL_GATHER``)."""


@dataclasses.dataclass(frozen=True)
class SimResult:
    iteration_s: float
    """End of the last forward, from the start of backward, plus the collectives' host work
    (``Profile.host_s_per_collective`` per collective)."""
    backward_end_s: float
    comm_end_s: float
    """End of the last block (the backward end when there are no blocks)."""
    ready_s: tuple[float, ...]
    """When each tensor's gradient became ready (by forward index)."""
    event_s: tuple[float, ...]
    """When event ``i`` (tensor ``plan.order[i]``) was processed."""
    blocks: tuple[BlockTiming, ...]
    """By block id."""
    launch_sequence: tuple[int, ...]
    """Block ids in launch order: a function of the plan alone (Note [Same order on every rank])."""
    forward_start_s: tuple[float, ...]
    """Per tensor (forward index): when its forward computation started."""
    forward_end_s: tuple[float, ...]


def ready_times(profile: Profile) -> tuple[float, ...]:
    """When each gradient becomes ready (by forward index): backward in the profile's ready order."""
    ready = [0.0] * profile.num_tensors
    now = 0.0
    for t in profile.order():
        now += profile.tensors[t].bwd_s
        ready[t] = now
    return tuple(ready)


def event_times(profile: Profile) -> list[float]:
    """When the runtime processes each event (the profile's ready order): its gradient and every earlier one
    are ready."""
    ready = ready_times(profile)
    out, latest = [], 0.0
    for t in profile.order():
        latest = max(latest, ready[t])
        out.append(latest)
    return out


@dataclasses.dataclass(frozen=True)
class BlockTable:
    """A plan's blocks laid against a profile: what the simulator and the planners both need."""

    layout: tuple[tuple[tuple[int, ...], int, int, int], ...]
    """``plan.stages_of(plan)`` (``blocks_of`` when nothing is decoupled): (tensors, offset, numel, priority)
    by block id."""
    nbytes: tuple[int, ...]
    """Each block's bytes, what the credit counts."""
    latency_s: tuple[float, ...]
    """Each block's start-up time (Note [Two-stage blocks in the simulator])."""
    wire: tuple[float, ...]
    """What each block costs the link, in bytes at the all-reduce's rate ``1 / beta``."""
    after: tuple[int, ...]
    """The block whose completion each block's launch waits for (-1: none)."""
    at_flush: tuple[bool, ...]
    op: tuple[int, ...]
    enters_at: tuple[tuple[int, ...], ...]
    """Per event: the blocks that enter the heap there (their last tensor's event)."""
    ready_s: tuple[float, ...]
    event_s: tuple[float, ...]
    """Event ``i`` is processed once its tensor and every earlier one in ``order`` are ready."""
    backward_end_s: float


def block_table(plan: Plan, profile: Profile) -> BlockTable:
    ready = ready_times(profile)
    events, latest = [], 0.0
    for t in plan.order:
        latest = max(latest, ready[t])
        events.append(latest)
    itemsize = [bytes_of(t.dtype) for t in profile.tensors]
    stages = stages_of(plan)
    layout = tuple((s.tensors, s.offset, s.numel, s.priority) for s in stages)
    position = {t: i for i, t in enumerate(plan.order)}
    enters_at: list[list[int]] = [[] for _ in plan.order]
    for b, (tensors, _, _, _) in enumerate(layout):
        enters_at[max(position[t] for t in tensors)].append(b)
    nbytes = tuple(numel * itemsize[tensors[0]] for tensors, _, numel, _ in layout)
    costs = {op: profile.stage_cost(op) for op in {s.op for s in stages}}
    beta = profile.beta_s_per_byte
    return BlockTable(
        layout=layout,
        nbytes=nbytes,
        latency_s=tuple(costs[s.op][0] for s in stages),
        wire=tuple(n * (costs[s.op][1] / beta if beta > 0 else 1.0) for n, s in zip(nbytes, stages)),
        after=tuple(s.after for s in stages),
        at_flush=tuple(s.at_flush for s in stages),
        op=tuple(s.op for s in stages),
        enters_at=tuple(tuple(e) for e in enters_at),
        ready_s=ready,
        event_s=tuple(events),
        # The ready times' own sum, so the flush is at the last event's time exactly.
        backward_end_s=max(ready, default=0.0),
    )


def simulate(plan: Plan, profile: Profile, *, update_s: float = 0.0, channel_fifo: bool = False) -> SimResult:
    """Replay one iteration of ``plan`` on ``profile``'s timings (see the module docstring).

    ``update_s`` is the optimizer's time for the whole model, shared among
    tensors in proportion to their bytes.
    """
    _check_args(plan, profile, update_s)
    run = _Run(plan, profile, channel_fifo)
    run.run()
    return run.result(update_s)


def iteration_time(plan: Plan, profile: Profile, *, update_s: float = 0.0, channel_fifo: bool = False,
                   table: BlockTable | None = None) -> float:
    """``simulate(...).iteration_s`` without the per-block records: what a planner's search needs.

    ``table``, if given, must be ``block_table(plan, profile)``.
    """
    _check_args(plan, profile, update_s)
    return unchecked_iteration_time(plan, profile, update_s=update_s, channel_fifo=channel_fifo, table=table)


def unchecked_iteration_time(plan: Plan, profile: Profile, *, update_s: float = 0.0, channel_fifo: bool = False,
                             table: BlockTable | None = None) -> float:
    """:func:`iteration_time` for a plan already known valid for ``profile`` (a planner's own candidates)."""
    run = _Run(plan, profile, channel_fifo, table)
    run.run()
    return run.iteration_s(update_s)


class FlushSnapshot:
    """Phase 1 simulated once, to try several ``phase2_windows`` from the flush on.

    Phase 1 does not depend on the phase-2 windows, so every branch starts
    from the same state.
    """

    def __init__(self, plan: Plan, profile: Profile, *, channel_fifo: bool = False,
                 table: BlockTable | None = None, checked: bool = True) -> None:
        """``table``, if given, must be ``block_table(plan, profile)`` (planners have it already);
        ``checked=False`` skips validating a plan the caller built and knows valid."""
        if checked:
            _check_args(plan, profile, 0.0)
        self._run = _Run(plan, profile, channel_fifo, table)
        self._run.run(stop_at_flush=True)
        self.pending = self._run.in_flight + len(self._run.queue)
        """Blocks released in phase 1 and not finished at the flush."""

    def result(self, phase2_windows: tuple[int, ...], *, update_s: float = 0.0) -> SimResult:
        return self._branch(phase2_windows, update_s).result(update_s)

    def iteration_s(self, phase2_windows: tuple[int, ...], *, update_s: float = 0.0) -> float:
        """``result(...).iteration_s`` without building the per-block records."""
        return self._branch(phase2_windows, update_s).iteration_s(update_s)

    def _branch(self, phase2_windows: tuple[int, ...], update_s: float) -> _Run:
        # The rest of the plan was validated with the profile already.
        windows = tuple(phase2_windows)
        if not windows or any(not isinstance(w, int) or w <= 0 for w in windows):
            raise PlanError("plan 'phase2_windows' must be a non-empty list of positive group sizes")
        if not (math.isfinite(update_s) and update_s >= 0):
            raise ValueError(f"update_s must be finite and >= 0, got {update_s}")
        branch = self._run.clone(dataclasses.replace(self._run.plan, phase2_windows=windows))
        branch.run()
        return branch


def _check_args(plan: Plan, profile: Profile, update_s: float) -> None:
    validate(plan, numels=profile.numels, dtypes=profile.dtypes)
    if not (math.isfinite(update_s) and update_s >= 0):
        raise ValueError(f"update_s must be finite and >= 0, got {update_s}")


class _Run:
    """The event loop; one instance per simulation (or per branch, see :meth:`clone`)."""

    _MUTABLE_LISTS = ("heap", "held", "window", "group", "event", "release_s", "launch_s", "end_s", "launch_index",
                      "channel", "sequence", "latency", "transfer", "channel_busy")

    def __init__(self, plan: Plan, profile: Profile, channel_fifo: bool, table: BlockTable | None = None) -> None:
        self.plan = plan
        self.alpha = profile.alpha_s
        self.beta = profile.beta_s_per_byte
        self.fifo = channel_fifo
        self.table = table or block_table(plan, profile)
        # The collectives' host work (Profile.host_s_per_collective).
        self.host_s = profile.host_s_per_collective * len(self.table.nbytes)
        self.fwd = [tp.fwd_s for tp in profile.tensors]
        self.tensor_bytes = profile.nbytes
        self.nbytes = self.table.nbytes
        self.latency_s = self.table.latency_s
        self.wire = self.table.wire
        self.after = self.table.after
        self.at_flush = self.table.at_flush
        B = len(self.nbytes)
        self.heap: list[tuple[int, int]] = []
        self.held: list[int] = []  # ready, kept for the flush (Note [Two-stage blocks in the simulator])
        self.queue: collections.deque[int] = collections.deque()  # released, not launched
        self.window = [0] * B
        self.group = [-1] * B
        self.event = [-1] * B
        self.release_s = [math.nan] * B
        self.launch_s = [math.nan] * B
        self.end_s = [math.nan] * B
        self.launch_index = [-1] * B
        self.channel = [-1] * B
        self.sequence: list[int] = []
        self.groups = 0
        self.in_flight = 0
        self.in_flight_bytes = 0
        self.now = 0.0
        self.next_event = 0
        self.flushed = False
        # Events where nothing enters the heap and nothing may be released
        # (window 0) change nothing; the loop jumps over them (planners
        # simulate many candidates, and packed plans have mostly such events).
        T = plan.num_tensors
        self.next_active = [T] * (T + 1)
        for i in range(T - 1, -1, -1):
            active = bool(self.table.enters_at[i]) or plan.window_at(i) != 0
            self.next_active[i] = i if active else self.next_active[i + 1]
        # Network state: collectives in their latency phase (end time, block);
        # collectives transferring, in virtual time (see run); and, with
        # channel FIFO, each channel's running collective and its waiting line.
        self.latency: list[tuple[float, int]] = []
        self.served = 0.0
        self.transfer: list[tuple[float, int]] = []
        self.channel_busy = [False] * plan.channels
        self.channel_wait: list[collections.deque[int]] = [collections.deque() for _ in range(plan.channels)]

    def clone(self, plan: Plan) -> _Run:
        """An independent copy of this run's state that will go on with ``plan`` (same layout)."""
        other = object.__new__(_Run)
        other.__dict__.update(self.__dict__)
        for name in self._MUTABLE_LISTS:
            setattr(other, name, list(getattr(self, name)))
        other.queue = collections.deque(self.queue)
        other.channel_wait = [collections.deque(w) for w in self.channel_wait]
        other.plan = plan
        return other

    # -- scheduler (the runtime's rules) --------------------------------------

    def _release(self, requested: int, event: int) -> None:
        take = len(self.heap) if requested == ALL else min(requested, len(self.heap))
        if take <= 0:
            return
        window = take if requested == ALL else requested  # Note [Group window]
        for _ in range(take):
            _, b = heapq.heappop(self.heap)
            self.window[b] = window
            self.group[b] = self.groups
            self.event[b] = event
            self.release_s[b] = self.now
            self.queue.append(b)
        self.groups += 1

    def _process_event(self, i: int) -> None:
        layout = self.table.layout
        for b in self.table.enters_at[i]:
            if self.at_flush[b]:
                self.held.append(b)
            else:
                heapq.heappush(self.heap, (layout[b][3], b))
        self._release(self.plan.window_at(i), i)

    def _flush(self) -> None:
        sizes = self.plan.phase2_windows
        layout = self.table.layout
        for b in self.held:
            heapq.heappush(self.heap, (layout[b][3], b))
        self.held.clear()
        g = 0
        while self.heap:
            self._release(sizes[min(g, len(sizes) - 1)], self.plan.num_tensors)
            g += 1
        self.flushed = True

    def _try_launch(self) -> None:
        credit = self.plan.credit_bytes
        while self.queue:
            b = self.queue[0]
            first = self.after[b]
            if first >= 0 and self.end_s[first] != self.end_s[first]:  # NaN: not done
                return
            if self.in_flight >= self.window[b]:
                return
            if credit > 0 and self.in_flight > 0 and self.in_flight_bytes + self.nbytes[b] > credit:
                return
            self.queue.popleft()
            n = len(self.sequence)
            self.sequence.append(b)
            self.launch_index[b] = n
            self.channel[b] = n % self.plan.channels
            self.launch_s[b] = self.now
            self.in_flight += 1
            self.in_flight_bytes += self.nbytes[b]
            c = self.channel[b]
            if self.fifo and self.channel_busy[c]:
                self.channel_wait[c].append(b)
            else:
                self._start(b)

    # -- network ----------------------------------------------------------------

    def _start(self, b: int) -> None:
        self.channel_busy[self.channel[b]] = True
        heapq.heappush(self.latency, (self.now + self.latency_s[b], b))

    def _complete(self, b: int) -> None:
        self.end_s[b] = self.now
        self.in_flight -= 1
        self.in_flight_bytes -= self.nbytes[b]
        c = self.channel[b]
        self.channel_busy[c] = False
        if self.fifo and self.channel_wait[c]:
            self._start(self.channel_wait[c].popleft())

    def run(self, stop_at_flush: bool = False) -> None:
        """Advance to the end of the iteration, or to the instant of the flush, before it releases."""
        pause()  # Note [Planning beside training]
        # Processor sharing in virtual time: every transferring collective is
        # served the same bytes, so one counter (`served`, bytes per collective
        # since time 0) tracks them all, and a collective that starts
        # transferring at `served = v` finishes when it reaches `v + nbytes`:
        # a heap of those marks gives the next completion in O(log n).
        T = self.plan.num_tensors
        event_s = self.table.event_s
        inf = math.inf
        if self.next_event == T and not self.flushed and self.now >= self.table.backward_end_s:
            self._flush()  # resuming a branch stopped at the flush
            self._try_launch()
        next_active = self.next_active
        while True:
            if self.next_event < T:
                self.next_event = next_active[self.next_event]
            if self.next_event < T:
                t_release = event_s[self.next_event]
            else:
                t_release = inf if self.flushed else self.table.backward_end_s
            t_latency = self.latency[0][0] if self.latency else inf
            n = len(self.transfer)
            t_transfer = self.now + (self.transfer[0][0] - self.served) * self.beta * n if n else inf
            t = min(t_release, t_latency, t_transfer)
            if t == inf:
                return
            if n:
                if t == t_transfer:
                    self.served = self.transfer[0][0]
                else:
                    self.served += (t - self.now) / (self.beta * n)
            self.now = t
            # Order at one instant: completions, then releases, then launches,
            # as in the runtime where a completion wakes the dispatch thread.
            while self.transfer and self.transfer[0][0] - self.served <= 1e-9 * self.wire[self.transfer[0][1]]:
                self._complete(heapq.heappop(self.transfer)[1])
            while self.latency and self.latency[0][0] <= self.now:
                _, b = heapq.heappop(self.latency)
                if self.beta == 0:
                    self._complete(b)
                else:
                    heapq.heappush(self.transfer, (self.served + self.wire[b], b))
            while self.next_event < T and event_s[self.next_event] <= self.now:
                self._process_event(self.next_event)
                self.next_event = next_active[self.next_event + 1]
            # The flush comes when the backward ends: not at the last event processed above, which may be
            # earlier when the events after it release nothing (empty tensors are skipped).
            if self.next_event == T and not self.flushed and self.table.backward_end_s <= self.now:
                if stop_at_flush:
                    return
                self._flush()
            self._try_launch()

    # -- forward ----------------------------------------------------------------

    def forward(self, update_s: float) -> tuple[list[float], list[float]]:
        """Forward start and end times per tensor (module docstring, Iteration)."""
        plan = self.plan
        T = plan.num_tensors
        done = [-math.inf] * T
        end_s = self.end_s
        for b, (tensors, _, _, _) in enumerate(self.table.layout):
            e = end_s[b]
            for t in tensors:
                done[t] = max(done[t], e)
        backward_end = self.table.backward_end_s
        starts, ends = [], []
        if plan.overlap_forward:
            if update_s:
                total = sum(self.tensor_bytes)
                share = [update_s * self.tensor_bytes[t] / total if total else update_s / T for t in range(T)]
            else:
                share = [0.0] * T
            prev = backward_end
            fwd = self.fwd
            for t in range(T):
                d = done[t]
                start = max(prev, d) + share[t]
                prev = start + fwd[t]
                starts.append(start)
                ends.append(prev)
        else:
            prev = max(backward_end, max(self.end_s, default=backward_end)) + update_s
            for t in range(T):
                starts.append(prev)
                prev += self.fwd[t]
                ends.append(prev)
        return starts, ends

    def iteration_s(self, update_s: float) -> float:
        """The end of the last forward, plus the collectives' host work."""
        ends = self.forward(update_s)[1]
        return (ends[-1] if ends else 0.0) + self.host_s

    def result(self, update_s: float) -> SimResult:
        layout = self.table.layout
        backward_end = self.table.backward_end_s
        starts, ends = self.forward(update_s)
        blocks = tuple(
            BlockTiming(b, tensors, offset, numel, self.nbytes[b], priority, self.group[b], self.event[b],
                        self.window[b], self.release_s[b], self.launch_s[b], self.end_s[b], self.launch_index[b],
                        self.channel[b], self.table.op[b])
            for b, (tensors, offset, numel, priority) in enumerate(layout))
        return SimResult(
            iteration_s=(ends[-1] if ends else 0.0) + self.host_s,
            backward_end_s=backward_end,
            comm_end_s=max(self.end_s, default=backward_end),
            ready_s=self.table.ready_s,
            event_s=self.table.event_s,
            blocks=blocks,
            launch_sequence=tuple(self.sequence),
            forward_start_s=tuple(starts),
            forward_end_s=tuple(ends),
        )
