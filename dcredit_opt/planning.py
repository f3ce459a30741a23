"""Glue between the runtime's Config and the planner's policies."""

from __future__ import annotations

import dataclasses
import inspect
import math

from .planner import policies
from .planner.plan import Plan
from .planner.profile import Profile


def make_plan(profile: Profile, policy: str, *, channels: int, overlap_forward: bool = True) -> Plan:
    """The plan the runtime runs for ``policy`` on ``profile``.

    ``bytescheduler`` means the best fixed block size and credit for this
    profile (searched over the simulator), never an arbitrary default, and
    ``dcredit`` likewise gets its best block size (its windows it chooses
    itself), so the two are compared on equal terms; a plan
    never uses more channels than the runtime has, and phase 2 stays off when
    the user turned it off.
    """
    if policy == "bytescheduler":
        build = policies.tune_bytescheduler
    elif policy == "dcredit":
        build = policies.tune_dcredit
    elif policy in policies.POLICIES:
        build = policies.POLICIES[policy]
    else:
        return policies.make_plan(profile, policy)  # raises the error that lists the known policies
    accepted = inspect.signature(build).parameters
    kwargs = {"channels": channels} if "channels" in accepted else {}
    if "block_sizes" in accepted:
        kwargs["block_sizes"] = block_size_grid(profile)
    plan = build(profile, **kwargs)
    if plan.channels > channels:
        plan = dataclasses.replace(plan, channels=channels)
    if not overlap_forward and plan.overlap_forward:
        plan = dataclasses.replace(plan, overlap_forward=False)
    return plan


# A block must carry enough bytes that its start-up cost stays a small share
# of its transfer: the simulator lets collectives overlap their latency
# freely, while a real channel serves its collectives largely one after
# another, so tiny blocks that look free in the model cost alpha each in
# practice (seen on Gloo: 64 KiB blocks of a 34M-parameter model tripled the
# iteration). 10 % keeps that loss small; 256 KiB is the floor on fast links.
MAX_STARTUP_SHARE = 0.10
MIN_BLOCK_BYTES = 256 * 1024


def block_size_grid(profile: Profile) -> list[int]:
    """Block sizes the runtime tunes over: powers of two from the floor up to the largest tensor."""
    largest = max((t.nbytes for t in profile.tensors), default=MIN_BLOCK_BYTES)
    beta = profile.beta_s_per_byte
    floor = MIN_BLOCK_BYTES if beta <= 0 else max(MIN_BLOCK_BYTES, profile.alpha_s / (MAX_STARTUP_SHARE * beta))
    low = 1 << math.ceil(math.log2(floor))
    high = 1 << max(0, math.ceil(math.log2(max(largest, 1))))
    return [1 << k for k in range(int(math.log2(low)), int(math.log2(max(high, low))) + 1)]
