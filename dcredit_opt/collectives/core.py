"""Handles, argument checks and the descriptor the ranks agree on (Note [Collectives beside the optimizer])."""

from __future__ import annotations

import datetime
import math
import time
import warnings
import zlib

import torch
import torch.distributed as dist

from ..errors import CollectiveError, CollectiveTimeout, MismatchError
from ..reduce_ops import HOROVOD_OP_CODES, ReduceOp
from ..world import process_sets, runtime
from ..world.runtime import require_world

# Horovod's reduce ops are ints (reduce_ops.HOROVOD_OP_CODES); Average, Sum and Adasum are also dcredit_opt's
# ReduceOp. Adasum is an all-gather, then a combination on every rank (collectives/adasum.py).
_HOROVOD_OPS = dict(HOROVOD_OP_CODES)
_OP_CODES = {name: code for code, name in _HOROVOD_OPS.items()}
Min, Max, Product = _OP_CODES["min"], _OP_CODES["max"], _OP_CODES["product"]

# Descriptor codes: fixed, so that they mean the same on every rank.
_OPERATIONS = ("barrier", "allreduce", "grouped_allreduce", "allgather", "broadcast", "broadcast_object",
               "allgather_object")
_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
           torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128)
_SHAPE_DIMS = 6  # dimensions a descriptor spells out, for the error message; a checksum covers them all


class Handle:
    """An operation in flight, as Horovod's ``*_async`` functions return: pass it to ``poll`` or
    ``synchronize``. ``synchronize`` returns its result (again, if called twice)."""

    def __init__(self, what: str, works=(), finish=None, hvd=None, hvd_handle=None, result=None, parts=()):
        self.what = what
        self._works = list(works)
        self._parts = list(parts)  # handles this one waits for first (a grouped operation made of several)
        self._finish = finish
        self._hvd, self._hvd_handle = hvd, hvd_handle
        self._result = result
        self._done = not self._works and not self._parts and finish is None and hvd is None

    def __repr__(self) -> str:
        return f"<dcredit_opt handle: {self.what}, {'done' if self._done else 'in flight'}>"

    def poll(self) -> bool:
        if self._done:
            return True
        if not all(p.poll() for p in self._parts):
            return False
        if self._hvd is not None:
            return bool(self._hvd.poll(self._hvd_handle))
        return all(w.is_completed() for w in self._works)

    def wait(self):
        if self._done:
            return self._result
        timeout_s = runtime.timeout_s()
        deadline = time.monotonic() + timeout_s
        out = [p.wait() for p in self._parts]  # each within its own deadline
        if self._hvd is not None:
            delay = 1e-4
            while not self._hvd.poll(self._hvd_handle):
                if time.monotonic() > deadline:
                    raise self._timeout(timeout_s)
                time.sleep(delay)
                delay = min(2 * delay, 0.01)
            out = self._hvd.synchronize(self._hvd_handle)
        else:
            for work in self._works:
                left = deadline - time.monotonic()
                try:
                    work.wait(timeout=datetime.timedelta(seconds=max(left, 0.001)))
                except RuntimeError as e:
                    if time.monotonic() >= deadline - 0.05 or "timed out" in str(e).lower():
                        raise self._timeout(timeout_s) from e
                    raise CollectiveError(f"rank {runtime.rank()} of {runtime.size()}: {self.what} failed: {e}") from e
        self._result = self._finish(out) if self._finish is not None else out
        self._done, self._works, self._parts, self._finish, self._hvd = True, [], [], None, None
        return self._result

    def _timeout(self, timeout_s: float) -> CollectiveTimeout:
        return CollectiveTimeout(
            f"rank {runtime.rank()} of {runtime.size()}: {self.what} did not complete within {timeout_s:g} s "
            "(init(timeout_s=...)): a rank has not called it, or has failed. Every rank must call the same "
            "collectives in the same order; after this error the job's collectives cannot be trusted, so end it")


def poll(handle: Handle) -> bool:
    """Whether the operation of ``handle`` has finished, so that ``synchronize(handle)`` will not wait."""
    if isinstance(handle, int) and not isinstance(handle, bool) and require_world("poll") == "horovod":
        return bool(runtime.horovod().poll(handle))  # a handle from horovod.torch itself
    return _handle(handle, "poll").poll()


