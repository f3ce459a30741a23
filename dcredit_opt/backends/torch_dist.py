"""torch.distributed: blocks all-reduced in C++ on one process group per channel."""

from __future__ import annotations

from .. import _ext, runtime


class TorchDistBackend:
    name = "torch"

    def __init__(self, channels: int, timeout_s: float):
        self.engine = _ext.load().Engine.torch(runtime.channel_groups(channels), float(timeout_s))

    def buffers_for_engine(self, buffers):
        """What ``Engine.set_plan`` gets: the C++ adapter cuts its own block views."""
        return buffers

    def set_blocks(self, buffers, layout, postscale: float) -> None:
        """Nothing to do: the engine already holds the views."""

    def close(self) -> None:
        self.engine.shutdown()
