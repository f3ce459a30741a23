"""The result record (JSON), its schema check, the markdown table and the chart.

A record is self-describing: raw per-iteration times of every launch, the
summary tables, the machine, the software versions, the git commit and the
full configuration, so that a number can be traced and re-run later.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Any

from benchmarks import cpu_use, stats
from benchmarks.stats import Row
from dcredit_opt.files import write_whole

SCHEMA_VERSION = 2  # 2: rows carry speedup_ci and ratio_to_floor, results floor_s
REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


# -- environment -----------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def hardware() -> dict[str, Any]:
    mem = None
    try:
        with open("/proc/meminfo") as f:
            kib = int(f.readline().split()[1])  # first line: MemTotal
            mem = round(kib / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": mem,
        "machine": platform.machine(),
        "kernel": platform.release(),
        "gpus": _gpus(),
    }


def _gpus() -> str | None:
    """The machine's CUDA GPUs, e.g. "1x NVIDIA H200"; None without any."""
    try:
        import torch

        n = torch.cuda.device_count()
        return f"{n}x {torch.cuda.get_device_name(0)}" if n else None
    except (ImportError, RuntimeError):
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], check=False, cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _dist_version(name: str) -> str | None:
    # Package metadata, not an import: importing horovod or dcredit_opt would
    # load native libraries into the harness (and takes seconds).
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, Any]:
    import numpy
    import torch

    status = _git("status", "--porcelain")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "horovod": _dist_version("horovod"),
        "dcredit_opt": _dist_version("dcredit-opt"),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
    }


# -- record ------------------------------------------------------------------------


def row_to_dict(row: Row) -> dict[str, Any]:
    s = row.summary
    return {
        "scheme": row.scheme,
        "n": s.n if s else 0,
        "median_s": s.median_s if s else None,
        "q1_s": s.q1_s if s else None,
        "q3_s": s.q3_s if s else None,
        "min_s": s.min_s if s else None,
        "max_s": s.max_s if s else None,
        "speedup_vs_ddp": row.speedup_vs_ddp,
        "speedup_ci": list(row.speedup_ci) if row.speedup_ci else None,
        "ratio_to_bound": row.ratio_to_bound,
        "ratio_to_floor": row.ratio_to_floor,
        "note": row.note,
    }


# Required keys and their types; `None` allowed where the tuple has type(None).
_NUM = (int, float)
_OPT_NUM = (int, float, type(None))
SCHEMA: dict[str, Any] = {
    "schema_version": int,
    "name": str,
    "date": str,
    "config": {
        "models": list, "rates": list, "ranks": int, "iters": int, "warmup": int,
        "rounds": int, "schemes": list, "batch_sizes": dict, "threads": int,
        "network": str, "launch_timeout_s": _NUM, "argv": list,
    },
    "hardware": {"cpu_model": str, "cores": int},
    "versions": {"python": str, "torch": str, "git_commit": (str, type(None))},
    "networks": dict,
    "runs": [{
        "model": str, "rate": str, "round": int, "scheme": str, "status": str,
        "iter_times_s": list, "error": (str, type(None)), "wall_s": _NUM,
    }],
    "results": [{
        "model": str, "rate": str, "bound_s": _OPT_NUM, "floor_s": _OPT_NUM,
        "rows": [{
            "scheme": str, "n": int, "median_s": _OPT_NUM, "q1_s": _OPT_NUM,
            "q3_s": _OPT_NUM, "min_s": _OPT_NUM, "max_s": _OPT_NUM,
            "speedup_vs_ddp": _OPT_NUM, "speedup_ci": (list, type(None)), "ratio_to_bound": _OPT_NUM,
            "ratio_to_floor": _OPT_NUM, "note": str,
        }],
    }],
}
RUN_STATUSES = ("ok", "failed", "skipped")


def _check(value: Any, schema: Any, where: str, errors: list[str]) -> None:
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            errors.append(f"{where}: expected an object")
            return
        for key, sub in schema.items():
            if key not in value:
                errors.append(f"{where}.{key}: missing")
            else:
                _check(value[key], sub, f"{where}.{key}", errors)
    elif isinstance(schema, list):
        if not isinstance(value, list):
            errors.append(f"{where}: expected a list")
            return
        for i, item in enumerate(value):
            _check(item, schema[0], f"{where}[{i}]", errors)
    elif isinstance(value, bool) or not isinstance(value, schema):
        # bool is an int in Python; no field here is meant to hold one.
        errors.append(f"{where}: {type(value).__name__} is not {schema}")


