"""Adaptive re-planning, the pure part: what the blocks' own timings say about the link and the compute,
whether that moved for long enough to re-plan, and the profile to re-plan with.

How it works
------------
The first plan is made from a profile measured in the first iterations. While
training, each rank watches two things it already has, on a few iterations of
every check window (``Config.replan_every`` steps):

- the link: the scheduler's trace (per block its launch and end), merged into
  busy periods (the union of overlapping ``[launch, end]`` intervals, any
  channel). A period of ``c`` collectives carrying ``b`` bytes in ``s`` seconds
  is one sample ``(b / c, s / c)`` of the per-collective cost; the window's
  samples are fitted to ``alpha + beta * bytes`` (:func:`.cost.fit_alpha_beta`)
  when their sizes spread by at least :data:`SIZE_SPREAD` (otherwise the
  baseline's link is all per byte), and the link time now is compared with
  what the baseline's fit predicts for the same traffic; the change is
  carried by the profile's ``beta``, priced with the profile's own alpha
  (:func:`link_estimate` and :func:`beta_scale` say why);
- the compute: the backward, as a scale on every tensor's forward and
  backward time. A forward and a backward of the same layers change together
  (a longer sequence, a bigger batch, a slower core), and the backward is the
  part measured without any communication wait in it. Where the backward runs
  on the thread that calls ``step()`` (a model on the CPU), it is read as that
  thread's CPU time from the iteration's first gradient to its ``step()``
  (``Window.cpu_s``); elsewhere (a device, whose kernels the host only
  launches) as the span from the first gradient ready to the last (the
  scheduler's ready times, ``Window.span_s``). Note [Compute in CPU time].

Neither is compared with the profile: the measurements depend on the plan
(concurrent collectives, a lazy step's CPU use), so each plan's first check
window is its *baseline*, gathered from every rank, and later windows are
compared with that baseline. A ratio of two measurements taken the same way
cancels the estimator's own bias, so an unchanged world reads 1.0. The
compute is compared with the windows the profile's compute was last set to,
across plan switches, so that a change between a re-plan and the new plan's
baseline is not taken into it (Note [Compute across a switch]). Where the profile was
measured while other jobs held the cores, its compute is brought down to within the threshold of its CPU time
once, at the first baseline (Note [Profiled under load]).

Every rank sends its window (:class:`Window`, a vector of numbers) to every rank; every rank
computes the same :class:`Estimate` from the gathered lists
(:func:`combine`): the job's compute is its slowest rank's (synchronous
training waits for it), and its link the rank that measured the *least*
slow-down (a collective cannot end before its last rank joins it, so a rank
waiting for a slower peer measures the peer, not the link).
:class:`Hysteresis` then says whether an estimate moved by more than the
threshold for ``patience`` checks in a row; only then does rank 0 plan on the
rescaled profile (:func:`rescale`), and the fresh plan replaces the current
one only if the simulator predicts it faster, under the same new profile, by
more than the threshold (:func:`worth_switching`). Either way the rescaled
profile becomes the current one and the window becomes the new baseline and reference, so a
change is acted on once, and a world that flips back is a new change.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

from .cost import fit_alpha_beta
from .profile import Profile

# Note [Compute in CPU time]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# On a CPU the backward shares the cores with whatever else runs there: the
# job's own communication threads and, on a shared machine, other jobs. Read
# in wall time, its span moves with their load, which comes and goes faster
# than a check window: measured on 2 shared cores (benchmarks/results/
# 2026-11-27-p2-adaptive.md), VGG-like's backward span fell from 1281 ms to
# 854 ms across a doubling of its batch, as the machine's load fell from 17;
# the doubling was never seen, and checks triggered on load alone. The CPU
# time of the thread that runs the backward counts only the work it does: it
# doubles with the batch and stays put when other threads take the cores. So
# there the compute is read in that thread's CPU time, from the iteration's
# first gradient (the backward's start, where the iteration opens) to its
# step(): the same work every iteration apart from the model's. What it does
# not see is a core that became slower for everyone (a lower clock, a noisy
# neighbour that stays): a plan tuned for the work is still the plan for it,
# and the link's estimate, read in wall time, sees what the neighbour does to
# the collectives. A device's backward is kernels the host only launches: there
# the wall-time span of the ready times stays the estimate.

# Note [Compute across a switch]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A new plan's first check window is its baseline, because what the link
# measures depends on the plan. A change that happens between the decision
# and that window would be taken into the baseline and never seen: measured,
# a re-plan on noise 3 iterations before VGG-like's batch went from 16 to 64
# made a baseline of the new batch, and the plan for batch 16 stayed
# (benchmarks/results/2026-11-27-p2-compute-x4-2.md, round 0). The compute,
# read in CPU time (Note [Compute in CPU time]), is the model's work, not the
# plan's: so it is compared with the *reference*, the windows the profile's
# compute was last set to (the first baseline, then each check that
# re-planned, kept or switched), across plan switches, and already at a new
# plan's baseline check, where the link has nothing to be compared with yet.

# Note [Profiled under load]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# The profile's compute is wall time (profiler.py: the gaps between ready
# gradients), and every later estimate of the compute is a ratio against the
# first baseline: a ratio cancels the estimator's bias, not the profile's. A
# profile measured while other jobs held the cores kept their load in its
# level for good: measured, one profile of 11 read the backward at 555 ms of
# wall time where the quiet ones read 250-369 ms and the reference window 241
# ms of CPU, and under that compute every plan hid the link, so the plan for a
# 250 Mbit/s link was kept at 1 Gbit/s
# (benchmarks/results/2026-11-28-p2-link-freed-analysis.md). So where the
# compute is read in CPU time (Note [Compute in CPU time]), the profiled
# iterations are read both ways: the wall-time span of their ready gradients,
# which the profile's compute comes from, and the training thread's CPU time
# over the same backward, as a window reads it. Where the wall time exceeds
# the CPU time by more than the threshold, the thread waited for cores, and at
# the first baseline rank 0 scales the profile's compute down to the
# threshold's edge: by (1 + threshold) CPU over wall (:func:`profile_level`).
# Not down to the CPU time itself: some wall time above it is the job's own
# (its communication threads share the cores in every iteration, not only the
# profile's: the quiet profiles above read up to 1.5x the reference window's
# CPU time), the scale is continuous where the correction starts, and a
# profile within the threshold stays as measured. Never up: the CPU time runs
# on to step(), a little past the last gradient, so the correction errs small.
# Only rank 0's planning input changes: every rank decides the same things at
# the same steps, and the plan in force is judged on the corrected level at
# the next decision to re-plan. On a device the span stays the estimate and
# the profile as measured, and so it stays where the backward runs on several
# intra-op threads: the training thread's CPU time is then its share of the
# work, and it also waits for the other threads, so wall time beyond it is not
# a wait for cores.

SIZE_SPREAD = 2.0
"""A window's per-collective sizes must span at least this factor (largest over smallest) for a fit of both
alpha and beta; below it only beta is scaled (the intercept is not identifiable from one size)."""

RATIO_RANGE = (1 / 16, 16.0)
"""Scales outside this range are a broken measurement (a stall, a clock jump), not a link or a model: clamped."""


# ---- one rank's measurements -------------------------------------------------------------------------------


def busy_periods(rows: Sequence[Sequence[int]], block_bytes: Sequence[int]) -> list[tuple[int, int, float]]:
    """``(collectives, bytes, seconds)`` of each busy period of one iteration's trace.

    ``rows`` are ``Engine.trace()`` tuples ``(block, channel, window, group, seq, release_ns, launch_ns,
    end_ns)``; blocks not launched or not finished are left out. A period is a maximal union of
    overlapping ``[launch, end]`` intervals, over every channel.
    """
    spans = sorted((r[6], r[7], int(block_bytes[r[0]])) for r in rows if r[6] and r[7] and r[7] >= r[6])
    out: list[tuple[int, int, float]] = []
    start = end = None
    count = nbytes = 0
    for launch, finish, b in spans:
        if end is not None and launch <= end:
            end = max(end, finish)
            count += 1
            nbytes += b
            continue
        if end is not None:
            out.append((count, nbytes, (end - start) / 1e9))
        start, end, count, nbytes = launch, finish, 1, b
    if end is not None:
        out.append((count, nbytes, (end - start) / 1e9))
    return out


def backward_span(ready_ns: Sequence[int]) -> float | None:
    """Seconds from the first gradient ready to the last (None with fewer than two)."""
    ready = [t for t in ready_ns if t > 0]
    if len(ready) < 2:
        return None
    return (max(ready) - min(ready)) / 1e9


@dataclasses.dataclass(frozen=True)
class Window:
    """One rank's measurements over one check window, per observed iteration: what it sends to the others."""

    iterations: int
    """Iterations observed."""
    span_s: float | None
    """Median backward span (first gradient ready to last), seconds; None if none was seen."""
    busy_s: float
    """Link busy time per iteration (the union of the blocks' ``[launch, end]``), seconds."""
    collectives: float
    """Collectives per iteration."""
    nbytes: float
    """Bytes per iteration."""
    alpha_s: float | None
    """Fitted per-collective start-up, seconds; None where the sizes did not spread (:data:`SIZE_SPREAD`)."""
    beta_s_per_byte: float | None
    """Fitted per-collective seconds per byte; None with ``alpha_s``."""
    cpu_s: float | None = None
    """Median CPU time of the thread that ran the backward, from the iteration's first gradient to its
    ``step()``, seconds; None where it was not read (Note [Compute in CPU time])."""

    @staticmethod
    def to_vector(window: Window | None) -> list[float]:
        """``window`` as :data:`VECTOR_SIZE` floats, its fields in order, NaN for None; None (nothing observed) as
        zero iterations. What a check gathers: a fixed size, so one collective carries it, started without
        waiting (Note [The check in flight] in profiling/replanner.py). Exact: every field is a float64."""
        if window is None:
            return [0.0] + [math.nan] * (VECTOR_SIZE - 1)
        return [math.nan if v is None else float(v) for v in dataclasses.astuple(window)]

    @classmethod
    def from_vector(cls, values) -> Window | None:
        """The window :meth:`to_vector` gave (None for zero iterations); a ValueError for a vector of another
        size or a negative or fractional iteration count."""
        values = [float(v) for v in values]
        if len(values) != VECTOR_SIZE:
            raise ValueError(f"a re-planning window's vector has {VECTOR_SIZE} numbers, got {len(values)}")
        n = values[0]
        if not (n >= 0 and n == int(n)):
            raise ValueError(f"a re-planning window's iteration count must be a whole number >= 0, got {n!r}")
        if n == 0:
            return None
        fields = [None if math.isnan(v) else v for v in values[1:]]
        return cls(int(n), *fields)


