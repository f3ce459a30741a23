"""Horovod's collective API on 2 ranks, under each launcher: torch.distributed (Gloo, torchrun-style spawn),
``mpiexec -n 2`` (MPI), ``horovodrun --gloo`` and ``horovodrun --mpi`` (Horovod). Every value is compared with
one computed by hand from the ranks' inputs (``collective_workers.py``); a launcher or library that is not
installed skips with the reason, as in test_backends.py."""

from __future__ import annotations

import pytest
import torch

from tests import timing

from . import collective_workers, spawn
from .test_backends import LAUNCHES, _tool

RUNS = ["torch", *LAUNCHES]


def _launch(name: str, function, timeout_s: float, **kwargs) -> list:
    """``function`` on 2 ranks started as ``name`` says; ``timeout_s`` bounds the whole launch."""
    if name == "torch":
        return spawn.run(function, 2, timeout_s=timeout_s, **kwargs)
    spec = LAUNCHES[name]
    reason = spec["missing"]()
    if reason:
        pytest.skip(f"{name}: {reason}")
    launcher = [_tool(spec["launcher"][0]), *spec["launcher"][1:]]
    return spawn.run_launched(function, launcher, 2, timeout_s=timeout_s, horovod_first=spec["horovod_first"],
                              **kwargs)


def _eq(got, want, what: str, rank: int) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"rank {rank} {what}: {got!r}"
        assert got.dtype == want.dtype, f"rank {rank} {what}: dtype {got.dtype}, want {want.dtype}"
        assert got.shape == want.shape and torch.equal(got, want), f"rank {rank} {what}: {got}, want {want}"
    elif isinstance(want, (list, tuple)) and want and isinstance(want[0], torch.Tensor):
        assert len(got) == len(want), f"rank {rank} {what}: {got!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            _eq(g, w, f"{what}[{i}]", rank)
    else:
        assert got == want, f"rank {rank} {what}: {got!r}, want {want!r}"


def expected(rank: int) -> dict:
    """By hand: rank 0 has x = [1, 10], rank 1 x = [2, 20] (see collective_workers.results)."""
    f = torch.tensor
    fp16_sum = (f(1.0 / 3.0).half() + f(4.0 / 3.0).half()).float().reshape(1)
    return {
        "size": 2,
        "average": f([1.5, 15.0]), "sum": f([3.0, 30.0]), "hvd_sum": f([3.0, 30.0]), "legacy_sum": f([3.0, 30.0]),
        "min": f([1.0, 10.0]), "max": f([2.0, 20.0]), "product": f([2.0, 200.0]),
        "scaled": f([1.5, 15.0]),  # (2*1 + 2*2) / 4, (2*10 + 2*20) / 4
        "int_average": f([3, -3, 3]),  # sums 7, -7, 7; halves 3.5, -3.5, 3.5 truncated toward zero
        "int16": f([3000], dtype=torch.int16), "float16": f([2.0], dtype=torch.float16),
        "bfloat16": f([2.0], dtype=torch.bfloat16), "fp16_wire": fp16_sum,
        "unchanged_input": f([1.0 + rank, 10.0 * (rank + 1)]),
        "inplace_is_arg": True, "inplace": f([3.0, 30.0]), "inplace_view": f([[3.0, 6.0], [4.0, 4.0]]),
        "polled": True, "async_h3": [f([2.0, 20.0]), f([1])], "async_h2_is_arg": True, "async_h2": f([1.5, 15.0]),
        "async_h1": f([3.0, 30.0]),
        "grouped": [f([3.0, 30.0]), f([3])], "grouped_": [f([3.0, 30.0]), f([2.0])],
        "grouped_async_": True, "grouped_async_value": f([1.0, 10.0]),
        "allgather": f([[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]]),
        "allgather_async": f([[1, 1], [2, 2], [2, 2]], dtype=torch.int8),
        "allgather_empty": torch.ones(2, 3, dtype=torch.bool),
        "allgather_bf16": f([[0.5], [1.5]], dtype=torch.bfloat16),
        "grouped_allgather": [f([[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]]), f([0, 1])],
        "grouped_allgather_async": [f([[0, 0], [1, 1]]), torch.ones(1, 1, dtype=torch.float64)],
        "broadcast_from_1": f([8.0, 9.0]), "broadcast_input": f([7.0 + rank, 8.0 + rank]),
        "broadcast__is_arg": True, "broadcast_": f([[5, 6]]), "broadcast_bool": f([True, False]),
        "broadcast_view": f([[2.0, 4.0], [3.0, 5.0]]), "broadcast_bf16": f([2.5], dtype=torch.bfloat16),
        "allgather_object": [("rank", 0, []), ("rank", 1, [1])], "allgather_object_default": [0, 10],
        "marker_seen_after_barrier": True,
        "layout": (2, 0, 1, True),  # one host, local ranks 0 and 1
        "grad_allreduce_sum": f([3.0, 4.0]),  # weights [1, 1] and [2, 3], summed
        "grad_allreduce_avg": f([1.5, 2.0]),
        "grad_allgather": f([[5.5]]) if rank == 0 else f([[11.0], [16.5]]),  # weights averaged, this rank's rows
        "grad_broadcast": f([1.5, 2.0]) if rank == 0 else f([0.0, 0.0]),
        "after_errors": f([1.0]),
    }


