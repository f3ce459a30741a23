"""F5.3 across ranks: the bad-input items that need more than a world of one.

Mixed dtypes, tied weights, zero-size, scalar and non-contiguous parameters
train like synchronous data parallelism on 2 Gloo ranks; a NaN or Inf
gradient on one rank only reaches every rank (as in synchronous DDP), and
with ``Config(check_finite=True)`` every rank refuses that step without
changing anything. The world-of-one catalogue is ``tests/unit/test_bad_inputs.py``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import dcredit_opt as dc

from . import spawn

# Largest |dcredit_opt - reference| allowed per dtype after 6 steps of SGD
# with momentum. The reference sums the ranks' gradients in the same dtype;
# with 2 ranks the sum is the same IEEE operation, so the results are in
# fact bit-identical; the bounds leave room for a different summation order
# (a few ulps of each dtype at these magnitudes).
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


class Zoo(nn.Module):
    """fp32, fp16 and bf16 layers; a tied weight; zero-size, scalar and non-contiguous parameters."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.empty = nn.Parameter(torch.zeros(0, 4))
        self.fp16 = nn.Linear(8, 8).to(torch.float16)
        self.wt = nn.Parameter(torch.randn(8, 8).t().contiguous().t())  # column-major
        self.bf16 = nn.Linear(8, 8).to(torch.bfloat16)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.out = nn.Linear(8, 11, bias=False)
        self.out.weight = self.emb.weight  # tied with the embedding

    def forward(self, idx):
        h = self.emb(idx)
        h = torch.relu(self.fp16(h.half())).float() @ self.wt
        h = torch.tanh(self.bf16(h.bfloat16())).float() * self.scale + self.empty.sum()
        return self.out(h)


def _batch(step, rank):
    return torch.randint(0, 11, (6,), generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(model, step, rank):
    idx = _batch(step, rank)
    return nn.functional.cross_entropy(model(idx).float(), idx)


def _reference_step(ref, ref_opt, step, world, bad=None):
    ref_opt.zero_grad()
    for r in range(world):
        loss = _loss(ref, step, r)
        if bad is not None and r == 1:
            loss = loss + (ref.fp16.bias * bad).sum()
        loss.backward()
    for p in ref.parameters():
        p.grad /= world
    ref_opt.step()


def _diffs(model, ref):
    """Per parameter: dtype, largest difference where both are finite, same non-finite entries."""
    out = {}
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        a, b = a.detach(), b.detach()
        fin = a.isfinite() & b.isfinite()
        inf_a, inf_b = a.isinf(), b.isinf()
        same = (torch.equal(a.isfinite(), b.isfinite()) and torch.equal(a.isnan(), b.isnan())
                and torch.equal(a[inf_a], b[inf_b]))
        d = (a[fin].double() - b[fin].double()).abs()
        out[name] = (str(a.dtype), float(d.max()) if d.numel() else 0.0, bool(same))
    return out


def zoo_worker(steps: int = 6) -> dict:
    dc.init()
    world, rank = dc.size(), dc.rank()
    result = {}
    config = dc.Config(block_bytes=32, window=2, channels=2, policy="fixed")

    # 1. Mixed dtypes, tied weights, zero-size, scalar, non-contiguous: equal to the reference.
    model = Zoo()
    ref = copy.deepcopy(model)
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters(), config=config)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        _loss(model, step, rank).backward()
        opt.step()
        _reference_step(ref, ref_opt, step, world)
    opt.synchronize()
    result["zoo"] = _diffs(model, ref)
    result["zoo_tied"] = model.out.weight is model.emb.weight
    opt._dc.close()

    # 2. A NaN / Inf gradient on rank 1 only reaches every rank, as in synchronous DDP.
    for bad in (math.nan, math.inf):
        model = Zoo()
        ref = copy.deepcopy(model)
        opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(), config=config)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        opt.zero_grad()
        loss = _loss(model, 0, rank)
        if rank == 1:
            loss = loss + (model.fp16.bias * bad).sum()
        loss.backward()
        opt.step()
        opt.synchronize()
        _reference_step(ref, ref_opt, 0, world, bad=bad)
        result[f"one_rank_{bad}"] = _diffs(model, ref)
        result[f"one_rank_{bad}_finite"] = bool(torch.isfinite(model.fp16.bias).all())
        opt._dc.close()

    # 3. check_finite: every rank refuses the same step and changes nothing.
    model = Zoo()
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters(),
                                  config=dc.Config(block_bytes=32, window=2, channels=2, policy="fixed",
                                                   check_finite=True))
    opt.zero_grad()
    _loss(model, 0, rank).backward()
    opt.step()
    opt.zero_grad()
    loss = _loss(model, 1, rank)
    if rank == 1:
        loss = loss + (model.fp16.bias * math.nan).sum()
    loss.backward()
    opt.synchronize()  # p.grad is now the reduced gradient; the refused step must leave it so
    params = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    try:
        with opt.skip_synchronize():
            opt.step()
        result["check_finite"] = "no error"
    except dc.DCreditError as e:
        result["check_finite"] = f"DCreditError: {e}"
    with torch.no_grad():
        model(_batch(9, rank))
    result["check_finite_unchanged"] = (
        all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
        and all(torch.equal(g.nan_to_num(), p.grad.nan_to_num()) for g, p in zip(grads, model.parameters()))
        and all(torch.equal(a, b) for k in state["state"] for a, b in
                zip(state["state"][k].values(), opt.state_dict()["state"][k].values())))
    opt.zero_grad()
    _loss(model, 2, rank).backward()  # the job goes on
    opt.step()
    opt.synchronize()
    result["check_finite_then_trains"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    result["checksum"] = float(sum(p.double().sum() for p in model.parameters()))
    return result


@pytest.mark.timeout(180)
def test_zoo_on_2_ranks():
    results = spawn.run(zoo_worker, 2, timeout_s=160)
    dtypes = {str(k): v for k, v in TOL.items()}
    for rank, r in enumerate(results):
        assert r["zoo_tied"]
        seen = set()
        for name, (dtype, diff, same_nan) in r["zoo"].items():
            assert diff <= dtypes[dtype], f"rank {rank}: {name} ({dtype}) differs from the reference by {diff}"
            assert same_nan
            seen.add(dtype)
        assert seen == set(dtypes), seen
        for bad in ("nan", "inf"):
            assert not r[f"one_rank_{bad}_finite"], f"rank {rank}: the {bad} from rank 1 did not arrive"
            for name, (dtype, diff, same_nan) in r[f"one_rank_{bad}"].items():
                assert same_nan and diff <= dtypes[dtype], f"rank {rank}, {bad} on rank 1: {name} {diff}"
        assert r["check_finite"].startswith("DCreditError: the reduced gradient of 'fp16.bias' holds NaN"), \
            r["check_finite"]
        assert r["check_finite_unchanged"], f"rank {rank}: the refused step changed something"
        assert r["check_finite_then_trains"]
    assert results[0]["checksum"] == results[1]["checksum"], "ranks disagree after the refused step"
