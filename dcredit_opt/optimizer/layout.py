"""Where each gradient lives: flat buffers per dtype, and the blocks cut from them.

A pure function of the plan and the tensors' dtypes, tested alone. Tensors
are laid out in the plan's event order, so a merge (neighbours in that
order) is one contiguous range and needs no copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..planner.plan import Plan, PlanError, split_evenly, stages_of

__all__ = ["Layout", "build_layout", "fixed_plan"]


@dataclasses.dataclass(frozen=True)
class Layout:
    segment_keys: tuple[str, ...]
    """One flat buffer per dtype, in first-use order (the dtype's name)."""
    segment_numels: tuple[int, ...]
    tensor_segment: tuple[int, ...]
    """For each tensor (forward index): its buffer, and its element offset there."""
    tensor_offset: tuple[int, ...]
    # Per block, in block-id order (the scheduler's arrays).
    block_segment: tuple[int, ...]
    block_offset: tuple[int, ...]
    block_numel: tuple[int, ...]
    block_bytes: tuple[int, ...]
    block_priority: tuple[int, ...]
    block_tensors: tuple[tuple[int, ...], ...]
    # Note [Two-stage blocks] (``Plan.decoupled``): per block, its collective (ALL_REDUCE, REDUCE_SCATTER or
    # ALL_GATHER of blockops.py), the block whose completion its launch waits for (-1: none), and whether it
    # waits for the flush.
    block_op: tuple[int, ...] = ()
    block_after: tuple[int, ...] = ()
    block_at_flush: tuple[bool, ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.block_segment)


def build_layout(plan: Plan, dtype_names: Sequence[str], itemsizes: Sequence[int]) -> Layout:
    """Lay out ``plan``'s tensors (dtype ``dtype_names[t]``, ``itemsizes[t]`` bytes each)."""
    T = plan.num_tensors
    if len(dtype_names) != T or len(itemsizes) != T:
        raise PlanError(f"the plan has {T} tensors but {len(dtype_names)} dtypes were given")
    keys: list[str] = []
    sizes: list[int] = []
    seg = [0] * T
    off = [0] * T
    for t in plan.order:
        key = str(dtype_names[t])
        if key not in keys:
            keys.append(key)
            sizes.append(0)
        s = keys.index(key)
        seg[t], off[t] = s, sizes[s]
        sizes[s] += plan.numels[t]
    b_seg, b_off, b_numel, b_bytes, b_prio, b_tensors = [], [], [], [], [], []
    b_op, b_after, b_at_flush = [], [], []
    for stage in stages_of(plan):
        head = stage.tensors[0]
        if any(seg[t] != seg[head] for t in stage.tensors):
            raise PlanError(f"plan 'merges' entry {list(stage.tensors)} mixes dtypes")
        b_seg.append(seg[head])
        b_off.append(off[head] + stage.offset)
        b_numel.append(stage.numel)
        b_bytes.append(stage.numel * int(itemsizes[head]))
        b_prio.append(stage.priority)
        b_tensors.append(tuple(stage.tensors))
        b_op.append(stage.op)
        b_after.append(stage.after)
        b_at_flush.append(stage.at_flush)
    return Layout(tuple(keys), tuple(sizes), tuple(seg), tuple(off), tuple(b_seg), tuple(b_off),
                  tuple(b_numel), tuple(b_bytes), tuple(b_prio), tuple(b_tensors), tuple(b_op), tuple(b_after),
                  tuple(b_at_flush))


def fixed_plan(numels: Sequence[int], itemsizes: Sequence[int], block_bytes: int, window: int,
               channels: int, credit_bytes: int = 0, overlap_forward: bool = True) -> Plan:
    """The plan used before (or without) profiling: equal blocks of ``block_bytes``,
    the same window at every event and in phase 2, ready order assumed to be backward
    (reverse forward) order."""
    if block_bytes <= 0:
        raise PlanError(f"block_bytes must be positive, got {block_bytes}")
    if window == 0 or window < -1:
        raise PlanError(f"window must be positive or -1 (all), got {window}")
    T = len(numels)
    return Plan(
        numels=tuple(int(n) for n in numels),
        order=tuple(reversed(range(T))),
        partition=tuple(split_evenly(int(n), max(1, block_bytes // int(size))) for n, size in zip(numels, itemsizes)),
        phase1_windows=(window,) * T,
        phase2_windows=(window if window > 0 else 1 << 30,),
        credit_bytes=credit_bytes,
        channels=channels,
        overlap_forward=overlap_forward,
        policy="custom",
    )
