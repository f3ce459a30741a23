"""The world changes mid-run: does the plan follow? (adaptive re-planning, ``dcredit_opt/replanner.py``)

    sudo .venv/bin/python -m benchmarks.changing_world --scenario rate-down-up --rounds 1

Two ranks in the network namespaces of :mod:`benchmarks.netem` (``tc tbf``). A scenario is a list of
phases, each from a timed iteration on, with a rate and a batch per rank:

- ``rate-down-up``: ResNet-18-like, 1 Gbit/s, then 250 Mbit/s, then 1 Gbit/s again;
- ``rate-up``: ResNet-18-like, 1 Gbit/s, then 10 Gbit/s;
- ``compute``: VGG-like at 1 Gbit/s, batch 16, then 32 per rank (the simulator says the batch-16 plan is
  about 1.16x slower than a fresh one where the compute doubles; a batch doubled on one core costs 1.5-1.9x
  the compute, not 2x, and there the old plan is 1.09-1.15x slower: wrong, but by less than 1.15x);
- ``compute-x4``: the same, batch 16 then 64 per rank (the compute x2.1-2.9 as measured: the old plan
  1.07-1.32x slower than a fresh one in the simulator, on the runs' own profiles);
- ``link-freed``: ResNet-18-like, 250 Mbit/s, then 1 Gbit/s (a neighbour's transfer on a shared link ends).
  At 250 Mbit/s every plan sits on the link's floor, and the one the search returns holds most blocks back
  to the end of backward; at 1 Gbit/s that forgoes the overlap: the simulator puts that plan at 1.39-1.41x
  a fresh one, and a re-plan from the first profile rescaled to the new link and compute at 1.00-1.08x (the
  rate-down-up runs' own 250 Mbit/s and 1 Gbit/s profiles, 2026-11-28). The other direction (1 Gbit/s ->
  250 Mbit/s, 1.00x) and 250 Mbit/s -> 10 Gbit/s (1.01x) leave the old plan right.

Schemes, interleaved per round (each launch a fresh job): ``adaptive`` (re-planning on, its defaults),
``once`` (``replan_every=0``: the plan made after profiling stays), both through the whole scenario; and
``fresh@<condition>`` for every condition of the scenario: a job started in that condition and planned there,
re-planning off (what re-planning should reach); and ``again@<condition>``, the last condition's fresh job
launched once more: two launches of one job differ by where their processes and memory land and by the
machine's other load at the time, and their ratio is the spread any comparison of two launches carries. With
``--history``, a control for what a job's past costs
apart from its plan: ``history`` (``Config(policy="fixed")``, one plan that nothing changes, through the
whole scenario) against ``history-fresh@<condition>`` (the same fixed plan, started in the condition); their
ratio is what running through the earlier phases (and measuring later iterations) costs by itself. Rate changes are made by this process (root) with
``tc qdisc change`` when rank 0 starts the switch iteration (it writes each iteration's index to a file);
batch changes by the ranks themselves.

Per phase: the median iteration time of ``adaptive`` and ``once`` from :data:`SETTLE` iterations after the
switch to the phase's end, against ``fresh`` in the same condition, with 95 % bootstrap intervals over
iterations (:func:`benchmarks.stats.speedup_interval`); the re-plans (at which iteration, why); and, for
each rank-0 profile, the synchronous floor (``planner.simulate.synchronous_floor``); in the last phase, per
round, whether the adaptive job ended on the fresh job's plan and, in the simulator under the fresh job's
profile, how the two plans compare (so a gap in time can be told from a gap in plan). Writes
``benchmarks/results/<date>-p2-<scenario>.{json,md,png}`` (every iteration time, hardware, versions, load).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import report
from benchmarks.harness import stop_all
from benchmarks.netem import open_network, rank_env
from benchmarks.stats import median, quantile, speedup_interval
from dcredit_opt.files import write_whole

SETTLE = 20
"""Iterations after a change that the done-when grants re-planning: the phase is measured from there on."""

# name -> (model, [(first timed iteration, rate, batch per rank)], timed iterations in all)
SCENARIOS = {
    "rate-down-up": ("resnet18", [(0, "1gbit", 8), (30, "250mbit", 8), (60, "1gbit", 8)], 90),
    "rate-up": ("resnet18", [(0, "1gbit", 8), (30, "10gbit", 8)], 60),
    "compute": ("vgg", [(0, "1gbit", 16), (30, "1gbit", 32)], 70),
    "compute-x4": ("vgg", [(0, "1gbit", 16), (30, "1gbit", 64)], 70),
    "link-freed": ("resnet18", [(0, "250mbit", 8), (30, "1gbit", 8)], 80),
    "smoke": ("tiny", [(0, "1gbit", 32), (4, "250mbit", 32), (8, "1gbit", 64)], 12),  # the code paths, quickly
}
FRESH_ITERS = 15
WARMUP = 2
POLL_S = 0.01


def _condition(rate: str, batch: int) -> str:
    return f"{rate}/b{batch}"


# ---- one rank ------------------------------------------------------------------------------------------------


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import dcredit_opt as dc
    from benchmarks.models import get_model, loss_fn
    from benchmarks.worker import LR, MOMENTUM, PG_TIMEOUT_S

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    said = _listen()
    spec = get_model(args.model)
    torch.manual_seed(0)
    model = spec.build()
    phases = [(int(k), int(b)) for k, b in (x.split(":") for x in args.batches.split(","))]
    data = {b: spec.make_batch(b, torch.Generator().manual_seed(1 + rank)) for _, b in phases}
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    config = dc.Config.from_env(policy=args.policy, **({} if args.adaptive else {"replan_every": 0}))
    dc.init(timeout_s=config.timeout_s)
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                                  named_parameters=model.named_parameters(), config=config)
    warmup = WARMUP + config.profile_iters + 1  # profiling, the switch to the plan, then untimed warm-up
    stamps = []
    for i in range(warmup + args.iters):
        k = i - warmup
        if rank == 0 and k >= 0:
            write_whole(args.progress, str(k))
        x, y = data[[b for start, b in phases if start <= max(k, 0)][-1]]
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        stamps.append(time.perf_counter())
    opt.synchronize()
    if rank == 0:
        # a re-plan staged by the step() of optimizer iteration n (loop index n - 1) is in force from loop index n
        replans = [{**r.to_dict(), "from_timed_iteration": r.iteration - warmup} for r in opt.replans]
        record = {"iter_times_s": [b - a for a, b in zip(stamps[warmup - 1:], stamps[warmup:])],
                  "replans": replans, "log": said, "profile": opt.profile.to_dict() if opt.profile is not None else None,
                  "plan": opt.plan.to_dict(),
                  "config": {"replan_every": config.replan_every, "replan_threshold": config.replan_threshold}}
        write_whole(args.out, json.dumps(record))
    dc.shutdown()
    dist.destroy_process_group()


def _listen() -> list[str]:
    """Rank 0's INFO lines from dcredit_opt (each re-plan, and each check that re-planned and kept the plan)."""
    import logging

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    logger = logging.getLogger("dcredit_opt")
    logger.addHandler(Keep(logging.INFO))
    logger.setLevel(logging.INFO)
    return said


