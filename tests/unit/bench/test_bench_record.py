import copy
import datetime
import json
import subprocess
import sys

import pytest

from benchmarks import harness, report
from benchmarks.harness import RunResult
from benchmarks.stats import Launch


def _runs():
    runs = []
    for rnd in range(2):
        for scheme, t in (("compute", 0.5), ("comm", 1.0), ("ddp", 1.4)):
            runs.append(RunResult(Launch("vgg", "1gbit", rnd, scheme), "ok",
                                  [t, t + 0.1, t - 0.1], None, 9.0, 16, 34_000_000, 2.3))
        runs.append(RunResult(Launch("vgg", "1gbit", rnd, "horovod"), "skipped",
                              error="`import horovod.torch` failed"))
    runs.append(RunResult(Launch("vgg", "1gbit", 0, "dc-dcredit"), "failed",
                          error="AttributeError: no init\n--- rank 0 log tail ---\n...", wall_s=3.0))
    runs.append(RunResult(Launch("vgg", "1gbit", 1, "dc-dcredit"), "skipped",
                          error="failed in an earlier round: AttributeError: no init"))
    return runs


def make_record():
    schemes = ["compute", "comm", "ddp", "horovod", "dc-dcredit"]
    runs = _runs()
    return {
        "schema_version": report.SCHEMA_VERSION,
        "name": "test",
        "date": "2026-01-02T03:04:05+00:00",
        "config": {
            "models": ["vgg"], "rates": ["1gbit"], "ranks": 2, "iters": 3, "warmup": 1,
            "rounds": 2, "schemes": schemes, "batch_sizes": {"vgg": 16}, "threads": 1,
            "network": "loopback (NOT rate-limited)", "launch_timeout_s": 300.0,
            "argv": ["--models", "vgg"],
        },
        "hardware": report.hardware(),
        "versions": {"python": "3.11", "torch": "2.13.0", "git_commit": None},
        "networks": {"1gbit": {"kind": "LoopbackNetwork"}},
        "runs": [r.to_dict() for r in runs],
        "results": harness.summarize_runs(runs, ["vgg"], ["1gbit"], schemes),
    }


def test_summarize_runs_pools_rounds_and_keeps_reasons():
    (res,) = make_record()["results"]
    assert res["bound_s"] == pytest.approx(1.0)
    by = {r["scheme"]: r for r in res["rows"]}
    assert by["ddp"]["n"] == 6 and by["ddp"]["median_s"] == pytest.approx(1.4)
    assert by["ddp"]["ratio_to_bound"] == pytest.approx(1.4)
    assert by["horovod"]["note"].startswith("skipped: `import horovod.torch` failed")
    # The first line of the first failure, not the log tail.
    assert by["dc-dcredit"]["note"] == "failed: AttributeError: no init"


def test_record_is_valid_and_round_trips_through_json():
    rec = make_record()
    assert report.validate_record(rec) == []
    again = json.loads(json.dumps(rec))
    assert report.validate_record(again) == []
    assert again["runs"][0]["iter_times_s"] == pytest.approx([0.5, 0.6, 0.4])


def test_hardware_has_cpu_and_cores():
    hw = report.hardware()
    assert isinstance(hw["cpu_model"], str) and hw["cpu_model"]
    assert isinstance(hw["cores"], int) and hw["cores"] >= 1


@pytest.mark.parametrize("mutate,expect", [
    (lambda r: r.pop("hardware"), "record.hardware: missing"),
    (lambda r: r["config"].pop("rounds"), "record.config.rounds: missing"),
    (lambda r: r["config"].update(ranks="2"), "record.config.ranks"),
    (lambda r: r["config"].update(ranks=True), "record.config.ranks"),
    (lambda r: r["runs"][0].update(status="great"), "status"),
    (lambda r: r["runs"][0].update(iter_times_s=[]), "without iteration times"),
    (lambda r: r["runs"][0].update(iter_times_s=[0.1, -1.0]), "negative"),
    (lambda r: r["runs"][3].update(error=None), "without a reason"),
    (lambda r: r["results"][0]["rows"][0].pop("median_s"), "median_s: missing"),
    (lambda r: r.update(schema_version=99), "schema_version"),
])
def test_validate_record_catches(mutate, expect):
    rec = copy.deepcopy(make_record())
    mutate(rec)
    errors = report.validate_record(rec)
    assert any(expect in e for e in errors), errors


def test_write_json_refuses_an_invalid_record(tmp_path):
    rec = make_record()
    del rec["versions"]
    with pytest.raises(ValueError, match="versions"):
        report.write_json(rec, tmp_path / "x.json")
    assert not (tmp_path / "x.json").exists()


def test_output_paths_are_dated_and_never_overwrite(tmp_path):
    day = datetime.date(2026, 3, 4)
    p1 = report.output_paths("vgg-1gbit-2r", day, tmp_path)
    assert p1["json"].name == "2026-03-04-vgg-1gbit-2r.json"
    assert {p.suffix for p in p1.values()} == {".json", ".png", ".md"}
    p1["md"].write_text("x")
    p2 = report.output_paths("vgg-1gbit-2r", day, tmp_path)
    assert p2["json"].name == "2026-03-04-vgg-1gbit-2r-2.json"


