"""One rank of one benchmark launch: ``python -m benchmarks.worker --scheme S --model M``.

The harness starts one of these per rank (inside the rank's network
namespace) with the torchrun-style environment ``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
``GLOO_SOCKET_IFNAME``. Rank 0 writes a JSON record to ``--out``: the
per-iteration times, or the error that stopped it.

Iteration time is the wall time between consecutive returns of
``opt.step()`` on rank 0 (for ``comm``, of the all-reduce). With a lazy step
(``step()`` returns before communication is done) the wait lands in the next
forward pass, which is inside the next interval, as intended: the interval is
what a training loop experiences.

``--device cuda`` puts the model and the batch on the rank's GPU
(``LOCAL_RANK``), joins torch.distributed over NCCL, and ends every
iteration by waiting for the current CUDA stream (as a loop that reads its
loss each step does): the interval then holds the GPU's work, not only its
launches. Communication on other streams (a lazy step's) may still run on.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import itertools
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmarks import cpu_use
from benchmarks.models import get_model, loss_fn, param_count
from dcredit_opt.files import write_whole

DC_POLICIES = ("wfbp", "mgwfbp", "oasr", "bytescheduler", "usbyte", "dear", "dcredit")
# hvd-dcredit: an unchanged Horovod script with dc.DistributedOptimizer (blocks on our own C++ channels beside
# Horovod, the default there); hvd-dcredit-ops: the same with Config(backend="horovod"), blocks on Horovod's ops;
# hvd-dcredit-ops-fused: the same with Horovod's tensor fusion left on (its default threshold), which merges the
# blocks released in one Horovod cycle into one collective (windows then hold only approximately).
# dc-dcredit-fp16: D-Credit with compression=Compression.fp16 (blocks travel as float16: half the bytes, float16's
# rounding in the reduced gradient, as with Horovod's fp16 compression). dc-dcredit-dense: D-Credit with
# Config(embedding_rows=False), embeddings all-reduced densely (Note [Embedding rows] in dcredit_opt/optimizer/rows.py).
# dc-dcredit-eager: D-Credit with Config(lazy_step="off"), every update applied in step() (on a GPU behind
# stream-ordered waits), none in the next forward. dc-dcredit-devwin: D-Credit with Config(device_windows=True),
# the credit window kept on the GPU (Note [Device windows] in csrc/core/scheduler.cc).
# dc-deft: DeFT's delayed updates (Config(policy="deft", accept_delayed_updates=True)): not synchronous training.
SCHEMES = ("compute", "comm", "ddp", "horovod") + tuple(f"dc-{p}" for p in DC_POLICIES) + (
    "hvd-dcredit", "hvd-dcredit-ops", "hvd-dcredit-ops-fused", "dc-dcredit-fp16", "dc-dcredit-dense", "dc-dcredit-eager",
    "dc-dcredit-devwin", "dc-deft")


def uses_horovod(scheme: str) -> bool:
    """The scheme runs under Horovod (stock Horovod, or our optimizer in a Horovod script)."""
    return scheme == "horovod" or scheme.startswith("hvd-")


LR = 0.01
MOMENTUM = 0.9
# Generous: a rank may wait on a peer for a whole slow iteration plus start-up,
# but a lost peer must still end the launch rather than hang it.
PG_TIMEOUT_S = 180
# Rank 0's time per phase of every iteration of this process's one run
# (zero_grad + forward + loss, backward, step), to show where an iteration
# goes: a lazy step moves its waits from `step` into the next `forward`.
PHASES: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}
# What a dcredit run's rank 0 measured while profiling (its per-tensor times, alpha and beta), for the
# harness's synchronous floor.
MEASURED: dict[str, dict] = {}
# Rank 0's CPU seconds per timed iteration, by kind of thread (benchmarks/cpu_use.py).
CPU_USE: dict[str, float] = {}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scheme", required=True, choices=SCHEMES)
    p.add_argument("--model", required=True)
    p.add_argument("--iters", type=int, required=True, help="timed iterations")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    p.add_argument("--batch-size", type=int, default=None, help="per rank; default: the model's")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the rank's GPU (LOCAL_RANK), NCCL between ranks")
    p.add_argument("--out", default=None, help="rank 0 writes its JSON record here")
    args = p.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    return args


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _timed_loop(iters: int, warmup: int, one_iter: Callable[[], object]) -> tuple[list[float], object]:
    """Run ``warmup + iters`` iterations; return the last ``iters`` intervals."""
    stamps = [time.perf_counter()]
    last = None
    cpu_before = cpu_use.thread_cpu_s() if warmup == 0 else {}
    for k in range(warmup + iters):
        last = one_iter()
        stamps.append(time.perf_counter())
        if k == warmup - 1:
            cpu_before = cpu_use.thread_cpu_s()  # the timed iterations start here
    cpu = cpu_use.cpu_by_kind(cpu_before, cpu_use.thread_cpu_s(), threading.get_native_id())
    CPU_USE.update({kind: seconds / iters for kind, seconds in cpu.items()})
    intervals = [b - a for a, b in itertools.pairwise(stamps)]
    return intervals[warmup:], last


def _train_step(model: torch.nn.Module, opt, batch) -> Callable[[], torch.Tensor]:
    x, y = batch
    on_gpu = x.is_cuda

    def one_iter() -> torch.Tensor:
        # No arguments: Horovod's optimizer does not take set_to_none, and
        # torch's default (True) is what we want anyway.
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        if on_gpu:
            torch.cuda.current_stream().synchronize()
        t3 = time.perf_counter()
        for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            PHASES[phase].append(seconds)
        return loss.detach()

    return one_iter


def _init_torch_pg(device: str) -> None:
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


# -- schemes -------------------------------------------------------------------
# Each returns (intervals, last loss or None, closer).


def run_compute(args, model, batch, rank, world):
    # One process alone: the compute lower bound, no communication at all.
    return (*_timed_loop(args.iters, args.warmup, _train_step(model, _sgd(model), batch)), None)


def run_comm(args, model, batch, rank, world):
    # The communication lower bound: every gradient byte in one flat
    # all-reduce (the fewest start-ups possible), nothing to overlap with.
    _init_torch_pg(args.device)
    flat = torch.zeros(param_count(model), device=args.device)

    def one_iter():
        dist.all_reduce(flat)
        if flat.is_cuda:
            torch.cuda.current_stream().synchronize()

    return (*_timed_loop(args.iters, args.warmup, one_iter), dist.destroy_process_group)


def run_ddp(args, model, batch, rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init_torch_pg(args.device)
    ddp = DDP(model)  # defaults: 25 MiB buckets, first bucket 1 MiB
    intervals, loss = _timed_loop(args.iters, args.warmup, _train_step(ddp, _sgd(ddp), batch))
    return intervals, loss, dist.destroy_process_group


def run_horovod(args, model, batch, rank, world):
    hvd, close = _join_horovod(rank, world)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters())
    intervals, loss = _timed_loop(args.iters, args.warmup, _train_step(model, opt, batch))
    return intervals, loss, close


def run_dc_under_horovod(args, model, batch, rank, world):
    import dcredit_opt as dc

    backend = "horovod" if "-ops" in args.scheme else "auto"  # "auto" under Horovod on CPUs: our channels
    # docs/horovod.md's recipe: fusion off (but in -fused, which measures what fusion does to our blocks);
    # with our channels carrying the blocks, a 20 ms cycle (Note [Horovod cycle time] in
    # dcredit_opt/world/launchers.py). Blocks on Horovod's operations keep its default cycle.
    hvd, close_horovod = _join_horovod(rank, world, fusion_off=not args.scheme.endswith("-fused"),
                                       quiet_cycle=backend == "auto")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    config = dc.Config.from_env(policy="dcredit", backend=backend)
    opt = dc.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(), config=config)
    warmup = args.warmup + opt._dc.config.profile_iters + 1
    intervals, loss = _timed_loop(args.iters, warmup, _train_step(model, opt, batch))

    def close():
        dc.shutdown()
        close_horovod()

    return intervals, loss, close


def _join_horovod(rank, world, fusion_off: bool = False, quiet_cycle: bool = False):
    """Horovod over this launch's ranks, as horovodrun would set it up; returns (hvd, close)."""
    import horovod.torch as hvd
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer

    # horovodrun would start Horovod's rendezvous server and launch ranks over
    # ssh; neither reaches into our namespaces. So rank 0 serves the
    # rendezvous itself and publishes the port through a torch TCPStore on
    # MASTER_ADDR:MASTER_PORT (otherwise unused by this scheme). Each rank
    # is its own host, as with one process per machine.
    master = os.environ["MASTER_ADDR"]
    store = dist.TCPStore(master, _env_int("MASTER_PORT", 29500), world, rank == 0,
                          timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    server = None
    if rank == 0:
        server = RendezvousServer(verbose=0)
        port = server.start()
        hosts = ",".join(f"rank{r}:1" for r in range(world))
        server.init(get_host_assignments(parse_hosts(hosts), world))
        store.set("horovod_rendezvous_port", str(port))
    port = int(store.get("horovod_rendezvous_port").decode())
    os.environ.update({
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": master,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        "HOROVOD_HOSTNAME": f"rank{rank}",
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(world),
        "HOROVOD_LOCAL_RANK": "0",
        "HOROVOD_LOCAL_SIZE": "1",
        "HOROVOD_CROSS_RANK": str(rank),
        "HOROVOD_CROSS_SIZE": str(world),
    })
    if fusion_off:
        os.environ["HOROVOD_FUSION_THRESHOLD"] = "0"  # as docs/horovod.md asks of Horovod users
    if quiet_cycle:
        os.environ["HOROVOD_CYCLE_TIME"] = "20"  # horovodrun --cycle-time-ms 20, as docs/horovod.md asks
    hvd.init()

    def close():
        hvd.shutdown()
        # Keep the rendezvous server alive until every rank has shut down.
        store.set(f"horovod_done_{rank}", "1")
        if server is not None:
            store.wait([f"horovod_done_{r}" for r in range(world)])
            server.stop()

    return hvd, close


DC_VARIANTS = {"": {}, "-fp16": {}, "-dense": {"embedding_rows": False}, "-eager": {"lazy_step": "off"},
               "-devwin": {"device_windows": True}}
"""A dc scheme is ``dc-<policy><variant>``: the Config fields each variant sets (``-fp16`` sets the compression)."""


def dc_variant(scheme: str) -> tuple[str, str]:
    """``(policy, variant)`` of a ``dc-`` scheme."""
    name = scheme.removeprefix("dc-")
    variant = next((v for v in DC_VARIANTS if v and name.endswith(v)), "")
    return name.removesuffix(variant) if variant else name, variant


def run_dc(args, model, batch, rank, world):
    import dcredit_opt as dc

    policy, variant = dc_variant(args.scheme)
    compression = dc.Compression.fp16 if variant == "-fp16" else dc.Compression.none
    overrides = dict(DC_VARIANTS[variant])
    if policy == "deft":  # the benchmark accepts what DeFT changes (docs/usage.md): its row is marked as such
        overrides["accept_delayed_updates"] = True
    # DCREDIT_* variables (a timeline path, a timeout) pass through; the
    # scheme decides the policy. The timeout also bounds joining the job and
    # the control plane, as PG_TIMEOUT_S does for the other schemes.
    config = dc.Config.from_env(policy=policy, **overrides)
    # The group the script makes, as DDP's: Gloo for CPU ranks even where a GPU is present (dc.init() alone
    # would pick NCCL there), NCCL for --device cuda.
    _init_torch_pg(args.device)
    dc.init(timeout_s=config.timeout_s)
    opt = dc.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(), compression=compression,
                                  config=config)
    # The job measures itself for profile_iters iterations, then plans and
    # switches (one more): time only what runs under the chosen plan.
    warmup = args.warmup + opt._dc.config.profile_iters + 1
    intervals, loss = _timed_loop(args.iters, warmup, _train_step(model, opt, batch))
    if opt.profile is not None:
        MEASURED["profile"] = opt.profile.to_dict()

    def close():
        # A lazy step may leave the last updates in flight; let the optimizer
        # finish them before the process group goes away.
        for name in ("close", "shutdown"):
            fn = getattr(opt, name, None) or getattr(dc, name, None)
            if callable(fn):
                fn()
                break
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    return intervals, loss, close