def synchronize(handle: Handle):
    """Wait (at most ``timeout_s``) for the operation of ``handle``; returns its result."""
    if isinstance(handle, int) and not isinstance(handle, bool) and require_world("synchronize") == "horovod":
        return Handle("Horovod operation", hvd=runtime.horovod(), hvd_handle=handle, finish=lambda out: out).wait()
    return _handle(handle, "synchronize").wait()


def _handle(handle, fn: str) -> Handle:
    if not isinstance(handle, Handle):
        raise TypeError(f"{fn}: handle must be what an *_async function returned, got {type(handle).__name__}")
    return handle


# ---- arguments ---------------------------------------------------------------------------


def reduction(op, average, fn: str = "allreduce") -> str:
    """Horovod's ``op``/``average`` pair as one of "average", "sum", "adasum", "min", "max", "product"."""
    if op is not None and average is not None:
        raise ValueError(f"{fn}: the op parameter supersedes average; provide only one of them")
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=4)
        return "average" if average else "sum"
    if op is None:
        return "average"
    if isinstance(op, ReduceOp):
        return op.value
    if isinstance(op, int) and not isinstance(op, bool) and op in _HOROVOD_OPS:
        return _HOROVOD_OPS[op]
    raise ValueError(f"{fn}: op must be Average, Sum, Adasum, Min, Max or Product (dcredit_opt's or Horovod's), "
                     f"got {op!r}")


def check_tensor(tensor, fn: str, what: str = "tensor") -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{fn}: {what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{fn}: {what} is a {tensor.layout} tensor; only dense tensors are supported "
                        "(call .to_dense(); Horovod's sparse_allreduce_async is not provided)")
    if tensor.dtype not in _DTYPES:
        raise TypeError(f"{fn}: {what} has dtype {tensor.dtype}, which is not supported")
    return tensor


def check_reducible(tensor: torch.Tensor, fn: str, what: str) -> None:
    if tensor.dtype == torch.bool or tensor.dtype.is_complex:
        raise TypeError(f"{fn}: {what} has dtype {tensor.dtype}, which cannot be reduced (as in Horovod); "
                        "cast it to an integer or float dtype")


def check_name(name, fn: str) -> None:
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{fn}: name must be a str or None, got {type(name).__name__}")


