"""What each rank runs in test_timeline.py: a short lazy-step training with a timeline, then shutdown."""

from __future__ import annotations

import json
import os

import torch
from torch import nn

import dcredit_opt as dc


def train_with_timeline(directory: str, steps: int) -> dict:
    """Train ``steps`` iterations writing ``directory/trace.json.rank<r>.json``; check it loads after each step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    config = dc.Config(block_bytes=256, channels=2, window=2, policy="fixed",
                       timeline_path=os.path.join(directory, "trace.json"))
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(), config=config)
    path = opt._dc.timeline.path
    loads_after_step = []
    generator = torch.Generator().manual_seed(1 + dc.rank())
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=generator)).pow(2).mean().backward()
        opt.step()
        with open(path) as f:
            loads_after_step.append(len(json.load(f)["traceEvents"]))
    lazy = opt._dc.lazy.deferred
    dc.shutdown()
    return {"path": path, "loads_after_step": loads_after_step, "lazy": lazy}
