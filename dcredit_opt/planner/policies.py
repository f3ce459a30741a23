"""Every scheduling policy as a function ``profile -> Plan``, and a registry.

The baselines are plans for the same runtime as D-Credit, so that all of
them are compared on equal terms (DESIGN.md section 4): they differ only in
how gradients are cut or merged, in priority, in the windows, and in whether
``step()`` waits (``overlap_forward``). See ``plan.py`` for what each field
makes the runtime do, and Note [Group window] in ``simulate.py``.

DeAR is its own collectives: every tensor reduce-scattered in backward and
all-gathered during the next forward (``Plan.decoupled``).

DeFT (``deft.py``) is registered apart (:data:`RESULT_CHANGING`): its speed
comes from delayed updates (a layer's update uses the gradient of the
previous iteration), which changes what is trained; Invariant 3 of
DESIGN.md lets the runtime run it only when the user accepts that.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from .dcredit import DEFAULT_BLOCK_BYTES, dcredit, partition_by_bytes
from .deft import deft
from .oasr import overlap_aware_merges
from .plan import ALL, POLICY_NAMES, Plan
from .profile import Profile
from .simulate import event_times, simulate
from .usbyte import unit_grid, usbyte

DDP_BUCKET_CAP_BYTES = 25 << 20
"""PyTorch DDP's ``bucket_cap_mb`` default."""
DDP_FIRST_BUCKET_BYTES = 1 << 20
"""PyTorch DDP's first bucket: small, so that the first all-reduce starts early in backward."""


def _whole_tensors(profile: Profile) -> tuple[tuple[int, ...], ...]:
    """One block per tensor; a tensor without elements has no block."""
    return tuple((t.numel,) if t.numel else () for t in profile.tensors)


def _send_as_ready(profile: Profile, policy: str, *, merges: Sequence[Sequence[int]] = (),
                   overlap_forward: bool = False, channels: int = 1, decoupled: bool = False) -> Plan:
    """Whole tensors (or merges) released as soon as they are ready: ALL at every event.

    A group released with ALL has as window the blocks it took (Note [Group
    window]); each event here releases at most one block, so collectives run
    one after another in ready order, as on one NCCL stream or Gloo process
    group. Nothing is left for the flush, so the phase-2 window is never used;
    unless every tensor is ``decoupled``: then the flush releases their
    all-gathers, one at a time (window 1), in priority order.
    """
    T = profile.num_tensors
    return Plan(
        numels=profile.numels,
        order=profile.order(),
        partition=_whole_tensors(profile),
        merges=tuple(tuple(m) for m in merges if len(m) > 1),
        phase1_windows=(ALL,) * T,
        phase2_windows=(1,) if decoupled else (max(1, T),),
        decoupled=tuple(t for t in range(T) if profile.tensors[t].numel) if decoupled else (),
        channels=channels,
        overlap_forward=overlap_forward,
        policy=policy,
    )


def wfbp(profile: Profile, *, channels: int = 1) -> Plan:
    """Wait-free backpropagation: each gradient all-reduced alone as soon as it is ready; step() waits."""
    return _send_as_ready(profile, "wfbp", channels=channels)


def ddp_buckets(profile: Profile, *, bucket_cap_bytes: int = DDP_BUCKET_CAP_BYTES,
                first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES) -> list[list[int]]:
    """DDP-style buckets: neighbours in ready order, one dtype, at most the cap.

    The first bucket is capped at ``first_bucket_bytes``, later ones at
    ``bucket_cap_bytes``; a tensor larger than the cap is a bucket alone.
    (DDP itself closes a bucket once it *reaches* the cap, so its buckets
    may exceed it by one tensor; here the cap is never exceeded.) A tensor
    without elements has no block and so ends the bucket being filled, since
    a merge must be a run of neighbours with one block each.
    """
    if bucket_cap_bytes <= 0 or first_bucket_bytes <= 0:
        raise ValueError("bucket caps must be positive")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for t in profile.order():
        tensor = profile.tensors[t]
        if tensor.numel == 0:
            if current:
                buckets.append(current)
            current, filled = [], 0
            continue
        cap = first_bucket_bytes if not buckets else bucket_cap_bytes
        if current and (tensor.dtype != profile.tensors[current[0]].dtype or filled + tensor.nbytes > cap):
            buckets.append(current)
            current, filled = [], 0
        current.append(t)
        filled += tensor.nbytes
    if current:
        buckets.append(current)
    return buckets


