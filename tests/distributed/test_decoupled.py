"""S1: decoupled plans (DeAR's reduce-scatter in backward, all-gather at the flush) train exactly like
synchronous data parallelism on every backend: torch.distributed (Gloo), MPI and Horovod (Gloo and MPI).

Block lengths are not all multiples of the world size (the model's tensors have odd sizes), so the padded
stages run too; 4 ranks with random decoupled plans run in test_long_run.py.
"""

from __future__ import annotations

import pytest

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
