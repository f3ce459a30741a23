"""DDP and dcredit-opt side by side, on 2 ranks joined by an emulated 1 Gbit/s link.

    python examples/side_by_side.py                                  # gpt, 1gbit, 2 rounds
    python examples/side_by_side.py --model vgg --rounds 3 --iters 10
    python examples/side_by_side.py --network loopback --model tiny --iters 2 --rounds 1

The same model, data and optimizer (SGD with momentum, the same initial
weights, a different batch on each rank) train first under torch's
``DistributedDataParallel``, then under ``dc.DistributedOptimizer``, and
again (``--rounds``), so that drift of a shared machine hits both alike.
Each launch starts one fresh process per rank, as the benchmark harness
does (``benchmarks/harness.py``): the ranks live in network namespaces
joined by veth pairs rate-limited with ``tc tbf`` (``benchmarks/netem.py``)
when this runs as root and ``ip netns`` works; otherwise they talk over
loopback, which is not rate-limited, and one line says so. The training
loops are the harness worker's own (``benchmarks/worker.py``: ``run_ddp``,
``run_dc``).

At the end: the median iteration time of each, the speed-up of dcredit-opt
over DDP, whether the ranks of every launch ended with bitwise identical
parameters, and whether DDP and dcredit-opt ended with the same parameters
(within float tolerance). The exit status is 1 when either check fails,
never because of a time.

It uses the repository's ``benchmarks`` package, so it runs from a checkout.
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # the benchmarks package lives beside examples/

import torch

from benchmarks import harness, netem
from benchmarks.models import MODELS, get_model, param_count
from benchmarks.stats import median, quantile

SCHEMES = {"ddp": "DDP", "dc-dcredit": "dcredit-opt"}
SEED = 0  # the harness worker's default: same initial weights on every rank, batch seed + 1 + rank
# DDP and dcredit-opt add the same gradients in a different order and grouping
# (DDP's buckets, our blocks): equal up to float32 rounding, carried through
# every step. Rounding differences stay orders of magnitude below these.
RTOL = 1e-4
ATOL = 1e-6
# dcredit-opt's collective timeout in the ranks unless DCREDIT_TIMEOUT_S says
# otherwise: the patience the worker gives DDP's process group (PG_TIMEOUT_S),
# so that a rank slowed by other jobs on the machine is not taken for a dead one.
DC_TIMEOUT_S = 180


# --------------------------------------------------------------------------
# One rank of one launch (this file, started again with --rank-of)
# --------------------------------------------------------------------------


def rank_main(args: argparse.Namespace) -> None:
    import dcredit_opt as dc
    from benchmarks import worker

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(args.threads)
    spec = get_model(args.model)
    batch_size = args.batch_size or spec.default_batch
    torch.manual_seed(SEED)
    model = spec.build()
    batch = spec.make_batch(batch_size, torch.Generator().manual_seed(SEED + 1 + rank))
    # run_dc leaves dcredit-opt's self-measurement (profile_iters) and the
    # switch to its plan (one more) untimed; DDP gets as many untimed
    # iterations, so that both take the same number of steps.
    warmup = args.warmup
    if args.rank_of == "ddp":
        warmup += dc.Config.from_env().profile_iters + 1
    run_args = argparse.Namespace(scheme=args.rank_of, iters=args.iters, warmup=warmup, device="cpu")
    runner = worker.run_ddp if args.rank_of == "ddp" else worker.run_dc
    intervals, loss, close = runner(run_args, model, batch, rank, world)
    close()  # dcredit-opt applies its last (lazy) updates before it shuts down
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out = Path(args.out)
    record = {"rank": rank, "iter_times_s": intervals, "final_loss": float(loss),
              "batch_size": batch_size, "params": param_count(model),
              "sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest()}
    if rank == 0:
        torch.save(flat, out / "params-r0.pt")
    tmp = out / f"record-r{rank}.json.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, out / f"record-r{rank}.json")  # never read half-written


# --------------------------------------------------------------------------
# The launcher
# --------------------------------------------------------------------------


class LaunchFailed(RuntimeError):
    pass


def open_network(ranks: int, rate: str, mode: str) -> netem.Network:
    """Namespaces at ``rate`` when possible (mode auto/netns), else loopback and one line saying so."""
    if mode != "loopback":
        try:
            return netem.open_network(ranks, rate, "netns")
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            if mode == "netns":
                raise
            why = str(exc).removeprefix("network namespaces unavailable: ")
    else:
        why = "--network loopback"
    print(f"note: ranks talk over loopback ({why}), which is NOT rate-limited: "
          f"the times below are not those of a {rate} link", flush=True)
    return netem.open_network(ranks, rate, "loopback")


def run_launch(net: netem.Network, scheme: str, args: argparse.Namespace, workdir: Path) -> list[dict]:
    """One process per rank, in its namespace; their records, rank 0's parameters under ``workdir``."""
    port = net.next_port()
    workdir.mkdir()
    procs, logs = [], []
    for ep in net.endpoints:
        env = dict(os.environ, **netem.rank_env(ep, net.ranks, net.master_addr, port))
        env["OMP_NUM_THREADS"] = str(args.threads)
        env["PYTHONFAULTHANDLER"] = "1"  # a rank that dies of a signal prints every thread's stack
        env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if x)
        env.setdefault("DCREDIT_TIMEOUT_S", str(DC_TIMEOUT_S))
        argv = [sys.executable, str(Path(__file__).resolve()), "--rank-of", scheme, "--out", str(workdir),
                "--model", args.model, "--iters", str(args.iters), "--warmup", str(args.warmup),
                "--threads", str(args.threads)]
        if args.batch_size:
            argv += ["--batch-size", str(args.batch_size)]
        log = workdir / f"r{ep.rank}.log"
        logs.append(log)
        with open(log, "w") as f:
            procs.append(subprocess.Popen(ep.wrap(argv), env=env, cwd=REPO_ROOT,
                                          stdout=f, stderr=subprocess.STDOUT))
    error = harness._wait_all(procs, args.launch_timeout_s)
    paths = [workdir / f"record-r{r}.json" for r in range(net.ranks)]
    if error is None and not all(p.exists() for p in paths):
        error = "a rank wrote no record"
    if error is not None:
        tails = [harness._log_tail(p) for p in logs]
        cause = next((c for c in map(harness._error_line, tails) if c), None)
        detail = "\n".join(f"--- rank {r} log tail ---\n{t}" for r, t in enumerate(tails))
        raise LaunchFailed(f"{SCHEMES[scheme]} launch failed: {error}"
                           f"{': ' + cause if cause else ''}\n{detail}")
    return [json.loads(p.read_text()) for p in paths]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt", choices=sorted(MODELS),
                   help="from benchmarks/models.py (default gpt: 27M parameters, 104 MiB of gradients)")
    p.add_argument("--batch-size", type=int, default=None, help="per rank; default: the model's")
    p.add_argument("--rate", default="1gbit", help="link rate each way, as tc writes it")
    p.add_argument("--ranks", type=int, default=2, help=f"2..{netem.MAX_RANKS}")
    p.add_argument("--network", choices=("auto", "netns", "loopback"), default="auto",
                   help="auto: namespaces when root and `ip netns` work, else loopback")
    p.add_argument("--rounds", type=int, default=2, help="DDP then dcredit-opt, this many times")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per launch")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed iterations first (dcredit-opt's profiling ones come on top, for both)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--launch-timeout-s", type=float, default=300.0, help="kill a launch after this long")
    p.add_argument("--rank-of", choices=SCHEMES, help=argparse.SUPPRESS)  # internal: be one rank
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    netem.parse_rate(args.rate)
    if not 2 <= args.ranks <= netem.MAX_RANKS:
        p.error(f"--ranks must be 2..{netem.MAX_RANKS}")
    if args.rounds < 1 or args.iters < 1 or args.warmup < 0 or args.threads < 1:
        p.error("--rounds, --iters, --threads must be >= 1 and --warmup >= 0")
    return args


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank_of:
        rank_main(args)
        # As benchmarks/worker.py: the record is written and every exit handler runs; the interpreter's own
        # teardown is skipped, where a finished rank has aborted a few times under heavy load ("terminate
        # called without an active exception"; tests/distributed/spawn.py, exit_after_exit_handlers).
        sys.stdout.flush()
        sys.stderr.flush()
        atexit._run_exitfuncs()
        os._exit(0)

    n = param_count(get_model(args.model).build())
    batch = args.batch_size or get_model(args.model).default_batch
    load_start = os.getloadavg()[0]
    with open_network(args.ranks, args.rate, args.network) as net, \
            tempfile.TemporaryDirectory(prefix="dcdemo-") as tmp:
        link = f"network namespaces, {args.rate} each way (tc tbf)" if net.limited else "loopback"
        print(f"DDP vs dcredit-opt: {args.model} ({n:,} parameters, {n * 4 / 2**20:.3g} MiB "
              f"of gradients per step), {args.ranks} ranks over {link}, batch {batch} per rank, "
              f"{args.rounds} round(s) of {args.iters} timed iterations", flush=True)
        times: dict[str, list[float]] = {s: [] for s in SCHEMES}
        agree: dict[str, bool] = dict.fromkeys(SCHEMES, True)
        reference = None  # rank 0's parameters after the first DDP launch; every launch is held to it
        max_diff, within_tol = 0.0, True
        for rnd in range(args.rounds):
            for scheme, label in SCHEMES.items():
                t0 = time.monotonic()
                workdir = Path(tmp) / f"{rnd}-{scheme}"
                records = run_launch(net, scheme, args, workdir)
                times[scheme] += records[0]["iter_times_s"]
                agree[scheme] &= len({r["sha256"] for r in records}) == 1
                params = torch.load(workdir / "params-r0.pt")
                (workdir / "params-r0.pt").unlink()  # 100+ MiB for the larger models
                if reference is None:
                    reference = params
                else:
                    max_diff = max(max_diff, (params - reference).abs().max().item())
                    within_tol &= torch.allclose(params, reference, rtol=RTOL, atol=ATOL)
                print(f"  round {rnd + 1}/{args.rounds}  {label:<12} median "
                      f"{median(records[0]['iter_times_s']):.3f} s per iteration "
                      f"(launch {time.monotonic() - t0:.0f} s)", flush=True)

    print()
    print(f"{'':<14}{'median (s)':>12}{'IQR (s)':>10}{'n':>5}")
    for scheme, label in SCHEMES.items():
        ts = times[scheme]
        print(f"{label:<14}{median(ts):>12.3f}{quantile(ts, 0.75) - quantile(ts, 0.25):>10.3f}{len(ts):>5}")
    speedup = median(times["ddp"]) / median(times["dc-dcredit"])
    print(f"speed-up of dcredit-opt over DDP: {speedup:.2f}x")
    print("ranks agree (identical parameters on every rank): "
          + ", ".join(f"{SCHEMES[s]} {_yes(agree[s])}" for s in SCHEMES))
    print(f"DDP and dcredit-opt agree (parameters within rtol {RTOL:g}, atol {ATOL:g}): {_yes(within_tol)} "
          f"(largest difference {max_diff:.2g})")
    cores, load_end = os.cpu_count() or 1, os.getloadavg()[0]
    # Each rank keeps one core busy: more load than that is other jobs.
    busy = max(load_start, load_end) > cores + 0.5
    print(f"machine: {cores} cores, 1-minute load average {load_start:.1f} at start, {load_end:.1f} at end"
          + (": other jobs were running, so every time above is slower and noisier than on an idle machine"
             if busy else ""))
    return 0 if all(agree.values()) and within_tol else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except LaunchFailed as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