VECTOR_SIZE = len(dataclasses.fields(Window))
"""Numbers in a window's vector (:meth:`Window.to_vector`)."""


class WindowRecorder:
    """Collects one rank's observed iterations; :meth:`take` closes the window and starts the next."""

    def __init__(self) -> None:
        self._periods: list[tuple[int, int, float]] = []
        self._spans: list[float] = []
        self._cpu: list[float] = []
        self._iterations = 0

    @property
    def iterations(self) -> int:
        return self._iterations

    def add(self, rows: Sequence[Sequence[int]], block_bytes: Sequence[int], ready_ns: Sequence[int],
            cpu_s: float | None = None) -> None:
        """One finished iteration: its trace rows, each block's bytes, each tensor's ready time, and the CPU
        seconds of its backward where they were read (Note [Compute in CPU time])."""
        self._periods += busy_periods(rows, block_bytes)
        span = backward_span(ready_ns)
        if span is not None:
            self._spans.append(span)
        if cpu_s is not None and cpu_s > 0:
            self._cpu.append(cpu_s)
        self._iterations += 1

    def take(self) -> Window | None:
        """The window so far (None if nothing was observed), and a fresh start."""
        periods, spans, cpu, n = self._periods, self._spans, self._cpu, self._iterations
        self._periods, self._spans, self._cpu, self._iterations = [], [], [], 0
        if n == 0:
            return None
        alpha = beta = None
        if periods:
            x = [b / c for c, b, _ in periods]
            y = [s / c for c, _, s in periods]
            lo, hi = min(x), max(x)
            if lo > 0 and hi >= SIZE_SPREAD * lo:
                a, b = fit_alpha_beta(x, y)
                if b > 0:
                    alpha, beta = a, b
        return Window(iterations=n, span_s=statistics.median(spans) if spans else None,
                      busy_s=sum(s for _, _, s in periods) / n, collectives=sum(c for c, _, _ in periods) / n,
                      nbytes=sum(b for _, b, _ in periods) / n, alpha_s=alpha, beta_s_per_byte=beta,
                      cpu_s=statistics.median(cpu) if cpu else None)


