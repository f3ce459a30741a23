"""The executable plan: what the runtime (and the simulator) carry out.

A plan is plain data. Policies (``dcredit_opt.planner.policies``) produce it
from a profile; the C++ scheduler executes it; the simulator replays it. The
runtime calls :func:`validate` before it switches to a plan, so a plan that
reaches the scheduler can always be executed.

Terms
-----
tensor
    One parameter's gradient, numbered by its forward-order index
    ``0 .. T-1`` (0 is nearest the input).
event
    "Tensor ``order[i]`` has its final gradient". Events are processed in
    ``order``; see Note [Same order on every rank].
block
    A contiguous range of elements that goes through one collective. A
    tensor is cut into blocks by ``partition[t]`` (element counts, summing to
    the tensor's numel). A *merge* joins whole tensors that are neighbours in
    ``order`` (and share a dtype) into one block, so that one collective
    carries them all (DDP buckets, MG-WFBP).
priority
    ``priority[t]``; lower goes first. A block's priority is the smallest
    priority of its tensors. Ties break by block id. Block ids number blocks
    in layout order: tensors in ``order``, each tensor's blocks by offset; a
    merged block takes the id of its place in that layout.

Note [Same order on every rank]
-------------------------------
Collectives on a channel are matched by their sequence alone, so every rank
must launch the same blocks in the same order on the same channels. Timing
differs between ranks; the sequence must not. The scheduler therefore takes
decisions only at events, and processes events strictly in ``order``: an
event that arrives early (a gradient that is ready before one expected
earlier) waits in a buffer until all events before it have been processed;
an event that never arrives (a parameter unused on this rank) is supplied by
the flush at ``step()``. The state after event ``i`` (which blocks are in the
heap, which have been released) is then the same on every rank, and so is
the launch sequence. Completions, which do depend on timing, only decide
*when* the next block of the sequence launches, never *which* one.

Note [Credit window]
--------------------
At event ``i`` the scheduler releases ``phase1_windows[i]`` blocks from the
heap of ready blocks, highest priority first, into the launch sequence (as
one *group*; ``ALL`` releases the whole heap; 0 holds everything back so a
higher-priority gradient that arrives later can overtake). At the flush (end
of backward), everything left in the heap is released in priority order in
groups of ``phase2_windows[0], phase2_windows[1], ...`` blocks, the last size
repeating. The size asked for is the group's *window* (for ``ALL``, the
number of blocks it released): a block may launch only while fewer than
its group's window are in flight, and (when
``credit_bytes > 0``) while the bytes in flight plus its own stay within
``credit_bytes``. A block larger than ``credit_bytes`` may launch only when
nothing is in flight: it overdraws the credit alone rather than never
running. Returned credit never exceeds what was taken, so the credit is never
above ``credit_bytes``. Launch ``n`` of an iteration goes on channel
``n % channels``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from ..blockops import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER

ALL = -1
"""A phase-1 window that releases every ready block at that event."""

POLICY_NAMES = (
    "wfbp",
    "ddp",
    "mgwfbp",
    "oasr",
    "bytescheduler",
    "usbyte",
    "dear",
    "dcredit",
    "deft",
)
"""The planner's policies (``policies.py`` makes each one's plans): what ``Config.policy`` names, besides
"fixed", and what a plan's ``policy`` says, besides "custom" (a plan no policy made)."""


