"""Where gradients live: ``split_evenly``, ``fixed_plan``, ``build_layout``, and
``plan.validate`` naming every bad field. Pure functions, no extension."""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcredit_opt.optimizer.layout import build_layout, fixed_plan
from dcredit_opt.planner.plan import (
    ALL,
    Plan,
    PlanError,
    blocks_of,
    split_evenly,
    validate,
)

ITEMSIZE = {"torch.float32": 4, "torch.float16": 2, "torch.bfloat16": 2, "torch.float64": 8}


def layout_of(plan: Plan, dtypes):
    return build_layout(plan, list(dtypes), [ITEMSIZE[d] for d in dtypes])


def check_layout(plan: Plan, dtypes, layout) -> None:
    """The invariants every layout must have, whatever the plan."""
    T = plan.num_tensors
    # One segment per dtype, in first use along the ready order.
    first_use = list(dict.fromkeys(dtypes[t] for t in plan.order))
    assert list(layout.segment_keys) == first_use
    # Tensors tile their segment in ready order (so neighbours in `order`
    # with one dtype, the only ones a merge may join, are contiguous).
    for s, key in enumerate(layout.segment_keys):
        members = [t for t in plan.order if dtypes[t] == key]
        assert all(layout.tensor_segment[t] == s for t in members)
        ends = list(itertools.accumulate((plan.numels[t] for t in members), initial=0))
        assert [layout.tensor_offset[t] for t in members] == ends[:-1]
        assert layout.segment_numels[s] == ends[-1]
    # Blocks, in id order, are blocks_of(plan): each inside its own
    # segment, covering exactly its tensors' elements, together tiling every
    # segment once.
    expected = blocks_of(plan)
    assert layout.num_blocks == len(expected)
    covered = [[0] * n for n in layout.segment_numels]
    for b, (tensors, first, numel, priority) in enumerate(expected):
        seg, off = layout.block_segment[b], layout.block_offset[b]
        assert layout.block_tensors[b] == tuple(tensors)
        assert {layout.tensor_segment[t] for t in tensors} == {seg}, f"block {b} crosses segments"
        assert 0 <= off and off + layout.block_numel[b] <= layout.segment_numels[seg]
        assert (off, layout.block_numel[b]) == (layout.tensor_offset[tensors[0]] + first, numel)
        start = layout.tensor_offset[tensors[0]]
        stop = layout.tensor_offset[tensors[-1]] + plan.numels[tensors[-1]]
        assert start <= off and off + numel <= stop, f"block {b} leaves its tensors"
        assert layout.block_bytes[b] == numel * ITEMSIZE[dtypes[tensors[0]]]
        assert layout.block_priority[b] == priority
        for i in range(off, off + numel):
            covered[seg][i] += 1
    assert all(c == 1 for seg in covered for c in seg), "blocks overlap or leave gaps"
    assert sum(layout.block_numel) == sum(plan.numels[t] for t in range(T))


# ---- split_evenly ---------------------------------------------------------


@pytest.mark.parametrize(("numel", "block", "expected"), [
    (1, 4, (1,)),                   # one element
    (3, 10, (3,)),                  # smaller than a block
    (12, 4, (4, 4, 4)),             # exactly k blocks
    (7, 7, (7,)),                   # exactly one block
    (97, 10, (10,) * 9 + (7,)),     # a prime
    (0, 4, ()),                     # an empty tensor has no block
    (1, 1, (1,)),
])
@pytest.mark.timeout(60)
def test_split_evenly_awkward_sizes(numel, block, expected):
    assert split_evenly(numel, block) == expected


