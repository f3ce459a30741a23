"""Rank functions for test_adasum.py: ``op=Adasum`` in the optimizer and the collectives, on every rank, with a
single-process simulation of the same training (``tests/adasum_reference.py``) to compare with."""

from __future__ import annotations

import torch

import dcredit_opt as dc
from tests import adasum_reference as ref

from .workers import batch, error_of

STEPS = 3


def _join(horovod_first: bool) -> None:
    if horovod_first:
        import horovod.torch as hvd

        hvd.init()
    dc.init(timeout_s=60.0)


def _model() -> torch.nn.Module:
    torch.manual_seed(1234)  # the same start on every rank and in the simulation
    return torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Tanh(), torch.nn.Linear(12, 7))


def _loss(model, data):
    x, y = data
    return torch.nn.functional.mse_loss(model(x), y)


OPTIMIZERS = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
}


def _train(kind: str, ranks: list, op, process_set=None, compression=None) -> dict:
    model = _model()
    opt = dc.DistributedOptimizer(OPTIMIZERS[kind](model), named_parameters=model.named_parameters(), op=op,
                                  process_set=process_set, compression=compression)
    assert isinstance(opt, type(OPTIMIZERS[kind](_model()))), type(opt).__mro__
    me = dc.rank()
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, batch(step, me)).backward()
        opt.synchronize()  # nothing to wait for; the step is still combined
        with opt.skip_synchronize():
            opt.step()
    state = opt.state_dict()["state"]
    wire = None if compression is None else torch.float16
    return {"got": {n: p.detach().clone() for n, p in model.named_parameters()},
            "want": ref.simulate(_model, OPTIMIZERS[kind], batch, _loss, STEPS, ranks, wire=wire),
            "state_steps": len(state)}


def _x(rank: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(5, 3, generator=g).to(dtype)


def _collectives(ranks: list, process_set=None) -> dict:
    me = dc.rank()
    want = ref.combine([_x(k) for k in ranks]).float()
    want64 = ref.combine([_x(k, torch.float64) * (k + 1) for k in ranks])
    out = {"want": want, "want64": want64}
    kw = {"process_set": process_set}
    out["allreduce"] = dc.allreduce(_x(me), op=dc.Adasum, name="ada", **kw)
    out["hvd_code"] = dc.allreduce(_x(me), op=2, **kw)
    out["scaled"] = dc.allreduce(_x(me), op=dc.Adasum, prescale_factor=2.0, postscale_factor=0.5, **kw)
    grouped = dc.grouped_allreduce([_x(me), _x(me, torch.float64) * (me + 1)], op=dc.Adasum, name="g", **kw)
    out["grouped"], out["grouped64"] = grouped
    t = _x(me)
    dc.synchronize(dc.allreduce_async_(t, op=dc.Adasum, name="async", **kw))
    out["async_inplace"] = t
    out["bf16"] = dc.allreduce(_x(me, torch.bfloat16), op=dc.Adasum, **kw)
    out["bf16_want"] = ref.combine([_x(k, torch.bfloat16) for k in ranks]).to(torch.bfloat16)
    return out


def run(horovod_first: bool = False, sets: bool = False, compare_horovod: bool = False) -> dict:
    """Train with op=Adasum (SGD with momentum, Adam, fp16 compression), the collectives, then the refusals;
    on 4 ranks with ``sets`` also on two process sets of 2."""
    _join(horovod_first)
    me, n = dc.rank(), dc.size()
    everyone = list(range(n))
    out = {"rank": me, "size": n, "kind": dc.world.runtime.kind()}
    out["sgd"] = _train("sgd", everyone, dc.Adasum)
    out["adam"] = _train("adam", everyone, 2)  # Horovod's constant for hvd.Adasum
    out["sgd_fp16"] = _train("sgd", everyone, dc.Adasum, compression=dc.Compression.fp16)
    out["collectives"] = _collectives(everyone)
    if sets and n == 4:
        half = [0, 1] if me < 2 else [2, 3]
        ps = dc.ProcessSet(half)
        out["set_sgd"] = _train("sgd", half, dc.Adasum, process_set=ps)
        out["set_collectives"] = _collectives(half, process_set=ps)
        out["alone"] = _train("adam", [me], dc.Adasum, process_set=dc.ProcessSet([me]))
    if compare_horovod:
        out["horovod"] = _horovod_adasum()
    # Refusals last: every rank raises the same error, and nothing is left half done. Under Horovod a rank whose
    # allreduce is Horovod's own never meets the other's all-gather: Horovod's negotiation stalls, and each rank
    # ends in a CollectiveTimeout after timeout_s, as for any two operations Horovod cannot pair; not run here.
    if out["kind"] != "horovod":
        out["mixed_collective"] = error_of(lambda: dc.allreduce(_x(me), op=dc.Adasum if me == 0 else dc.Sum,
                                                                name="mixed"))
    model = _model()
    out["mixed_optimizer"] = error_of(lambda: dc.DistributedOptimizer(
        OPTIMIZERS["sgd"](model), named_parameters=model.named_parameters(), op=dc.Adasum if me == 0 else dc.Average))
    out["after_refusals"] = dc.allreduce(torch.tensor([1.0 + me]), op=dc.Sum, name="after")
    return out


def _horovod_adasum() -> dict:
    """Horovod's own DistributedOptimizer(op=hvd.Adasum), SGD and Adam, where Horovod can run it (MPI)."""
    import horovod.torch as hvd

    if not hvd.mpi_enabled():
        return {"skipped": "Horovod's Adasum needs MPI"}
    out = {}
    for kind in ("sgd", "adam"):
        model = _model()
        opt = hvd.DistributedOptimizer(OPTIMIZERS[kind](model), named_parameters=model.named_parameters(),
                                       op=hvd.Adasum)
        for step in range(STEPS):
            opt.zero_grad()
            _loss(model, batch(step, hvd.rank())).backward()
            opt.step()
        out[kind] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out
