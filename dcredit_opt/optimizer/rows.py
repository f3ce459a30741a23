"""Embedding gradients reduced as the rows a batch touched, not as a dense tensor.

Note [Embedding rows]
---------------------
An ``nn.Embedding`` of V rows looks up only the rows of the batch's tokens,
so its weight's gradient is zero outside those rows (384 of 16,384 in the
GPT-like benchmark model), yet a dense all-reduce sends all V rows. Worse,
the embedding is the first layer: its gradient is final only when the
backward ends, and the next forward needs its update first, so that whole
transfer sits between two iterations, where nothing overlaps it. When the
weight is tied to the output layer (GPT-2 and most language models), the
output layer's share is ready at the start of the backward, but the leaf's
gradient, the sum of both, only at the end.

The sum of all-reduces is the all-reduce of the sum, so a weight ``W`` that
an embedding reads is reduced in two parts:

- The embedding's own contribution. While the forward runs, each embedding
  module that reads ``W`` looks its rows up in a stand-in: a leaf
  ``W.detach().requires_grad_()`` sharing ``W``'s memory (swapped into the
  module's ``weight`` for its forward and swapped back after). Its gradient,
  the embedding's contribution alone, ends up in the stand-in's ``.grad``.
  At ``step()`` every rank sends its nonzero rows (indices and values) to
  every other (an all-gather on the optimizer's side channel, packed as
  bytes by ``backends/packed_rows.py``), and each rank adds all ranks'
  rows, in rank order, to ``W``'s reduced gradient just before ``W``'s
  update: every rank computes the same sum.
- Everything else (a tied output layer, a regulariser): it reaches ``W``'s
  own gradient, whose accumulation no longer waits for the embedding. A
  tied weight keeps its blocks, now ready when the output layer's backward
  ends. A weight only embeddings read (seen while learning where
  parameters are first read, Note [First read]) has no blocks at all; if
  some iteration reads it otherwise after all, that part is all-reduced
  densely at ``step()``, on the same side channel (correct, not overlapped).

Which weights take this path is agreed by every rank together: each rank
proposes what it saw while learning, the proposal travels in the
per-iteration tally (Note [Global usage] in ``usage.py``), and the
rows start, on every rank, at the ``step()`` after the one whose tally first
shows every rank agreeing. That ``step()`` is eager, so that the plan
without the rows-only weights' blocks replaces the old one with nothing in
flight. The result equals synchronous training up to the order of a float
sum: the rows are added to the reduced rest instead of to each rank's
gradient before reducing. Every backend exchanges the rows on its side
channel (a Gloo group, an MPI communicator, Horovod names); with one rank,
with ``backward_passes_per_step`` above 1, for a weight in a Horovod group,
or with ``Config(embedding_rows=False)``, embeddings reduce densely.
A weight only embeddings read gets no gradient of its own, yet after
``backward()`` plain torch shows it one (``clip_grad_norm_`` and any loop
over ``p.grad`` read it): when its stand-in's gradient comes, its ``p.grad``
becomes the watched alias of its slot, zeroed (``Backward.rows_arrived``),
and a read of it starts the flush and waits for the rows, as a read of any
gradient waits for its reduction; set to None after ``backward()``, it is
dropped, no update, as any other gradient (Note [Replaced gradients]).
``nn.Embedding(max_norm=...)`` renormalises in place the rows each rank's
batch looks up, so the ranks' weights would drift apart: refused at the
first ``step()`` with more than one rank (``Stepper._refuse_renorm``).
A sparse gradient (``nn.Embedding(sparse=True)``) takes this path with no
stand-in, on every backend and whatever those settings: its rows are
``p.grad`` itself (Note [Sparse gradients] in ``sparse.py``).
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import DCreditError
from ..planner.plan import Plan

ROWS_ONLY = 2  # only embeddings read it: no blocks
TIED = 1  # read otherwise too: blocks for the rest, rows for the embeddings


class EmbeddingRows:
    """One weight's embedding contribution, captured through a stand-in in its embeddings' forwards."""

    def __init__(self, index: int, param: torch.Tensor, name: str, modules: list, kind: int, on_grad):
        self.index = index
        self.param = param
        self.name = name
        self.kind = kind
        self._on_grad = on_grad  # on_grad(index) when the stand-in's gradient is accumulated (opens the iteration)
        self.stand_in: torch.Tensor | None = None
        self.ids: list[torch.Tensor] | None = []  # token ids of this iteration's lookups; None: some unknown
        self.gathered: list | None = None  # after the exchange: every rank's (indices, rows), in rank order
        self.hooks = []
        # Hidden from Dynamo, like every hook of ours (Note [Compiled models] in lazy.py): run eagerly.
        swap_in = _RowsHook(torch.compiler.disable(self._swap_in))
        swap_out = _RowsHook(torch.compiler.disable(self._swap_out))
        for module in modules:
            self.hooks.append(module.register_forward_pre_hook(swap_in))
            self.hooks.append(module.register_forward_hook(swap_out, always_call=True))

    def _swap_in(self, module, args) -> None:
        if not torch.is_grad_enabled() or module._parameters.get("weight") is not self.param:
            return  # evaluation, or a module whose weight was replaced: W is read as it is
        if self.stand_in is None:
            self.stand_in = self.param.detach().requires_grad_()
            self.stand_in.register_hook(self._before_accumulate)
            self.stand_in.register_post_accumulate_grad_hook(lambda _: self._on_grad(self.index))
        module._parameters["weight"] = self.stand_in
        if self.ids is not None:
            if args and isinstance(args[0], torch.Tensor):
                self.ids.append(args[0].detach().reshape(-1))
            else:
                self.ids = None  # the ids came some other way: the rows are found from the gradient

    def _before_accumulate(self, grad):
        """A second backward into this iteration's lookups: refused, as for any gradient (one pass per step)."""
        if self.stand_in is not None and self.stand_in.grad is not None:
            raise DCreditError(
                f"the embedding rows of parameter '{self.name}' got a gradient from a second backward before "
                "step() (backward_passes_per_step=1). Call step() after every backward pass, or pass "
                "backward_passes_per_step=N to DistributedOptimizer")
        return grad

    def _swap_out(self, module, args, output) -> None:
        if self.stand_in is not None and module._parameters.get("weight") is self.stand_in:
            module._parameters["weight"] = self.param

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's nonzero rows of this iteration, as (indices, rows), and start the next iteration."""
        stand_in, ids = self.stand_in, self.ids
        self.stand_in, self.ids = None, []
        dim = self.param.shape[1:]
        grad = None if stand_in is None else stand_in.grad
        if grad is None:
            return (torch.zeros(0, dtype=torch.int64, device=self.param.device),
                    torch.zeros((0, *dim), dtype=self.param.dtype, device=self.param.device))
        if grad.is_sparse:
            grad = grad.coalesce()
            return grad.indices()[0], grad.values()
        if ids:
            rows = torch.unique(torch.cat(ids))
        else:
            rows = grad.reshape(grad.shape[0], -1).ne(0).any(dim=1).nonzero().reshape(-1)
        return rows, grad.index_select(0, rows)

    def add_to(self, slot: torch.Tensor, scale: float) -> None:
        """Add every rank's rows, in rank order, times ``scale``, to ``slot`` (the reduced rest of the gradient)."""
        gathered, self.gathered = self.gathered, None
        for rows, values in gathered or ():
            if rows.numel():
                slot.index_add_(0, rows, values, alpha=scale)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


