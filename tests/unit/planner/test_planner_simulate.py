"""The simulator: hand-computed timelines, and the runtime's invariants on arbitrary plans."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcredit_opt.planner.floors import lower_bound, synchronous_floor
from dcredit_opt.planner.plan import ALL, ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, Plan, PlanError
from dcredit_opt.planner.profile import Profile, TensorProfile
from dcredit_opt.planner.simulate import FlushSnapshot, simulate

from .strategies import plans_for, profile_and_plan, profiles

EPS = 1e-9


def profile_of(numels, fwd=1.0, bwd=1.0, alpha=0.5, beta=0.001, ready_order=None, dtype="float32") -> Profile:
    tensors = tuple(TensorProfile(f"t{i}", n, dtype, i, fwd, bwd) for i, n in enumerate(numels))
    return Profile(tensors, alpha, beta, 2, ready_order)


def plan_of(profile: Profile, partition, **fields) -> Plan:
    return Plan(numels=profile.numels, order=profile.order(), partition=tuple(partition), **fields)


def ends(result):
    return [b.end_s for b in result.blocks]


# -- hand-computed timelines ----------------------------------------------------

def test_window_groups_and_forward_waits_by_hand():
    # Ready at 1 (t2), 2 (t1), 3 (t0); ALL releases t2's two blocks as a group
    # of window 2; t1's and t0's blocks each form a group of window 1, which
    # waits until nothing is in flight. alpha 0.5, 1000 bytes = 1 s.
    p = profile_of([250, 250, 500])
    plan = plan_of(p, [(250,), (250,), (250, 250)], phase1_windows=(ALL,) * 3, phase2_windows=(4,))
    r = simulate(plan, p)
    assert r.event_s == (1.0, 2.0, 3.0)
    assert [b.window for b in r.blocks] == [2, 2, 1, 1]
    assert [b.launch_s for b in r.blocks] == pytest.approx([1.0, 1.0, 3.5, 5.0])
    assert ends(r) == pytest.approx([3.5, 3.5, 5.0, 6.5])  # two 1000-byte blocks sharing the link
    assert r.forward_start_s == pytest.approx((6.5, 7.5, 8.5))
    assert r.iteration_s == pytest.approx(9.5)
    assert [b.event for b in r.blocks] == [0, 0, 1, 2]


def test_host_cost_adds_per_collective_to_the_iteration():
    """Profile.host_s_per_collective: host time per collective, whatever the link; a
    decoupled block is two collectives. The link's timeline is untouched."""
    p = profile_of([250, 250, 500])
    plan = plan_of(p, [(250,), (250,), (250, 250)], phase1_windows=(ALL,) * 3, phase2_windows=(4,))
    charged = dataclasses.replace(p, host_s_per_collective=0.25)
    r, rc = simulate(plan, p), simulate(plan, charged)
    assert rc.iteration_s == pytest.approx(r.iteration_s + 4 * 0.25)
    assert (rc.blocks, rc.forward_end_s) == (r.blocks, r.forward_end_s)
    assert FlushSnapshot(plan, charged).iteration_s((4,)) == rc.iteration_s
    decoupled = dataclasses.replace(plan, decoupled=(0,))  # t0: one block, now a reduce-scatter and an all-gather
    assert simulate(decoupled, charged).iteration_s == pytest.approx(simulate(decoupled, p).iteration_s + 5 * 0.25)


def test_processor_sharing_of_unequal_blocks():
    # 1000 and 3000 bytes launched together: both transfer at half rate until
    # the small one is done (1 + 2*1000*0.001 = 3), then the big one alone;
    # the last ends at alpha + beta * total = 5.
    p = profile_of([1000], alpha=1.0, beta=0.001, dtype="uint8")
    p = dataclasses.replace(p, tensors=(dataclasses.replace(p.tensors[0], numel=4000),))
    plan = plan_of(p, [(1000, 3000)], phase1_windows=(0,), phase2_windows=(2,))
    assert ends(simulate(plan, p)) == pytest.approx([1.0 + 2.0 + 1.0, 5.0 + 1.0])