def check_factor(value, what: str, fn: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{fn}: {what} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{fn}: {what} must be finite, got {value!r}")
    return float(value)


def check_root(root_rank, fn: str, plane=None) -> int:
    """``root_rank``, a global rank (as in Horovod, also with a process set), checked against the job and
    ``plane``'s ranks (a process set's, ``set_of``)."""
    size = runtime.size()
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < size:
        raise ValueError(f"{fn}: root_rank must be a rank in 0..{size - 1}, got {root_rank!r}")
    if plane is not None and root_rank not in plane.ranks:
        raise ValueError(f"{fn}: root_rank {root_rank} is not in process_set {plane.ranks}; root_rank is a global "
                         "rank (hvd.rank()) of one of the set's ranks, as in Horovod")
    return root_rank


class GlobalProcessSet:
    """Horovod's ``hvd.global_process_set``: every rank. Stateless: it asks the runtime, so it stays right across
    ``shutdown()`` and ``init()``."""

    process_set_id = 0  # Horovod's id of the global set, which the optimizer also accepts

    def size(self) -> int:
        return runtime.size()

    def rank(self) -> int:
        return runtime.rank()

    def included(self) -> bool:
        return True

    @property
    def ranks(self) -> list[int]:
        return list(range(runtime.size()))

    def __repr__(self) -> str:
        return "dcredit_opt.global_process_set"


global_process_set = GlobalProcessSet()


def set_of(process_set, fn: str):
    """The ranks ``fn`` runs over (Note [Collectives beside the optimizer]): every rank's plane for None or the
    global set, else the process set's (``process_sets.for_collectives``: ``ranks``, this rank's position
    ``rank``, ``size``, and Horovod's set object ``horovod_set`` or the group to run on, ``collective_group()``,
    with its ``control_device()``). Errors name ``process_set``."""
    return process_sets.for_collectives(process_set, fn)


def horovod_kwargs(plane) -> dict:
    """The ``process_set=`` to pass to Horovod's operation for ``plane``: none for every rank."""
    return {} if plane.horovod_set is None else {"process_set": plane.horovod_set}


# ---- the descriptor (Note [Collectives beside the optimizer]) -----------------------------


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def describe(operation: str, tensors=(), op: str | None = None, root_rank: int = -1, name: str | None = None,
             gather: bool = False) -> list[int]:
    """This rank's descriptor of an operation: what every rank must agree on. With ``gather`` the
    first dimension may differ (``allgather``): it is left out of the shape and kept in the last field."""
    shapes = [list(t.shape[1:] if gather else t.shape) for t in tensors]
    dtypes = [_DTYPES.index(t.dtype) for t in tensors]
    single = len(tensors) == 1
    shape = shapes[0] if single else []
    dims = (shape + [0] * _SHAPE_DIMS)[:_SHAPE_DIMS]
    return [_OPERATIONS.index(operation), _OP_CODES.get(op, -1), root_rank,
            dtypes[0] if single else _crc(repr(dtypes)), len(tensors), _crc(name) if name is not None else 0,
            _crc(repr(shapes)), len(shape) if single else -1, *dims,
            int(tensors[0].shape[0]) if gather and single and tensors[0].dim() else 0]


def disagreement(rows: list[list[int]], what: str, name: str | None, rank: int, ranks=None) -> str | None:
    """Why the ranks' descriptors ``rows`` (in rank order) disagree, or None; ``rank`` is this rank. ``ranks``: the
    global rank of each row (a process set's), rows 0, 1, ... by default."""
    ranks = list(range(len(rows))) if ranks is None else list(ranks)
    fields = (("operation", 0, lambda r: _OPERATIONS[r[0]] if 0 <= r[0] < len(_OPERATIONS) else str(r[0])),
              ("op", 1, lambda r: {-1: "none", **_HOROVOD_OPS}.get(r[1], str(r[1]))),
              ("root_rank", 2, lambda r: str(r[2])),
              ("number of tensors", 4, lambda r: str(r[4])),
              ("dtype", 3, lambda r: str(_DTYPES[r[3]]) if r[4] == 1 and 0 <= r[3] < len(_DTYPES)
               else "(several)"),
              ("shape", 6, _shape_text))
    for label, index, text in fields:
        values = [r[index] for r in rows]
        if len(set(values)) > 1:
            return (f"{what}: the ranks disagree on the {label}: "
                    + ", ".join(f"rank {r} {text(row)}" for r, row in zip(ranks, rows)))
    names = [r[5] for r in rows]
    if len(set(names)) > 1:
        others = [r for r, n in zip(ranks, names) if n != names[ranks.index(rank)]]
        return (f"{what}: the ranks gave different names: rank {rank} {name!r}, rank(s) {others} another; "
                "every rank must call the same collectives in the same order")
    return None


def _shape_text(row: list[int]) -> str:
    if row[7] < 0:
        return "(several tensors)"
    dims = row[8:8 + min(row[7], _SHAPE_DIMS)]
    return "[" + ", ".join(map(str, dims)) + (", ...]" if row[7] > _SHAPE_DIMS else "]")


def agree(descriptor: list[int], what: str, name: str | None, plane=None) -> list[list[int]]:
    """All-gather ``descriptor`` among ``plane``'s ranks (``set_of``; every rank by default), within the
    deadline; raise on every one of them if they disagree."""
    plane = plane if plane is not None else process_sets.everyone()
    mine = torch.tensor(descriptor, dtype=torch.int64, device=plane.control_device())
    rows = [torch.empty_like(mine) for _ in range(plane.size)]
    Handle(what, works=[dist.all_gather(rows, mine, group=plane.collective_group(), async_op=True)]).wait()
    table = [r.tolist() for r in rows]
    problem = disagreement(table, what, name, runtime.rank(), plane.ranks)
    if problem:
        raise MismatchError(problem)
    return table


def label(fn: str, name: str | None, plane=None) -> str:
    """``fn`` and its name for messages, with the process set it runs on unless that is every rank."""
    where = "" if plane is None or plane.everyone else f" on process_set {plane.ranks}"
    return (f"{fn} {name!r}" if name is not None else fn) + where