class _RowsHook:
    """A forward hook of an embedding on the rows path. The model may be pickled whole or deep-copied
    while it carries one (Note [Pickled hooks] in lazy.py): the copy gets a hook that does nothing."""

    __slots__ = ("_run",)

    def __init__(self, run):
        self._run = run

    def __call__(self, *args):
        return self._run(*args)

    def __reduce__(self):
        return _NoRowsHook, ()


class _NoRowsHook:
    """What a copied model carries in place of a :class:`_RowsHook`."""

    __slots__ = ()

    def __call__(self, *args):
        return None

    def __reduce__(self):
        return _NoRowsHook, ()


def without_tensors(plan: Plan, gone) -> Plan:
    """``plan`` with no blocks for the tensors ``gone`` (their ``numels`` 0); a merge they were in is cut
    around them (a part of one tensor stays as that tensor's single block)."""
    gone = set(gone)
    if not gone:
        return plan
    numels = tuple(0 if t in gone else n for t, n in enumerate(plan.numels))
    partition = tuple(() if t in gone else sizes for t, sizes in enumerate(plan.partition))
    merges = []
    for run in plan.merges:
        part: list = []
        for t in (*run, None):
            if t is None or t in gone:
                if len(part) >= 2:
                    merges.append(tuple(part))
                part = []
            else:
                part.append(t)
    return dataclasses.replace(plan, numels=numels, partition=partition, merges=tuple(merges))
