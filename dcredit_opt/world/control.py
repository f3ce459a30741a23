"""The control plane: small collectives outside the scheduler, on the training thread (the model check, the
broadcast helpers, the plan). They run on Horovod in a Horovod job, on our own world group in an MPI job
(Note [Private groups] in ``groups.py``), and on torch.distributed's default group otherwise, whichever
backend carries the blocks: never on a dispatch thread's channels, so they never race one.

``name`` identifies the operation to Horovod, which matches operations across ranks by name; it must be the
same on every rank, and stable from one call to the next so that Horovod's response cache can serve it.

Every wait has a deadline, ``timeout_s`` (``init(timeout_s=)``). On torch.distributed it is the group's
timeout, which Gloo's collectives honour (and NCCL's watchdog enforces). Horovod's synchronous calls and its
``synchronize`` have none, so in a Horovod job the async form is started and its handle polled
(``_horovod_wait``) until the deadline.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..errors import CollectiveTimeout
from . import groups, runtime
from .peers import at_rank


def control_group():
    """The control plane's process group: None for torch.distributed's default group, else ours (Note
    [Private groups] in groups.py)."""
    return runtime.current().group


def control_backend() -> str | None:
    """The control plane's torch.distributed backend ("gloo", "nccl"), or None where it is Horovod's."""
    world = runtime.current()
    if world.kind == "horovod":
        return None
    if world.group is not None:
        return "gloo"
    return dist.get_backend() if dist.is_initialized() else None


def control_device() -> torch.device:
    """Where control tensors live: the GPU under NCCL, else the CPU."""
    if control_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Sleeps between polls of a Horovod handle: from 20 us, doubling, to at most 2 ms. The control plane's
# operations are small and usually done within a negotiation cycle or two, so the first polls are quick;
# a wait that goes on costs a poll every 2 ms, not a spinning core.
_POLL_FIRST_S = 20e-6
_POLL_MAX_S = 2e-3


def wait_polled(done, timeout_s: float, timeout_error) -> None:
    """Call ``done()`` until it is true, sleeping between calls as above; past ``timeout_s``, raise
    ``timeout_error()``. For operations whose own wait has no deadline (Horovod handles, MPI requests)."""
    deadline = time.monotonic() + timeout_s
    delay = _POLL_FIRST_S
    while not done():
        if time.monotonic() >= deadline:
            raise timeout_error()
        time.sleep(min(delay, max(deadline - time.monotonic(), 0.0)))
        delay = min(2 * delay, _POLL_MAX_S)


def _horovod_wait(hvd, handle, what: str, timeout_s: float, rank_: int, size_: int):
    """The result of Horovod operation ``handle`` (``hvd.synchronize``), polled with ``hvd.poll`` so that
    the wait ends within ``timeout_s``: past it, ``CollectiveTimeout`` (a TimeoutError) naming ``what``."""
    wait_polled(lambda: hvd.poll(handle), timeout_s, lambda: CollectiveTimeout(
        f"rank {rank_} of {size_}: control-plane operation {what} did not complete within {timeout_s:g} s "
        "(init(timeout_s=...)): a peer is gone or did not reach the same call (every rank must make the "
        "same dcredit_opt calls in the same order); the operation is still pending in Horovod, so end "
        "the job"))
    return hvd.synchronize(handle)


def horovod_wait(hvd, handle, what: str, timeout_s: float):
    """The result of Horovod operation ``handle``, waited for at most ``timeout_s`` (``CollectiveTimeout`` naming
    ``what`` past it); for backends' own operations beside the blocks."""
    return _horovod_wait(hvd, handle, what, timeout_s, runtime.rank(), runtime.size())


class Gathering:
    """A control-plane all-gather started and not waited for yet (:func:`all_gather_async`). ``wait()`` gives
    every rank's tensor, in rank order, within the plane's ``timeout_s`` (``CollectiveTimeout``, a TimeoutError,
    past it), and the same list again if called again. Every rank that started it waits for it before the
    plane closes: one left in flight at ``shutdown()`` would meet a group being taken down."""

    def __init__(self, wait):
        self._wait = wait
        self._result = None

    @classmethod
    def done(cls, result: list) -> Gathering:
        return cls(lambda: result)

    def wait(self) -> list:
        if self._wait is not None:
            self._result, self._wait = self._wait(), None
        return self._result


