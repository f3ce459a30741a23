"""Calibrate the planner's simulator on measured runs, and report predicted vs measured per scheme.

    python -m benchmarks.calibrate [records.json ...] [--out benchmarks/results/calibration.md]

For each benchmark record (``benchmarks/results/*.json``, written by
``make bench``) and each model in it:

* compute: the shipped profile of the model, its per-tensor forward and
  backward times scaled so that their sums are the measured medians of the
  record's ``compute`` scheme (one rank, no communication), backward
  further slowed by the factor measured beside communication (the median
  backward phase of the runtime's schemes over compute's: the ranks and
  their communication threads share two cores), and the optimizer step
  (``update_s``) its measured ``step`` median;
* network: ``alpha`` of one all-reduce fitted by least squares on the
  ``comm`` scheme (one flat all-reduce of every gradient) of all records at
  that rate (two sizes at 1 Gbit/s; shared across rates when a rate has one
  size only), ``beta`` from the record's own ``comm`` runs (the same machine
  load as its schemes);
* per-collective cost ``c`` (launch, completion and the update call on the
  ranks' own cores, which the link model does not charge), fitted per
  network model by a grid search minimising the mean absolute relative
  error over the schemes our runtime ran, and added to alpha;
* each ``dc-*`` scheme's plan as the current planner makes it
  (``planning.make_plan``, 2 channels, tuned under processor sharing as the
  planner that ran the records did), ``ddp`` as DDP-style buckets, and the
  simulated iteration of that same plan under both network models:
  processor sharing (the simulator's default) and ``channel_fifo``
  (collectives one after another on each channel). The one with the lower
  mean error is the one the measurements support; the planner tunes under
  it (``planning.CHANNEL_FIFO``).

* a reduce-scatter's and an all-gather's costs (``Profile.stage_ratios``,
  what DeAR's and decoupled D-Credit's plans are priced with): the median
  of what the record's own runs of that scheme measured (their profiles),
  the ring formula's halves where none did.

Where a scheme's plan changed since a record was measured (``PLANNER_SINCE``:
the commit from which the planner makes today's plan; the record's own
commit is not after it), its row compares a prediction for today's plan
with a measurement of an older one; such rows are shown but left out of
the fit and of the choice of network model.
Horovod's scheme is not modelled (its own fusion and cycle). By default the
records of the current runtime are used: those whose ``compute`` runs have
per-phase times (the 2026-11-22 records measured an older, slower runtime).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import statistics
import subprocess
from pathlib import Path

import numpy as np

import dcredit_opt
from dcredit_opt.files import write_whole
from dcredit_opt.planner.profile import RING_STAGE_RATIOS, Profile
from dcredit_opt.planner.simulate import simulate
from dcredit_opt.profiling import planning

REPO = Path(__file__).resolve().parents[1]
SCHEMES = {"ddp": "ddp", "dc-wfbp": "wfbp", "dc-mgwfbp": "mgwfbp", "dc-bytescheduler": "bytescheduler",
           "dc-oasr": "oasr", "dc-dear": "dear", "dc-usbyte": "usbyte", "dc-dcredit": "dcredit"}
PLANNER_SINCE = {"dc-dcredit": "245b792", "dc-usbyte": "245b792", "dc-dear": "245b792"}
"""Per scheme, the commit from which the planner makes today's plan for it: the search with decoupled
candidates, the paper's US-Byte, DeAR's own collectives. A record measured at an earlier commit ran
another plan."""
GRID_C_S = [k * 5e-4 for k in range(21)]
"""Per-collective costs tried: 0 to 10 ms in 0.5 ms steps."""
TELL_APART = 0.01
"""Mean |error| difference below which the verdict says the evidence is thin."""


def shipped(name: str) -> Profile:
    for folder in (Path(dcredit_opt.__file__).parent / "profiles", REPO / "benchmarks" / "profiles"):
        if (folder / f"{name}.json").exists():
            return Profile.load(folder / f"{name}.json")
    raise SystemExit(f"shipped profile {name!r} not found")


def _median_phase(record: dict, model: str, rate: str, scheme: str, phase: str) -> float | None:
    values = [v for run in record["runs"] if (run["model"], run["rate"], run["scheme"]) == (model, rate, scheme)
              and run.get("status") == "ok" and run.get("phases_s") for v in run["phases_s"][phase]]
    return statistics.median(values) if values else None


def measured(record: dict) -> dict[tuple[str, str], dict[str, float]]:
    out = {}
    for result in record["results"]:
        out[(result["model"], result["rate"])] = {row["scheme"]: row["median_s"] for row in result["rows"]
                                                  if row.get("median_s") is not None}
    return out


def fit_network(records: list[dict]) -> dict[str, tuple[float, float]]:
    """Per rate, (alpha_s, beta_s_per_byte) of one all-reduce from the ``comm`` scheme."""
    points: dict[str, list[tuple[float, float]]] = {}
    for record in records:
        for (model, rate), rows in measured(record).items():
            if "comm" in rows:
                points.setdefault(rate, []).append((shipped(model).total_bytes, rows["comm"]))
    fits, alphas = {}, []
    for rate, pts in points.items():
        sizes = np.array([s for s, _ in pts], dtype=float)
        times = np.array([t for _, t in pts], dtype=float)
        if len(set(sizes)) >= 2:
            beta, alpha = np.polyfit(sizes, times, 1)
            alpha, beta = max(0.0, float(alpha)), max(0.0, float(beta))
            fits[rate] = (alpha, beta)
            alphas.append(alpha)
    alpha_shared = statistics.median(alphas) if alphas else 0.0
    for rate, pts in points.items():
        if rate not in fits:
            beta = statistics.median((t - alpha_shared) / s for s, t in pts)
            fits[rate] = (alpha_shared, max(0.0, beta))
    return fits


def _is_ancestor(old: str, new: str | None) -> bool:
    if not new:
        return False
    done = subprocess.run(["git", "merge-base", "--is-ancestor", old, new], cwd=REPO, capture_output=True,
                          check=False)
    return done.returncode == 0


def plan_changed_since(record: dict, scheme: str) -> bool:
    """Whether ``record`` ran another plan for ``scheme`` than the current planner makes (``PLANNER_SINCE``)."""
    since = PLANNER_SINCE.get(scheme)
    return since is not None and not _is_ancestor(since, record.get("versions", {}).get("git_commit"))


def stage_ratios(record: dict, model: str, rate: str, scheme: str) -> tuple[float, ...]:
    """The median ``stage_ratios`` the record's runs of ``scheme`` measured (the ring's halves if none did)."""
    measured_ratios = [run["profile"]["stage_ratios"] for run in record["runs"]
                       if run["scheme"] == scheme and run.get("model") == model and run.get("rate") == rate
                       and run.get("status") == "ok" and (run.get("profile") or {}).get("stage_ratios")]
    if not measured_ratios:
        return RING_STAGE_RATIOS
    return tuple(statistics.median(r[k] for r in measured_ratios) for k in range(4))


def calibrated_profile(record: dict, model: str, rate: str, network: tuple[float, float]) -> tuple[Profile, float]:
    base = shipped(model)
    fwd = _median_phase(record, model, rate, "compute", "forward")
    bwd = _median_phase(record, model, rate, "compute", "backward")
    step = _median_phase(record, model, rate, "compute", "step") or 0.0
    if fwd is None or bwd is None:  # an old record without phases: scale both to the compute median
        total = measured(record)[(model, rate)]["compute"]
        scale_f = scale_b = total / sum(t.fwd_s + t.bwd_s for t in base.tensors)
    else:
        scale_f = fwd / sum(t.fwd_s for t in base.tensors)
        scale_b = bwd / sum(t.bwd_s for t in base.tensors)
    # Backward beside communication: both ranks and their communication threads share the
    # machine's cores, so every scheme's backward runs slower than one rank's alone. Measured,
    # not fitted: the median over our runtime's schemes of their backward phase (which never
    # waits for communication: hooks only hand blocks over) against compute's.
    slowed = [b for scheme in SCHEMES if scheme.startswith("dc-")
              and (b := _median_phase(record, model, rate, scheme, "backward")) is not None]
    if bwd is not None and slowed:
        scale_b *= max(1.0, statistics.median(slowed) / bwd)
    tensors = tuple(dataclasses.replace(t, fwd_s=t.fwd_s * scale_f, bwd_s=t.bwd_s * scale_b) for t in base.tensors)
    alpha, beta = network
    return dataclasses.replace(base, tensors=tensors, alpha_s=alpha, beta_s_per_byte=beta), step


def predict(profile: Profile, step: float, policy: str, c: float, fifo: bool) -> float:
    p = dataclasses.replace(profile, alpha_s=profile.alpha_s + c)
    # The plan the measured run ran: its planner tuned under processor sharing. The plan is the
    # same for both network models; only the model that replays it differs.
    plan = planning.make_plan(p, policy, channels=2, channel_fifo=False)
    return simulate(plan, p, update_s=step, channel_fifo=fifo).iteration_s


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="*", help="benchmark JSON records (default: every one in benchmarks/results)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "calibration.md"))
    args = parser.parse_args(argv)
    paths = args.records or sorted(glob.glob(str(REPO / "benchmarks" / "results" / "*.json")))
    records = [json.loads(Path(p).read_text()) for p in paths]
    if not args.records:  # records of the current runtime: those with per-phase times (2026-11-23 on)
        kept = [(p, r) for p, r in zip(paths, records)
                if any(run.get("phases_s") for run in r["runs"] if run["scheme"] == "compute")]
        paths, records = [p for p, _ in kept], [r for _, r in kept]
    pooled = fit_network(records)
    cases = []  # (record name, model, rate, scheme, measured, profile, step)
    for path, record in zip(paths, records):
        # Alpha pooled over the records (two sizes at one rate barely pin it); beta from the
        # record's own all-reduce (the same machine load as its schemes).
        networks = {}
        for (model, rate), rows in measured(record).items():
            if "comm" in rows and rate in pooled:
                alpha = pooled[rate][0]
                networks.setdefault(rate, []).append((rows["comm"] - alpha) / shipped(model).total_bytes)
        networks = {rate: (pooled[rate][0], max(0.0, statistics.median(betas))) for rate, betas in networks.items()}
        for (model, rate), rows in measured(record).items():
            if "compute" not in rows or rate not in networks:
                continue
            profile, step = calibrated_profile(record, model, rate, networks[rate])
            for scheme, policy in SCHEMES.items():
                if scheme in rows:
                    ratios = stage_ratios(record, model, rate, scheme)
                    cases.append((Path(path).stem, model, rate, scheme, rows[scheme],
                                  dataclasses.replace(profile, stage_ratios=ratios), step, policy,
                                  plan_changed_since(record, scheme)))

    def errors(c: float, fifo: bool) -> list[float]:
        return [predict(prof, step, pol, c, fifo) / m - 1 for _, _, _, s, m, prof, step, pol, changed in cases
                if not changed]

    fit = {}
    for fifo in (False, True):
        best = min(GRID_C_S, key=lambda c: statistics.mean(abs(e) for e in errors(c, fifo)))
        fit[fifo] = (best, statistics.mean(abs(e) for e in errors(best, fifo)))
    name = {False: "processor sharing", True: "channel FIFO"}
    chosen = min(fit, key=lambda f: fit[f][1])
    gaps = [(abs(ps) - abs(ff), s, rec, model) for (rec, model, _, s, *_), ps, ff in
            zip([c for c in cases if not c[-1]], errors(fit[False][0], False), errors(fit[True][0], True))]
    gap, scheme, rec, model = max(gaps, key=lambda g: abs(g[0]))
    verdict = (f"The measurements support {name[chosen]}: mean |error| {fit[chosen][1]:.1%} against "
               f"{fit[not chosen][1]:.1%}; where the two models differ most ({scheme} on {model}, {rec}: "
               f"several collectives in flight) {name[gap > 0]} is closer by {abs(gap):.1%}.")
    if abs(fit[True][1] - fit[False][1]) < TELL_APART and (gap > 0) != chosen:
        verdict += " The difference is small: more ranks, and plans with more overlap, would settle it."
    lines = ["# Simulator calibration: predicted vs measured iteration time", "",
             f"Made with `python -m benchmarks.calibrate` from {len(paths)} records: "
             + ", ".join(f"`{Path(p).name}`" for p in paths) + ".", "",
             "Network fitted on the `comm` scheme (one all-reduce of every gradient), beta per record; pooled "
             "over the records: "
             + "; ".join(f"{rate}: alpha {a * 1e3:.2f} ms, beta {b * 1e9:.2f} ns/B" for rate, (a, b) in
                         sorted(pooled.items())) + ". Backward times are those measured beside communication "
             "(median of the runtime's schemes), forward and step those of one rank alone.",
             "Per-collective cost fitted per network model (added to alpha): "
             + "; ".join(f"{name[f]}: c = {fit[f][0] * 1e3:.1f} ms, mean |error| {fit[f][1]:.1%}" for f in fit)
             + f". **{verdict}**", "",
             "| record | model | rate | scheme | measured s | predicted s (PS) | error | predicted s (FIFO) | error |",
             "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for rec, model, rate, scheme, m, prof, step, pol, changed in cases:
        ps = predict(prof, step, pol, fit[False][0], False)
        ff = predict(prof, step, pol, fit[True][0], True)
        note = " (plan changed since)" if changed else ""
        lines.append(f"| {rec} | {model} | {rate} | {scheme}{note} | {m:.3f} | {ps:.3f} | {ps / m - 1:+.1%} | "
                     f"{ff:.3f} | {ff / m - 1:+.1%} |")
    within = [abs(e) <= 0.10 for e in errors(fit[chosen][0], chosen)]
    lines += ["", (f"Under {name[chosen]}, {sum(within)} of {len(within)} comparable predictions are within 10 % "
                   "(the goal: all of them)."), ""]
    write_whole(args.out, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
