"""Horovod's allreduce family: ``allreduce(_)``, ``allreduce_async(_)``, ``grouped_allreduce(_)(_async)``.

See Note [Collectives beside the optimizer] (``collectives/__init__.py``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..reduce_ops import library_op
from ..world import runtime
from ..world.runtime import require_world
from . import adasum, core
from .core import Handle, agree, describe, label

# ---- allreduce ------------------------------------------------------------------------------

# The dtypes a backend cannot reduce travel as wider ones, and are cast back: torch.distributed's backends lack
# int16 (Gloo, NCCL); Horovod's allreduce has neither 8- nor 16-bit integers, nor bfloat16.
_DIST_WIRE = {torch.int16: torch.int32}
_HOROVOD_WIRE = {torch.uint8: torch.int32, torch.int8: torch.int32, torch.int16: torch.int32,
                 torch.bfloat16: torch.float32}


def _scaled(t: torch.Tensor, factor: float) -> torch.Tensor:
    """``t * factor`` in ``t``'s dtype; integers truncate toward zero, as Horovod's scaling does."""
    if factor == 1.0:
        return t
    if t.dtype.is_floating_point:
        return t * factor
    return (t.double() * factor).trunc().to(t.dtype)


@dataclasses.dataclass
class _Reduce:
    fn: str
    name: str | None
    op: str
    prescale: float
    postscale: float
    inplace: bool
    process_set: object = None  # as given: None, a global set, or a process set (core.set_of)


def _allreduce_launch(tensors: list, r: _Reduce) -> Handle:
    kind = require_world(r.fn)
    if r.op == "adasum":
        return adasum.launch(tensors, r, _deliver)
    plane = core.set_of(r.process_set, r.fn)
    what = label(r.fn, r.name, plane)
    if kind == "horovod":
        return _allreduce_horovod(tensors, r, what, plane)
    size = plane.size
    post = r.postscale / size if r.op == "average" else r.postscale
    if size > 1:
        agree(describe("allreduce" if r.fn.startswith("allreduce") else "grouped_allreduce", tensors, r.op,
                        name=r.name), what, r.name, plane)
    device = plane.control_device()
    wires = [_DIST_WIRE.get(t.dtype, t.dtype) for t in tensors]
    groups: dict[torch.dtype, list[int]] = {}
    for i, wire in enumerate(wires):
        groups.setdefault(wire, []).append(i)
    buffers, works = [], []
    for wire, members in groups.items():
        flat = torch.cat([tensors[i].detach().reshape(-1).to(device=device, dtype=wire) for i in members])
        flat = _scaled(flat, r.prescale)
        if size > 1:
            # an average is a sum, divided after
            op = library_op("sum" if r.op == "average" else r.op, "torch.distributed", dist.ReduceOp)
            works.append(dist.all_reduce(flat, op=op, group=plane.collective_group(), async_op=True))
        buffers.append((members, flat))

    def finish(_):
        outs = [None] * len(tensors)
        for members, flat in buffers:
            flat = _scaled(flat, post)
            for i, piece in zip(members, flat.split([tensors[i].numel() for i in members])):
                outs[i] = piece.reshape(tensors[i].shape).to(device=tensors[i].device, dtype=tensors[i].dtype)
        return _deliver(tensors, outs, r.inplace)

    handle = Handle(what, works=works, finish=finish)
    if size == 1:
        handle.wait()
    return handle


def _allreduce_horovod(tensors: list, r: _Reduce, what: str, plane) -> Handle:
    hvd = runtime.horovod()
    op = hvd.Average if r.op == "average" else library_op(r.op, "horovod", hvd)
    # Horovod's allreduce takes contiguous int32, int64, float16, float32 and float64 tensors only.
    sent = [t.detach().to(_HOROVOD_WIRE.get(t.dtype, t.dtype)).contiguous() for t in tensors]
    kw = {"name": r.name, "op": op, "prescale_factor": r.prescale, "postscale_factor": r.postscale,
          **core.horovod_kwargs(plane)}
    if r.fn.startswith("grouped"):
        hvd_handle = hvd.grouped_allreduce_async(sent, **kw)
    else:
        hvd_handle = hvd.allreduce_async(sent[0], **kw)

    def finish(out):
        outs = [out] if isinstance(out, torch.Tensor) else list(out)
        return _deliver(tensors, [o.to(t.dtype) for o, t in zip(outs, tensors)], r.inplace)

    return Handle(what, hvd=hvd, hvd_handle=hvd_handle, finish=finish)


def _deliver(tensors: list, outs: list, inplace: bool) -> list:
    """The results: ``outs``, or, for the in-place forms, ``tensors`` with ``outs`` copied into them."""
    if not inplace:
        return outs
    with torch.no_grad():
        for t, out in zip(tensors, outs):
            t.copy_(out)
    return list(tensors)


def _reduce_args(fn, tensors, average, name, op, prescale_factor, postscale_factor, process_set, inplace):
    require_world(fn)
    core.check_name(name, fn)
    core.set_of(process_set, fn)  # a set this rank can use, checked before the tensors
    many = fn.startswith("grouped")
    if many and (isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple))):
        raise TypeError(f"{fn}: tensors must be a list of tensors, got {type(tensors).__name__}")
    tensors = list(tensors) if many else [tensors]
    for i, t in enumerate(tensors):
        what = f"tensors[{i}]" if many else "tensor"
        core.check_tensor(t, fn, what)
        core.check_reducible(t, fn, what)
    return tensors, _Reduce(fn, name, core.reduction(op, average, fn),
                            core.check_factor(prescale_factor, "prescale_factor", fn),
                            core.check_factor(postscale_factor, "postscale_factor", fn), inplace, process_set)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=None) -> Handle:
    """Start reducing ``tensor`` over all ranks (of ``process_set``), Average unless ``op`` says otherwise;
    ``tensor`` is not changed. ``synchronize(handle)`` returns the result."""
    tensors, r = _reduce_args("allreduce_async", tensor, average, name, op, prescale_factor, postscale_factor,
                              process_set, False)
    return _single(_allreduce_launch(tensors, r))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=None) -> Handle:
    """Like ``allreduce_async``, writing the result into ``tensor``."""
    tensors, r = _reduce_args("allreduce_async_", tensor, average, name, op, prescale_factor, postscale_factor,
                              process_set, True)
    return _single(_allreduce_launch(tensors, r))


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=None) -> torch.Tensor:
    """``tensor`` reduced over all ranks (of ``process_set``), as a new tensor: Horovod's ``hvd.allreduce``.
    Differentiable: the gradient is the same reduction of the output's gradient."""
    tensors, r = _reduce_args("allreduce", tensor, average, name, op, prescale_factor, postscale_factor,
                              process_set, False)
    sent, ctx = _compress(compression, tensors[0], "allreduce")
    if r.op == "adasum":
        adasum.check_not_differentiated([sent], "allreduce")
    if sent.requires_grad and torch.is_grad_enabled():
        out = _AllreduceFn.apply(sent, r)
    else:
        out = _allreduce_launch([sent], r).wait()[0]
    return _decompress(compression, out, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=None) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks (of ``process_set``), in place; returns it."""
    tensors, r = _reduce_args("allreduce_", tensor, average, name, op, prescale_factor, postscale_factor,
                              process_set, True)
    return _allreduce_launch(tensors, r).wait()[0]


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=None) -> Handle:
    """Start reducing a list of tensors as one operation; ``synchronize`` returns the list of results."""
    tensors, r = _reduce_args("grouped_allreduce_async", tensors, average, name, op, prescale_factor,
                              postscale_factor, process_set, False)
    return _allreduce_launch(tensors, r)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=None) -> Handle:
    tensors, r = _reduce_args("grouped_allreduce_async_", tensors, average, name, op, prescale_factor,
                              postscale_factor, process_set, True)
    return _allreduce_launch(tensors, r)


def grouped_allreduce(tensors, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=None) -> list:
    """The tensors reduced over all ranks (of ``process_set``), as one operation; a list of new tensors."""
    tensors, r = _reduce_args("grouped_allreduce", tensors, average, name, op, prescale_factor, postscale_factor,
                              process_set, False)
    packed = [_compress(compression, t, "grouped_allreduce") for t in tensors]
    sent = [s for s, _ in packed]
    if r.op == "adasum":
        adasum.check_not_differentiated(sent, "grouped_allreduce")
    if torch.is_grad_enabled() and any(s.requires_grad for s in sent):
        outs = list(_GroupedAllreduceFn.apply(r, *sent))
    else:
        outs = _allreduce_launch(sent, r).wait()
    return [_decompress(compression, o, ctx) for o, (_, ctx) in zip(outs, packed)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=None) -> list:
    tensors, r = _reduce_args("grouped_allreduce_", tensors, average, name, op, prescale_factor, postscale_factor,
                              process_set, True)
    return _allreduce_launch(tensors, r).wait()


def _single(handle: Handle) -> Handle:
    """A one-tensor operation's handle: ``synchronize`` returns the tensor, not a list of one."""
    finish, handle._finish = handle._finish, None
    if finish is None:  # already done (a world of one)
        handle._result = handle._result[0]
        return handle
    handle._finish = lambda out: finish(out)[0]
    return handle


def _compress(compression, tensor: torch.Tensor, fn: str):
    if compression is None:
        return tensor, None
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError(f"{fn}: compression must be a Compression (hvd.Compression.none, .fp16), "
                        f"got {compression!r}")
    return compression.compress(tensor)


def _decompress(compression, tensor: torch.Tensor, ctx):
    return tensor if compression is None else compression.decompress(tensor, ctx)


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, r):
        ctx.r = r
        return _allreduce_launch([tensor], r).wait()[0]

    @staticmethod
    def backward(ctx, grad):
        r = dataclasses.replace(ctx.r, fn="allreduce", name=None if ctx.r.name is None else f"{ctx.r.name}.grad")
        return _allreduce_launch([grad.contiguous()], r).wait()[0], None


class _GroupedAllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r, *tensors):
        ctx.r = r
        return tuple(_allreduce_launch(list(tensors), r).wait())

    @staticmethod
    def backward(ctx, *grads):
        r = dataclasses.replace(ctx.r, fn="grouped_allreduce",
                                name=None if ctx.r.name is None else f"{ctx.r.name}.grad")
        return (None, *_allreduce_launch([g.contiguous() for g in grads], r).wait())


