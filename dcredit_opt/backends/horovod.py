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
"""

from __future__ import annotations

import atexit

import torch

from ..blockops import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from ..world import control, runtime
from ..world.launchers import warn_if_fusion_on
from . import packed_rows
from .driven import DrivenBackend


class HorovodBackend(DrivenBackend):
    name = "horovod"
    # Horovod's CPU collectives have no bfloat16: those gradients travel as float32 (Note [Wire dtype]).
    reducible_dtypes = (torch.float16, torch.float32, torch.float64)

    def __init__(self, channels: int, timeout_s: float):
        hvd = runtime.horovod()
        warn_if_fusion_on(hvd)
        super().__init__(_HorovodTransport(hvd, f"dc.{runtime.next_backend_id()}"), timeout_s)


class _HorovodTransport:
    def __init__(self, hvd, prefix: str):
        self._hvd = hvd
        self._prefix = prefix
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
        if op == ALL_REDUCE:
            return hvd.allreduce_async_(self._views[block], name=self._names[block], op=hvd.Sum,
                                        postscale_factor=self._postscale)
        if op == REDUCE_SCATTER:
            return hvd.reducescatter_async(self._views[block], name=self._names[block], op=hvd.Sum)
        return hvd.allgather_async(self._results.pop(after), name=self._names[block])

    def wait(self, block: int, handle) -> None:
        out = self._hvd.synchronize(handle)
        if self._stages[block][0] != ALL_REDUCE:
            self._results[block] = out

    def finish(self, block: int) -> None:
        """An all-gather's result into the block, post-scaled; an all-reduce has nothing left (Horovod applied
        the postscale), a reduce-scatter's shard waits for its all-gather."""
        if self._stages[block][0] != ALL_GATHER:
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
                                              op=self._hvd.Sum), "an all-reduce of the profiler's sweep", timeout_s)

    def barrier(self, timeout_s: float) -> None:
        self._wait(self._hvd.allreduce_async_(torch.zeros(1), name=f"{self._prefix}.sweep.barrier", op=self._hvd.Sum),
                   "a barrier of the profiler's sweep", timeout_s)

    def reduce_scatter(self, tensor, timeout_s: float) -> None:
        self._wait(self._hvd.reducescatter_async(tensor, name=f"{self._prefix}.sweep.rs.{tensor.numel()}",
                                                 op=self._hvd.Sum), "a reduce-scatter of the profiler's sweep",
                   timeout_s)

    def all_gather(self, tensor, timeout_s: float) -> None:
        shard = tensor[:tensor.numel() // self._hvd.size()].clone()
        tensor.copy_(self._wait(self._hvd.allgather_async(shard, name=f"{self._prefix}.sweep.ag.{tensor.numel()}"),
                                "an all-gather of the profiler's sweep", timeout_s))

    def exchange_rows(self, ids, values, flag: bool, timeout_s: float):
        """Note [Embedding rows]: counts, then every rank's packed ids and rows (Horovod's all-gather takes
        first dimensions that differ by rank; at least one row's room each, never an empty tensor)."""
        hvd = self._hvd
        head = torch.tensor([[ids.numel(), int(flag)]], dtype=torch.int64)
        heads = self._wait(hvd.allgather_async(head, name=f"{self._prefix}.rows.head"), "the embedding rows' counts",
                           timeout_s)
        counts = [int(c) for c in heads[:, 0]]
        any_flag = bool(heads[:, 1].any())
        if max(counts) == 0:
            return [], any_flag
        width = packed_rows.row_bytes(values)
        room = [max(c, 1) for c in counts]
        mine = packed_rows.pack(ids, values, room[hvd.rank()])
        everything = self._wait(hvd.allgather_async(mine, name=f"{self._prefix}.rows.data"), "the embedding rows",
                                timeout_s)
        out, start = [], 0
        for c, r in zip(counts, room):
            out.append(packed_rows.unpack(everything[start:start + r * (8 + width)], c, r, values))
            start += r * (8 + width)
        return out, any_flag

    def allreduce_side(self, tensor, timeout_s: float) -> None:
        """Sum ``tensor`` over ranks in place (float32 where Horovod's CPU operations lack the type)."""
        work = tensor if tensor.dtype in HorovodBackend.reducible_dtypes else tensor.float()
        self._wait(self._hvd.allreduce_async_(work, name=f"{self._prefix}.rows.rest", op=self._hvd.Sum),
                   "the dense rest of an embedding's gradient", timeout_s)
        if work is not tensor:
            tensor.copy_(work)

    def _wait(self, handle, what: str, timeout_s: float):
        return control.horovod_wait(self._hvd, handle, what, timeout_s)

    def start_tally(self, counts) -> None:
        assert self._tally is None, "a tally is already in flight"
        self._tally = self._hvd.allreduce_async_(counts, name=f"{self._prefix}.tally", op=self._hvd.Sum)

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
