"""The timeline file (Note [Timeline writer] in timeline.py) and our torch.profiler ranges, in one process."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import dcredit_opt as dc
from dcredit_opt import timeline
from tests import timing

ROOT = Path(__file__).resolve().parents[2]

NAMES = ["0.weight", "0.bias", "2.weight"]
BLOCK_TENSORS = [[0], [1, 2]]


def rows(t0: int) -> list:
    """Engine.trace() rows of one iteration: (block, channel, window, group, seq, release, launch, end), in ns."""
    return [(0, 0, 0, 0, 0, t0 + 1_000, t0 + 2_000, t0 + 5_000), (1, 1, 0, 1, 1, t0 + 500, t0 + 1_000, t0 + 4_000)]


def events_of(path) -> list:
    with open(path) as f:
        return json.load(f)["traceEvents"]


def test_file_is_whole_after_every_settle_and_after_close(tmp_path):
    tl = timeline.RankTimeline(str(tmp_path / "t{rank}.json"), rank=3, size=4)
    assert tl.path == str(tmp_path / "t3.json")
    meta = events_of(tl.path)  # whole from the start: names only
    assert {e["name"] for e in meta} == {"process_name", "process_sort_index", "thread_name", "thread_sort_index"}
    assert [e["args"]["name"] for e in meta if e["name"] == "process_name"] == ["rank 3"]
    t0 = 10_000_000
    for it in range(1, 4):
        base = t0 + it * 1_000_000
        for k in range(3):  # the next iteration's forward, before the record at its first gradient
            tl._forward.append((base + 900_000 + k * 10_000, k))
        tl.record(rows(base), [base + 100, base + 200, base + 300], NAMES, BLOCK_TENSORS, it)
        tl.settle()  # at most this batch left to write
        assert tl.flush()
        assert len(events_of(tl.path)) > len(meta)
    tl.on_forward(0)  # a forward with no backward after it: written at close
    tl.close(NAMES)
    tl.close(NAMES)  # idempotent
    tl.record(rows(t0), [1, 2, 3], NAMES, BLOCK_TENSORS, 9)  # after close: ignored
    events = events_of(tl.path)
    blocks = [e for e in events if e["name"].startswith("block ")]
    assert sorted({e["args"]["iteration"] for e in blocks}) == [1, 2, 3]
    assert {e["tid"] for e in blocks} == {timeline.CHANNEL_TID0, timeline.CHANNEL_TID0 + 1}
    assert {e["name"] for e in blocks} == {"block 0: 0.weight", "block 1: 0.bias (+1)"}
    names = {(e["tid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert names == {(1, "forward"), (2, "backward"), (10, "channel 0"), (11, "channel 1")}
    forward = [e for e in events if e["name"] == "forward"]
    # Stamps taken before iteration k's first gradient are iteration k's forward; the last has no backward.
    assert [e["args"]["iteration"] for e in forward] == [2, 3, 4, 4]
    first = forward[0]
    assert first["dur"] == pytest.approx((2_000_100 + t0 - (t0 + 1_900_000)) / 1e3)
    modules = [e for e in events if e.get("tid") == timeline.FORWARD_TID and e["name"].startswith("forward ")]
    assert [e["name"] for e in modules[:3]] == ["forward 0", "forward 0", "forward 2"]
    assert all(e["ts"] >= 0 for e in events if "ts" in e)
    assert not tl._thread.is_alive()


def test_a_dropped_timeline_finishes_its_file(tmp_path):
    tl = timeline.RankTimeline(str(tmp_path / "t.json"), rank=0, size=1)
    thread, path = tl._thread, tl.path
    tl.record(rows(1_000_000), [1_000_100, 0, 1_000_300], NAMES, BLOCK_TENSORS, 1)
    del tl
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()
    assert any(e["name"].startswith("block ") for e in events_of(path))


def test_a_mark_is_an_instant_with_its_args(tmp_path):
    """A re-plan's mark (replanner.py): an instant across the process, after the iteration
    recorded before it, with the record in its args."""
    tl = timeline.RankTimeline(str(tmp_path / "t.json"), rank=0, size=1)
    base = time.perf_counter_ns()
    tl.record(rows(base), [base + 100, base + 200, base + 300], NAMES, BLOCK_TENSORS, 1)
    tl.mark("re-plan", {"iteration": 7, "reason": "moved: link x0.25"})
    tl.close(NAMES)
    marks = [e for e in events_of(tl.path) if e["name"] == "re-plan"]
    assert len(marks) == 1 and marks[0]["ph"] == "i" and marks[0]["s"] == "p"
    assert marks[0]["args"] == {"iteration": 7, "reason": "moved: link x0.25"} and marks[0]["ts"] > 0
    tl.mark("re-plan", {})  # after close: ignored


def test_max_events_stops_recording_and_the_file_stays_whole(tmp_path):
    tl = timeline.RankTimeline(str(tmp_path / "t.json"), rank=0, size=1, max_events=10)
    for it in range(1, 6):
        tl.record(rows(it * 1_000_000), [it * 1_000_000 + 1, 0, 0], NAMES, BLOCK_TENSORS, it)
    tl.close(NAMES)
    assert {e["args"]["iteration"] for e in events_of(tl.path) if e["name"].startswith("block ")} == {1}


def test_a_path_that_cannot_be_written_fails_where_the_timeline_is_asked_for(tmp_path):
    with pytest.raises(OSError):
        timeline.RankTimeline(str(tmp_path / "missing" / "t.json"), rank=0, size=1)


def _train(opt, model, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(3, 4)).pow(2).sum().backward()
        opt.step()


def _model_and_optimizer(**config):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  config=dc.Config(block_bytes=64, window=2, policy="fixed", **config))
    return model, opt


@pytest.mark.timeout(120)
def test_optimizer_timeline_holds_the_last_iteration_after_shutdown(tmp_path):
    path = tmp_path / "trace.json"
    model, opt = _model_and_optimizer(timeline_path=str(path))
    _train(opt, model, 4)
    assert opt._dc.lazy.deferred, "the lazy step should be on"
    written = {e["args"]["iteration"] for e in events_of(path) if e["name"].startswith("block ")}
    assert {1, 2} <= written <= {1, 2, 3}, "after step(), the file lags by at most one iteration"
    dc.shutdown()
    events = events_of(path)
    assert {e["args"]["iteration"] for e in events if e["name"].startswith("block ")} == {1, 2, 3, 4}
    assert [e["args"]["iteration"] for e in events if e["name"] == "forward"] == [3, 4]
    assert [e["args"]["iteration"] for e in events if e["name"] == "backward"] == [1, 2, 3, 4]


@pytest.mark.timeout(120)
def test_torch_profiler_trace_shows_our_ranges(tmp_path):
    model, opt = _model_and_optimizer()
    _train(opt, model, 3)  # learns where each parameter is read first: the lazy step from here on
    assert isinstance(timeline.profiled("dcredit_opt::wait"), type(timeline._NO_RANGE)), \
        "with no profiler running, a range must cost nothing"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _train(opt, model, 2)
    opt.synchronize()
    trace = tmp_path / "profile.json"
    prof.export_chrome_trace(str(trace))
    names = {e.get("name") for e in events_of(trace)}
    assert {"dcredit_opt::wait", "dcredit_opt::apply", "dcredit_opt::step"} <= names, sorted(
        n for n in names if n and "dcredit" in n)
    dc.shutdown()


def test_two_timelines_on_one_path_get_files_of_their_own(tmp_path):
    first = timeline.RankTimeline(str(tmp_path / "t.json"), rank=0, size=1)
    second = timeline.RankTimeline(str(tmp_path / "t.json"), rank=0, size=1)
    assert (first.path, second.path) == (str(tmp_path / "t.json"), str(tmp_path / "t.json.opt1"))
    first.close()
    third = timeline.RankTimeline(str(tmp_path / "t.json"), rank=0, size=1)  # free again
    assert third.path == first.path
    second.close()
    third.close()
    for path in (first.path, second.path):
        assert events_of(path)


EXIT_PROBE = r'''
import sys, torch
import dcredit_opt as dc
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                              config=dc.Config(block_bytes=64, window=2, policy="fixed", timeline_path=sys.argv[1]))
for _ in range(4):
    opt.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
'''


@pytest.mark.timeout(120)
def test_a_script_that_exits_without_shutdown_keeps_its_last_iteration(tmp_path):
    path = tmp_path / "trace.json"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DCREDIT_") and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", EXIT_PROBE, str(path)], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=timing.scaled(100), check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert {e["args"]["iteration"] for e in events_of(path) if e["name"].startswith("block ")} == {1, 2, 3, 4}
