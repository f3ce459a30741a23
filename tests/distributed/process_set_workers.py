"""What each rank runs in test_process_sets.py: optimizers over process sets (Note [Process sets]) against
synchronous training over each set's ranks alone.

The reference of ``workers.py``, over a set: every rank of the set regenerates every member's batch (seeded by
step and global rank) and averages their gradients itself. Several patterns run in one launch, each reported
under its name (an exception is reported as its type and message).
"""

from __future__ import annotations

import copy
import time
import traceback

import torch

import dcredit_opt as dc

from . import workers as w
from .workers import error_of

CONFIG = {"policy": "fixed", "block_bytes": 256, "window": 2, "channels": 2}


def _reference(ref, step: int, ranks: list, passes: int = 1) -> None:
    for p in ref.parameters():
        p.grad = None
    for r in ranks:
        w.loss_of(ref, w.batch(step, r)).backward()
    for p in ref.parameters():
        p.grad /= len(ranks)


def train_on(process_set, ranks: list, steps: int = 5, opt_name: str = "sgd", seed: int = 0, **config) -> dict:
    """Train a fresh model on ``process_set`` (whose members are ``ranks``) beside the reference over ``ranks``."""
    torch.manual_seed(seed)
    model = w.Net()
    ref = copy.deepcopy(model)
    cfg = dc.Config(**{**CONFIG, **config})
    opt = dc.DistributedOptimizer(w.OPTIMIZERS[opt_name](model.parameters()), named_parameters=model.named_parameters(),
                                  process_set=process_set, config=cfg)
    ropt = w.OPTIMIZERS[opt_name](ref.parameters())
    me = dc.rank()
    for step in range(steps):
        opt.zero_grad()
        w.loss_of(model, w.batch(step, me)).backward()
        opt.step()
        _reference(ref, step, ranks)
        ropt.step()
    opt.synchronize()
    out = {"diff": w.max_diff(model, ref), "checksum": w.checksum(model), "moved": _moved(ref, seed),
           "backend": opt._dc.backend.name}
    opt._dc.close()
    return out


def _moved(ref, seed: int) -> float:
    torch.manual_seed(seed)
    return w.max_diff(w.Net(), ref)


def _pattern(out: dict, name: str, fn) -> None:
    try:
        out[name] = fn()
    except Exception as e:  # noqa: BLE001 - reported to the test under the pattern's name
        out[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}


def four_ranks(timeout_s: float = 4.0) -> dict:
    """The patterns of a 4-rank job (torchrun or mpiexec); ``backend`` "auto" (MPI's own under mpiexec) and "torch"."""
    dc.init(timeout_s=30.0)
    me = dc.rank()
    out: dict = {}
    even, odd = [0, 2], [1, 3]
    mine = even if me in even else odd
    for backend in ("auto", "torch"):
        # Two disjoint sets, each its own optimizer: each trains as if alone.
        _pattern(out, f"disjoint/{backend}", lambda b=backend: train_on(dc.ProcessSet(mine), mine, backend=b))
    # The 2-D case: each rank's data-parallel set, and one optimizer over every rank, trained in turn.
    _pattern(out, "two_optimizers", lambda: _two_optimizers(mine))
    # A set of 2 of the 4: ranks 2 and 3 build nothing meanwhile (they are not involved), then wait at a barrier.
    if me in (0, 1):
        _pattern(out, "two_of_four", lambda: train_on(dc.ProcessSet([0, 1]), [0, 1], opt_name="adam", seed=3))
    dc.barrier()
    # A torch.distributed group as the set (under torchrun): new_group is collective over every rank.
    if dc.mpi_enabled():
        out["torch_group"] = {"skipped": "mpiexec"}
    else:
        import torch.distributed as dist

        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        _pattern(out, "torch_group", lambda: train_on(groups[0] if me in even else groups[1], mine, seed=5))
    # Horovod's collectives on each rank's set, ours given as a ProcessSet, a list of ranks and a torch group.
    _pattern(out, "collectives", lambda: collectives_on(dc.ProcessSet(mine), mine))
    _pattern(out, "collectives/list", lambda: collectives_on(mine, mine))
    if not dc.mpi_enabled():
        _pattern(out, "collectives/torch_group", lambda: collectives_on(groups[0] if me in even else groups[1], mine))
    # ---- what must be refused, never trained wrong ----
    # Rank 3 is given a set that does not hold it.
    if me == 3:
        _pattern(out, "outside", lambda: train_on(dc.ProcessSet([0, 1]), [0, 1]))
    # Ranks 0 and 1 disagree about their set: [0, 1] on rank 0, [0, 1, 2] on rank 1 (rank 2 builds nothing).
    if me in (0, 1):
        started = time.monotonic()
        theirs = [0, 1] if me == 0 else [0, 1, 2]
        _pattern(out, "differ", lambda: train_on(dc.ProcessSet(theirs), theirs, timeout_s=timeout_s))
        out["differ"]["took_s"] = time.monotonic() - started
    dc.barrier()
    # On [0, 1], rank 0's first collective meets rank 1's optimizer: both are told at once, naming both.
    if me in (0, 1):
        started = time.monotonic()
        if me == 0:
            _pattern(out, "call_or_build", lambda: dc.allreduce(torch.ones(1), process_set=dc.ProcessSet([0, 1])))
        else:
            _pattern(out, "call_or_build", lambda: train_on(dc.ProcessSet([0, 1]), [0, 1], timeout_s=timeout_s))
        out["call_or_build"]["took_s"] = time.monotonic() - started
    dc.barrier()
    # Rank 3 never builds on [2, 3]: rank 2 is told within the timeout, naming rank 3.
    if me == 2:
        started = time.monotonic()
        _pattern(out, "missing", lambda: train_on(dc.ProcessSet([2, 3]), [2, 3], timeout_s=timeout_s))
        out["missing"]["took_s"] = time.monotonic() - started
    dc.barrier()
    # After those errors, the sets still work.
    _pattern(out, "after_errors", lambda: train_on(dc.ProcessSet(mine), mine, opt_name="rmsprop", seed=7))
    return out