@pytest.mark.timeout(60)
@settings(deadline=None)
@given(numel=st.integers(0, 10_000), block=st.integers(1, 300))
def test_split_evenly_tiles_the_tensor(numel, block):
    parts = split_evenly(numel, block)
    assert sum(parts) == numel and all(p > 0 for p in parts)
    assert all(p == block for p in parts[:-1]) and len(parts) == -(-numel // block)


@pytest.mark.parametrize("block", [0, -4])
@pytest.mark.timeout(60)
def test_split_evenly_rejects_a_bad_block_size(block):
    with pytest.raises(PlanError, match="block size"):
        split_evenly(10, block)


# ---- fixed_plan ---------------------------------------------------------------


@pytest.mark.timeout(60)
def test_fixed_plan_awkward_sizes():
    # 64-byte blocks of float32: 16 elements.
    numels = [1, 97, 3, 64, 0]  # one element, a prime, under a block, exactly 4 blocks, empty
    plan = fixed_plan(numels, [4] * 5, block_bytes=64, window=2, channels=3, credit_bytes=128)
    validate(plan, numels=numels, max_channels=3)
    assert plan.partition == ((1,), (16,) * 6 + (1,), (3,), (16,) * 4, ())
    assert plan.order == (4, 3, 2, 1, 0)  # backward: reverse forward order
    assert plan.phase1_windows == (2,) * 5 and plan.phase2_windows == (2,)
    assert (plan.credit_bytes, plan.channels, plan.merges) == (128, 3, ())
    layout = layout_of(plan, ["torch.float32"] * 5)
    check_layout(plan, ["torch.float32"] * 5, layout)
    assert layout.num_blocks == 1 + 7 + 1 + 4
    assert max(layout.block_bytes) == 64


@pytest.mark.timeout(60)
def test_fixed_plan_itemsize_above_block_bytes_gives_one_element_blocks():
    plan = fixed_plan([3], [8], block_bytes=4, window=1, channels=1)
    assert plan.partition == ((1, 1, 1),)


@pytest.mark.timeout(60)
def test_fixed_plan_window_all_never_limits_phase_2():
    plan = fixed_plan([10, 10], [4, 4], block_bytes=8, window=ALL, channels=1)
    assert plan.phase1_windows == (ALL, ALL)
    assert plan.phase2_windows[0] >= sum(len(p) for p in plan.partition)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"block_bytes": 0}, "block_bytes"),
    ({"block_bytes": -1}, "block_bytes"),
    ({"window": 0}, "window"),
    ({"window": -2}, "window"),
])
@pytest.mark.timeout(60)
def test_fixed_plan_rejects_bad_arguments(kwargs, field):
    args = {"numels": [4], "itemsizes": [4], "block_bytes": 8, "window": 1, "channels": 1, **kwargs}
    with pytest.raises(PlanError, match=field):
        fixed_plan(**args)


# ---- build_layout ---------------------------------------------------------


@pytest.mark.timeout(60)
def test_zero_size_tensors_take_no_room_and_have_no_block():
    numels = (0, 5, 0, 0, 2)
    plan = Plan(numels=numels, order=(4, 3, 2, 1, 0), partition=tuple(split_evenly(n, 2) for n in numels))
    dtypes = ["torch.float32"] * 5
    layout = layout_of(plan, dtypes)
    check_layout(plan, dtypes, layout)
    assert layout.num_blocks == 3 + 1
    assert all(0 not in ts and 2 not in ts and 3 not in ts for ts in layout.block_tensors)


@pytest.mark.timeout(60)
def test_all_tensors_empty():
    plan = Plan(numels=(0, 0), order=(1, 0), partition=((), ()))
    layout = layout_of(plan, ["torch.float16", "torch.float16"])
    assert layout.num_blocks == 0 and layout.segment_numels == (0,)


@pytest.mark.timeout(60)
def test_mixed_dtypes_give_one_segment_each_and_blocks_stay_inside():
    numels = (5, 3, 7, 1, 4)
    dtypes = ["torch.float32", "torch.float16", "torch.float32", "torch.float64", "torch.float16"]
    plan = Plan(numels=numels, order=(4, 3, 2, 1, 0), partition=tuple(split_evenly(n, 3) for n in numels))
    layout = layout_of(plan, dtypes)
    check_layout(plan, dtypes, layout)
    assert layout.segment_keys == ("torch.float16", "torch.float64", "torch.float32")
    assert layout.segment_numels == (7, 1, 12)