def ddp(profile: Profile, *, bucket_cap_bytes: int = DDP_BUCKET_CAP_BYTES,
        first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES, channels: int = 1) -> Plan:
    """PyTorch-DDP-style buckets (:func:`ddp_buckets`), each all-reduced when complete; step() waits."""
    buckets = ddp_buckets(profile, bucket_cap_bytes=bucket_cap_bytes, first_bucket_bytes=first_bucket_bytes)
    return _send_as_ready(profile, "ddp", merges=buckets, channels=channels)


def startup_sharing_merges(profile: Profile) -> list[list[int]]:
    """MG-WFBP merging: join the next gradient when waiting for it costs less than a start-up.

    Model: collectives run one after another on the link; a group could
    start at ``s = max(its last gradient's event, link free)``. Sending it
    now and the next gradient (ready at ``r``) separately ends no earlier
    than ``s + 2*alpha + beta*(both)``; waiting and sending both together
    ends at ``max(r, s) + alpha + beta*(both)``. Merging is better exactly
    when ``r < s + alpha``. The decision is greedy, one neighbour at a time,
    in ready order; dtypes are not mixed and tensors without elements end a
    group (they have no block to merge).
    """
    alpha, beta = profile.alpha_s, profile.beta_s_per_byte
    order = profile.order()
    events = event_times(profile)
    groups: list[list[int]] = []
    current: list[int] = []
    start = free = 0.0

    def close() -> None:
        nonlocal current, free
        if current:
            free = start + alpha + beta * sum(profile.tensors[u].nbytes for u in current)
            groups.append(current)
            current = []

    for i, t in enumerate(order):
        tensor = profile.tensors[t]
        if tensor.numel == 0:
            close()
            continue
        same_dtype = bool(current) and tensor.dtype == profile.tensors[current[0]].dtype
        if not (same_dtype and events[i] < start + alpha):
            close()
        current.append(t)
        start = max(events[i], free)
    close()
    return groups


def mgwfbp(profile: Profile, *, channels: int = 1) -> Plan:
    """WFBP with start-up sharing merges (:func:`startup_sharing_merges`); step() waits."""
    return _send_as_ready(profile, "mgwfbp", merges=startup_sharing_merges(profile), channels=channels)


def oasr(profile: Profile, *, channels: int = 1) -> Plan:
    """OASR-WFBP: whole tensors merged where the overlap-aware model says so (:mod:`.oasr`); step() waits.

    Unlike MG-WFBP's greedy rule, the merges minimise the end of the whole
    backward's communication (an exact dynamic programme), so a merge is
    made or refused by what it does to every later collective's overlap.
    """
    return _send_as_ready(profile, "oasr", merges=overlap_aware_merges(profile), channels=channels)


def bytescheduler(profile: Profile, *, block_bytes: int = DEFAULT_BLOCK_BYTES, credit_blocks: int = 4,
                  channels: int = 1) -> Plan:
    """ByteScheduler: equal blocks, priority by forward index, one fixed credit of ``credit_blocks``.

    The credit is a window: at every event and at the flush up to
    ``credit_blocks`` blocks are released, each group with that window, so
    at most ``credit_blocks`` are ever in flight. With equal blocks this is
    ByteScheduler's byte credit of ``credit_blocks * block_bytes``. Blocks
    left in the heap can be overtaken by higher-priority gradients (its
    preemption between blocks). Unlike ByteScheduler, which launches
    whenever credit returns, the runtime decides only at events (Note
    [Same order on every rank]), so at most ``credit_blocks`` are released
    per event.
    """
    if credit_blocks < 1:
        raise ValueError(f"credit_blocks must be >= 1, got {credit_blocks}")
    return Plan(
        numels=profile.numels,
        order=profile.order(),
        partition=partition_by_bytes(profile, block_bytes),
        phase1_windows=(credit_blocks,) * profile.num_tensors,
        phase2_windows=(credit_blocks,),
        channels=channels,
        overlap_forward=True,
        policy="bytescheduler",
    )


