"""E1: Horovod's DistributedOptimizer arguments, for real, on every backend.

``compression`` (float16 on the wire: the reduced gradient is float16
arithmetic's, and the scheduler counts half the bytes), ``op`` as Horovod's
ints, ``groups`` (merged into one block each, same result), and bfloat16
parameters (carried as float32 where the backend has no bfloat16). The
worker is ``workers.horovod_arguments``; the torch backend runs under our
spawn, MPI and Horovod under their own launchers (``test_backends.LAUNCHES``).
"""

from __future__ import annotations

import pytest
import torch

from . import spawn, workers

# Blocks that travel as float16, by backend: MPI has no 16-bit floats, so there fp16 compression cannot
# shrink anything and the blocks travel as float32 (the optimizer says so once).
COMPRESSES = {"torch": True, "horovod": True, "mpi": False}
CARRIES_BF16 = {"torch": True, "horovod": False, "mpi": False}


def check(per_rank: list, backend: str) -> None:
    r0 = per_rank[0]
    for rank, r in enumerate(per_rank):
        assert r["backend"] == backend, (rank, r["backend"])
        assert r["wire_none"] == pytest.approx([r0["expect_none"]] * 3, rel=1e-6), (rank, r["wire_none"])
        if COMPRESSES[backend]:
            # Exactly float16's sum of the float16-rounded values, then halved.
            assert r["wire_fp16"] == [r0["expect_fp16"]] * 3, (rank, r["wire_fp16"], r0["expect_fp16"])
            assert r["wire_fp16"] != pytest.approx(r["wire_none"], rel=1e-5), "fp16 compression changed nothing"
            assert r["wire_fp16_bytes"] * 2 == r["wire_none_bytes"], r
            assert r["fp16_training"]["bytes"] * 2 == r["fp16_training"]["f32_bytes"], r["fp16_training"]
        else:
            assert r["wire_fp16"] == r["wire_none"], (rank, r["wire_fp16"], r["wire_none"])
            assert r["fp16_training"]["bytes"] == r["fp16_training"]["f32_bytes"], r["fp16_training"]
        assert r["fp16_training"]["diff"] < 5e-3, (rank, r["fp16_training"])
        for label in ("list", "number", "sum"):
            assert r["groups"][label]["diff"] < 1e-5, (rank, label, r["groups"][label])
        assert r["bf16"]["diff"] < 3e-2, (rank, r["bf16"])
        assert r["bf16"]["wire"] == (["torch.bfloat16"] if CARRIES_BF16[backend] else ["torch.float32"]), r["bf16"]
    for key in ("fp16_training", "bf16"):
        assert len({r[key]["checksum"] for r in per_rank}) == 1, f"{key}: ranks differ"
    for label in ("list", "number", "sum"):
        assert len({r["groups"][label]["checksum"] for r in per_rank}) == 1, f"groups {label}: ranks differ"
    merged = {frozenset(b) for b in r0["groups"]["list"]["blocks"] if len(b) > 1}
    assert merged == {frozenset({"inp.weight", "out.bias", "mid.bias"}), frozenset({"norm.weight", "inp.bias"})}, \
        r0["groups"]["list"]["blocks"]
    merged = {frozenset(b) for b in r0["groups"]["number"]["blocks"] if len(b) > 1}
    assert merged == {frozenset({"inp.weight", "inp.bias", "mid.weight"}),
                      frozenset({"mid.bias", "norm.weight", "norm.bias"}),
                      frozenset({"out.weight", "out.bias"})}, r0["groups"]["number"]["blocks"]


@pytest.mark.timeout(300)
def test_horovod_arguments_on_torch_backend():
    check(spawn.run(workers.horovod_arguments, 2, timeout_s=240), "torch")


@pytest.mark.timeout(420)
def test_horovod_arguments_on_backend(launch):
    per_rank = spawn.run_launched(workers.horovod_arguments, launch["launcher"], 2, timeout_s=400,
                                  horovod_first=launch["horovod_first"], backend=launch["backend"])
    check(per_rank, launch["backend"])


def test_expected_values_differ_between_float16_and_float32():
    # The test above is only meaningful if float16 arithmetic changes these values.
    values = (1.0 + 2.0 ** -12, 1.0 / 3.0)
    exact = float(sum(torch.tensor(v, dtype=torch.float32) for v in values) / 2)
    assert workers._fp16(workers._fp16(values[0]) + workers._fp16(values[1])) / 2 != pytest.approx(exact, rel=1e-5)