# ---- the launches ----------------------------------------------------------------------------------------------


def _launch(net, model: str, phases: list, iters: int, adaptive: bool, workdir: Path, tag: str,
            timeout_s: float, policy: str = "dcredit") -> dict:
    """One job through ``phases`` (rates switched here, batches by the ranks); rank 0's record."""
    net.set_rate(phases[0][1])
    port, out, progress = net.next_port(), workdir / f"{tag}.json", workdir / f"{tag}.progress"
    batches = ",".join(f"{k}:{b}" for k, _, b in phases)
    procs = []
    for ep in net.endpoints:
        env = dict(os.environ, **rank_env(ep, net.ranks, net.master_addr, port), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(x for x in (str(report.REPO_ROOT), os.environ.get("PYTHONPATH")) if x))
        argv = [sys.executable, "-m", "benchmarks.changing_world", "--rank-of", model, "--batches", batches,
                "--iters", str(iters), "--out", str(out), "--progress", str(progress), "--policy", policy] + (
                    ["--adaptive"] * adaptive)
        with open(workdir / f"{tag}-r{ep.rank}.log", "w") as log:
            procs.append(subprocess.Popen(ep.wrap(argv), env=env, cwd=report.REPO_ROOT, stdout=log,
                                          stderr=subprocess.STDOUT))
    switches = [(k, rate) for (k, rate, _), (_, before, _) in zip(phases[1:], phases) if rate != before]
    deadline, done = time.monotonic() + timeout_s, []
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{tag}: timed out after {timeout_s:.0f} s")
            if switches:
                try:
                    at = int(progress.read_text())
                except (OSError, ValueError):
                    at = -1
                if at >= switches[0][0]:
                    k, rate = switches.pop(0)
                    t0 = time.perf_counter()
                    net.set_rate(rate)
                    done.append({"timed_iteration": k, "seen_at": at, "rate": rate,
                                 "tc_s": time.perf_counter() - t0})
            time.sleep(POLL_S)
    finally:
        stop_all(procs)
    if any(p.returncode for p in procs) or not out.exists():
        tails = "\n".join((workdir / f"{tag}-r{r}.log").read_text()[-1500:] for r in range(len(procs)))
        raise RuntimeError(f"{tag}: a rank failed ({[p.returncode for p in procs]}):\n{tails}")
    return {**json.loads(out.read_text()), "rate_switches": done}


