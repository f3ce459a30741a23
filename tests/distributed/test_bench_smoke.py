"""The benchmark harness end to end: real ranks on loopback, the tiny model.

Checks behaviour (launches run, the record is complete and valid), never
speed: a benchmark is not a timed test, and every limit here only stops a
hang.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import timing

REPO_ROOT = Path(__file__).resolve().parents[2]
ITERS, WARMUP, ROUNDS = 3, 1, 2
# Limits in seconds for a busy machine, times DC_TEST_TIME_SCALE where used
# (tests/timing.py). A launch is fresh interpreters importing torch and a
# few iterations of the tiny model: measured 5-35 s on a 2-core machine at
# load 5-7, up to 50 s at load 9-11, and past 90 s at load 6-8 on a fresh
# clone. So each launch gets the harness's own default limit.
LAUNCH_LIMIT_S = 300
# The harness's own work besides the launches: imports, report, plot.
HARNESS_OVERHEAD_S = 300
# dcredit_opt's collective timeout in the dc-* launches: the patience the
# worker gives the other schemes' process groups (PG_TIMEOUT_S), so that a
# rank slowed by other jobs is not taken for a dead one.
DC_TIMEOUT_S = 180


def harness_limit_s(schemes: int) -> float:
    """Every launch may run up to its own limit: this one never fires before those would."""
    return schemes * ROUNDS * LAUNCH_LIMIT_S + HARNESS_OVERHEAD_S


@pytest.fixture
def report(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from benchmarks import report

    return report


def run_harness(tmp_path: Path, schemes: list[str]) -> dict:
    argv = [sys.executable, "-m", "benchmarks.harness", "--models", "tiny",
            "--network", "loopback", "--ranks", "2", "--iters", str(ITERS),
            "--warmup", str(WARMUP), "--rounds", str(ROUNDS), "--schemes", ",".join(schemes),
            "--results-dir", str(tmp_path), "--name", "smoke", "--no-progress",
            "--launch-timeout-s", f"{timing.scaled(LAUNCH_LIMIT_S):g}"]
    env = dict(os.environ, DCREDIT_TIMEOUT_S=f"{timing.scaled(DC_TIMEOUT_S):g}")
    proc = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timing.scaled(harness_limit_s(len(schemes))), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = tmp_path.glob("*-smoke.json")
    assert path.with_suffix(".md").exists() and path.with_suffix(".png").exists()
    return json.loads(path.read_text())


def check_record(record: dict, report, schemes: list[str]) -> None:
    assert report.validate_record(record) == []
    assert record["config"]["schemes"] == schemes
    assert record["config"]["network"].startswith("loopback")
    assert record["hardware"]["cores"] >= 1 and record["versions"]["torch"]
    runs = record["runs"]
    # Interleaved: every scheme once per round, in order.
    assert [r["scheme"] for r in runs] == schemes * ROUNDS
    assert [r["round"] for r in runs] == [k for k in range(ROUNDS) for _ in schemes]
    for r in runs:
        assert r["status"] == "ok", r["error"]
        assert len(r["iter_times_s"]) == ITERS
        assert all(t > 0 for t in r["iter_times_s"])
        # Every scheme here trains: rank 0's phases of the same timed iterations.
        assert sorted(r["phases_s"]) == ["backward", "forward", "step"]
        assert all(len(v) == ITERS and min(v) >= 0 for v in r["phases_s"].values())
        assert all(sum(p) <= t * 1.01 for *p, t in zip(*r["phases_s"].values(), r["iter_times_s"]))
    (res,) = record["results"]
    rows = {row["scheme"]: row for row in res["rows"]}
    assert set(rows) == set(schemes)
    for row in rows.values():
        assert row["n"] == ITERS * ROUNDS
        assert row["min_s"] <= row["median_s"] <= row["max_s"]
    assert res["bound_s"] == rows["compute"]["median_s"]  # no `comm` run: compute alone


@pytest.mark.timeout(harness_limit_s(2) + 60)  # scaled in tests/conftest.py
def test_harness_compute_and_ddp(tmp_path, report):
    schemes = ["compute", "ddp"]
    record = run_harness(tmp_path, schemes)
    check_record(record, report, schemes)
    ddp = next(r for r in record["results"][0]["rows"] if r["scheme"] == "ddp")
    assert ddp["speedup_vs_ddp"] == 1.0


@pytest.mark.timeout(harness_limit_s(3) + 60)  # scaled in tests/conftest.py
def test_harness_dcredit(tmp_path, report):
    pytest.importorskip("dcredit_opt._C", reason="the C++ runtime is not built")
    import dcredit_opt as dc

    missing = [n for n in ("init", "Config", "DistributedOptimizer") if not hasattr(dc, n)]
    if missing:
        pytest.skip(f"dcredit_opt does not provide {missing} yet")
    schemes = ["compute", "ddp", "dc-dcredit"]
    check_record(run_harness(tmp_path, schemes), report, schemes)


@pytest.mark.timeout(600)
def test_replan_cost_runs_its_checks_end_to_end(tmp_path):
    """benchmarks/replan_cost.py wraps the replanner's own calls to time them: a change of their arguments must
    show here, not in the next measurement (it once broke at the first check with a TypeError)."""
    argv = [sys.executable, "-m", "benchmarks.replan_cost", "--iters", "30", "--model", "tiny", "--batch", "8",
            "--results-dir", str(tmp_path), "--timeout-s", f"{timing.scaled(LAUNCH_LIMIT_S):g}"]
    env = dict(os.environ, DCREDIT_TIMEOUT_S=f"{timing.scaled(DC_TIMEOUT_S):g}")
    proc = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timing.scaled(LAUNCH_LIMIT_S + HARNESS_OVERHEAD_S), check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("*-p2-replan-cost.json")
    result = json.loads(path.read_text())["result"]
    assert len(result["on_s"]) == 30 and len(result["off_s"]) == 30
    assert len(result["gather_s"]) >= 2, "the checks' all-gathers were not timed"  # a check every 10 steps
    assert "**re-plans**" in path.with_suffix(".md").read_text()


@pytest.mark.timeout(900)
def test_host_cost_runs_every_way_with_every_loop_option():
    """benchmarks/host_cost.py, every way taking turns in one process with each of its loop's options at once
    (zero_grad to zeros, a clip, two passes per step: DDP under no_sync() before the last): it runs to its
    summary and phase table, and says what it measured."""
    argv = [sys.executable, "-m", "benchmarks.host_cost", "--model", "mlp", "--together", "--rounds", "2", "--block",
            "3", "--ways", "plain,ddp,dc", "--zero-grad", "zeros", "--clip", "--passes", "2"]
    proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timing.scaled(LAUNCH_LIMIT_S + HARNESS_OVERHEAD_S), check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "zero_grad to zeros, clip_grad_norm_, 2 passes per step (100 parameter tensors)" in out, out
    assert "dc / plain:" in out and "dc / ddp:" in out and "collectives per iteration" in out, out
    assert all(f"  {phase} " in out for phase in ("zero_grad", "forward", "backward", "step")), out
