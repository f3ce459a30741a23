"""F6 bad input and the CPU side of the CUDA path, in a world of one on the CPU.

What needs a GPU is in tests/distributed/test_nccl.py. Here: the device and
process-group checks (CUDA parameters stood in for by objects that only have
a ``device``, since no CUDA tensor can exist without a GPU), the refusal of
meta parameters through the public API, the engine's event API being a no-op
on CPU blocks, and a CPU build that carries no CUDA code.
"""

import copy
import glob
import os
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dcredit_opt as dc
from dcredit_opt import _ext
from dcredit_opt.optimizer import devices
from dcredit_opt.world import channels, control

pytestmark = pytest.mark.timeout(120)

FIXED = dc.Config(block_bytes=64, window=2, policy="fixed")
CPU, CUDA0, CUDA1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)


def fake(*devs):
    """Stand-ins for parameters: the checks read only ``device``."""
    return [f"p{i}" for i in range(len(devs))], [types.SimpleNamespace(device=d) for d in devs]


# ---- one device per optimizer ------------------------------------------------

def test_cuda_mixed_with_cpu_names_both_and_says_what_to_do():
    names, params = fake(CUDA0, CUDA0, CPU)
    with pytest.raises(ValueError, match=r"'p0' on cuda:0, 'p2' on cpu.*model.to\(f'cuda:\{local_rank\}'\)"):
        devices.device_of(names, params)


def test_two_gpus_in_one_rank_ask_for_one_process_per_gpu():
    names, params = fake(CUDA0, CUDA1)
    with pytest.raises(ValueError, match=r"'p0' on cuda:0, 'p1' on cuda:1.*one process per GPU"):
        devices.device_of(names, params)


@pytest.mark.parametrize("devs, expected", [((), CPU), ((CPU, CPU), CPU), ((CUDA1,), CUDA1)])
def test_one_device_is_accepted(devs, expected):
    assert devices.device_of(*fake(*devs)) == expected


def test_meta_parameters_are_refused_before_anything_happens():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3, device="meta"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = copy.deepcopy(model[0].state_dict())
    with pytest.raises(ValueError, match=r"'1.weight' is on meta.*CPU or on CUDA"):
        dc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), config=FIXED)
    assert all(torch.equal(v, before[k]) for k, v in model[0].state_dict().items())
    assert not getattr(model[0].weight, "_post_accumulate_grad_hooks", None)


# ---- the process group must carry the device -----------------------------------

@pytest.mark.parametrize("backend, carried", [
    ("nccl", {"cuda"}), ("gloo", {"cpu", "cuda"}), ("cpu:gloo,cuda:nccl", {"cpu", "cuda"}),
    ("cuda:nccl", {"cuda"}), ("some-third-party-backend", None)])
def test_device_types_of_a_backend(backend, carried):
    assert devices.device_types(backend) == carried


def test_nccl_with_cpu_parameters_is_refused_with_the_way_out():
    names, params = fake(CPU, CPU)
    with pytest.raises(ValueError, match=r"uses nccl, which carries cuda tensors only.*'p0'.*'gloo'"):
        devices.check_group(names, params, "nccl")


@pytest.mark.parametrize("backend, devs, control", [
    ("gloo", (CPU,), None), ("cpu:gloo,cuda:nccl", (CPU,), None), ("gloo", (CUDA1,), None),
    ("nccl", (CUDA1,), CUDA1), ("some-third-party-backend", (CPU,), None)])
def test_groups_that_carry_the_device_pass(backend, devs, control):
    names, params = fake(*devs)
    devices.check_group(names, params, backend, control)
    # What the check guards holds in each accepted case: the group carries the parameters' device (a backend
    # we do not know is trusted), and the control plane, where it is a GPU, is the parameters' own.
    device = devices.device_of(names, params)
    carried = devices.device_types(backend)
    assert carried is None or device.type in carried, (backend, device)
    assert control is None or control == device, (control, device)


def test_nccl_on_another_gpu_than_the_current_one_asks_for_set_device():
    names, params = fake(CUDA1, CUDA1)
    with pytest.raises(ValueError, match=r"on cuda:1 \('p0'\).*current CUDA device is cuda:0.*set_device\(1\)"):
        devices.check_group(names, params, "nccl", CUDA0)


def test_cuda_parameters_need_an_extension_built_with_cuda():
    names, params = fake(CUDA0)
    with pytest.raises(ValueError, match=r"on cuda:0 \('p0'\).*built without CUDA"):
        devices.check_extension(names, params, with_cuda=False)
    devices.check_extension(names, params, with_cuda=True)
    devices.check_extension(*fake(CPU), with_cuda=False)


def test_an_nccl_default_group_with_a_cpu_model_fails_before_any_communication(monkeypatch):
    dc.init()
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")

    def no_communication(*args, **kwargs):
        raise AssertionError("communication was attempted before the device check")

    monkeypatch.setattr(control, "all_gather", no_communication)
    monkeypatch.setattr(control, "broadcast_", no_communication)
    monkeypatch.setattr(dc.optimizer.core.backends, "create", no_communication)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"uses nccl.*parameters are on the CPU \('weight'\)"):
        dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                named_parameters=model.named_parameters(), config=FIXED)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not getattr(model.weight, "_post_accumulate_grad_hooks", None)


# ---- the engine on CPU blocks ---------------------------------------------------

