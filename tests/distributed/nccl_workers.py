"""What each rank runs in tests/distributed/test_nccl.py: CUDA tensors, NCCL or Gloo.

With ``backend="nccl"`` each rank takes the GPU of its local rank before
joining, so that dc.init() creates an NCCL default group (spawn.run sets
torchrun's variables) and every communicator opens on this rank's own device.
With ``backend="gloo"`` every rank shares GPU 0 and the script creates a Gloo
group itself before dc.init(), as a user's script may: NCCL refuses two ranks
on one device, Gloo reduces CUDA tensors through the host, and the stream
ordering (Note [CUDA streams]) is the same either way.
"""

from __future__ import annotations

import copy
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import dcredit_opt as dc
from dcredit_opt import _ext
from dcredit_opt.world import channels

from . import workers

# torch.cuda._sleep spins the GPU for this many clock cycles (about 0.1 s at
# 1-2 GHz): long enough that a collective launched without waiting for the
# gradient's stream certainly reads the buffer before it is written.
SLOW_PRODUCER_CYCLES = 200_000_000


def _join(backend: str) -> torch.device:
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    else:
        device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    if backend == "gloo":
        dist.init_process_group("gloo", init_method="env://")
    dc.init()
    return device


def _reference_step(ref, ropt, step, world, device) -> None:
    """Synchronous data parallelism by hand, on this GPU: average every rank's gradient, then step."""
    for p in ref.parameters():
        p.grad = None
    for r in range(world):
        x, y = (t.to(device) for t in workers.batch(step, r))
        nn.functional.mse_loss(ref(x), y).backward()
    for p in ref.parameters():
        p.grad /= world
    ropt.step()


def equivalence(configs: list, steps: int = 12, backend: str = "nccl") -> dict:
    """For each config: (max |param - reference|, checksum) after ``steps`` steps on ``backend``."""
    device = _join(backend)
    world, rank = dc.size(), dc.rank()
    out = {"backend": dist.get_backend()}
    for cfg in configs:
        config = dc.Config(block_bytes=cfg["block_bytes"], window=cfg["window"], channels=cfg["channels"],
                           overlap_forward=cfg["phase2"], policy=cfg.get("policy", "fixed"),
                           profile_iters=cfg.get("profile_iters", 0))
        torch.manual_seed(0)
        model = workers.Net().to(device)
        ref = copy.deepcopy(model)
        opt = dc.DistributedOptimizer(workers.OPTIMIZERS[cfg["opt"]](model.parameters()),
                                      named_parameters=model.named_parameters(), config=config)
        ropt = workers.OPTIMIZERS[cfg["opt"]](ref.parameters())
        for step in range(steps):
            opt.zero_grad()
            x, y = (t.to(device) for t in workers.batch(step, rank))
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            _reference_step(ref, ropt, step, world, device)
        opt.synchronize()
        torch.cuda.synchronize()
        out[repr(sorted(cfg.items()))] = (workers.max_diff(model, ref), workers.checksum(model))
        opt._dc.close()
    return out


def _one_tensor_plan(engine, buf, blocks: int, postscale: float, channels: int) -> None:
    size = buf.numel() // blocks
    engine.set_plan(num_tensors=1, order=[0], segments=[0] * blocks, offsets=[j * size for j in range(blocks)],
                    numels=[size] * blocks, bytes=[size * buf.element_size()] * blocks, priorities=[0] * blocks,
                    block_tensors=[[0]] * blocks, phase1_windows=[-1], phase2_windows=[channels],
                    credit_bytes=0, channels=channels, buffers=[buf], postscale=postscale)


def side_stream_engine(iterations: int = 3, backend: str = "nccl") -> dict:
    """A gradient written late on a side stream must be what the collective reduces.

    Rank r writes ``r + 1 + it`` after a slow kernel on a side stream and marks
    the tensor ready at once (the host runs ahead, as autograd's does). The
    reduced, postscaled block must be the average. The control run marks
    without an event and must see the race, which shows the test can.
    """
    device = _join(backend)
    world, rank = dc.size(), dc.rank()
    C = _ext.load()
    engine = C.Engine.torch(channels.channel_groups(2), 60.0)
    buf = torch.zeros(1 << 20, device=device)
    _one_tensor_plan(engine, buf, blocks=4, postscale=0.5, channels=2)
    side = torch.cuda.Stream(device)
    errors, control_raced = [], []
    try:
        for it in range(iterations):
            for record in (True, False):
                torch.cuda.synchronize(device)
                buf.zero_()
                torch.cuda.synchronize(device)
                engine.start_iteration()
                with torch.cuda.stream(side):
                    torch.cuda._sleep(SLOW_PRODUCER_CYCLES)
                    buf.fill_(float(rank + 1 + it))
                    engine.mark_ready(0, record_event=record)
                engine.flush(record_event=record)  # the control records nothing anywhere
                engine.wait_all(60.0)
                # wait_all returned: the device has finished the block (Note [CUDA streams]), so
                # the default stream may read it without waiting on anything.
                got = buf.clone()
                torch.cuda.synchronize(device)
                expected = 0.5 * sum(r + 1 + it for r in range(world))
                ok = bool(torch.all(got == expected))
                if record and not ok:
                    errors.append(f"iteration {it}: expected {expected}, got {got.unique().tolist()[:5]}")
                if not record:
                    control_raced.append(not ok)
    finally:
        engine.shutdown()
    return {"errors": errors, "control_raced": control_raced, "backend": dist.get_backend()}