def test_credit_bytes_and_oversized_block():
    # uint8: bytes = elements. Credit 1500: 1000 + 400 fit together, the next
    # 400 waits for credit, and the 2000-byte block goes only alone.
    p = profile_of([1000, 400, 400, 2000], bwd=0.0, alpha=0.0, beta=0.001, dtype="uint8")
    plan = Plan(numels=p.numels, order=(0, 1, 2, 3), partition=((1000,), (400,), (400,), (2000,)),
                phase1_windows=(0, 0, 0, 0), phase2_windows=(8,), credit_bytes=1500, overlap_forward=False)
    r = simulate(plan, p)
    launch = [b.launch_s for b in r.blocks]
    end = ends(r)
    assert launch[0] == launch[1] == 0.0
    assert launch[2] == pytest.approx(end[1])  # after the 400 returns its credit
    assert launch[3] == pytest.approx(max(end[:3]))  # alone
    assert end[3] == pytest.approx(launch[3] + 2.0)


def test_events_wait_for_earlier_ones_in_order():
    # The plan expects 2 then 1 then 0 but gradients come 0, 1, 2 (1 s each):
    # every event is processed at 3 s, when tensor 2 finally arrives.
    p = profile_of([10, 10, 10], ready_order=(0, 1, 2))
    plan = plan_of(dataclasses.replace(p, ready_order=None), [(10,)] * 3, phase1_windows=(1, 1, 1))
    r = simulate(plan, p)
    assert r.ready_s == (1.0, 2.0, 3.0)
    assert r.event_s == (3.0, 3.0, 3.0)
    assert all(b.release_s == 3.0 for b in r.blocks)


def test_merged_block_enters_at_its_last_tensor():
    p = profile_of([10, 20, 30])  # ready 1 (t2), 2 (t1), 3 (t0)
    plan = plan_of(p, [(10,), (20,), (30,)], merges=((2, 1),), phase1_windows=(ALL,) * 3)
    r = simulate(plan, p)
    merged = r.blocks[0]
    assert merged.tensors == (2, 1)
    assert merged.numel == 50
    assert merged.release_s == 2.0


def test_no_overlap_waits_for_everything():
    p = profile_of([500, 500], fwd=0.25)
    plan = plan_of(p, [(500,), (500,)], phase1_windows=(ALL, ALL), overlap_forward=False)
    r = simulate(plan, p, update_s=0.1)
    assert r.iteration_s == pytest.approx(max(r.backward_end_s, r.comm_end_s) + 0.1 + 0.5)
    assert r.forward_start_s[0] == pytest.approx(r.comm_end_s + 0.1)


def test_update_time_is_shared_by_bytes_before_each_forward():
    p = profile_of([100, 300], fwd=0.0, alpha=0.0, beta=0.0)
    plan = plan_of(p, [(100,), (300,)])
    r = simulate(plan, p, update_s=0.4)
    assert r.forward_start_s == pytest.approx((2.0 + 0.1, 2.0 + 0.4))
    assert r.iteration_s == pytest.approx(2.4)


def test_channel_fifo_serialises_one_channel():
    p = profile_of([500, 500], bwd=0.0, alpha=0.5, beta=0.001)
    plan = plan_of(p, [(500,), (500,)], phase1_windows=(0, 0), phase2_windows=(2,))
    assert ends(simulate(plan, p)) == pytest.approx([0.5 + 4.0, 0.5 + 4.0])  # 4000 bytes share the link
    fifo = simulate(plan, p, channel_fifo=True)
    # One after the other, each alpha + 2 s; block 1 (tensor 0) has priority.
    assert ends(fifo) == pytest.approx([5.0, 2.5])
    two = simulate(dataclasses.replace(plan, channels=2), p, channel_fifo=True)
    assert [b.channel for b in two.blocks] == [1, 0]  # launch 0 (block 1) on channel 0
    assert ends(two) == pytest.approx([4.5, 4.5])


def test_zero_alpha_beta_and_empty_tensors():
    p = profile_of([0, 10, 0], alpha=0.0, beta=0.0)
    plan = plan_of(p, [(), (5, 5), ()])
    r = simulate(plan, p)
    assert [b.end_s for b in r.blocks] == [r.event_s[1]] * 2
    assert r.iteration_s == pytest.approx(6.0)


def test_plan_must_match_profile():
    p = profile_of([10, 10])
    plan = Plan(numels=(10, 11), order=(1, 0), partition=((10,), (11,)))
    with pytest.raises(PlanError, match="numels"):
        simulate(plan, p)
    with pytest.raises(ValueError, match="update_s"):
        simulate(plan_of(p, [(10,), (10,)]), p, update_s=-1.0)


