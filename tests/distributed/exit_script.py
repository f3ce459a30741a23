"""A training script that ends normally, run as a script (never through ``spawn``'s ``os._exit``).

Under torchrun (``test_exit.py``, and the loop in its docstring): ``dc.init()``
(which makes the default group), ``--cycles`` times a fresh model and
optimizer trained a few steps, its weights compared across ranks, then
``dc.shutdown()`` and ``dc.init()`` again (issue 29, item 7); then a last
training, an ``all_gather`` of the weights on the default group at module
level (its tensors live until the interpreter's teardown, as in a user's
script), ``dc.shutdown()``, and the interpreter's own exit, which must be
clean: exit status 0 on every rank.

Each rank prints ``weights equal: <bool>`` per training and, after the last
``dc.shutdown()``, ``threads left: [...]``: the names of this process's
threads other than the main one (Note [Orderly exit] in world/job.py: none of
Gloo's or ours may outlive ``shutdown()``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import dcredit_opt as dc


def train(steps: int, timeout_s: float) -> torch.nn.Module:
    """A fresh model, wrapped, trained ``steps`` steps on rank-dependent data."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                  named_parameters=model.named_parameters(),
                                  config=dc.Config(timeout_s=timeout_s, block_bytes=64))
    data = torch.Generator().manual_seed(1 + dc.rank())
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(4, 8, generator=data)
        model(x).pow(2).mean().backward()
        opt.step()
    return model


def same_on_every_rank(model: torch.nn.Module) -> bool:
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, weights)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def say(line: str) -> None:
    """One line in one write: the ranks share torchrun's stdout, and a line written whole stays whole."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def other_threads() -> list:
    """This process's threads but the main one, by name (Linux)."""
    names = []
    for tid in sorted(os.listdir("/proc/self/task")):
        if int(tid) != os.getpid():
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
    return names


parser = argparse.ArgumentParser()
parser.add_argument("--cycles", type=int, default=0)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--timeout", type=float, default=30.0)
args = parser.parse_args()

dc.init(timeout_s=args.timeout)
rank = dc.rank()
equal = True
for _ in range(args.cycles):
    ok = same_on_every_rank(train(args.steps, args.timeout))
    say(f"rank {rank}: weights equal: {ok}")
    equal = equal and ok
    dc.shutdown()
    dc.init(timeout_s=args.timeout)
model = train(args.steps, args.timeout)
weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
gathered = [torch.empty_like(weights) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, weights)
ok = all(torch.equal(g, gathered[0]) for g in gathered)
say(f"rank {rank}: weights equal: {ok}")
dc.shutdown()
say(f"rank {rank}: threads left: {other_threads()}")
if not (equal and ok):
    sys.exit(3)
