"""Horovod's allgather, broadcast, ``*_object`` and barrier.

See Note [Collectives beside the optimizer] (``collectives/__init__.py``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..errors import CollectiveError
from ..world import groups, runtime
from ..world.runtime import require_world
from . import core, objects
from .allreduce import allreduce
from .core import Handle, agree, describe, label

# ---- allgather, broadcast -------------------------------------------------------------------

# What Horovod's allgather takes; other dtypes (bool, bfloat16, complex) travel as rows of bytes.
_HOROVOD_GATHERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
                    torch.float64)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous, on the control device) as a flat uint8 tensor: gathers and broadcasts copy bytes,
    exact for every dtype, with none of the backends' dtype gaps."""
    return t.reshape(-1).view(torch.uint8)


def _allgather_launch(tensor: torch.Tensor, name: str | None, fn: str, process_set=None) -> Handle:
    kind = require_world(fn)
    core.check_name(name, fn)
    plane = core.set_of(process_set, fn)
    core.check_tensor(tensor, fn)
    if tensor.dim() == 0:
        raise ValueError(f"{fn}: tensor must have at least one dimension (the one concatenated), got a scalar; "
                         "use tensor.reshape(1)")
    what = label(fn, name, plane)
    if kind == "horovod":
        hvd = runtime.horovod()
        kw = core.horovod_kwargs(plane)
        sent = tensor.detach().contiguous()
        if sent.dtype not in _HOROVOD_GATHERS:
            # Rows of bytes, exact; Horovod's errors about mismatched shapes then count bytes.
            rest = tensor.shape[1:]
            sent = sent.reshape(tensor.shape[0], math.prod(rest)).view(torch.uint8)
            return Handle(what, hvd=hvd, hvd_handle=hvd.allgather_async(sent, name=name, **kw),
                          finish=lambda out: out.view(tensor.dtype).reshape(out.shape[0], *rest))
        return Handle(what, hvd=hvd, hvd_handle=hvd.allgather_async(sent, name=name, **kw), finish=lambda out: out)
    size = plane.size
    if size == 1:
        return Handle(what, result=tensor.detach().clone())
    table = agree(describe("allgather", [tensor], name=name, gather=True), what, name, plane)
    firsts = [row[-1] for row in table]
    row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
    device = plane.control_device()
    longest = max(firsts) * row_bytes
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[:tensor.shape[0] * row_bytes] = _bytes_of(tensor.detach().to(device).contiguous())
    parts = [torch.empty_like(mine) for _ in range(size)]
    works = [dist.all_gather(parts, mine, group=plane.collective_group(), async_op=True)] if longest else []

    def finish(_):
        data = torch.cat([p[:n * row_bytes] for p, n in zip(parts, firsts)])
        out = data.view(tensor.dtype).reshape(sum(firsts), *tensor.shape[1:])
        return out.to(tensor.device)

    return Handle(what, works=works, finish=finish)


def allgather_async(tensor, name=None, process_set=None) -> Handle:
    """Start concatenating every rank's (of ``process_set``) ``tensor`` along dimension 0 (lengths may differ)."""
    return _allgather_launch(tensor, name, "allgather_async", process_set)


def allgather(tensor, name=None, process_set=None) -> torch.Tensor:
    """Every rank's (of ``process_set``) ``tensor`` concatenated along dimension 0, in rank order; the first
    dimension may differ between ranks, the others may not. Differentiable (the gradient of this rank's slice,
    averaged over the ranks, as Horovod's)."""
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
        require_world("allgather")
        core.set_of(process_set, "allgather")
        return _AllgatherFn.apply(tensor, name, process_set)
    return _allgather_launch(tensor, name, "allgather", process_set).wait()


def _grouped_allgather_launch(tensors, name: str | None, fn: str, process_set) -> Handle:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{fn}: tensors must be a list of tensors, got {type(tensors).__name__}")
    names = [None if name is None else f"{name}.{i}" for i in range(len(tensors))]
    parts = [_allgather_launch(t, n, fn, process_set) for t, n in zip(tensors, names)]
    return Handle(label(fn, name), parts=parts, finish=lambda outs: outs)


def grouped_allgather_async(tensors, name=None, process_set=None) -> Handle:
    """Start an ``allgather`` of each tensor of the list; ``synchronize`` returns the list of results."""
    require_world("grouped_allgather_async")
    core.set_of(process_set, "grouped_allgather_async")
    return _grouped_allgather_launch(tensors, name, "grouped_allgather_async", process_set)


def grouped_allgather(tensors, name=None, process_set=None) -> list:
    """``allgather`` of each tensor of the list, as a list."""
    require_world("grouped_allgather")
    core.set_of(process_set, "grouped_allgather")
    return _grouped_allgather_launch(tensors, name, "grouped_allgather", process_set).wait()


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.first, ctx.name, ctx.process_set = tensor.shape[0], name, process_set
        return _allgather_launch(tensor, name, "allgather", process_set).wait()

    @staticmethod
    def backward(ctx, grad):
        # Named after the forward where it was (Horovod matches by name; unnamed, by each rank's count of calls).
        name = None if ctx.name is None else f"{ctx.name}.grad"
        reduced = allreduce(grad.contiguous(), op=0, name=name, process_set=ctx.process_set)
        firsts = allgather(torch.tensor([ctx.first], dtype=torch.int64), name=name and f"{name}.firsts",
                           process_set=ctx.process_set)
        start = int(firsts[:core.set_of(ctx.process_set, "allgather").rank].sum())
        return reduced.narrow(0, start, ctx.first), None, None