# ---- the job's estimate, the same on every rank ------------------------------------------------------------


def _clamp(x: float) -> float:
    lo, hi = RATIO_RANGE
    return min(hi, max(lo, x))


def link_estimate(base: Window, now: Window) -> tuple[float, float] | None:
    """``(link_scale, beta_scale)`` of one rank: ``now`` against its ``base`` window.

    ``link_scale`` is the link time measured now over the link time the baseline's fit predicts for the same
    traffic (so a plan's changing mix of sizes does not read as a change). ``beta_scale`` is the scale on
    the per-byte time that explains it with the start-up left as it was: the fitted intercept and slope of
    one job's mix trade off against each other within the noise (an unchanged link read alpha x4.9 and beta
    x0.4 on a busy machine) while their sum over the traffic stays put, and a change of rate, the common
    change, is a change of beta. None where a window carried nothing.
    """
    if base.nbytes <= 0 or now.nbytes <= 0 or base.busy_s <= 0 or now.busy_s <= 0:
        return None
    if base.alpha_s is not None:
        a_b, b_b = base.alpha_s, base.beta_s_per_byte
    else:
        a_b, b_b = 0.0, base.busy_s / base.nbytes
    predicted = a_b * now.collectives + b_b * now.nbytes
    if predicted <= 0:
        return None
    scale = _clamp(now.busy_s / predicted)
    per_byte = (scale * predicted - a_b * now.collectives) / (b_b * now.nbytes)
    return scale, _clamp(max(per_byte, 0.0))


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What moved since the baseline, for the whole job: scales (1.0 = unchanged)."""

    compute: float
    """Backward now over the baseline's, of the slowest rank (each side): in CPU time where every window
    carries it, else the wall-time span (Note [Compute in CPU time])."""
    link: float
    """Link time now over the baseline's prediction for the same traffic."""
    beta: float
    """Scale of the all-reduce time per byte that explains ``link`` with the baseline window's fitted start-up
    unchanged (:func:`link_estimate`); :func:`rescale` uses it only where the estimate carries no traffic."""
    link_rank: int
    """The rank whose link measurement was taken (the least slowed)."""
    span_s: tuple[float, float]
    """The job's backward, baseline and now, seconds (for messages)."""
    traffic: tuple[float, float] = (0.0, 0.0)
    """What the link rank's window carried per iteration now: collectives and bytes (:func:`rescale` prices
    the link's change on them with the profile's own alpha and beta)."""
    cpu: bool = False
    """Whether ``compute`` and ``span_s`` were read in CPU time."""


