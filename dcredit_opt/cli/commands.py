"""``python -m dcredit_opt`` (or ``dcredit-opt``): profile a model, then plan and simulate its gradient schedule.

    python -m dcredit_opt profile --model mymodels.py:make --out mine.json
    python -m dcredit_opt plan --profile mine.json --policy dcredit
    python -m dcredit_opt simulate --profile vgg --workers 16,64,256 --plot scale.png
    python -m dcredit_opt config > docs/configuration.md

``config`` prints every ``Config`` field (type, default, environment
variable, docstring) as Markdown: the repository's docs/configuration.md.

``--profile`` takes a profile JSON file or the name of a shipped profile
(``vgg``, ``resnet18``, ``gpt``: measured on the models in the repository's
benchmarks, package data here so they work after ``pip install``).
Errors a user can fix (a missing file, a bad spec, a missing optional
package) are one line on stderr and exit status 1, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.resources
import importlib.util
import json
import re
import sys
import textwrap
from pathlib import Path

import torch

from .. import timeline
from ..config import reference_markdown
from ..planner import policies
from ..planner.cost import scale_to_workers
from ..planner.floors import lower_bound
from ..planner.plan import ALL, blocks_of
from ..planner.profile import Profile, ProfileError
from ..planner.simulate import simulate
from ..profiling.planning import CHANNEL_FIFO, make_plan
from ..world import runtime
from .model_profile import FactoryError, assume_link, call_factory, load_factory, profile_model

PROG = "python -m dcredit_opt"
POLICY_ORDER = tuple(policies.POLICIES)
SHIPPED_PROFILES = ("vgg", "resnet18", "gpt")


class UserError(Exception):
    """Something the user can fix; printed as one line, no traceback."""


# ---- argument types ---------------------------------------------------------


def _workers(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"needs positive worker counts, got {text!r}")
    return values


def _policies(text: str) -> list[str]:
    names = list(POLICY_ORDER) if text == "all" else [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in POLICY_ORDER]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown policy {', '.join(unknown) or repr(text)}; "
                                         f"choose from all, {', '.join(POLICY_ORDER)}")
    return list(dict.fromkeys(names))


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
        return value
    return parse


# One phrase per policy for --help; a policy without one shows its docstring's first line.
POLICY_PHRASES = {
    "wfbp": "each tensor alone as soon as ready",
    "ddp": "PyTorch DDP's 25 MB buckets",
    "mgwfbp": "WFBP with small tensors merged",
    "bytescheduler": "equal blocks under a fixed credit, tuned",
    "usbyte": "US-Byte: unequal gap-filling messages, tuned",
    "oasr": "OASR-WFBP: overlap-aware optimal merges",
    "dear": "DeAR: reduce-scatter in backward, all-gather in forward, tuned fusion",
    "dcredit": "D-Credit: greedy then optimal windows, searched",
}


def _phrase(name: str) -> str:
    if name in POLICY_PHRASES:
        return POLICY_PHRASES[name]
    doc = (policies.POLICIES[name].__doc__ or "").strip().splitlines()
    return re.sub(r":\w+:`\.?([^`]+)`", r"\1", doc[0]).split(";")[0].rstrip(".") if doc else name


POLICY_METAVAR = "{all," + ",".join(POLICY_ORDER) + "}[,...]"
POLICY_HELP = ("a policy, a comma-separated list of them, or all (every policy). Policies: "
               + "; ".join(f"{n} ({_phrase(n)})" for n in POLICY_ORDER))
PROFILE_HELP = ("profile JSON written by `profile`, or a shipped profile: " + ", ".join(SHIPPED_PROFILES))


def _para(text: str) -> str:
    return textwrap.fill(text, width=100)


def _examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {PROG} {line}" for line in lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__.splitlines()[0].split(": ", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_examples("profile --model mymodels.py:make --out mine.json",
                         "plan --profile mine.json --policy all",
                         "simulate --profile vgg --workers 16,64,256,1024",
                         "config > docs/configuration.md",
                         "<command> --help"))
    sub = p.add_subparsers(dest="command", required=True, metavar="{profile,plan,simulate,config}")
    raw = argparse.RawDescriptionHelpFormatter

    pr = sub.add_parser(
        "profile", formatter_class=raw, help="measure your model on this machine and write its profile JSON",
        description=_para(
            "Train your model for a few iterations under a DistributedOptimizer, which measures when each "
            "gradient is ready and (under a launcher) the network's alpha/beta, and write that profile. The "
            "factory takes no arguments and returns (model, batch, loss_fn); batch is (inputs, target) and one "
            "iteration is loss_fn(model(inputs), target).backward() (inputs may be a tuple: model(*inputs), or a "
            "dict: model(**inputs)). Put the model on the device you train on. As a world of one no network is "
            "measured: --gbit and --alpha-us describe it."),
        epilog=_examples("profile --model mymodels.py:make --out mine.json",
                         "profile --model mypkg.models:make_resnet --iters 10 --gbit 10 --out resnet.json")
        + "\n\nwith mymodels.py:\n"
          "  import torch\n"
          "  def make():\n"
          "      model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))\n"
          "      batch = (torch.randn(16, 32), torch.randint(0, 10, (16,)))\n"
          "      return model, batch, torch.nn.functional.cross_entropy\n"
          "under a launcher every rank runs it and rank 0 writes the file:\n"
          "  torchrun --nproc_per_node 2 -m dcredit_opt profile --model mymodels.py:make --out mine.json")
    pr.add_argument("--model", required=True, metavar="MODULE:FACTORY",
                    help="pkg.module:factory (importable from the current folder or PYTHONPATH) or "
                         "path/to/file.py:factory")
    pr.add_argument("--out", required=True, help="where to write the profile JSON")
    pr.add_argument("--iters", type=_positive(int), default=5,
                    help="iterations measured (default 5); one more follows, planned")
    pr.add_argument("--threads", type=_positive(int), default=None,
                    help="torch CPU threads (default: torch's own choice)")
    pr.add_argument("--gbit", type=_positive(float), default=1.0,
                    help="link rate in Gbit/s assumed as a world of one (default 1.0); under a launcher the "
                         "network is measured instead")
    pr.add_argument("--alpha-us", type=_positive(float), default=100.0,
                    help="per-hop latency in microseconds assumed as a world of one (default 100)")

    pl = sub.add_parser(
        "plan", formatter_class=raw, help="print the plan a policy makes for a profile",
        description=_para("Plan a profile with one or more policies and print each plan's blocks, windows "
                          "and simulated iteration time."),
        epilog=_examples("plan --profile vgg", "plan --profile mine.json --policy all",
                         "plan --profile gpt --policy ddp,dcredit --channels 1",
                         "plan --profile mine.json --policy dcredit --json > plan.json"))
    pl.add_argument("--profile", required=True, help=PROFILE_HELP)
    pl.add_argument("--policy", default=["dcredit"], type=_policies, metavar=POLICY_METAVAR,
                    help=f"{POLICY_HELP} (default dcredit)")
    pl.add_argument("--channels", type=_positive(int), default=2, help="communication channels (default 2)")
    pl.add_argument("--json", action="store_true",
                    help="print the plan as JSON (with several policies: an object keyed by policy)")

    sm = sub.add_parser(
        "simulate", formatter_class=raw, help="simulated iteration time per policy and worker count",
        description=_para("Scale a profile's network to larger worlds (ring all-reduce) and simulate every "
                          "policy's plan at each size. The profile must have been measured (or assumed) on at "
                          "least two ranks."),
        epilog=_examples("simulate --profile vgg", "simulate --profile mine.json --workers 8,64 --policy ddp,dcredit",
                         "simulate --profile gpt --markdown --plot scale.png   # --plot needs matplotlib",
                         "simulate --profile vgg --policy dcredit --timeline trace.json   # chrome://tracing"))
    sm.add_argument("--profile", required=True, help=PROFILE_HELP)
    sm.add_argument("--policy", default=list(POLICY_ORDER), type=_policies, metavar=POLICY_METAVAR,
                    help=f"{POLICY_HELP} (default all)")
    sm.add_argument("--workers", default=[16, 64, 256, 1024], type=_workers, metavar="N[,N...]",
                    help="worker counts (default 16,64,256,1024)")
    sm.add_argument("--channels", type=_positive(int), default=2, help="communication channels (default 2)")
    sm.add_argument("--plot", metavar="PNG", help="write a PNG of iteration time against workers (needs matplotlib: "
                                                  "pip install 'dcredit-opt[plot]')")
    sm.add_argument("--markdown", action="store_true", help="print the table as markdown")
    sm.add_argument("--timeline", metavar="JSON",
                    help="write a Chrome trace of the first policy at the first worker count")

    sub.add_parser(
        "config", formatter_class=raw, help="print every Config field: type, default, environment variable, meaning",
        description=_para("Print the reference of dcredit_opt.Config as Markdown, read from its field docstrings: "
                          "the repository's docs/configuration.md is this output."),
        epilog=_examples("config", "config > docs/configuration.md"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "config":
            print(reference_markdown(), end="")
            return 0
        if args.command == "plan":
            return _plan(args)
        if args.command == "simulate":
            return _simulate(args)
        return _profile(args)
    except UserError as e:
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return 1


# ---- inputs and outputs ------------------------------------------------------


def load_profile(spec: str) -> Profile:
    """A profile from a JSON file, or the shipped profile of that name."""
    path = Path(spec)
    try:
        if path.is_file() or spec not in SHIPPED_PROFILES:
            return Profile.load(path)
        return Profile.from_json((importlib.resources.files("dcredit_opt") / "profiles" / f"{spec}.json").read_text())
    except FileNotFoundError:
        raise UserError(f"no profile file {spec!r} (shipped profiles: {', '.join(SHIPPED_PROFILES)}; "
                        f"make one with `{PROG} profile`)") from None
    except ProfileError as e:
        raise UserError(f"{spec} is not a valid profile: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {spec}: {e}") from None


def _writable(path: str | None, option: str) -> None:
    """Fail before any work when an output's folder does not exist."""
    if path is None:
        return
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise UserError(f"{option} {path}: the folder {folder} does not exist")
    if Path(path).is_dir():
        raise UserError(f"{option} {path} is a folder, not a file")


