"""What the timeline's hooks and our torch.profiler ranges cost when nobody looks (``dcredit_opt/timeline.py``).

    .venv/bin/python -m benchmarks.timeline_cost --models tiny,resnet18

One process (a world of one, the lazy step on). Prints, best of several
repeats: the cost of one ``dcredit_opt::*`` range with no profiler running,
as shipped (``timeline.profiled``: asks whether a profiler runs) and as a
bare ``record_function`` would cost; the cost of one forward stamp
(``RankTimeline.on_forward``). For each model: the ranges and stamps per
iteration (counted under a profiler), their product as the cost per
iteration and its share of the measured iteration time, and the medians of
whole iterations with no timeline and with ``Config.timeline_path`` set,
interleaved (on a busy machine that difference is noise-bound, which is why
the products are the figures to quote). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import tempfile
import time
import timeit

import torch
from torch.autograd.profiler import record_function

import dcredit_opt as dc
from benchmarks.models import get_model, loss_fn
from dcredit_opt import timeline

NAMES = ("dcredit_opt::wait", "dcredit_opt::apply", "dcredit_opt::step")


def per_call_us(repeats: int = 7, number: int = 20000) -> dict:
    """Cost of one range (shipped, bare record_function, nothing) and of one forward stamp, in µs."""
    def shipped():
        with timeline.profiled("dcredit_opt::wait"):
            pass

    def bare():
        with record_function("dcredit_opt::wait"):
            pass

    def nothing():
        with contextlib.nullcontext():
            pass

    tl = timeline.RankTimeline(os.path.join(tempfile.mkdtemp(), "t.json"), 0, 1)

    def stamp():
        tl.on_forward(0)
        if len(tl._forward) > 10000:
            tl._forward.clear()

    best = {name: min(timeit.repeat(fn, number=number, repeat=repeats)) / number * 1e6
            for name, fn in (("shipped", shipped), ("bare", bare), ("nothing", nothing), ("stamp", stamp))}
    tl.close()
    return best


def measure(name: str, iters: int, warmup: int) -> dict:
    spec = get_model(name)
    x, y = spec.make_batch(spec.default_batch, torch.Generator().manual_seed(0))
    runs = {}
    for traced in (False, True):
        torch.manual_seed(0)
        model = spec.build()
        path = os.path.join(tempfile.mkdtemp(), "trace.json") if traced else None
        runs[traced] = (model, dc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), named_parameters=model.named_parameters(),
            config=dc.Config(policy="fixed", lazy_step="on", timeline_path=path)))

    def one(traced: bool) -> float:
        model, opt = runs[traced]
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        return time.perf_counter() - t0

    times = {False: [], True: []}
    for i in range(warmup + 2 * iters):
        traced = i % 2 == 1
        t = one(traced)
        if i >= warmup:
            times[traced].append(t)
    model, opt = runs[False]
    assert opt._dc.lazy.deferred, "the lazy step was off: nothing to measure"
    counted = 3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(counted):
            one(False)
    counts = {e.key: e.count / counted for e in prof.key_averages() if e.key in NAMES}
    stamps = len(opt._dc.lazy.apply_points())  # one forward pre-hook per apply point
    for _, o in runs.values():
        o._dc.close()
    return {"model": name, "ranges": sum(counts.values()), "counts": counts, "stamps": stamps,
            "plain_s": statistics.median(times[False]), "traced_s": statistics.median(times[True])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,resnet18")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per setting")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    dc.init()
    us = per_call_us()
    print(f"# timeline and profiler-range cost, {datetime.date.today()}, torch {torch.__version__}, "
          f"{platform.processor() or '?'} ({torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}), "
          "world of one")
    print(f"one range, no profiler running: shipped {us['shipped']:.3f} us, bare record_function {us['bare']:.3f} us,"
          f" an empty with {us['nothing']:.3f} us; one forward stamp {us['stamp']:.3f} us (best of 7 x 20000)")
    print("| model | ranges/iter | ranges cost/iter | bare would cost | stamps/iter | stamps cost/iter | "
          "iteration | share (ranges + stamps) | median no timeline | median timeline |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        r = measure(name, args.iters, args.warmup)
        ranges_s = r["ranges"] * us["shipped"] * 1e-6
        bare_s = r["ranges"] * us["bare"] * 1e-6
        stamps_s = r["stamps"] * us["stamp"] * 1e-6
        print(f"| {name} | {r['ranges']:.0f} | {ranges_s * 1e6:.1f} us | {bare_s * 1e6:.1f} us | {r['stamps']} | "
              f"{stamps_s * 1e6:.1f} us | {r['plain_s'] * 1e3:.2f} ms | "
              f"{100 * (ranges_s + stamps_s) / r['plain_s']:.3f} % | {r['plain_s'] * 1e3:.2f} ms | "
              f"{r['traced_s'] * 1e3:.2f} ms |")
    dc.shutdown()


if __name__ == "__main__":
    main()
