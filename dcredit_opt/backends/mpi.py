"""MPI through mpi4py: each block is one ``Iallreduce`` (Note [Python-driven backend]).

Each channel is its own communicator (``COMM_WORLD.Dup()``, made by every
rank in the same order when the optimizer is built), so a window of k blocks
on k channels is k collectives in flight at once, and the MPI library is free
to progress them together. Collectives on one communicator match by order,
which the driver thread keeps (the scheduler's launch order). Every optimizer
duplicates its own and frees them when it closes: two optimizers' drivers
start their blocks in an order that differs between ranks, so on a shared
communicator one optimizer's block would be reduced with the other's. The
profiler's sweep runs on the first of them.

The driver starts collectives while the completer waits in ``MPI_Wait``, so
the library must allow calls from several threads (``MPI_THREAD_MULTIPLE``,
what mpi4py asks for by default; MPICH and Open MPI grant it). Blocks are
reduced in place on numpy views of the CPU buffers; GPU tensors would need a
CUDA-aware MPI, which we do not assume.
"""

from __future__ import annotations

import numpy as np
import torch

from ..blockops import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from ..errors import LaunchError
from ..reduce_ops import library_op
from ..world import control, runtime
from ..world.launchers import import_mpi
from . import packed_rows
from .driven import DrivenBackend

# dtypes every MPI has a type for; float16/bfloat16 have none in the standard.
_SUPPORTED = (torch.float32, torch.float64)


class MPIBackend(DrivenBackend):
    name = "mpi"
    reducible_dtypes = _SUPPORTED  # float16/bfloat16 gradients travel as float32 (Note [Wire dtype])

    def __init__(self, channels: int, timeout_s: float, members=None, *, reduction: str = "sum"):
        MPI = import_mpi()
        world = MPI.COMM_WORLD
        if (world.Get_rank(), world.Get_size()) != (runtime.rank(), runtime.size()):
            raise LaunchError(
                f"backend 'mpi' needs a job launched by mpiexec/mpirun: MPI sees rank {world.Get_rank()} of "
                f"{world.Get_size()}, but this job is rank {runtime.rank()} of {runtime.size()} "
                f"({runtime.kind()}). Launch with `mpiexec -n N python train.py`, or use backend 'auto'")
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise LaunchError(
                "backend 'mpi' starts and waits for collectives from two threads and needs MPI_THREAD_MULTIPLE, "
                f"but this MPI granted level {MPI.Query_thread()}: use an MPI built with thread support, leave "
                "mpi4py.rc.thread_level at 'multiple', or use backend 'torch'")
        # A process set's communicator (Note [Process sets] in process_sets.py), or every rank's.
        base = members.mpi_comm() if members is not None else world
        comms = [base.Dup() for _ in range(channels + 1)]  # the last one carries the tallies
        if base != world and base != MPI.COMM_SELF:
            base.Free()  # its duplicates stay
        super().__init__(_MPITransport(MPI, comms[:-1], comms[-1], reduction), timeout_s)


# Requests (each holding the buffer MPI writes into) and their communicators that were still in flight
# when given up on: a peer is gone or stalled. Kept for the life of the process, never freed.
_IN_FLIGHT_AT_CLOSE: list = []


def _wait(request, timeout_s: float, what: str) -> None:
    """Wait for an MPI request, polled, so that the wait has a deadline. Past it the request, and the
    buffer it holds, are kept (``_IN_FLIGHT_AT_CLOSE``): MPI may still write into that buffer; and the job
    ends with MPI_Abort at exit, since MPI_Finalize would wait for that request's stalled peer forever (a
    side collective given up on, with every block done, hung the job at exit)."""
    try:
        control.wait_polled(request.Test, timeout_s, lambda: TimeoutError(
            f"mpi: {what} did not arrive within {timeout_s:g} s (a peer may be gone or stalled)"))
    except TimeoutError:
        _IN_FLIGHT_AT_CLOSE.append((request, None))
        from mpi4py.run import set_abort_status

        set_abort_status(1)
        raise