def _need_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise UserError("--plot needs matplotlib, which is not installed: pip install 'dcredit-opt[plot]' "
                        "(or pip install matplotlib)")


# ---- plan --------------------------------------------------------------------


def _plan(args) -> int:
    profile = load_profile(args.profile)
    plans = {name: make_plan(profile, name, channels=args.channels) for name in args.policy}
    if args.json:
        if len(plans) == 1:
            print(next(iter(plans.values())).to_json())
        else:
            print(json.dumps({name: json.loads(plan.to_json()) for name, plan in plans.items()}, indent=1))
        return 0
    print(f"profile {args.profile}: {profile.num_tensors} tensors, {profile.total_bytes / 2**20:.1f} MiB of "
          f"gradients, compute {_compute_s(profile) * 1e3:.1f} ms, world of {profile.world_size}; "
          f"lower bound {lower_bound(profile) * 1e3:.2f} ms")
    for name, plan in plans.items():
        blocks = blocks_of(plan)
        result = simulate(plan, profile, channel_fifo=CHANNEL_FIFO)
        print(f"policy {name}: {_count(len(blocks), 'block')}, {_count(len(plan.merges), 'merge')}, "
              f"channels {plan.channels}, "
              f"credit {plan.credit_bytes} B, phase 2 {'on' if plan.overlap_forward else 'off'}; "
              f"simulated iteration {result.iteration_s * 1e3:.2f} ms")
        print(f"  phase-1 windows (per event): {_windows(plan.phase1_windows)}")
        print(f"  phase-2 windows: {_windows(plan.phase2_windows)}")
    return 0


