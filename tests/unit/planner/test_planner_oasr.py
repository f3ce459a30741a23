"""OASR-WFBP: the overlap-aware merges against exhaustive search, the simulator, and MG-WFBP."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings

from dcredit_opt.planner import policies
from dcredit_opt.planner.oasr import overlap_aware_merges
from dcredit_opt.planner.plan import ALL, Plan
from dcredit_opt.planner.profile import Profile, TensorProfile
from dcredit_opt.planner.simulate import event_times, simulate

from .strategies import profiles

# The four tensors of test_planner_policies.P4: ready at 0.4 (t3, 2048 B), 0.7 (t2, 256 B),
# 0.9 (t1, 4096 B), 1.0 (t0, 1024 B); alpha 0.15 s, beta 1e-4 s/B.
P4 = Profile(
    tensors=tuple(TensorProfile(f"t{i}", n, "float32", i, 0.1, b)
                  for i, (n, b) in enumerate(zip((256, 1024, 64, 512), (0.1, 0.2, 0.3, 0.4)))),
    alpha_s=0.15, beta_s_per_byte=1e-4, world_size=2)


def comm_end(profile: Profile, groups: list[list[int]]) -> float:
    """The model's end of communication for ``groups`` (runs in ready order), sent one after another."""
    alpha, beta = profile.alpha_s, profile.beta_s_per_byte
    position = {t: i for i, t in enumerate(profile.order())}
    events = event_times(profile)
    free = 0.0  # no collective: communication ends before backward starts
    for group in groups:
        free = max(events[position[group[-1]]], free) + alpha + beta * sum(profile.tensors[t].nbytes
                                                                              for t in group)
    return free


def test_oasr_by_hand_differs_from_mgwfbp():
    # Both send t3 alone (0.4 -> 0.7548). MG-WFBP then merges t2 with t1 (ready at 0.9 <
    # 0.7548 + alpha) and with t0: 5376 B from 1.0, ending at 1.0 + 0.15 + 0.5376 = 1.6876.
    # OASR sends t2 alone (0.7548 -> 0.9304: the link was free anyway), then t1 + t0 (5120 B)
    # from 1.0, ending at 1.662.
    assert policies.startup_sharing_merges(P4) == [[3], [2, 1, 0]]
    assert overlap_aware_merges(P4) == [[3], [2], [1, 0]]
    assert comm_end(P4, [[3], [2], [1, 0]]) == pytest.approx(1.662)
    assert comm_end(P4, [[3], [2, 1, 0]]) == pytest.approx(1.6876)
    assert policies.oasr(P4) == Plan(numels=P4.numels, order=(3, 2, 1, 0), partition=((256,), (1024,), (64,), (512,)),
                                     merges=((1, 0),), phase1_windows=(ALL,) * 4, phase2_windows=(4,),
                                     overlap_forward=False, policy="oasr")
    # The simulator runs the model exactly: backward 1.0, comm to 1.662, forward 0.4.
    assert simulate(policies.oasr(P4), P4).iteration_s == pytest.approx(1.662 + 0.4)


def groupings(profile: Profile):
    """Every split of the ready order into runs that a merge allows (one dtype, no empty tensor)."""
    order = list(profile.order())
    n = len(order)
    for cuts in itertools.product([False, True], repeat=max(0, n - 1)):
        groups, run = [], []
        ok = True
        for j, t in enumerate(order):
            run.append(t)
            if j == n - 1 or cuts[j]:
                groups.append(run)
                run = []
        for g in groups:
            if len(g) > 1 and (any(profile.tensors[t].numel == 0 for t in g)
                               or len({profile.tensors[t].dtype for t in g}) > 1):
                ok = False
        if ok:
            yield [[t for t in g if profile.tensors[t].numel] for g in groups if any(profile.tensors[t].numel
                                                                                    for t in g)]


@settings(max_examples=150, deadline=None)
@given(profiles(max_tensors=7, max_numel=60))
def test_merges_are_optimal_over_every_grouping(p):
    ours = overlap_aware_merges(p)
    assert sorted(t for g in ours for t in g) == [t for t in range(p.num_tensors) if p.tensors[t].numel]
    best = min((comm_end(p, g) for g in groupings(p)), default=-float("inf"))
    assert comm_end(p, ours) <= best + 1e-9 * max(1.0, abs(best))


@settings(max_examples=100, deadline=None)
@given(profiles(max_tensors=8, max_numel=300))
def test_oasr_never_slower_than_wfbp_mgwfbp_ddp_in_the_simulator(p):
    plan = policies.oasr(p)
    ours = simulate(plan, p).iteration_s
    backward_end = max(simulate(plan, p).ready_s, default=0.0)
    forward = sum(t.fwd_s for t in p.tensors)
    # The simulator executes the model: iteration = max(backward, communication) + forward.
    assert ours == pytest.approx(max(backward_end, comm_end(p, overlap_aware_merges(p))) + forward, abs=1e-9)
    for name in ("wfbp", "mgwfbp", "ddp"):
        other = simulate(policies.POLICIES[name](p), p).iteration_s
        assert ours <= other + 1e-9 * max(1.0, other), name

