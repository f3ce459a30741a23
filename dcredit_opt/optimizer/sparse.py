"""Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``) reduced as rows.

Note [Sparse gradients]
-----------------------
A sparse gradient is exactly what Note [Embedding rows] (``rows.py``)
exchanges: row indices and those rows. So a parameter whose gradient comes
sparse (``sparse_as_dense=False``, the default) takes that path with no
stand-in: its rows are this rank's ``p.grad`` itself, coalesced, taken when
its hook fires (after the last of ``backward_passes_per_step`` passes, so
several passes simply accumulate in ``p.grad`` as in plain torch). At the
flush every rank sends its rows to every other (the same all-gather, the
same side channel, every backend), each rank adds all ranks' rows in rank
order, times the average's scale, to a slot of its own, and the wrapped step
gets the coalesced sparse tensor of those rows at the union of the indices
every rank's gradient held (not only the rows whose sum is nonzero:
``SparseAdam`` moves its moments at every index it is given, as it does for
synchronous training on the global batch).

Which parameters take this path is agreed once, at the first flush: every
rank sums, over ranks, a flag per tensor, "came sparse here" (one small
all-reduce on the side channel, in the first iteration only, which is eager
anyway). From then on those tensors have no blocks (a plan without them,
staged as the rows-only weights' is), and every rank exchanges their rows at
every flush, none when it has none (a rank whose batch touched no row, or
that never called the embedding). In the first iteration their blocks still
run, carrying zeros from the ranks whose gradient came sparse.

Plain torch makes a gradient dense once any dense part is added to it (a
weight tied to a dense layer, a regulariser, a dense zero tensor the script
put in ``p.grad``), but keeps a sparse ``p.grad`` sparse when it zeroes it
in place (``zero_grad(set_to_none=False)``) or adds the next gradient to it.
Here ``p.grad`` after ``backward()`` is the dense slot (through its watched
alias), or a dense spare of zeros: so where a sparse gradient is about to be
added to one of ours, ``p.grad`` first becomes the row-sparse form of what
it holds (``Backward._sparse_onto_ours``; the C++ pre-hook calls it where
the incoming gradient is sparse and ``p.grad`` dense), and the sum stays
sparse, as an optimizer whose state is sparse (SGD's momentum) needs.
Where some rank's gradient of such a tensor came dense in an iteration,
the exchange says so, that dense part is
all-reduced whole on the side channel (after the first iteration; in it, by
the blocks), the rows are added to it, and the wrapped step gets the dense
sum, as synchronous training would. A tensor none of whose gradients came
sparse in the first iteration and that gets one later is refused (the ranks
never agreed to exchange it): the error names it and the fix (reach it in
the first iteration, or ``sparse_as_dense=True``). ``p.grad`` read between
``backward()`` and ``step()`` is the averaged gradient in dense form; the
optimizer gets it sparse. The sparse form holds a copy of the slot's rows,
so what writes gradients in place gets the dense slot itself: GradScaler's
unscaling inside ``step()`` (``Stepper.scaled_skip``) unscales the slot,
whose rows the optimizer then takes, and its check for Inf/NaN sees them.
"""

from __future__ import annotations

import torch

from ..errors import DCreditError
from .rows import ROWS_ONLY


def row_sparse(name: str, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``grad`` (sparse) as (row indices, rows), coalesced; refused unless its sparse dimensions are the rows."""
    if grad.layout != torch.sparse_coo or grad.sparse_dim() != 1:
        raise DCreditError(
            f"parameter '{name}' has a sparse gradient of layout {grad.layout} with {grad.sparse_dim()} sparse "
            "dimension(s); dcredit_opt reduces sparse gradients as rows (a sparse COO tensor sparse in its first "
            "dimension only, as nn.Embedding(sparse=True) gives). Pass sparse_as_dense=True to reduce it dense")
    grad = grad.coalesce()
    return grad.indices()[0], grad.values()


class SparseRows:
    """One parameter's sparse gradient on the rows path (Note [Sparse gradients]); the interface of
    :class:`rows.EmbeddingRows` that ``usage.py`` drives."""

    kind = ROWS_ONLY
    stand_in = None  # no stand-in: the rows come in p.grad

    def __init__(self, index: int, param: torch.Tensor, name: str, rows=None, in_blocks: bool = False):
        self.index = index
        self.param = param
        self.name = name
        self.rows = rows  # this iteration's (indices, rows) of this rank, or None
        self.in_blocks = in_blocks  # the agreeing iteration: the tensor still has blocks, they carry the dense part
        self.gathered: list | None = None  # after the exchange: every rank's (indices, rows), in rank order
        self.dense = False  # after the exchange: some rank's gradient came dense, so the sum is dense

    def put(self, grad: torch.Tensor) -> None:
        """This rank's sparse gradient of this iteration."""
        self.rows = row_sparse(self.name, grad)

    def captured(self) -> bool:
        return self.rows is not None

    def take(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """This rank's rows of this iteration (empty if none) and whether it had any, and start the next."""
        got, self.rows = self.rows, None
        if got is not None:
            return got[0], got[1], True
        p = self.param
        return (torch.zeros(0, dtype=torch.int64, device=p.device),
                torch.zeros((0, *p.shape[1:]), dtype=p.dtype, device=p.device), False)

    def add_to(self, slot: torch.Tensor, scale: float):
        """Every rank's rows, in rank order, times ``scale``, into ``slot``; returns the union of their indices
        (sorted), or None when the sum is dense."""
        gathered, self.gathered = self.gathered, None
        ids = []
        for rows, values in gathered or ():
            if rows.numel():
                slot.index_add_(0, rows, values, alpha=scale)
                ids.append(rows)
        if self.dense:
            return None
        if not ids:
            return torch.zeros(0, dtype=torch.int64, device=slot.device)
        if len(ids) == 1:  # one rank's rows (a world of one, or the only rank with any): coalesced, so sorted, unique
            return ids[0]
        return torch.unique(torch.cat(ids))

    def remove(self) -> None:
        pass


def as_sparse(slot: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The reduced gradient in ``slot`` as the coalesced sparse tensor of its rows ``ids`` (sorted, unique)."""
    return torch.sparse_coo_tensor(ids.reshape(1, -1), slot.index_select(0, ids), slot.shape,
                                   is_coalesced=True, check_invariants=False)
