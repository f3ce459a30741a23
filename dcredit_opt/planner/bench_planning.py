"""How long planning takes: ``python -m dcredit_opt.planner.bench_planning [--tensors 1000]``.

The planner runs once, on rank 0, after the profiling iterations; the
target is under 50 ms for a 1,000-tensor model with D-Credit, so that
re-planning is cheap. Prints the median and spread of repeated runs for
each policy on a synthetic model-shaped profile; asserts nothing (timings
belong to benchmarks, not tests).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

from .dcredit import dcredit
from .policies import POLICIES, tune_bytescheduler
from .simulate import lower_bound, simulate
from .synthetic import model_like_profile


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
    parser.add_argument("--tune", action="store_true",
                        help="also time tune_bytescheduler (slow: a grid of simulations)")
    args = parser.parse_args(argv)

    profile = model_like_profile(args.tensors)
    print(f"python {sys.version.split()[0]} on {platform.machine()} ({platform.processor() or 'cpu'}), "
          f"{args.tensors} tensors, {profile.total_bytes / 2**20:.0f} MiB, lower bound "
          f"{lower_bound(profile) * 1e3:.1f} ms")
    print(f"{'policy':<22}{'plan ms (median)':>18}{'spread ms':>11}{'cpu ms':>9}{'blocks':>8}"
          f"{'sim. iteration ms':>19}")
    rows = [(f"{name}", lambda f=fn: f(profile)) for name, fn in POLICIES.items()]
    rows.append(("dcredit refine=False", lambda: dcredit(profile, refine=False)))
    if args.tune:
        rows.append(("tune_bytescheduler", lambda: tune_bytescheduler(profile)))
    for name, fn in rows:
        median, spread, cpu, plan = _time(fn, 3 if name == "tune_bytescheduler" else args.repeats)
        blocks = sum(len(p) for p in plan.partition) - sum(len(m) - 1 for m in plan.merges)
        iteration = simulate(plan, profile).iteration_s
        print(f"{name:<22}{median * 1e3:>18.2f}{spread * 1e3:>11.2f}{cpu * 1e3:>9.2f}{blocks:>8}"
              f"{iteration * 1e3:>19.1f}")
    plan = dcredit(profile)
    median, spread, cpu, _ = _time(lambda: simulate(plan, profile), args.repeats)
    print(f"{'simulate(dcredit plan)':<22}{median * 1e3:>18.2f}{spread * 1e3:>11.2f}{cpu * 1e3:>9.2f}")


if __name__ == "__main__":
    main()