def _runner(scheme: str):
    if scheme.startswith("dc-"):
        return run_dc
    if scheme.startswith("hvd-dcredit"):
        return run_dc_under_horovod
    return {"compute": run_compute, "comm": run_comm, "ddp": run_ddp,
            "horovod": run_horovod}[scheme]


def _write(path: str | None, record: dict) -> None:
    if path is None:
        print(json.dumps(record))
        return
    write_whole(path, json.dumps(record))  # the harness never sees a half-written file


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = _env_int("RANK", 0)
    world = _env_int("WORLD_SIZE", 1)
    torch.set_num_threads(args.threads)
    spec = get_model(args.model)
    batch_size = args.batch_size or spec.default_batch
    record = {
        "scheme": args.scheme, "model": args.model, "rank": rank, "world_size": world,
        "batch_size": batch_size, "threads": args.threads, "iters": args.iters,
        "warmup": args.warmup, "device": args.device,
    }
    try:
        torch.manual_seed(args.seed)  # same initial weights on every rank
        model = spec.build()
        # Different data on every rank, as in data-parallel training.
        batch = spec.make_batch(batch_size, torch.Generator().manual_seed(args.seed + 1 + rank))
        if args.device == "cuda":
            if uses_horovod(args.scheme):
                raise ValueError(f"scheme {args.scheme} runs on CPUs only in this benchmark")
            torch.cuda.set_device(_env_int("LOCAL_RANK", 0))
            record["gpu"] = torch.cuda.get_device_name()
            model = model.cuda()
            batch = tuple(t.cuda() for t in batch)
        record["params"] = param_count(model)
        t0 = time.perf_counter()
        intervals, loss, close = _runner(args.scheme)(args, model, batch, rank, world)
        record["run_s"] = time.perf_counter() - t0
        record["iter_times_s"] = intervals
        if PHASES["step"]:  # schemes that train (not `comm`): the timed iterations' phases
            record["phases_s"] = {k: v[len(v) - len(intervals):] for k, v in PHASES.items()}
        record["final_loss"] = float(loss) if loss is not None else None
        if CPU_USE:
            record["cpu_s_per_iter"] = dict(CPU_USE)
        if "profile" in MEASURED:
            record["profile"] = MEASURED["profile"]
        if close is not None:
            close()
    except BaseException as exc:
        # Recorded for the harness, then re-raised: the traceback goes to the
        # rank's log and the exit status says it failed.
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()
        if rank == 0:
            _write(args.out, record)
        raise
    if rank == 0:
        _write(args.out, record)
    return 0


if __name__ == "__main__":
    code = main()
    # The record is written and every exit handler (dcredit_opt's shutdown, Horovod's) runs; the interpreter's
    # own teardown is skipped, where a finished rank has aborted a few times under heavy load (see
    # tests/distributed/spawn.py, exit_after_exit_handlers).
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(code)
