"""Adasum: how several ranks' vectors combine into one (Horovod's ``op=hvd.Adasum``), as a pure function.

Below both the optimizer (``op=Adasum``: the ranks' parameter changes are
combined, ``optimizer/adasum.py``) and the collectives
(``allreduce(op=Adasum)``, ``collectives/adasum.py``). No processes here.

Note [Adasum]
-------------
Two vectors ``a`` and ``b`` (one tensor's values on two ranks) combine as

    a' = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

with a coefficient of 1 where that vector's squared norm is below
``sqrt(DBL_MIN)`` (a zero vector adds nothing and takes nothing away).
Orthogonal vectors add; equal ones give the vector itself; in general the
part of one along the other is counted once, not twice. Dot products and
norms are per tensor, never over the whole model.

Many ranks combine over a binary tree of their positions (0..n-1, the
process set's order): at each level, positions 2k and 2k+1 of the level
below combine (the lower position is ``a``), and a last one without a
partner moves up unchanged. For a power of two this is exactly Horovod's
pairing (its vector-halving, distance-doubling rounds: rank r with
r ^ level, the lower half as ``a``). Horovod refuses other sizes
(NotImplementedError); here they take the same rule, which is the tree whose
left part is always the largest power of two below the count: 3 ranks give
adasum(adasum(0, 1), 2).

Every rank evaluates the same tree on the same gathered values, with the
same operations in the same order, so every rank gets the same bits
(Note [Same bits on every rank]). Horovod rounds to the tensor's dtype
after every level and sums its dot products in a rank-dependent order; here
the tree runs in float64 and the result is rounded once, so the two agree to
the dtype's rounding, not bitwise.

Note [Same bits on every rank]
------------------------------
Element-wise operations give the same bits whatever the thread count or the
vector width (each element is one correctly rounded operation; we never ask
for a fused multiply-add, e.g. no ``add(..., alpha=)``). A library reduction
(``sum``, ``dot``) may split its work by thread count, and ranks of one job
may run different thread counts. So the dot products and norms are summed
by halving: ``x[:h] + x[h:2h]`` until one element is left, a fixed pairwise
order, element-wise all the way.
"""

from __future__ import annotations

import sys

import torch

ADASUM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""What Adasum combines: floating-point tensors (Horovod: float16, float32, float64)."""

_TINY = sys.float_info.min ** 0.5  # Horovod's guard: a squared norm below sqrt(DBL_MIN) counts as zero


def pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """The sums of ``x`` along its last dimension, in a fixed pairwise order, element-wise only
    (Note [Same bits on every rank]); the last dimension is kept, with length 1."""
    n = x.shape[-1]
    if n == 0:
        return x.new_zeros((*x.shape[:-1], 1))
    while n > 1:
        h = n // 2
        y = x[..., :h] + x[..., h:2 * h]
        if n % 2:
            y[..., h - 1:h] += x[..., 2 * h:]
        x, n = y, h
    return x


def combine_pairs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row i of ``a`` with row i of ``b`` (float64, shape (pairs, numel)), each pair as Note [Adasum] says."""
    products = torch.stack((a * b, a * a, b * b), dim=1)  # (pairs, 3, numel)
    sums = pairwise_sum(products)[..., 0]  # (pairs, 3): a.b, |a|^2, |b|^2
    dot, anormsq, bnormsq = sums[:, 0:1], sums[:, 1:2], sums[:, 2:3]
    one = torch.ones_like(dot)
    # Horovod's expression, term for term: 1 - dot / normsq * 0.5 (the norm clamped only where it is not used).
    acoeff = torch.where(anormsq >= _TINY, one - dot / anormsq.clamp(min=_TINY) * 0.5, one)
    bcoeff = torch.where(bnormsq >= _TINY, one - dot / bnormsq.clamp(min=_TINY) * 0.5, one)
    return a * acoeff + b * bcoeff


def adasum_rows(rows: torch.Tensor) -> torch.Tensor:
    """Every rank's values of one tensor, ``rows`` (shape (ranks, numel), in the ranks' order), combined
    over the tree of Note [Adasum]: a float64 vector of length numel."""
    level = rows.to(torch.float64)
    while level.shape[0] > 1:
        pairs = level.shape[0] // 2
        merged = combine_pairs(level[0:2 * pairs:2], level[1:2 * pairs:2])
        level = torch.cat((merged, level[2 * pairs:])) if level.shape[0] % 2 else merged
    return level[0]


def adasum(tensors) -> torch.Tensor:
    """The Adasum of same-shaped tensors (one per rank, in the ranks' order), in their dtype and shape."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("adasum: no tensors to combine")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ValueError(f"adasum: tensor {i} has shape {tuple(t.shape)} and dtype {t.dtype}, tensor 0 "
                             f"{tuple(first.shape)} and {first.dtype}: they must be the same")
    if first.dtype not in ADASUM_DTYPES:
        raise TypeError(f"adasum: dtype {first.dtype} cannot be combined: Adasum takes floating-point tensors "
                        "(float16, bfloat16, float32, float64)")
    rows = torch.stack([t.detach().reshape(-1) for t in tensors])
    return adasum_rows(rows).to(first.dtype).reshape(first.shape)


# ---- the gathered bytes ------------------------------------------------------------------------
# Each rank sends its tensors as one flat byte buffer (exact for every dtype, one collective); every tensor
# starts on an 8-byte boundary, so each one's bytes view as its dtype.

_ALIGN = 8


def packed_sizes(tensors) -> list[tuple[int, int]]:
    """(offset, bytes) of each tensor in the buffer ``pack`` makes."""
    out, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        out.append((offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return out


def pack(tensors, device=None) -> torch.Tensor:
    """``tensors`` (any dtypes and shapes) as one flat uint8 buffer, laid out by ``packed_sizes``."""
    tensors = list(tensors)
    sizes = packed_sizes(tensors)
    total = sizes[-1][0] + -(-sizes[-1][1] // _ALIGN) * _ALIGN if sizes else 0
    device = device if device is not None else (tensors[0].device if tensors else "cpu")
    buf = torch.zeros(total, dtype=torch.uint8, device=device)
    for t, (offset, nbytes) in zip(tensors, sizes):
        if nbytes:
            buf[offset:offset + nbytes] = t.detach().contiguous().reshape(-1).view(torch.uint8).to(device)
    return buf


def unpack_rows(rows, like) -> list[torch.Tensor]:
    """Every rank's buffer (``rows``: a list of uint8 buffers, or a (ranks, bytes) tensor, as ``pack`` made them
    from tensors ``like``): for each tensor of ``like``, a (ranks, numel) tensor of its dtype. One tensor's rows
    are copied at a time, never the whole gathered model again."""
    out = []
    for t, (offset, nbytes) in zip(like, packed_sizes(like)):
        if not nbytes:
            out.append(torch.empty((len(rows), 0), dtype=t.dtype, device=rows[0].device))
            continue
        mine = torch.stack([row[offset:offset + nbytes] for row in rows])
        out.append(mine.view(t.dtype).reshape(len(rows), t.numel()))
    return out