class _MPITransport:
    def __init__(self, MPI, comms, tally_comm, reduction: str = "sum"):
        self._MPI = MPI
        # The blocks' op (Note [Reduce ops] in reduce_ops.py); the sweep, tallies and rows always sum.
        self._reduce = library_op(reduction, "mpi4py", MPI)
        self._comms = comms
        self._tally_comm = tally_comm
        self._tally = None  # the request of the tally in flight
        self._views: list = []
        self._arrays: list = []
        self._ops: list = []
        # Note [Two-stage blocks]: per decoupled block, this rank's reduced shard, and a zero-padded copy of
        # the block where its length is not a multiple of the world size (None: the block itself).
        self._shards: list = []
        self._padded: list = []
        self._postscale = 1.0

    def set_blocks(self, views, postscale: float, stages) -> None:
        for v in views:
            if v.device.type != "cpu":
                raise ValueError(f"backend 'mpi' reduces CPU tensors only, got a gradient on {v.device}: use "
                                 "backend 'torch' (NCCL) or 'horovod' for GPU training")
            if v.dtype not in _SUPPORTED:
                raise ValueError(f"backend 'mpi' reduces float32 and float64 blocks, got {v.dtype}")
        self._views = views
        self._arrays = [v.numpy() for v in views]  # share memory with the buffers
        self._ops = [op for op, _ in stages]
        self._shards, self._padded = [None] * len(views), [None] * len(views)
        size = self._comms[0].Get_size()
        for b, (op, after) in enumerate(stages):
            if op == REDUCE_SCATTER:
                n = self._arrays[b].size
                shard = -(-n // size)
                self._shards[b] = np.zeros(shard, dtype=self._arrays[b].dtype)
                self._padded[b] = np.zeros(shard * size, dtype=self._arrays[b].dtype) if shard * size != n else None
            elif op == ALL_GATHER:  # the layout puts its reduce-scatter, `after`, first
                self._shards[b], self._padded[b] = self._shards[after], self._padded[after]
        self._postscale = postscale

    def start(self, block: int, channel: int):
        comm, a, op = self._comms[channel], self._arrays[block], self._ops[block]
        if op == ALL_REDUCE:
            return comm.Iallreduce(self._MPI.IN_PLACE, a, op=self._reduce)
        padded = self._padded[block]
        if op == REDUCE_SCATTER:
            if padded is not None:
                padded[:a.size] = a  # the tail stays zero
            return comm.Ireduce_scatter_block(a if padded is None else padded, self._shards[block], op=self._reduce)
        return comm.Iallgather(self._shards[block], a if padded is None else padded)

    def wait(self, block: int, request) -> None:
        request.Wait()

    def finish(self, block: int) -> None:
        """An all-reduce or an all-gather has the reduced block: post-scale it. A reduce-scatter's shard waits
        for its all-gather as it is."""
        op, a = self._ops[block], self._arrays[block]
        if op == REDUCE_SCATTER:
            return
        if op == ALL_GATHER and self._padded[block] is not None:
            a[:] = self._padded[block][:a.size]
        if self._postscale != 1.0:
            np.multiply(a, a.dtype.type(self._postscale), out=a)

    def describe(self, block: int) -> str:
        return f"{self._arrays[block].size} elements" if block < len(self._arrays) else "unknown block"

    # The profiler's sweep: blocking for the caller, each wait bounded by ``timeout_s`` (``_wait``).
    def allreduce(self, tensor, timeout_s: float) -> None:
        _wait(self._comms[0].Iallreduce(self._MPI.IN_PLACE, tensor.numpy(), op=self._MPI.SUM), timeout_s,
              "an all-reduce of the profiler's sweep")

    def barrier(self, timeout_s: float) -> None:
        _wait(self._comms[0].Ibarrier(), timeout_s, "a barrier of the profiler's sweep")

    def reduce_scatter(self, tensor, timeout_s: float) -> None:
        a = tensor.numpy()
        shard = np.empty(a.size // self._comms[0].Get_size(), a.dtype)  # alive until the wait is over
        _wait(self._comms[0].Ireduce_scatter_block(a, shard, op=self._MPI.SUM), timeout_s,
              "a reduce-scatter of the profiler's sweep")

    def all_gather(self, tensor, timeout_s: float) -> None:
        a = tensor.numpy()
        shard = a[:a.size // self._comms[0].Get_size()].copy()  # alive until the wait is over
        _wait(self._comms[0].Iallgather(shard, a), timeout_s, "an all-gather of the profiler's sweep")

    def start_tally(self, counts) -> None:
        assert self._tally is None, "a tally is already in flight"
        self._tally = self._tally_comm.Iallreduce(self._MPI.IN_PLACE, counts.numpy(), op=self._MPI.SUM)

    def tally_done(self) -> bool:
        if self._tally is not None and self._tally.Test():
            self._tally = None
        return self._tally is None

    def exchange_rows(self, ids, values, flag: bool, timeout_s: float):
        """Note [Embedding rows]: counts, then every rank's packed ids and rows (``Iallgatherv``, no padding),
        on the tally communicator, each wait bounded by ``timeout_s``."""
        comm, MPI = self._tally_comm, self._MPI
        head = np.array([ids.numel(), int(flag)], dtype=np.int64)
        heads = np.empty((comm.Get_size(), 2), dtype=np.int64)
        _wait(comm.Iallgather(head, heads), timeout_s, "the embedding rows' counts")
        counts = [int(c) for c in heads[:, 0]]
        any_flag = bool(heads[:, 1].any())
        if max(counts) == 0:
            return [], any_flag
        width = packed_rows.row_bytes(values)
        sizes = [c * (8 + width) for c in counts]
        displs = [sum(sizes[:r]) for r in range(len(sizes))]
        recv = np.empty(sum(sizes), dtype=np.uint8)
        mine = packed_rows.pack(ids, values, ids.numel()).numpy()
        _wait(comm.Iallgatherv(mine, [recv, sizes, displs, MPI.BYTE]), timeout_s, "the embedding rows")
        everything = torch.from_numpy(recv)
        gathered = [packed_rows.unpack(everything[d:d + n], c, c, values) for d, n, c in zip(displs, sizes, counts)]
        return gathered, any_flag

    def allreduce_side(self, tensor, timeout_s: float) -> None:
        """Sum the CPU ``tensor`` over ranks in place on the tally communicator (float32 where MPI has no type)."""
        work = tensor if tensor.dtype in _SUPPORTED else tensor.float()
        _wait(self._tally_comm.Iallreduce(self._MPI.IN_PLACE, work.numpy(), op=self._MPI.SUM), timeout_s,
              "the dense rest of an embedding's gradient")
        if work is not tensor:
            tensor.copy_(work)

    def close(self) -> None:
        self._views, self._arrays, self._shards, self._padded = [], [], [], []
        if not self.tally_done():
            # Never free a request in flight: mpi4py would drop the buffer MPI is about to write into
            # (heap corruption), and MPI forbids freeing an active collective's request or communicator.
            _IN_FLIGHT_AT_CLOSE.append((self._tally, self._tally_comm))
            self._tally = None
            self._tally_comm = None
        if not self._MPI.Is_finalized():
            for comm in self._comms + ([self._tally_comm] if self._tally_comm is not None else []):
                comm.Free()
        self._comms = []

    def abandon(self, at_exit: bool) -> None:
        """A collective will never finish: at exit, MPI_Finalize would wait for the stalled peer
        forever. Ask mpi4py to call MPI_Abort at exit instead, which ends the whole job."""
        from mpi4py.run import set_abort_status

        set_abort_status(1)