def _broadcast_launch(tensor: torch.Tensor, root_rank: int, name: str | None, fn: str, inplace: bool,
                      process_set=None) -> Handle:
    kind = require_world(fn)
    core.check_name(name, fn)
    plane = core.set_of(process_set, fn)
    core.check_tensor(tensor, fn)
    root_rank = core.check_root(root_rank, fn, plane)
    what = label(fn, name, plane)
    if kind == "horovod":
        hvd = runtime.horovod()
        # As bytes: exact, and independent of which dtypes Horovod's CPU operations have.
        sent = tensor.detach().contiguous().clone()

        def finish_hvd(_):
            if inplace:
                with torch.no_grad():
                    tensor.copy_(sent)
                return tensor
            return sent

        if not sent.numel():
            return Handle(what, result=finish_hvd(None))
        return Handle(what, hvd=hvd, hvd_handle=hvd.broadcast_async_(_bytes_of(sent), root_rank, name=name,
                                                                     **core.horovod_kwargs(plane)),
                      finish=finish_hvd)
    size = plane.size
    if size > 1:
        agree(describe("broadcast", [tensor], root_rank=root_rank, name=name), what, name, plane)
    device = plane.control_device()
    staged = tensor.detach().to(device).contiguous()
    if not inplace and staged.data_ptr() == tensor.data_ptr():
        staged = staged.clone()  # the input is not changed
    # The root's position among the plane's ranks (the same number as its global rank for every rank's plane).
    works = ([groups.broadcast(_bytes_of(staged), plane.ranks.index(root_rank), plane.collective_group(),
                               async_op=True)]
             if size > 1 and staged.numel() else [])

    def finish(_):
        if inplace:
            if staged.data_ptr() != tensor.data_ptr():
                with torch.no_grad():
                    tensor.copy_(staged)
            return tensor
        return staged.to(tensor.device)

    handle = Handle(what, works=works, finish=finish)
    if not works:
        handle.wait()
    return handle


def broadcast_async(tensor, root_rank, name=None, process_set=None) -> Handle:
    """Start sending ``root_rank``'s ``tensor`` to every rank (of ``process_set``; ``root_rank`` is a global
    rank, as in Horovod); ``synchronize`` returns a new tensor."""
    return _broadcast_launch(tensor, root_rank, name, "broadcast_async", False, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=None) -> Handle:
    """Start overwriting ``tensor`` with ``root_rank``'s."""
    return _broadcast_launch(tensor, root_rank, name, "broadcast_async_", True, process_set)


def broadcast(tensor, root_rank, name=None, process_set=None) -> torch.Tensor:
    """``root_rank``'s ``tensor``, as a new tensor on every rank (of ``process_set``; ``root_rank`` is a global
    rank, as in Horovod), with the same shape and dtype everywhere. Differentiable: the root gets the gradients
    averaged over the ranks, the others zero (Horovod's)."""
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
        require_world("broadcast")
        core.check_root(root_rank, "broadcast", core.set_of(process_set, "broadcast"))
        return _BroadcastFn.apply(tensor, root_rank, name, process_set)
    return _broadcast_launch(tensor, root_rank, name, "broadcast", False, process_set).wait()


def broadcast_(tensor, root_rank, name=None, process_set=None) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s, in place; returns it."""
    return _broadcast_launch(tensor, root_rank, name, "broadcast_", True, process_set).wait()


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.name, ctx.process_set = root_rank, name, process_set
        return _broadcast_launch(tensor, root_rank, name, "broadcast", False, process_set).wait()

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad.contiguous(), op=0, name=None if ctx.name is None else f"{ctx.name}.grad",
                            process_set=ctx.process_set)
        return (reduced if runtime.rank() == ctx.root_rank else torch.zeros_like(reduced)), None, None, None


# ---- objects, barrier -----------------------------------------------------------------------


# Note [Objects that cannot be sent]: encoding fails on one rank only (its object holds a lambda, a class
# instance), and the other ranks must not wait for bytes that will never come. So a rank whose object does
# not encode still takes part in every exchange: in the length field it sends -(n + 1) instead of a length,
# and as its bytes the n bytes of UTF-8 text "<error type>: <message>". A negative length is a flag no
# real payload can produce. After the exchange every rank raises: the failing rank its own error, unchanged;
# the others a TypeError (a RuntimeError if the sender's error was not a TypeError) naming the rank(s)
# whose object was not sent and why.


def _encode_or_error(obj) -> tuple[bytes, Exception | None]:
    """``obj`` encoded and no error, or the error's text (to send in its place) and the error."""
    try:
        return objects.encode(obj), None
    except Exception as e:  # noqa: BLE001 - any failure is sent to the peers, then raised here
        return f"{type(e).__name__}: {e}".encode(errors="replace"), e


