"""DeFT: some updates one iteration late, so that their gradients' communication leaves the critical path.

Note [Delayed updates]
----------------------
Synchronous data parallelism has hard dependencies: the forward of a layer
waits for its gradient's reduction, and the gradient ready last (the input
side's) is needed first. DeFT (Meng, Sun and Zhu, FGCS 2026) relaxes them:
a delayed tensor's update at step ``k`` applies the sum of the gradients of
step ``k - 1``, so its reduction may run during the whole next iteration
and nothing waits for it. That changes what is trained: it is not
synchronous data parallelism (Invariant 3 of DESIGN.md), so the runtime
makes such plans only under ``Config(policy="deft",
accept_delayed_updates=True)``, and says so.

What the runtime does (``optimizer/``): a delayed tensor has no blocks.
At the end of each backward its gradient is copied out and summed over
ranks in the background (one collective for all delayed tensors, on the
side channel, after the step's other traffic is queued); the reduced
gradient written for its update is the previous step's sum, averaged as
the others are; at the first step there is none, and the update sees a
zero gradient (weight decay and optimizer counters still advance).

The plan (:func:`deft`): DeFT casts the choice as knapsacks whose capacity
is the compute time the background reduction can hide under. Here: the
link must carry every byte once per iteration anyway, so an iteration
takes at least ``beta`` times all the bytes (plus one start-up); below
that, the delayed bundle is free, and above it, it stretches the
iteration. :func:`iteration_time` is that model: the simulated iteration
of the blocks that remain, or the link's total work, whichever is longer.
Tensors are tried input side first (ready last in backward, needed first
in forward: the chain no schedule hides), each kept delayed when the
model's iteration gets shorter; the blocks of the rest are D-Credit's,
tuned over the block sizes once the set is chosen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .dcredit import DEFAULT_BLOCK_BYTES, dcredit
from .plan import Plan
from .profile import Profile
from .simulate import simulate


def without(profile: Profile, tensors) -> Profile:
    """``profile`` with ``tensors`` sending nothing (numel 0): what the blocks of the rest are planned on."""
    gone = set(tensors)
    return dataclasses.replace(profile, tensors=tuple(
        dataclasses.replace(t, numel=0) if t.forward_index in gone else t for t in profile.tensors))


def iteration_time(plan: Plan, profile: Profile, *, update_s: float = 0.0, channel_fifo: bool = False) -> float:
    """The model's iteration (module docstring): the simulated iteration of ``plan``'s blocks, or the link's
    work for every byte (blocks and the delayed bundle) plus one start-up, whichever is longer."""
    result = simulate(plan, profile, update_s=update_s, channel_fifo=channel_fifo)
    late = sum(profile.tensors[t].nbytes for t in plan.delayed)
    # What the blocks cost the link: each stage's per-byte time over its bytes.
    link = sum(profile.stage_cost(b.op)[1] * b.nbytes for b in result.blocks)
    link += profile.beta_s_per_byte * late
    start_up = profile.alpha_s if result.blocks or late else 0.0
    return max(result.iteration_s, start_up + link)


def with_delayed(plan: Plan, profile: Profile, delayed: Sequence[int]) -> Plan:
    """``plan`` (made on ``without(profile, delayed)``) for the whole model: full ``numels``, the delayed
    tensors without blocks."""
    return dataclasses.replace(plan, numels=profile.numels, delayed=tuple(sorted(delayed)), policy="deft")


def deft(profile: Profile, *, block_sizes: Sequence[int] | None = None, channels: int = 1, update_s: float = 0.0,
         channel_fifo: bool = False) -> Plan:
    """The DeFT plan (Note [Delayed updates]): the delayed tensors, input side first, then D-Credit's blocks
    for the rest at the best of ``block_sizes`` (default: D-Credit's 4 MiB)."""
    sizes = sorted(set(block_sizes)) if block_sizes else [DEFAULT_BLOCK_BYTES]

    def plan_for(delayed: list[int], size: int) -> Plan:
        rest = without(profile, delayed)
        return with_delayed(dcredit(rest, block_bytes=size, channels=channels, update_s=update_s), profile, delayed)

    def cost(plan: Plan) -> float:
        return iteration_time(plan, profile, update_s=update_s, channel_fifo=channel_fifo)

    def best_size(delayed: list[int]) -> tuple[Plan, float, int]:
        plans = [plan_for(delayed, size) for size in sizes]
        costs = [cost(p) for p in plans]
        i = costs.index(min(costs))
        return plans[i], costs[i], sizes[i]

    best, best_s, size = best_size([])
    delayed: list[int] = []
    for t in reversed(profile.order()):
        if not profile.tensors[t].numel:
            continue
        trial = plan_for([*delayed, t], size)
        s = cost(trial)
        if s < best_s * (1 - 1e-9):
            delayed.append(t)
            best, best_s = trial, s
    if delayed and len(sizes) > 1:
        tuned, tuned_s, _ = best_size(delayed)
        if tuned_s < best_s:
            best = tuned
    return best
