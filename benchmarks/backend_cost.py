"""Python's cost per block in the Python-driven backends (Horovod, mpi4py).

    mpiexec -n 2 .venv/bin/python -m benchmarks.backend_cost                  # backend mpi
    mpiexec -n 2 .venv/bin/python -m benchmarks.backend_cost --backend torch  # same job, Gloo in C++
    horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python -m benchmarks.backend_cost
    torchrun --nproc_per_node 2 -m benchmarks.backend_cost                    # backend torch

Trains an MLP whose gradients are cut into many equal blocks, and prints,
on rank 0: the median iteration time (with spread), the blocks per
iteration, and for Horovod/MPI the mean CPU time that our driver thread
(launch taken -> collective started) and completer thread (collective done
-> scheduler told) spend per block (``DrivenBackend.cost_per_block_us``).
CPU time, not wall time: it is what the training thread can lose to these
threads through the GIL, and it excludes waiting for a core on a busy
machine. A benchmark, not a test: it prints numbers and checks nothing.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch
from torch import nn

import dcredit_opt as dc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--block-kib", type=int, default=64)
    parser.add_argument("--width", type=int, default=1024, help="MLP width (4 layers: about 4 * width^2 weights)")
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)

    dc.init(backend=args.backend)
    torch.manual_seed(0)
    w = args.width
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(w, w), nn.ReLU())])
    config = dc.Config(backend=args.backend, block_bytes=args.block_kib * 1024, window=args.window,
                       policy="fixed", timeout_s=120.0)
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                  named_parameters=model.named_parameters(), config=config)
    x = torch.randn(32, w)
    times = []
    for i in range(args.warmup + args.iters):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        opt.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    backend = opt._dc.backend
    blocks = opt._dc.buffers.layout.num_blocks
    cost = backend.cost_per_block_us() if hasattr(backend, "cost_per_block_us") else None
    if dc.rank() == 0:
        med = statistics.median(times)
        spread = statistics.stdev(times) if len(times) > 1 else 0.0
        print(f"{datetime.date.today()} {platform.node()} torch {torch.__version__} ranks {dc.size()} "
              f"launcher {dc.world.runtime.kind()} backend {backend.name}")
        print(f"{blocks} blocks of {args.block_kib} KiB per iteration, window {args.window}: "
              f"iteration {med * 1e3:.1f} ms median (stdev {spread * 1e3:.1f} ms, {args.iters} iterations)")
        if cost is not None:
            launch_us, complete_us, n = cost
            print(f"Python CPU per block: driver {launch_us:.1f} us, completer {complete_us:.1f} us "
                  f"(mean over {n} blocks); {blocks * (launch_us + complete_us) / 1e3:.2f} ms per iteration")
    opt._dc.close()
    dc.shutdown()


if __name__ == "__main__":
    main()
