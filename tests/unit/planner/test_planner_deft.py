"""DeFT's planner (Note [Delayed updates] in planner/deft.py): which tensors it delays, its iteration model, and
what a plan with delayed tensors may hold."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings

from dcredit_opt.planner import deft
from dcredit_opt.planner.dcredit import dcredit
from dcredit_opt.planner.floors import lower_bound
from dcredit_opt.planner.plan import Plan, PlanError, validate
from dcredit_opt.planner.profile import Profile, TensorProfile
from dcredit_opt.planner.simulate import simulate

from .strategies import profiles


def chain_profile() -> Profile:
    # The input layer is large and ready last: synchronous training reduces its 40 kB after the backward
    # (0.1 + 0.4 s) before the next forward can start; the rest is small. Compute 1.2 s, all bytes 0.45 s.
    sizes = (10_000, 100, 100, 1_000)
    tensors = tuple(TensorProfile(f"t{i}", n, "float32", i, 0.1, 0.2) for i, n in enumerate(sizes))
    return Profile(tensors, alpha_s=0.1, beta_s_per_byte=1e-5, world_size=2)


def test_deft_delays_the_input_side_chain():
    p = chain_profile()
    plan = deft.deft(p)
    validate(plan, numels=p.numels, dtypes=p.dtypes)
    assert plan.policy == "deft" and plan.delayed == (0,)
    assert plan.partition[0] == () and plan.numels == p.numels
    synchronous = dcredit(p)
    ours = deft.iteration_time(plan, p)
    assert ours < simulate(synchronous, p).iteration_s - 0.3  # the 0.5 s chain, less what still waits
    assert ours >= lower_bound(p) - 1e-12
    # Nothing waits for a delayed tensor: its forward starts right after the backward.
    assert simulate(plan, p).forward_start_s[0] == pytest.approx(sum(t.bwd_s for t in p.tensors))


def test_iteration_model_counts_the_delayed_bytes_on_the_link():
    # Communication-bound: delaying moves bytes out of the blocks but not off the link.
    p = dataclasses.replace(chain_profile(), beta_s_per_byte=1e-4)
    plan = deft.with_delayed(dcredit(deft.without(p, [0]), block_bytes=4096), p, [0])
    link = p.alpha_s + p.beta_s_per_byte * p.total_bytes
    assert deft.iteration_time(plan, p) >= link - 1e-12
    assert simulate(plan, p).iteration_s < link  # what the blocks alone would suggest


@settings(max_examples=40, deadline=None)
@given(profiles(max_tensors=6, max_numel=200, allow_empty=True, dtypes=("float32",)))
def test_deft_is_never_worse_than_delaying_nothing_in_its_model(p):
    plan = deft.deft(p, block_sizes=[64, 512])
    validate(plan, numels=p.numels, dtypes=p.dtypes)
    nothing = min(deft.iteration_time(deft.with_delayed(dcredit(p, block_bytes=s), p, []), p) for s in (64, 512))
    assert deft.iteration_time(plan, p) <= nothing * (1 + 1e-9)
    assert deft.iteration_time(plan, p) >= lower_bound(p) - 1e-9
    assert all(p.tensors[t].numel for t in plan.delayed)


@pytest.mark.parametrize(("change", "message"), [
    ({"delayed": (0, 0)}, "plan 'delayed' must name distinct tensors"),
    ({"delayed": (5,)}, "plan 'delayed' must name distinct tensors of 0..2"),
    ({"delayed": (0, 1)}, r"plan 'partition'\[1\] cuts tensor 1 into blocks, but it is 'delayed'"),
    ({"delayed": (0,), "decoupled": (0,)}, r"plan 'decoupled' names delayed tensor\(s\) \[0\]"),
])
def test_bad_delayed_is_named(change, message):
    plan = Plan(numels=(4, 4, 4), order=(2, 1, 0), partition=((), (4,), (4,)), delayed=(0,))
    validate(plan)
    with pytest.raises(PlanError, match=message):
        validate(dataclasses.replace(plan, **change))
    assert Plan.from_json(plan.to_json()) == plan