class PlanError(ValueError):
    """A plan that the runtime cannot execute; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one iteration's gradients are cut, ordered and windowed.

    All sequences are tuples so that a plan is hashable and immutable.
    """

    numels: tuple[int, ...]
    """Elements of each tensor, by forward index (the layout the plan was made for)."""

    order: tuple[int, ...]
    """Tensors in the order their gradients are expected to become ready."""

    partition: tuple[tuple[int, ...], ...]
    """For each tensor (by forward index), the element count of each of its blocks."""

    merges: tuple[tuple[int, ...], ...] = ()
    """Runs of tensors (consecutive in ``order``, one block each) reduced as one block."""

    priority: tuple[int, ...] | None = None
    """Per-tensor priority, lower first; ``None`` means the forward index."""

    phase1_windows: tuple[int, ...] | None = None
    """Blocks released at each event (``ALL``, 0 or a positive count); ``None`` means ALL."""

    phase2_windows: tuple[int, ...] = (1,)
    """Group sizes for the blocks left at the flush; the last size repeats."""

    credit_bytes: int = 0
    """Bytes allowed in flight at once; 0 means no byte limit (only the window)."""

    channels: int = 1
    """How many channels (process groups) launches rotate over."""

    overlap_forward: bool = True
    """Phase 2 on: ``step()`` returns early and each layer's forward waits for its own update."""

    decoupled: tuple[int, ...] = ()
    """Tensors whose blocks go in two collectives (DeAR): a reduce-scatter when the block is released, and
    an all-gather of the reduced shards released only at the flush, in priority order, so that it overlaps
    the next forward (Note [Two-stage blocks] in ``csrc/core/scheduler.cc``). A merge is decoupled whole
    or not at all."""

    delayed: tuple[int, ...] = ()
    """Tensors whose updates are one iteration late (DeFT, Note [Delayed updates] in ``planner/deft.py``):
    they have no blocks; their gradients are summed in the background while the next iteration runs, and
    each update applies the previous iteration's sum. Not synchronous data parallelism: only a plan of
    ``Config(policy="deft", accept_delayed_updates=True)`` may have them."""

    policy: str = "custom"
    """The policy that produced this plan (for logs and timelines)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        if not isinstance(data, dict):
            raise PlanError(f"a plan must be a JSON object, got {type(data).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise PlanError(f"unknown plan field(s): {', '.join(unknown)}")
        for required in ("numels", "order", "partition"):
            if required not in data:
                raise PlanError(f"plan field '{required}' is missing")
        kwargs = dict(data)
        for name in ("numels", "order", "priority", "phase1_windows", "phase2_windows", "decoupled", "delayed"):
            if kwargs.get(name) is not None:
                kwargs[name] = tuple(int(x) for x in kwargs[name])
        kwargs["partition"] = tuple(tuple(int(x) for x in p) for p in kwargs["partition"])
        kwargs["merges"] = tuple(tuple(int(x) for x in m) for m in kwargs.get("merges", ()))
        return cls(**kwargs)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    @property
    def num_tensors(self) -> int:
        return len(self.numels)

    def tensor_priority(self, t: int) -> int:
        return t if self.priority is None else self.priority[t]

    def window_at(self, event: int) -> int:
        return ALL if self.phase1_windows is None else self.phase1_windows[event]


def blocks_of(plan: Plan) -> list[tuple[tuple[int, ...], int, int, int]]:
    """The plan's blocks in block-id order.

    Each block is ``(tensors, first_offset, numel, priority)``: the tensors it
    covers (one, or a merge), the element offset inside the first tensor, the
    number of elements, and its priority. This is the one definition of the
    layout; the runtime and the simulator both use it.
    """
    merged_head: dict[int, tuple[int, ...]] = {}
    merged_member: set[int] = set()
    for run in plan.merges:
        merged_head[run[0]] = run
        merged_member.update(run[1:])
    blocks = []
    for t in plan.order:
        if t in merged_member:
            continue
        if t in merged_head:
            run = merged_head[t]
            numel = sum(plan.numels[u] for u in run)
            blocks.append((run, 0, numel, min(plan.tensor_priority(u) for u in run)))
            continue
        offset = 0
        for size in plan.partition[t]:
            blocks.append(((t,), offset, size, plan.tensor_priority(t)))
            offset += size
    return blocks


@dataclasses.dataclass(frozen=True)
class Stage:
    """One collective of the launch layout: a block of :func:`blocks_of`, or one of a decoupled block's two."""

    tensors: tuple[int, ...]
    offset: int
    numel: int
    priority: int
    op: int = ALL_REDUCE
    after: int = -1
    """The stage whose completion this one's launch waits for (-1: none)."""
    at_flush: bool = False
    """Held out of phase 1: released at the flush with everything left (Note [Two-stage blocks])."""


def stages_of(plan: Plan) -> list[Stage]:
    """The collectives the scheduler launches, in its block-id order: :func:`blocks_of`, each block of a
    ``decoupled`` tensor becoming a reduce-scatter and, right after it, an all-gather that waits for it and
    for the flush (Note [Two-stage blocks] in ``csrc/core/scheduler.cc``). The one definition the runtime's
    layout and the simulator share."""
    split = set(plan.decoupled)
    out: list[Stage] = []
    for tensors, offset, numel, priority in blocks_of(plan):
        if tensors[0] in split:
            out.append(Stage(tensors, offset, numel, priority, REDUCE_SCATTER))
            out.append(Stage(tensors, offset, numel, priority, ALL_GATHER, after=len(out) - 1, at_flush=True))
        else:
            out.append(Stage(tensors, offset, numel, priority))
    return out


