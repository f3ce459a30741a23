"""Glue between the runtime's Config and the planner's policies."""

from __future__ import annotations

import dataclasses
import inspect

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
    else:
        build = lambda prof, **kw: policies.make_plan(prof, policy, **kw)  # noqa: E731
        if policy in policies.POLICIES:
            build.__signature__ = inspect.signature(policies.POLICIES[policy])
    accepted = inspect.signature(build).parameters
    kwargs = {"channels": channels} if "channels" in accepted else {}
    plan = build(profile, **kwargs)
    if plan.channels > channels:
        plan = dataclasses.replace(plan, channels=channels)
    if not overlap_forward and plan.overlap_forward:
        plan = dataclasses.replace(plan, overlap_forward=False)
    return plan