def test_flush_snapshot_matches_full_simulation():
    p = profile_of([300, 200, 700], fwd=0.5, alpha=0.2, beta=0.002)
    plan = plan_of(p, [(100, 200), (200,), (300, 300, 100)], phase1_windows=(1, 2, 0))
    snap = FlushSnapshot(plan, p)
    for windows in [(1,), (2, 1), (1, 1, 3), (5,)]:
        full = simulate(dataclasses.replace(plan, phase2_windows=windows), p, update_s=0.3)
        assert snap.iteration_s(windows, update_s=0.3) == full.iteration_s
        assert snap.result(windows, update_s=0.3) == full
    # At the flush (3 s): block 0 (t2, launched at 1 s, 2.6 s long) and block 3 (t1, at 2 s) are
    # in flight, and block 1 (released with block 3 in a group of window 2) still waits.
    assert snap.pending == 3
    with pytest.raises(PlanError, match="phase2_windows"):
        snap.iteration_s((2, 0))


def test_decoupled_blocks_by_hand():
    # Note [Two-stage blocks in the simulator]. Two tensors of 2000 bytes, ready at 1 (t1) and 2 (t0); each
    # stage costs half of 0.5 + 2 s. Blocks: 0 = RS(t1), 1 = AG(t1), 2 = RS(t0), 3 = AG(t0).
    # RS(t1) runs 1 -> 2.25; RS(t0), released at 2 with window 1, waits for it: 2.25 -> 3.5. The flush (2 s)
    # releases the all-gathers in priority order, one per group: AG(t0) waits for RS(t0), 3.5 -> 4.75, then
    # AG(t1) 4.75 -> 6; t0's forward runs 4.75 -> 5.75 beside AG(t1), t1's 6 -> 7.
    p = profile_of([500, 500])
    plan = plan_of(p, [(500,), (500,)], phase1_windows=(ALL, ALL), phase2_windows=(1,), decoupled=(0, 1))
    r = simulate(plan, p)
    assert [b.op for b in r.blocks] == [REDUCE_SCATTER, ALL_GATHER, REDUCE_SCATTER, ALL_GATHER]
    assert r.launch_sequence == (0, 2, 3, 1)
    assert ends(r) == pytest.approx([2.25, 6.0, 3.5, 4.75])
    assert [b.event for b in r.blocks] == [0, 2, 1, 2]
    assert r.forward_start_s == pytest.approx((4.75, 6.0))
    assert r.iteration_s == pytest.approx(7.0)
    # The same plan with all-reduces: 1 -> 3.5, 3.5 -> 6; both forwards wait: 8 s.
    whole = simulate(dataclasses.replace(plan, decoupled=()), p)
    assert ends(whole) == pytest.approx([3.5, 6.0])
    assert whole.iteration_s == pytest.approx(8.0)
    # A window of two at the flush launches both all-gathers as soon as their reduce-scatters are done: AG(t0)
    # at 3.5 and AG(t1) right behind it (it waits for AG(t0)'s launch, the head of the sequence), sharing the link.
    both = simulate(dataclasses.replace(plan, phase2_windows=(2,)), p)
    assert [both.blocks[b].launch_s for b in (3, 1)] == pytest.approx([3.5, 3.5])
    assert [both.blocks[b].end_s for b in (3, 1)] == pytest.approx([5.75, 5.75])  # 3.5 + 0.25 + 2000 B * 0.001
    # Measured stage costs (Profile.stage_ratios): a reduce-scatter as dear as an all-reduce, an all-gather
    # at 0.4 of its start-up and 0.7 of its transfer. RS(t1) 1 -> 3.5, RS(t0) 3.5 -> 6, AG(t0) 6 -> 6.2 + 1.4
    # = 7.6, AG(t1) 7.6 -> 9.2; forwards 7.6 -> 8.6 and 9.2 -> 10.2.
    gloo_like = dataclasses.replace(p, stage_ratios=(1.0, 1.0, 0.4, 0.7))
    assert gloo_like.stage_cost(ALL_GATHER) == pytest.approx((0.2, 0.0007))
    slow = simulate(plan, gloo_like)
    assert ends(slow) == pytest.approx([3.5, 9.2, 6.0, 7.6])
    assert slow.iteration_s == pytest.approx(10.2)


# -- invariants on arbitrary plans ---------------------------------------------

def entry_event(plan: Plan, tensors: tuple[int, ...]) -> int:
    return max(plan.order.index(t) for t in tensors)


def cost(profile: Profile, b) -> float:
    """The least time a block's collective takes: its own start-up and transfer (``Profile.stage_cost``)."""
    alpha, beta = profile.stage_cost(b.op)
    return alpha + beta * b.nbytes