def combine(base: Sequence[Window | None] | None, now: Sequence[Window | None],
            reference: Sequence[Window | None] | None = None) -> Estimate | None:
    """The job's estimate from every rank's baseline and current window (rank order), or None where some rank
    observed nothing. A pure function of the gathered windows: every rank computes the same.

    The link is compared with ``base``, the plan's own baseline (None: the plan has none yet, and the link
    reads unchanged); the compute with ``reference`` where given (the windows the profile's compute stands
    for: Note [Compute across a switch]), else with ``base``."""
    reference = base if reference is None else reference
    if reference is None or len(reference) != len(now) or not now or any(w is None for w in (*reference, *now)):
        return None
    if base is not None and (len(base) != len(now) or any(w is None for w in base)):
        return None
    cpu = all(w.cpu_s is not None for w in (*reference, *now))
    spans_b = [w.cpu_s if cpu else w.span_s for w in reference]
    spans_n = [w.cpu_s if cpu else w.span_s for w in now]
    if any(s is None for s in (*spans_b, *spans_n)) or max(spans_b) <= 0:
        compute, span = 1.0, (0.0, 0.0)
    else:
        compute, span = _clamp(max(spans_n) / max(spans_b)), (max(spans_b), max(spans_n))
    links = [] if base is None else [(r, link_estimate(b, n)) for r, (b, n) in enumerate(zip(base, now))]
    links = [(est[0], r, est) for r, est in links if est is not None]
    if links:
        _, rank, (link, beta) = min(links)
        traffic = (now[rank].collectives, now[rank].nbytes)
    else:  # nothing travelled (a world of one, every gradient unused) or no baseline yet: only the compute
        rank, link, beta, traffic = -1, 1.0, 1.0, (0.0, 0.0)
    return Estimate(compute=compute, link=link, beta=beta, link_rank=rank, span_s=span, traffic=traffic, cpu=cpu)


