"""``python -m dcredit_opt``: plan, simulate and profile from the command line.

    python -m dcredit_opt plan --profile P.json --policy dcredit
    python -m dcredit_opt simulate --profile P.json --policy all --workers 16,64,256,1024 --plot scale.png
    python -m dcredit_opt profile --model vgg --out P.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from .planner.cost import scale_to_workers
from .planner.plan import blocks_of
from .planner.profile import Profile
from .planner.simulate import lower_bound, simulate
from .planning import make_plan

POLICY_ORDER = ("wfbp", "ddp", "mgwfbp", "bytescheduler", "usbyte", "dear", "dcredit")


def _workers(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--workers must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--workers needs positive worker counts, got {text!r}")
    return values


def _policies(text: str) -> list[str]:
    names = list(POLICY_ORDER) if text == "all" else text.split(",")
    unknown = [n for n in names if n not in POLICY_ORDER]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown policy {', '.join(unknown)}; known: all, {', '.join(POLICY_ORDER)}")
    return names


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dcredit_opt", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    pl = sub.add_parser("plan", help="print the plan a policy makes for a profile")
    pl.add_argument("--profile", required=True, help="profile JSON (python -m dcredit_opt profile)")
    pl.add_argument("--policy", default="dcredit", type=lambda t: _policies(t)[0])
    pl.add_argument("--channels", type=int, default=2)
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")

    sm = sub.add_parser("simulate", help="simulated iteration time per policy and worker count")
    sm.add_argument("--profile", required=True)
    sm.add_argument("--policy", default="all", type=_policies)
    sm.add_argument("--workers", default=[16, 64, 256, 1024], type=_workers)
    sm.add_argument("--channels", type=int, default=2)
    sm.add_argument("--plot", help="write a PNG of iteration time against workers")
    sm.add_argument("--markdown", action="store_true", help="print the table as markdown")
    sm.add_argument("--timeline", help="write a Chrome trace of the first policy at the first worker count")

    pr = sub.add_parser("profile", help="measure a model on this machine and write its profile JSON")
    pr.add_argument("--model", default="vgg", help="benchmarks.models name (vgg, resnet18, gpt, tiny)")
    pr.add_argument("--batch", type=int, default=None)
    pr.add_argument("--iters", type=int, default=5, help="profiled iterations (after one warm-up)")
    pr.add_argument("--out", required=True)
    pr.add_argument("--gbit", type=float, default=1.0,
                    help="link rate for alpha/beta when run as a world of one (under torchrun they are measured)")
    pr.add_argument("--alpha-us", type=float, default=100.0, help="per-hop latency for the same, microseconds")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "plan":
        return _plan(args)
    if args.command == "simulate":
        return _simulate(args)
    return _profile(args)


def _plan(args) -> int:
    profile = Profile.load(args.profile)
    plan = make_plan(profile, args.policy, channels=args.channels)
    if args.json:
        print(plan.to_json())
        return 0
    blocks = blocks_of(plan)
    print(f"policy {plan.policy}: {profile.num_tensors} tensors, {len(blocks)} blocks, "
          f"{len(plan.merges)} merges, channels {plan.channels}, credit {plan.credit_bytes} B, "
          f"phase 2 {'on' if plan.overlap_forward else 'off'}")
    print(f"phase-1 windows (per event): {list(plan.phase1_windows) if plan.phase1_windows else 'ALL'}")
    print(f"phase-2 windows: {list(plan.phase2_windows)}")
    result = simulate(plan, profile)
    print(f"simulated iteration {result.iteration_s * 1e3:.2f} ms; lower bound "
          f"{lower_bound(profile) * 1e3:.2f} ms")
    return 0


def _scaled(profile: Profile, workers: int) -> Profile:
    if profile.world_size < 2:
        raise SystemExit("the profile's alpha/beta were measured on one rank: nothing to scale from")
    alpha, beta = scale_to_workers(profile.alpha_s, profile.beta_s_per_byte, profile.world_size, workers)
    return dataclasses.replace(profile, alpha_s=alpha, beta_s_per_byte=beta, world_size=workers)


def simulate_table(profile: Profile, policies: list[str], workers: list[int], channels: int = 2) -> dict:
    """{workers: {policy: iteration_s}} plus each scale's lower bound under key "bound"."""
    table = {}
    for p in workers:
        scaled = _scaled(profile, p)
        row = {"bound": lower_bound(scaled)}
        for name in policies:
            row[name] = simulate(make_plan(scaled, name, channels=channels), scaled).iteration_s
        table[p] = row
    return table


