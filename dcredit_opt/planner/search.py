"""The D-Credit planner's search: D-Credit's plans and every baseline's, judged by the simulator.

D-Credit's windows (``dcredit.py``) are the model's optimum for the blocks
they are given, but the block size, whether small tensors are packed, and
whether windows beat a fixed credit on a given network are choices the
model does not settle: at high start-up latency a fixed credit keeps one
collective's latency overlapped with another's transfer, and a merge-only
schedule may pay fewer start-ups than any cut. The planner therefore treats
all of them as candidates of one search, and keeps the one the simulator
finds fastest. Every baseline is a special case of a D-Credit plan (a plan
is blocks, priorities and a window per event: a fixed credit is a constant
window, WFBP and its merging variants release everything when ready), so
the search includes each baseline's own plan, as the runtime would make it
(``profiling/planning.py``), relabelled ``dcredit``; D-Credit is then never slower
than any of them in the simulator, by construction, whenever the search
runs to the end.

Candidates, in the order they are tried (most promising first):

1. D-Credit proper (greedy phase 1, optimal phase 2) at every block size,
   small tensors packed;
2. the merge-only schedules (OASR's optimal merges, MG-WFBP's, DDP's
   buckets, WFBP), with phase 2 on;
3. ByteScheduler's grid: every block size times every credit;
4. the same blocks with a fixed phase-1 credit and D-Credit's optimal
   phase-2 windows, and D-Credit's windows without packing;
5. US-Byte's plans over its unit grid;
6. DeAR's plans over its threshold grid (reduce-scatter in backward,
   all-gather in forward), and D-Credit over decoupled collectives: its
   windows with every block decoupled, and with only the blocks its
   all-reduce plan leaves for the flush decoupled, so that their
   reduce-scatters may fill the link's idle time in backward and only the
   all-gathers are left for the forward (issue S1's question: whether
   decoupling wins is the simulator's call, per profile). Not in a world
   of one (Note [A world of one never decouples]).

Note [A world of one never decouples]
-------------------------------------
With one rank nothing travels: an all-reduce in place is a no-op for the
backend, while a reduce-scatter and an all-gather each copy the block, and
a decoupled block is two collectives where an all-reduce block is one.
Decoupling can only cost there, and the profile cannot say how much: the
stage costs are ratios of the all-reduce's (``Profile.stage_ratios``), and
one rank's all-reduce fits a per-byte time of zero. Measured on the 2-core
machine (Gloo, 11.6 MB): all-reduce 0.08 ms, reduce-scatter 1.3 ms,
all-gather 7.6 ms; an MLP planned decoupled ran 7.4 ms per iteration where
its all-reduce plan ran 2.9 ms, and whether a process planned so depended on
the sweep's noise. So the search leaves candidates 6 out for a profile of
one rank, and the profiler skips the stage sweep that only they need
(``planning.measures_stages``, by :func:`decouples`). DeAR, asked for by
name, still decouples.

Invariant 1 (a plan is a deterministic function of the profile): the search
has no clock. Its effort is bounded by a budget in *work units*, an
estimate of the cost of each candidate counted in simulated events and
blocks (and US-Byte's model runs); candidates past the budget are not
tried. The budget lets a model of about 1,000 tensors plan in under 50 ms
while the benchmark models (up to ~100 tensors) run the whole search.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence

from . import policies
from .dcredit import (
    dcredit_windows,
    optimal_phase2_windows,
    packing_merges,
    partition_by_bytes,
    replay_phase1,
)
from .oasr import overlap_aware_merges
from .plan import ALL, Plan, validate
from .profile import Profile
from .simulate import block_table, unchecked_iteration_time
from .usbyte import _Model, unit_grid

CREDITS = (1, 2, 4, 8, 16)
"""ByteScheduler's credits (in blocks), as ``policies.tune_bytescheduler`` tries them."""

BUDGET_TENSOR_UNITS = 15_000_000
"""The search's budget times the number of tensors: work units (about one simulated event or
block each, some 3 us of Python here) it may spend. A candidate costs about T units, so a model
of T tensors may try about 15e6 / T**2 of them: a 1,000-tensor model a dozen (under 50 ms), a
100-tensor model (every benchmark model) all of them (under half a second)."""

