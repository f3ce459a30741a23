"""Rank functions for test_collectives.py: each Horovod collective on 2 ranks, with inputs that differ by rank so
that every result can be computed by hand in the test."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

import dcredit_opt as dc

from .workers import error_of


def _join(horovod_first: bool, timeout_s: float = 30.0) -> None:
    if horovod_first:
        import horovod.torch as hvd

        hvd.init()
    dc.init(timeout_s=timeout_s)


def results(horovod_first: bool = False, marker: str = "") -> dict:
    """Every collective once (rank r of 2); returns what each gave, for the test to compare with hand values."""
    _join(horovod_first)
    r = dc.rank()
    out = {"kind": dc.world.runtime.kind(), "rank": r, "size": dc.size()}
    x = torch.tensor([1.0 + r, 10.0 * (r + 1)])  # rank 0: [1, 10], rank 1: [2, 20]
    out["average"] = dc.allreduce(x, name="average")
    out["sum"] = dc.allreduce(x, op=dc.Sum, process_set=dc.global_process_set)
    out["hvd_sum"] = dc.allreduce(x, op=1)  # Horovod's own constant
    out["legacy_sum"] = dc.allreduce(x, average=False)
    out["min"] = dc.allreduce(x, op=dc.Min)
    out["max"] = dc.allreduce(x, op=dc.Max)
    out["product"] = dc.allreduce(x, op=dc.Product)
    out["scaled"] = dc.allreduce(x, op=dc.Sum, prescale_factor=2.0, postscale_factor=0.25)
    out["int_average"] = dc.allreduce(torch.tensor([3 + r, -3 - r, 7 * r]))
    out["int16"] = dc.allreduce(torch.tensor([1000 * (r + 1)], dtype=torch.int16), op=dc.Sum)
    out["float16"] = dc.allreduce(torch.tensor([0.5 + r], dtype=torch.float16), op=dc.Sum)
    out["bfloat16"] = dc.allreduce(torch.tensor([1.5 + r], dtype=torch.bfloat16))
    out["fp16_wire"] = dc.allreduce(torch.tensor([1.0 / 3.0 + r]), op=dc.Sum, compression=dc.Compression.fp16)
    out["unchanged_input"] = x.clone()
    y = x.clone()
    out["inplace_is_arg"] = dc.allreduce_(y, op=dc.Sum, name="inplace") is y
    out["inplace"] = y
    view = torch.tensor([[1.0 + r, 2.0], [3.0, 4.0 * r]]).t()  # not contiguous
    dc.allreduce_(view, op=dc.Sum)
    out["inplace_view"] = view.contiguous()

    z = x.clone()
    h1 = dc.allreduce_async(x, op=dc.Sum, name="async.1")
    h2 = dc.allreduce_async_(z, name="async.2")
    h3 = dc.grouped_allreduce_async([x, torch.tensor([r])], op=dc.Max, name="async.3")
    deadline = time.monotonic() + 60
    while not (dc.poll(h1) and dc.poll(h2) and dc.poll(h3)) and time.monotonic() < deadline:
        time.sleep(0.001)
    out["polled"] = dc.poll(h1) and dc.poll(h2) and dc.poll(h3)
    out["async_h3"] = dc.synchronize(h3)  # out of order
    out["async_h2_is_arg"] = dc.synchronize(h2) is z
    out["async_h2"] = z
    out["async_h1"] = dc.synchronize(h1)

    out["grouped"] = dc.grouped_allreduce([x, torch.tensor([r + 1], dtype=torch.int64)], op=dc.Sum, name="grouped")
    g = [x.clone(), torch.tensor([2.0 * r])]
    dc.grouped_allreduce_(g, postscale_factor=2.0)
    out["grouped_"] = g
    g2 = [x.clone()]
    out["grouped_async_"] = dc.synchronize(dc.grouped_allreduce_async_(g2, op=dc.Min))[0] is g2[0]
    out["grouped_async_value"] = g2[0]

    # allgather: rank r contributes r + 1 rows of (r + 1)s; rank 0 also an empty first dimension.
    rows = torch.full((r + 1, 2), float(r + 1))
    out["allgather"] = dc.allgather(rows, name="rows")
    out["allgather_async"] = dc.synchronize(dc.allgather_async(rows.to(torch.int8)))
    out["allgather_empty"] = dc.allgather(torch.ones(0 if r == 0 else 2, 3, dtype=torch.bool))
    out["allgather_bf16"] = dc.allgather(torch.tensor([[0.5 + r]], dtype=torch.bfloat16))
    out["grouped_allgather"] = dc.grouped_allgather([rows, torch.tensor([r])], name="g")
    hg = dc.grouped_allgather_async([torch.tensor([[r, r]]), torch.ones(r, 1, dtype=torch.float64)], name="ga")
    out["grouped_allgather_async"] = dc.synchronize(hg)

    b = torch.tensor([7.0 + r, 8.0 + r])
    out["broadcast_from_1"] = dc.broadcast(b, 1)
    out["broadcast_input"] = b.clone()
    b_ = torch.tensor([[5 + r, 6 + r]], dtype=torch.int64)
    out["broadcast__is_arg"] = dc.broadcast_(b_, 0, name="b_") is b_
    out["broadcast_"] = b_
    flags = torch.tensor([r == 1, r == 0])
    out["broadcast_bool"] = dc.synchronize(dc.broadcast_async(flags, 1))
    bview = torch.tensor([[1.0 + r, 2.0 + r], [3.0 + r, 4.0 + r]]).t()
    dc.synchronize(dc.broadcast_async_(bview, 1))
    out["broadcast_view"] = bview.contiguous()
    out["broadcast_bf16"] = dc.broadcast(torch.tensor([1.5 + r], dtype=torch.bfloat16), 1)

    out["broadcast_object"] = dc.broadcast_object({"from": r, "w": torch.arange(2) + r, "t": (r, "x")}, root_rank=1)
    out["allgather_object"] = dc.allgather_object(("rank", r, [r] * r), name="objects")
    out["allgather_object_default"] = dc.allgather_object(r * 10)

    # barrier: rank 1 writes the marker after a pause and only then enters; rank 0 must see it after its barrier.
    if r == 1:
        time.sleep(1.0)
        Path(marker).write_text("here")
    dc.barrier()
    out["marker_seen_after_barrier"] = os.path.exists(marker)
    dc.barrier()

    out["layout"] = (dc.local_size(), dc.cross_rank(), dc.cross_size(), dc.is_homogeneous())
    out["mpi_enabled"] = dc.mpi_enabled()

    # Autograd: the gradient of an allreduce is the same reduction of the output's gradient.
    w = torch.tensor([1.0, 1.0]) if r == 0 else torch.tensor([2.0, 3.0])
    a = x.clone().requires_grad_()
    (dc.allreduce(a, op=dc.Sum, name="grad.sum") * w).sum().backward()
    out["grad_allreduce_sum"] = a.grad
    a = x.clone().requires_grad_()
    (dc.allreduce(a, name="grad.avg") * w).sum().backward()
    out["grad_allreduce_avg"] = a.grad
    rows_g = torch.ones(r + 1, 1, requires_grad=True)
    weights = torch.tensor([[1.0], [2.0], [3.0]]) * (1 if r == 0 else 10)
    (dc.allgather(rows_g, name="grad.gather") * weights).sum().backward()
    out["grad_allgather"] = rows_g.grad
    c = torch.ones(2, requires_grad=True)
    (dc.broadcast(c, 0, name="grad.bcast") * w).sum().backward()
    out["grad_broadcast"] = c.grad

    # The ranks disagree: every rank raises the same clear error, and the next collective still works.
    out["err_dtype"] = error_of(lambda: dc.allreduce(torch.ones(2, dtype=torch.float32 if r == 0 else torch.float64),
                                                   name="mismatch.dtype"))
    out["err_shape"] = error_of(lambda: dc.allreduce(torch.ones(2 + r), name="mismatch.shape"))
    out["err_gather_shape"] = error_of(lambda: dc.allgather(torch.ones(1, 2 + r), name="mismatch.gather"))
    out["err_root"] = error_of(lambda: dc.broadcast(torch.ones(2), r, name="mismatch.root"))
    if dc.world.runtime.kind() != "horovod":  # Horovod matches by name: different names would wait for each other
        out["err_name"] = error_of(lambda: dc.allreduce(torch.ones(1), name=f"mismatch.name.{r}"))
        out["err_op"] = error_of(lambda: dc.allreduce(torch.ones(1), op=dc.Sum if r == 0 else dc.Max))
    out["after_errors"] = dc.allreduce(torch.tensor([float(r)]), op=dc.Sum, name="after")
    dc.barrier()
    return out


def stalled_peer(stall_timeout_s: float, pause_s: float, marker: str, horovod_first: bool = False) -> dict:
    """Rank 1 never calls the allreduce that rank 0 waits in: rank 0 raises TimeoutError after stall_timeout_s
    (``init(timeout_s=)``; ``spawn`` keeps ``timeout_s`` for its own limit) and prints it. How the job ends
    after that is the launcher's business (MPI may abort it at exit), so the test reads the printed line.
    Rank 1 stays alive, not calling, until rank 0 has raised (it creates the file ``marker``), at most
    ``pause_s``: rank 0 must time out, not see a closed connection."""
    _join(horovod_first, stall_timeout_s)
    r = dc.rank()
    dc.barrier()
    if r == 0:
        start = time.monotonic()
        error = error_of(lambda: dc.allreduce(torch.ones(1), name="never.answered"))
        print(f"COLLECTIVE-TIMEOUT waited {time.monotonic() - start:.3f} s: {error}", flush=True)
        open(marker, "w").close()
    else:
        deadline = time.monotonic() + pause_s
        while time.monotonic() < deadline and not os.path.exists(marker):
            time.sleep(0.05)
    return {"rank": r}


class _Unsendable:
    """An object ``objects.encode`` refuses (it would need pickle)."""


def unsendable_objects(horovod_first: bool = False, timeout_s: float = 60.0) -> dict:
    """Objects that one rank cannot encode: every rank must raise at once (not wait out ``timeout_s``), and the
    ranks stay in step for the next collective. Returns each error, for the test to read."""
    _join(horovod_first, timeout_s)
    r = dc.rank()
    out = {"rank": r}
    # The root's object is a lambda; rank 1's is fine, but only the root's is sent.
    obj = (lambda: r) if r == 0 else {"from": 1}
    out["bcast_bad_root"] = error_of(lambda: dc.broadcast_object(obj, root_rank=0, name="bad.bcast"))
    # A non-root's object is never encoded: rank 0's lambda does not matter when rank 1 is the root.
    out["bcast_from_1"] = dc.broadcast_object(obj, root_rank=1, name="good.bcast")
    # Rank 1's object holds an instance of a class of ours; rank 0's is fine.
    item = [1, _Unsendable()] if r == 1 else [0, "fine"]
    out["gather_bad_1"] = error_of(lambda: dc.allgather_object(item, name="bad.gather"))
    # Both ranks' objects fail: each raises its own error.
    out["gather_bad_both"] = error_of(lambda: dc.allgather_object({"f": print}))
    # The root's optimizer state holds an entry that cannot travel: every rank raises, none waits.
    w = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([w], lr=0.1)
    opt.state[w]["note"] = object() if r == 0 else 1
    out["state_bad_root"] = error_of(lambda: dc.broadcast_optimizer_state(opt, root_rank=0))
    out["gather_after"] = dc.allgather_object(("ok", r), name="after")
    out["bcast_after"] = dc.broadcast_object({"from": r}, root_rank=0)
    dc.barrier()
    return out


def horovod_script(horovod_first: bool = False) -> dict:
    """A Horovod training script written as Horovod's examples are, with ``dcredit_opt`` imported as ``hvd``
    and nothing else changed: returns what the test checks."""
    import dcredit_opt as hvd

    if horovod_first:
        import horovod.torch

        horovod.torch.init()
    hvd.init()
    torch.manual_seed(42 + hvd.rank())  # different on purpose: broadcast_parameters must even them out
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    lr_scaler = hvd.local_size() if hvd.nccl_built() and torch.cuda.is_available() else 1
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler * hvd.size(), momentum=0.5)
    resume_from_epoch = hvd.broadcast_object(0 if hvd.rank() == 0 else 7, root_rank=0, name="resume_from_epoch")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.none, op=hvd.Average)
    losses = []
    for epoch in range(resume_from_epoch, 2):
        g = torch.Generator().manual_seed(1000 * hvd.rank() + epoch)
        for _ in range(3):
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
        losses.append(hvd.allreduce(loss.detach(), name="avg_loss").item())  # metric_average
    optimizer.synchronize()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).reshape(1, -1)
    everyone = hvd.allgather(flat, name="params")
    hvd.barrier()
    return {"resume_from_epoch": resume_from_epoch, "losses": losses, "rank": hvd.rank(), "size": hvd.size(),
            "ranks_agree": all(torch.equal(row, everyone[0]) for row in everyone), "rows": everyone.shape[0],
            "has_join": hasattr(hvd, "join")}
