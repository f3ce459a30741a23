"""Where the host waits in steady iterations on one GPU: a ``torch.profiler`` trace of a world of one.

    python -m benchmarks.gpu_trace --model gpt --out OUTDIR [--way dc|ddp] [--iters 10]

Trains the benchmark's model on ``cuda:0`` at a world of one (NCCL) with
``dc.DistributedOptimizer`` (or DDP), warms up, then records ``--iters``
iterations with the CPU and CUDA activities. Printed per iteration (medians):
the wall time, the host time inside ``dcredit_opt::wait`` ranges (the lazy
step and ``synchronize()`` waiting for reduced blocks) split into the forward
and the rest, and the host time in the CUDA runtime's synchronising calls
(stream, event and device synchronisation). The chrome trace is written to
OUTDIR, gzipped. A benchmark, not a test: it prints numbers and checks nothing.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import time
from pathlib import Path

SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt", choices=("gpt", "vgg"))
    p.add_argument("--way", default="dc", choices=("dc", "ddp"))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run of this script")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks.models import get_model, loss_fn

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    spec = get_model(args.model)
    model = spec.build().to(args.device)
    x, y = (t.to(args.device) for t in spec.make_batch(spec.default_batch, torch.Generator().manual_seed(1)))
    net = model
    if args.way == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    else:
        import dcredit_opt as dc

        dc.init()
        opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                      named_parameters=model.named_parameters())

    def step() -> None:
        opt.zero_grad()
        with record_function("bench::forward"):
            loss = loss_fn(net(x), y)
        with record_function("bench::backward"):
            loss.backward()
        with record_function("bench::step"):
            opt.step()

    for _ in range(args.warmup):
        step()
    sync()
    walls = []
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(args.iters):
            t = time.perf_counter()
            with record_function("bench::iteration"):
                step()
            walls.append(time.perf_counter() - t)
        sync()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / f"trace-{args.model}-{args.way}.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()

    # Host-side ranges (cpu_op / user_annotation / cuda_runtime), on the training thread or any.
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    forwards = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"] == "bench::forward"]

    def inside_forward(e) -> bool:
        return any(a <= e["ts"] < b for a, b in forwards)

    waits = [e for e in spans if e["name"] == "dcredit_opt::wait"]
    syncs = [e for e in spans if e["name"] in SYNC_CALLS]
    n = max(1, args.iters)
    print(f"# {args.model}, {args.way}, {torch.cuda.get_device_name() if cuda else 'CPU'}, {args.iters} profiled iterations "
          f"after {args.warmup}")
    print(f"iteration (profiled): median {statistics.median(walls) * 1e3:.2f} ms")
    for label, group in (("dcredit_opt::wait", waits), ("CUDA synchronising calls", syncs)):
        fwd = [e["dur"] for e in group if inside_forward(e)]
        rest = [e["dur"] for e in group if not inside_forward(e)]
        print(f"{label}: in the forward {len(fwd) / n:.1f} per iteration, {sum(fwd) / n / 1e3:.3f} ms per "
              f"iteration; elsewhere {len(rest) / n:.1f} per iteration, {sum(rest) / n / 1e3:.3f} ms")
    for part in ("forward", "backward", "step"):
        durs = [e["dur"] for e in spans if e["name"] == f"bench::{part}"]
        print(f"host time in {part}: median {statistics.median(durs) / 1e3:.3f} ms" if durs else f"no {part} spans")
    applies = [e["dur"] for e in spans if e["name"] == "dcredit_opt::apply"]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    print(f"dcredit_opt::apply: {len(applies) / n:.1f} per iteration, {sum(applies) / n / 1e3:.3f} ms; "
          f"device kernels and copies: {len(kernels) / n:.0f} per iteration, "
          f"{sum(e['dur'] for e in kernels) / n / 1e3:.3f} ms")
    if args.way == "dc":
        plan = opt.plan
        print(f"plan: {plan.policy}, {len(plan.numels)} tensors, {sum(len(p) for p in plan.partition)} pieces, "
              f"{len(plan.merges)} merges, overlap_forward={plan.overlap_forward}, channels={plan.channels}, "
              f"phase-2 windows {plan.phase2_windows}")
    print(f"trace: {trace}.gz")
    if args.way == "dc":
        dc.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
