"""Gradient compression on the wire: Horovod's ``Compression.none`` and ``Compression.fp16``.

``DistributedOptimizer(..., compression=...)`` takes these classes, or
Horovod's own (``hvd.Compression.none``, ``hvd.Compression.fp16``): a script
that passes Horovod's keeps working unchanged. dcredit_opt does not call
``compress``/``decompress`` per tensor: it reduces blocks of a flat buffer,
so a compression is a *wire dtype* (Note [Wire dtype]). The classes keep
Horovod's two static methods so that code calling them directly still works.

Note [Wire dtype]
-----------------
Every block travels in its wire dtype: its buffer's dtype, unless

- ``Compression.fp16`` is on and the block is float32 or float64: float16
  (half the bytes; the 16-bit kinds travel as they are: turning bfloat16
  into float16 would trade its range for nothing);
- the backend cannot reduce the buffer's dtype (Horovod's and MPI's CPU
  collectives have no bfloat16, MPI none of the 16-bit floats): float32,
  so that such gradients still work, with a sum that is more precise, not
  less.

A block whose wire dtype differs is cast into a wire tensor when it
launches, reduced, and cast back into its slot when it completes; the
post-scale (averaging) is applied after the cast back, in the buffer's own
dtype, as for an uncompressed block.
"""

from __future__ import annotations

import sys

import torch


class Compressor:
    """Horovod's compressor interface: compress one tensor for the wire, and back."""

    wire_dtype: torch.dtype | None = None  # None: the gradient's own dtype

    @staticmethod
    def compress(tensor: torch.Tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx):
        return tensor


class NoneCompressor(Compressor):
    """No compression: blocks travel in their own dtype."""


class FP16Compressor(Compressor):
    """float32/float64 gradients travel as float16."""

    wire_dtype = torch.float16

    @staticmethod
    def compress(tensor: torch.Tensor):
        if tensor.dtype in (torch.float32, torch.float64):
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """The compressions ``DistributedOptimizer`` takes (Horovod's names)."""

    none = NoneCompressor
    fp16 = FP16Compressor


def wire_dtype_of(compression) -> torch.dtype | None:
    """The wire dtype ``compression`` asks for (None: no compression); refuses what we cannot honour."""
    if compression is None or compression is NoneCompressor:
        return None
    if compression is FP16Compressor:
        return torch.float16
    horovod = sys.modules.get("horovod.torch.compression")  # only a script that imported Horovod can pass its own
    if horovod is not None:
        if compression is getattr(horovod, "NoneCompressor", None):
            return None
        if compression is getattr(horovod, "FP16Compressor", None):
            return torch.float16
    raise NotImplementedError(
        f"compression={compression!r} is not supported: dcredit_opt reduces gradients in blocks of a flat buffer "
        "and supports Compression.none and Compression.fp16 (dcredit_opt's or Horovod's); pass one of those")


def block_wire_dtype(dtype: torch.dtype, compression: torch.dtype | None, backend_dtypes) -> torch.dtype:
    """The dtype a block of ``dtype`` travels in (Note [Wire dtype]); ``backend_dtypes`` are those the
    backend can reduce (None: any)."""
    wire = dtype
    if compression is not None and dtype in (torch.float32, torch.float64):
        wire = compression
    if backend_dtypes is not None and wire not in backend_dtypes:
        wire = torch.float32 if wire.is_floating_point else wire
    return wire