def moved(estimate: Estimate, threshold: float) -> tuple[str, ...]:
    """The estimates (``"compute"``, ``"link"``) that moved by more than ``threshold`` (a share: 0.1 = 10 %),
    either way, measured as a ratio (x2 and x0.5 are the same distance)."""
    limit = math.log1p(threshold)
    return tuple(name for name, scale in (("compute", estimate.compute), ("link", estimate.link))
                 if abs(math.log(scale)) > limit)


class Hysteresis:
    """Triggers once some estimate has moved beyond ``threshold`` at ``patience`` consecutive checks."""

    def __init__(self, threshold: float, patience: int):
        if not threshold >= 0 or patience < 1:
            raise ValueError(f"threshold must be >= 0 and patience >= 1, got {threshold!r}, {patience!r}")
        self.threshold = threshold
        self.patience = patience
        self._streak = 0

    @property
    def streak(self) -> int:
        """Consecutive checks that saw a move."""
        return self._streak

    def update(self, estimate: Estimate | None) -> bool:
        """One check's estimate (None: nothing to compare, which breaks a streak); True when it triggers."""
        if estimate is None or not moved(estimate, self.threshold):
            self._streak = 0
            return False
        self._streak += 1
        return self._streak >= self.patience

    def reset(self) -> None:
        self._streak = 0


def beta_scale(profile: Profile, estimate: Estimate) -> float:
    """The scale on ``profile``'s beta that makes its link ``estimate.link`` times slower on the traffic the
    estimate saw, its alpha unchanged; ``estimate.beta`` where the estimate carries no traffic.

    The profile's alpha, not the baseline window's fitted one: a window's fit of one job's mix may put most
    of the link time in the start-up (measured: alpha x4.9 on an unchanged link), and a link x0.6 then left
    beta x0.06 (VGG-like under load: the re-planned profile saw a free link, and no plan was worth a switch
    when the compute doubled). The profile's alpha comes from the sweep of sizes at profiling."""
    collectives, nbytes = estimate.traffic
    if nbytes <= 0 or profile.beta_s_per_byte <= 0:
        return estimate.beta
    fixed = profile.alpha_s * collectives
    return _clamp(max(estimate.link * (fixed + profile.beta_s_per_byte * nbytes) - fixed, 0.0)
                  / (profile.beta_s_per_byte * nbytes))


def profile_level(wall_s: float, cpu_s: float, threshold: float) -> float:
    """The scale on the compute of a profile whose backward took ``wall_s`` of wall time for ``cpu_s`` of the
    training thread's CPU time: ``(1 + threshold) * cpu_s / wall_s`` where the wall time exceeds the CPU time by
    more than ``threshold`` (a share), so the profile stands at the threshold's edge; else 1.0, never above
    (Note [Profiled under load])."""
    if not (wall_s > 0 and cpu_s > 0 and threshold >= 0) or wall_s <= cpu_s * (1 + threshold):
        return 1.0
    return _clamp((1 + threshold) * cpu_s / wall_s)


def rescale(profile: Profile, estimate: Estimate) -> Profile:
    """``profile`` with every tensor's compute scaled by ``estimate.compute`` and the link's beta by
    :func:`beta_scale` (alpha, sizes, order and stage ratios unchanged: :func:`link_estimate`)."""
    c = estimate.compute
    tensors = tuple(dataclasses.replace(t, fwd_s=t.fwd_s * c, bwd_s=t.bwd_s * c) for t in profile.tensors)
    return dataclasses.replace(profile, tensors=tensors,
                               beta_s_per_byte=profile.beta_s_per_byte * beta_scale(profile, estimate))


