"""Embedding rows as bytes: what a backend's all-gather carries for Note [Embedding rows] (``rows.py``)."""

from __future__ import annotations

import math

import torch


def row_bytes(values: torch.Tensor) -> int:
    """Bytes of one row of ``values`` (rows along dimension 0)."""
    return math.prod(values.shape[1:]) * values.element_size()


def pack(ids: torch.Tensor, values: torch.Tensor, capacity: int) -> torch.Tensor:
    """``ids`` (int64) and their rows as one CPU byte tensor with room for ``capacity`` rows: the ids first
    (``capacity * 8`` bytes), then the rows. What a backend's all-gather carries for the exchange."""
    width = row_bytes(values)
    out = torch.zeros(capacity * (8 + width), dtype=torch.uint8)
    n = ids.numel()
    if n:
        out[:n * 8] = ids.to(torch.int64).cpu().view(torch.uint8)
        out[capacity * 8:capacity * 8 + n * width] = values.detach().cpu().contiguous().view(-1).view(torch.uint8)
    return out


def unpack(buf: torch.Tensor, count: int, capacity: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``count`` ids and rows that ``pack(..., capacity)`` put in ``buf``, on ``like``'s device and dtype."""
    width = row_bytes(like)
    # Copied out: ``buf`` may be one rank's part of a concatenation, at an offset no wider dtype can view.
    ids = buf[:count * 8].clone().view(torch.int64)
    rows = buf[capacity * 8:capacity * 8 + count * width].clone().view(like.dtype).reshape(count, *like.shape[1:])
    return ids.to(like.device), rows.to(like.device)
