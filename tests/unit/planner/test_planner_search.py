"""The D-Credit planner's search: never slower than any result-preserving baseline in the simulator
(random profiles, and the shipped profiles at 2 to 1024 workers), deterministic, bounded."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dcredit_opt
from dcredit_opt.planner import policies
from dcredit_opt.planner.cost import scale_to_workers
from dcredit_opt.planner.plan import Plan, stages_of, validate
from dcredit_opt.planner.profile import RING_STAGE_RATIOS, Profile
from dcredit_opt.planner.search import budget_units, search
from dcredit_opt.planner.simulate import simulate
from dcredit_opt.planner.synthetic import model_like_profile
from dcredit_opt.profiling import planning

from .strategies import profiles

TOLERANCE = 1.005  # the "within 0.5 %"; by construction the search is never slower at all
BASELINES = ("wfbp", "ddp", "mgwfbp", "oasr", "bytescheduler", "usbyte", "dear")


def baseline_plans(p: Profile, grid: list[int], channels: int, fifo: bool = False) -> dict[str, Plan]:
    """Every other result-preserving policy, tuned over ``grid`` as the runtime tunes them."""
    plans = {name: policies.POLICIES[name](p, channels=channels) for name in ("wfbp", "ddp", "mgwfbp", "oasr")}
    plans["dear"] = policies.tune_dear(p, block_sizes=grid, channels=channels, channel_fifo=fifo)
    plans["bytescheduler"] = policies.tune_bytescheduler(p, block_sizes=grid, channels=channels, channel_fifo=fifo)
    plans["usbyte"] = policies.tune_usbyte(p, block_sizes=grid, channels=channels, channel_fifo=fifo)
    assert sorted(plans) == sorted(BASELINES)
    return plans


@settings(max_examples=40, deadline=None)
@given(profiles(max_tensors=6, max_numel=120, dtypes=("float32", "float16"), host_cost=True),
       st.sampled_from([[8, 32, 128], [16], [4, 64, 1 << 20]]), st.sampled_from([1, 2]), st.booleans())
def test_dcredit_is_never_slower_than_any_baseline(p, grid, channels, fifo):
    """Under either network model, every policy tuned and judged under the same one."""
    plan = search(p, block_sizes=grid, channels=channels, channel_fifo=fifo)
    validate(plan, numels=p.numels, dtypes=p.dtypes)
    assert plan.policy == "dcredit" and plan.channels == channels
    ours = simulate(plan, p, channel_fifo=fifo).iteration_s
    for name, other in baseline_plans(p, grid, channels, fifo).items():
        theirs = simulate(other, p, channel_fifo=fifo).iteration_s
        assert ours <= theirs * TOLERANCE + 1e-12, name


def shipped(name: str) -> Profile:
    for folder in (Path(dcredit_opt.__file__).parent / "profiles", Path(__file__).parents[3] / "benchmarks" / "profiles"):
        if (folder / f"{name}.json").exists():
            return Profile.load(folder / f"{name}.json")
    pytest.skip(f"shipped profile {name} not found")


def scaled(p: Profile, workers: int) -> Profile:
    alpha, beta = scale_to_workers(p.alpha_s, p.beta_s_per_byte, p.world_size, workers)
    return dataclasses.replace(p, alpha_s=alpha, beta_s_per_byte=beta, world_size=workers)


@pytest.mark.parametrize("model", ["vgg", "resnet18", "gpt"])
def test_dcredit_is_never_beaten_on_the_shipped_profiles(model):
    """As the runtime plans (planning.make_plan, 2 channels), at 2, 16, 64, 256 and 1024 workers,
    in the calibrated simulator (its network model planning.CHANNEL_FIFO)."""
    base = shipped(model)
    fifo = planning.CHANNEL_FIFO
    for workers in (2, 16, 64, 256, 1024):
        p = scaled(base, workers)
        ours = simulate(planning.make_plan(p, "dcredit", channels=2), p, channel_fifo=fifo).iteration_s
        for name in BASELINES:
            theirs = simulate(planning.make_plan(p, name, channels=2), p, channel_fifo=fifo).iteration_s
            assert ours <= theirs * TOLERANCE, (workers, name, ours, theirs)


def test_phase_2_off_is_respected():
    p = scaled(shipped("resnet18"), 16)
    plan = planning.make_plan(p, "dcredit", channels=2, overlap_forward=False)
    assert not plan.overlap_forward
    fifo = planning.CHANNEL_FIFO
    ours = simulate(plan, p, channel_fifo=fifo).iteration_s
    for name in BASELINES:
        other = planning.make_plan(p, name, channels=2, overlap_forward=False)
        assert ours <= simulate(other, p, channel_fifo=fifo).iteration_s * TOLERANCE, name


def test_search_is_deterministic_and_bounded():
    # Invariant 1: the plan is a function of the profile (no clock): the same twice.
    p = model_like_profile(1000)
    grid = planning.block_size_grid(p)
    trace: list = []
    first = search(p, block_sizes=grid, channels=2, trace=trace)
    assert search(p, block_sizes=grid, channels=2) == first
    validate(first, numels=p.numels, dtypes=p.dtypes)
    # A 1,000-tensor model spends its budget on a few candidates, D-Credit's own first.
    assert budget_units(1000) == 15_000
    assert 1 <= len(trace) < 10 and trace[0][0].startswith("dcredit S=")
    # A small model runs the whole search: every candidate is tried (screens aside).
    small = scaled(shipped("vgg"), 64)
    trace = []
    search(small, block_sizes=planning.block_size_grid(small), channels=2, budget=10**12, trace=trace)
    full = len(trace)
    trace = []
    search(small, block_sizes=planning.block_size_grid(small), channels=2, trace=trace)
    assert len(trace) == full


def test_search_needs_a_block_size():
    with pytest.raises(ValueError, match="at least one block size"):
        search(model_like_profile(4), block_sizes=[])


@pytest.mark.parametrize("model", ["vgg", "resnet18", "gpt"])
def test_the_whole_search_fits_the_budget_on_the_shipped_profiles(model):
    """So that 'never beaten' holds there by construction, not by luck (GPT at 2 workers uses ~80 %)."""
    from dcredit_opt.planner.search import CREDITS, _candidates

    for workers in (2, 16, 64, 256, 1024):
        p = scaled(shipped(model), workers)
        grid = sorted(planning.block_size_grid(p))
        total = sum(cost for _, cost, _, _ in _candidates(p, grid, CREDITS, 2, 0.0, True, planning.CHANNEL_FIFO))
        assert total <= budget_units(p.num_tensors), (workers, total)


def test_where_the_link_is_free_the_host_cost_picks_fewer_larger_blocks():
    """Profile.host_s_per_collective: a world of one (alpha of tens of microseconds, no bandwidth term) finds
    every plan about equally fast on the link; charging each collective's host work makes the search take
    few collectives, and never a plan slower than another candidate under the same charge."""
    shipped = Profile.load(Path(dcredit_opt.__file__).parent / "profiles" / "gpt.json")
    free = dataclasses.replace(shipped, alpha_s=40e-6, beta_s_per_byte=0.0, world_size=1)
    charged = dataclasses.replace(free, host_s_per_collective=20e-6)
    grid = [1 << 16, 1 << 20, 4 << 20]
    link_only = search(free, block_sizes=grid, channels=2)
    with_host = search(charged, block_sizes=grid, channels=2)
    n_link, n_host = len(stages_of(link_only)), len(stages_of(with_host))
    assert n_host <= 8 < n_link, (n_link, n_host)  # 5 against 1,705 when written
    ours = simulate(with_host, charged).iteration_s
    assert ours <= simulate(link_only, charged).iteration_s + 1e-12
    for name, other in baseline_plans(charged, grid, channels=2).items():
        assert ours <= simulate(other, charged).iteration_s * TOLERANCE + 1e-12, name


def test_a_world_of_one_never_decouples():
    """Note [A world of one never decouples]: the same profile that the search plans with every tensor decoupled at
    two ranks (the simulator, with one rank's all-reduce fit, sees the stages as nearly free) gets all-reduce blocks
    only at one rank; DeAR, asked for by name, still decouples there."""
    base = shipped("vgg")
    for ratios in ((0.05, 0.5, 0.05, 0.5), RING_STAGE_RATIOS):
        two = dataclasses.replace(base, alpha_s=70e-6, beta_s_per_byte=0.0, world_size=2, stage_ratios=ratios,
                                  host_s_per_collective=20e-6)
        one = dataclasses.replace(two, world_size=1)
        assert planning.make_plan(two, "dcredit", channels=2).decoupled, ratios  # what the rule takes away
        plan = planning.make_plan(one, "dcredit", channels=2)
        assert plan.decoupled == () and all(s.op == 0 for s in stages_of(plan)), ratios
        assert planning.make_plan(one, "dear", channels=2).decoupled
