"""``op=Adasum`` (Note [Adasum optimizer], Note [Adasum]) on several ranks: training with SGD (momentum, weight
decay), Adam and fp16 compression equals a single-process simulation of Horovod's Adasum semantics and is the
same to the bit on every rank; ``allreduce(op=Adasum)`` and its forms equal the reference combination; ranks
that disagree on the op raise the same ``MismatchError``. One launch per world and launcher, every case in it
(``adasum_workers.run``)."""

from __future__ import annotations

import pytest
import torch

from . import adasum_workers, spawn
from .test_backends import LAUNCHES, _tool

_CACHE: dict = {}


def _launch(name: str, world: int) -> list:
    def start():
        if name == "torch":
            return spawn.run(adasum_workers.run, world, timeout_s=240, sets=world == 4)
        spec = LAUNCHES[name]
        reason = spec["missing"]()
        if reason:
            return pytest.skip.Exception(f"{name}: {reason}")
        launcher = [_tool(spec["launcher"][0]), *spec["launcher"][1:]]
        return spawn.run_launched(adasum_workers.run, launcher, world, timeout_s=240,
                                  horovod_first=spec["horovod_first"], compare_horovod=name == "horovod-mpi")

    return spawn.launch_once(_CACHE, (name, world), start)


CASES = [("torch", 2), ("torch", 4), *((name, 2) for name in LAUNCHES)]
IDS = [f"{name}-{world}" for name, world in CASES]


def _same_bits_everywhere(per_rank: list, key: str) -> None:
    for r, out in enumerate(per_rank[1:], start=1):
        for name, p in out[key]["got"].items():
            assert torch.equal(p, per_rank[0][key]["got"][name]), f"{key}: {name} differs between rank 0 and {r}"


def _close_to_simulation(out: dict, key: str, rtol=1e-5, atol=1e-6) -> None:
    for name, p in out[key]["got"].items():
        torch.testing.assert_close(p, out[key]["want"][name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{key} {n}: {m}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "world"), CASES, ids=IDS)
def test_training_with_adasum_equals_the_simulation_and_every_rank_has_the_same_bits(name, world):
    per_rank = _launch(name, world)
    assert [o["size"] for o in per_rank] == [world] * world
    for key in ("sgd", "adam", "sgd_fp16"):
        _same_bits_everywhere(per_rank, key)
        for out in per_rank:
            _close_to_simulation(out, key, **({"rtol": 1e-3, "atol": 1e-4} if key == "sgd_fp16" else {}))
            assert out[key]["state_steps"] == 4, "the optimizer state is kept per rank, for every parameter"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "world"), CASES, ids=IDS)
def test_allreduce_with_adasum_equals_the_reference_combination(name, world):
    per_rank = _launch(name, world)
    for out in per_rank:
        c = out["collectives"]
        for key in ("allreduce", "hvd_code", "scaled", "grouped", "async_inplace"):
            torch.testing.assert_close(c[key], c["want"], rtol=1e-6, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
            assert torch.equal(c[key], per_rank[0]["collectives"][key]), f"{key}: ranks differ"
        torch.testing.assert_close(c["grouped64"], c["want64"], rtol=1e-12, atol=1e-12)
        assert c["bf16"].dtype == torch.bfloat16
        torch.testing.assert_close(c["bf16"], c["bf16_want"], rtol=1e-2, atol=1e-2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "world"), CASES, ids=IDS)
def test_ranks_that_disagree_on_adasum_all_raise_the_same_mismatch(name, world):
    per_rank = _launch(name, world)
    for out in per_rank:
        if out["kind"] != "horovod":  # under Horovod a stall in its negotiation, then a timeout (adasum_workers)
            assert out["mixed_collective"].startswith("MismatchError"), out["mixed_collective"]
            assert "adasum" in out["mixed_collective"] and "sum" in out["mixed_collective"]
        assert out["mixed_optimizer"].startswith("MismatchError"), out["mixed_optimizer"]
        assert "op" in out["mixed_optimizer"]
        assert float(out["after_refusals"]) == sum(1.0 + r for r in range(world)), "collectives work after"


@pytest.mark.timeout(300)
def test_adasum_on_process_sets_combines_within_each_set():
    per_rank = _launch("torch", 4)
    for r, out in enumerate(per_rank):
        _close_to_simulation(out, "set_sgd")
        _close_to_simulation(out, "alone")  # a set of one: the plain local step
        partner = r ^ 1
        for n, p in out["set_sgd"]["got"].items():
            assert torch.equal(p, per_rank[partner]["set_sgd"]["got"][n])
        c = out["set_collectives"]
        torch.testing.assert_close(c["allreduce"], c["want"], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(per_rank[0]["set_sgd"]["got"]["0.weight"], per_rank[2]["set_sgd"]["got"]["0.weight"])


@pytest.mark.timeout(300)
def test_close_to_horovods_own_adasum_optimizer():
    per_rank = _launch("horovod-mpi", 2)
    for out in per_rank:
        theirs = out["horovod"]
        if "skipped" in theirs:
            pytest.skip(theirs["skipped"])
        for kind in ("sgd", "adam"):
            for n, p in out[kind]["got"].items():
                torch.testing.assert_close(p, theirs[kind][n], rtol=1e-5, atol=1e-6,
                                           msg=lambda m, k=kind, n=n: f"{k} {n}: ours vs Horovod's: {m}")
