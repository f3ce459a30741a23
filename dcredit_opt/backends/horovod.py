"""Horovod: each block is one ``hvd.allreduce_async_`` (Note [Python-driven backend]).

Horovod matches operations across ranks by name, in a negotiation that its
background thread runs once per cycle. A block's name is
``dc.<backend>.<plan>.<block>``: equal on every rank, because every rank
builds the same optimizers in the same order (``<backend>`` is
``runtime.next_backend_id()``) and switches plans at the same iteration;
unique among operations in flight, because a block is reduced once per
iteration and completes before the next one starts, and another optimizer's
blocks, in flight at the same time, carry another ``<backend>``; and stable
from one iteration to the next, so that Horovod's response cache answers it
without a full negotiation. The profiler's sweep is named
``dc.<backend>.sweep.<elements>`` for the same reasons. Fusion is discussed
in Note [Horovod fusion] (``world/launchers.py``).

Horovod runs its collectives one after another on one background thread, so
channels do not add concurrency here: a window of k blocks means k
operations queued in Horovod, which starts the next as soon as one ends.
The average is a sum followed by Horovod's own ``postscale_factor`` (the
optimizer has already applied the prescale), so no Python touches the data.
A decoupled block (Note [Two-stage blocks]) is a ``reducescatter_async``
(Horovod splits the first dimension, so no padding) and later an
``allgather_async`` of this rank's shard, copied back into the block.

Over a process set (Note [Process sets] in ``world/process_sets.py``) every
operation is Horovod's on Horovod's set (``process_set=``), and the names
are ``dc.set<id>.<k>.<plan>.<block>``: ``<k>`` counts the optimizers built
on that set, the same on each of its ranks, whatever the ranks outside it
build. A rank outside the Horovod set it is given steps alone, as in
Horovod: its "set" is itself, and nothing is sent (``_Alone``).
"""

from __future__ import annotations

import atexit

import torch

from ..blockops import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from ..reduce_ops import library_op
from ..world import control, runtime
from ..world.launchers import warn_if_fusion_on
from . import packed_rows
from .driven import DrivenBackend


class HorovodBackend(DrivenBackend):
    name = "horovod"
    # Horovod's CPU collectives have no bfloat16: those gradients travel as float32 (Note [Wire dtype]).
    reducible_dtypes = (torch.float16, torch.float32, torch.float64)

    def __init__(self, channels: int, timeout_s: float, members=None, *, reduction: str = "sum"):
        hvd = runtime.horovod()
        warn_if_fusion_on(hvd)
        if members is None or members.everyone:
            transport = _HorovodTransport(hvd, f"dc.{runtime.next_backend_id()}", reduction=reduction)
        elif members.horovod_set is None:  # a rank outside its Horovod set: nobody to reduce with
            transport = _Alone()
        else:
            hvd_set = members.horovod_set
            transport = _HorovodTransport(hvd, f"dc.set{hvd_set.process_set_id}.{members.count}", hvd_set,
                                          members.rank, members.size, reduction=reduction)
        super().__init__(transport, timeout_s)


