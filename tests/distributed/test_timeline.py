"""Config.timeline_path on two ranks: one Chrome/Perfetto trace per rank, whole at shutdown.

Each file must load as JSON after every ``step()`` and at the end, name its
process and tracks, hold forward and backward spans beside the blocks, and
hold the blocks of the last iteration (written at ``dc.shutdown()``).
"""

from __future__ import annotations

import json

import pytest

from dcredit_opt import timeline

from . import spawn, timeline_workers

STEPS = 6


@pytest.mark.timeout(240)
def test_two_ranks_write_whole_timelines(tmp_path):
    per_rank = spawn.run(timeline_workers.train_with_timeline, 2, timeout_s=200, directory=str(tmp_path),
                         steps=STEPS)
    for rank, result in enumerate(per_rank):
        assert result["path"] == str(tmp_path / f"trace.json.rank{rank}.json")
        assert result["lazy"], "the run should have taken the lazy step (forward spans come from its hooks)"
        counts = result["loads_after_step"]
        assert counts == sorted(counts) and counts[-1] > counts[0], f"rank {rank}: the file did not grow: {counts}"
        with open(result["path"]) as f:
            events = json.load(f)["traceEvents"]
        meta = {(e["name"], e.get("tid")): e["args"] for e in events if e["ph"] == "M"}
        assert meta[("process_name", None)] == {"name": f"rank {rank}"}
        assert meta[("thread_name", timeline.FORWARD_TID)] == {"name": "forward"}
        assert meta[("thread_name", timeline.BACKWARD_TID)] == {"name": "backward"}
        for c in (0, 1):
            assert meta[("thread_name", timeline.CHANNEL_TID0 + c)] == {"name": f"channel {c}"}
        assert all(e["pid"] == rank for e in events)
        blocks = [e for e in events if e["ph"] == "X" and e["tid"] >= timeline.CHANNEL_TID0]
        assert {e["args"]["iteration"] for e in blocks} == set(range(1, STEPS + 1)), "an iteration's blocks missing"
        assert all(e["name"].startswith("block ") and e["dur"] >= 0 for e in blocks)
        backward = [e for e in events if e["name"] == "backward" and e["ph"] == "X"]
        assert [e["args"]["iteration"] for e in backward] == list(range(1, STEPS + 1))
        forward = [e for e in events if e["name"] == "forward" and e["ph"] == "X"]
        # The forward hooks exist from the third iteration on (the second one learns where to apply).
        assert [e["args"]["iteration"] for e in forward] == list(range(3, STEPS + 1))
        modules = [e["name"] for e in events if e["ph"] == "X" and e["tid"] == timeline.FORWARD_TID
                   and e["name"] != "forward" and e["args"]["iteration"] == STEPS]
        assert modules == ["forward 0", "forward 2", "forward 4"]
        last_forward, last_backward = forward[-1], backward[-1]
        assert last_forward["ts"] + last_forward["dur"] <= last_backward["ts"] + 1e-3
