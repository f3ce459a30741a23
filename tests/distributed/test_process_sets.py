"""Note [Process sets]: an optimizer over some of the ranks reduces over them only and trains as synchronous
training over those ranks alone; wrong sets end in a DCreditError naming the fix, never a hang or a silent
wrong result.

One 4-rank launch per launcher runs every pattern (``process_set_workers.py``): torchrun (Gloo) and mpiexec (the
MPI backend and Gloo), both with ``dc.ProcessSet``; horovodrun --gloo and --mpi with Horovod's process sets
(``process_set_horovod.py``), the blocks on our Gloo channels and on Horovod's own operations. The collectives'
``process_set=`` runs in the same launches. Horovod's own test of process sets runs in the peer suite
(tests/horovod_peer), on 2 ranks and, under horovodrun --mpi, on 4.
"""

from __future__ import annotations

import os

import pytest

from . import process_set_horovod as ph
from . import process_set_workers as pw
from . import spawn
from .test_backends import LAUNCHES, _tool

TOL = 1e-5


class KilledAtExit(AssertionError):
    """The known horovodrun --mpi shutdown flake: every rank returned its results; then one rank's process ended
    (status 0) while others were still shutting down (rank 0, the rendezvous store's host, often still in
    dc.shutdown() at exit), and MPICH's process manager killed every rank still running (signal 9). Seen in about
    one launch in four of 4 ranks on 2 busy cores."""


_KILLED_AT_EXIT = ("known flake: under horovodrun --mpi rank 0 is sometimes killed (signal 9) at shutdown, after every "
                   "rank returned its results")
# Opt-in: besides the shutdown flake above, a 4-rank launch under horovodrun --mpi on 2 cores once had rank 2 time
# out connecting to rank 0's rendezvous store (30 s) and stall Horovod's barrier, in the full suite (not seen when
# run alone). Until that is understood the --mpi variants run only when asked for; the vendored Horovod test of
# process sets runs under --mpi in the peer suite, and the --gloo variants here check the same behaviour.
_MPI_4_RANKS = "DC_TEST_HOROVOD_MPI_4_RANKS"
HOROVOD = ["horovod-gloo",
           pytest.param("horovod-mpi", marks=[
               pytest.mark.skipif(not os.environ.get(_MPI_4_RANKS),
                                  reason=f"4 ranks under horovodrun --mpi: set {_MPI_4_RANKS}=1 (a store connect "
                                         "timeout seen once in the full suite is not yet understood)"),
               pytest.mark.xfail(strict=False, raises=KilledAtExit, reason=_KILLED_AT_EXIT)])]
_launched: dict = {}


class _Killed:
    """A launch of the known shutdown flake (``KilledAtExit``): its results, checked as any launch's, and the
    message that each test reading it raises once its checks pass (``_exited``)."""

    def __init__(self, message: str, results: list):
        self.message, self.results = message, results


def _results(launcher: str) -> list:
    out = spawn.launch_once(_launched, launcher, lambda: _launch(launcher))
    return out.results if isinstance(out, _Killed) else out


def _exited(launcher: str) -> None:
    """After a test's checks of a Horovod launch: ``KilledAtExit`` if that launch ended in the known flake."""
    out = _launched.get(launcher)
    if isinstance(out, _Killed):
        raise KilledAtExit(out.message)


def _launch(launcher: str) -> list:
    if launcher == "torch":
        return spawn.run(pw.four_ranks, 4, timeout_s=300)
    reason = LAUNCHES[launcher]["missing"]()
    if reason:
        return pytest.skip.Exception(f"{launcher}: {reason}")
    if launcher == "mpi":
        return spawn.run_launched(pw.four_ranks, [_tool("mpiexec"), "-n", "4"], 4, timeout_s=300)
    command = [_tool("horovodrun"), "-np", "4", "-H", "localhost:4", "--mpi" if launcher == "horovod-mpi" else "--gloo"]
    try:
        return spawn.run_launched(ph.four_ranks, command, 4, timeout_s=300)
    except spawn.RankFailure as e:
        # Only that signature: every rank's results written, the launch ended by a rank killed with signal 9.
        if launcher == "horovod-mpi" and e.returncodes == [9] and e.results is not None \
                and "Killed (signal 9)" in e.outputs[0]:
            return _Killed(str(e), e.results)
        raise