def tune_bytescheduler(profile: Profile, *, block_sizes: Sequence[int] | None = None,
                       credits: Sequence[int] = (1, 2, 4, 8, 16), channels: int = 1,
                       update_s: float = 0.0, channel_fifo: bool = False) -> Plan:
    """The ByteScheduler plan with the shortest simulated iteration over ``block_sizes x credits``.

    ByteScheduler tunes its partition size and credit online (Bayesian
    optimisation); a grid over the simulator is the offline equivalent.
    Default sizes: powers of two from the largest tensor down by a factor of
    up to 1024. Ties keep the first (smallest block, then smallest credit).
    """
    sizes = _block_size_grid(profile, step=1) if block_sizes is None else block_sizes
    return _fastest(profile, update_s, "tune_bytescheduler",
                    (bytescheduler(profile, block_bytes=size, credit_blocks=credit, channels=channels)
                     for size in sizes for credit in credits), channel_fifo)


def tune_dcredit(profile: Profile, *, block_sizes: Sequence[int] | None = None, channels: int = 1,
                 update_s: float = 0.0, channel_fifo: bool = False) -> Plan:
    """The D-Credit plan with the shortest simulated iteration over ``block_sizes``.

    D-Credit chooses its windows itself; the block size is the one free
    parameter, searched like ByteScheduler's so that the two are compared on
    equal terms. Default sizes: powers of four from the largest tensor down
    by up to 1024.
    """
    sizes = _block_size_grid(profile, step=2) if block_sizes is None else block_sizes
    return _fastest(profile, update_s, "tune_dcredit",
                    (dcredit(profile, block_bytes=size, channels=channels, update_s=update_s) for size in sizes),
                    channel_fifo)


def _block_size_grid(profile: Profile, step: int) -> list[int]:
    """Powers of ``2**step`` bytes from the largest tensor (rounded up) down by up to 1024, ascending."""
    largest = max((t.nbytes for t in profile.tensors), default=1)
    top = 1 << max(0, math.ceil(math.log2(max(largest, 1))))
    return sorted({max(1, top >> k) for k in range(0, 11, step)})


def _fastest(profile: Profile, update_s: float, who: str, plans, channel_fifo: bool = False) -> Plan:
    """The first of ``plans`` with the shortest simulated iteration (under ``channel_fifo``'s network model)."""
    best, best_s = None, math.inf
    for plan in plans:
        s = simulate(plan, profile, update_s=update_s, channel_fifo=channel_fifo).iteration_s
        if s < best_s:
            best, best_s = plan, s
    if best is None:
        raise ValueError(f"{who} needs at least one candidate (block size, credit)")
    return best


def tune_usbyte(profile: Profile, *, block_sizes: Sequence[int] | None = None, per_octave: int = 5,
                channels: int = 1, update_s: float = 0.0, channel_fifo: bool = False) -> Plan:
    """The US-Byte plan (:mod:`.usbyte`) with the shortest simulated iteration over its unit size.

    Tuned with ByteScheduler's budget: ByteScheduler tries ``len(block_sizes)``
    sizes times its 5 credits; US-Byte has no credit (it sizes each message
    itself), so it tries as many unit sizes over the same range,
    ``per_octave`` per factor of two (:func:`.usbyte.unit_grid`). Default sizes:
    ByteScheduler's default grid.
    """
    sizes = _block_size_grid(profile, step=1) if block_sizes is None else block_sizes
    return _fastest(profile, update_s, "tune_usbyte",
                    (usbyte(profile, block_bytes=size, channels=channels, update_s=update_s)
                     for size in unit_grid(sizes, per_octave)), channel_fifo)


DEAR_THRESHOLD_BYTES = 25 << 20
"""DeAR's fusion buffer threshold before tuning (25 MB, its published default)."""


