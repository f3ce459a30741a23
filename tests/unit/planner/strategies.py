"""Shared by the planner tests: Hypothesis strategies (profiles, arbitrary valid plans) and a seeded random profile."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import strategies as st

from dcredit_opt.planner.plan import ALL, Plan, validate
from dcredit_opt.planner.profile import RING_STAGE_RATIOS, Profile, TensorProfile, bytes_of

times = st.floats(min_value=0.0, max_value=2.0, allow_nan=False, allow_infinity=False)


@st.composite
def profiles(draw, max_tensors: int = 6, max_numel: int = 40, allow_empty: bool = True,
             dtypes: tuple[str, ...] = ("float32", "float16"), shuffled: bool = True,
             host_cost: bool = False) -> Profile:
    """``host_cost``: also draw ``host_s_per_collective`` (0 otherwise: the link-model formulas of the
    policies' own tests leave it out)."""
    T = draw(st.integers(1, max_tensors))
    tensors = tuple(
        TensorProfile(f"t{i}", draw(st.integers(0 if allow_empty else 1, max_numel)), draw(st.sampled_from(dtypes)),
                      i, draw(times), draw(times))
        for i in range(T))
    alpha = draw(st.just(0.0) | st.floats(0.0, 1.0))
    beta = draw(st.just(0.0) | st.floats(1e-4, 0.05))
    ready = draw(st.permutations(range(T))) if shuffled and draw(st.booleans()) else None
    ratios = draw(st.just(RING_STAGE_RATIOS) | st.tuples(*[st.floats(0.1, 2.0)] * 4))
    host = draw(st.just(0.0) | st.floats(0.0, 0.5)) if host_cost else 0.0
    return Profile(tensors, alpha, beta, 2, None if ready is None else tuple(ready), stage_ratios=ratios,
                   host_s_per_collective=host)


@st.composite
def plans_for(draw, profile: Profile) -> Plan:
    """Any plan the runtime accepts for ``profile``: random order, cuts, merges, decoupled tensors, windows,
    credit."""
    T = profile.num_tensors
    order = tuple(draw(st.permutations(range(T)))) if draw(st.booleans()) else profile.order()
    partition = []
    for t in profile.tensors:
        if t.numel == 0:
            partition.append(())
            continue
        cuts = sorted(draw(st.lists(st.integers(1, t.numel - 1), unique=True, max_size=3))) if t.numel > 1 else []
        bounds = [0, *cuts, t.numel]
        partition.append(tuple(b - a for a, b in itertools.pairwise(bounds)))
    merges, run = [], []
    for t in order:
        mergeable = len(partition[t]) == 1 and (not run or profile.tensors[t].dtype == profile.tensors[run[0]].dtype)
        if mergeable and draw(st.booleans()):
            run.append(t)
            continue
        if len(run) > 1:
            merges.append(tuple(run))
        run = [t] if len(partition[t]) == 1 else []
    if len(run) > 1:
        merges.append(tuple(run))
    # Decoupled tensors (Note [Two-stage blocks]): a merge whole or not at all.
    in_merge = {t: m for m in merges for t in m}
    decoupled = set()
    if draw(st.booleans()):
        for t in range(T):
            if partition[t] and t not in decoupled and draw(st.booleans()):
                decoupled.update(in_merge.get(t, (t,)))
    plan = Plan(
        numels=profile.numels,
        order=order,
        decoupled=tuple(sorted(decoupled)),
        partition=tuple(partition),
        merges=tuple(merges),
        priority=tuple(draw(st.permutations(range(T)))) if draw(st.booleans()) else None,
        phase1_windows=(None if draw(st.booleans())
                        else tuple(draw(st.sampled_from([ALL, 0, 1, 2, 3, 5])) for _ in range(T))),
        phase2_windows=tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))),
        credit_bytes=draw(st.just(0) | st.integers(1, 200)),
        channels=draw(st.integers(1, 3)),
        overlap_forward=draw(st.booleans()),
    )
    validate(plan, numels=profile.numels, dtypes=profile.dtypes)
    return plan


@st.composite
def profile_and_plan(draw, **kwargs) -> tuple[Profile, Plan]:
    profile = draw(profiles(**kwargs))
    return profile, draw(plans_for(profile))


def random_profile(seed: int, num_tensors: int, *, max_numel: int = 64, numel_multiple: int = 1,
                   allow_empty: bool = False, dtypes: tuple[str, ...] = ("float32",),
                   shuffle_ready: bool = False, comm_to_compute: float | None = None) -> Profile:
    """A small random profile, reproducible from ``seed``.

    Every numel is a multiple of ``numel_multiple`` (so that blocks of that
    many elements are all equal), at most ``max_numel``; ``allow_empty`` lets
    some be 0. Times are uniform in [0, 1) s. ``alpha`` and ``beta`` are drawn
    so that communicating everything costs about ``comm_to_compute`` times
    the compute (random in [0.1, 4) when ``None``), with alpha up to half of
    one tensor's backward.
    """
    rng = np.random.default_rng(seed)
    units = max(1, max_numel // numel_multiple)
    low = 0 if allow_empty else 1
    numels = [int(rng.integers(low, units + 1)) * numel_multiple for _ in range(num_tensors)]
    tensors = [
        TensorProfile(f"t{i}", numels[i], str(rng.choice(dtypes)), i,
                      float(rng.uniform(0, 1)), float(rng.uniform(0, 1)))
        for i in range(num_tensors)
    ]
    compute = sum(t.fwd_s + t.bwd_s for t in tensors)
    total = sum(t.numel * bytes_of(t.dtype) for t in tensors)
    ratio = float(rng.uniform(0.1, 4.0)) if comm_to_compute is None else comm_to_compute
    alpha = float(rng.uniform(0, 0.5))
    beta = ratio * compute / total if total else 0.0
    ready = None
    if shuffle_ready:
        ready = [int(x) for x in rng.permutation(num_tensors)]
    return Profile(tuple(tensors), alpha, beta, 2, ready)