def all_gather_async(tensor: torch.Tensor, name: str) -> Gathering:
    """Start gathering every rank's ``tensor`` (same shape and dtype on every rank) without waiting; the training
    thread goes on, and ``wait()`` on the result later. The operations started this way and the synchronous ones
    must come in the same order on every rank, as every collective's."""
    world = runtime.current()
    if world.size == 1:
        return Gathering.done([tensor.clone()])
    if world.kind == "horovod":
        op = f"dc.ctl.{name}"
        handle = world.hvd.allgather_async(tensor.reshape(1, -1).contiguous(), name=op)

        def rows() -> list:
            rows_ = _horovod_wait(world.hvd, handle, f"all_gather {op!r}", world.timeout_s, world.rank, world.size)
            return [row.reshape(tensor.shape) for row in rows_.unbind(0)]

        return Gathering(rows)
    return torch_all_gather_async(tensor, world.group, world.size, f"control-plane all_gather {name!r}")


def torch_all_gather_async(tensor: torch.Tensor, group, size: int, what: str) -> Gathering:
    """:func:`all_gather_async` on a torch.distributed ``group`` of ``size`` ranks (None: the default group), whose
    own timeout bounds the wait; a failure names ``what``."""
    gathered = [torch.empty_like(tensor) for _ in range(size)]
    try:
        work = dist.all_gather(gathered, tensor, group=group, async_op=True)
    except RuntimeError as e:  # torch's DistBackendError: a peer is gone, or the timeout passed
        raise at_rank(e, what) from e

    def done() -> list:
        try:
            work.wait()
        except RuntimeError as e:
            raise at_rank(e, what) from e
        return gathered

    return Gathering(done)


def all_gather(tensor: torch.Tensor, name: str) -> list:
    """Every rank's ``tensor`` (same shape and dtype on every rank), in rank order; waits at most
    ``timeout_s`` (``CollectiveTimeout``, a TimeoutError, past it)."""
    return all_gather_async(tensor, name).wait()


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str) -> None:
    """Overwrite the contiguous ``tensor`` (on ``control_device()``) with ``root_rank``'s, in place; waits at
    most ``timeout_s`` (``CollectiveTimeout``, a TimeoutError, past it)."""
    world = runtime.current()
    if world.size == 1:
        return
    if world.kind == "horovod":
        if tensor.numel():
            # As bytes: exact, and independent of which dtypes Horovod supports.
            op = f"dc.ctl.{name}"
            handle = world.hvd.broadcast_async_(tensor.view(-1).view(torch.uint8), root_rank, name=op)
            _horovod_wait(world.hvd, handle, f"broadcast_ {op!r}", world.timeout_s, world.rank, world.size)
        return
    try:
        groups.broadcast(tensor, root_rank, world.group)
    except RuntimeError as e:
        raise at_rank(e, f"control-plane broadcast {name!r} from rank {root_rank}") from e


def broadcast_text(text: str | None, root_rank: int, plane=None) -> str:
    """``root_rank``'s ``text`` on every rank, as UTF-8 bytes in a uint8 tensor (no pickle). ``plane``: a process
    set's control plane (``process_sets``), its ``rank``, ``broadcast_`` and ``control_device``; None: every rank."""
    me, broadcast_one, dev = _plane(plane, "broadcast_")
    if me == root_rank:
        payload = torch.tensor(list(text.encode()), dtype=torch.uint8, device=dev)
        length = torch.tensor([payload.numel()], dtype=torch.int64, device=dev)
    else:
        length = torch.zeros(1, dtype=torch.int64, device=dev)
    broadcast_one(length, root_rank, "text.length")
    if me != root_rank:
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=dev)
    broadcast_one(payload, root_rank, "text.payload")
    return bytes(payload.cpu().tolist()).decode()


def all_gather_text(text: str, name: str, plane=None) -> list[str]:
    """Every rank's ``text``, in rank order, as UTF-8 bytes in uint8 tensors (no pickle): the lengths, then
    the bytes, each rank's padded to the longest. ``plane``: as in ``broadcast_text``."""
    _, gather, dev = _plane(plane, "all_gather")
    payload = torch.tensor(list(text.encode()), dtype=torch.uint8, device=dev)
    lengths = [int(n) for n in gather(torch.tensor([payload.numel()], dtype=torch.int64, device=dev),
                                      f"{name}.length")]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=dev)
    padded[:payload.numel()] = payload
    return [bytes(row[:n].cpu().tolist()).decode() for row, n in zip(gather(padded, f"{name}.data"), lengths)]


def _plane(plane, operation: str) -> tuple:
    """(this rank, ``operation``, the control device) of ``plane``, or of every rank's control plane."""
    if plane is None:
        return runtime.rank(), {"broadcast_": broadcast_, "all_gather": all_gather}[operation], control_device()
    return plane.rank, getattr(plane, operation), plane.control_device()


def shared_store():
    """The store every rank reaches (process sets meet there, Note [Process sets] in process_sets.py): ours under
    MPI, the default group's under torchrun (or where the script made one), else None."""
    world = runtime.current()
    if world.store is not None:
        return world.store
    if dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    return None
