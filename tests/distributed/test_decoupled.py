"""S1: decoupled plans (DeAR's reduce-scatter in backward, all-gather at the flush) train exactly like
synchronous data parallelism on every backend: torch.distributed (Gloo), MPI and Horovod (Gloo and MPI).

Block lengths are not all multiples of the world size (the model's tensors have odd sizes), so the padded
stages run too; 4 ranks with random decoupled plans run in test_long_run.py.
"""

from __future__ import annotations

import pytest

from dcredit_opt.planner.profile import RING_STAGE_RATIOS
from dcredit_opt.profiling.profiler import STAGE_RATIO_RANGE

from . import decoupled_workers, spawn

TOL = 2e-5  # as in test_equivalence.py


def _check(per_rank: list, backend: str) -> None:
    for rank, r in enumerate(per_rank):
        assert r["backend"] == backend, f"rank {rank}: blocks went through {r['backend']}"
        # plan 0 and 2: every tensor decoupled (as many all-gathers as reduce-scatters, half the blocks each);
        # plan 1: every other tensor
        for i, (scatters, gathers, blocks) in enumerate(r["ops"]):
            assert scatters == gathers > 0, f"rank {rank}, plan {i}: {scatters} reduce-scatters, {gathers} gathers"
            assert (2 * scatters == blocks) == (i != 1), f"rank {rank}, plan {i}: {r['ops'][i]}"
        worst = max(r["diffs"])
        assert worst < TOL, f"rank {rank} differs from the synchronous reference by {worst} ({r['diffs']})"
    assert len({r["checksum"] for r in per_rank}) == 1, [r["checksum"] for r in per_rank]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
def test_decoupled_plans_on_torch_backend(opt_name):
    _check(spawn.run(decoupled_workers.decoupled, 2, timeout_s=240, backend="torch", opt_name=opt_name), "torch")


@pytest.mark.timeout(300)
def test_decoupled_plans_on_backend(launch):
    _check(spawn.run_launched(decoupled_workers.decoupled, launch["launcher"], 2, timeout_s=240,
                              backend=launch["backend"], horovod_first=launch["horovod_first"]), launch["backend"])


POLICY_CASES = [("dear", True), ("dear", False), ("dcredit-all", True), ("dcredit-flush", True),
                ("dcredit-all", False)]


def _check_policies(per_rank: list, backend: str) -> None:
    for rank, r in enumerate(per_rank):
        assert r["backend"] == backend, f"rank {rank}: blocks went through {r['backend']}"
        for key, case in r["cases"].items():
            scatters, gathers, blocks = case["ops"]
            assert scatters == gathers > 0, f"rank {rank}, {key}: {scatters} reduce-scatters, {gathers} all-gathers"
            if key.startswith(("dear", "dcredit-all")):
                assert 2 * scatters == blocks, f"rank {rank}, {key}: not every block decoupled: {case['ops']}"
            assert case["policy"] == ("dear" if key.startswith("dear") else "dcredit"), (key, case["policy"])
            assert case["overlap_forward"] == key.endswith("True"), (key, case["overlap_forward"])
            assert case["diff"] < TOL, f"rank {rank}, {key}: differs from synchronous training by {case['diff']}"
            if key.startswith("dear") and rank == 0:  # profiled: the stage sweeps ran and were fitted
                ratios = case["stage_ratios"]
                assert ratios is not None and len(ratios) == 4 and ratios != list(RING_STAGE_RATIOS), ratios
                assert all(STAGE_RATIO_RANGE[0] <= r <= STAGE_RATIO_RANGE[1] for r in ratios), ratios
                # Note [Measured host cost]: the CPU a collective cost rank 0, above the configured 1 ns
                assert 1e-9 < case["host_s"] < 1.0, case["host_s"]
    for key in per_rank[0]["cases"]:
        sums = {r["cases"][key]["checksum"] for r in per_rank}
        assert len(sums) == 1, f"{key}: ranks disagree: {sums}"


@pytest.mark.timeout(300)
def test_dear_and_decoupled_dcredit_plans_on_torch_backend():
    """S1: the profiled DeAR plan and D-Credit's decoupled candidates, phase 2 on and off."""
    _check_policies(spawn.run(decoupled_workers.policies, 2, timeout_s=240, cases=POLICY_CASES, backend="torch"),
                    "torch")


@pytest.mark.timeout(300)
def test_dear_and_decoupled_dcredit_plans_on_backend(launch):
    _check_policies(spawn.run_launched(decoupled_workers.policies, launch["launcher"], 2, timeout_s=240,
                                       cases=POLICY_CASES, backend=launch["backend"],
                                       horovod_first=launch["horovod_first"]), launch["backend"])
