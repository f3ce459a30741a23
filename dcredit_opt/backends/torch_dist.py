"""torch.distributed: blocks all-reduced in C++ on one process group per channel.

The groups (``runtime.channel_groups``) inherit the default group's backend:
Gloo on CPUs, NCCL on GPUs. On a GPU the C++ adapter also orders every
collective after its gradient's stream (Note [CUDA streams] in
``csrc/torch/cuda_sync.h``).

Note [NCCL channels]
--------------------
Under NCCL each channel is a process group, and c10d gives a group one NCCL
communicator per device it is used on; an optimizer reduces one device's
parameters, so a channel is one communicator, with its own internal stream.
What NCCL requires of several communicators, and how we meet it:

1. Per communicator, every rank issues the same collectives in the same
   order: NCCL matches them by position. The launch sequence is the same on
   every rank (Note [Same order on every rank]) and block ``seq`` goes to
   channel ``seq % channels``, so each communicator sees the same sequence
   everywhere; and the interleaving across communicators is the same too.
2. Communicators are created collectively. Every rank calls ``new_group``
   in the same order; c10d creates a group's communicator at its first
   collective on the device (or splits it from the default group's, when
   that group was bound to a device with ``device_id``). First collectives
   follow the launch sequence, channel 0 first, on every rank, so no rank
   waits in one creation while a peer waits in another. The first launch on
   each channel pays for the creation on the dispatch thread (milliseconds to
   seconds at scale), in the first iteration only.
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
   Keep ``Config.channels`` small on GPUs. Recent NCCL (the 2.30.7 that torch
   2.14.1 ships has it) can order kernels of different communicators on one
   device by host launch order: ``NCCL_LAUNCH_ORDER_IMPLICIT=1`` in the
   environment before the first collective removes the hazard.
5. Each communicator costs device memory (NCCL's buffers) and creation time;
   another reason for few channels.
6. Timeouts: c10d's NCCL watchdog aborts a collective that outlives the
   group's timeout (``Config.timeout_s``, the scheduler's own) and by default
   ends the process (TORCH_NCCL_ASYNC_ERROR_HANDLING). The two race, so under
   NCCL a dead peer may end the job with c10d's message rather than ours.
"""

from __future__ import annotations

from .. import _ext, profiler, runtime


class TorchDistBackend:
    name = "torch"

    def __init__(self, channels: int, timeout_s: float):
        self.engine = _ext.load().Engine.torch(runtime.channel_groups(channels), float(timeout_s))

    def buffers_for_engine(self, buffers):
        """What ``Engine.set_plan`` gets: the C++ adapter cuts its own block views."""
        return buffers

    def set_blocks(self, buffers, layout, postscale: float) -> None:
        """Nothing to do: the engine already holds the views."""

    def measure_alpha_beta(self, device):
        """The profiler's all-reduce sweep on channel 0."""
        return profiler.measure_alpha_beta(runtime.channel_groups(1)[0], device)

    def close(self) -> None:
        self.engine.shutdown()