def check_invariants(plan: Plan, profile: Profile, r) -> None:
    blocks = r.blocks
    B = len(blocks)
    T = plan.num_tensors
    # Each block launched exactly once, in a sequence that is a permutation.
    assert sorted(r.launch_sequence) == list(range(B))
    for n, b in enumerate(r.launch_sequence):
        assert blocks[b].launch_index == n
        assert blocks[b].channel == n % plan.channels
    for b in blocks:
        assert b.release_s <= b.launch_s + EPS
        # No collective beats alpha + beta * its bytes (half of it for a stage of a decoupled block).
        assert b.end_s >= b.launch_s + cost(profile, b) - 1e-7
        # Released exactly when its event was processed (the flush: at the last event's time).
        assert b.release_s == r.event_s[min(b.event, plan.num_tensors - 1)]
    # Launch order is release order: groups in order, a group by (priority, id).
    released = sorted(blocks, key=lambda b: (b.group, b.priority, b.block_id))
    assert [b.block_id for b in released] == list(r.launch_sequence)
    # Two-stage blocks: each decoupled block is a reduce-scatter, then its all-gather, released at the flush
    # and launched only once the reduce-scatter is done.
    split = set(plan.decoupled)
    ops = [b.op for b in blocks]
    assert all((op == ALL_REDUCE) == (b.tensors[0] not in split) for op, b in zip(ops, blocks))
    for b in blocks:
        if b.op == ALL_GATHER:
            first = blocks[b.block_id - 1]
            assert first.op == REDUCE_SCATTER and first.tensors == b.tensors and first.numel == b.numel
            assert b.event == T and b.launch_s >= first.end_s - EPS
    # Priority at each release: a block left in the heap never beats one released (an all-gather enters the
    # heap at the flush).
    for x in blocks:
        for y in blocks:
            entry = T if y.op == ALL_GATHER else entry_event(plan, y.tensors)
            if y.group > x.group and entry <= x.event:
                assert (y.priority, y.block_id) > (x.priority, x.block_id)
    # The window and the credit hold at every launch.
    for b in blocks:
        others = [c for c in blocks if c.launch_index < b.launch_index and c.end_s > b.launch_s]
        assert len(others) < b.window
        if plan.credit_bytes and others:
            assert sum(c.nbytes for c in others) + b.nbytes <= plan.credit_bytes
    # Forward waits for each tensor's blocks (or for everything when not overlapping).
    done = {t: max((b.end_s for b in blocks if t in b.tensors), default=-math.inf) for t in range(plan.num_tensors)}
    for t in range(plan.num_tensors):
        if plan.overlap_forward:
            assert r.forward_start_s[t] >= done[t] - EPS
        else:
            assert r.forward_start_s[t] >= r.comm_end_s - EPS
        assert r.forward_start_s[t] >= (r.forward_end_s[t - 1] if t else r.backward_end_s) - EPS
    assert r.iteration_s >= lower_bound(profile) - 1e-9


@settings(max_examples=200, deadline=None)
@given(profile_and_plan(), st.booleans())
def test_runtime_invariants_hold_for_any_plan(pp, fifo):
    profile, plan = pp
    check_invariants(plan, profile, simulate(plan, profile, channel_fifo=fifo))


@settings(max_examples=100, deadline=None)
@given(profile_and_plan())
def test_channel_fifo_runs_one_collective_at_a_time_per_channel(pp):
    profile, plan = pp
    r = simulate(plan, profile, channel_fifo=True)
    for c in range(plan.channels):
        on_c = sorted((b for b in r.blocks if b.channel == c), key=lambda b: b.launch_index)
        for prev, b in itertools.pairwise(on_c):
            assert b.end_s >= prev.end_s + cost(profile, b) - 1e-7


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_same_order_on_every_rank(data):
    # Two ranks: same model, different timings. Note [Same order on every rank]:
    # the launch sequence, channels, groups and windows are a function of the plan.
    p1 = data.draw(profiles())
    plan = data.draw(plans_for(p1))
    tensors = tuple(dataclasses.replace(t, fwd_s=data.draw(st.floats(0, 3)), bwd_s=data.draw(st.floats(0, 3)))
                    for t in p1.tensors)
    order = data.draw(st.permutations(range(p1.num_tensors)))
    p2 = Profile(tensors, data.draw(st.floats(0, 1)), data.draw(st.floats(0, 0.1)), 2, tuple(order))
    r1, r2 = simulate(plan, p1), simulate(plan, p2)
    assert r1.launch_sequence == r2.launch_sequence
    for a, b in zip(r1.blocks, r2.blocks):
        assert (a.channel, a.group, a.window, a.event) == (b.channel, b.group, b.window, b.event)


