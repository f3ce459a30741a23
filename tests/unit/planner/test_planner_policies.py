"""Every policy: a hand-computed plan on one small profile, and validity on random ones."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcredit_opt.planner import policies
from dcredit_opt.planner.floors import lower_bound
from dcredit_opt.planner.plan import ALL, POLICY_NAMES, Plan, validate
from dcredit_opt.planner.policies import POLICIES, make_plan, tune_bytescheduler
from dcredit_opt.planner.profile import Profile, TensorProfile
from dcredit_opt.planner.simulate import simulate

from .strategies import profiles

# Four float32 tensors of 1024, 4096, 256 and 2048 bytes. Backward runs
# 3, 2, 1, 0 taking 0.4, 0.3, 0.2, 0.1 s: gradients are ready at 0.4, 0.7,
# 0.9 and 1.0 s. alpha = 0.15 s, beta = 1e-4 s/byte (1024 bytes: 0.1024 s).
P4 = Profile(
    tensors=tuple(TensorProfile(f"t{i}", n, "float32", i, 0.1, b)
                  for i, (n, b) in enumerate(zip((256, 1024, 64, 512), (0.1, 0.2, 0.3, 0.4)))),
    alpha_s=0.15, beta_s_per_byte=1e-4, world_size=2)
WHOLE = ((256,), (1024,), (64,), (512,))
BLOCKS_1K = ((256,), (256, 256, 256, 256), (64,), (256, 256))
ORDER = (3, 2, 1, 0)


def test_wfbp_by_hand():
    assert policies.wfbp(P4) == Plan(numels=P4.numels, order=ORDER, partition=WHOLE, phase1_windows=(ALL,) * 4,
                                     phase2_windows=(4,), overlap_forward=False, policy="wfbp")


@pytest.mark.parametrize(("first", "cap", "merges"), [
    # 2048 + 256 fit the first bucket (2500); 4096 + 1024 fit the next (5200).
    (2500, 5200, ((3, 2), (1, 0))),
    # With a 3000-byte cap the 4096-byte tensor is a bucket alone, and so is t0 after it.
    (2500, 3000, ((3, 2),)),
    # DDP's defaults (1 MiB, 25 MiB): everything in the first bucket.
    (1 << 20, 25 << 20, ((3, 2, 1, 0),)),
])
def test_ddp_by_hand(first, cap, merges):
    plan = policies.ddp(P4, first_bucket_bytes=first, bucket_cap_bytes=cap)
    assert plan == Plan(numels=P4.numels, order=ORDER, partition=WHOLE, merges=merges, phase1_windows=(ALL,) * 4,
                        phase2_windows=(4,), overlap_forward=False, policy="ddp")


def test_ddp_splits_dtypes_and_skips_empty_tensors():
    tensors = [TensorProfile("a", 4, "float32", 0, 0, 1), TensorProfile("b", 4, "float16", 1, 0, 1),
               TensorProfile("c", 4, "float16", 2, 0, 1), TensorProfile("d", 0, "float16", 3, 0, 1),
               TensorProfile("e", 4, "float16", 4, 0, 1), TensorProfile("f", 4, "float16", 5, 0, 1)]
    p = Profile(tuple(tensors), 0.0, 0.0, 2)
    assert policies.ddp_buckets(p) == [[5, 4], [2, 1], [0]]


def test_mgwfbp_by_hand():
    # t3 could start at 0.4; t2 is ready at 0.7 >= 0.4 + alpha: send t3 alone
    # (link free at 0.4 + 0.15 + 0.2048 = 0.7548). t2 could start at 0.7548; t1
    # is ready at 0.9 < 0.7548 + 0.15: wait and merge (start 0.9); t0 at
    # 1.0 < 0.9 + 0.15: merge too.
    assert policies.startup_sharing_merges(P4) == [[3], [2, 1, 0]]
    assert policies.mgwfbp(P4) == Plan(numels=P4.numels, order=ORDER, partition=WHOLE, merges=((2, 1, 0),),
                                       phase1_windows=(ALL,) * 4, phase2_windows=(4,), overlap_forward=False,
                                       policy="mgwfbp")


def test_bytescheduler_by_hand():
    assert policies.bytescheduler(P4, block_bytes=1024, credit_blocks=2) == Plan(
        numels=P4.numels, order=ORDER, partition=BLOCKS_1K, phase1_windows=(2, 2, 2, 2), phase2_windows=(2,),
        overlap_forward=True, policy="bytescheduler")


def test_dear_by_hand():
    # Forward order t0 (1024 B), t1 (4096), t2 (256), t3 (2048), threshold 5000: t1 would bring t0's group to
    # 5120, so it starts the next; t2 joins it (4352); t3 would reach 6400 and is a group alone. Groups are
    # merges in ready order (3, 2, 1, 0); every tensor is decoupled; all-gathers go one at a time at the flush.
    assert policies.dear_groups(P4, 5000) == [[3], [2, 1], [0]]
    assert policies.dear(P4, threshold_bytes=5000) == Plan(
        numels=P4.numels, order=ORDER, partition=WHOLE, merges=((2, 1),), phase1_windows=(ALL,) * 4,
        phase2_windows=(1,), overlap_forward=True, decoupled=(0, 1, 2, 3), policy="dear")
    # A group is closed before it *reaches* the threshold: 5120 exactly splits t0 from t1.
    assert policies.dear_groups(P4, 5120) == [[3], [2, 1], [0]]
    assert policies.dear_groups(P4, 5121) == [[3, 2], [1, 0]]  # t0 + t1 = 5120 fit; t2 starts a group, t3 joins
    # The default (25 MB) fuses everything here; a threshold below every tensor fuses nothing.
    assert policies.dear(P4).merges == ((3, 2, 1, 0),)
    assert policies.dear_groups(P4, 1) == [[3], [2], [1], [0]]
    with pytest.raises(ValueError, match="threshold_bytes must be positive"):
        policies.dear_groups(P4, 0)


def test_dear_groups_keep_dtypes_apart_and_skip_empty_tensors():
    p = Profile(tuple(TensorProfile(f"t{i}", n, dt, i, 0.1, 0.1) for i, (n, dt) in
                      enumerate([(10, "float32"), (10, "float16"), (0, "float16"), (10, "float16"), (10, "float16")])),
                alpha_s=0.1, beta_s_per_byte=1e-4, world_size=2)
    assert policies.dear_groups(p, 1 << 20) == [[4, 3], [1], [0]]
    plan = policies.dear(p, threshold_bytes=1 << 20)
    assert plan.decoupled == (0, 1, 3, 4)
    validate(plan, numels=p.numels, dtypes=p.dtypes)


def test_tune_dear_picks_the_best_threshold():
    from dcredit_opt.planner.usbyte import unit_grid

    sizes = [256, 1024, 4096]
    best = policies.tune_dear(P4, block_sizes=sizes)
    grid = [policies.dear(P4, threshold_bytes=s) for s in unit_grid(sizes, 5)]
    assert best in grid and best.policy == "dear"
    assert simulate(best, P4).iteration_s == min(simulate(g, P4).iteration_s for g in grid)


def test_dcredit_by_hand():
    # Blocks (ids): t3 -> 0, 1; t2 -> 2; t1 -> 3..6; t0 -> 7. S = 1024 bytes.
    # e0 = 0.4: link idle until 0.7, dt = 0.3 - 0.15 = 0.15 -> 1500 bytes: blocks 0, 1
    #   (link busy until 0.4 + 0.15 + 0.2048 = 0.7548).
    # e1 = 0.7: idle 0.9 - 0.7548 = 0.1452 > 0, dt < 0 -> one block's worth: block 2 (all there is)
    #   (busy until 0.9304).
    # e2 = 0.9: idle 1.0 - 0.9304 > 0, dt < 0 -> one block: block 3 (busy until 1.1828).
    # e3 = 1.0: last event, nothing; the flush finds 7 (t0) and 4, 5, 6 (t1).
    # Phase 2 with g(t0) = 0.4, g(t1) = 0.3: one batch costs 0.15 + 0.4096 + 0.4 = 0.9596;
    # two batches cost max(0.15 + 0.1024 + 0.4, 0.3 + 0.4096 + 0.3) = 1.0096. One window of 4.
    plan = policies.dcredit(P4, block_bytes=1024)
    assert plan == Plan(numels=P4.numels, order=ORDER, partition=BLOCKS_1K, phase1_windows=(2, 1, 1, 0),
                        phase2_windows=(4,), overlap_forward=True, policy="dcredit")
    # Block 3 is still in flight at the flush; refinement also tried window 5
    # (the first batch joining it) and kept 4. By hand, processor sharing:
    # blocks 7, 4, 5 launch at 1.0 beside 3, block 6 when 3 ends at 1.2812,
    # 7, 4, 5 end at 1.5096 and 6 at 1.5924; forwards of 0.1 s from 1.5096.
    r = simulate(plan, P4)
    assert [r.blocks[b].end_s for b in (3, 7, 4, 5, 6)] == pytest.approx([1.2812, 1.5096, 1.5096, 1.5096, 1.5924])
    assert r.iteration_s == pytest.approx(1.5096 + 0.4)
    assert simulate(dataclasses.replace(plan, phase2_windows=(5,)), P4).iteration_s > r.iteration_s


def test_tune_bytescheduler_picks_the_best_of_its_grid():
    sizes, credits = [256, 1024, 4096], [1, 2, 4]
    best = tune_bytescheduler(P4, block_sizes=sizes, credits=credits)
    grid = [policies.bytescheduler(P4, block_bytes=s, credit_blocks=c) for s in sizes for c in credits]
    assert best in grid
    assert simulate(best, P4).iteration_s == min(simulate(g, P4).iteration_s for g in grid)
    assert tune_bytescheduler(P4).policy == "bytescheduler"  # default grid


def test_tune_dcredit_picks_the_best_block_size():
    sizes = [256, 1024, 4096]
    best = policies.tune_dcredit(P4, block_sizes=sizes)
    grid = [policies.dcredit(P4, block_bytes=s) for s in sizes]
    assert best in grid
    assert simulate(best, P4).iteration_s == min(simulate(g, P4).iteration_s for g in grid)
    assert policies.tune_dcredit(P4).policy == "dcredit"
    with pytest.raises(ValueError, match="tune_dcredit needs at least one candidate"):
        policies.tune_dcredit(P4, block_sizes=[])


def test_registry_is_frozen():
    # A new policy must be added here on purpose, and must be a name plan.validate accepts.
    assert sorted(POLICIES) == ["bytescheduler", "dcredit", "ddp", "dear", "mgwfbp", "oasr", "usbyte", "wfbp"]
    assert set(POLICIES) <= set(POLICY_NAMES)


def test_make_plan_errors_name_the_policy():
    with pytest.raises(ValueError, match=r"unknown policy 'dcredit2'; known policies: bytescheduler, dcredit, ddp"):
        make_plan(P4, "dcredit2")
    assert make_plan(P4, "deft").policy == "deft"  # apart from POLICIES: it changes results (Config says so)
    with pytest.raises(TypeError):
        make_plan(P4, "wfbp", block_bytes=4)
    assert make_plan(P4, "bytescheduler", block_bytes=1024, credit_blocks=2).partition == BLOCKS_1K


@settings(max_examples=60, deadline=None)
@given(profiles(max_tensors=8, max_numel=300, dtypes=("float32", "float16", "bfloat16", "int8")),
       st.sampled_from(sorted(POLICIES)), st.sampled_from([8, 64, 1 << 20]))
def test_every_policy_gives_a_valid_plan(p, name, block_bytes):
    kwargs = {"block_bytes": block_bytes} if name in ("bytescheduler", "usbyte", "dcredit") else {}
    plan = make_plan(p, name, **kwargs)
    validate(plan, numels=p.numels, dtypes=p.dtypes)
    assert plan.policy == name
    assert Plan.from_json(plan.to_json()) == plan
    assert simulate(plan, p).iteration_s >= lower_bound(p) - 1e-9
