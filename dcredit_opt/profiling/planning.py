"""Glue between the runtime's Config and the planner's policies."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

from ..planner import policies, search
from ..planner.plan import Plan
from ..planner.profile import Profile

CHANNEL_FIFO = True
"""The simulator's network model that plans are tuned and searched under: collectives one after
another on each channel (``simulate(..., channel_fifo=True)``), the model the measured runs support
(``benchmarks/results/calibration.md``: mean error 2.9 % against 3.3 % for processor sharing, and
the one scheme with several collectives in flight, ByteScheduler on VGG, predicted within 1 % where
processor sharing is 8 % short)."""


def measures_stages(policy: str, world_size: int) -> bool:
    """Whether profiling measures what a reduce-scatter and an all-gather cost (``profiler.measure_stage_ratios``):
    only where the plan may decouple blocks (``Plan.decoupled``): DeAR's, and D-Credit's search where more than
    one rank takes part (Note [A world of one never decouples] in ``planner/search.py``). The others never pay
    for that sweep."""
    return policy == "dear" or (policy == "dcredit" and search.decouples(world_size))


def make_plan(profile: Profile, policy: str, *, channels: int, overlap_forward: bool = True,
              channel_fifo: bool | None = None) -> Plan:
    """The plan the runtime runs for ``policy`` on ``profile``.

    ``bytescheduler`` means the best fixed block size and credit for this
    profile (searched over the simulator), never an arbitrary default,
    ``usbyte`` its best unit size with the same number of tries, ``dear`` its best fusion threshold
    with as many, and
    ``dcredit`` the fastest plan of the planner's search
    (:mod:`.planner.search`: D-Credit's own plans over the same block sizes,
    and every baseline's plan as the runtime makes it, so that D-Credit is
    never slower than any of them in the simulator), all judged under the
    network model :data:`CHANNEL_FIFO` (or ``channel_fifo`` when given); a plan
    never uses more channels than the runtime has, and phase 2 stays off when
    the user turned it off.
    """
    if policy == "bytescheduler":
        build = policies.tune_bytescheduler
    elif policy == "usbyte":
        build = policies.tune_usbyte
    elif policy == "dear":
        build = policies.tune_dear
    elif policy in policies.RESULT_CHANGING:
        build = policies.RESULT_CHANGING[policy]
    elif policy == "dcredit":
        build = functools.partial(search.search, overlap_forward=overlap_forward)
    elif policy in policies.POLICIES:
        build = policies.POLICIES[policy]
    else:
        return policies.make_plan(profile, policy)  # raises the error that lists the known policies
    accepted = inspect.signature(build).parameters
    kwargs = {"channels": channels} if "channels" in accepted else {}
    if "block_sizes" in accepted:
        kwargs["block_sizes"] = block_size_grid(profile)
    if "channel_fifo" in accepted:
        kwargs["channel_fifo"] = CHANNEL_FIFO if channel_fifo is None else channel_fifo
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
