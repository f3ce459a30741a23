"""D-Credit: the phase-2 derivation against exhaustive search, the phase-1 greedy against
exhaustive search and against the best fixed window."""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcredit_opt.planner.dcredit import (
    dcredit,
    optimal_phase2_batches,
    optimal_phase2_windows,
    packing_merges,
    windows_for_batches,
)
from dcredit_opt.planner.plan import ALL, Plan, validate
from dcredit_opt.planner.profile import Profile, TensorProfile
from dcredit_opt.planner.simulate import ready_times, simulate

from .strategies import profiles, random_profile

S = 16  # block bytes in the small cases: 4 float32 elements


def window_sequences(n: int):
    """Every phase-2 window sequence that differs in effect for ``n`` blocks.

    Entries above ``n`` act like ``n`` (never more than ``n - 1`` others in
    flight), and entries after the one that exhausts the heap are never used.
    """
    def extend(prefix, total):
        for w in range(1, n + 1):
            if total + w >= n:
                yield (*prefix, w)
            else:
                yield from extend((*prefix, w), total + w)
    yield from extend((), 0)


def iteration(plan: Plan, profile: Profile, **fields) -> float:
    return simulate(dataclasses.replace(plan, **fields) if fields else plan, profile).iteration_s


def num_blocks(plan: Plan) -> int:
    """Collectives per iteration: cut blocks, a merged run counting once."""
    return sum(len(p) for p in plan.partition) - sum(len(m) - 1 for m in plan.merges)


def small_case(seed: int, equal_blocks: bool) -> Profile:
    rng = np.random.default_rng(seed + 7)
    return random_profile(seed, int(rng.integers(2, 5)), max_numel=12, numel_multiple=4 if equal_blocks else 1,
                          shuffle_ready=seed % 5 == 0)


# -- phase 2 ----------------------------------------------------------------------

def test_phase2_batches_by_hand():
    # alpha = beta = 1, two tensors of two 1-byte blocks, g = F(tensor).
    # f = (3, 1): one batch 1 + 4 + 4 = 9; per tensor max(1 + 2 + 4, 2 + 4 + 1) = 7.
    assert optimal_phase2_batches(1.0, 1.0, [1, 1, 1, 1], [4, 4, 1, 1]) == [2, 2]
    # f = (0.5, 1): one batch 1 + 4 + 1.5 = 6.5 beats per tensor max(4.5, 7).
    assert optimal_phase2_batches(1.0, 1.0, [1, 1, 1, 1], [1.5, 1.5, 1, 1]) == [4]
    # A long first forward: the first tensor alone, then the rest (max(8, 7) < 11).
    assert optimal_phase2_batches(1.0, 1.0, [1, 1, 1, 1], [6, 1, 1, 1]) == [1, 3]
    assert optimal_phase2_batches(0.0, 0.0, [5, 5], [2, 1]) == [2]
    assert optimal_phase2_batches(1.0, 1.0, [], []) == []


def test_windows_for_batches():
    assert windows_for_batches([3, 2, 2]) == (3, 2)  # the last size repeats
    assert windows_for_batches([1, 3]) == (1, 1, 3)
    assert windows_for_batches([2, 2, 5, 1]) == (1, 2, 2, 5, 1)
    assert windows_for_batches([]) == (1,)


def equal_block_profile(blocks_per_tensor, alpha=0.5, beta=0.01) -> Profile:
    tensors = tuple(TensorProfile(f"t{i}", 4 * m, "float32", i, 0.1, 0.1) for i, m in enumerate(blocks_per_tensor))
    return Profile(tensors, alpha, beta, 2)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=5))