SCREEN_MARGIN = 1.25
"""A US-Byte unit size gets its order search and a simulation only when its model's iteration with
forward order is within this factor of the best candidate so far (the search rarely gains 10 %)."""


def _layout(profile: Profile, partition, merges=(), priority=None, *, channels: int, overlap_forward: bool) -> Plan:
    T = profile.num_tensors
    return Plan(numels=profile.numels, order=profile.order(), partition=tuple(partition),
                merges=tuple(tuple(m) for m in merges if len(m) > 1), priority=priority,
                phase1_windows=(ALL,) * T, phase2_windows=(max(1, T),), channels=channels,
                overlap_forward=overlap_forward, policy="dcredit")


def _blocks(plan: Plan) -> int:
    return sum(len(p) for p in plan.partition) - sum(len(m) - 1 for m in plan.merges)


def _candidates(profile: Profile, block_sizes: Sequence[int], credits: Sequence[int], channels: int,
                update_s: float, overlap_forward: bool,
                channel_fifo: bool = False) -> Iterator[tuple[str, int, Callable[[], Plan]]]:
    """Every candidate as ``(name, work units, make)``, in the order they are tried; ``make()`` builds it."""
    T = profile.num_tensors
    whole = tuple((t.numel,) if t.numel else () for t in profile.tensors)
    kw = {"channels": channels, "overlap_forward": overlap_forward}

    @functools.cache
    def plain(size: int) -> Plan:
        return _layout(profile, partition_by_bytes(profile, size), **kw)

    @functools.cache
    def packed(size: int) -> Plan:
        return _layout(profile, plain(size).partition, packing_merges(profile, size), **kw)


    def units(layout: Plan, runs: int) -> int:
        """About ``runs`` simulations (or replays) of ``layout``."""
        return runs * (T + _blocks(layout))

    # dcredit_windows replays phase 1, simulates to the flush and tries phase 2's variants: four runs.
    for size in block_sizes:
        yield (f"dcredit S={size}", units(packed(size), 4),
               lambda size=size: dcredit_windows(packed(size), profile, block_bytes=size, update_s=update_s,
                                               channel_fifo=channel_fifo), None)
    for name, merges in (("oasr merges", overlap_aware_merges),
                         ("mgwfbp merges", policies.startup_sharing_merges),
                         ("ddp buckets", policies.ddp_buckets),
                         ("wfbp", lambda _: ())):
        yield (name, 2 * T, lambda merges=merges: _layout(profile, whole, merges(profile), **kw), None)
    for size in block_sizes:
        for credit in credits:
            yield (f"fixed credit {credit} S={size}", units(plain(size), 1),
                   lambda size=size, credit=credit: dataclasses.replace(
                       plain(size), phase1_windows=(credit,) * T, phase2_windows=(credit,)), None)
    for size in block_sizes:
        for credit in credits:
            def hybrid(size=size, credit=credit) -> Plan:
                fixed = dataclasses.replace(plain(size), phase1_windows=(credit,) * T)
                return dataclasses.replace(fixed, phase2_windows=optimal_phase2_windows(fixed, profile,
                                                                                        update_s=update_s))
            yield f"credit {credit} + optimal phase 2 S={size}", units(plain(size), 2), hybrid, None
        yield (f"dcredit unpacked S={size}", units(plain(size), 4),
               lambda size=size: dcredit_windows(plain(size), profile, block_bytes=size, update_s=update_s,
                                               channel_fifo=channel_fifo), None)
    for size in _usbyte_units(block_sizes):
        model = _usbyte_model(profile, size, update_s)
        # Worth the order search only when the model's forward-order plan is close to the best.
        yield f"usbyte unit={size} (screen)", 3 * T, None, lambda model=model: model.run(list(range(T)))[0]

        def usbyte(size=size, model=model) -> Plan:
            plan = policies.usbyte(profile, block_bytes=size, channels=channels, update_s=update_s)
            return dataclasses.replace(plan, overlap_forward=plan.overlap_forward and overlap_forward,
                                       policy="dcredit")
        # US-Byte's order search runs its model once per tensor it may promote; a run visits
        # each tensor and message (about 3T: its events, its phase-1 and phase-2 messages).
        yield f"usbyte unit={size}", (T + 1) * T // 2, usbyte, None
    if not decouples(profile.world_size):
        return
    for size in _usbyte_units(block_sizes):
        yield (f"dear threshold={size}", 2 * T, lambda size=size: dataclasses.replace(
            policies.dear(profile, threshold_bytes=size, channels=channels), overlap_forward=overlap_forward,
            policy="dcredit"), None)
    for size in block_sizes:
        for which in ("all", "flush"):
            yield (f"dcredit decoupled ({which}) S={size}", units(packed(size), 6),
                   lambda size=size, which=which: _decoupled_dcredit(profile, packed(size), size, which, update_s,
                                                                     channel_fifo), None)


