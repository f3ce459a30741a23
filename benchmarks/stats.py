"""Pure functions: the run schedule and the statistics of iteration times.

Kept apart from the launcher so that they are tested without processes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# The two schemes that define the lower bound; they are not training schemes.
BOUND_SCHEMES = ("compute", "comm")
BASELINE = "ddp"


@dataclass(frozen=True)
class Launch:
    """One process-group launch: one scheme on one (model, rate) for one round."""

    model: str
    rate: str
    round: int
    scheme: str


def schedule(models: Sequence[str], rates: Sequence[str], schemes: Sequence[str],
             rounds: int) -> list[Launch]:
    """Launch order: for each (model, rate), ``rounds`` rounds of every scheme.

    Within a (model, rate) the schemes are interleaved, A B C A B C ..., so
    slow drift of the machine (thermal, other tenants, page cache) hits every
    scheme alike instead of whichever ran last. (model, rate) stay the outer
    loops because a rate change means a new network.
    """
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    if len(set(schemes)) != len(schemes):
        raise ValueError(f"duplicate schemes in {list(schemes)}")
    return [Launch(m, r, k, s)
            for r in rates for m in models for k in range(rounds) for s in schemes]


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default), ``0 <= q <= 1``."""
    if not xs:
        raise ValueError("quantile of no data")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q={q} outside [0, 1]")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median(xs: Sequence[float]) -> float:
    return quantile(xs, 0.5)


@dataclass(frozen=True)
class Summary:
    n: int
    median_s: float
    q1_s: float
    q3_s: float
    min_s: float
    max_s: float

    @property
    def iqr_s(self) -> float:
        return self.q3_s - self.q1_s


def summarize(xs: Sequence[float]) -> Summary:
    return Summary(len(xs), median(xs), quantile(xs, 0.25), quantile(xs, 0.75), min(xs), max(xs))


def bound_s(compute_s: float | None, comm_s: float | None) -> float | None:
    """The lower bound ``max(compute, comm)`` on an iteration with perfect overlap.

    With one bound missing (its scheme not run or failed) the other is still
    a valid, looser lower bound; with both missing there is none.
    """
    known = [x for x in (compute_s, comm_s) if x is not None]
    return max(known) if known else None


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


# Bootstrap resamples for a speed-up's interval; fixed seed, so a record's intervals are reproducible.
BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95


def speedup_interval(base: Sequence[Sequence[float]], other: Sequence[Sequence[float]],
                     resamples: int = BOOTSTRAP_RESAMPLES, confidence: float = CONFIDENCE,
                     seed: int = 0) -> tuple[float, float] | None:
    """A percentile-bootstrap interval for ``median(base) / median(other)``.

    Each argument holds one list of iteration times per launch. Iterations of
    one launch share its start-up, placement and neighbours, so they are not
    independent draws: each resample draws launches with replacement, then
    iterations with replacement within each drawn launch (a two-level
    bootstrap), for both schemes independently. None when either side has no
    times.
    """
    base = [list(x) for x in base if x]
    other = [list(x) for x in other if x]
    if not base or not other:
        return None
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence} outside (0, 1)")
    rng = random.Random(seed)

    def draw(launches: list[list[float]]) -> float:
        pooled: list[float] = []
        for _ in launches:
            launch = launches[rng.randrange(len(launches))]
            pooled.extend(launch[rng.randrange(len(launch))] for _ in launch)
        return median(pooled)

    ratios = [draw(base) / draw(other) for _ in range(resamples)]
    tail = (1.0 - confidence) / 2
    return quantile(ratios, tail), quantile(ratios, 1.0 - tail)


@dataclass(frozen=True)
class Row:
    scheme: str
    summary: Summary | None  # None: the scheme was skipped or failed
    speedup_vs_ddp: float | None  # ddp median / this median (> 1: faster than DDP)
    ratio_to_bound: float | None  # this median / bound (>= 1 up to noise)
    note: str = ""
    speedup_ci: tuple[float, float] | None = None  # 95 % bootstrap interval of speedup_vs_ddp (over launches)
    ratio_to_floor: float | None = None  # this median / the synchronous floor (planner.floors.synchronous_floor)


def table(times: dict[str, list[float]], schemes: Iterable[str],
          notes: dict[str, str] | None = None,
          launches: dict[str, list[list[float]]] | None = None,
          floor: float | None = None) -> tuple[list[Row], float | None]:
    """One row per scheme for one (model, rate), and the bound.

    ``times`` maps a scheme to its steady-state iteration times pooled over
    rounds; a scheme absent from it (or with no times) gets an empty row and
    its note (the skip reason or the error). ``launches``, the same times
    kept apart per launch, gives each speed-up its bootstrap interval;
    ``floor``, the synchronous floor, each training scheme's ratio to it.
    """
    notes = notes or {}
    launches = launches or {}
    med = {s: median(t) for s, t in times.items() if t}
    bound = bound_s(med.get("compute"), med.get("comm"))
    base = med.get(BASELINE)
    rows = []
    for s in schemes:
        if s not in med:
            rows.append(Row(s, None, None, None, notes.get(s, "no data")))
            continue
        is_bound = s in BOUND_SCHEMES
        ci = None
        if not is_bound and BASELINE in launches and s in launches:
            ci = speedup_interval(launches[BASELINE], launches[s])
        rows.append(Row(
            s, summarize(times[s]),
            None if is_bound else ratio(base, med[s]),
            None if is_bound else ratio(med[s], bound),
            notes.get(s, ""),
            ci,
            None if is_bound else ratio(med[s], floor),
        ))
    return rows, bound
