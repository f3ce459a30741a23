"""Chrome/Perfetto trace files (chrome://tracing, ui.perfetto.dev) of what the scheduler did.

One process per rank, one track per channel: a block is a slice from its
launch to its completion, named by its tensors, with its window and release
group in ``args``; gradient-ready events are instants on a "backward" track.
The simulator writes the same shape (``planner.simulate``), so a measured
and a simulated iteration can be opened side by side.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence


def block_events(rows: Iterable[Sequence[int]], names: Sequence[str], block_tensors: Sequence[Sequence[int]],
                 ready_ns: Sequence[int], pid: int, origin_ns: int, iteration: int) -> list[dict]:
    """Events for one iteration of the runtime; ``rows`` are ``Engine.trace()`` tuples."""
    events = []
    for block, channel, window, group, seq, release_ns, launch_ns, end_ns in rows:
        if launch_ns == 0 or end_ns == 0:
            continue
        tensors = block_tensors[block]
        label = names[tensors[0]] + (f" (+{len(tensors) - 1})" if len(tensors) > 1 else "")
        events.append({"name": f"block {block}: {label}", "ph": "X", "pid": pid, "tid": f"channel {channel}",
                       "ts": (launch_ns - origin_ns) / 1e3, "dur": (end_ns - launch_ns) / 1e3,
                       "args": {"iteration": iteration, "window": window, "group": group, "launch": seq,
                                "queued_us": (launch_ns - release_ns) / 1e3}})
    for t, ns in enumerate(ready_ns):
        if ns:
            events.append({"name": f"ready {names[t]}", "ph": "i", "s": "t", "pid": pid, "tid": "backward",
                           "ts": (ns - origin_ns) / 1e3, "args": {"iteration": iteration, "tensor": t}})
    return events


def write(path: str, events: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
