"""torch.distributed: blocks all-reduced in C++ on one process group per channel.

Each backend (so each ``DistributedOptimizer``) makes its own groups when it
is built (``channels.channel_groups``: ``new_group`` on every rank, in the
order the optimizers are built) and destroys them when it closes. Groups are
never shared between optimizers: each optimizer has its own dispatch thread,
and the launches of two optimizers interleave by each rank's timing, so on a
shared group rank 0's block of one optimizer would meet rank 1's block of the
other (Gloo aborts when their sizes differ, and silently sums unrelated
gradients when they do not). The profiler's sweep runs on the backend's own
channel 0, for the same reason.

The groups inherit the default group's backend: Gloo on CPUs, NCCL on GPUs.
On a GPU the C++ adapter also orders every collective after its gradient's
stream (Note [CUDA streams] in ``csrc/torch/cuda_sync.h``).

Note [NCCL channels]
--------------------
Under NCCL each channel is a process group, and c10d gives a group one NCCL
communicator per device it is used on; an optimizer reduces one device's
parameters, so a channel is one communicator, with its own internal stream.
What NCCL requires of several communicators, and how we meet it:

1. Per communicator, every rank issues the same collectives in the same
   order: NCCL matches them by position. An optimizer's launch sequence is
   the same on every rank (Note [Same order on every rank]) and block
   ``seq`` goes to channel ``seq % channels``, so each of its communicators
   sees the same sequence everywhere, and the interleaving across its
   communicators is the same too. Communicators are never shared between
   optimizers: two optimizers' launches interleave by timing, differently on
   each rank (see the module docstring).
2. Communicators are created collectively. Every rank builds its optimizers,
   and so calls ``new_group``, in the same order. c10d would create a
   group's communicator at its first collective on the device (or split it
   from the default group's, when that group was bound to a device with
   ``device_id``); ``channels.channel_groups`` runs that first collective
   itself, a one-element all-reduce per group on the training thread while
   the optimizer is built, so every rank creates the communicators one
   after another in the same order. Left to the first launches, the
   creations of two optimizers' communicators would run on two dispatch
   threads in an order that differs between ranks, while the other
   optimizer's kernels may already be waiting on the device for their peers.
   The cost (one communicator creation per channel: milliseconds to seconds
   at scale) is paid once, when the optimizer is built.
3. One rank per GPU. All ranks of a communicator must sit on distinct
   devices, and the control plane puts its tensors on the current device; so
   the parameters must be on the rank's current CUDA device
   (``devices.check_group``).
4. Concurrent communicators on one device: the point of channels (a window of
   k blocks runs k collectives at once), and the one real hazard. NCCL
   kernels spin until their peers arrive. If the kernels of two channels
   cannot all be resident on the GPU at once, one rank may be running
   channel A's kernel while a peer runs channel B's, each waiting for the
   other: a deadlock that the same host issue order (rule 1) does not rule
   out, because the device need not start kernels of different streams in
   issue order. NCCL supports it only when the operations fit on the device
   together. In practice an NCCL kernel takes a few SMs (one block per NCCL
   "channel", an unrelated use of the word, bounded by NCCL_MAX_NCHANNELS),
   so 2 to 4 of ours fit beside compute kernels, which finish and free theirs.
   Keep ``Config.channels`` small on GPUs; with several optimizers on one
   GPU it is the sum of their channels that must fit. Recent NCCL (the
   2.30.7 that torch 2.14.1 ships has it) can order kernels of different
   communicators on one device by host launch order:
   ``NCCL_LAUNCH_ORDER_IMPLICIT=1`` in the environment before the first
   collective removes the hazard for one optimizer. Not for several: their
   host launch order differs between ranks (rule 1), and kernels serialised
   in orders that differ between ranks wait for each other forever.
5. Each communicator costs device memory (NCCL's buffers) and creation time;
   another reason for few channels. An optimizer's communicators live until
   it closes (``Core.close()``, or ``dc.shutdown()``, which closes optimizers
   in the order they were built, the same on every rank).
6. Timeouts: c10d's NCCL watchdog aborts a collective that outlives the
   group's timeout (``Config.timeout_s``, the scheduler's own) and by default
   ends the process (TORCH_NCCL_ASYNC_ERROR_HANDLING). The two race, so under
   NCCL a dead peer may end the job with c10d's message rather than ours.
"""

from __future__ import annotations

import atexit
import contextlib
import logging

import torch
import torch.distributed as dist

from .. import _ext
from ..errors import DCreditError
from ..world import peers, runtime
from ..world.channels import channel_groups, destroy_channel_groups
from . import packed_rows

log = logging.getLogger("dcredit_opt")


