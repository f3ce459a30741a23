"""P2: adaptive re-planning on 2 ranks (how: planner/adaptive.py). The compute
changes mid-run (more work in the backward, longer on one rank); every rank re-plans at the same step, the
staging step is eager, and training equals synchronous data parallelism across the switch: on
torch.distributed (Gloo), under mpiexec and under horovodrun, with backward_passes_per_step=2, into, between and out of
decoupled plans, and with two optimizers; and, randomised, ranks with different local timings agree on every
decision."""

from __future__ import annotations

import json

import pytest

from . import replan_workers, spawn

TOL = 2e-5


def _check(results, optimizers=1, backend="torch", reasons="compute"):
    """``reasons``: "compute" (every re-plan follows an estimate that moved, and one of the first optimizer's
    follows its compute: noise in the link's estimate may re-plan before the compute change on a busy
    machine), "moved" (every re-plan follows an estimate that moved), or None (decisions forced)."""
    for rank, r in enumerate(results):
        assert r["backend"] == backend, f"rank {rank}: blocks went through {r['backend']}"
        assert r["ops"] == results[0]["ops"], f"rank {rank} ran other layouts than rank 0"
        assert r["diff"] < TOL, f"differs from synchronous training by {r['diff']}"
        assert all(r["staged_eagerly"]), "a re-plan was staged by a lazy step()"
    for k in range(optimizers):
        its = [[rec["iteration"] for rec in r["replans"][k]] for r in results]
        assert its[0], f"optimizer {k} never re-planned"
        assert all(i == its[0] for i in its), f"optimizer {k}: the ranks re-planned at different steps: {its}"
        assert all(r["plans"][k] == results[0]["plans"][k] for r in results), "the ranks hold different plans"
        for rec in results[0]["replans"][k]:
            assert rec["predicted_new_s"] < rec["predicted_old_s"], rec
            assert reasons is None or rec["reason"].startswith("moved: "), rec["reason"]
    if reasons == "compute":
        # the first optimizer's backward holds the slowed layer: its compute moved, by more than the threshold
        recs = results[0]["replans"][0]
        assert any(rec["reason"].startswith("moved: compute x") and rec["compute"] > 1.2 for rec in recs), \
            [rec["reason"] for rec in recs]
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
def test_replans_into_between_and_out_of_decoupled_plans():
    """Every check after a plan's baseline re-plans; the forced plans decouple every tensor, every other one,
    none, in turn: each switch stages a layout with other two-stage blocks (all-gathers held for the flush)."""
    results = spawn.run(replan_workers.train, 2, timeout_s=100, decoupled=True, steps=32)
    its = _check(results, reasons=None)
    assert len(its) >= 3, f"want switches into, between and out of decoupled plans; re-planned at {its}"
    # the layouts the steps ran, by their reduce-scatters and blocks: the profiled plan's, then the forced ones
    seen = []
    for (scatters, blocks), in results[0]["ops"]:
        which = "none" if scatters == 0 else "all" if 2 * scatters == blocks else "every other"
        if not seen or seen[-1] != which:
            seen.append(which)
    turns, start = list(replan_workers.DECOUPLED) * 2, seen.index("all")
    assert seen[start:] == turns[:len(seen) - start] and len(seen) - start >= 3, f"layouts {seen}, re-plans {its}"


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


@pytest.mark.timeout(300)
def test_replans_equal_synchronous_training_on_backend(launch):
    """mpiexec, horovodrun --gloo and horovodrun --mpi (conftest.py's ``launch``): the check's window gather
    and plan broadcast, and the switch, on each backend's own collectives."""
    _check(spawn.run_launched(replan_workers.train, launch["launcher"], 2, timeout_s=240, backend=launch["backend"],
                              horovod_first=launch["horovod_first"]), backend=launch["backend"], reasons="moved")


@pytest.mark.timeout(180)
def test_ranks_with_different_timings_agree_on_every_decision():
    """Randomised: per seed, each rank works in its backward at levels it draws on its own and skews the
    windows it sends at random (replan_workers.random_timings); the job's shape (backward passes per step,
    one or two optimizers, the check interval) is drawn per seed. Every rank computes the same estimates at
    the same checks, re-plans at the same steps, holds the same plan at every step, and trains as
    synchronous data parallelism does, across every re-plan."""
    results = spawn.run(replan_workers.random_timings, 2, timeout_s=150)
    replanned = 0
    for by_seed in zip(*results):
        seed = by_seed[0]["seed"]
        for rank, r in enumerate(by_seed):
            assert r["seed"] == seed and r["shape"] == by_seed[0]["shape"]
            assert r["estimates"] == by_seed[0]["estimates"], f"seed {seed}: rank {rank} estimated otherwise"
            assert r["replans"] == by_seed[0]["replans"], f"seed {seed}: re-plans {[x['replans'] for x in by_seed]}"
            assert r["plans"] == by_seed[0]["plans"], f"seed {seed}: rank {rank} held another plan"
            assert r["diff"] < TOL, f"seed {seed}, rank {rank}: differs from synchronous training by {r['diff']}"
            assert all(r["staged_eagerly"]), f"seed {seed}: a re-plan was staged by a lazy step()"
        assert by_seed[0]["estimates"], f"seed {seed}: no check compared windows"
        replanned += sum(map(len, by_seed[0]["replans"]))
    # the draws move the estimates: the agreement above covers re-plans, not only quiet checks
    assert replanned >= 3, f"only {replanned} re-plans over {len(results[0])} seeds"
