"""What re-planning's watching costs, and whether a quiet job re-plans: 1,000 iterations with nothing changing.

    .venv/bin/python -m benchmarks.replan_cost --iters 1000

Two ranks on loopback (no rate limit: an iteration is mostly compute, so the watching's share is as large as
it gets). Each rank trains two copies of the same model, each with its own optimizer, taking turns every
iteration: one with re-planning on (the defaults: ``Config.replan_every`` 10), one with it off
(``replan_every=0``); both otherwise the same (D-Credit, profiled and planned). For the one with re-planning
on, rank 0 times every call of the watch (``Replanner.observe``: reads the last iteration's trace on the
few iterations a window observes) and of the check (``Replanner.check``: every ``replan_every`` steps one
all-gather of every rank's window, started there and waited for at the next step, and when the estimates moved
for long enough rank 0's verdict: Note [The check in flight]; rank 0 plans on a thread of its own, which the
timing does not count but the end-to-end medians do), and counts the re-plans and the checks whose estimates
moved beyond the threshold. Prints medians of both (interleaved) and their ratio with a
95 % bootstrap interval (chunks of 100 iterations as the resampled units), and the timed cost per iteration
as a share of the median iteration; writes ``benchmarks/results/<date>-p2-replan-cost.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import report
from benchmarks.netem import LoopbackNetwork, rank_env
from benchmarks.stats import median, quantile, speedup_interval
from dcredit_opt.files import write_whole

CHUNK = 100
"""Iterations per resampled unit of the bootstrap (neighbouring iterations share the machine's moment)."""


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import dcredit_opt as dc
    from benchmarks.models import get_model, loss_fn
    from benchmarks.worker import LR, MOMENTUM
    from dcredit_opt.planner import adaptive

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    spec = get_model(args.model)
    x, y = spec.make_batch(args.batch, torch.Generator().manual_seed(1 + rank))
    dist.init_process_group("gloo")
    dc.init()
    jobs = {}
    for on in (True, False):
        torch.manual_seed(0)
        model = spec.build()
        config = dc.Config.from_env(policy="dcredit", **({} if on else {"replan_every": 0}))
        opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                                      named_parameters=model.named_parameters(), config=config)
        jobs[on] = (model, opt)
    watched = jobs[True][1]._dc.replanner
    spent = {"observe": [], "check": [], "_decide": [], "_conclude": []}  # the last two: parts of check
    for name in spent:
        method = getattr(watched, name)

        def timed(*a, _method=method, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _method(*a, **k)
            finally:
                spent[_name].append(time.perf_counter() - t0)

        setattr(watched, name, timed)
    gather = watched._all_gather_async

    class TimedGathering:  # the gather's start and its wait at the next step(), timed together
        def __init__(self, gathering, started_s):
            self._gathering, self._spent_s = gathering, started_s

        def wait(self):
            t0 = time.perf_counter()
            try:
                return self._gathering.wait()
            finally:
                spent["gather"].append(self._spent_s + time.perf_counter() - t0)

    def timed_gather(tensor, name):
        t0 = time.perf_counter()
        gathering = gather(tensor, name)
        return TimedGathering(gathering, time.perf_counter() - t0)

    spent["gather"] = []
    watched._all_gather_async = timed_gather
    estimates = []
    combine = adaptive.combine

    def recorded(*a, **k):  # adaptive.combine's arguments, as the replanner passes them
        est = combine(*a, **k)
        if est is not None:
            estimates.append([est.compute, est.link, list(adaptive.moved(est, args.threshold))])
        return est

    adaptive.combine = recorded
    warmup = jobs[True][1]._dc.config.profile_iters + 1 + 2
    times = {True: [], False: []}
    for i in range(warmup + args.iters):
        for on in ((True, False) if i % 2 == 0 else (False, True)):  # which goes first alternates too
            model, opt = jobs[on]
            t0 = time.perf_counter()
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            if i >= warmup:
                times[on].append(time.perf_counter() - t0)
    for _, opt in jobs.values():
        opt.synchronize()
    if rank == 0:
        record = {"on_s": times[True], "off_s": times[False], "observe_s": spent["observe"],
                  "check_s": spent["check"], "gather_s": spent["gather"], "decide_s": spent["_decide"],
                  "verdict_s": spent["_conclude"], "replans": [r.to_dict() for r in jobs[True][1].replans],
                  "estimates": estimates, "warmup": warmup,
                  "config": {"replan_every": jobs[True][1]._dc.config.replan_every,
                             "replan_threshold": jobs[True][1]._dc.config.replan_threshold}}
        write_whole(args.out, json.dumps(record))
    dc.shutdown()
    dist.destroy_process_group()


def _chunks(xs: list[float]) -> list[list[float]]:
    return [xs[i:i + CHUNK] for i in range(0, len(xs), CHUNK)]


def markdown(record: dict) -> str:
    r, c = record["result"], record["conditions"]
    on, off = r["on_s"], r["off_s"]
    n = len(on)
    # the observes and checks of the timed iterations only (the warm-up's come first)
    obs, chk = r["observe_s"][-n:], r["check_s"][-n:]
    gathers = r["gather_s"][-(n // r["config"]["replan_every"]):]
    per_iter = (sum(obs) + sum(chk)) / n
    own = per_iter - sum(gathers) / n  # without the gathers
    ci = speedup_interval(_chunks(on), _chunks(off))
    moved = [e for e in r["estimates"] if e[2]]
    ratio = median(on) / median(off)
    lines = [
        f"# Re-planning's watching: cost, and {n} quiet iterations", "",
        (f"{record['date']}, {record['hardware'].get('cpu_model', '?')}, {record['hardware'].get('cores', '?')} "
         f"cores, 2 ranks on loopback, {record['model']} batch {record['batch']} per rank, D-Credit; the two jobs take "
         f"turns every iteration in the same ranks. Load average (1, 5, 15 min) {c['load_start']} at the start, "
         f"{c['load_end']} at the end; {c['wall_s']:.0f} s in all. `python -m benchmarks.replan_cost --iters {n}`."),
        "",
        "| | value |", "|---|---:|",
        f"| iterations with re-planning on (timed, after profiling) | {n} |",
        (f"| checks (every {r['config']['replan_every']} steps) / with estimates moved beyond "
        f"{r['config']['replan_threshold']:.0%} | {len(r['estimates'])} / {len(moved)} |"),
        f"| **re-plans** | **{len(r['replans'])}** |",
        f"| median iteration, re-planning on / off | {median(on) * 1e3:.2f} ms / {median(off) * 1e3:.2f} ms |",
        (f"| IQR on / off | [{quantile(on, .25) * 1e3:.2f}, {quantile(on, .75) * 1e3:.2f}] / "
        f"[{quantile(off, .25) * 1e3:.2f}, {quantile(off, .75) * 1e3:.2f}] ms |"),
        f"| on / off (medians) | {ratio:.4f} |",
        f"| off / on, 95 % bootstrap over chunks of {CHUNK} | [{ci[0]:.3f}, {ci[1]:.3f}] |" if ci else "| | |",
        f"| watch (`observe`), timed: total / per iteration | {sum(obs) * 1e3:.1f} ms / {sum(obs) / n * 1e6:.1f} us |",
        (f"| check (`check`): total / per iteration; of which the windows' all-gather ({len(gathers)} calls, its "
         f"start and its wait at the next step) | {sum(chk) * 1e3:.1f} ms / {sum(chk) / n * 1e6:.1f} us; "
         f"{sum(gathers) * 1e3:.1f} ms |"),
        (f"| of the check: decisions ({len(r.get('decide_s', []))}, from the warm-up on) / rank 0's verdicts and "
         f"\"still planning\" broadcasts ({len(r.get('verdict_s', []))}) | {sum(r.get('decide_s', [])) * 1e3:.1f} ms / "
         f"{sum(r.get('verdict_s', [])) * 1e3:.1f} ms, the longest {max(r.get('verdict_s', [0.0]), default=0.0) * 1e3:.1f} "
         "ms |"),
        (f"| timed watching per iteration without the all-gathers, share of the median iteration | "
         f"{own * 1e6:.1f} us, {100 * own / median(on):.3f} % |"),
        (f"| **timed watching per iteration, share of the median iteration** | **{per_iter * 1e6:.1f} us, "
        f"{100 * per_iter / median(on):.3f} %** |"),
        "",
    ]
    if moved:
        lines += ["Checks whose estimates moved (compute, link scales):",
                  ", ".join(f"{e[0]:.2f}/{e[1]:.2f} ({'+'.join(e[2])})" for e in moved), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=1000, help="timed iterations of each job")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch", type=int, default=2, help="per rank")
    p.add_argument("--results-dir", type=Path, default=report.RESULTS_DIR)
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--threshold", type=float, default=0.1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank:
        rank_main(args)
        return
    started = datetime.datetime.now().astimezone()
    load_start = [round(x, 2) for x in os.getloadavg()]
    net = LoopbackNetwork(2)
    port = net.next_port()
    with tempfile.TemporaryDirectory(prefix="dcreplan-") as tmp:
        out = Path(tmp) / "r0.json"
        procs = []
        for ep in net.endpoints:
            env = dict(os.environ, **rank_env(ep, 2, net.master_addr, port), OMP_NUM_THREADS="1",
                       PYTHONPATH=os.pathsep.join(x for x in (str(report.REPO_ROOT), os.environ.get("PYTHONPATH"))
                                                  if x))
            argv_ = [sys.executable, "-m", "benchmarks.replan_cost", "--rank", "--out", str(out), "--iters",
                     str(args.iters), "--model", args.model, "--batch", str(args.batch)]
            procs.append(subprocess.Popen(argv_, env=env, cwd=report.REPO_ROOT))
        for proc in procs:
            proc.wait(timeout=args.timeout_s)
        if any(proc.returncode for proc in procs):
            raise SystemExit(f"a rank failed: {[proc.returncode for proc in procs]}")
        result = json.loads(out.read_text())
    record = {"date": started.isoformat(timespec="seconds"), "model": args.model, "batch": args.batch,
              "hardware": report.hardware(), "versions": report.versions(),
              "conditions": {"load_start": load_start, "load_end": [round(x, 2) for x in os.getloadavg()],
                             "wall_s": (datetime.datetime.now().astimezone() - started).total_seconds()},
              "result": result}
    md = markdown(record)
    paths = report.output_paths("p2-replan-cost", started.date(), args.results_dir)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    write_whole(paths["md"], md)
    write_whole(paths["json"], json.dumps(record) + "\n")
    print(md)
    print(f"wrote {paths['md']}, {paths['json']}")


if __name__ == "__main__":
    main()
