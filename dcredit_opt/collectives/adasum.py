"""``allreduce(..., op=Adasum)`` and its async and grouped forms: an all-gather, then Note [Adasum].

Every rank sends its tensors (one flat byte buffer) to every other, and every
rank evaluates the same tree on the same bytes (``dcredit_opt/adasum.py``), so
the result is the same on every rank, under every launcher, to the bit. That
costs an all-gather (each rank receives every rank's tensors: the set's size
times the tensors' bytes), where Horovod's own Adasum (MPI only, powers of two
only) is bandwidth-optimal; in exchange it runs on Gloo, MPI and Horovod alike,
on any number of ranks and on process sets.

Under Horovod the gathered buffer starts with this rank's descriptor of the
operation (``core.describe``), since Horovod's allgather lets shapes differ:
ranks that disagree raise the same ``MismatchError``. Elsewhere the ranks agree
on the descriptor first, as for every other operation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import adasum
from ..errors import MismatchError
from ..world import runtime
from . import core
from .core import Handle, agree, describe, label

_DESCRIPTOR_BYTES = 8  # one int64 per descriptor field


def check_tensors(tensors: list, fn: str, many: bool) -> None:
    for i, t in enumerate(tensors):
        if t.dtype not in adasum.ADASUM_DTYPES:
            what = f"tensors[{i}]" if many else "tensor"
            raise TypeError(f"{fn}: {what} has dtype {t.dtype}; op=Adasum combines floating-point tensors only "
                            "(float16, bfloat16, float32, float64): cast it, or use op=Sum")


def check_not_differentiated(tensors: list, fn: str) -> None:
    """Adasum is not a linear map of the inputs: reducing the output's gradient with it again (what Horovod's
    allreduce does for any op) would not be the gradient. Refused rather than given wrong."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise ValueError(f"{fn}: op=Adasum is not differentiable (its gradient is not the Adasum of the output's "
                         "gradients): pass tensor.detach(), or call it under torch.no_grad()")


def launch(tensors: list, r, deliver) -> Handle:
    """Start combining ``tensors`` over the ranks of ``r.process_set`` (``allreduce._Reduce``: the function, name,
    scale factors, in place or not); ``synchronize`` gives ``deliver(tensors, results, r.inplace)``."""
    check_tensors(tensors, r.fn, r.fn.startswith("grouped"))
    kind = runtime.kind()
    plane = core.set_of(r.process_set, r.fn)
    what = label(r.fn, r.name, plane)
    operation = "grouped_allreduce" if r.fn.startswith("grouped") else "allreduce"
    descriptor = describe(operation, tensors, "adasum", name=r.name)
    sent = [_scaled(t.detach(), r.prescale) for t in tensors]

    def finish(rows) -> list:
        outs = []
        for t, per_rank in zip(tensors, adasum.unpack_rows(rows, sent)):
            combined = adasum.adasum_rows(per_rank).to(t.dtype).reshape(t.shape)
            outs.append(_scaled(combined, r.postscale).to(t.device))
        return deliver(tensors, outs, r.inplace)

    if plane.size == 1:
        return Handle(what, result=finish([adasum.pack(sent)]))
    if kind == "horovod":
        hvd = runtime.horovod()
        prefix = torch.tensor(descriptor, dtype=torch.int64).view(torch.uint8)
        buf = torch.cat((prefix, adasum.pack(sent, device="cpu")))
        hvd_handle = hvd.allgather_async(buf.reshape(1, -1), name=r.name, **core.horovod_kwargs(plane))

        def finish_hvd(rows: torch.Tensor) -> list:
            head = len(descriptor) * _DESCRIPTOR_BYTES
            table = [row.contiguous().view(torch.int64).tolist() for row in rows[:, :head]]
            problem = core.disagreement(table, what, r.name, runtime.rank(), plane.ranks)
            if problem:
                raise MismatchError(problem)
            return finish(rows[:, head:])

        return Handle(what, hvd=hvd, hvd_handle=hvd_handle, finish=finish_hvd)
    agree(descriptor, what, r.name, plane)
    buf = adasum.pack(sent, device=plane.control_device())
    parts = [torch.empty_like(buf) for _ in range(plane.size)]
    works = [dist.all_gather(parts, buf, group=plane.collective_group(), async_op=True)] if buf.numel() else []
    return Handle(what, works=works, finish=lambda _: finish(parts))


def _scaled(t: torch.Tensor, factor: float) -> torch.Tensor:
    return t if factor == 1.0 else t * factor