def decouples(world_size: int) -> bool:
    """Whether the search tries decoupled candidates for a profile of ``world_size`` ranks: not for one
    (Note [A world of one never decouples])."""
    return world_size > 1


def _decoupled_dcredit(profile: Profile, base: Plan, size: int, which: str, update_s: float,
                       channel_fifo: bool) -> Plan:
    """D-Credit's windows over ``base`` with decoupled blocks: every tensor's (``which="all"``), or those of the
    tensors whose blocks D-Credit's all-reduce plan leaves for the flush (``"flush"``; a merge whole)."""
    nonempty = [t for t in range(profile.num_tensors) if profile.tensors[t].numel]
    if which == "all":
        split = set(nonempty)
    else:
        table = block_table(base, profile)
        state = replay_phase1(base, profile, greedy=True, block_bytes=size, table=table)
        split = {t for b in state.remaining for t in table.layout[b][0]}
    decoupled = dataclasses.replace(base, decoupled=tuple(sorted(split)))
    return dcredit_windows(decoupled, profile, block_bytes=size, update_s=update_s, channel_fifo=channel_fifo)


def _usbyte_units(block_sizes: Sequence[int]) -> list[int]:
    return unit_grid(block_sizes, len(CREDITS))


def _usbyte_model(profile: Profile, size: int, update_s: float) -> _Model:
    return _Model(profile, size, update_s)


def search(profile: Profile, *, block_sizes: Sequence[int], channels: int = 1, update_s: float = 0.0,
           overlap_forward: bool = True, credits: Sequence[int] = CREDITS, budget: int | None = None,
           channel_fifo: bool = False, trace: list | None = None) -> Plan:
    """The fastest candidate (module docstring) in the simulator, within ``budget`` work units.

    ``channel_fifo`` is the simulator's network model the candidates are judged
    under (the runtime passes the calibrated one, ``planning.CHANNEL_FIFO``).
    The first candidate is always tried. Ties keep the earlier candidate.
    ``trace``, if given, receives ``(name, iteration_s)`` per candidate tried.
    """
    if not block_sizes:
        raise ValueError("the D-Credit search needs at least one block size")
    best, best_s, spent = None, math.inf, 0
    budget = budget_units(profile.num_tensors) if budget is None else budget
    skip = False
    for name, cost, make, screen in _candidates(profile, sorted(set(block_sizes)), credits, channels, update_s,
                                                overlap_forward, channel_fifo):
        if skip:  # the screen before this candidate found it far from the best
            skip = False
            continue
        if best is not None and spent + cost > budget:
            break
        spent += cost
        if screen is not None:
            skip = screen() > SCREEN_MARGIN * best_s
            continue
        plan = make()
        s = unchecked_iteration_time(plan, profile, update_s=update_s, channel_fifo=channel_fifo)
        if trace is not None:
            trace.append((name, s))
        if s < best_s * (1 - 1e-12):
            best, best_s = plan, s
    validate(best, numels=profile.numels, dtypes=profile.dtypes)
    return best


def budget_units(num_tensors: int) -> int:
    """The default budget: :data:`BUDGET_TENSOR_UNITS` divided by the number of tensors."""
    return BUDGET_TENSOR_UNITS // max(1, num_tensors)