def _check(name: str, per_rank: list) -> None:
    horovod = name.startswith("horovod")
    for rank, got in enumerate(per_rank):
        assert got["rank"] == rank
        assert got["kind"] == {"torch": "torch", "mpi": "mpi"}.get(name, "horovod"), got["kind"]
        assert got["mpi_enabled"] == (name in ("mpi", "horovod-mpi")), got["mpi_enabled"]
        for key, want in expected(rank).items():
            _eq(got[key], want, key, rank)
        obj = got["broadcast_object"]
        assert obj.keys() == {"from", "w", "t"} and obj["from"] == 1 and obj["t"] == (1, "x")
        assert torch.equal(obj["w"], torch.tensor([1, 2]))
        for key in ("err_dtype", "err_shape", "err_gather_shape", "err_root"):
            assert got[key] != "no error", f"rank {rank} {key}: the mismatch was not detected"
        if horovod:  # Horovod's own negotiation finds and words them
            for key in ("err_dtype", "err_shape", "err_gather_shape", "err_root"):
                assert got[key].startswith("HorovodInternalError: Mismatched"), got[key]
            # Horovod names the two shapes in the order the requests reached its coordinator: either way round.
            assert any(f"shape [{a}], but another rank sent a tensor of shape [{b}]" in got["err_shape"]
                       for a, b in ((2, 3), (3, 2))), got["err_shape"]
            continue
        assert got["err_dtype"] == ("MismatchError: allreduce 'mismatch.dtype': the ranks disagree on the dtype: "
                                    "rank 0 torch.float32, rank 1 torch.float64"), got["err_dtype"]
        assert got["err_shape"] == ("MismatchError: allreduce 'mismatch.shape': the ranks disagree on the shape: "
                                    "rank 0 [2], rank 1 [3]"), got["err_shape"]
        assert got["err_gather_shape"] == ("MismatchError: allgather 'mismatch.gather': the ranks disagree on the "
                                           "shape: rank 0 [2], rank 1 [3]"), got["err_gather_shape"]
        assert got["err_root"] == ("MismatchError: broadcast 'mismatch.root': the ranks disagree on the root_rank: "
                                   "rank 0 0, rank 1 1"), got["err_root"]
        assert got["err_name"] == (f"MismatchError: allreduce 'mismatch.name.{rank}': the ranks gave different names: "
                                   f"rank {rank} 'mismatch.name.{rank}', rank(s) [{1 - rank}] another; every rank "
                                   "must call the same collectives in the same order"), got["err_name"]
        assert got["err_op"] == ("MismatchError: allreduce: the ranks disagree on the op: rank 0 sum, rank 1 max"), \
            got["err_op"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", RUNS)
def test_each_collective_gives_the_hand_computed_result(name, tmp_path):
    per_rank = _launch(name, collective_workers.results, timeout_s=360, marker=str(tmp_path / "marker"))
    _check(name, per_rank)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", RUNS)
def test_a_peer_that_never_calls_is_a_timeout_error_not_a_hang(name, tmp_path):
    timeout_s = timing.STALL_TIMEOUT_S
    _, outputs = _launch(name, collective_workers.stalled_peer, timeout_s=240, expect_failure=True,
                         stall_timeout_s=timeout_s, pause_s=timeout_s + timing.scaled(60),
                         marker=str(tmp_path / "rank-0-timed-out"))
    output = "\n".join(outputs) if isinstance(outputs, list) else outputs
    # horovodrun puts "[0]<stdout>:" before each line
    lines = [line[line.index("COLLECTIVE-TIMEOUT"):] for line in output.splitlines() if "COLLECTIVE-TIMEOUT" in line]
    assert len(lines) == 1, output[-3000:]
    waited = float(lines[0].split()[2])
    assert (
        f"s: CollectiveTimeout: rank 0 of 2: allreduce 'never.answered' did not complete within {timeout_s:g} s "
        "(init(timeout_s=...)): a rank has not called it, or has failed. Every rank must call the same collectives "
        "in the same order; after this error the job's collectives cannot be trusted, so end it") in lines[0], lines[0]
    assert timeout_s * 0.9 <= waited < timeout_s + timing.scaled(15), waited


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["torch", "mpi", "horovod-gloo"])
def test_a_horovod_script_runs_with_dcredit_opt_imported_as_hvd(name):
    per_rank = _launch(name, collective_workers.horovod_script, timeout_s=240)
    for rank, got in enumerate(per_rank):
        assert (got["rank"], got["size"], got["rows"]) == (rank, 2, 2)
        assert got["resume_from_epoch"] == 0, "broadcast_object did not give rank 0's epoch"
        assert len(got["losses"]) == 2 and got["losses"] == per_rank[0]["losses"], "metric averages differ"
        assert got["ranks_agree"], f"rank {rank}: parameters differ between ranks"
        assert got["has_join"] is False


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", RUNS)
def test_an_object_one_rank_cannot_send_is_an_error_on_every_rank_not_a_wait(name):
    """Note [Objects that cannot be sent]: the failing rank raises its own TypeError, the others one naming
    it, all at once (the collective timeout is 60 s: a rank that waited it out would report a TimeoutError
    instead), and the ranks stay in step."""
    per_rank = _launch(name, collective_workers.unsendable_objects, timeout_s=240)
    lambda_error = "TypeError: obj has type builtins.function, which cannot be sent: objects travel as JSON"
    instance_error = ("TypeError: obj[1] has type tests.distributed.collective_workers._Unsendable, which cannot be "
                      "sent: objects travel as JSON")
    for rank, got in enumerate(per_rank):
        assert got["rank"] == rank
        if rank == 0:
            assert got["bcast_bad_root"].startswith(lambda_error), got["bcast_bad_root"]
            assert got["gather_bad_1"].startswith(
                "TypeError: rank 0 of 2: allgather_object 'bad.gather': no object was received: rank 1's object "
                f"could not be sent ({instance_error}"), got["gather_bad_1"]
        else:
            assert got["bcast_bad_root"].startswith(
                "TypeError: rank 1 of 2: broadcast_object 'bad.bcast': no object was received: rank 0 (the root)'s "
                f"object could not be sent ({lambda_error}"), got["bcast_bad_root"]
            assert got["gather_bad_1"].startswith(instance_error), got["gather_bad_1"]
        assert got["gather_bad_both"].startswith("TypeError: obj['f'] has type builtins.builtin_function_or_method"), \
            got["gather_bad_both"]
        state_error = "TypeError: optimizer state entry 'note' of parameter 0 has type object, which cannot be broadcast"
        if rank == 0:
            assert got["state_bad_root"] == state_error, got["state_bad_root"]
        else:
            assert got["state_bad_root"] == ("TypeError: broadcast_optimizer_state: rank 0 (the root) could not send "
                                             f"its optimizer state: {state_error}"), \
                got["state_bad_root"]
        assert got["bcast_from_1"] == {"from": 1}
        assert got["gather_after"] == [("ok", 0), ("ok", 1)]
        assert got["bcast_after"] == {"from": 0}