def side_stream_training(steps: int = 8, backend: str = "nccl") -> dict:
    """Forward, backward and step all on a side stream, behind a slow kernel; equals the reference."""
    device = _join(backend)
    world, rank = dc.size(), dc.rank()
    torch.manual_seed(0)
    model = workers.Net().to(device)
    ref = copy.deepcopy(model)
    config = dc.Config(block_bytes=128, window=2, channels=2, policy="fixed")
    opt = dc.DistributedOptimizer(workers.OPTIMIZERS["adam"](model.parameters()),
                                  named_parameters=model.named_parameters(), config=config)
    ropt = workers.OPTIMIZERS["adam"](ref.parameters())
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    for step in range(steps):
        with torch.cuda.stream(side):
            opt.zero_grad()
            x, y = (t.to(device) for t in workers.batch(step, rank))
            loss = nn.functional.mse_loss(model(x), y)
            torch.cuda._sleep(SLOW_PRODUCER_CYCLES // 4)  # backward's kernels run late; its hooks do not
            loss.backward()
            opt.step()
        _reference_step(ref, ropt, step, world, device)
    with torch.cuda.stream(side):
        opt.synchronize()
    torch.cuda.synchronize(device)
    result = {"diff": workers.max_diff(model, ref), "checksum": workers.checksum(model)}
    opt._dc.close()
    return result


def dispatch_rate(blocks: int = 4096, block_numel: int = 256, tensors: int = 64, iterations: int = 20) -> dict:
    """Blocks per second through the scheduler and the CUDA/NCCL adapter (not a timed test).

    Tiny blocks, so that the per-block cost of the path (event waits, the
    launch, the completion host function) dominates, beside the same plan on
    the no-op engine (the scheduler alone).
    """
    device = _join("nccl")
    C = _ext.load()
    per = blocks // tensors
    buf = torch.ones(blocks * block_numel, device=device)
    size = block_numel
    plan = {"num_tensors": tensors, "order": list(reversed(range(tensors))), "segments": [0] * blocks,
            "offsets": [b * size for b in range(blocks)], "numels": [size] * blocks, "bytes": [size * 4] * blocks,
            "priorities": [b // per for b in range(blocks)], "block_tensors": [[b // per] for b in range(blocks)],
            "phase1_windows": [-1] * tensors, "phase2_windows": [8], "credit_bytes": 0, "channels": 2}
    out = {}
    for name, engine in (("noop", C.Engine.noop(60.0)), ("nccl", C.Engine.torch(channels.channel_groups(2), 60.0))):
        try:
            engine.set_plan(**plan, buffers=[buf] if name == "nccl" else [], postscale=1.0 / dc.size())
            times = []
            for it in range(iterations + 2):  # two warm-up iterations (communicators, allocator)
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                engine.start_iteration()
                for t in plan["order"]:
                    engine.mark_ready(t)
                engine.flush()
                engine.wait_all(60.0)
                if it >= 2:
                    times.append(time.perf_counter() - t0)
            times.sort()
            out[f"{name}_blocks_per_s"] = blocks / times[len(times) // 2]
        finally:
            engine.shutdown()
    torch.cuda.synchronize(device)
    out["values_ok"] = bool(torch.all(buf == 1.0))  # the average of ones, every iteration
    # The same blocks through c10d alone, one async all_reduce per block and then a wait on each:
    # the floor that the adapter's per-block cost stands on.
    views = [buf[b * size:(b + 1) * size] for b in range(blocks)]
    times = []
    for it in range(iterations + 2):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        works = [dist.all_reduce(v, async_op=True) for v in views]
        for w in works:
            w.wait()
        torch.cuda.synchronize(device)
        if it >= 2:
            times.append(time.perf_counter() - t0)
    times.sort()
    out["c10d_blocks_per_s"] = blocks / times[len(times) // 2]
    out["device"] = torch.cuda.get_device_name(device)
    out["world"] = dc.size()
    return out