@pytest.mark.timeout(60)
def test_merge_is_one_contiguous_block():
    numels = (3, 4, 5, 6)
    plan = Plan(numels=numels, order=(3, 2, 1, 0), partition=((3,), (4,), (5,), (2, 2, 2)),
                merges=((2, 1, 0),), priority=(3, 0, 2, 1))
    dtypes = ["torch.float32"] * 4
    validate(plan, numels=numels, dtypes=dtypes)
    layout = layout_of(plan, dtypes)
    check_layout(plan, dtypes, layout)
    assert layout.block_tensors == ((3,), (3,), (3,), (2, 1, 0))
    assert (layout.block_offset[3], layout.block_numel[3]) == (6, 12)
    assert layout.block_priority[3] == 0  # the merge takes its best tensor's priority


@pytest.mark.timeout(60)
def test_merge_across_dtypes_is_rejected():
    plan = Plan(numels=(2, 2), order=(0, 1), partition=((2,), (2,)), merges=((0, 1),))
    dtypes = ["torch.float32", "torch.float16"]
    with pytest.raises(PlanError, match="'merges'.*mixes dtypes"):
        validate(plan, dtypes=dtypes)
    with pytest.raises(PlanError, match="'merges'.*mixes dtypes"):
        layout_of(plan, dtypes)


@pytest.mark.timeout(60)
def test_build_layout_wants_one_dtype_per_tensor():
    plan = Plan(numels=(2, 2), order=(0, 1), partition=((2,), (2,)))
    with pytest.raises(PlanError, match="2 tensors but 1 dtypes"):
        build_layout(plan, ["torch.float32"], [4])


@st.composite
def plans_and_dtypes(draw):
    """Valid plans over awkward sizes (0, 1, primes, ...) and mixed dtypes,
    with merges of one-block neighbours of one dtype."""
    T = draw(st.integers(1, 8))
    numels = tuple(draw(st.lists(st.sampled_from([0, 1, 2, 3, 7, 13, 16, 31, 64, 97]), min_size=T, max_size=T)))
    dtypes = draw(st.lists(st.sampled_from(sorted(ITEMSIZE)), min_size=T, max_size=T))
    order = tuple(draw(st.permutations(range(T))))
    partition = []
    for n in numels:
        cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=4))) if n > 1 else []
        partition.append(tuple(b - a for a, b in zip([0, *cuts], [*cuts, n])) if n else ())
    merges, run = [], []
    for t in order:
        joinable = len(partition[t]) == 1 and (not run or dtypes[run[-1]] == dtypes[t])
        if joinable and draw(st.booleans()):
            run.append(t)
            continue
        if len(run) >= 2:
            merges.append(tuple(run))
        run = [t] if len(partition[t]) == 1 else []
    if len(run) >= 2:
        merges.append(tuple(run))
    priority = tuple(draw(st.lists(st.integers(0, 5), min_size=T, max_size=T)))
    plan = Plan(numels=numels, order=order, partition=tuple(partition), merges=tuple(merges), priority=priority)
    validate(plan, numels=numels, dtypes=dtypes)
    return plan, dtypes


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(case=plans_and_dtypes())
def test_layout_invariants_hold_for_any_plan(case):
    plan, dtypes = case
    check_layout(plan, dtypes, layout_of(plan, dtypes))


# ---- validate names the bad field -------------------------------------------------

GOOD = Plan(numels=(4, 2, 3), order=(2, 1, 0), partition=((2, 2), (2,), (3,)), merges=((2, 1),),
            priority=(0, 1, 2), phase1_windows=(ALL, 0, 2), phase2_windows=(1, 2), credit_bytes=16, channels=2)


