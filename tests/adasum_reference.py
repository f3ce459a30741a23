"""An independent, straightforward Adasum (Horovod's ``op=hvd.Adasum``) for the tests to compare with.

Written from the definition, not from ``dcredit_opt/adasum.py``: recursive over the ranks, the left part the
largest power of two below their count, every vector in float64, norms and dot products with ``torch.dot``.
"""

from __future__ import annotations

import math

import torch


def pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    dot = float(torch.dot(a, b))
    anormsq, bnormsq = float(torch.dot(a, a)), float(torch.dot(b, b))
    tiny = math.sqrt(2.2250738585072014e-308)
    ca = 1.0 - dot / anormsq / 2 if anormsq >= tiny else 1.0
    cb = 1.0 - dot / bnormsq / 2 if bnormsq >= tiny else 1.0
    return ca * a + cb * b


def combine(vectors: list) -> torch.Tensor:
    """The Adasum of same-shaped tensors, one per rank in rank order, as float64 of their shape."""
    flat = [v.detach().double().reshape(-1) for v in vectors]
    n = len(flat)
    if n == 1:
        return flat[0].reshape(vectors[0].shape)
    left = 1 << (n - 1).bit_length() - 1  # the largest power of two below n
    return pair(combine(flat[:left]), combine(flat[left:])).reshape(vectors[0].shape)


def simulate(make_model, make_optimizer, batches, loss_fn, steps: int, ranks: list, wire=None) -> dict:
    """Adasum data parallelism in one process: one model copy and one optimizer per rank (its own state), each
    stepping on its rank's batch; each parameter's delta combined over the ranks; every copy set to the start
    plus the combined delta. ``batches(step, rank)``; returns the final parameters by name."""
    models = [make_model() for _ in ranks]
    opts = [make_optimizer(m) for m in models]
    for step in range(steps):
        starts = [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models]
        for m, o, r in zip(models, opts, ranks):
            o.zero_grad()
            loss_fn(m, batches(step, r)).backward()
            o.step()
        with torch.no_grad():
            for name, _ in models[0].named_parameters():
                deltas = [dict(m.named_parameters())[name] - s[name] for m, s in zip(models, starts)]
                if wire is not None:
                    deltas = [d.to(wire) for d in deltas]
                combined = combine(deltas)
                if wire is not None:
                    combined = combined.to(wire)
                for m, s in zip(models, starts):
                    p = dict(m.named_parameters())[name]
                    p.copy_(s[name] + combined.to(p.dtype))
    return {n: p.detach().clone() for n, p in models[0].named_parameters()}
