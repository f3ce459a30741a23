"""Delayed updates at run time (DeFT, Note [Delayed updates] in ``planner/deft.py``).

A delayed tensor has no blocks. At each flush, :meth:`DelayedGradients.swap`
waits for the background sum started at the previous flush, copies this
step's local gradients out, and writes the previous step's sum (averaged as
the blocks are) into the tensors' gradient slots, where the update finds it
as it finds any reduced gradient; at the first flush there is no previous
sum and the slots are zeroed. :meth:`start` then sums this step's gradients
in the background on the side channel, queued after the step's tally, so
that the tally never waits behind it. Two flat CPU buffers alternate: one
in flight, one being filled.
"""

from __future__ import annotations

import functools

import torch


class DelayedGradients:
    def __init__(self, indices, slots) -> None:
        self.indices = tuple(indices)
        self.numels = [slots[i].numel() for i in self.indices]
        dtype = functools.reduce(torch.promote_types, [slots[i].dtype for i in self.indices])
        total = sum(self.numels)
        self._flats = [torch.zeros(total, dtype=dtype), torch.zeros(total, dtype=dtype)]
        self._next = 0  # the buffer the next swap fills
        self._started = False  # a sum is in flight (or done, not yet waited for) in the other buffer
        self._filled = False  # swap() filled _flats[_next]; start() sends it

    def swap(self, slots, scale: float, backend, timeout_s: float) -> None:
        """The previous step's sum into the slots (zeros at the first step), this step's gradients out."""
        previous = None
        if self._started:
            backend.wait_delayed(timeout_s)
            previous = self._flats[1 - self._next]
            self._started = False
        out = self._flats[self._next]
        offset = 0
        for i, n in zip(self.indices, self.numels):
            slot = slots[i]
            out[offset:offset + n].copy_(slot.reshape(-1))
            if previous is None:
                slot.zero_()
            else:
                slot.copy_(previous[offset:offset + n].view(slot.shape))
                if scale != 1.0:
                    slot.mul_(scale)
            offset += n
        self._filled = True

    def start(self, backend) -> None:
        """Sum what :meth:`swap` copied out over ranks, in the background."""
        if not self._filled:
            return
        backend.start_delayed(self._flats[self._next])
        self._filled = False
        self._started = True
        self._next = 1 - self._next

    def drain(self, backend, timeout_s: float) -> None:
        """Wait for the sum in flight (before a plan switch or closing); its result is not applied."""
        if self._started:
            backend.wait_delayed(timeout_s)
            self._started = False