def _simulate(args) -> int:
    profile = Profile.load(args.profile)
    table = simulate_table(profile, args.policy, args.workers, args.channels)
    base = "ddp" if "ddp" in args.policy else args.policy[0]
    header = ["workers", "bound ms"] + [f"{n} ms" for n in args.policy] + [f"{n} vs {base}" for n in args.policy]
    rows = []
    for p, row in table.items():
        rows.append([str(p), f"{row['bound'] * 1e3:.1f}"] + [f"{row[n] * 1e3:.1f}" for n in args.policy]
                    + [f"{row[base] / row[n]:.2f}x" for n in args.policy])
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
        for r in rows:
            print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    if args.plot:
        _plot(table, args.policy, args.plot)
    if args.timeline:
        scaled = _scaled(profile, args.workers[0])
        result = simulate(make_plan(scaled, args.policy[0], channels=args.channels), scaled)
        _write_sim_timeline(result, profile, args.timeline)
    return 0


def _plot(table: dict, policies: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    workers = list(table)
    for name in policies:
        ax.plot(workers, [table[p][name] * 1e3 for p in workers], marker="o", label=name)
    ax.plot(workers, [table[p]["bound"] * 1e3 for p in workers], "k--", label="bound max(compute, comm)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers")
    ax.set_ylabel("simulated iteration (ms)")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _write_sim_timeline(result, profile: Profile, path: str) -> None:
    from . import timeline

    names = [t.name for t in profile.tensors]
    events = []
    for b in result.blocks:
        tensors = b.tensors
        events.append({"name": f"block {b.block_id}: {names[tensors[0]]}", "ph": "X", "pid": 0,
                       "tid": f"channel {b.channel}", "ts": b.launch_s * 1e6, "dur": (b.end_s - b.launch_s) * 1e6,
                       "args": {"window": b.window, "released_us": b.release_s * 1e6}})
    for t, (s, e) in enumerate(zip(result.forward_start_s, result.forward_end_s)):
        events.append({"name": f"forward {names[t]}", "ph": "X", "pid": 0, "tid": "forward",
                       "ts": s * 1e6, "dur": (e - s) * 1e6})
    for t, r in enumerate(result.ready_s):
        events.append({"name": f"ready {names[t]}", "ph": "i", "s": "t", "pid": 0, "tid": "backward", "ts": r * 1e6})
    timeline.write(path, events)


def _profile(args) -> int:
    import torch

    from . import Config, DistributedOptimizer, init, rank, size
    from .planner.cost import ring_allreduce

    try:
        from benchmarks.models import get_model, loss_fn
    except ImportError:
        raise SystemExit("`profile` measures the models in benchmarks/models.py: run it from the repository root")
    torch.set_num_threads(1)
    init()
    spec = get_model(args.model)
    batch = args.batch or spec.default_batch
    torch.manual_seed(0)
    model = spec.build()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), named_parameters=model.named_parameters(),
                               config=Config(policy="dcredit", profile_iters=args.iters))
    gen = torch.Generator().manual_seed(rank())
    for _ in range(args.iters + 1):
        x, y = spec.make_batch(batch, gen)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    profile = opt.profile
    if rank() != 0:
        return 0
    if size() == 1:
        # One rank measures no network: describe the requested link as a ring of two.
        link_beta = 8.0 / (args.gbit * 1e9)
        alpha = ring_allreduce(args.alpha_us * 1e-6, 0.0, 0, 2)
        beta = ring_allreduce(0.0, link_beta, 1, 2)
        profile = dataclasses.replace(profile, alpha_s=alpha, beta_s_per_byte=beta, world_size=2)
    profile.save(args.out)
    compute = sum(t.fwd_s + t.bwd_s for t in profile.tensors)
    print(json.dumps({"model": args.model, "batch": batch, "tensors": profile.num_tensors,
                      "params": sum(t.numel for t in profile.tensors), "compute_s": round(compute, 4),
                      "alpha_s": profile.alpha_s, "beta_s_per_byte": profile.beta_s_per_byte,
                      "world_size": profile.world_size, "out": args.out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