def test_windows_launch_exactly_the_batches(batches):
    # Equal blocks, link idle at the flush: blocks launched at the same instant are one batch.
    n = sum(batches)
    p = equal_block_profile([n])
    plan = Plan(numels=p.numels, order=(0,), partition=((4,) * n,), phase1_windows=(0,),
                phase2_windows=windows_for_batches(batches))
    launches = [b.launch_s for b in simulate(plan, p).blocks]
    sizes = [len(list(group)) for _, group in itertools.groupby(launches)]
    assert sizes == batches


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 4), st.booleans())
def test_phase2_windows_are_optimal_over_every_window_sequence(seed, T, shuffled):
    """The derivation's assumptions: equal blocks, link idle at the flush (phase 1 holds everything).

    Its windows must reach the simulator's minimum over every phase-2 window
    sequence, exactly (up to float rounding).
    """
    rng = np.random.default_rng(seed)
    p = random_profile(seed, T, max_numel=4 * int(rng.integers(1, 4)), numel_multiple=4, shuffle_ready=shuffled)
    plan = dataclasses.replace(dcredit(p, block_bytes=S), phase1_windows=(0,) * T)
    n = num_blocks(plan)
    if n > 8:
        return
    ours = iteration(plan, p, phase2_windows=optimal_phase2_windows(plan, p))
    best = min(iteration(plan, p, phase2_windows=w) for w in window_sequences(n))
    assert ours == pytest.approx(best, rel=1e-12, abs=1e-12)


def phase2_gaps(pack: bool) -> list[float]:
    gaps = []
    for seed in range(120):
        p = small_case(seed, equal_blocks=seed % 2 == 0)
        plan = dcredit(p, block_bytes=S, pack=pack)
        n = num_blocks(plan)
        if n > 7:
            continue
        best = min(iteration(plan, p, phase2_windows=w) for w in window_sequences(n))
        gaps.append(iteration(plan, p) / best - 1)
    print(f"\nphase 2 given the greedy's phase 1, pack={pack}, {len(gaps)} cases: gap to exhaustive mean "
          f"{statistics.mean(gaps):.2%}, max {max(gaps):.2%}, exact in {sum(g < 1e-9 for g in gaps)}")
    return gaps


def test_phase2_gap_outside_the_assumptions(record_property):
    """Unequal tail blocks, phase-1 blocks still in flight at the flush: the analytic windows
    (refined by the simulator, as dcredit() does) against exhaustive search, same phase 1.

    Without packing every block but a tensor's last is of one size, as the
    derivation has it."""
    gaps = phase2_gaps(pack=False)
    record_property("phase2_gap_max", max(gaps))
    assert max(gaps) <= 0.10  # measured 7.85%
    assert statistics.mean(gaps) <= 0.01  # measured 0.59%


def test_phase2_gap_with_packed_blocks(record_property):
    """Packed small tensors make blocks of many sizes, further from the derivation's equal
    blocks: the gap is larger in the worst case. Measured (seeds 0..119, 86 cases): mean 0.82%,
    max 18.2%; the bounds sit just above, so that a regression shows."""
    gaps = phase2_gaps(pack=True)
    record_property("phase2_gap_packed_max", max(gaps))
    assert max(gaps) <= 0.20
    assert statistics.mean(gaps) <= 0.012


# -- phase 1 ----------------------------------------------------------------------

def design_rule_windows(p: Profile, plan: Plan) -> list[int]:
    """DESIGN.md section 4 as written, for full-size blocks and ready order = reverse forward order."""
    alpha, beta = p.alpha_s, p.beta_s_per_byte
    ready = ready_times(p)
    events = [ready[t] for t in plan.order]
    heap = 0
    free = 0.0
    out = []
    for i, t in enumerate(plan.order):
        heap += len(plan.partition[t])
        if i + 1 == len(events):
            out.append(0)
            break
        start = max(events[i], free)
        dt = events[i + 1] - start - alpha
        k = math.ceil(dt / (beta * S)) if dt > 0 else (1 if dt > -alpha else 0)
        k = min(k, heap)
        heap -= k
        out.append(k)
        if k:
            free = start + alpha + beta * S * k
    return out


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 6))
def test_greedy_is_the_design_rule_on_full_blocks(seed, T):
    p = random_profile(seed, T, max_numel=16, numel_multiple=4)
    plan = dcredit(p, block_bytes=S)
    assert list(plan.phase1_windows) == design_rule_windows(p, plan)