def collectives_on(process_set, ranks: list, other_set=None) -> dict:
    """Horovod's collectives on ``process_set`` (whose members are ``ranks``), for the test to compare with values
    computed by hand (``expected_collectives``); then the calls a rank must be refused, among them one on
    ``other_set`` (the other ranks by default), which does not hold this rank. Every call is named: Horovod
    matches an unnamed one by each rank's count of calls, which differs between ranks that built different
    optimizers before."""
    me = dc.rank()
    other = [r for r in range(dc.size()) if r not in ranks]
    x = torch.tensor([1.0 + me, 10.0 * (me + 1)])
    ps = process_set
    out = {
        "sum": dc.allreduce(x, op=dc.Sum, name="ps.sum", process_set=ps),
        "average": dc.allreduce(x, name="ps.average", process_set=ps),
        "grouped": dc.grouped_allreduce([x, torch.tensor([me])], op=dc.Sum, name="ps.grouped", process_set=ps),
        "max_async": dc.synchronize(dc.allreduce_async(x, op=dc.Max, name="ps.max", process_set=ps)),
        # rank r gives r // 2 + 1 rows of r: lengths differ within the set
        "allgather": dc.allgather(torch.full((me // 2 + 1, 2), float(me)), name="ps.allgather", process_set=ps),
        "broadcast": dc.broadcast(torch.tensor([float(me)]), ranks[1], name="ps.broadcast", process_set=ps),
        "broadcast_object": dc.broadcast_object({"from": me}, root_rank=ranks[1], name="ps.object", process_set=ps),
        "allgather_object": dc.allgather_object(me, name="ps.objects", process_set=ps),
    }
    dc.barrier(process_set=ps)
    w = torch.tensor([[1.0 + me]], requires_grad=True)
    (dc.allgather(w, name="ps.grad", process_set=ps).sum() * (me + 1)).backward()
    out["grad_allgather"] = w.grad
    out["root_outside"] = error_of(lambda: dc.broadcast(x, other[0], name="ps.bad", process_set=ps))
    out["outside"] = error_of(lambda: dc.allreduce(x, name="ps.bad", process_set=other if other_set is None
                                                 else other_set))
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else [t.tolist() for t in v] if k == "grouped" else v)
            for k, v in out.items()}


def expected_collectives(me: int, ranks: list) -> dict:
    """What ``collectives_on`` gives rank ``me`` of the set ``ranks``, by hand."""
    xs = [[1.0 + r, 10.0 * (r + 1)] for r in ranks]
    total = [sum(v[i] for v in xs) for i in range(2)]
    return {
        "sum": total, "average": [t / len(ranks) for t in total], "grouped": [total, [sum(ranks)]],
        "max_async": [max(v[i] for v in xs) for i in range(2)],
        "allgather": [[float(r)] * 2 for r in ranks for _ in range(r // 2 + 1)],
        "broadcast": [float(ranks[1])], "broadcast_object": {"from": ranks[1]}, "allgather_object": ranks,
        "grad_allgather": [[sum(r + 1 for r in ranks) / len(ranks)]],
    }


def _two_optimizers(mine: list, process_set=None) -> dict:
    """Each rank: model A on its data-parallel set (``process_set``, ours by default), model B on every rank;
    stepped alternately."""
    me, everyone = dc.rank(), list(range(dc.size()))
    models, refs, opts, ropts = [], [], [], []
    for seed, (ps, name) in enumerate(((process_set or dc.ProcessSet(mine), "sgd"), (None, "adam"))):
        torch.manual_seed(seed)
        models.append(w.Net())
        refs.append(copy.deepcopy(models[-1]))
        opts.append(dc.DistributedOptimizer(w.OPTIMIZERS[name](models[-1].parameters()),
                                            named_parameters=models[-1].named_parameters(), process_set=ps,
                                            config=dc.Config(**CONFIG)))
        ropts.append(w.OPTIMIZERS[name](refs[-1].parameters()))
    for step in range(5):
        for model, ref, opt, ropt, ranks in zip(models, refs, opts, ropts, (mine, everyone)):
            opt.zero_grad()
            w.loss_of(model, w.batch(step, me)).backward()
            opt.step()
            _reference(ref, step, ranks)
            ropt.step()
    diffs = []
    for model, ref, opt in zip(models, refs, opts):
        opt.synchronize()
        diffs.append(w.max_diff(model, ref))
        opt._dc.close()
    return {"diff": max(diffs), "checksum": w.checksum(models[0]), "checksum_all": w.checksum(models[1]),
            "moved": 1.0}


def head_on_a_set_of_its_own(steps: int = 6, whole: bool = True) -> dict:
    """Each rank's output layer on an optimizer over a process set of its own rank (its head, trained alone: the
    ranks' heads differ by design), the rest of the model on an optimizer over every rank that names the whole
    model (``whole``), or only its own parameters (the heads are then found in the model its forward runs). The
    heads are outside the first optimizer but reduced by ours: it leaves their comparison to theirs (Note
    [Parameters outside the optimizer] in checks.py), so nothing is refused; both parts equal training by hand
    (every rank's model simulated: the body's gradients averaged over them, each head on its own)."""
    dc.init()
    torch.manual_seed(0)
    model = w.Net()
    me, world = dc.rank(), dc.size()
    refs = [copy.deepcopy(model) for _ in range(world)]
    ropts = [torch.optim.SGD(r.parameters(), lr=0.05) for r in refs]
    cfg = dc.Config(**CONFIG, check_weights_every=2)
    body = [(n, p) for n, p in model.named_parameters() if not n.startswith("out.")]
    first = dc.DistributedOptimizer(torch.optim.SGD([p for _, p in body], lr=0.05),
                                    named_parameters=model.named_parameters() if whole else body, config=cfg)
    head = dc.DistributedOptimizer(torch.optim.SGD(model.out.parameters(), lr=0.05),
                                   named_parameters=model.out.named_parameters(prefix="out"),
                                   process_set=dc.ProcessSet([me]), config=cfg)
    out = {"raised": None}
    try:
        for step in range(steps):
            first.zero_grad()
            head.zero_grad()
            w.loss_of(model, w.batch(step, me)).backward()
            first.step()
            head.step()
            for r, ref in enumerate(refs):
                ref.zero_grad()
                w.loss_of(ref, w.batch(step, r)).backward()
            for name, _ in model.named_parameters():
                if not name.startswith("out."):
                    grads = [r.get_parameter(name).grad for r in refs]
                    for g in grads[1:]:
                        grads[0] += g
                    for r in refs:
                        r.get_parameter(name).grad = grads[0] / world
            for ropt in ropts:
                ropt.step()
        first.synchronize()
        head.synchronize()
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["raised"] = f"{type(e).__name__}: {e}"
    out["diff"] = w.max_diff(model, refs[me])
    out["head"] = [float(v) for v in model.out.bias.detach()]
    first._dc.close()
    head._dc.close()
    return out
