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


class RankTimeline:
    """One rank's trace file, rewritten after every iteration so that it is whole whenever the job stops.

    ``path`` is ``Config.timeline_path``: a ``{rank}`` in it is replaced by
    the rank; otherwise, with more than one rank, ``.rank<r>.json`` is
    appended. Recording stops at ``max_events``, which any viewer can still
    open, so that long jobs keep their memory bounded.
    """

    def __init__(self, path: str, rank: int, size: int, max_events: int = 200_000):
        if "{rank}" in path:
            path = path.replace("{rank}", str(rank))
        elif size > 1:
            path = f"{path}.rank{rank}.json"
        self.path = path
        self.rank = rank
        self.max_events = max_events
        self.events: list[dict] = []
        self.origin_ns: int | None = None

    def record(self, rows: Sequence[Sequence[int]], ready_ns: Sequence[int], names: Sequence[str],
               block_tensors: Sequence[Sequence[int]], iteration: int) -> None:
        """Add one iteration (``Engine.trace()`` rows and ready times) and rewrite the file."""
        if len(self.events) > self.max_events:
            return
        stamps = [r[6] for r in rows if r[6]] + [t for t in ready_ns if t]
        if not stamps:
            return
        if self.origin_ns is None:
            self.origin_ns = min(stamps)
        self.events.extend(block_events(rows, names, block_tensors, ready_ns, self.rank, self.origin_ns, iteration))
        write(self.path, self.events)