def jobs(scenario: str, history: bool = False) -> list[tuple[str, list, int, bool, str]]:
    """``(scheme, phases, iterations, adaptive, policy)`` of one round (``history``: and the fixed-plan control)."""
    _, phases, iters = SCENARIOS[scenario]
    out = [("adaptive", phases, iters, True, "dcredit"), ("once", phases, iters, False, "dcredit")]
    conditions = list(dict.fromkeys((rate, batch) for _, rate, batch in phases))
    for rate, batch in conditions:
        out.append((f"fresh@{_condition(rate, batch)}", [(0, rate, batch)], FRESH_ITERS, False, "dcredit"))
    rate, batch = phases[-1][1:]  # the launch-to-launch control: the last condition's fresh job, once more
    out.append((f"again@{_condition(rate, batch)}", [(0, rate, batch)], FRESH_ITERS, False, "dcredit"))
    if history:
        out.append(("history", phases, iters, False, "fixed"))
        for rate, batch in conditions:
            out.append((f"history-fresh@{_condition(rate, batch)}", [(0, rate, batch)], FRESH_ITERS, False, "fixed"))
    return out


# ---- what the runs say ------------------------------------------------------------------------------------------


def _floor(profile: dict | None) -> float | None:
    if not profile:
        return None
    from dcredit_opt.planner.floors import synchronous_floor
    from dcredit_opt.planner.profile import Profile

    return synchronous_floor(Profile.from_dict(profile))