def validate(plan: Plan, numels: Sequence[int] | None = None, max_channels: int | None = None,
             dtypes: Sequence[object] | None = None) -> None:
    """Raise :class:`PlanError` naming the field unless the runtime can execute ``plan``.

    ``numels``/``dtypes`` are the live model's tensors (by forward index);
    ``max_channels`` is how many channels the runtime has.
    """
    T = len(plan.numels)
    if numels is not None and tuple(int(n) for n in numels) != tuple(plan.numels):
        if len(numels) != T:
            raise PlanError(f"plan 'numels' has {T} tensors, the model has {len(numels)}")
        bad = next(i for i in range(T) if int(numels[i]) != plan.numels[i])
        raise PlanError(
            f"plan 'numels'[{bad}] = {plan.numels[bad]} but the model's tensor {bad} has {numels[bad]} elements")
    if any(n < 0 for n in plan.numels):
        raise PlanError("plan 'numels' has a negative element count")
    if sorted(plan.order) != list(range(T)):
        raise PlanError(f"plan 'order' must be a permutation of 0..{T - 1}")
    if len(plan.partition) != T:
        raise PlanError(f"plan 'partition' has {len(plan.partition)} entries for {T} tensors")
    if len(set(plan.delayed)) != len(plan.delayed) or any(not 0 <= t < T for t in plan.delayed):
        raise PlanError(f"plan 'delayed' must name distinct tensors of 0..{T - 1}, got {list(plan.delayed)}")
    late = set(plan.delayed)
    for t, sizes in enumerate(plan.partition):
        if any(s <= 0 for s in sizes):
            raise PlanError(f"plan 'partition'[{t}] has a block of {min(sizes)} elements; blocks must be positive")
        if t in late:
            if sizes:
                raise PlanError(f"plan 'partition'[{t}] cuts tensor {t} into blocks, but it is 'delayed' (its "
                                "gradient is summed in the background, without blocks): give it ()")
            continue
        if sum(sizes) != plan.numels[t]:
            raise PlanError(
                f"plan 'partition'[{t}] sums to {sum(sizes)} elements, tensor {t} has {plan.numels[t]}")
    position = {t: i for i, t in enumerate(plan.order)}
    seen: set[int] = set()
    for run in plan.merges:
        if len(run) < 2:
            raise PlanError(f"plan 'merges' entry {list(run)} must join at least two tensors")
        for t in run:
            if not 0 <= t < T:
                raise PlanError(f"plan 'merges' names tensor {t}, which does not exist")
            if t in seen:
                raise PlanError(f"plan 'merges' puts tensor {t} in two merges")
            seen.add(t)
            if len(plan.partition[t]) != 1:
                raise PlanError(f"plan 'merges' joins tensor {t}, which the partition cuts into blocks")
        positions = [position[t] for t in run]
        if positions != list(range(positions[0], positions[0] + len(run))):
            raise PlanError(f"plan 'merges' entry {list(run)} is not a run of neighbours in 'order'")
        if dtypes is not None and len({str(dtypes[t]) for t in run}) != 1:
            raise PlanError(f"plan 'merges' entry {list(run)} mixes dtypes")
    if len(set(plan.decoupled)) != len(plan.decoupled) or any(not 0 <= t < T for t in plan.decoupled):
        raise PlanError(f"plan 'decoupled' must name distinct tensors of 0..{T - 1}, got {list(plan.decoupled)}")
    split = set(plan.decoupled)
    if split & late:
        raise PlanError(f"plan 'decoupled' names delayed tensor(s) {sorted(split & late)}, which have no blocks")
    for run in plan.merges:
        if 0 < len(split & set(run)) < len(run):
            raise PlanError(f"plan 'decoupled' splits merge {list(run)}: decouple all of it or none")
    if plan.priority is not None and len(plan.priority) != T:
        raise PlanError(f"plan 'priority' has {len(plan.priority)} entries for {T} tensors")
    if plan.phase1_windows is not None:
        if len(plan.phase1_windows) != T:
            raise PlanError(f"plan 'phase1_windows' has {len(plan.phase1_windows)} entries for {T} events")
        bad = [w for w in plan.phase1_windows if w < 0 and w != ALL]
        if bad:
            raise PlanError(f"plan 'phase1_windows' has window {bad[0]}; use a count >= 0 or ALL ({ALL})")
    if not plan.phase2_windows or any(w <= 0 for w in plan.phase2_windows):
        raise PlanError("plan 'phase2_windows' must be a non-empty list of positive group sizes")
    if plan.credit_bytes < 0:
        raise PlanError(f"plan 'credit_bytes' is {plan.credit_bytes}; it must be >= 0 (0 means no byte limit)")
    if plan.channels < 1:
        raise PlanError(f"plan 'channels' is {plan.channels}; it must be >= 1")
    if max_channels is not None and plan.channels > max_channels:
        raise PlanError(f"plan 'channels' is {plan.channels} but the runtime has {max_channels}")
    known = (*POLICY_NAMES, "custom")
    if plan.policy not in known:
        raise PlanError(f"plan 'policy' is {plan.policy!r}; known policies: {', '.join(known)}")


def split_evenly(numel: int, block_elems: int) -> tuple[int, ...]:
    """``numel`` as ``ceil(numel / block_elems)`` blocks of ``block_elems`` (the last one shorter).

    A zero-element tensor has no blocks.
    """
    if block_elems <= 0:
        raise PlanError(f"block size must be positive, got {block_elems} elements")
    full, rest = divmod(numel, block_elems)
    return (block_elems,) * full + ((rest,) if rest else ())