@pytest.mark.parametrize(("field", "change", "context"), [
    ("numels", {}, {"numels": [4, 2]}),
    ("numels", {}, {"numels": [4, 2, 5]}),
    ("numels", {"numels": (4, -2, 3), "partition": ((2, 2), (), (3,)), "merges": ()}, {}),
    ("order", {"order": (2, 1, 1)}, {}),
    ("order", {"order": (2, 1)}, {}),
    ("partition", {"partition": ((2, 2), (2,))}, {}),
    ("partition", {"partition": ((2, 2, 0), (2,), (3,))}, {}),
    ("partition", {"partition": ((2, 1), (2,), (3,))}, {}),
    ("merges", {"merges": ((2,),)}, {}),
    ("merges", {"merges": ((2, 3),)}, {}),
    ("merges", {"merges": ((2, 1), (1, 2))}, {}),
    ("merges", {"merges": ((1, 0),)}, {}),  # tensor 0 is cut into two blocks
    ("merges", {"merges": ((2, 0),), "partition": ((4,), (2,), (3,))}, {}),  # not neighbours in order
    ("merges", {}, {"dtypes": ["torch.float32", "torch.float32", "torch.float16"]}),
    ("priority", {"priority": (0, 1)}, {}),
    ("phase1_windows", {"phase1_windows": (ALL, 0)}, {}),
    ("phase1_windows", {"phase1_windows": (ALL, -3, 1)}, {}),
    ("phase2_windows", {"phase2_windows": ()}, {}),
    ("phase2_windows", {"phase2_windows": (1, 0)}, {}),
    ("credit_bytes", {"credit_bytes": -1}, {}),
    ("channels", {"channels": 0}, {}),
    ("channels", {}, {"max_channels": 1}),
    ("policy", {"policy": "fastest"}, {}),
])
@pytest.mark.timeout(60)
def test_validate_names_the_bad_field(field, change, context):
    validate(GOOD, numels=GOOD.numels, max_channels=2, dtypes=["torch.float32"] * 3)
    with pytest.raises(PlanError, match=f"'{field}'"):
        validate(dataclasses.replace(GOOD, **change), **context)
    assert issubclass(PlanError, ValueError)


def test_decoupled_tensors_get_a_reduce_scatter_then_an_all_gather():
    """Note [Two-stage blocks]: each block of a decoupled tensor (or merge) becomes two blocks over the same
    elements, the all-gather right after its reduce-scatter, waiting for it and for the flush."""
    from dcredit_opt.blockops import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER

    plan = Plan(numels=(6, 4, 5), order=(2, 1, 0), partition=((3, 3), (4,), (5,)), merges=((2, 1),),
                decoupled=(0,))
    layout = layout_of(plan, ["torch.float32"] * 3)
    assert layout.block_tensors == ((2, 1), (0,), (0,), (0,), (0,))
    assert layout.block_op == (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, REDUCE_SCATTER, ALL_GATHER)
    assert layout.block_after == (-1, -1, 1, -1, 3)
    assert layout.block_at_flush == (False, False, True, False, True)
    assert layout.block_offset[1:3] == (layout.tensor_offset[0],) * 2 and layout.block_numel[1:3] == (3, 3)
    whole = dataclasses.replace(plan, decoupled=(0, 1, 2))
    assert layout_of(whole, ["torch.float32"] * 3).block_op == (REDUCE_SCATTER, ALL_GATHER) * 3
    assert Plan.from_json(whole.to_json()) == whole


@pytest.mark.parametrize("decoupled, message", [
    ((3,), "must name distinct tensors"), ((0, 0), "must name distinct tensors"),
    ((1,), "splits merge [2, 1]"),
])
def test_bad_decoupled_is_named(decoupled, message):
    plan = Plan(numels=(6, 4, 5), order=(2, 1, 0), partition=((3, 3), (4,), (5,)), merges=((2, 1),),
                decoupled=decoupled)
    with pytest.raises(PlanError, match=re.escape(message)):
        validate(plan)