def summarize(scenario: str, runs: dict[str, list[dict]]) -> list[dict]:
    """Per phase: medians (settled), the fresh job's, ratios with intervals, re-plans in the phase."""
    _, phases, iters = SCENARIOS[scenario]
    rows = []
    for p, (start, rate, batch) in enumerate(phases):
        end = phases[p + 1][0] if p + 1 < len(phases) else iters
        lo = min(start + SETTLE, end - 1) if p else 0  # (the smoke scenario's phases are shorter)
        fresh_runs = runs[f"fresh@{_condition(rate, batch)}"]
        fresh = [r["iter_times_s"] for r in fresh_runs]
        floors = [f for r in fresh_runs if (f := _floor(r.get("profile"))) is not None]
        part = {s: [r["iter_times_s"][lo:end] for r in runs[s]] for s in ("adaptive", "once")}
        row = {"phase": p, "condition": _condition(rate, batch), "iterations": [start, end], "measured_from": lo,
               "fresh_s": median(_flat(fresh)), "floor_s": median(floors) if floors else float("nan")}
        for s, times in part.items():
            flat = _flat(times)
            row[f"{s}_s"] = median(flat)
            row[f"{s}_iqr_s"] = [quantile(flat, 0.25), quantile(flat, 0.75)]
            row[f"{s}_over_fresh"] = median(flat) / row["fresh_s"]
            row[f"{s}_over_fresh_ci"] = _inverse(speedup_interval(fresh, times))
        row["once_over_adaptive"] = row["once_s"] / row["adaptive_s"]
        row["once_over_adaptive_ci"] = speedup_interval(part["once"], part["adaptive"])
        again = runs.get(f"again@{_condition(rate, batch)}") if p == len(phases) - 1 else None
        if again:  # two launches of one job: what launching alone changes (the module docstring)
            row["again_over_fresh"] = median(_flat([r["iter_times_s"] for r in again])) / row["fresh_s"]
            row["again_over_fresh_ci"] = _inverse(speedup_interval(fresh, [r["iter_times_s"] for r in again]))
        if p == len(phases) - 1:
            row["plans"] = _plans_compared(runs["adaptive"], fresh_runs)
        row["replans"] = [[rp["from_timed_iteration"] for rp in r["replans"] if start <= rp["from_timed_iteration"] < end]
                          for r in runs["adaptive"]]
        control = runs.get(f"history-fresh@{_condition(rate, batch)}")
        if "history" in runs and control:
            past = [r["iter_times_s"][lo:end] for r in runs["history"]]
            started_here = [r["iter_times_s"] for r in control]
            row["history_over_fresh"] = median(_flat(past)) / median(_flat(started_here))
            row["history_over_fresh_ci"] = _inverse(speedup_interval(started_here, past))
        rows.append(row)
    return rows


def _plans_compared(adaptive: list[dict], fresh: list[dict]) -> list[dict]:
    """Per round: whether the adaptive job's last plan is the fresh job's, and both plans' iteration time in the
    simulator under the fresh job's profile (the fresh plan's, and the adaptive one's over it); empty for records
    without plans."""
    from dcredit_opt.planner.plan import Plan
    from dcredit_opt.planner.profile import Profile
    from dcredit_opt.planner.simulate import iteration_time
    from dcredit_opt.profiling.planning import CHANNEL_FIFO

    out = []
    for a, f in zip(adaptive, fresh):
        if not (a.get("plan") and f.get("plan") and f.get("profile")):
            continue
        mine, theirs, profile = Plan.from_dict(a["plan"]), Plan.from_dict(f["plan"]), Profile.from_dict(f["profile"])
        fresh_s = iteration_time(theirs, profile, channel_fifo=CHANNEL_FIFO)
        out.append({"same": mine == theirs, "fresh_plan_s": fresh_s,
                    "adaptive_plan_over_fresh": iteration_time(mine, profile, channel_fifo=CHANNEL_FIFO) / fresh_s})
    return out


def _flat(lists: list[list[float]]) -> list[float]:
    return list(itertools.chain.from_iterable(lists))


def _inverse(ci):
    return None if ci is None else [1 / ci[1], 1 / ci[0]]


def _ci(ci) -> str:
    return "-" if ci is None else f"[{ci[0]:.2f}, {ci[1]:.2f}]"


