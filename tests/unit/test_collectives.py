"""Horovod's collective API in one process: argument checks, results in a world of one (by hand), the
descriptor the ranks agree on, the layout, the object codec, and the Horovod names we lack."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import dcredit_opt as dc
from dcredit_opt.collectives import core, objects
from dcredit_opt.collectives.jobinfo import Layout, layout_of, torchrun_layout
from dcredit_opt.collectives.missing import MISSING
from dcredit_opt.world import channels, control, runtime
from tests import timing

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]

# Every name horovod.torch 0.28.1 exports (its __init__.py): each is provided or refused with a message.
HOROVOD_TORCH_NAMES = [
    "elastic", "Compression", "allgather_object", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_", "sparse_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_async",
    "broadcast_", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "join", "barrier", "poll", "synchronize", "init",
    "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "ProcessSet", "global_process_set",
    "add_process_set", "remove_process_set", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "HorovodInternalError", "DistributedOptimizer", "SyncBatchNorm",
]


@pytest.fixture(autouse=True)
def world_of_one():
    dc.init()
    assert dc.size() == 1


# ---- the names ------------------------------------------------------------------------------


def test_every_horovod_name_is_provided_or_refused_with_a_message():
    provided = [n for n in HOROVOD_TORCH_NAMES if n in dc.__all__]
    refused = [n for n in HOROVOD_TORCH_NAMES if n in MISSING]
    assert sorted(provided + refused) == sorted(HOROVOD_TORCH_NAMES), "a Horovod name is neither"
    assert not set(provided) & set(refused)
    for name in provided:
        assert getattr(dc, name) is not None
    for name in refused:
        with pytest.raises(dc.MissingHorovodName, match=rf"dcredit_opt has no {name} \(Horovod's "
                                                        rf"horovod\.torch\.{name}\): .{{20}}"):
            getattr(dc, name)
        assert not hasattr(dc, name)
    assert issubclass(dc.MissingHorovodName, AttributeError) and issubclass(dc.MissingHorovodName, NotImplementedError)


def test_the_refusals_say_what_to_use_instead():
    for name, words in [("alltoall", "all_to_all_single"), ("reducescatter", "allreduce"),
                        ("join", "same number of steps"), ("add_process_set", "need no registration"),
                        ("SyncBatchNorm", "torch.nn.SyncBatchNorm"), ("sparse_allreduce_async", "reduces sparse gradients itself")]:
        with pytest.raises(NotImplementedError, match=words):
            getattr(dc, name)


def test_an_unknown_name_is_a_plain_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'") as info:
        dc.no_such_thing  # noqa: B018
    assert not isinstance(info.value, NotImplementedError)
    from dcredit_opt import planner  # a submodule not yet imported still imports

    assert planner is not None


def test_all_is_sorted_and_complete():
    assert dc.__all__ == sorted(dc.__all__)
    for name in dc.__all__:
        assert hasattr(dc, name), name


def test_horovod_installed_exports_nothing_beyond_the_list():
    hvd = pytest.importorskip("horovod.torch", reason="Horovod is not installed (make horovod)")
    source = Path(hvd.__file__).read_text()
    imported = set()
    for line in source.splitlines():
        line = line.strip()
        if line.startswith("from horovod.torch") and " import " in line:
            imported.update(n.strip() for n in line.split(" import ", 1)[1].split(","))
    assert imported == set(HOROVOD_TORCH_NAMES), imported ^ set(HOROVOD_TORCH_NAMES)


def test_signatures_are_horovods():
    hvd = pytest.importorskip("horovod.torch", reason="Horovod is not installed (make horovod)")
    from dcredit_opt import collectives

    # Horovod's own functions (not is_homogeneous, which horovod.torch lacks); broadcast_optimizer_state lacks
    # Horovod's ``model`` (Horovod finds sparse parameters with it; ours needs none).
    names = [n for n in collectives.__all__ if callable(getattr(collectives, n)) and n in HOROVOD_TORCH_NAMES
             and n not in ("Handle", "broadcast_optimizer_state")]
    assert len(names) > 30
    for name in names:
        ours = list(inspect.signature(getattr(dc, name)).parameters)
        theirs = list(inspect.signature(getattr(hvd, name)).parameters)
        if name == "allgather_object":
            theirs.append("process_set")  # ours also takes Horovod's usual process_set
        assert ours == theirs, f"{name}: ours {ours}, Horovod's {theirs}"


# ---- before init -------------------------------------------------------------------------------

BEFORE_INIT = r'''
import json, torch, dcredit_opt as dc
t = torch.ones(2)
calls = {"allreduce": lambda: dc.allreduce(t), "allreduce_": lambda: dc.allreduce_(t),
         "allreduce_async": lambda: dc.allreduce_async(t), "grouped_allreduce": lambda: dc.grouped_allreduce([t]),
         "allgather": lambda: dc.allgather(t), "broadcast": lambda: dc.broadcast(t, 0),
         "broadcast_": lambda: dc.broadcast_(t, 0), "broadcast_object": lambda: dc.broadcast_object(1),
         "allgather_object": lambda: dc.allgather_object(1), "barrier": dc.barrier, "local_size": dc.local_size,
         "cross_rank": dc.cross_rank, "cross_size": dc.cross_size, "start_timeline": lambda: dc.start_timeline("x")}
out = {"initialized": dc.is_initialized()}
for name, call in calls.items():
    try:
        call()
        out[name] = "no error"
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
'''


def test_every_call_before_init_is_a_value_error_naming_the_call():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", BEFORE_INIT], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=timing.scaled(120), check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result.pop("initialized") is False
    for name, text in result.items():
        assert text == f"ValueError: {name}() called before init(): call hvd.init() (dcredit_opt.init()) first", text


# ---- bad arguments ------------------------------------------------------------------------------

T = torch.tensor([1.0, 2.0])


@pytest.mark.parametrize("call, error, message", [
    (lambda: dc.allreduce("1.0"), TypeError, "allreduce: tensor must be a torch.Tensor, got str"),
    (lambda: dc.allreduce_([1.0]), TypeError, "allreduce_: tensor must be a torch.Tensor, got list"),
    (lambda: dc.allreduce(torch.ones(2).to_sparse()), TypeError, "sparse_coo tensor"),
    (lambda: dc.allreduce(torch.ones(2, dtype=torch.bool)), TypeError, "torch.bool, which cannot be reduced"),
    (lambda: dc.allreduce(torch.ones(2, dtype=torch.complex64)), TypeError, "complex64, which cannot be reduced"),
    (lambda: dc.allreduce(torch.ones(2, dtype=torch.int32), op=2), TypeError, "op=Adasum combines floating-point"),
    (lambda: dc.allreduce(torch.ones(2, requires_grad=True), op=dc.Adasum), ValueError, "not differentiable"),
    (lambda: dc.grouped_allreduce([torch.ones(2, requires_grad=True)], op=dc.Adasum), ValueError,
     "not differentiable"),
    (lambda: dc.allreduce(T, op="max"), ValueError, "op must be Average, Sum, Adasum, Min, Max or Product"),
    (lambda: dc.allreduce(T, op=True), ValueError, "op must be"),
    (lambda: dc.allreduce(T, op=7), ValueError, "got 7"),
    (lambda: dc.allreduce(T, op=dc.Sum, average=True), ValueError, "op parameter supersedes average"),
    (lambda: dc.allreduce(T, name=3), TypeError, "name must be a str or None, got int"),
    (lambda: dc.allreduce(T, prescale_factor="2"), TypeError, "prescale_factor must be a number, got str"),
    (lambda: dc.allreduce(T, postscale_factor=float("inf")), ValueError, "postscale_factor must be finite"),
    (lambda: dc.allreduce(T, process_set=object()), TypeError, "allreduce: process_set must be a dcredit_opt"),
    (lambda: dc.allgather(T, process_set=[1]), dc.DCreditError, r"allgather: process_set=\[1\]: rank\(s\) \[1\]"),
    (lambda: dc.broadcast_(T, 0, process_set=dc.ProcessSet([0, 1])), dc.DCreditError, "broadcast_: process_set"),
    (lambda: dc.allreduce(T, compression="fp16"), TypeError, "compression must be a Compression"),
    (lambda: dc.grouped_allreduce(T), TypeError, "grouped_allreduce: tensors must be a list of tensors, got Tensor"),
    (lambda: dc.grouped_allreduce([T, 1.0]), TypeError, r"tensors\[1\] must be a torch.Tensor, got float"),
    (lambda: dc.allgather(torch.tensor(1.0)), ValueError, "at least one dimension"),
    (lambda: dc.allgather(np.ones(2)), TypeError, "allgather: tensor must be a torch.Tensor, got ndarray"),
    (lambda: dc.grouped_allgather(T), TypeError, "grouped_allgather: tensors must be a list"),
    (lambda: dc.grouped_allgather_async([T, 3]), TypeError, r"grouped_allgather_async: tensor must be a torch.Tensor"),
    (lambda: dc.broadcast(T, 1), ValueError, r"broadcast: root_rank must be a rank in 0\.\.0, got 1"),
    (lambda: dc.broadcast_(T, -1), ValueError, "got -1"),
    (lambda: dc.broadcast_(T, True), ValueError, "got True"),
    (lambda: dc.broadcast_async(T, "0"), ValueError, "got '0'"),
    (lambda: dc.broadcast([1], 0), TypeError, "broadcast: tensor must be a torch.Tensor, got list"),
    (lambda: dc.broadcast_object(1, root_rank=2), ValueError, "broadcast_object: root_rank"),
    (lambda: dc.broadcast_object({"f": len}), TypeError, r"obj\['f'\] has type builtins.builtin_function"),
    (lambda: dc.allgather_object([object()]), TypeError, r"obj\[0\] has type builtins.object.*never pickled"),
    (lambda: dc.synchronize(5), TypeError, "synchronize: handle must be what an \\*_async function returned"),
    (lambda: dc.poll(None), TypeError, "poll: handle"),
    (lambda: dc.start_timeline(None), TypeError, "file_path"),
])
def test_bad_arguments_name_the_culprit(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_bad_arguments_change_nothing():
    t = torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError):
        dc.allreduce_(t, op="sum")
    with pytest.raises(ValueError):
        dc.broadcast_(t, 3)
    assert t.tolist() == [1.0, 2.0]


# ---- results in a world of one, by hand ---------------------------------------------------------


def test_allreduce_ops_and_scales():
    t = torch.tensor([1.5, -2.0, 4.0])
    assert dc.allreduce(t).tolist() == [1.5, -2.0, 4.0]
    assert dc.allreduce(t, op=dc.Sum, prescale_factor=2.0, postscale_factor=0.5).tolist() == [1.5, -2.0, 4.0]
    assert dc.allreduce(t, op=dc.Average, postscale_factor=3).tolist() == [4.5, -6.0, 12.0]
    for op in (dc.Min, dc.Max, dc.Product, 0, 1):
        assert dc.allreduce(t, op=op, prescale_factor=2.0).tolist() == [3.0, -4.0, 8.0]
    # Integers are scaled as Horovod does: multiplied, then truncated toward zero.
    assert dc.allreduce(torch.tensor([7, -7, 3]), prescale_factor=0.5).tolist() == [3, -3, 1]
    out = dc.allreduce(torch.tensor([5], dtype=torch.int16), op=dc.Sum)
    assert out.dtype == torch.int16 and out.tolist() == [5]
    assert t.tolist() == [1.5, -2.0, 4.0], "allreduce changed its input"


def test_legacy_average_warns_and_means_average_or_sum():
    t = torch.tensor([2.0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert dc.allreduce(t, average=False, postscale_factor=2.0).tolist() == [4.0]
        assert dc.allreduce(t, average=True).tolist() == [2.0]
    assert [w.category for w in caught] == [DeprecationWarning, DeprecationWarning]
    assert caught[0].filename == __file__, "the warning should point at the caller's line"


def test_in_place_forms_return_their_argument_and_handle_views():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    view = t.t()  # not contiguous
    out = dc.allreduce_(view, op=dc.Sum, prescale_factor=10.0)
    assert out is view
    assert t.tolist() == [[0.0, 10.0, 20.0], [30.0, 40.0, 50.0]]
    b = torch.tensor([1, 2])
    assert dc.broadcast_(b, 0) is b and b.tolist() == [1, 2]
    group = [torch.tensor([1.0]), torch.tensor([2], dtype=torch.int32)]
    outs = dc.grouped_allreduce_(group, op=dc.Sum, postscale_factor=3)
    assert outs[0] is group[0] and outs[1] is group[1]
    assert group[0].tolist() == [3.0] and group[1].tolist() == [6] and group[1].dtype == torch.int32


def test_async_handles_poll_and_synchronize():
    t = torch.tensor([1.0, 2.0])
    h = dc.allreduce_async(t, op=dc.Sum, postscale_factor=2.0)
    assert dc.poll(h) is True
    assert dc.synchronize(h).tolist() == [2.0, 4.0]
    assert dc.synchronize(h).tolist() == [2.0, 4.0], "a second synchronize returns the result again"
    h = dc.allreduce_async_(t, postscale_factor=0.5)
    assert dc.synchronize(h) is t and t.tolist() == [0.5, 1.0]
    h = dc.grouped_allreduce_async([t, torch.tensor([4])], op=dc.Max)
    assert [x.tolist() for x in dc.synchronize(h)] == [[0.5, 1.0], [4]]
    h = dc.grouped_allreduce_async_([t], prescale_factor=4.0)
    assert dc.synchronize(h)[0] is t and t.tolist() == [2.0, 4.0]
    assert dc.synchronize(dc.allgather_async(torch.ones(1, 2))).shape == (1, 2)
    h = dc.grouped_allgather_async([torch.ones(1, 2), torch.tensor([5])])
    assert dc.poll(h) is True
    assert [x.tolist() for x in dc.synchronize(h)] == [[[1.0, 1.0]], [5]]
    assert dc.synchronize(dc.broadcast_async(t, 0)).tolist() == [2.0, 4.0]
    b = torch.zeros(2)
    assert dc.synchronize(dc.broadcast_async_(b, 0)) is b
    assert "done" in repr(h)


def test_outputs_are_new_tensors():
    t = torch.tensor([[1.0, 2.0]])
    for out in (dc.allreduce(t), dc.allgather(t), dc.broadcast(t, 0), dc.grouped_allreduce([t])[0],
                dc.grouped_allgather([t])[0]):
        assert out.tolist() == [[1.0, 2.0]] and out.data_ptr() != t.data_ptr()


def test_allgather_keeps_dtype_and_shape():
    for dtype in (torch.bool, torch.uint8, torch.int16, torch.int64, torch.float16, torch.bfloat16, torch.complex64):
        t = torch.ones(3, 2, dtype=dtype)
        out = dc.allgather(t)
        assert out.dtype == dtype and out.shape == (3, 2) and torch.equal(out, t)
    assert dc.allgather(torch.empty(0, 4)).shape == (0, 4)


def test_compression_fp16_travels_as_half_and_comes_back():
    t = torch.tensor([1.0 / 3.0])
    out = dc.allreduce(t, compression=dc.Compression.fp16)
    assert out.dtype == torch.float32
    assert out.item() == torch.tensor(1.0 / 3.0).half().float().item()
    assert dc.allreduce(t, compression=dc.Compression.none).item() == t.item()


def test_objects_and_barrier():
    state = {"epoch": 3, "best": (0.5, float("inf")), "tags": {"a", "b"}, "w": torch.arange(3)}
    got = dc.broadcast_object(state, root_rank=0, name="resume")
    assert got["epoch"] == 3 and got["best"] == (0.5, float("inf")) and got["tags"] == {"a", "b"}
    assert torch.equal(got["w"], torch.arange(3)) and got is not state
    assert dc.allgather_object({"rank": dc.rank()}) == [{"rank": 0}]
    assert dc.barrier() is None


def test_layout_in_a_world_of_one():
    assert (dc.local_size(), dc.cross_rank(), dc.cross_size(), dc.is_homogeneous()) == (1, 0, 1, True)


def test_the_global_process_set_is_accepted_everywhere():
    ps = dc.global_process_set
    assert (ps.process_set_id, ps.size(), ps.rank(), ps.included(), ps.ranks) == (0, 1, 0, True, [0])
    assert dc.allreduce(torch.tensor([2.0]), op=dc.Sum, process_set=ps).tolist() == [2.0]
    assert dc.broadcast_object("x", process_set=ps) == "x"
    dc.barrier(process_set=ps)
    model = nn.Linear(2, 1)
    dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                            process_set=ps, config=dc.Config(block_bytes=64, policy="fixed"))


def test_a_process_set_of_every_rank_runs_the_collectives_on_every_rank():
    for ps in (dc.ProcessSet([0]), [0]):
        assert dc.allreduce(torch.tensor([2.0]), op=dc.Sum, process_set=ps).tolist() == [2.0]
        assert dc.allgather(torch.ones(2, 1), process_set=ps).shape == (2, 1)
        assert dc.broadcast(torch.tensor([3]), 0, process_set=ps).tolist() == [3]
        assert dc.allgather_object({"a": 1}, process_set=ps) == [{"a": 1}]
        dc.barrier(process_set=ps)


def test_build_and_world_queries():
    assert dc.gloo_built() is True and dc.gloo_enabled() is True and dc.mpi_enabled() is False
    assert dc.mpi_threads_supported() is False and dc.ddl_built() is False and dc.ccl_built() is False
    assert dc.cuda_built() == torch.backends.cuda.is_built() and dc.rocm_built() == (torch.version.hip is not None)
    assert isinstance(dc.nccl_built(), bool) and isinstance(dc.mpi_built(), bool)


# ---- autograd -------------------------------------------------------------------------------------


def test_allreduce_gradient_is_the_same_reduction():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    (dc.allreduce(x, op=dc.Sum, prescale_factor=3.0) * torch.tensor([1.0, 10.0])).sum().backward()
    assert x.grad.tolist() == [3.0, 30.0]
    y = torch.tensor([1.0], requires_grad=True)
    z = torch.tensor([2.0], requires_grad=True)
    a, b = dc.grouped_allreduce([y, z], op=dc.Sum, postscale_factor=2.0)
    (a * 5 + b * 7).sum().backward()
    assert y.grad.tolist() == [10.0] and z.grad.tolist() == [14.0]


def test_allgather_and_broadcast_gradients():
    x = torch.ones(2, 2, requires_grad=True)
    (dc.allgather(x) * torch.tensor([[1.0, 2.0], [3.0, 4.0]])).sum().backward()
    assert x.grad.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    y = torch.tensor([1.0, 1.0], requires_grad=True)
    (dc.broadcast(y, 0) * torch.tensor([5.0, 6.0])).sum().backward()
    assert y.grad.tolist() == [5.0, 6.0]


# ---- waits have a deadline -------------------------------------------------------------------------


def test_a_horovod_handle_that_never_completes_times_out_without_spinning(monkeypatch):
    class NeverDone:
        polls = 0

        def poll(self, handle):
            NeverDone.polls += 1
            return False

        def synchronize(self, handle):
            raise AssertionError("synchronize would wait forever")

    monkeypatch.setattr(runtime, "timeout_s", lambda: 0.3)
    h = core.Handle("allreduce 'x'", hvd=NeverDone(), hvd_handle=7, finish=lambda out: out)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^rank 0 of 1: allreduce 'x' did not complete within 0.3 s"):
        dc.synchronize(h)
    assert 0.3 <= time.monotonic() - start < timing.scaled(5)
    assert dc.poll(h) is False
    assert NeverDone.polls < 200, f"{NeverDone.polls} polls in 0.3 s: the wait spins"


def test_a_failed_or_late_transport_wait_is_named(monkeypatch):
    class Work:
        def __init__(self, message):
            self.message = message

        def is_completed(self):
            return False

        def wait(self, timeout):
            assert timeout.total_seconds() <= 0.3
            raise RuntimeError(self.message)

    monkeypatch.setattr(runtime, "timeout_s", lambda: 0.3)
    with pytest.raises(TimeoutError, match="broadcast did not complete within 0.3 s"):
        core.Handle("broadcast", works=[Work("Operation timed out!")]).wait()
    with pytest.raises(RuntimeError, match="rank 0 of 1: barrier failed: Connection closed by peer") as info:
        core.Handle("barrier", works=[Work("Connection closed by peer")]).wait()
    assert not isinstance(info.value, TimeoutError)


class _FakeHorovod:
    """Stands in for ``horovod.torch`` in a 2-rank Horovod world: its operations complete after ``polls_needed``
    polls (never, with None), and it records what was started."""

    def __init__(self, polls_needed):
        self.polls_needed, self.polls, self.started = polls_needed, 0, []

    def allgather_async(self, tensor, name=None):
        self.started.append(("allgather_async", name))
        return ("allgather", tensor)

    def broadcast_async_(self, tensor, root_rank, name=None):
        self.started.append(("broadcast_async_", name, root_rank))
        return ("broadcast", tensor)

    def poll(self, handle):
        self.polls += 1
        return self.polls_needed is not None and self.polls >= self.polls_needed

    def synchronize(self, handle):
        assert self.poll(handle), "synchronize before the operation finished would wait forever"
        kind, tensor = handle
        if kind == "allgather":  # rank 1's row is rank 0's plus one
            return torch.cat([tensor, tensor + 1])
        tensor.fill_(7)  # the root's bytes, written in place
        return tensor

    def allgather(self, *args, **kwargs):
        raise AssertionError("the synchronous form has no deadline")

    broadcast_ = allgather


def _horovod_world(monkeypatch, hvd, timeout_s):
    world = runtime.World(rank=0, size=2, local_rank=0, owns_default_group=False, timeout_s=timeout_s,
                          kind="horovod", hvd=hvd)
    monkeypatch.setattr(runtime, "_world", world)
    return world


def test_the_control_plane_under_horovod_polls_async_operations_to_their_result(monkeypatch):
    hvd = _FakeHorovod(polls_needed=5)
    _horovod_world(monkeypatch, hvd, timeout_s=30.0)
    rows = control.all_gather(torch.tensor([[1, 2]], dtype=torch.int32), name="model.summary")
    assert [r.tolist() for r in rows] == [[[1, 2]], [[2, 3]]]
    t = torch.zeros(2, dtype=torch.int16)
    control.broadcast_(t, 1, name="text.length")
    assert t.view(torch.uint8).tolist() == [7, 7, 7, 7]  # moved as bytes
    assert hvd.started == [("allgather_async", "dc.ctl.model.summary"), ("broadcast_async_", "dc.ctl.text.length", 1)]


@pytest.mark.parametrize("call", ["all_gather", "broadcast_"])
def test_a_control_plane_operation_a_peer_never_joins_times_out_under_horovod(monkeypatch, call):
    hvd = _FakeHorovod(polls_needed=None)
    _horovod_world(monkeypatch, hvd, timeout_s=0.3)
    t = torch.zeros(3, dtype=torch.int64)
    start = time.monotonic()
    op = "all_gather 'dc.ctl.setup.digests'" if call == "all_gather" else "broadcast_ 'dc.ctl.setup.digests'"
    with pytest.raises(TimeoutError, match=(
            rf"^rank 0 of 2: control-plane operation {op} did not complete within 0.3 s \(init\(timeout_s=\.\.\.\)\): "
            "a peer is gone or did not reach the same call")):
        if call == "all_gather":
            control.all_gather(t, name="setup.digests")
        else:
            control.broadcast_(t, 0, name="setup.digests")
    assert 0.3 <= time.monotonic() - start < timing.scaled(5)
    # Sleeps grow from 20 us to 2 ms: about 160 polls in 0.3 s; a spinning wait would make many thousands.
    assert 5 < hvd.polls < 400, f"{hvd.polls} polls in 0.3 s"
    assert t.tolist() == [0, 0, 0], "the tensor changed though the operation did not complete"


# ---- the descriptor the ranks agree on (pure) ------------------------------------------------------


def test_describe_and_disagreement_by_hand():
    a = core.describe("allreduce", [torch.zeros(2, 3)], "sum", name="loss")
    b = core.describe("allreduce", [torch.zeros(2, 3, dtype=torch.float64)], "sum", name="loss")
    assert core.disagreement([a, a], "allreduce 'loss'", "loss", 0) is None
    assert core.disagreement([a, b], "allreduce 'loss'", "loss", 1) == (
        "allreduce 'loss': the ranks disagree on the dtype: rank 0 torch.float32, rank 1 torch.float64")
    c = core.describe("allreduce", [torch.zeros(3)], "sum", name="loss")
    assert core.disagreement([a, c], "allreduce", "loss", 0) == (
        "allreduce: the ranks disagree on the shape: rank 0 [2, 3], rank 1 [3]")
    d = core.describe("allreduce", [torch.zeros(2, 3)], "average", name="loss")
    assert "disagree on the op: rank 0 sum, rank 1 average" in core.disagreement([a, d], "allreduce", "loss", 0)
    e = core.describe("allreduce", [torch.zeros(2, 3)], "sum", name="acc")
    assert core.disagreement([a, e, a], "allreduce 'loss'", "loss", 0) == (
        "allreduce 'loss': the ranks gave different names: rank 0 'loss', rank(s) [1] another; every rank must "
        "call the same collectives in the same order")
    f = core.describe("broadcast", [torch.zeros(2, 3)], root_rank=1)
    assert "the operation: rank 0 allreduce, rank 1 broadcast" in core.disagreement([a, f], "allreduce", None, 0)
    g = core.describe("broadcast", [torch.zeros(2, 3)], root_rank=0)
    assert "the root_rank: rank 0 1, rank 1 0" in core.disagreement([f, g], "broadcast", None, 0)
    big = core.describe("allreduce", [torch.zeros([1] * 8)], "sum")
    assert core._shape_text(big) == "[1, 1, 1, 1, 1, 1, ...]"
    # Over a process set the rows are the set's ranks, named by their global ranks.
    assert core.disagreement([a, b], "allreduce on process_set [1, 3]", "loss", 3, [1, 3]) == (
        "allreduce on process_set [1, 3]: the ranks disagree on the dtype: rank 1 torch.float32, rank 3 "
        "torch.float64")
    assert "rank 1 'loss', rank(s) [3] another" in core.disagreement([a, e], "allreduce", "loss", 1, [1, 3])


def test_allgather_descriptors_ignore_the_first_dimension_only():
    a = core.describe("allgather", [torch.zeros(2, 3)], gather=True)
    b = core.describe("allgather", [torch.zeros(5, 3)], gather=True)
    c = core.describe("allgather", [torch.zeros(5, 4)], gather=True)
    assert a[-1] == 2 and b[-1] == 5
    assert core.disagreement([a, b], "allgather", None, 0) is None
    assert core.disagreement([a, c], "allgather", None, 0) == (
        "allgather: the ranks disagree on the shape: rank 0 [3], rank 1 [4]")


def test_grouped_descriptors_compare_every_tensor():
    a = core.describe("grouped_allreduce", [torch.zeros(2), torch.zeros(3)], "sum")
    b = core.describe("grouped_allreduce", [torch.zeros(2), torch.zeros(4)], "sum")
    c = core.describe("grouped_allreduce", [torch.zeros(2)], "sum")
    assert "disagree on the shape" in core.disagreement([a, b], "grouped_allreduce", None, 0)
    assert "disagree on the number of tensors: rank 0 2, rank 1 1" in core.disagreement(
        [a, c], "grouped_allreduce", None, 0)


# ---- the layout (pure) ----------------------------------------------------------------------------


def test_layout_of_by_hand():
    assert layout_of(["a", "a", "b", "b"], [0, 1, 0, 1], 3) == Layout(2, 1, 2, True)
    assert layout_of(["a", "a", "b", "b"], [0, 1, 0, 1], 0) == Layout(2, 0, 2, True)
    # Three ranks on a, one on b: rank 3 is the second rank with local rank 0.
    assert layout_of(["a", "a", "a", "b"], [0, 1, 2, 0], 3) == Layout(1, 1, 2, False)
    assert layout_of(["a", "a", "a", "b"], [0, 1, 2, 0], 2) == Layout(3, 0, 1, False)


def test_torchrun_layout():
    assert torchrun_layout({"LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "3"}) == Layout(
        4, 1, 3, True)
    assert torchrun_layout({"LOCAL_WORLD_SIZE": "4"}) is None
    assert torchrun_layout({"LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "3", "GROUP_WORLD_SIZE": "3"}) is None


# ---- the object codec (no pickle) -------------------------------------------------------------------


def test_codec_round_trips_by_value_and_type():
    value = {"i": 10**30, "f": 0.1, "nan": float("nan"), "s": "é", "b": b"\x00\xff", "ba": bytearray(b"x"),
             (1, "k"): [None, True, (2,)], "set": {1, 2}, "fs": frozenset({"a"}), 3: -1,
             "t": torch.tensor([[1.5, 2.0]], dtype=torch.bfloat16), "empty": torch.zeros(0, 2, dtype=torch.int8),
             "np": np.arange(3, dtype=np.uint16), "scalar": np.float32(2.5)}
    got = objects.decode(objects.encode(value))
    assert got.keys() == value.keys()
    assert got["i"] == 10**30 and got["f"] == 0.1 and got["nan"] != got["nan"] and got["s"] == "é"
    assert got["b"] == b"\x00\xff" and type(got["ba"]) is bytearray and got[(1, "k")] == [None, True, (2,)]
    assert got["set"] == {1, 2} and type(got["fs"]) is frozenset and got[3] == -1
    assert got["t"].dtype == torch.bfloat16 and torch.equal(got["t"], value["t"])
    assert got["empty"].shape == (0, 2) and got["empty"].dtype == torch.int8
    assert got["np"].dtype == np.uint16 and got["np"].tolist() == [0, 1, 2]
    assert type(got["scalar"]) is np.float32 and got["scalar"] == 2.5


def test_codec_refuses_what_would_need_pickle_and_bytes_it_did_not_make():
    class Thing:
        pass

    for bad, where in [(Thing(), "obj has type"), ([1, {"k": Thing()}], r"obj\[1\]\['k'\] has type"),
                       (np.array(["x"]), "numpy <U1 array"), (torch.ones(2).to_sparse(), "sparse_coo tensor")]:
        with pytest.raises(TypeError, match=where):
            objects.encode(bad)
    for raw in [b"\x80\x04K\x01.", b'{"a": 1, "b": 2}', b'{"weird": 1}', b'{"float": "1.5"}', b"NaN",
                b'{"tensor": ["float32", [2], false, "AAAA"]}', b'{"tensor": ["object", [1], false, ""]}',
                b'{"ndarray": ["|O", [1], "AAAAAAAAAAA="]}', b"[" * 100000]:
        with pytest.raises(ValueError, match="do not decode"):
            objects.decode(raw)


# ---- the timeline switch ---------------------------------------------------------------------------


def test_start_and_stop_timeline_switch_a_live_optimizer(tmp_path):
    from dcredit_opt.world import job

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  config=dc.Config(block_bytes=64, window=2, policy="fixed"))

    def steps(n):
        for _ in range(n):
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()

    # every live optimizer is switched, ".opt<k>" added for all but the first: an earlier test's optimizer still
    # alive in this process (held by a traceback, say) takes the plain path
    k = job.users().index(opt._dc)
    path = tmp_path / ("trace.json" if k == 0 else f"trace.json.opt{k}")
    dc.start_timeline(str(tmp_path / "trace.json"), mark_cycles=True)
    steps(3)
    events = json.loads(path.read_text())["traceEvents"]
    assert any(e["name"].startswith("block ") for e in events)
    dc.stop_timeline()
    path.unlink()
    steps(2)
    assert not path.exists(), "the optimizer kept recording after stop_timeline()"
    opt.synchronize()


@pytest.mark.parametrize("on_cpu, expected", [(True, "torch"), (False, "horovod")])
def test_auto_under_horovod_is_our_channels_on_cpus_and_horovods_operations_on_gpus(monkeypatch, on_cpu, expected):
    # Note [C++ channels under Horovod]; whether the job runs on CPUs is decided already (the next test).
    from dcredit_opt import backends

    _horovod_world(monkeypatch, _FakeHorovod(polls_needed=1), timeout_s=30.0).on_cpu = on_cpu
    assert backends.detect() == expected


def test_whether_a_horovod_job_runs_on_cpus_is_decided_once_by_every_rank(monkeypatch):
    hvd = _FakeHorovod(polls_needed=1)
    _horovod_world(monkeypatch, hvd, timeout_s=30.0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # this rank has CUDA; the fake's rank 1 has not
    assert channels.horovod_on_cpu() is True  # one rank without CUDA makes it a CPU job for all
    assert channels.horovod_on_cpu() is True
    assert hvd.started == [("allgather_async", "dc.ctl.cpu")]  # asked once per job