def test_greedy_counts_small_blocks_in_bytes():
    # Six 4-byte tensors ready every 0.3 s; alpha 1 s, S = 16 bytes. t5 goes at
    # 0.3 (link idle, dt < 0: one block's worth) and holds the link to 1.304;
    # t4, t3, t2 pile up. At 1.2 the link is idle before 1.5 but dt < 0 again:
    # one block's worth of bytes is all three (12 bytes), which share one
    # start-up; the design's count would have sent t2 alone.
    tensors = tuple(TensorProfile(f"t{i}", 1, "float32", i, 0.0, 0.3) for i in range(6))
    p = Profile(tensors, 1.0, 0.001, 2)
    # Unpacked: packing would join these neighbours into blocks before the greedy sees them.
    assert dcredit(p, block_bytes=S, pack=False).phase1_windows == (1, 0, 0, 3, 0, 0)


# -- packing ------------------------------------------------------------------------

def test_packing_by_hand():
    # Ready order 5, 4, ..., 0 every 0.1 s; alpha 0.05 s, beta 0.01 s/byte, S = 16
    # bytes: patience alpha + beta * S = 0.21 s after a run's first event.
    #   t5 (8 B) + t4 (4 B): 12 B, 0.1 s apart.
    #   t3 (8 B) would make 20 B > S: a new run, t3 + t2 (4 B) ...
    #   t1 is float16: a dtype change ends the run; t0 (24 B) is cut into blocks: never packed.
    tensors = (TensorProfile("t0", 6, "float32", 0, 0.0, 0.1), TensorProfile("t1", 2, "float16", 1, 0.0, 0.1),
               TensorProfile("t2", 1, "float32", 2, 0.0, 0.1), TensorProfile("t3", 2, "float32", 3, 0.0, 0.1),
               TensorProfile("t4", 1, "float32", 4, 0.0, 0.1), TensorProfile("t5", 2, "float32", 5, 0.0, 0.1))
    p = Profile(tensors, 0.05, 0.01, 2)
    assert packing_merges(p, S) == [[5, 4], [3, 2]]
    # Less patience (beta * S below the 0.1 s between gradients): nothing waits, nothing is packed.
    assert packing_merges(dataclasses.replace(p, alpha_s=0.0, beta_s_per_byte=0.001), S) == []
    # A larger block: t5..t2 (20 B) fit in 32 B and arrive within 0.37 s of t5.
    assert packing_merges(p, 32) == [[5, 4, 3, 2]]
    plan = dcredit(p, block_bytes=S)
    assert plan.merges == ((5, 4), (3, 2))
    assert num_blocks(plan) == 2 + 1 + 2  # t0 cut in two, t1 alone, two packed blocks
    # An empty tensor has no block: it ends a run, and a run is of neighbours in the ready order.
    empty = (TensorProfile("e0", 1, "float32", 0, 0.0, 0.0), TensorProfile("e1", 0, "float32", 1, 0.0, 0.0),
             TensorProfile("e2", 1, "float32", 2, 0.0, 0.0), TensorProfile("e3", 1, "float32", 3, 0.0, 0.0))
    assert packing_merges(Profile(empty, 0.0, 0.0, 2), S) == [[3, 2]]
    assert packing_merges(Profile(empty[:2], 0.0, 0.0, 2), S) == []


@settings(max_examples=150, deadline=None)
@given(profiles(max_tensors=8, max_numel=24), st.sampled_from([8, 16, 64]))
def test_packing_rules_hold(p, block_bytes):
    plan = dcredit(p, block_bytes=block_bytes)
    validate(plan, p.numels, dtypes=[t.dtype for t in p.tensors])  # consecutive, one block each, one dtype
    ready = ready_times(p)
    events = {}
    latest = 0.0
    for t in p.order():
        latest = max(latest, ready[t])
        events[t] = latest
    for run in plan.merges:
        assert sum(p.tensors[t].nbytes for t in run) <= block_bytes
        assert all(p.tensors[t].numel > 0 for t in run)
        assert events[run[-1]] - events[run[0]] <= p.alpha_s + p.beta_s_per_byte * block_bytes + 1e-12
    assert dcredit(p, block_bytes=block_bytes, pack=False).merges == ()