def _windows(windows) -> str:
    """Windows in blocks, ALL for no limit, runs of one value shortened: ``[0 x3, 2, ALL x4]``."""
    if not windows:
        return "ALL"
    runs: list[list] = []
    for w in windows:
        if runs and runs[-1][0] == w:
            runs[-1][1] += 1
        else:
            runs.append([w, 1])
    shown = ["ALL" if w == ALL else str(w) for w, _ in runs]
    return "[" + ", ".join(f"{v} x{n}" if n > 2 else ", ".join([v] * n) for v, (_, n) in zip(shown, runs)) + "]"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _compute_s(profile: Profile) -> float:
    return sum(t.fwd_s + t.bwd_s for t in profile.tensors)


# ---- simulate ------------------------------------------------------------------


def _scaled(profile: Profile, workers: int) -> Profile:
    if profile.world_size < 2:
        raise UserError("the profile's alpha/beta were measured on one rank: nothing to scale from")
    alpha, beta = scale_to_workers(profile.alpha_s, profile.beta_s_per_byte, profile.world_size, workers)
    return dataclasses.replace(profile, alpha_s=alpha, beta_s_per_byte=beta, world_size=workers)


def simulate_table(profile: Profile, policies: list[str], workers: list[int], channels: int = 2) -> dict:
    """{workers: {policy: iteration_s}} plus each scale's lower bound under key "bound"."""
    table = {}
    for p in workers:
        scaled = _scaled(profile, p)
        row = {"bound": lower_bound(scaled)}
        for name in policies:
            row[name] = simulate(make_plan(scaled, name, channels=channels), scaled, channel_fifo=CHANNEL_FIFO).iteration_s
        table[p] = row
    return table


def _simulate(args) -> int:
    if args.plot:
        _need_matplotlib()
    _writable(args.plot, "--plot")
    _writable(args.timeline, "--timeline")
    profile = load_profile(args.profile)
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
        result = simulate(make_plan(scaled, args.policy[0], channels=args.channels), scaled, channel_fifo=CHANNEL_FIFO)
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


# ---- profile -------------------------------------------------------------------


def _profile(args) -> int:
    _writable(args.out, "--out")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        factory = load_factory(args.model)
        model, batch, loss_fn = call_factory(factory, args.model)
    except FactoryError as e:
        raise UserError(str(e)) from None
    profile = profile_model(model, batch, loss_fn, iters=args.iters)
    if runtime.rank() != 0:
        return 0
    if profile is None:
        raise UserError(f"no profile was measured after {args.iters} iterations")
    measured = profile.world_size > 1
    if not measured:
        profile = assume_link(profile, args.gbit, args.alpha_us)
    profile.save(args.out)
    params = sum(t.numel for t in profile.tensors)
    network = (f"measured on {profile.world_size} ranks" if measured else
               f"assumed: {args.gbit:g} Gbit/s links, {args.alpha_us:g} us per hop; a world of one measures no "
               "network")
    print(f"wrote {args.out}: {profile.num_tensors} tensors, {params:,} parameters "
          f"({profile.total_bytes / 2**20:.2f} MiB of gradients), forward+backward {_compute_s(profile) * 1e3:.2f} ms")
    print(f"network: ring of {profile.world_size}, alpha {profile.alpha_s * 1e6:.0f} us, "
          f"beta {profile.beta_s_per_byte * 1e9:.2f} ns/B ({network})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
