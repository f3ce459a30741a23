"""Which gradients exist where, and the embedding rows agreed on through the same tally.

Note [Global usage]
-------------------
A parameter unused on this rank (its gradient is ``None`` when phase 1
ends) contributes zeros to the all-reduce, as Horovod does: every rank must
launch the same blocks. If no rank used it, synchronous training (one
process, or DDP) leaves its gradient ``None`` and the optimizer skips it:
no momentum, no weight decay, no Adam step. Giving it the reduced zeros
instead would move it (Horovod's behaviour, a silent difference). The
reduced values cannot tell the two apart (a used parameter may have an
exactly zero gradient, and ranks deciding on local evidence would differ),
so each rank also sums, over ranks, a flag per tensor: "had a gradient
here". The tally starts when phase 1 ends, on a channel of its own beside
the blocks, and is waited for only when an update is applied to a tensor
this rank did not use (a tensor used here is used, whatever the others
did). A tensor that no rank used gets ``p.grad = None`` before the wrapped
step, on every rank alike, and keeps it, as under DDP.

The same tally carries each rank's proposal of tensors to reduce as
embedding rows; once every rank proposes the same ones, all take the rows
path together (Note [Embedding rows] in ``rows.py``). :class:`GlobalUsage`
holds methods of the generated optimizer subclass (``optimizer.py``); its
state is set up in ``_DistributedOptimizer._dc_setup``.
"""

from __future__ import annotations

import weakref

import torch

from . import rows, runtime, timeline
from .gradients import clear
from .runtime import at_rank


