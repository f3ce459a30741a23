"""P2: adaptive re-planning on 2 ranks (how: planner/adaptive.py). The compute
changes mid-run (a sleep in the backward, longer on one rank); every rank re-plans at the same step, the
staging step is eager, and training equals synchronous data parallelism across the switch."""

from __future__ import annotations

import json

import pytest

from . import replan_workers, spawn

TOL = 2e-5


def _check(results, optimizers=1):
    for r in results:
        assert r["diff"] < TOL, f"differs from synchronous training by {r['diff']}"
        assert all(r["staged_eagerly"]), "a re-plan was staged by a lazy step()"
    for k in range(optimizers):
        its = [[rec["iteration"] for rec in r["replans"][k]] for r in results]
        assert its[0], f"optimizer {k} never re-planned"
        assert all(i == its[0] for i in its), f"optimizer {k}: the ranks re-planned at different steps: {its}"
        assert all(r["plans"][k] == results[0]["plans"][k] for r in results), "the ranks hold different plans"
        first = results[0]["replans"][k][0]
        assert first["reason"].startswith("moved: "), first["reason"]
        assert first["predicted_new_s"] < first["predicted_old_s"]
    # the first optimizer's backward holds the slowed layer: its compute moved, by more than the threshold
    first = results[0]["replans"][0][0]
    assert first["reason"].startswith("moved: compute x") and first["compute"] > 1.2, first["reason"]
    return [rec["iteration"] for rec in results[0]["replans"][0]]


@pytest.mark.timeout(120)
def test_a_compute_change_replans_at_the_same_step_everywhere(tmp_path):
    path = str(tmp_path / "t.json")
    its = _check(spawn.run(replan_workers.train, 2, timeout_s=100, timeline_path=path))
    # the timeline marks each re-plan with its record
    for rank in range(2):
        with open(f"{path}.rank{rank}.json") as f:
            marks = [e for e in json.load(f)["traceEvents"] if e["name"] == "re-plan"]
        assert [m["args"]["iteration"] for m in marks] == its


@pytest.mark.timeout(120)
def test_a_replan_during_backward_passes_per_step_2():
    _check(spawn.run(replan_workers.train, 2, timeout_s=100, passes=2))


@pytest.mark.timeout(120)
def test_two_optimizers_replan_each_on_its_own():
    _check(spawn.run(replan_workers.train, 2, timeout_s=100, optimizers=2), optimizers=2)


@pytest.mark.timeout(120)
def test_with_the_control_plane_on_the_gpu_a_check_waits_for_the_blocks_in_flight():
    """replanner.control_on_gpu: under NCCL a check's collectives go on the default group's communicator beside
    our channels', so none may run while blocks are in flight; taken as if there, on Gloo, every check's
    gather finds every block done, and training still equals synchronous training across the re-plans."""
    results = spawn.run(replan_workers.train, 2, timeout_s=100, gpu_control=True)
    _check(results)
    for r in results:
        assert r["quiet_checks"] and all(r["quiet_checks"]), f"blocks in flight at a check: {r['quiet_checks']}"


@pytest.mark.timeout(120)
def test_nothing_changes_nothing_replans():
    """No change, the real planner: noise may move an estimate now and then on a busy machine, but the fresh
    plan is then the old one, never predicted faster: no re-plan."""
    results = spawn.run(replan_workers.train, 2, timeout_s=100, forced=False, change_at=10**6, steps=40)
    for r in results:
        assert r["diff"] < TOL and r["replans"] == [[]]
