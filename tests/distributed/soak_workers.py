"""What each rank runs in test_soak.py (issue R1, item 3): a long training with random per-rank delays and a
random plan, measuring this process's resident memory, threads and file descriptors as it goes.

The case is drawn from a seed, the same on every rank (as ``random_workers.py`` draws its cases): the
optimizer, the policy (a fixed plan with random blocks, window and channels, or a profiled policy, which
profiles, stages its plan and switches to it), whether the model reads tokens through an embedding (the rows'
exchange). Every iteration each rank sleeps a random 0-4 ms (seeded by rank and step) at a random place:
inside the forward, between backward and ``step()``, or after ``step()``.
"""

from __future__ import annotations

import logging
import os
import random
import time
import warnings

import torch
from torch import nn

import dcredit_opt as dc

POLICIES = ("fixed", "fixed", "dcredit", "bytescheduler", "mgwfbp")
CHECKPOINTS = (100, 500, 1000, 1500, 2000)


def resources() -> dict:
    """Resident memory (kB, from /proc/self/status), threads and open file descriptors of this process."""
    rss_kb = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
    return {"rss_kb": rss_kb, "threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd"))}


def draw(seed: int) -> dict:
    rng = random.Random(seed)
    policy = rng.choice(POLICIES)
    return {"seed": seed, "policy": policy, "opt": rng.choice(("sgd", "adam")), "embed": rng.random() < 0.7,
            "block_bytes": rng.choice((64, 256, 1024, 1 << 16)), "window": rng.choice((1, 2, -1)),
            "channels": rng.choice((1, 2)), "hidden": rng.choice((24, 48))}


class SoakNet(nn.Module):
    def __init__(self, case: dict, nap):
        super().__init__()
        h = case["hidden"]
        self.embed = nn.Embedding(96, 16) if case["embed"] else None
        self.inp = nn.Linear(16, h)
        self.mid = nn.Linear(h, h)
        self.out = nn.Linear(h, 5)
        self.nap = nap

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x).mean(1)
        h = torch.relu(self.inp(x))
        self.nap("forward")
        return self.out(torch.relu(self.mid(h)))


def soak(seed: int, iterations: int, collective_timeout_s: float) -> dict:
    """Train ``iterations`` steps; return the case, the resources at each checkpoint, the warnings seen before the
    first checkpoint (warm-up) and after it."""
    case = draw(seed)
    dc.init(timeout_s=collective_timeout_s)
    rank = dc.rank()
    caught: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            caught.append(f"log {record.levelname} at iteration {state['it']}: {record.getMessage()[:300]}")

    state = {"it": 0, "where": None, "delay": 0.0}
    handler = Keep(level=logging.WARNING)
    logging.getLogger("dcredit_opt").addHandler(handler)

    def nap(place: str) -> None:
        if state["where"] == place:
            time.sleep(state["delay"])

    torch.manual_seed(seed)
    model = SoakNet(case, nap)
    params = list(model.parameters())
    base = (torch.optim.SGD(params, lr=0.01, momentum=0.9) if case["opt"] == "sgd"
            else torch.optim.Adam(params, lr=1e-3))
    config = dc.Config(policy=case["policy"], profile_iters=5, block_bytes=case["block_bytes"],
                       window=case["window"], channels=case["channels"], timeout_s=collective_timeout_s)
    delays = random.Random(f"{seed}/{rank}")
    seen = {}
    with warnings.catch_warnings(record=True) as python_warnings:
        warnings.simplefilter("always")
        opt = dc.DistributedOptimizer(base, named_parameters=model.named_parameters(), config=config)
        g = torch.Generator().manual_seed(1000 * seed + rank)
        for it in range(1, iterations + 1):
            state["it"] = it
            state["where"] = delays.choice(("forward", "before step", "after step"))
            state["delay"] = delays.uniform(0.0, 0.004)
            x = (torch.randint(0, 96, (8, 6), generator=g) if case["embed"] else torch.randn(8, 16, generator=g))
            y = torch.randn(8, 5, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            nap("before step")
            opt.step()
            nap("after step")
            if it in CHECKPOINTS:
                seen[it] = resources()
            if it == CHECKPOINTS[0]:
                warm_python, warm_log = len(python_warnings), len(caught)
        opt.synchronize()
        with torch.no_grad():
            loss = float(nn.functional.mse_loss(model(x), y))
    logging.getLogger("dcredit_opt").removeHandler(handler)
    python = [f"warning: {w.category.__name__}: {str(w.message)[:300]}" for w in python_warnings]
    dc.shutdown()
    return {"case": case, "resources": seen, "loss": loss, "warnings_warm": caught[:warm_log] + python[:warm_python],
            "warnings_late": caught[warm_log:] + python[warm_python:]}