def validate_record(record: dict) -> list[str]:
    """Problems with ``record`` (empty when it matches the schema)."""
    errors: list[str] = []
    _check(record, SCHEMA, "record", errors)
    if errors:
        return errors
    if record["schema_version"] != SCHEMA_VERSION:
        errors.append(f"record.schema_version: {record['schema_version']} != {SCHEMA_VERSION}")
    for i, run in enumerate(record["runs"]):
        if run["status"] not in RUN_STATUSES:
            errors.append(f"record.runs[{i}].status: {run['status']!r} not in {RUN_STATUSES}")
        if run["status"] == "ok" and not run["iter_times_s"]:
            errors.append(f"record.runs[{i}]: status ok without iteration times")
        if run["status"] != "ok" and not run["error"]:
            errors.append(f"record.runs[{i}]: status {run['status']} without a reason")
        if not all(isinstance(t, _NUM) and t >= 0 for t in run["iter_times_s"]):
            errors.append(f"record.runs[{i}].iter_times_s: non-numeric or negative time")
    return errors


def output_paths(name: str, date: datetime.date, results_dir: Path = RESULTS_DIR) -> dict[str, Path]:
    """``YYYY-MM-DD-<name>.{json,png,md}``; a numeric suffix keeps earlier runs of the day."""
    stem = f"{date.isoformat()}-{name}"
    n = 1
    while True:
        base = results_dir / (stem if n == 1 else f"{stem}-{n}")
        paths = {ext: base.with_suffix(f".{ext}") for ext in ("json", "png", "md")}
        if not any(p.exists() for p in paths.values()):
            return paths
        n += 1


def write_json(record: dict, path: Path) -> None:
    errors = validate_record(record)
    if errors:
        raise ValueError("result record does not match its schema:\n  " + "\n  ".join(errors))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, json.dumps(record, indent=1) + "\n")


# -- human-readable outputs ----------------------------------------------------------


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _sec(x: float | None, suffix: str = "") -> str:
    """Seconds: three decimals, or three significant digits under 0.1 s (a GPU's milliseconds)."""
    return _fmt(x, ".3f" if x is None or abs(x) >= 0.1 else "#.3g", suffix)


def speedup_text(speedup: float | None, ci) -> str:
    """"1.08x [1.02, 1.15]"; an interval that holds 1.0 is read as no difference, and says so."""
    if speedup is None:
        return "-"
    if not ci:
        return f"{speedup:.2f}x"
    lo, hi = ci
    verdict = " no difference" if lo <= 1.0 <= hi else ""
    return f"{speedup:.2f}x [{lo:.2f}, {hi:.2f}]{verdict}"


def markdown_table(result: dict) -> str:
    """One (model, rate) result as a markdown table."""
    head = (f"### {result['model']} @ {result['rate']}  "
            f"(bound max(compute, comm) = {_sec(result['bound_s'], ' s')}; synchronous floor = "
            f"{_sec(result.get('floor_s'), ' s')})\n\n"
            "| scheme | n | median (s) | IQR (s) | min-max (s) | speedup vs DDP [95 % CI] "
            "| ratio to bound | ratio to floor | note |\n|---|---:|---:|---:|---:|---:|---:|---:|---|\n")
    lines = []
    for r in result["rows"]:
        iqr = None if r["q1_s"] is None else r["q3_s"] - r["q1_s"]
        span = "-" if r["min_s"] is None else f"{_sec(r['min_s'])}-{_sec(r['max_s'])}"
        note = r["note"].replace("|", "/").replace("\n", " ")[:120]
        lines.append(
            f"| {r['scheme']} | {r['n']} | {_sec(r['median_s'])} | {_sec(iqr)} "
            f"| {span} | {speedup_text(r['speedup_vs_ddp'], r.get('speedup_ci'))} "
            f"| {_fmt(r['ratio_to_bound'], '.2f', 'x')} | {_fmt(r.get('ratio_to_floor'), '.2f', 'x')} | {note} |")
    return head + "\n".join(lines) + "\n"


def phase_table(runs: list[dict], model: str, rate: str) -> str:
    """Medians of rank 0's forward, backward and step times per scheme, pooled over rounds ("" when none)."""
    pooled: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        if run["model"] == model and run["rate"] == rate and run.get("phases_s"):
            mine = pooled.setdefault(run["scheme"], {})
            for phase, times in run["phases_s"].items():
                mine.setdefault(phase, []).extend(times)
    if not pooled:
        return ""
    lines = ["Where rank 0's iteration goes (medians; a lazy step waits in the next forward):\n",
             "| scheme | forward (s) | backward (s) | step (s) |", "|---|---:|---:|---:|"]
    for scheme, phases in pooled.items():
        cells = " | ".join(_sec(statistics.median(phases[p]) if phases.get(p) else None)
                           for p in ("forward", "backward", "step"))
        lines.append(f"| {scheme} | {cells} |")
    return "\n".join(lines) + "\n"