class GlobalUsage:
    def _dc_exchange_rows(self) -> None:
        """Note [Embedding rows]: every rank's embedding rows to every rank; a rows-only tensor's other
        gradient (if any rank has one this iteration) all-reduced densely."""
        timeout = float(self._dc_config.timeout_s)
        for i, r in self._dc_rows.items():  # built in tensor order on every rank
            ids, values = r.take()
            slot = self._dc_slots[i]
            # W's own gradient, which has no blocks; all zeros (zero_grad(set_to_none=False)) adds nothing.
            rest = r.kind == rows.ROWS_ONLY and self._dc_used[i] and bool(slot.any())
            try:
                r.gathered, rest_anywhere = self._dc_backend.exchange_rows(ids, values, rest, timeout)
                if rest_anywhere:
                    self._dc_tell(f"rows rest {i}", f"dcredit_opt: parameter '{self._dc_names[i]}', reduced as "
                                  "the rows its embeddings looked up, was also read otherwise in this iteration; "
                                  "that part of its gradient is all-reduced whole in step(), without overlap "
                                  "(Note [Embedding rows]). Said once.")
                    self._dc_backend.allreduce_side(slot, timeout)
                    if self._dc_postscale != 1.0:
                        slot.mul_(self._dc_postscale)
            except (RuntimeError, TimeoutError) as e:
                raise at_rank(e, f"end of phase 1, exchanging the embedding rows of '{self._dc_names[i]}'") from e
            self._dc_versions[i] = slot._version
            if ids.numel():
                self._dc_used[i] = True

    def _dc_add_rows(self, indices) -> None:
        """Every rank's embedding rows into the reduced gradients of ``indices`` that have them."""
        scale = self._dc_prescale * self._dc_postscale
        for i in indices:
            r = self._dc_rows.get(i)
            if r is not None and r.gathered is not None:
                slot = self._dc_slots[i]
                r.add_to(slot, scale)
                self._dc_versions[i] = slot._version
    def _dc_start_tally(self) -> None:
        """Note [Global usage]: start summing over ranks which tensors had a gradient on each."""
        proposal = tuple(self._dc_rows_proposal)
        here = bytearray(self._dc_used)
        T = len(here)
        # Built from the bytes and a per-proposal tail, not element by element: this runs every iteration.
        if self._dc_tally_tail is None or self._dc_tally_tail[0] != proposal:
            tail = torch.tensor([*(k > 0 for k in proposal), *(k == rows.ROWS_ONLY for k in proposal)],
                                dtype=torch.int32)
            self._dc_tally_tail = (proposal, tail)
        counts = torch.empty(3 * T, dtype=torch.int32)
        if T:
            counts[:T] = torch.frombuffer(here, dtype=torch.uint8)
        counts[T:] = self._dc_tally_tail[1]
        usage = _Usage(bytes(here), counts)
        if runtime.size() == 1:
            usage.everywhere = usage.here
        else:
            last = self._dc_usage
            try:
                self._dc_backend.wait_tally(float(self._dc_config.timeout_s))  # the last one, if nothing needed it
                if last is not None and not self._dc_rows_agreed:
                    self._dc_agree_on_rows(last.counts.tolist())
                self._dc_backend.start_tally(counts)
            except (RuntimeError, TimeoutError) as e:
                raise at_rank(e, "end of phase 1, summing which gradients each rank computed") from e
        self._dc_usage = usage
        clear(self._dc_used)

    def _dc_unused_everywhere(self, indices) -> list:
        """Of tensors ``indices``, those no rank computed a gradient for in the iteration being applied."""
        usage = self._dc_usage
        if usage is None:
            return []
        maybe = [i for i in indices if not usage.here[i]]
        if not maybe:
            return []
        if usage.everywhere is None:
            try:
                with timeline.profiled("dcredit_opt::wait"):
                    self._dc_backend.wait_tally(float(self._dc_config.timeout_s))
            except (RuntimeError, TimeoutError) as e:
                raise at_rank(e, f"phase 2, waiting to learn whether any rank computed a gradient of "
                                 f"'{self._dc_names[maybe[0]]}' (tensor {maybe[0]})") from e
            usage.everywhere = [bool(c) for c in usage.counts[:len(usage.here)].tolist()]
        return [i for i in maybe if not usage.everywhere[i]]

    def _dc_agree_on_rows(self, sums: list) -> None:
        """Note [Embedding rows]: once the last tally shows every rank proposing the same tensors, they
        take the rows path from the next iteration on, on every rank (all saw the same sums)."""
        T, world = len(self._dc_params), runtime.size()
        agreed = [i for i in range(T) if sums[T + i] == world]
        if not agreed:
            return
        self._dc_rows_agreed = True
        me = weakref.ref(self)
        for i in agreed:
            kind = rows.ROWS_ONLY if sums[2 * T + i] == world else rows.TIED
            modules = [m for m in (ref() for ref in self._dc_rows_modules.get(i, ())) if m is not None]
            self._dc_rows[i] = rows.EmbeddingRows(i, self._dc_params[i], self._dc_names[i], modules, kind,
                                                  _weak_rows_hook(me))
        if self._dc_rows_only():
            self._dc_staged_plan = self._dc_staged_plan or self._dc_plan  # rebuilt without their blocks
            self._dc_replan = True
        names = ", ".join(f"'{self._dc_names[i]}'" for i in agreed)
        self._dc_tell("rows", f"dcredit_opt: {names} reduced as the embedding rows each batch looks up, not "
                              "as a dense tensor (Note [Embedding rows]; Config(embedding_rows=False) turns it off)")

    def _dc_drop_unused_grads(self, indices) -> list:
        """``p.grad = None`` for the tensors of ``indices`` no rank used (Note [Global usage]); returns them."""
        unused = self._dc_unused_everywhere(indices)
        for i in unused:
            p = self._dc_params[i]
            if p.grad is self._dc_watched[i] or p.grad is self._dc_slots[i]:  # not one the user assigned
                p.grad = None
        return unused


class _Usage:
    """One iteration's Note [Global usage]: per tensor, whether it had a gradient here, the counts being
    summed over ranks, and, once that sum is known, whether it had one anywhere."""

    __slots__ = ("counts", "everywhere", "here")

    def __init__(self, here: list, counts: torch.Tensor):
        self.here = here
        self.counts = counts
        self.everywhere = None


def _weak_rows_hook(ref):
    def hook():
        opt = ref()
        if opt is not None and not opt._dc_open:
            opt._dc_begin()  # an iteration whose only gradients are embedding rows
    return hook
