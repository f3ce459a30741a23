"""Several DistributedOptimizers in one process train as if each were alone.

Two models with an optimizer each, one model split between two
optimizers, and optimizers replaced mid-training (the new one takes over, a
dropped one still applies its pending updates), with random per-rank sleeps so that the two optimizers' launches
interleave differently on each rank. Each optimizer owns its channels (its
own process groups, MPI communicators, Horovod names), so the interleaving
cannot pair one optimizer's block with the other's on a peer. Every rank must
end with the synchronous reference's weights, and the ranks must agree.

One launch per backend runs every case (a launcher costs seconds per start):
torch.distributed (Gloo) with torchrun-style ranks, mpi4py under ``mpiexec``
and Horovod under ``horovodrun --gloo``; a launcher that is not installed
skips with the reason.
"""

from __future__ import annotations

import pytest

from . import multi_workers, spawn
from .test_backends import _tool, horovod_missing, mpi_missing

TOL = 2e-5  # as in test_equivalence.py
AGREE_TOL = 1e-6  # the ranks apply the same reduced gradients; they may differ only by a last bit
# Larger blocks for the Python-driven backends, which pay a thread hand-off per block (as in
# test_backends.py); still several blocks per weight matrix, so both optimizers have many in flight.
DRIVEN_BLOCK_BYTES = 512


def _check(per_rank: list, backend: str) -> None:
    cases = [case for case in per_rank[0] if case != "lifecycle"]
    assert cases == ["two_models", "split_model", "interleaved_split", "replaced", "two_models_profiled"], cases
    for case in cases:
        for rank, result in enumerate(per_rank):
            r = result[case]
            assert set(r["backends"]) == {backend}, f"{case}: blocks went through {r['backends']}"
            assert r["diff"] < TOL, f"{case}: rank {rank} differs from the synchronous reference by {r['diff']}"
        for rank, result in enumerate(per_rank[1:], 1):
            for model, (mine, theirs) in enumerate(zip(per_rank[0][case]["params"], result[case]["params"])):
                worst = max(float((mine[k] - theirs[k]).abs().max()) for k in mine)
                assert worst <= AGREE_TOL, f"{case}: model {model} differs between ranks 0 and {rank} by {worst}"


@pytest.mark.timeout(420)
def test_two_optimizers_on_torch_backend():
    per_rank = spawn.run(multi_workers.multi_optimizer, 2, timeout_s=400, backend="torch")
    _check(per_rank, "torch")
    for rank, result in enumerate(per_rank):
        failed = [check for check, ok in result["lifecycle"].items() if not ok]
        assert not failed, f"rank {rank}: process groups not owned and released per optimizer: {failed}"


@pytest.mark.timeout(420)
def test_two_optimizers_under_mpiexec():
    reason = mpi_missing()
    if reason:
        pytest.skip(f"mpi: {reason}")
    _check(spawn.run_launched(multi_workers.multi_optimizer, [_tool("mpiexec"), "-n", "2"], 2, timeout_s=400,
                              backend="mpi", block_bytes=DRIVEN_BLOCK_BYTES), "mpi")


@pytest.mark.timeout(420)
def test_two_optimizers_under_horovodrun_gloo():
    reason = horovod_missing("gloo")
    if reason:
        pytest.skip(f"horovod-gloo: {reason}")
    launcher = [_tool("horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo"]
    _check(spawn.run_launched(multi_workers.multi_optimizer, launcher, 2, timeout_s=400, backend="horovod",
                              block_bytes=DRIVEN_BLOCK_BYTES), "horovod")


def _check_close_before_peer_tally(per_rank: list) -> None:
    for rank, r in enumerate(per_rank):
        for case in ("closed", "dropped", "after"):
            assert r[case]["tally_left"] == 0, f"rank {rank}, {case}: closed with the peer's tally still in flight"
            # Rank 1 starts each tally 2 s after its blocks; rank 0, which finished first, must have waited for
            # it (the slack allows rank 0 to reach the close up to 0.8 s after rank 1's blocks).
            assert rank == 1 or r[case]["close_s"] > 1.2, f"{case}: rank 0 closed after {r[case]['close_s']:.2f} s, " \
                "without waiting for the peer's tally"
        assert r["dropped_freed"], f"rank {rank}: the dropped optimizer was not freed, so not closed"
        assert r["diff"] < TOL, f"rank {rank} differs from the synchronous reference by {r['diff']}"


@pytest.mark.timeout(300)
def test_close_before_the_peers_tally_on_torch_backend():
    _check_close_before_peer_tally(spawn.run(multi_workers.close_before_peer_tally, 2, timeout_s=240,
                                             backend="torch"))


@pytest.mark.timeout(300)
def test_close_before_the_peers_tally_under_mpiexec():
    reason = mpi_missing()
    if reason:
        pytest.skip(f"mpi: {reason}")
    _check_close_before_peer_tally(spawn.run_launched(multi_workers.close_before_peer_tally,
                                                      [_tool("mpiexec"), "-n", "2"], 2, timeout_s=240, backend="mpi"))