def _sent_length(payload: bytes, error: Exception | None) -> int:
    return -len(payload) - 1 if error is not None else len(payload)


def _payload_size(length: int) -> int:
    """How many bytes follow a length field (an error text's for a negative one)."""
    return -length - 1 if length < 0 else length


def _not_sent(what: str, failures: list[tuple[int, str]], root_rank: int | None = None) -> Exception:
    """The error for ranks whose peers' objects (``failures``: rank, error text) could not be sent."""
    parts = [f"rank {r}{' (the root)' if r == root_rank else ''}'s object could not be sent ({text})"
             for r, text in failures]
    cls = TypeError if all(text.startswith("TypeError:") for _, text in failures) else CollectiveError
    return cls(f"rank {runtime.rank()} of {runtime.size()}: {what}: no object was received: " + "; ".join(parts))


def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    """``root_rank``'s ``obj`` on every rank. Differs from Horovod's: the object travels as JSON, never
    pickled, so it may hold only plain values, containers, tensors and numpy arrays (``objects.py``).

    On the wire: the root broadcasts the length of its encoded object (int64), then its bytes. If the root's
    object cannot be encoded, it broadcasts -(n + 1) and n bytes of its error's text instead, and every rank
    raises: the root its own ``TypeError``, the others a ``TypeError`` naming the root and the reason (Note
    [Objects that cannot be sent])."""
    fn = "broadcast_object"
    kind = require_world(fn)
    core.check_name(name, fn)
    plane = core.set_of(process_set, fn)
    root_rank = core.check_root(root_rank, fn, plane)
    rank = runtime.rank()
    if plane.size == 1:
        return objects.decode(objects.encode(obj))
    payload, error = _encode_or_error(obj) if rank == root_rank else (b"", None)
    base = name or fn
    length = torch.tensor([_sent_length(payload, error)], dtype=torch.int64)
    if kind != "horovod":
        agree(describe(fn, root_rank=root_rank, name=name), label(fn, name, plane), name, plane)
    broadcast_(length, root_rank, name=f"{base}.length", process_set=process_set)
    sent = int(length.item())
    data = torch.zeros(_payload_size(sent), dtype=torch.uint8)
    if rank == root_rank:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else data
    broadcast_(data, root_rank, name=f"{base}.data", process_set=process_set)
    if error is not None:
        raise error
    if sent < 0:
        text = bytes(data.numpy()).decode(errors="replace")
        raise _not_sent(label(fn, name, plane), [(root_rank, text)], root_rank)
    return objects.decode(bytes(data.numpy()))


def allgather_object(obj, name=None, process_set=None) -> list:
    """Every rank's ``obj``, in rank order. Objects travel as JSON, never pickled (see ``broadcast_object``).

    On the wire: an ``allgather`` of each rank's length (int64), then one of its bytes. A rank whose object
    cannot be encoded sends -(n + 1) and n bytes of its error's text instead, and every rank raises: that
    rank its own ``TypeError``, the others a ``TypeError`` naming it and the reason (Note [Objects that
    cannot be sent])."""
    fn = "allgather_object"
    kind = require_world(fn)
    core.check_name(name, fn)
    plane = core.set_of(process_set, fn)
    if plane.size == 1:
        return [objects.decode(objects.encode(obj))]
    payload, error = _encode_or_error(obj)
    if kind != "horovod":
        agree(describe(fn, name=name), label(fn, name, plane), name, plane)
    base = name or fn
    lengths = allgather(torch.tensor([_sent_length(payload, error)], dtype=torch.int64), name=f"{base}.length",
                        process_set=process_set)
    data = allgather(torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload
                     else torch.zeros(0, dtype=torch.uint8), name=f"{base}.data", process_set=process_set)
    if error is not None:
        raise error
    chunks, start = [], 0
    for sent in lengths.tolist():
        n = _payload_size(sent)
        chunks.append((sent, bytes(data[start:start + n].numpy())))
        start += n
    failures = [(r, chunk.decode(errors="replace")) for r, (sent, chunk) in zip(plane.ranks, chunks) if sent < 0]
    if failures:
        raise _not_sent(label(fn, name, plane), failures)
    return [objects.decode(chunk) for _, chunk in chunks]


def barrier(process_set=None) -> None:
    """Wait (at most ``timeout_s``) until every rank (of ``process_set``) has called ``barrier``."""
    kind = require_world("barrier")
    plane = core.set_of(process_set, "barrier")
    if plane.size == 1:
        return
    if kind == "horovod":
        # Horovod's own barrier has no deadline: a one-element all-reduce does the same, with one.
        allreduce(torch.zeros(1), name="dcredit_opt.barrier", op=1, process_set=process_set)
        return
    agree(describe("barrier"), label("barrier", None, plane), None, plane)
