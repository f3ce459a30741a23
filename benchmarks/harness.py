"""Benchmark harness: every scheme on every (model, rate), interleaved, over real ranks.

    python -m benchmarks.harness --models vgg,gpt --rates 1gbit --ranks 2 \\
        --iters 20 --warmup 3 --rounds 3 --schemes compute,comm,ddp,dc-dcredit

For each rate the harness builds a rate-limited namespace network
(:mod:`benchmarks.netem`; loopback when that is impossible), then launches
one process group per (model, round, scheme): ``benchmarks.worker`` once per
rank, inside the rank's namespace. Schemes run interleaved, A B C A B C, so
that drift hits them alike. A scheme that fails (or is unavailable, like
Horovod when it is not installed) is recorded with its reason and skipped for
the rest of that (model, rate); the run goes on.

Outputs, in ``--results-dir`` (default ``benchmarks/results``):
``YYYY-MM-DD-<name>.json`` (raw times, hardware, versions, configuration),
``.md`` (the tables) and ``.png`` (a bar chart).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import report
from benchmarks.models import MODELS
from benchmarks.netem import MAX_RANKS, Network, open_network, parse_rate, rank_env
from benchmarks.stats import Launch, median, schedule, table
from benchmarks.worker import SCHEMES, uses_horovod
from dcredit_opt.files import write_whole

DEFAULT_SCHEMES = SCHEMES
# After one rank fails, how long the others get to notice and exit on their
# own before they are killed (their peers are gone; waiting longer is waste).
FAIL_GRACE_S = 15.0
POLL_S = 0.1
LOG_TAIL_CHARS = 1500


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _batch_sizes(text: str) -> dict[str, int]:
    out = {}
    for item in _csv(text):
        name, _, value = item.partition("=")
        if name not in MODELS or not value.isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(f"bad batch size {item!r}; expected model=N")
        out[name] = int(value)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.harness",
                                description=__doc__.split("\n")[0])
    p.add_argument("--models", type=_csv, default=["vgg", "gpt"],
                   help=f"comma-separated, from {','.join(MODELS)}")
    p.add_argument("--rates", type=_csv, default=["1gbit"],
                   help="comma-separated tc rates per link and direction, e.g. 1gbit,10gbit")
    p.add_argument("--ranks", type=int, default=2, help=f"1..{MAX_RANKS}")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per launch")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations per launch")
    p.add_argument("--rounds", type=int, default=3, help="launches per scheme, interleaved")
    p.add_argument("--schemes", type=_csv, default=list(DEFAULT_SCHEMES),
                   help=f"comma-separated, from {','.join(SCHEMES)}")
    p.add_argument("--batch-sizes", type=_batch_sizes, default={},
                   help="per-rank overrides, e.g. vgg=32,gpt=4")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: one GPU per rank, NCCL between ranks (Horovod's schemes run on CPUs only)")
    p.add_argument("--network", choices=("auto", "netns", "loopback"), default="auto",
                   help="auto: namespaces when root, else loopback (unlimited, with a warning)")
    p.add_argument("--launch-timeout-s", type=float, default=300.0,
                   help="kill a launch (all its ranks) after this long")
    p.add_argument("--name", default=None, help="result file name; default from the config")
    p.add_argument("--results-dir", type=Path, default=report.RESULTS_DIR)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        p.error(f"unknown models {unknown}; choose from {sorted(MODELS)}")
    bad = [s for s in args.schemes if s not in SCHEMES]
    if bad:
        p.error(f"unknown schemes {bad}; choose from {list(SCHEMES)}")
    if len(set(args.schemes)) != len(args.schemes):
        p.error("--schemes lists a scheme twice")
    for rate in args.rates:
        try:
            parse_rate(rate)
        except ValueError as exc:
            p.error(str(exc))
    if not 1 <= args.ranks <= MAX_RANKS:
        p.error(f"--ranks must be 1..{MAX_RANKS}")
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < args.ranks:
            p.error(f"--device cuda needs one GPU per rank: {args.ranks} ranks, "
                    f"{torch.cuda.device_count()} GPU(s) here")
        on_horovod = [s for s in args.schemes if uses_horovod(s)]
        if on_horovod:
            p.error(f"schemes {on_horovod} run on CPUs only in this benchmark; drop them with --device cuda")
    if args.iters < 1 or args.warmup < 0 or args.rounds < 1 or args.threads < 1:
        p.error("--iters, --rounds, --threads must be >= 1 and --warmup >= 0")
    if not args.models or not args.rates or not args.schemes:
        p.error("--models, --rates and --schemes must not be empty")
    if args.name is None:
        args.name = f"{'-'.join(args.models)}-{'-'.join(args.rates)}-{args.ranks}r"
    return args


def horovod_unavailable() -> str | None:
    """Why the ``horovod`` scheme cannot run here, or None when it can."""
    try:
        proc = subprocess.run([sys.executable, "-c", "import horovod.torch"],
                              check=False, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "`import horovod.torch` timed out"
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or ["unknown error"])[-1]
    return f"`import horovod.torch` failed: {last}"


@dataclass
class RunResult:
    launch: Launch
    status: str  # ok | failed | skipped
    iter_times_s: list[float] = field(default_factory=list)
    error: str | None = None
    wall_s: float = 0.0
    batch_size: int | None = None
    params: int | None = None
    final_loss: float | None = None
    phases_s: dict[str, list[float]] | None = None
    profile: dict | None = None  # a dcredit run's own measurement (per-tensor times, alpha, beta), rank 0
    cpu_s_per_iter: dict[str, float] | None = None  # rank 0's CPU per timed iteration by kind of thread

    def to_dict(self) -> dict:
        d = {k: v for k, v in vars(self).items() if k != "launch"}
        return {**vars(self.launch), **d}


def _error_line(log_text: str) -> str | None:
    """The last ``SomeError: message`` line of a rank's log, without torch's ``[rankN]:``."""
    for line in reversed(log_text.splitlines()):
        line = re.sub(r"^\[rank\d+\]:\s*", "", line).strip()
        if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b.*:", line):
            return line[:300]
    return None


def _log_tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except OSError:
        return ""


def run_launch(net: Network, launch: Launch, args: argparse.Namespace, workdir: Path,
               index: int) -> RunResult:
    """Start every rank of one launch, wait (bounded), and read rank 0's record."""
    world = 1 if launch.scheme == "compute" else args.ranks
    port = net.next_port()
    tag = f"{index:04d}-{launch.model}-{launch.scheme}"
    out = workdir / f"{tag}.json"
    batch = args.batch_sizes.get(launch.model)
    procs, logs = [], []
    t0 = time.monotonic()
    for ep in net.endpoints[:world]:
        env = dict(os.environ, **rank_env(ep, world, net.master_addr, port))
        env["OMP_NUM_THREADS"] = str(args.threads)
        env["PYTHONFAULTHANDLER"] = "1"  # a rank that dies of a signal prints every thread's stack
        env["PYTHONPATH"] = os.pathsep.join(
            x for x in (str(report.REPO_ROOT), os.environ.get("PYTHONPATH")) if x)
        argv = [sys.executable, "-m", "benchmarks.worker", "--scheme", launch.scheme,
                "--model", launch.model, "--iters", str(args.iters),
                "--warmup", str(args.warmup), "--threads", str(args.threads), "--device", args.device,
                "--out", str(out)]
        if batch:
            argv += ["--batch-size", str(batch)]
        log = workdir / f"{tag}-r{ep.rank}.log"
        logs.append(log)
        with open(log, "w") as f:
            procs.append(subprocess.Popen(ep.wrap(argv), env=env, cwd=report.REPO_ROOT,
                                          stdout=f, stderr=subprocess.STDOUT))
    error = _wait_all(procs, args.launch_timeout_s)
    wall = time.monotonic() - t0

    record = {}
    if out.exists():
        try:
            record = json.loads(out.read_text())
        except json.JSONDecodeError as exc:
            error = error or f"unreadable worker record: {exc}"
    if record.get("error"):
        error = record["error"]
    elif error is None and not record.get("iter_times_s"):
        error = "rank 0 wrote no iteration times"
    if error is not None:
        tail_texts = [_log_tail(p) for p in logs]
        if not record.get("error"):
            # Rank 0 wrote nothing useful: name the first rank's own exception.
            cause = next((c for c in map(_error_line, tail_texts) if c), None)
            error = f"{error}: {cause}" if cause else error
        tails = "\n".join(f"--- rank {r} log tail ---\n{t}" for r, t in enumerate(tail_texts))
        return RunResult(launch, "failed", error=f"{error}\n{tails}", wall_s=wall,
                         batch_size=record.get("batch_size"), params=record.get("params"))
    return RunResult(launch, "ok", [float(t) for t in record["iter_times_s"]], None, wall,
                     record.get("batch_size"), record.get("params"), record.get("final_loss"),
                     record.get("phases_s"), record.get("profile"), record.get("cpu_s_per_iter"))