def _trained(per_rank: list, name: str, ranks) -> None:
    for rank in ranks:
        r = per_rank[rank][name]
        assert "error" not in r, f"{name}: rank {rank} raised {r['error']}\n{r.get('traceback', '')}"
        assert r["diff"] < TOL, f"{name}: rank {rank} differs from synchronous training over its set by {r['diff']}"
        assert r["moved"] > 1e-3, f"{name}: rank {rank}'s reference did not train"


def _same_within_sets(per_rank: list, name: str, sets, key: str = "checksum") -> None:
    for ranks in sets:
        values = {per_rank[r][name][key] for r in ranks}
        assert len(values) == 1, f"{name}: the weights differ within set {ranks}: {values}"
    firsts = {per_rank[ranks[0]][name][key] for ranks in sets}
    assert len(firsts) == len(sets), f"{name}: disjoint sets trained the same weights (were they mixed?)"


@pytest.mark.timeout(420)
@pytest.mark.parametrize("launcher", ["torch", "mpi"])
@pytest.mark.parametrize("name", ["disjoint/auto", "disjoint/torch", "two_optimizers", "after_errors"])
def test_disjoint_sets_each_train_as_if_alone(launcher, name):
    per_rank = _results(launcher)
    _trained(per_rank, name, range(4))
    _same_within_sets(per_rank, name, ([0, 2], [1, 3]))
    if name == "two_optimizers":  # the second optimizer of each rank reduces over every rank
        assert len({r[name]["checksum_all"] for r in per_rank}) == 1


@pytest.mark.timeout(420)
@pytest.mark.parametrize("launcher", ["torch", "mpi"])
def test_a_set_of_two_of_four_leaves_the_others_alone(launcher):
    per_rank = _results(launcher)
    _trained(per_rank, "two_of_four", [0, 1])
    assert per_rank[0]["two_of_four"]["checksum"] == per_rank[1]["two_of_four"]["checksum"]
    assert "two_of_four" not in per_rank[2] and "two_of_four" not in per_rank[3]


@pytest.mark.timeout(420)
def test_a_torch_process_group_is_a_process_set():
    per_rank = _results("torch")
    _trained(per_rank, "torch_group", range(4))
    _same_within_sets(per_rank, "torch_group", ([0, 2], [1, 3]))


@pytest.mark.timeout(420)
@pytest.mark.parametrize("launcher", ["torch", "mpi"])
def test_wrong_sets_are_refused_naming_the_fix(launcher):
    per_rank = _results(launcher)
    outside = per_rank[3]["outside"]["error"]
    assert outside.startswith("DCreditError") and "does not hold it" in outside and "ProcessSet([3])" in outside
    for rank in (0, 1):  # they disagree about their set: both are told at once, naming both sets
        r = per_rank[rank]["differ"]
        assert r["error"].startswith("MismatchError"), f"rank {rank}: {r}"
        assert "[0, 1]" in r["error"] and "[0, 1, 2]" in r["error"] and "same set" in r["error"], r["error"]
        assert r["took_s"] < 3.0, f"rank {rank} waited {r['took_s']:.1f} s for a mismatch it could see"
    missing = per_rank[2]["missing"]
    assert missing["error"].startswith("CollectiveTimeout") and "rank 3" in missing["error"], missing
    assert 3.5 < missing["took_s"] < 30, missing


def _collectives(per_rank: list, name: str, sets, outside: str = "is not in process_set") -> None:
    for ranks in sets:
        for me in ranks:
            got = per_rank[me][name]
            assert "error" not in got, f"{name}: rank {me} raised {got['error']}\n{got.get('traceback', '')}"
            for key, want in pw.expected_collectives(me, ranks).items():
                assert got[key] == want, f"{name}: rank {me} {key} {got[key]!r}, want {want!r}"
            assert got["root_outside"].startswith("ValueError") and "is not in process_set" in got["root_outside"]
            assert got["outside"].startswith("DCreditError") and outside in got["outside"], got["outside"]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("launcher", ["torch", "mpi"])