# Note [Judged conditions]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# On a noisy machine the estimates of a world that does not change wander
# beyond the threshold and back: measured on 2 shared cores, 23 to 36 of 99
# checks of a quiet 1,000-iteration job triggered rank 0's planner (60-125
# ms of CPU each, which a planning thread takes from the training thread
# too: Python runs one thread at a time), and every verdict was "keep"
# (benchmarks/results/2026-11-27-p2-replan-cost-*.md). A condition is where
# the rescaled profile stands against what profiling measured: its compute
# and link scales (:func:`condition`). Each condition the plan in force was
# kept for is remembered (on rank 0), and a decision whose condition is
# within half the threshold of one of them, in both scales, is kept without
# planning (:func:`near`). That takes the verdict to be the same within half
# the threshold of a condition where no plan was faster by more than the
# threshold: a switch this skips would have gained little. A real change (a
# batch x4, a link x0.25) lands far from every judged condition and is
# planned for; a plan switch forgets them.


def condition(first: Profile, now: Profile) -> tuple[float, float]:
    """Where ``now`` (a rescaled profile) stands against ``first`` (what profiling measured): the logarithms of
    its compute scale and of its link's per-byte scale (Note [Judged conditions])."""
    compute = sum(t.bwd_s for t in now.tensors) / max(sum(t.bwd_s for t in first.tensors), 1e-30)
    beta = now.beta_s_per_byte / first.beta_s_per_byte if first.beta_s_per_byte > 0 else 1.0
    return math.log(max(compute, 1e-30)), math.log(max(beta, 1e-30))


def near(where: tuple[float, float], judged: Sequence[tuple[float, float]], share: float) -> bool:
    """Whether ``where`` is within ``share`` (0.05 = 5 %) of some condition in ``judged``, in both scales."""
    limit = math.log1p(share)
    return any(abs(where[0] - c) <= limit and abs(where[1] - b) <= limit for c, b in judged)


def worth_switching(current_s: float, fresh_s: float, threshold: float) -> bool:
    """Whether a fresh plan predicted at ``fresh_s`` beats the current plan's ``current_s`` (both under the new
    estimates) by more than ``threshold`` (a share of the fresh plan's time)."""
    if not (math.isfinite(fresh_s) and fresh_s > 0):
        return False
    return not math.isfinite(current_s) or current_s > fresh_s * (1 + threshold)


def describe(estimate: Estimate, threshold: float) -> str:
    """Why: each estimate, with the ones that moved beyond the threshold first."""
    parts = []
    span_b, span_n = estimate.span_s
    compute = f"compute x{estimate.compute:.2f}"
    if span_b > 0:
        clock = " of CPU" if estimate.cpu else ""
        compute += f" (backward {span_b * 1e3:.1f} ms -> {span_n * 1e3:.1f} ms{clock})"
    link = f"link x{estimate.link:.2f}"
    link += f" (as rank {estimate.link_rank} measured it)" if estimate.link_rank >= 0 else ""
    which = moved(estimate, threshold)
    for name, text in (("compute", compute), ("link", link)):
        parts.append(("moved: " if name in which else "") + text)
    parts.sort(key=lambda p: not p.startswith("moved"))
    return "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class Replan:
    """One re-plan, as every rank records it (``DistributedOptimizer.replans``)."""

    iteration: int
    """The optimizer's iteration (counted from 1 since wrapping) whose ``step()`` staged the new plan, the same
    on every rank; the new plan is in force from the next iteration."""
    reason: str
    """Which estimates moved, and by how much (:func:`describe`)."""
    compute: float
    """Compute scale since the last plan (or last check that kept it)."""
    link: float
    """Link scale since then."""
    predicted_old_s: float
    """The plan in force, under the new estimates: predicted iteration seconds (the simulator's)."""
    predicted_new_s: float
    """The new plan, under the new estimates."""
    largest_block: tuple[int, int]
    """Largest block of the old plan and of the new one, in elements (a quick view of what changed)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def largest_block(partition: Sequence[Sequence[int]]) -> int:
    """The largest block of a plan's partition, in elements (0 for none)."""
    return int(max((max(p) for p in partition if len(p)), default=0))