def dear_groups(profile: Profile, threshold_bytes: int = DEAR_THRESHOLD_BYTES) -> list[list[int]]:
    """DeAR's tensor fusion: tensors in forward order, a group closed before the tensor that would make it
    reach ``threshold_bytes`` (a tensor that alone reaches it is a group alone).

    DeAR fills fusion buffers from the input side, so the group left short is
    the output side's, the first reduced in backward. Groups are runs of
    neighbours in the ready order walked backwards (forward order when
    gradients are ready in reverse forward order), returned in ready order
    so that each is a valid merge; dtypes are not mixed and a tensor without
    elements ends a group.
    """
    if threshold_bytes <= 0:
        raise ValueError(f"threshold_bytes must be positive, got {threshold_bytes}")
    groups: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for t in reversed(profile.order()):
        tensor = profile.tensors[t]
        if tensor.numel == 0 or (current and (tensor.dtype != profile.tensors[current[0]].dtype
                                               or filled + tensor.nbytes >= threshold_bytes)):
            if current:
                groups.append(current[::-1])
            current, filled = [], 0
        if tensor.numel:
            current.append(t)
            filled += tensor.nbytes
    if current:
        groups.append(current[::-1])
    return groups[::-1]


def dear(profile: Profile, *, threshold_bytes: int = DEAR_THRESHOLD_BYTES, channels: int = 1) -> Plan:
    """DeAR: each fusion group (:func:`dear_groups`) reduce-scattered in backward as soon as its last gradient
    is ready, and all-gathered group by group in forward order while the next forward runs.

    Every tensor is decoupled (``Plan.decoupled``): a group's reduce-scatter
    is released at its event (ALL: one at a time on the link, as on DeAR's
    one communication stream) and its all-gather waits for the flush
    (``step()``). Phase-2 windows of one launch the all-gathers one after
    another, the first once every reduce-scatter has finished (DeAR's barrier
    at the end of backward), each next one as the previous completes, which
    is when DeAR's forward hook of a group starts the next group's all-gather.
    Each layer's forward waits for its own group (``overlap_forward=True``),
    and its update is applied then (the lazy step).
    """
    return _send_as_ready(profile, "dear", merges=dear_groups(profile, threshold_bytes), overlap_forward=True,
                          channels=channels, decoupled=True)


def tune_dear(profile: Profile, *, block_sizes: Sequence[int] | None = None, per_octave: int = 5,
              channels: int = 1, update_s: float = 0.0, channel_fifo: bool = False) -> Plan:
    """The DeAR plan with the shortest simulated iteration over its fusion threshold.

    DeAR tunes the threshold online (Bayesian optimisation); the offline
    equivalent is a grid over the simulator, with ByteScheduler's budget as
    US-Byte has it (:func:`tune_usbyte`): ``per_octave`` thresholds per factor
    of two over ``block_sizes`` (default: ByteScheduler's grid).
    """
    sizes = _block_size_grid(profile, step=1) if block_sizes is None else block_sizes
    # Thresholds that make the same groups make the same plan: each plan is simulated once.
    plans = dict.fromkeys(dear(profile, threshold_bytes=size, channels=channels) for size in unit_grid(sizes, per_octave))
    return _fastest(profile, update_s, "tune_dear", plans, channel_fifo)


POLICIES: dict[str, Callable[..., Plan]] = {
    "wfbp": wfbp,
    "ddp": ddp,
    "mgwfbp": mgwfbp,
    "oasr": oasr,
    "bytescheduler": bytescheduler,
    "usbyte": usbyte,
    "dear": dear,
    "dcredit": dcredit,
}
RESULT_CHANGING: dict[str, Callable[..., Plan]] = {"deft": deft}
"""Policies whose plans do not train like synchronous data parallelism: never a baseline the D-Credit
search adopts, never compared as if equal."""
assert set(POLICIES) | set(RESULT_CHANGING) == set(POLICY_NAMES), "plan.POLICY_NAMES names each policy, once"


def make_plan(profile: Profile, policy: str, **kwargs) -> Plan:
    """``POLICIES[policy](profile, **kwargs)``, with a clear error for an unknown name."""
    if policy in RESULT_CHANGING:
        return RESULT_CHANGING[policy](profile, **kwargs)
    if policy not in POLICIES:
        known = ", ".join(sorted([*POLICIES, *RESULT_CHANGING]))
        raise ValueError(f"unknown policy {policy!r}; known policies: {known}")
    return POLICIES[policy](profile, **kwargs)