def stop_all(procs: list[subprocess.Popen]) -> None:
    """Kill every rank still running, and reap it."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> str | None:
    """Wait for every rank; None when all exited 0, else why not. Never hangs."""
    deadline = time.monotonic() + timeout_s
    first_failure = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad and first_failure is None:
                first_failure = now
            if now > deadline:
                return f"timed out after {timeout_s:.0f} s"
            if first_failure is not None and now - first_failure > FAIL_GRACE_S:
                r, c = bad[0]
                return f"rank {r} exited with status {c}; the other ranks were killed"
            time.sleep(POLL_S)
    finally:
        stop_all(procs)
    bad = [(r, c) for r, c in enumerate(codes) if c != 0]
    if bad:
        return "; ".join(f"rank {r} exited with status {c}" for r, c in bad)
    return None


def floor_s(profiles: list[dict]) -> float | None:
    """The synchronous floor (``planner.floors.synchronous_floor``) of the dcredit runs' own measurements
    of this model and link, per-tensor times and the network's alpha and beta: their median; None without."""
    from dcredit_opt.planner.floors import synchronous_floor
    from dcredit_opt.planner.profile import Profile

    floors = [synchronous_floor(Profile.from_dict(p)) for p in profiles]
    return median(floors) if floors else None


def summarize_runs(runs: list[RunResult], models: list[str], rates: list[str],
                   schemes: list[str]) -> list[dict]:
    """Per (model, rate): pool the rounds' times per scheme and tabulate."""
    results = []
    for rate in rates:
        for model in models:
            mine = [r for r in runs if r.launch.model == model and r.launch.rate == rate]
            times: dict[str, list[float]] = {}
            launches: dict[str, list[list[float]]] = {}
            # DeFT trains differently (delayed updates): its row says so, whatever else it says.
            notes: dict[str, str] = {"dc-deft": "delayed updates: not synchronous training"} if "dc-deft" in schemes \
                else {}
            for r in mine:
                if r.status == "ok":
                    times.setdefault(r.launch.scheme, []).extend(r.iter_times_s)
                    launches.setdefault(r.launch.scheme, []).append(list(r.iter_times_s))
                elif r.launch.scheme not in notes or r.launch.scheme == "dc-deft":
                    notes[r.launch.scheme] = f"{r.status}: {(r.error or 'unknown').splitlines()[0]}"
            # The floor of full-precision synchronous training: profiles of compressed runs (fp16 on the wire,
            # half the bytes) would lower it, and a compressed scheme may legitimately beat it.
            floor = floor_s([r.profile for r in mine if r.status == "ok" and r.profile
                             and not r.launch.scheme.endswith("-fp16") and r.launch.scheme != "dc-deft"])
            rows, bound = table(times, schemes, notes, launches, floor)
            results.append({"model": model, "rate": rate, "bound_s": bound, "floor_s": floor,
                            "rows": [report.row_to_dict(row) for row in rows]})
    return results


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from tqdm import tqdm

    launches = schedule(args.models, args.rates, args.schemes, args.rounds)
    unavailable: dict[str, str] = {}
    needs_horovod = [s for s in args.schemes if uses_horovod(s)]
    if needs_horovod:
        why = horovod_unavailable()
        if why:
            for scheme in needs_horovod:
                unavailable[scheme] = why
                print(f"skipping scheme {scheme}: {why}", file=sys.stderr)

    runs: list[RunResult] = []
    networks: dict[str, dict] = {}
    failed: dict[tuple[str, str, str], str] = {}  # (model, rate, scheme) -> first error
    started = datetime.datetime.now().astimezone()
    # Other work on the machine skews every number; record how busy it was.
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="dcbench-") as tmp, \
            tqdm(total=len(launches), disable=args.no_progress, unit="launch") as bar:
        workdir = Path(tmp)
        for rate in args.rates:
            with open_network(args.ranks, rate, args.network) as net:
                networks[rate] = net.describe()
                for i, launch in enumerate(launches):
                    if launch.rate != rate:
                        continue
                    bar.set_postfix_str(f"{launch.model} {rate} r{launch.round} {launch.scheme}")
                    key = (launch.model, rate, launch.scheme)
                    if launch.scheme in unavailable:
                        res = RunResult(launch, "skipped", error=unavailable[launch.scheme])
                    elif key in failed:
                        res = RunResult(launch, "skipped",
                                        error=f"failed in an earlier round: {failed[key]}")
                    else:
                        res = run_launch(net, launch, args, workdir, i)
                        if res.status == "failed":
                            failed[key] = res.error.splitlines()[0]
                            tqdm.write(f"scheme {launch.scheme} on {launch.model} @ {rate} "
                                       f"failed, skipped from now on:\n{res.error}",
                                       file=sys.stderr)
                    runs.append(res)
                    bar.update(1)

    batch_sizes = {m: next((r.batch_size for r in runs if r.launch.model == m and r.batch_size),
                           args.batch_sizes.get(m, MODELS[m].default_batch))
                   for m in args.models}
    kinds = {n["kind"] for n in networks.values()}
    net_desc = "netns (tc tbf rate-limited)" if kinds == {"NamespaceNetwork"} else \
        "loopback (NOT rate-limited)"
    record = {
        "schema_version": report.SCHEMA_VERSION,
        "name": args.name,
        "date": started.isoformat(timespec="seconds"),
        "config": {
            "models": args.models, "rates": args.rates, "ranks": args.ranks,
            "iters": args.iters, "warmup": args.warmup, "rounds": args.rounds,
            "schemes": args.schemes, "batch_sizes": batch_sizes, "threads": args.threads,
            "network": net_desc, "device": args.device, "launch_timeout_s": args.launch_timeout_s,
            "argv": sys.argv[1:] if argv is None else list(argv),
            "unavailable_schemes": unavailable,
        },
        "hardware": report.hardware(),
        "versions": report.versions(),
        "networks": networks,
        "conditions": {"load_avg_1_5_15_start": load_start,
                       "load_avg_1_5_15_end": os.getloadavg(),
                       "wall_s": round((datetime.datetime.now().astimezone() - started)
                                       .total_seconds(), 1)},
        "runs": [r.to_dict() for r in runs],
        "results": summarize_runs(runs, args.models, args.rates, args.schemes),
    }
    paths = report.output_paths(args.name, started.date(), args.results_dir)
    report.write_json(record, paths["json"])
    md = report.markdown_report(record)
    write_whole(paths["md"], md)
    report.plot(record, paths["png"])
    print(md)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    # The simulator against this run: predicted vs measured per scheme, beside the results.
    calibration = paths["json"].with_name(paths["json"].stem + "-calibration.md")
    try:
        from benchmarks import calibrate

        calibrate.main([str(paths["json"]), "--out", str(calibration)])
        print(f"wrote {calibration}")
    except (ValueError, KeyError, statistics.StatisticsError, SystemExit) as e:  # no compute/comm, no profile
        print(f"no calibration table for this run: {type(e).__name__}: {e}", file=sys.stderr)
    return record


if __name__ == "__main__":
    main()
