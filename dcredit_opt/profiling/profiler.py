"""Measuring the live job: per-tensor compute times and the network's alpha/beta.

During the first ``Config.profile_iters`` iterations the optimizer steps
eagerly (so a forward never includes waiting for gradients) and this module
records, per iteration, when each parameter is first read by a forward (the
forward pre-hook of the module that reads it first, Note [First read] in
``reads.py``), and when each gradient became ready (the scheduler's own
timestamps). Profiling ends after exactly ``profile_iters`` calls of
``step()``, whatever could be measured: every rank counts the same steps, so
every rank leaves profiling, measures the network and takes the plan at the
same ``step()`` (a parameter one rank never saw read just has no forward
time). Then every rank joins a short all-reduce sweep on the optimizer's
own channel 0 (and, where the policy may decouple blocks, a reduce-scatter
and an all-gather sweep, :func:`measure_stage_ratios`); rank 0 fits
alpha/beta, builds a :class:`~dcredit_opt.planner.profile.Profile`,
plans, and broadcasts the plan as JSON; every rank validates it and switches
at the same iteration. With profiling off the optimizer pays one ``if`` per
hook.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from ..config import Config
from ..errors import DCreditError
from ..planner.cost import fit_alpha_beta
from ..planner.plan import Plan, validate
from ..planner.profile import RING_STAGE_RATIOS, Profile, TensorProfile, canonical_dtype
from ..world import control, runtime
from .planning import make_plan

# A sweep from latency-bound to bandwidth-bound messages; 4 repeats each,
# median taken, so one slow outlier does not bend the fit.
SWEEP_BYTES = (1 << 12, 1 << 15, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
SWEEP_REPEATS = 4
# Reduce-scatter and all-gather: three sizes are enough for a line, from latency- to bandwidth-bound.
STAGE_SWEEP_BYTES = (1 << 16, 1 << 20, 1 << 24)
# A measured ratio outside this range is noise on a sweep of a few milliseconds, not a collective.
STAGE_RATIO_RANGE = (0.05, 20.0)
# Latency-bound all-reduces, this many back to back, three times (Note [Measured host cost]).
HOST_SWEEP_BYTES = 1 << 12
HOST_SWEEP_REPEATS = 8

# Note [Measured host cost]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# Where the blocks are reduced on the CPU, a collective's own work (the call, the backend's threads, the
# transport's system calls) runs on the cores the compute uses: CPU training keeps them busy (torch's
# intra-op threads default to every core, and ranks often share a host). What a collective costs the host
# there is the backend's and the machine's, not a constant: measured on the 2-core development machine
# with Gloo, the CPU this process spent per small blocking all-reduce was 36 us at one rank and 1.2-1.4 ms
# at two ranks over loopback (the wall time 2.4 ms). Planned with the fixed 20 us of
# ``Config.collective_host_s``, a ViT-like model of 78 tensors at two ranks took 8-9 collectives per
# iteration where DDP took 2: its Gloo threads used 5.3-7.1 ms of CPU per iteration against DDP's 2.0-2.2,
# and the iteration was 1.18-1.50x DDP's; charged 400 us per collective, the search took 2 and ran at
# 1.03-1.09x. So at the end of profiling every rank runs a few small all-reduces on channel 0 and reads the
# CPU time its whole process spent on them (``time.process_time``: every thread); rank 0 charges the larger
# of that and ``collective_host_s``. On a GPU the host's share of a collective is its launch, and the sweep
# would read the CPU spent waiting for the device: the configured value stays. ``collective_host_s=0`` (plan
# for the link alone) measures nothing.


class Recorder:
    """Timestamps of one optimizer's profiled iterations."""

    def __init__(self, names, params, iterations: int):
        self.names = list(names)
        self.params = list(params)
        self.iterations = iterations
        self.forward_start: list[dict[int, int]] = []  # per iteration: tensor -> ns of its module's first forward
        self.ready: list[list[int]] = []  # per iteration: tensor -> ns its gradient was ready
        self._current: dict[int, int] | None = None

    @property
    def done(self) -> bool:
        return len(self.ready) >= self.iterations

    def on_forward(self, tensors, now_ns: int | None = None) -> None:
        """``tensors`` are first read by a forward now (or at ``now_ns``)."""
        if self._current is None:
            self._current = {}
        now = time.perf_counter_ns() if now_ns is None else now_ns
        for t in tensors:
            self._current.setdefault(t, now)

    def on_step(self, ready_ns) -> None:
        """An iteration ended; ``ready_ns`` are the scheduler's per-tensor ready times.

        Every call counts towards ``done``, seen forward or not, so that the
        end of profiling is the same ``step()`` on every rank."""
        fwd, self._current = self._current or {}, None
        # The scheduler stamps with std::steady_clock and perf_counter_ns reads
        # the same CLOCK_MONOTONIC on Linux, so the two series compare directly.
        self.forward_start.append(fwd)
        self.ready.append(list(ready_ns))

    def compute_times(self) -> tuple[list[float], list[float], tuple[int, ...]]:
        """Median forward and backward seconds per tensor, and the measured ready order."""
        T = len(self.params)
        fwd_samples = [[] for _ in range(T)]
        bwd_samples = [[] for _ in range(T)]
        orders = []
        for fwd, ready in zip(self.forward_start, self.ready):
            by_start = sorted(fwd, key=lambda t: (fwd[t], t))  # tensors whose first read we saw
            starts = sorted(set(fwd.values()))
            order = tuple(sorted(range(T), key=lambda t: (ready[t], -t)))
            orders.append(order)
            first_ready = ready[order[0]]
            # The last module's forward, the loss and the first backward share
            # the gap to the first ready gradient; split it evenly.
            tail = max(0, first_ready - starts[-1]) / 2 if starts else 0
            next_start = {s: (starts[k + 1] if k + 1 < len(starts) else starts[-1] + tail)
                          for k, s in enumerate(starts)}
            charged = set()
            for t in by_start:
                s = fwd[t]
                fwd_samples[t].append(0.0 if s in charged else (next_start[s] - s) / 1e9)
                charged.add(s)
            prev = first_ready - tail
            for t in order:
                bwd_samples[t].append(max(0, ready[t] - prev) / 1e9)
                prev = ready[t]
        fwd_s = [statistics.median(s) if s else 0.0 for s in fwd_samples]
        bwd_s = [statistics.median(s) if s else 0.0 for s in bwd_samples]
        ready_order = statistics.mode(orders) if orders else tuple(reversed(range(T)))
        return fwd_s, bwd_s, ready_order