@settings(max_examples=200, deadline=None)
@given(profiles())
def test_lower_bound_is_tight_for_compute_or_communication(p):
    lb = lower_bound(p)
    compute = sum(t.fwd_s + t.bwd_s for t in p.tensors)
    ra, rb, _, gb = p.stage_ratios
    comm = (min(1.0, ra) * p.alpha_s + min(1.0, rb + gb) * p.beta_s_per_byte * p.total_bytes
            if p.total_bytes else 0.0)
    assert lb == pytest.approx(max(compute, comm), rel=1e-12)


def test_synchronous_floor_by_hand():
    # Three tensors of 1000 float32 (4000 B), forward 1 s and backward 1 s each: compute 6 s. The link: 12000 B
    # at 0.001 s/B after the first start-up, a reduce-scatter's (half of alpha 0.5 by the ring formula, since
    # every byte may go as a reduce-scatter and an all-gather at the all-reduce's total per-byte time):
    # 0.25 + 12 = 12.25 s. Input side: 6 + (0.25 + 4) = 10.25 s (the last tensor's link floor). Output side:
    # 12.25 + fwd(last) 1 + bwd(first ready) 1 = 14.25 s.
    p = profile_of([1000, 1000, 1000])
    assert lower_bound(p) == pytest.approx(12.25)
    assert synchronous_floor(p) == pytest.approx(14.25)
    # Where stages cost more than halves (Gloo's), only all-reduces reach the floor: 0.5 + 12, then + 2.
    gloo_like = dataclasses.replace(p, stage_ratios=(1.1, 1.1, 0.7, 0.7))
    assert lower_bound(gloo_like) == pytest.approx(12.5)
    assert synchronous_floor(gloo_like) == pytest.approx(14.5)
    # Compute-bound: 0.1 s per pass, tiny link cost: the input side's reduction after backward decides, at
    # its link floor (a reduce-scatter's start-up, half of alpha, then every byte).
    q = profile_of([1000, 10, 10], fwd=0.1, bwd=0.1, alpha=0.01, beta=1e-5)
    assert synchronous_floor(q) == pytest.approx(0.6 + 0.005 + 1e-5 * 4000)
    assert synchronous_floor(profile_of([])) == lower_bound(profile_of([]))
    # A small last layer ready first, a large one behind it (VGG's classifier): the link has 40 B to carry
    # until the middle tensor's gradient, ready at 2 s; from there 8000 B: 2 + 0.25 + 8 = 10.25 s, then the
    # last layer's forward: 11.25 s. (From the first gradient: 1 + 0.25 + 8.04 = 9.29 s; input side: 3 + 4.25
    # + 3 = 10.25 s.)
    vgg_like = profile_of([1000, 1000, 10])
    assert synchronous_floor(vgg_like) == pytest.approx(11.25)


@settings(max_examples=100, deadline=None)
@given(profile_and_plan(), st.booleans())
def test_no_plan_beats_the_synchronous_floor(pp, fifo):
    profile, plan = pp
    r = simulate(plan, profile, channel_fifo=fifo)
    assert r.iteration_s >= synchronous_floor(profile) - 1e-9
    assert synchronous_floor(profile) >= lower_bound(profile)


def test_the_flush_waits_for_the_backward_even_when_the_last_events_release_nothing():
    """Hypothesis found it: empty tensors last in the order are skipped, and the flush came at the time of
    the last event that released something, not when the backward ends (as step() does in the runtime)."""

    profile = Profile(tensors=(TensorProfile(name="t0", numel=0, dtype="float32", forward_index=0, fwd_s=0.0, bwd_s=1.0),
                               TensorProfile(name="t1", numel=1, dtype="float32", forward_index=1, fwd_s=0.0, bwd_s=0.0),
                               TensorProfile(name="t2", numel=0, dtype="float32", forward_index=2, fwd_s=0.0, bwd_s=0.0)),
                      alpha_s=0.0, beta_s_per_byte=0.0, world_size=2, ready_order=None)
    plan = Plan(numels=(0, 1, 0), order=(2, 1, 0), partition=((), (1,), ()), phase1_windows=(-1, 0, 0),
                phase2_windows=(1,), channels=1, overlap_forward=False, policy="custom")
    for fifo in (False, True):
        r = simulate(plan, profile, channel_fifo=fifo)
        check_invariants(plan, profile, r)
        assert r.blocks[0].release_s == 1.0