class TorchDistBackend:
    name = "torch"

    def __init__(self, channels: int, timeout_s: float, members=None, *, device_windows: bool = False,
                 reduction: str = "sum"):
        # The ranks reduced over: a process set's (Note [Process sets] in process_sets.py), or every rank.
        self._members = members if members is not None else _Everyone()
        self._groups = self._members.channel_groups(channels)  # this backend's own (see the module docstring)
        self._tally_group = self._members.channel_groups(1, backend="gloo")[0]  # Note [Global usage] in usage.py
        # Note [Side sums] in csrc/torch/side_sums.h: the side group's sums, started from C++ on this thread.
        self._side = _ext.load().SideSums(self._tally_group)
        self._tally = _SideSum(self._side, "a tally")
        self._delayed = _SideSum(self._side, "a delayed sum")  # the background sum of delayed gradients (deft.py)
        self._timeout_s = float(timeout_s)
        self.engine = _ext.load().Engine.torch(self._groups, float(timeout_s), reduction)  # Note [Reduce ops]
        # Note [Device windows] in csrc/core/scheduler.cc: only CUDA blocks can be ordered on the device.
        self.engine.set_device_windows(device_windows)
        if runtime.kind() == "horovod":  # registered after hvd.init(), so it runs before Horovod's own exit
            atexit.register(_abort_failed_horovod_mpi_job, self.engine, runtime.horovod())

    reducible_dtypes = None  # Gloo and NCCL reduce every floating dtype

    def buffers_for_engine(self, buffers, wires):
        """What ``Engine.set_plan`` gets: the C++ adapter cuts its own block views (and wire views)."""
        return {"buffers": buffers, "wire_buffers": wires}

    def set_blocks(self, buffers, wires, layout, postscale: float) -> None:
        """Nothing to do: the engine already holds the views."""

    def sweep_collectives(self):
        """Blocking ``allreduce(tensor)`` and ``barrier()`` on this backend's channel 0, for the profiler's sweep
        (nothing of ours is in flight then; another optimizer's blocks may be, on its own groups)."""
        group = self._groups[0]
        return (_at_rank(lambda buf: dist.all_reduce(buf, group=group), "profiling, the all-reduce sweep"),
                _at_rank(lambda: dist.barrier(group=group), "profiling, a barrier of the sweep"))

    def stage_collectives(self):
        """Blocking ``(reduce_scatter(buf), all_gather(buf))`` on channel 0, for the profiler's stage sweep
        (``profiler.measure_stage_ratios``): the buffer's length is a multiple of the world size; the
        all-gather spreads its first shard."""
        group = self._groups[0]
        world = dist.get_world_size(group)

        # torch 2.13 renamed these (the old names warn FutureWarning on every call); earlier torch has only
        # the old ones. Same arguments: (output, input).
        reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

        def reduce_scatter(buf):
            reduce_scatter_into(buf.new_empty(buf.numel() // world), buf, group=group)

        def all_gather(buf):
            all_gather_into(buf, buf[:buf.numel() // world].clone(), group=group)

        return (_at_rank(reduce_scatter, "profiling, the reduce-scatter sweep"),
                _at_rank(all_gather, "profiling, the all-gather sweep"))

    def _open(self) -> None:
        """After ``close()``, an error: never the default group that ``group=None`` would name."""
        if self._tally_group is None:
            raise DCreditError("this optimizer's channels are closed (dc.shutdown() or the optimizer's close)")

    def _side_group(self):
        """The side group (Note [Global usage] in usage.py), for a collective the training thread starts itself;
        the sums it started before are on the group already (Note [Side sums] in csrc/torch/side_sums.h)."""
        self._open()
        return self._tally_group

    def start_tally(self, counts) -> None:
        """Start summing the CPU tensor ``counts`` over ranks, in place, on a Gloo group of its own (Note
        [Global usage] in usage.py), from C++ (Note [Side sums]). One at a time: ``wait_tally`` before
        the next."""
        self._open()
        self._tally.start(counts)

    def wait_tally(self, timeout_s: float) -> None:
        """Wait for the tally in flight, if any."""
        self._tally.wait(timeout_s)

    def turn_tally(self, counts, used, tail, rest, summed, at: int, mine, world: int, timeout_s: float) -> bool:
        """A steady iteration's tally in one C++ call (``TallyTurns`` in base.py)."""
        self._open()
        return self._tally.turn(counts, used, tail, rest, summed, at, mine, world, timeout_s)

    exchanges_rows = True  # Note [Embedding rows] in rows.py

    def exchange_rows(self, ids, values, flag: bool, timeout_s: float):
        """Every rank's ``(ids, values)`` (int64 row indices, and those rows), in rank order, and whether any
        rank raised ``flag``; on the side group (whose timeout bounds each wait). Two all-gathers: the counts,
        then each rank's indices and rows packed as bytes, so that only two messages queue behind blocks."""
        group = self._side_group()
        world = dist.get_world_size(group)
        head = torch.tensor([ids.numel(), int(flag)], dtype=torch.int64)
        heads = [torch.empty_like(head) for _ in range(world)]
        dist.all_gather(heads, head, group=group)
        counts = [int(h[0]) for h in heads]
        any_flag = any(int(h[1]) for h in heads)
        n = max(counts)
        if n == 0:
            return [], any_flag
        packed = packed_rows.pack(ids, values, n)  # every rank's padded to the longest: all_gather wants one size
        everyone = [torch.empty_like(packed) for _ in range(world)]
        dist.all_gather(everyone, packed, group=group)
        return [packed_rows.unpack(buf, c, n, values) for buf, c in zip(everyone, counts)], any_flag

    def allreduce_side(self, tensor, timeout_s: float) -> None:
        """Sum ``tensor`` over ranks in place, on the side group (a CPU copy for a GPU tensor)."""
        if tensor.device.type == "cpu":
            dist.all_reduce(tensor, group=self._side_group())
        else:
            host = tensor.cpu()
            dist.all_reduce(host, group=self._side_group())
            tensor.copy_(host)

    def start_delayed(self, flat) -> None:
        """Start summing the CPU tensor ``flat`` over ranks, in place, on the side group, after whatever was
        started there (Note [Delayed updates] in planner/deft.py). One at a time: ``wait_delayed`` first."""
        self._open()
        self._delayed.start(flat)

    def wait_delayed(self, timeout_s: float) -> None:
        """Wait for the delayed sum in flight, if any."""
        self._delayed.wait(timeout_s)

    def close(self) -> None:
        """Stop the engine, then destroy the groups: the engine's dispatch thread is gone, and the
        optimizer has drained what was in flight."""
        self.engine.shutdown()
        if self._delayed.in_flight:  # started before the next tally on the side group: wait for it too
            self._wait_at_close(self.wait_delayed, "the last background sum of delayed gradients")
        if self._tally.in_flight:
            # A slower peer may start its last tally well after our blocks are done: destroying the group
            # first would fail that peer's tally.
            self._wait_at_close(self.wait_tally, "the last sum of which gradients each rank computed")
        self._side.close()  # the waits above saw every sum finish
        groups, self._groups = self._groups + [self._tally_group], []
        self._tally_group = None  # the engine let go of its groups (Engine.shutdown): now they can really go
        self._members.destroy_channel_groups(groups)

    def _wait_at_close(self, wait, what: str) -> None:
        """``wait(grace)`` for a collective still on the side group: as long as any collective, or briefly
        after a failure; a peer that is gone is logged (the channels' own failure says why), not raised."""
        grace = 1.0 if self.engine.error() is not None or peers.peer_lost() else self._timeout_s
        try:
            wait(grace)
        except RuntimeError as e:
            log.warning("dcredit_opt: %s did not finish within %g s: %s", what, grace, e)


class _Everyone:
    """Every rank's channels (``world/channels.py``), where no process set is given."""

    channel_groups = staticmethod(channel_groups)
    destroy_channel_groups = staticmethod(destroy_channel_groups)


def _at_rank(collective, where: str):
    """``collective``, raising torch.distributed's errors (a peer gone, the timeout) as ``DCreditError``s."""

    def call(*args):
        try:
            return collective(*args)
        except RuntimeError as e:
            raise peers.at_rank(e, f"{where} on channel 0") from e

    return call


class _SideSum:
    """One slot: at most one sum over ranks in flight on the side group (the tally, or DeFT's delayed sum),
    started from C++ on the training thread (Note [Side sums] in csrc/torch/side_sums.h)."""

    def __init__(self, sums, what: str):
        self._sums = sums
        self._what = what
        self._ticket = None

    @property
    def in_flight(self) -> bool:
        return self._ticket is not None

    def start(self, tensor) -> None:
        """Start the sum of ``tensor`` over the side group's ranks (every rank is in it), in place."""
        assert self._ticket is None, f"{self._what} is already in flight"
        self._ticket = self._sums.start(tensor)

    def wait(self, timeout_s: float) -> None:
        """Wait for the sum in flight, if any; the slot is free afterwards, even if the wait raised."""
        ticket, self._ticket = self._ticket, None
        if ticket is not None:
            self._sums.wait(ticket, timeout_s)

    def turn(self, counts, used, tail, rest, summed, at: int, mine, world: int, timeout_s: float) -> bool:
        """The sum in flight waited for, then ``counts`` (filled first) started unless ``summed`` breaks the
        agreement on ``mine`` (``SideSums.turn_tally``); the slot is free where that raised or broke."""
        ticket, self._ticket = self._ticket, None
        ticket = self._sums.turn_tally(-1 if ticket is None else ticket, counts, used, tail, rest, summed, at, mine,
                                       world, timeout_s)
        if ticket < 0:
            return False
        self._ticket = ticket
        return True


def _abort_failed_horovod_mpi_job(engine, hvd) -> None:
    """At exit, after a block of ours failed (a peer stalled or died) in a Horovod job on MPI: Horovod's
    shutdown would wait in MPI_Finalize for that peer forever, so the whole job ends with MPI_Abort, as
    with blocks on Horovod's operations (``HorovodBackend``'s transport, ``abandon``)."""
    if engine.error() is None:
        return
    with contextlib.suppress(Exception):  # Horovod already shut down, or without MPI: nothing waits in MPI
        if not hvd.mpi_enabled():
            return
        from mpi4py import MPI  # Horovod initialised MPI; mpi4py adopts it

        MPI.COMM_WORLD.Abort(1)