def measure_alpha_beta(allreduce, barrier, device: torch.device) -> tuple[float, float, list[tuple[int, float]]]:
    """All-reduce sweep with a backend's blocking ``allreduce(tensor)`` and ``barrier()`` (its
    ``sweep_collectives()``); returns (alpha_s, beta_s_per_byte, samples)."""
    samples = []
    for nbytes in SWEEP_BYTES:
        buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        samples.append((nbytes, _timed(allreduce, barrier, buf, device)))
    alpha, beta = fit_alpha_beta([s for s, _ in samples], [t for _, t in samples])
    return alpha, beta, samples


def measure_host_per_collective(allreduce, barrier) -> float:
    """CPU seconds this process spends per small blocking all-reduce on the CPU, every thread counted
    (Note [Measured host cost]): the median of three runs of ``HOST_SWEEP_REPEATS`` back to back. Every
    rank must call it (the all-reduces are collectives)."""
    buf = torch.zeros(HOST_SWEEP_BYTES // 4, dtype=torch.float32)
    return _timed(allreduce, barrier, buf, torch.device("cpu"), clock=time.process_time, calls=HOST_SWEEP_REPEATS,
                  repeats=3)


def _timed(collective, barrier, buf, device: torch.device, *, clock=None, calls: int = 1,
           repeats: int = SWEEP_REPEATS) -> float:
    """One collective's time: after a warm-up call, ``repeats`` runs of ``calls`` back to back, each after a
    barrier, read on ``clock`` (wall time, ``time.perf_counter``, unless given); the median run, per call."""
    clock = clock or time.perf_counter
    collective(buf)  # warm the connection and the allocator
    times = []
    for _ in range(repeats):
        barrier()
        t0 = clock()
        for _ in range(calls):
            collective(buf)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((clock() - t0) / calls)
    return statistics.median(times)


def measure_stage_ratios(stage_collectives, barrier, device: torch.device, world_size: int, alpha: float,
                         beta: float) -> tuple[float, float, float, float]:
    """``Profile.stage_ratios`` on the live job: a reduce-scatter sweep and an all-gather sweep with a
    backend's blocking ``(reduce_scatter(buf), all_gather(buf))`` (its ``stage_collectives()``; each over a
    flat buffer whose length is a multiple of the world size, the all-gather from the buffer's first shard),
    each fitted to a line and divided by the all-reduce's ``alpha``/``beta``. Backends differ far from the
    ring formula's halves (Gloo's reduce-scatter costs more than its all-reduce), and the planner decouples
    blocks only where this says it pays."""
    fitted = []
    for collective in stage_collectives:
        samples = []
        for nbytes in STAGE_SWEEP_BYTES:
            numel = max(1, nbytes // 4 // world_size) * world_size
            buf = torch.zeros(numel, dtype=torch.float32, device=device)
            samples.append((numel * 4, _timed(collective, barrier, buf, device)))
        fitted.append(fit_alpha_beta([s for s, _ in samples], [t for _, t in samples]))
    low, high = STAGE_RATIO_RANGE

    def ratio(stage: float, whole: float, ring: float) -> float:
        return min(high, max(low, stage / whole)) if whole > 0 else ring

    (rs_alpha, rs_beta), (ag_alpha, ag_beta) = fitted
    return (ratio(rs_alpha, alpha, RING_STAGE_RATIOS[0]), ratio(rs_beta, beta, RING_STAGE_RATIOS[1]),
            ratio(ag_alpha, alpha, RING_STAGE_RATIOS[2]), ratio(ag_beta, beta, RING_STAGE_RATIOS[3]))


def build_profile(recorder: Recorder, alpha: float, beta: float, world_size: int,
                  wire_dtypes: list | None = None, numels: list | None = None,
                  stage_ratios: tuple[float, float, float, float] = RING_STAGE_RATIOS,
                  host_s_per_collective: float = 0.0) -> Profile:
    """The profile of what was recorded. ``wire_dtypes`` (per tensor, Note [Wire dtype]) count the bytes that
    travel when every tensor has one dtype and one wire dtype (the planner merges by dtype, and a merge must
    stay within one buffer); otherwise each tensor counts in its own dtype. ``numels`` (default: the
    parameters') are the elements that travel in blocks (Note [Embedding rows]). ``stage_ratios``: what
    :func:`measure_stage_ratios` found, or the ring formula's. ``host_s_per_collective``: the host time one collective
    costs an iteration (``Config.collective_host_s``)."""
    fwd_s, bwd_s, order = recorder.compute_times()
    dtypes = [p.dtype for p in recorder.params]
    if wire_dtypes is not None and len(set(dtypes)) == 1 and len(set(wire_dtypes)) == 1:
        dtypes = list(wire_dtypes)
    numels = [p.numel() for p in recorder.params] if numels is None else numels
    tensors = [TensorProfile(name=n, numel=numels[i], dtype=canonical_dtype(d), forward_index=i,
                             fwd_s=fwd_s[i], bwd_s=bwd_s[i])
               for i, (n, d) in enumerate(zip(recorder.names, dtypes))]
    return Profile(tensors=tensors, alpha_s=alpha, beta_s_per_byte=beta, world_size=world_size,
                   ready_order=order, stage_ratios=tuple(stage_ratios),
                   host_s_per_collective=float(host_s_per_collective))


def agree_on_plan(recorder: Recorder, alpha: float, beta: float, config: Config,
                  params: list, wire_dtypes: list | None = None,
                  numels: list | None = None,
                  stage_ratios: tuple[float, float, float, float] = RING_STAGE_RATIOS,
                  plane=None, *, host_s_per_collective: float) -> tuple[Plan, Profile | None]:
    """The plan every rank switches to after profiling, and the profile (on rank 0; None elsewhere).

    Rank 0 builds the profile from its measurements and plans; the plan goes
    to every rank as JSON (never pickle). A failure on rank 0 goes out the
    same way, so that every rank raises instead of waiting for a plan.
    ``plane``: a process set's ranks (``process_sets``; rank 0 is its first), every rank by default.
    ``host_s_per_collective``: what rank 0 charges per collective (Note [Measured host cost]).
    """
    text, profile = None, None
    me, world = (runtime.rank(), runtime.size()) if plane is None else (plane.rank, plane.size)
    if me == 0:
        try:
            profile = build_profile(recorder, alpha, beta, world, wire_dtypes, numels, stage_ratios,
                                    host_s_per_collective)
            plan = make_plan(profile, config.policy, channels=config.channels, overlap_forward=config.overlap_forward)
            validate(plan, numels=numels or [p.numel() for p in params], max_channels=config.channels,
                     dtypes=[p.dtype for p in params])
            text = plan.to_json()
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, or the others would wait
            text = json.dumps({"error": f"{type(e).__name__}: {e}"})
    data = json.loads(control.broadcast_text(text, 0, plane=plane))
    if "error" in data:
        raise DCreditError(f"rank 0 could not plan with policy {config.policy!r}: {data['error']}")
    return Plan.from_dict(data), profile
