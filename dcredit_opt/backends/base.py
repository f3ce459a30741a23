"""What a backend offers the optimizer (``Backend``), and what a Python-driven backend's transport offers
it (``Transport``, Note [Python-driven backend] in ``driven.py``).

Every member is required: a caller uses it without asking whether it is there. What only some backends
do is a protocol of its own that a caller tests with ``isinstance`` (``DelayedSums``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch


class Backend(Protocol):
    """How one optimizer's blocks are launched and completed, and its side channel (Note [Global usage] in
    usage.py): one per ``DistributedOptimizer``, owning its channels until ``close()``."""

    name: str
    """"torch", "horovod" or "mpi" (``config.BACKENDS``)."""
    engine: Any
    """The ``_C.Engine`` that schedules this backend's blocks (``Engine.torch``, or ``Engine.manual``)."""
    reducible_dtypes: tuple[torch.dtype, ...] | None
    """None: its collectives reduce any dtype; else those they reduce, the others travel as float32 (Note
    [Wire dtype] in compression.py)."""
    exchanges_rows: bool
    """Whether ``exchange_rows`` can carry embedding rows (Note [Embedding rows] in rows.py)."""

    def buffers_for_engine(self, buffers: list[torch.Tensor], wires: list[torch.Tensor]) -> dict:
        """The keywords of ``Engine.set_plan`` that carry memory."""
        ...

    def set_blocks(self, buffers: list[torch.Tensor], wires: list[torch.Tensor], layout, postscale: float) -> None:
        """The blocks of ``layout`` as views of ``buffers`` (and of ``wires`` where a block travels in another
        dtype); only while nothing is in flight."""
        ...

    def sweep_collectives(self) -> tuple[Callable[[torch.Tensor], None], Callable[[], None]]:
        """A blocking all-reduce and barrier on the backend's own channels, for the profiler's sweep."""
        ...

    def stage_collectives(self) -> tuple[Callable[[torch.Tensor], None], Callable[[torch.Tensor], None]]:
        """A blocking reduce-scatter and all-gather, for the profiler's stage sweep."""
        ...

    def start_tally(self, counts: torch.Tensor) -> None:
        """Start summing ``counts`` over ranks, in place, beside the blocks; one at a time."""
        ...

    def wait_tally(self, timeout_s: float) -> None:
        """Wait for the tally in flight, if any."""
        ...

    def exchange_rows(self, ids: torch.Tensor, values: torch.Tensor, flag: bool,
                      timeout_s: float) -> tuple[list, bool]:
        """Every rank's ``(ids, values)``, in rank order, and whether any rank raised ``flag``."""
        ...

    def allreduce_side(self, tensor: torch.Tensor, timeout_s: float) -> None:
        """Sum ``tensor`` over ranks in place, on the side channel."""
        ...

    def close(self) -> None:
        """Stop the engine and release the channels; nothing of this backend runs afterwards."""
        ...


@runtime_checkable
class DelayedSums(Protocol):
    """A backend that sums delayed gradients in the background on its side channel (Note [Delayed updates]
    in planner/deft.py): the torch backend."""

    def start_delayed(self, flat: torch.Tensor) -> None: ...

    def wait_delayed(self, timeout_s: float) -> None: ...


@runtime_checkable
class TallyTurns(Protocol):
    """A backend that takes a steady iteration's tally (Note [Global usage] in usage.py) in one call: the
    torch backend (Note [Side sums] in csrc/torch/side_sums.h)."""

    def turn_tally(self, counts: torch.Tensor, used, tail, rest: list[int], summed: torch.Tensor | None, at: int,
                   mine: list[int], world: int, timeout_s: float) -> bool:
        """This rank's part into ``counts`` (the flags ``used``, then ``tail``, then ``rest``); the tally in
        flight waited for; then, unless its sums ``summed`` (from ``at`` on) show a rank that sent other values
        than ``mine`` (False: nothing started), the sum of ``counts`` started and ``used`` cleared."""
        ...


class Transport(Protocol):
    """How a Python-driven backend starts, waits for and finishes one block's collective (Note
    [Python-driven backend] in driven.py): MPI's and Horovod's."""

    def set_blocks(self, views: list[torch.Tensor], postscale: float, stages: list[tuple[int, int]]) -> None:
        """Per block its view, and its collective and the block it follows (Note [Two-stage blocks])."""
        ...

    def start(self, block: int, channel: int) -> Any:
        """Start ``block``'s collective on ``channel``; a handle for ``wait``."""
        ...

    def wait(self, block: int, handle: Any) -> None:
        """Wait for ``block``'s collective (on the completer thread)."""
        ...

    def finish(self, block: int) -> None:
        """What is left to do to ``block`` once its collective is done (an all-gather's copy, the postscale)."""
        ...

    def describe(self, block: int) -> str:
        """``block`` as an error message names it."""
        ...

    def allreduce(self, tensor: torch.Tensor, timeout_s: float) -> None:
        """A blocking all-reduce in place, for the profiler's sweep."""
        ...

    def barrier(self, timeout_s: float) -> None:
        ...

    def reduce_scatter(self, tensor: torch.Tensor, timeout_s: float) -> None:
        ...

    def all_gather(self, tensor: torch.Tensor, timeout_s: float) -> None:
        ...

    def start_tally(self, counts: torch.Tensor) -> None:
        """Start a small sum beside the blocks (polled with ``tally_done``)."""
        ...

    def tally_done(self) -> bool:
        """Whether no tally is in flight."""
        ...

    def exchange_rows(self, ids: torch.Tensor, values: torch.Tensor, flag: bool,
                      timeout_s: float) -> tuple[list, bool]:
        ...

    def allreduce_side(self, tensor: torch.Tensor, timeout_s: float) -> None:
        ...

    def close(self) -> None:
        ...

    def abandon(self, at_exit: bool) -> None:
        """A collective will never finish: make the process able to exit anyway."""
        ...
