"""What each rank runs in test_deft.py: delayed updates (DeFT, Note [Delayed updates] in planner/deft.py)
against a reference that applies, for the delayed parameters, the previous step's averaged gradient."""

from __future__ import annotations

import dataclasses
import random
import time

import torch
from torch import nn

import dcredit_opt as dc
from dcredit_opt.optimizer.layout import fixed_plan

from .workers import OPTIMIZERS, Net, batch, loss_of, max_diff, reference_grads


def deft_plan(params: list, delayed: tuple) -> dc.Plan:
    """The fixed plan with ``delayed`` tensors taken out of the blocks and updated one step late."""
    base = fixed_plan([p.numel() for p in params], [p.element_size() for p in params], 256, 2, 2)
    partition = tuple(() if t in delayed else sizes for t, sizes in enumerate(base.partition))
    return dataclasses.replace(base, partition=partition, delayed=tuple(delayed), policy="deft")


def exact(opt_name: str = "adam", delayed: tuple = (0, 1), steps: int = 10, max_sleep_ms: float = 10.0) -> dict:
    """Train with a staged DeFT plan (the input layer delayed, by default) and, beside it, synchronous
    training by hand in which the delayed parameters take the previous step's averaged gradient (zero at the
    first step): the two must agree to float tolerance on every rank."""
    dc.init()
    world, rank = dc.size(), dc.rank()
    rng = random.Random(3 + 31 * rank)
    torch.manual_seed(0)
    model = Net()
    ref = Net()
    ref.load_state_dict(model.state_dict())
    config = dc.Config(policy="deft", accept_delayed_updates=True, profile_iters=0, block_bytes=256, window=2,
                       channels=2, backend="torch")
    opt = dc.DistributedOptimizer(OPTIMIZERS[opt_name](model.parameters()),
                                  named_parameters=model.named_parameters(), config=config)
    ropt = OPTIMIZERS[opt_name](ref.parameters())
    params = list(model.parameters())
    opt._dc.staged_plan = deft_plan(params, tuple(delayed))
    late = [list(ref.parameters())[t] for t in delayed]
    previous = [torch.zeros_like(p) for p in late]
    diffs, planned = [], []
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, batch(step, rank)).backward()
        time.sleep(rng.uniform(0, max_sleep_ms / 1000))
        planned.append(list(opt._dc.buffers.plan.delayed))
        opt.step()
        reference_grads(ref, step, world)
        for p, prev in zip(late, previous):
            now = p.grad.clone()
            p.grad.copy_(prev)
            prev.copy_(now)
        ropt.step()
        diffs.append(max_diff(model, ref))
    opt.synchronize()
    out = {"diffs": diffs, "planned": planned, "diff": max_diff(model, ref),
           "checksum": float(sum(p.double().sum() for p in model.state_dict().values()))}
    opt._dc.close()
    return out


class Classifier(nn.Module):
    """A small real task: four Gaussian clusters in 16 dimensions, a two-layer network."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.out = nn.Linear(64, 4)

    def forward(self, x):
        return self.out(torch.relu(self.inp(x)))


def _task_batch(step: int, rank: int, n: int = 32):
    g = torch.Generator().manual_seed(104729 * step + rank)
    centres = torch.Generator().manual_seed(1)
    means = torch.randn(4, 16, generator=centres) * 0.5  # clusters that overlap: the loss stays above 0.4
    y = torch.randint(0, 4, (n,), generator=g)
    return means[y] + torch.randn(n, 16, generator=g), y


def convergence(delayed_policy: bool, steps: int = 80) -> dict:
    """The loss curve (every rank's batch loss, averaged over ranks by hand) of synchronous training, or of
    DeFT with the input layer delayed: what the README's DeFT section shows."""
    dc.init()
    world, rank = dc.size(), dc.rank()
    torch.manual_seed(0)
    model = Classifier()
    config = (dc.Config(policy="deft", accept_delayed_updates=True, profile_iters=0, backend="torch")
              if delayed_policy else dc.Config(policy="fixed", backend="torch"))
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                  named_parameters=model.named_parameters(), config=config)
    if delayed_policy:
        opt._dc.staged_plan = deft_plan(list(model.parameters()), (0, 1))
    curve = []
    for step in range(steps):
        opt.zero_grad()
        x, y = _task_batch(step, rank)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        with torch.no_grad():  # the loss of every rank's batch, from this rank's (identical) model
            total = sum(float(nn.functional.cross_entropy(model(bx), by)) for bx, by in
                        (_task_batch(step, r) for r in range(world)))
        curve.append(total / world)
    opt.synchronize()
    out = {"curve": curve, "delayed": list(opt.plan.delayed),
           "checksum": float(sum(p.double().sum() for p in model.state_dict().values()))}
    opt._dc.close()
    return out


def refused(backend: str, horovod_first: bool = False) -> str:
    """The DCreditError of ``Config(policy='deft')`` on a backend without the background sum ("" if none)."""
    if horovod_first:
        import horovod.torch as hvd

        hvd.init()
    dc.init()
    model = Net()
    try:
        dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                config=dc.Config(policy="deft", accept_delayed_updates=True, backend=backend))
    except dc.DCreditError as e:
        return str(e)
    return ""


def profiled(steps: int = 8) -> dict:
    """``Config(policy="deft")`` as a user sets it: the job profiles itself for 3 steps, rank 0 plans, every
    rank switches; what it delays depends on what was measured."""
    dc.init()
    rank = dc.rank()
    torch.manual_seed(0)
    model = Net()
    config = dc.Config(policy="deft", accept_delayed_updates=True, profile_iters=3, backend="torch")
    opt = dc.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                  named_parameters=model.named_parameters(), config=config)
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, batch(step, rank)).backward()
        opt.step()
    opt.synchronize()
    out = {"policy": opt.plan.policy, "delayed": list(opt.plan.delayed),
           "checksum": float(sum(p.double().sum() for p in model.state_dict().values()))}
    opt._dc.close()
    return out