def test_markdown_and_plot(tmp_path):
    rec = make_record()
    md = report.markdown_report(rec)
    assert "| ddp | 6 | 1.400 |" in md
    assert "1.40x" in md  # DDP's ratio to the bound
    assert "NOT rate-limited" in md
    report.plot(rec, tmp_path / "chart.png")
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_phase_table_pools_rounds_per_scheme():
    runs = [r.to_dict() for r in _runs()]
    assert report.phase_table(runs, "vgg", "1gbit") == ""  # no run recorded phases
    for rnd, run in enumerate(r for r in runs if r["scheme"] == "ddp"):
        run["phases_s"] = {"forward": [0.1 + rnd], "backward": [0.2 + rnd], "step": [0.05]}
    table = report.phase_table(runs, "vgg", "1gbit")
    assert "| ddp | 0.600 | 0.700 | 0.0500 |" in table  # medians of the two rounds
    assert "compute" not in table
    assert report.phase_table(runs, "gpt", "1gbit") == ""
    rec = make_record()
    rec["runs"] = runs
    assert report.validate_record(rec) == []
    assert "| ddp | 0.600 | 0.700 | 0.0500 |" in report.markdown_report(rec)


def test_cpu_table_shows_medians_by_kind_of_thread_and_how_busy_rank_0_was():
    runs = [r.to_dict() for r in _runs()]
    assert report.cpu_table(runs, "vgg", "1gbit") == ""  # no run recorded CPU use
    for rnd, run in enumerate(r for r in runs if r["scheme"] == "ddp"):  # iterations 1.3, 1.4, 1.5 s
        run["cpu_s_per_iter"] = {"training": 1.0 + rnd, "library": 0.2, "dcredit_opt": 0.0, "other": 0.0}
    table = report.cpu_table(runs, "vgg", "1gbit")
    # medians of the two launches: training 1.5, library 0.2, total 1.7 s per 1.4 s iteration
    assert "| ddp | 1.500 | 0.200 | 0.00 | 0.00 | 1.700 | 1.21 | - |" in table
    assert "compute" not in table
    for rnd, run in enumerate(r for r in runs if r["scheme"] == "comm"):  # iterations 0.9, 1.0, 1.1 s
        run["cpu_s_per_iter"] = {"training": 0.5 + 0.2 * rnd, "library": 0.3, "dcredit_opt": 0.05, "other": 0.0}
    table = report.cpu_table(runs, "vgg", "1gbit")
    # totals 0.85 and 1.05 s, median 0.95 s, against DDP's 1.2 and 2.2 s, median 1.7 s; with two launches
    # a side the interval reaches the extreme ratios, 0.85 / 2.2 and 1.05 / 1.2
    assert "| comm | 0.600 | 0.300 | 0.0500 | 0.00 | 0.950 | 0.95 | 0.56x [0.39, 0.88] |" in table
    rec = make_record()
    rec["runs"] = runs
    assert report.validate_record(rec) == []
    assert "| ddp | 1.500 | 0.200 |" in report.markdown_report(rec)


# -- waiting on ranks never hangs ------------------------------------------------------


def _sleeper(seconds: float, code: int = 0) -> subprocess.Popen:
    prog = f"import time, sys; time.sleep({seconds}); sys.exit({code})"
    return subprocess.Popen([sys.executable, "-c", prog])


@pytest.mark.timeout(60)
def test_wait_all_ok():
    assert harness._wait_all([_sleeper(0.1), _sleeper(0.2)], timeout_s=30) is None


@pytest.mark.timeout(60)
def test_wait_all_kills_on_timeout():
    procs = [_sleeper(60), _sleeper(60)]
    assert "timed out" in harness._wait_all(procs, timeout_s=1)
    assert all(p.poll() is not None for p in procs)


@pytest.mark.timeout(60)
def test_wait_all_kills_peers_of_a_failed_rank(monkeypatch):
    monkeypatch.setattr(harness, "FAIL_GRACE_S", 0.5)
    procs = [_sleeper(60), _sleeper(0, code=3)]
    msg = harness._wait_all(procs, timeout_s=30)
    assert "rank 1 exited with status 3" in msg
    assert all(p.poll() is not None for p in procs)


def test_error_line_names_the_exception():
    log = ("[W socket.cpp:207] warning\n"
           "[rank1]: Traceback (most recent call last):\n"
           "[rank1]:   File \"x.py\", line 1, in f\n"
           "[rank1]: dcredit_opt._C.SchedulerError: block 45 failed: Connection reset\n")
    assert harness._error_line(log) == "dcredit_opt._C.SchedulerError: block 45 failed: Connection reset"
    assert harness._error_line("ValueError: bad\n") == "ValueError: bad"
    assert harness._error_line("all fine\n") is None


def test_synchronous_floor_comes_from_full_precision_dcredit_runs():
    from dcredit_opt.planner.floors import synchronous_floor
    from dcredit_opt.planner.profile import Profile, TensorProfile

    def profile(dtype: str) -> dict:
        tensors = tuple(TensorProfile(f"t{i}", 1000, dtype, i, 0.01, 0.02) for i in range(3))
        return Profile(tensors, 1e-4, 1e-6, 2).to_dict()

    fp32, fp16 = profile("float32"), profile("float16")
    runs = [RunResult(Launch("gpt", "1gbit", 0, "ddp"), "ok", [1.0, 1.1]),
            RunResult(Launch("gpt", "1gbit", 0, "dc-dcredit"), "ok", [0.9, 1.0], profile=fp32),
            RunResult(Launch("gpt", "1gbit", 0, "dc-dcredit-fp16"), "ok", [0.8, 0.9], profile=fp16)]
    [result] = harness.summarize_runs(runs, ["gpt"], ["1gbit"], ["ddp", "dc-dcredit", "dc-dcredit-fp16"])
    floor = synchronous_floor(Profile.from_dict(fp32))
    assert floor > synchronous_floor(Profile.from_dict(fp16))
    assert result["floor_s"] == pytest.approx(floor)
    by = {r["scheme"]: r for r in result["rows"]}
    assert by["dc-dcredit"]["ratio_to_floor"] == pytest.approx(0.95 / floor)
    assert by["ddp"]["speedup_ci"] is not None