def cpu_table(runs: list[dict], model: str, rate: str) -> str:
    """Rank 0's CPU seconds per timed iteration by kind of thread (``benchmarks/cpu_use.py``), medians over
    launches per scheme, beside the median iteration ("" when no run recorded them).

    ``vs DDP`` is a scheme's total over DDP's (below 1: less CPU than DDP), with a bootstrap interval over
    launches: what a scheme adds around the same compute, told apart from the waiting that wall time also
    holds (on a shared two-core machine its interval has come out about as wide as wall time's).
    """
    pooled: dict[str, dict[str, list[float]]] = {}
    iters: dict[str, list[float]] = {}
    for run in runs:
        if run["model"] == model and run["rate"] == rate and run.get("cpu_s_per_iter"):
            mine = pooled.setdefault(run["scheme"], {})
            for kind, seconds in run["cpu_s_per_iter"].items():
                mine.setdefault(kind, []).append(seconds)
            mine.setdefault("total", []).append(sum(run["cpu_s_per_iter"].values()))
            iters.setdefault(run["scheme"], []).extend(run["iter_times_s"])
    if not pooled:
        return ""
    lines = [("Rank 0's CPU per iteration, by thread (medians over launches; `busy`: CPU seconds per second of "
             "iteration, where 1.0 is one core; `vs DDP`: total CPU over DDP's, with a 95 % interval over "
             "launches):\n"),
             "| scheme | training (s) | comm. library (s) | dcredit_opt (s) | other (s) | total (s) | busy | vs DDP |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    ddp = pooled.get("ddp", {}).get("total")
    ddp_median = statistics.median(ddp) if ddp else 0.0
    for scheme, kinds in pooled.items():
        med = {k: statistics.median(v) for k, v in kinds.items()}
        cells = " | ".join(_sec(med.get(k)) for k in (*cpu_use.KINDS, "total"))
        busy = med["total"] / statistics.median(iters[scheme]) if iters.get(scheme) else None
        versus = "-"
        if scheme != "ddp" and ddp_median > 0:
            ratio = med["total"] / ddp_median
            ci = stats.speedup_interval([[x] for x in kinds["total"]], [[x] for x in ddp])
            versus = f"{ratio:.2f}x" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
        lines.append(f"| {scheme} | {cells} | {_fmt(busy, '.2f', '')} | {versus} |")
    return "\n".join(lines) + "\n"


def _conditions(cond: dict | None) -> str:
    if not cond:
        return "- load: not recorded"
    start, end = cond["load_avg_1_5_15_start"], cond["load_avg_1_5_15_end"]
    return (f"- machine load (1-min average) at start {start[0]:.2f}, at end {end[0]:.2f}; "
            f"run took {cond['wall_s']:.0f} s")


def markdown_report(record: dict) -> str:
    cfg, hw, ver = record["config"], record["hardware"], record["versions"]
    out = [
        f"# Benchmark {record['name']} ({record['date']})\n",
        f"- machine: {hw['cpu_model']}, {hw['cores']} cores"
        + (f"; {hw['gpus']}" if hw.get("gpus") else ""),
        f"- versions: python {ver['python']}, torch {ver['torch']}, "
        f"horovod {ver.get('horovod') or 'not installed'}, commit {ver['git_commit'] or 'none'}"
        + (" (dirty)" if ver.get("git_dirty") else ""),
        f"- network: {cfg['network']}, {cfg['ranks']} ranks, rates {', '.join(cfg['rates'])}"
        + (", ranks on GPUs (NCCL)" if cfg.get("device") == "cuda" else ""),
        (f"- {cfg['iters']} timed iterations after {cfg['warmup']} warm-up, per launch; "
         f"{cfg['rounds']} rounds; {cfg['threads']} thread(s) per rank"),
        f"- batch sizes per rank: {cfg['batch_sizes']}",
        _conditions(record.get("conditions")),
        ("- iteration time: wall time between consecutive `opt.step()` returns on rank 0; "
         "`compute` is one rank without communication, `comm` one flat all-reduce of all "
         "gradients without compute"),
        "",
    ]
    for result in record["results"]:
        out.append(markdown_table(result))
        phases = phase_table(record["runs"], result["model"], result["rate"])
        if phases:
            out.append(phases)
        cpu = cpu_table(record["runs"], result["model"], result["rate"])
        if cpu:
            out.append(cpu)
    return "\n".join(out)


def plot(record: dict, path: Path) -> None:
    """Bar chart: median iteration time per scheme, one panel per (model, rate)."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    results = record["results"]
    if not results:
        return
    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 4), squeeze=False)
    for ax, res in zip(axes[0], results):
        rows = [r for r in res["rows"] if r["median_s"] is not None]
        names = [r["scheme"] for r in rows]
        med = [r["median_s"] for r in rows]
        # Error bars show the interquartile range around the median.
        err = [[r["median_s"] - r["q1_s"] for r in rows], [r["q3_s"] - r["median_s"] for r in rows]]
        colors = ["0.7" if n in ("compute", "comm") else "C0" for n in names]
        ax.bar(range(len(rows)), med, yerr=err, color=colors, capsize=3)
        if res["bound_s"] is not None:
            ax.axhline(res["bound_s"], color="C3", linestyle="--", label="max(compute, comm)")
            ax.legend(loc="upper left", fontsize=8)
        ax.set_xticks(range(len(rows)), names, rotation=45, ha="right", fontsize=8)
        ax.set_title(f"{res['model']} @ {res['rate']}")
        ax.set_ylabel("iteration time (s), median and IQR")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