class _HorovodTransport:
    def __init__(self, hvd, prefix: str, process_set=None, rank: int | None = None, size: int | None = None, *,
                 reduction: str = "sum"):
        self._hvd = hvd
        # The blocks' op (Note [Reduce ops] in reduce_ops.py); the sweep, tallies and rows always sum. Horovod's
        # reduce-scatter sums only: with another op a decoupled block is all-reduced whole in its first stage.
        self._reduce = library_op(reduction, "horovod", hvd)
        self._whole = reduction != "sum"
        self._prefix = prefix
        # Every operation's process set (Horovod's global one by default), and this rank's place in it.
        self._on = {} if process_set is None else {"process_set": process_set}
        self._rank = hvd.rank() if rank is None else rank
        self._size = hvd.size() if size is None else size
        self._plans = 0
        self._views: list = []
        self._names: list[str] = []
        self._stages: list = []  # per block: (collective, the block it follows)
        self._results: dict = {}  # block -> what its reduce-scatter or all-gather returned, until used
        self._postscale = 1.0
        self._tally = None  # the handle of the tally in flight

    def set_blocks(self, views, postscale: float, stages) -> None:
        for v in views:
            if not v.is_contiguous():  # a 1-D narrow of a flat buffer always is; Horovod insists
                raise ValueError("Horovod all-reduces contiguous tensors only")
        prefix = f"{self._prefix}.{self._plans}"
        self._plans += 1
        self._names = [f"{prefix}.{b}" for b in range(len(views))]
        self._views = views
        self._stages = list(stages)
        self._results = {}
        self._postscale = postscale

    def start(self, block: int, channel: int):
        hvd, (op, after) = self._hvd, self._stages[block]
        if op == ALL_REDUCE or (op == REDUCE_SCATTER and self._whole):
            return hvd.allreduce_async_(self._views[block], name=self._names[block], op=self._reduce,
                                        postscale_factor=self._postscale, **self._on)
        if op == REDUCE_SCATTER:
            return hvd.reducescatter_async(self._views[block], name=self._names[block], op=hvd.Sum, **self._on)
        if self._whole:  # its first stage reduced the whole block: nothing left to move
            return None
        return hvd.allgather_async(self._results.pop(after), name=self._names[block], **self._on)

    def wait(self, block: int, handle) -> None:
        if handle is None:  # a whole block's second stage
            return
        out = self._hvd.synchronize(handle)
        if self._stages[block][0] != ALL_REDUCE and not self._whole:
            self._results[block] = out

    def finish(self, block: int) -> None:
        """An all-gather's result into the block, post-scaled; an all-reduce has nothing left (Horovod applied
        the postscale), a reduce-scatter's shard waits for its all-gather."""
        if self._stages[block][0] != ALL_GATHER or self._whole:
            return
        view = self._views[block]
        view.copy_(self._results.pop(block))
        if self._postscale != 1.0:
            view.mul_(self._postscale)

    def describe(self, block: int) -> str:
        return f"Horovod tensor '{self._names[block]}'" if block < len(self._names) else "unknown block"

    # The profiler's sweep: blocking for the caller, each wait bounded by ``timeout_s`` (``_wait``).
    def allreduce(self, tensor, timeout_s: float) -> None:
        self._wait(self._hvd.allreduce_async_(tensor, name=f"{self._prefix}.sweep.{tensor.numel()}",
                                              op=self._hvd.Sum, **self._on),
                   "an all-reduce of the profiler's sweep", timeout_s)

    def barrier(self, timeout_s: float) -> None:
        self._wait(self._hvd.allreduce_async_(torch.zeros(1), name=f"{self._prefix}.sweep.barrier", op=self._hvd.Sum,
                                              **self._on),
                   "a barrier of the profiler's sweep", timeout_s)

    def reduce_scatter(self, tensor, timeout_s: float) -> None:
        self._wait(self._hvd.reducescatter_async(tensor, name=f"{self._prefix}.sweep.rs.{tensor.numel()}",
                                                 op=self._hvd.Sum, **self._on),
                   "a reduce-scatter of the profiler's sweep", timeout_s)

    def all_gather(self, tensor, timeout_s: float) -> None:
        shard = tensor[:tensor.numel() // self._size].clone()
        tensor.copy_(self._wait(self._hvd.allgather_async(shard, name=f"{self._prefix}.sweep.ag.{tensor.numel()}",
                                                          **self._on),
                                "an all-gather of the profiler's sweep", timeout_s))

    def exchange_rows(self, ids, values, flag: bool, timeout_s: float):
        """Note [Embedding rows]: counts, then every rank's packed ids and rows (Horovod's all-gather takes
        first dimensions that differ by rank; at least one row's room each, never an empty tensor)."""
        hvd = self._hvd
        head = torch.tensor([[ids.numel(), int(flag)]], dtype=torch.int64)
        heads = self._wait(hvd.allgather_async(head, name=f"{self._prefix}.rows.head", **self._on),
                           "the embedding rows' counts", timeout_s)
        counts = [int(c) for c in heads[:, 0]]
        any_flag = bool(heads[:, 1].any())
        if max(counts) == 0:
            return [], any_flag
        width = packed_rows.row_bytes(values)
        room = [max(c, 1) for c in counts]
        mine = packed_rows.pack(ids, values, room[self._rank])
        everything = self._wait(hvd.allgather_async(mine, name=f"{self._prefix}.rows.data", **self._on),
                                "the embedding rows", timeout_s)
        out, start = [], 0
        for c, r in zip(counts, room):
            out.append(packed_rows.unpack(everything[start:start + r * (8 + width)], c, r, values))
            start += r * (8 + width)
        return out, any_flag

    def allreduce_side(self, tensor, timeout_s: float) -> None:
        """Sum ``tensor`` over ranks in place (float32 where Horovod's CPU operations lack the type)."""
        work = tensor if tensor.dtype in HorovodBackend.reducible_dtypes else tensor.float()
        self._wait(self._hvd.allreduce_async_(work, name=f"{self._prefix}.rows.rest", op=self._hvd.Sum, **self._on),
                   "the dense rest of an embedding's gradient", timeout_s)
        if work is not tensor:
            tensor.copy_(work)

    def _wait(self, handle, what: str, timeout_s: float):
        return control.horovod_wait(self._hvd, handle, what, timeout_s)

    def start_tally(self, counts) -> None:
        assert self._tally is None, "a tally is already in flight"
        self._tally = self._hvd.allreduce_async_(counts, name=f"{self._prefix}.tally", op=self._hvd.Sum, **self._on)

    def tally_done(self) -> bool:
        if self._tally is not None and self._hvd.poll(self._tally):
            handle, self._tally = self._tally, None
            self._hvd.synchronize(handle)  # releases the handle; raises the operation's error, if any
        return self._tally is None

    def close(self) -> None:
        self._views = []

    def abandon(self, at_exit: bool) -> None:
        """A block will never complete. Under Gloo, Horovod's shutdown at exit ends it with an error
        (after Gloo's own timeout). Under MPI, that shutdown would wait in MPI_Finalize for the
        stalled peer forever, so the job is aborted at exit instead, as mpi4py's runner does."""
        if not self._hvd.mpi_enabled():
            return
        from mpi4py import MPI  # Horovod initialised MPI; mpi4py adopts it

        if at_exit:
            MPI.COMM_WORLD.Abort(1)
        atexit.register(MPI.COMM_WORLD.Abort, 1)  # runs before Horovod's shutdown (registered later)


class _Alone:
    """The transport of a rank outside the Horovod process set it was given (Horovod's meaning: its gradients are
    not reduced): a set of one, so every collective is the identity and completes at once."""

    def __init__(self):
        self._views: list = []
        self._stages: list = []
        self._postscale = 1.0

    def set_blocks(self, views, postscale: float, stages) -> None:
        self._views, self._postscale, self._stages = views, postscale, list(stages)

    def start(self, block: int, channel: int):
        return None

    def wait(self, block: int, handle) -> None:
        """Nothing in flight."""

    def finish(self, block: int) -> None:
        """A block is its own sum; post-scaled as a reduction's would be, once (by its last stage)."""
        if self._stages[block][0] != REDUCE_SCATTER and self._postscale != 1.0:
            self._views[block].mul_(self._postscale)

    def describe(self, block: int) -> str:
        return f"block {block} (this rank alone)"

    def allreduce(self, tensor, timeout_s: float) -> None:
        """A sum over one rank."""

    def barrier(self, timeout_s: float) -> None:
        """Nobody to wait for."""

    def reduce_scatter(self, tensor, timeout_s: float) -> None:
        """This rank's shard is the whole."""

    def all_gather(self, tensor, timeout_s: float) -> None:
        """The whole is this rank's."""

    def exchange_rows(self, ids, values, flag: bool, timeout_s: float):
        """Note [Embedding rows], among one rank: its own rows, in the form a gather returns them."""
        n = ids.numel()
        return ([packed_rows.unpack(packed_rows.pack(ids, values, n), n, n, values)] if n else []), flag

    def allreduce_side(self, tensor, timeout_s: float) -> None:
        """A sum over one rank."""

    def start_tally(self, counts) -> None:
        """The tally of one rank is its own counts."""

    def tally_done(self) -> bool:
        return True

    def close(self) -> None:
        self._views = []

    def abandon(self, at_exit: bool) -> None:
        """Nothing can stall."""