def test_collectives_on_a_process_set_reduce_over_its_ranks(launcher):
    per_rank = _results(launcher)
    names = ["collectives", "collectives/list"] + (["collectives/torch_group"] if launcher == "torch" else [])
    for name in names:
        _collectives(per_rank, name, ([0, 2], [1, 3]))


@pytest.mark.timeout(420)
@pytest.mark.parametrize("launcher", ["torch", "mpi"])
def test_a_first_collective_against_an_optimizer_on_the_same_set_is_a_mismatch(launcher):
    per_rank = _results(launcher)
    for rank in (0, 1):
        r = per_rank[rank]["call_or_build"]
        assert r.get("error", "").startswith("MismatchError"), f"rank {rank}: {r}"
        assert "the set's first collective" in r["error"] and "a DistributedOptimizer" in r["error"], r["error"]
        assert r["took_s"] < 3.0, f"rank {rank} waited {r['took_s']:.1f} s for a mismatch it could see"


@pytest.mark.timeout(420)
@pytest.mark.parametrize("launcher", HOROVOD)
def test_horovod_collectives_on_horovods_sets(launcher):
    per_rank = _results(launcher)
    _collectives(per_rank, "collectives", ([0, 2], [1, 3]))
    for rank in range(4):
        ours = per_rank[rank]["collectives/ours"]
        assert ours.startswith("DCreditError") and "hvd.add_process_set" in ours, ours
    _exited(launcher)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("launcher", HOROVOD)
def test_horovod_backend_over_horovods_sets(launcher):
    per_rank = _results(launcher)
    _trained(per_rank, "disjoint/horovod", range(4))
    _same_within_sets(per_rank, "disjoint/horovod", ([0, 2], [1, 3]))
    _trained(per_rank, "outside/horovod", [0, 2, 3])  # rank 3 alone, as in Horovod, on the Horovod backend
    for name, ranks in (("disjoint/horovod", range(4)), ("outside/horovod", [0, 2, 3])):
        assert all(per_rank[r][name]["backend"] == "horovod" for r in ranks), name
    _exited(launcher)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("launcher", HOROVOD)
@pytest.mark.parametrize("name", ["disjoint", "two_optimizers"])
def test_horovod_process_sets_train_as_if_alone(name, launcher):
    per_rank = _results(launcher)
    _trained(per_rank, name, range(4))
    _same_within_sets(per_rank, name, ([0, 2], [1, 3]))
    _exited(launcher)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("launcher", HOROVOD)
def test_horovod_rank_outside_its_set_steps_alone_as_in_horovod(launcher):
    per_rank = _results(launcher)
    _trained(per_rank, "outside", [0, 2, 3])  # rank 3's reference is rank 3 alone
    for rank in range(4):
        ours = per_rank[rank]["ours"]["error"]
        assert ours.startswith("DCreditError") and "hvd.add_process_set" in ours, ours
    _exited(launcher)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("whole", [True, False], ids=["naming_the_whole_model", "naming_its_own"])
def test_a_head_per_rank_on_a_set_of_its_own_beside_an_optimizer_over_every_rank(whole):
    """Note [Parameters outside the optimizer]: the heads differ between ranks by design; the optimizer over every
    rank names them (or finds them in the model its forward runs) but leaves their comparison to the optimizer
    that reduces them, over its own set."""
    per_rank = spawn.run(pw.head_on_a_set_of_its_own, 2, timeout_s=200, whole=whole)
    for rank, r in enumerate(per_rank):
        assert r["raised"] is None, f"rank {rank}: {r['raised']}"
        assert r["diff"] < 2e-5, f"rank {rank}: differs from training by hand by {r['diff']}"
    assert per_rank[0]["head"] != per_rank[1]["head"], "the heads should differ between ranks (each trained alone)"