@pytest.mark.parametrize("model", ["resnet18", "vgg", "gpt"])
@pytest.mark.parametrize("gbit", [1, 10])
def test_packing_on_the_benchmark_models(model, gbit):
    """Fewer collectives, and the simulated iteration no more than 1% longer (measured: at most +0.8%,
    ResNet at 1 Gbit/s; GPT at 1 Gbit/s 2.2% shorter)."""
    from benchmarks.report import REPO_ROOT

    p = Profile.load(REPO_ROOT / "dcredit_opt" / "profiles" / f"{model}.json")
    p = dataclasses.replace(p, beta_s_per_byte=8e-9 / gbit)
    packed, plain = dcredit(p), dcredit(p, pack=False)
    assert num_blocks(packed) < num_blocks(plain)
    assert iteration(packed, p) <= iteration(plain, p) * 1.01


def test_greedy_releases_blocks_nothing_can_overtake():
    # Gradients ready in forward order: tensor 0 (the highest priority) first.
    # No later gradient can overtake its blocks, so they all go at once.
    tensors = tuple(TensorProfile(f"t{i}", 12, "float32", i, 0.1, 0.01) for i in range(3))
    p = Profile(tensors, 1.0, 0.1, 2, ready_order=(0, 1, 2))
    plan = dcredit(p, block_bytes=S)
    assert plan.phase1_windows == (3, 3, 0)


def exhaustive_phase1(plan: Plan, p: Profile) -> float:
    n = num_blocks(plan)
    best = math.inf
    for windows in itertools.product([ALL, *range(n + 1)], repeat=plan.num_tensors):
        candidate = dataclasses.replace(plan, phase1_windows=windows)
        candidate = dataclasses.replace(candidate, phase2_windows=optimal_phase2_windows(candidate, p))
        best = min(best, iteration(candidate, p))
    return best


def best_fixed_window(plan: Plan, p: Profile) -> float:
    n = num_blocks(plan)
    return min(iteration(plan, p, phase1_windows=(k,) * plan.num_tensors, phase2_windows=(k,))
               for k in range(1, n + 1))


def test_greedy_against_exhaustive_and_fixed_windows(record_property):
    """The greedy (and the plan dcredit() makes from it) never loses to the best fixed window
    (ByteScheduler's credit, same blocks) by more than 15%.

    Recorded: its gap to the exhaustive optimum over every phase-1 window
    sequence (each with its optimal phase-2 windows). Measured on 219 cases of
    2-4 tensors, up to 7 blocks (seeds 0..299): vs the best fixed window
    mean -2.8%, max +12.6%; vs the exhaustive optimum mean +1.3%, max +13.6%.
    The worst cases are the design's rule itself: ``ceil`` sends a block that
    is still on the link when a higher-priority gradient arrives.
    """
    vs_fixed, vs_best = [], []
    for seed in range(0, 200, 2):
        p = small_case(seed, equal_blocks=seed % 4 == 0)
        plan = dcredit(p, block_bytes=S)
        if plan.num_tensors > 3 or num_blocks(plan) > 6:
            continue
        ours = iteration(plan, p)
        vs_fixed.append(ours / best_fixed_window(plan, p) - 1)
        vs_best.append(ours / exhaustive_phase1(plan, p) - 1)
    print(f"\ngreedy over {len(vs_fixed)} cases: vs best fixed window mean {statistics.mean(vs_fixed):+.2%}, "
          f"max {max(vs_fixed):+.2%}; vs exhaustive phase 1 mean {statistics.mean(vs_best):+.2%}, "
          f"max {max(vs_best):+.2%}, optimal in {sum(g < 1e-9 for g in vs_best)}")
    record_property("greedy_vs_fixed_max", max(vs_fixed))
    record_property("greedy_vs_exhaustive_max", max(vs_best))
    assert max(vs_fixed) <= 0.15
    assert statistics.mean(vs_fixed) <= 0.0


@settings(max_examples=60, deadline=None)
@given(profiles(max_tensors=6, max_numel=60), st.sampled_from([8, 16, 64]))
def test_refinement_never_hurts(p, block_bytes):
    refined = dcredit(p, block_bytes=block_bytes)
    plain = dcredit(p, block_bytes=block_bytes, refine=False)
    assert refined.phase1_windows == plain.phase1_windows
    assert iteration(refined, p) <= iteration(plain, p)