def markdown(record: dict) -> str:
    c = record["conditions"]
    hw = record["hardware"]
    header = (f"{record['date']}, {hw.get('cpu_model', '?')}, {hw.get('cores', '?')} cores, 2 ranks in network "
              f"namespaces (tc tbf), {record['rounds']} round(s) of every scheme, interleaved; load average (1, 5, "
              f"15 min) {c['load_start']} at the start, {c['load_end']} at the end; {c['wall_s']:.0f} s in all. "
              f"`python -m benchmarks.changing_world --scenario {record['scenario']}`.")
    how = (f"Phases (first timed iteration, rate, batch per rank): {record['phases']}. Each phase is measured from "
           f"{SETTLE} iterations after its switch (the whole phase for the first); `fresh` is a job started and "
           "planned in the phase's condition, re-planning off; `floor` the synchronous floor of the fresh job's "
           "profile. Ratios: medians, 95 % bootstrap intervals.")
    columns = ("| phase | condition | fresh | floor | adaptive | adaptive / fresh | once | once / fresh | "
               "once / adaptive | re-plans in phase (from iteration) |")
    lines = [f"# The world changes mid-run: {record['scenario']} ({record['model']})", "", header, "", how, "",
             columns, "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in record["summary"]:
        lines.append(f"| {r['phase']} ({r['measured_from']}-{r['iterations'][1]}) | {r['condition']} | "
                     f"{r['fresh_s']:.3f} s | {r['floor_s']:.3f} s | {r['adaptive_s']:.3f} s | "
                     f"{r['adaptive_over_fresh']:.3f} {_ci(r['adaptive_over_fresh_ci'])} | {r['once_s']:.3f} s | "
                     f"{r['once_over_fresh']:.3f} {_ci(r['once_over_fresh_ci'])} | {r['once_over_adaptive']:.3f} "
                     f"{_ci(r['once_over_adaptive_ci'])} | {r['replans']} |")
    for r in record["summary"]:
        if "again_over_fresh" in r:
            lines += ["", (f"Launch to launch (phase {r['phase']}, {r['condition']}): a second job started there "
                           f"(`again`) took {r['again_over_fresh']:.3f}x the `fresh` job's time "
                           f"{_ci(r['again_over_fresh_ci'])}: the spread of two launches of one job.")]
        for k, c in enumerate(r.get("plans", [])):
            lines.append(f"- round {k}: the adaptive job's last plan is {'the same as' if c['same'] else 'not'} "
                         f"the fresh job's; in the simulator, under the fresh job's "
                         f"profile, {c['adaptive_plan_over_fresh']:.3f}x the fresh plan's "
                         f"{c['fresh_plan_s'] * 1e3:.0f} ms")
    if any("history_over_fresh" in r for r in record["summary"]):
        lines += ["", ("The past alone (`--history`): one fixed plan through the scenario (`history`, measured as "
                       "above) against the same plan started in the phase's condition (`history-fresh`):"), ""]
        lines += [f"- phase {r['phase']} ({r['condition']}): history / history-fresh {r['history_over_fresh']:.3f} "
                  f"{_ci(r['history_over_fresh_ci'])}" for r in record["summary"] if "history_over_fresh" in r]
    lines += ["", "Re-plans (adaptive, each round):", ""]
    for k, run in enumerate(record["runs"]["adaptive"]):
        for rp in run["replans"]:
            lines.append(f"- round {k}, from iteration {rp['from_timed_iteration']}: {rp['reason']}; predicted "
                         f"{rp['predicted_old_s'] * 1e3:.0f} ms with the plan in force, "
                         f"{rp['predicted_new_s'] * 1e3:.0f} ms with the new one")
        if not run["replans"]:
            lines.append(f"- round {k}: none")
        for line in run.get("log", []):
            if "estimates moved" in line:
                lines.append(f"- round {k}, a check that moved and kept the plan: {line.removeprefix('dcredit_opt: ')}")
    lines += ["", "Iteration times, ms (each launch; `|` marks a switch):", "", "```"]
    starts = {k for k, _, _ in record["phases"][1:]}
    for scheme, runs in record["runs"].items():
        for k, run in enumerate(runs):
            cells = [("| " if i in starts and "@" not in scheme else "") + f"{t * 1e3:.0f}"
                     for i, t in enumerate(run["iter_times_s"])]
            lines.append(f"{scheme} r{k}: " + " ".join(cells))
    lines += ["```", ""]
    return "\n".join(lines)


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    for scheme in ("adaptive", "once"):
        for k, run in enumerate(record["runs"][scheme]):
            ax.plot(run["iter_times_s"], label=f"{scheme} r{k}", lw=1)
    for r in record["summary"]:
        ax.hlines(r["fresh_s"], *r["iterations"], colors="k", linestyles="dashed",
                  label="fresh (median)" if r["phase"] == 0 else None)
    for k, _, _ in record["phases"][1:]:
        ax.axvline(k, color="grey", lw=0.8)
    ax.set_xlabel("timed iteration")
    ax.set_ylabel("iteration time (s)")
    ax.set_title(f"{record['scenario']} ({record['model']}), 2 ranks")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="rate-down-up")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--launch-timeout-s", type=float, default=600.0)
    p.add_argument("--results-dir", type=Path, default=report.RESULTS_DIR)
    p.add_argument("--render", type=Path, default=None, help="write the .md and .png of this record again")
    p.add_argument("--rank-of", default=None, help=argparse.SUPPRESS)  # a rank of one launch: its model
    for name in ("--batches", "--out", "--progress"):
        p.add_argument(name, default=None, help=argparse.SUPPRESS)
    p.add_argument("--iters", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--adaptive", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--policy", default="dcredit", help=argparse.SUPPRESS)
    p.add_argument("--history", action="store_true",
                   help="also run the fixed-plan control: what the earlier phases cost a job apart from its plan")
    args = p.parse_args(argv)
    if args.rank_of:
        args.model = args.rank_of
        rank_main(args)
        return None
    if args.render:
        record = json.loads(args.render.read_text())
        record["summary"] = summarize(record["scenario"], record["runs"])
        write_whole(args.render, json.dumps(record, indent=1) + "\n")
        write_whole(args.render.with_suffix(".md"), markdown(record))
        plot(record, args.render.with_suffix(".png"))
        print(markdown(record))
        return record
    model, phases, _ = SCENARIOS[args.scenario]
    started = datetime.datetime.now().astimezone()
    load_start = [round(x, 2) for x in os.getloadavg()]
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="dcworld-") as tmp, open_network(2, phases[0][1], "netns") as net:
        for rnd in range(args.rounds):
            for scheme, ph, iters, adaptive, policy in jobs(args.scenario, args.history):
                t0 = time.monotonic()
                run = _launch(net, model, ph, iters, adaptive, Path(tmp), f"{rnd}-{scheme.replace('@', '-')}"
                              .replace("/", "-"), args.launch_timeout_s, policy)
                runs.setdefault(scheme, []).append(run)
                print(f"round {rnd} {scheme}: median {median(run['iter_times_s']):.3f} s, re-plans at "
                      f"{[r['from_timed_iteration'] for r in run['replans']]}, {time.monotonic() - t0:.0f} s",
                      flush=True)
    record = {"scenario": args.scenario, "model": model, "phases": phases, "rounds": args.rounds,
              "settle_iterations": SETTLE, "date": started.isoformat(timespec="seconds"),
              "hardware": report.hardware(), "versions": report.versions(),
              "conditions": {"load_start": load_start, "load_end": [round(x, 2) for x in os.getloadavg()],
                             "wall_s": (datetime.datetime.now().astimezone() - started).total_seconds()},
              "runs": runs, "summary": summarize(args.scenario, runs)}
    paths = report.output_paths(f"p2-{args.scenario}", started.date(), args.results_dir)
    paths["json"].parent.mkdir(parents=True, exist_ok=True)
    write_whole(paths["json"], json.dumps(record, indent=1) + "\n")
    md = markdown(record)
    write_whole(paths["md"], md)
    plot(record, paths["png"])
    print(md)
    print("wrote " + ", ".join(str(x) for x in paths.values()))
    return record


if __name__ == "__main__":
    main()
