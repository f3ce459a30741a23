"""How long planning takes.

    .venv/bin/python -m benchmarks.planning_cost [--tensors 1000]

The planner runs once, on rank 0, after the profiling iterations; the
target is under 50 ms for a 1,000-tensor model with D-Credit as the runtime
plans it (``planning.make_plan``: the search of ``planner/search.py`` over
the runtime's block sizes), so that re-planning is cheap. Prints the median
and spread of repeated runs for each policy on a synthetic model-shaped
profile, wall and CPU time (on a shared machine other processes inflate
wall time; planning is single-threaded, so on an idle machine the two
agree); asserts nothing (timings belong to benchmarks, not tests).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

from dcredit_opt.planner.dcredit import dcredit
from dcredit_opt.planner.floors import lower_bound
from dcredit_opt.planner.policies import POLICIES
from dcredit_opt.planner.simulate import simulate
from dcredit_opt.planner.synthetic import model_like_profile
from dcredit_opt.profiling.planning import CHANNEL_FIFO, make_plan


def _time(fn, repeats: int) -> tuple[float, float, float, object]:
    """Median wall time, its spread, and median CPU time of this process.

    CPU time is printed too because on a shared machine other processes
    inflate wall time; planning is single-threaded, so on an idle machine
    the two agree.
    """
    fn()  # warm-up: first-call imports and caches
    wall, cpu, out = [], [], None
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        out = fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), max(wall) - min(wall), statistics.median(cpu), out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--channels", type=int, default=2)
    parser.add_argument("--tune", action="store_true",
                        help="also time bytescheduler and usbyte (tuned over a grid: seconds to a minute)")
    args = parser.parse_args(argv)
    profile = model_like_profile(args.tensors)
    print(f"python {sys.version.split()[0]} on {platform.machine()} ({platform.processor() or 'cpu'}), "
          f"{args.tensors} tensors, {profile.total_bytes / 2**20:.0f} MiB, lower bound "
          f"{lower_bound(profile) * 1e3:.1f} ms; each policy as the runtime plans it (planning.make_plan)")
    print(f"{'policy':<22}{'plan ms (median)':>18}{'spread ms':>11}{'cpu ms':>9}{'blocks':>8}"
          f"{'sim. iteration ms':>19}")
    tuned = ("bytescheduler", "usbyte")
    rows = [(name, lambda n=name: make_plan(profile, n, channels=args.channels)) for name in POLICIES
            if args.tune or name not in tuned]
    rows.append(("dcredit one size", lambda: dcredit(profile, channels=args.channels)))
    for name, fn in rows:
        median, spread, cpu, plan = _time(fn, 2 if name in tuned else args.repeats)
        blocks = sum(len(p) for p in plan.partition) - sum(len(m) - 1 for m in plan.merges)
        iteration = simulate(plan, profile, channel_fifo=CHANNEL_FIFO).iteration_s
        print(f"{name:<22}{median * 1e3:>18.2f}{spread * 1e3:>11.2f}{cpu * 1e3:>9.2f}{blocks:>8}"
              f"{iteration * 1e3:>19.1f}")
    plan = dcredit(profile, channels=args.channels)
    median, spread, cpu, _ = _time(lambda: simulate(plan, profile, channel_fifo=CHANNEL_FIFO), args.repeats)
    print(f"{'simulate(dcredit plan)':<22}{median * 1e3:>18.2f}{spread * 1e3:>11.2f}{cpu * 1e3:>9.2f}")


if __name__ == "__main__":
    main()
