"""Blocks per second through the C++ scheduler alone (``_C.Engine.noop``).

The noop backend completes every block inside its launch, so what is timed
is the scheduler's own cost: events, heap, release groups, window checks,
launch bookkeeping, completion bookkeeping. The target is at least a
million blocks per second, so that even a plan of tiny blocks costs the
training step well under a millisecond per thousand blocks.

    .venv/bin/python -m benchmarks.core_dispatch [--repeats 7] [--out result.json]

Two cases, both with windows of 8 at every event and in phase 2:

* ``one-tensor``: one tensor of ``--blocks`` blocks; its event releases 8,
  the flush releases the rest in groups of 8.
* ``many-tensors``: ``--tensors`` tensors of ``--blocks-per-tensor`` blocks,
  ``mark_ready`` called from Python for each in ready order (each call
  releases 8 more blocks), then the flush.

Timed per repeat: from just after ``start_iteration()`` to the return of
``wait_all()``; ``set_plan`` is not timed. One untimed warm-up iteration,
then ``--repeats`` timed ones; the median rate is reported with min and max.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

from benchmarks.report import hardware, versions
from benchmarks.stats import summarize
from dcredit_opt import _ext
from dcredit_opt.files import write_whole

ALL = -1


def install(engine, tensors: int, blocks_per_tensor: int, window: int, channels: int) -> int:
    """A plan of ``tensors`` x ``blocks_per_tensor`` one-element blocks; returns the block count."""
    B = tensors * blocks_per_tensor
    # Ready order = forward order, so block ids follow the layout (plan.py).
    block_tensors = [[t] for t in range(tensors) for _ in range(blocks_per_tensor)]
    priorities = [t for t in range(tensors) for _ in range(blocks_per_tensor)]
    engine.set_plan(tensors, list(range(tensors)), [0] * B, list(range(B)), [1] * B, [4] * B, priorities,
                    block_tensors, [window] * tensors, [window], 0, channels, [], 1.0)
    return B


def one_iteration(engine, tensors: int) -> float:
    engine.start_iteration()
    start = time.perf_counter()
    for t in range(tensors):
        engine.mark_ready(t)
    engine.flush()
    engine.wait_all(600.0)
    return time.perf_counter() - start


def run_case(C, name: str, tensors: int, blocks_per_tensor: int, window: int, channels: int, repeats: int,
             warmup: int) -> dict:
    engine = C.Engine.noop(600.0)
    try:
        blocks = install(engine, tensors, blocks_per_tensor, window, channels)
        for _ in range(warmup):
            one_iteration(engine, tensors)
        times = [one_iteration(engine, tensors) for _ in range(repeats)]
        # Every block really went through: launch numbers 0..B-1, all ended.
        trace = engine.trace()
        assert sorted(tr[4] for tr in trace) == list(range(blocks)) and all(tr[7] > 0 for tr in trace)
    finally:
        engine.shutdown()
    s = summarize(times)
    return {
        "case": name, "tensors": tensors, "blocks_per_tensor": blocks_per_tensor, "blocks": blocks,
        "window": window, "channels": channels, "repeats": repeats, "warmup": warmup, "times_s": times,
        "median_blocks_per_s": blocks / s.median_s, "min_blocks_per_s": blocks / s.max_s,
        "max_blocks_per_s": blocks / s.min_s,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=1_000_000, help="blocks of the one-tensor case")
    p.add_argument("--tensors", type=int, default=10_000, help="tensors of the many-tensors case")
    p.add_argument("--blocks-per-tensor", type=int, default=100, help="blocks per tensor, many-tensors case")
    p.add_argument("--window", type=int, default=8, help="release window at every event and in phase 2")
    p.add_argument("--channels", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--cases", default="one-tensor,many-tensors")
    p.add_argument("--out", type=Path, default=None, help="also write the full record here (JSON)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.window == 0 or args.window < ALL:
        p.error("--repeats must be >= 1, --warmup >= 0, --window > 0 or -1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    C = _ext.load()
    record = {
        "benchmark": "core_dispatch",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hardware": hardware(),
        "versions": versions(),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "results": [],
    }
    v, h = record["versions"], record["hardware"]
    print(f"# core_dispatch: python {v['python']}, torch {v['torch']}, dcredit_opt {v['dcredit_opt']}, "
          f"git {(v['git_commit'] or '?')[:12]}{' (dirty)' if v['git_dirty'] else ''}; "
          f"{h['cpu_model']}, {h['usable_cores']} usable cores")
    print(f"# config: {json.dumps(record['config'], sort_keys=True)}")
    shapes = {"one-tensor": (1, args.blocks), "many-tensors": (args.tensors, args.blocks_per_tensor)}
    for name in args.cases.split(","):
        if name not in shapes:
            raise SystemExit(f"unknown case {name!r}; known: {', '.join(shapes)}")
        r = run_case(C, name, *shapes[name], args.window, args.channels, args.repeats, args.warmup)
        record["results"].append(r)
        print(f"{name}: {r['median_blocks_per_s'] / 1e6:.2f} M blocks/s median "
              f"(min {r['min_blocks_per_s'] / 1e6:.2f}, max {r['max_blocks_per_s'] / 1e6:.2f}; "
              f"{r['blocks']} blocks = {r['tensors']} tensors x {r['blocks_per_tensor']}, window {r['window']}, "
              f"{r['repeats']} repeats; {1e9 / r['median_blocks_per_s']:.0f} ns/block)", flush=True)
    if args.out is not None:
        write_whole(args.out, json.dumps(record, indent=2) + "\n")
        print(f"# wrote {args.out}")
    return record


if __name__ == "__main__":
    main()