def _plan(engine, buffers, numels_per_tensor, blocks_per_tensor, postscale, channels=1):
    """One segment per tensor, each cut into equal blocks; release everything at once."""
    segs, offs, nums, byts, prios, covers = [], [], [], [], [], []
    for t, (n, k) in enumerate(zip(numels_per_tensor, blocks_per_tensor)):
        size = n // k
        for j in range(k):
            segs.append(t), offs.append(j * size), nums.append(size), byts.append(size * 4)
            prios.append(t), covers.append([t])
    T = len(numels_per_tensor)
    engine.set_plan(num_tensors=T, order=list(reversed(range(T))), segments=segs, offsets=offs, numels=nums,
                    bytes=byts, priorities=prios, block_tensors=covers, phase1_windows=[-1] * T,
                    phase2_windows=[2], credit_bytes=0, channels=channels, buffers=buffers, postscale=postscale)


def test_event_api_is_a_no_op_on_cpu_blocks():
    dc.init()
    C = _ext.load()
    engine = C.Engine.torch(channels.channel_groups(1), 30.0)
    try:
        bufs = [torch.full((8,), 2.0), torch.full((12,), 4.0)]
        _plan(engine, bufs, [8, 12], [2, 3], postscale=0.5)
        for record in (True, False):
            engine.start_iteration()
            engine.mark_ready(1, record_event=record)
            engine.flush(record_event=record)
            engine.wait_all(30.0)
        # Two iterations, each halving (world of one: the sum is the value itself).
        assert torch.equal(bufs[0], torch.full((8,), 0.5)) and torch.equal(bufs[1], torch.full((12,), 1.0))
        engine.start_iteration()
        engine.mark_ready(0)  # the default records an event: still nothing on the CPU
        engine.mark_ready(1)
        engine.flush()
        engine.wait_all(30.0)
        assert engine.error() is None
    finally:
        engine.shutdown()


@pytest.mark.parametrize("record", [True, False])
def test_engines_without_tensors_accept_the_event_flag(record):
    C = _ext.load()
    engine = C.Engine.noop(30.0)
    try:
        engine.set_plan(num_tensors=1, order=[0], segments=[0], offsets=[0], numels=[4], bytes=[16], priorities=[0],
                        block_tensors=[[0]], phase1_windows=[-1], phase2_windows=[1], credit_bytes=0, channels=1,
                        buffers=[], postscale=1.0)
        engine.start_iteration()
        assert not engine.tensor_done(0)
        engine.mark_ready(0, record_event=record)
        engine.flush(record_event=record)
        engine.wait_all(30.0)
        # The flag changed nothing: the one block was released, launched on channel 0 and completed, and the
        # engine is idle with no error.
        assert engine.tensor_done(0) and engine.idle() and engine.error() is None
        ((block, channel, _, _, _, release_ns, launch_ns, end_ns),) = engine.trace()
        assert (block, channel) == (0, 0) and 0 < release_ns <= launch_ns <= end_ns
    finally:
        engine.shutdown()


@pytest.mark.parametrize("make, message", [
    (lambda: [torch.zeros(8, device="meta")], r"on meta; blocks can live on the CPU or CUDA"),
    (lambda: [torch.zeros(8), torch.zeros(8, device="meta")], r"buffer 1 is on meta but buffer 0 is on cpu"),
])
def test_blocks_must_share_one_cpu_or_cuda_device(make, message):
    dc.init()
    C = _ext.load()
    engine = C.Engine.torch(channels.channel_groups(1), 30.0)
    try:
        buffers = make()
        with pytest.raises(ValueError, match=message):
            _plan(engine, buffers, [8] * len(buffers), [2] * len(buffers), postscale=1.0)
    finally:
        engine.shutdown()


# ---- a CPU build has no CUDA in it ------------------------------------------------

cpu_build = pytest.mark.skipif(torch.version.cuda is not None, reason="this torch has CUDA: the CUDA build is tested")


@cpu_build
def test_cpu_build_says_so():
    from dcredit_opt import _build_info

    assert _ext.load().WITH_CUDA is False and _build_info.WITH_CUDA is False


@cpu_build
def test_cpu_build_has_no_cuda_code():
    (so,) = glob.glob(os.path.join(os.path.dirname(_ext.__file__), "_C*.so"))
    with open(so, "rb") as f:
        data = f.read()
    for needle in (b"cudaLaunchHostFunc", b"cudaStreamWaitEvent", b"cudaStreamCreateWithFlags", b"libcudart",
                   b"c10_cuda", b"torch_cuda"):
        assert needle not in data, f"{so} mentions {needle.decode()}"


@pytest.mark.parametrize("cuda, made", [(True, "cpu:gloo,cuda:nccl"), (False, "gloo")], ids=["gpu", "cpu"])
def test_a_world_of_one_on_a_gpu_machine_reduces_cuda_tensors_over_nccl(monkeypatch, cuda, made):
    """With no launcher, the default group of a world of one carries CUDA tensors on NCCL, as a larger world's
    does: Gloo's CUDA all-reduce would make the host wait for the device at every lazy update (Note
    [Stream-ordered waits]). CPU tensors stay on Gloo."""
    from dcredit_opt.world import job
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(job.launchers, "slurm_environment", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    job._init_default_group(5.0)
    assert [(b, kw["rank"], kw["world_size"]) for b, kw in calls] == [(made, 0, 1)]
    assert devices.device_types(made) >= {"cpu"}
