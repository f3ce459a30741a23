"""Simulated scale: every policy on the shipped profiles at 2 to 1024 workers.

    python -m benchmarks.simulated_scale [--out benchmarks/simulated_scale.md] [--plots benchmarks/results]

Writes ``benchmarks/simulated_scale.md`` (tables, the papers' claimed
ordering beside ours) and one plot per model. Each policy is planned as the
runtime plans it (``planning.make_plan``, 2 channels: tuned where the
policy has knobs) and replayed by the planner's simulator with the
profile's alpha/beta scaled to p workers (``planner.cost.scale_to_workers``).
Nothing here is measured; see ``benchmarks/results/`` for measured runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import platform
import subprocess
import sys
from pathlib import Path

import dcredit_opt
from dcredit_opt.files import write_whole
from dcredit_opt.planner import policies
from dcredit_opt.planner.cost import scale_to_workers
from dcredit_opt.planner.floors import lower_bound
from dcredit_opt.planner.profile import Profile
from dcredit_opt.planner.search import search
from dcredit_opt.planner.simulate import simulate
from dcredit_opt.profiling import planning

REPO = Path(__file__).resolve().parents[1]
MODELS = ("vgg", "resnet18", "gpt")
WORKERS = (2, 16, 64, 256, 1024)
CHANNELS = 2
POLICIES = tuple(name for name in ("wfbp", "ddp", "mgwfbp", "oasr", "bytescheduler", "usbyte", "dear", "dcredit")
                 if name in policies.POLICIES)
LABEL = {"wfbp": "WFBP", "ddp": "DDP", "mgwfbp": "MG-WFBP", "oasr": "OASR", "bytescheduler": "ByteScheduler",
         "usbyte": "US-Byte", "dear": "DeAR", "dcredit": "D-Credit"}

# What the seed papers claim (their abstracts, ../shared/seeds/), as "A ahead of B" pairs.
CLAIMS = (
    ("dcredit", "bytescheduler", "D-Credit: up to 1.26x over ByteScheduler"),
    ("dcredit", "dear", "D-Credit: up to 1.21x over DeAR"),
    ("dcredit", "ddp", "D-Credit: up to 1.48x over PyTorch-DDP"),
    ("dcredit", "wfbp", "D-Credit: up to 1.53x over WFBP"),
    ("usbyte", "bytescheduler", "US-Byte: up to 1.26x over ByteScheduler"),
    ("usbyte", "wfbp", "US-Byte: up to 1.56x over WFBP"),
    ("oasr", "wfbp", "OASR-WFBP: 5-16 % over WFBP"),
    ("dear", "mgwfbp", "DeAR: up to 1.83x over the state of the art (MG-WFBP-style fusion among them)"),
)


def shipped(name: str) -> Profile:
    for folder in (Path(dcredit_opt.__file__).parent / "profiles", REPO / "benchmarks" / "profiles"):
        if (folder / f"{name}.json").exists():
            return Profile.load(folder / f"{name}.json")
    raise SystemExit(f"shipped profile {name!r} not found")


def scaled(p: Profile, workers: int) -> Profile:
    alpha, beta = scale_to_workers(p.alpha_s, p.beta_s_per_byte, p.world_size, workers)
    return dataclasses.replace(p, alpha_s=alpha, beta_s_per_byte=beta, world_size=workers)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def dcredit_pick(p: Profile) -> str:
    """Which candidate of the D-Credit search won (the first of the fastest, as the search keeps)."""
    trace: list = []
    search(p, block_sizes=planning.block_size_grid(p), channels=CHANNELS, channel_fifo=planning.CHANNEL_FIFO,
           trace=trace)
    best = min(s for _, s in trace)
    name = next(n for n, s in trace if s == best)
    head, _, size = name.partition(" S=")
    if name.startswith("usbyte unit="):
        return f"US-Byte's plan, unit {_size(int(name.split('=')[1]))}"
    if name.startswith("dear threshold="):
        return f"DeAR's plan, threshold {_size(int(name.split('=')[1]))}"
    if head.startswith("dcredit decoupled"):
        which = "every block" if "(all)" in head else "the blocks left for the flush"
        return f"D-Credit windows, {_size(int(size))} blocks, packed, {which} reduce-scattered + all-gathered"
    if head == "dcredit":
        return f"D-Credit windows, {_size(int(size))} blocks, packed"
    if head == "dcredit unpacked":
        return f"D-Credit windows, {_size(int(size))} blocks"
    if head.startswith("fixed credit"):
        return f"{head} (ByteScheduler's plan), {_size(int(size))} blocks"
    if head.startswith("credit"):
        return f"{head.replace('credit', 'fixed credit', 1)}, {_size(int(size))} blocks"
    return f"{name}, sent when ready, phase 2 on"


def table(model: str) -> list[dict]:
    base = shipped(model)
    rows = []
    for workers in WORKERS:
        p = scaled(base, workers)
        row = {"workers": workers, "bound": lower_bound(p), "alpha_ms": p.alpha_s * 1e3}
        for name in POLICIES:
            plan = planning.make_plan(p, name, channels=CHANNELS)
            row[name] = simulate(plan, p, channel_fifo=planning.CHANNEL_FIFO).iteration_s
        row["pick"] = dcredit_pick(p)
        rows.append(row)
    return rows


def ranking(row: dict) -> str:
    """Fastest first; equal times (to 1e-6 s) joined by '='."""
    names = sorted(POLICIES, key=lambda n: (round(row[n], 6), POLICIES.index(n)))
    out = LABEL[names[0]]
    for a, b in itertools.pairwise(names):
        out += (" = " if round(row[a], 6) == round(row[b], 6) else " < ") + LABEL[b]
    return out


def markdown(results: dict[str, list[dict]]) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    base = shipped(MODELS[0])
    out = [
        "# Simulated scale: every policy at 2 to 1024 workers",
        "",
        (f"Made with `python -m benchmarks.simulated_scale` on {datetime.date.today().isoformat()} (commit {commit}, "
        f"python {sys.version.split()[0]}, {platform.machine()}). Compute times per tensor were measured on this "
        "machine (`python -m dcredit_opt profile`, one rank, one thread; the profiles ship in "
        "`dcredit_opt/profiles/`); the network is a 1 Gbit/s link with 100 us per hop described as a ring of two "
        f"(alpha {base.alpha_s * 1e3:.1f} ms, beta {base.beta_s_per_byte * 1e9:.0f} ns/byte) and scaled to p "
        "workers by the ring all-reduce formula (`planner.cost.scale_to_workers`: alpha grows as p-1, beta as "
        "(p-1)/p). Every policy is planned as the runtime plans it (`planning.make_plan`, 2 channels): "
        "ByteScheduler tuned over block size x credit, US-Byte over its unit size with the same number of "
        "candidates, D-Credit by its search (`planner/search.py`), which also tries every other policy's plan. "
        "The simulator's network model is the one the measured runs support (`planning.CHANNEL_FIFO`, "
        "`benchmarks/results/calibration.md`): "
        + ("collectives run one after another on each of the 2 channels, the channels sharing the link's "
           "bandwidth" if planning.CHANNEL_FIFO else
           "processor sharing (concurrent collectives overlap their start-ups and share the link's bandwidth)")
        + "; every policy is tuned and judged under it. DeAR is its own collectives: each fusion group "
        "reduce-scattered in backward and all-gathered during the next forward, each stage costing half an "
        "all-reduce (`Note [Two-stage blocks in the simulator]`), its fusion threshold tuned with US-Byte's "
        "budget. Times are simulated iteration times in ms."),
        "",
    ]
    for model, rows in results.items():
        out += [f"## {model}", "",
                "| workers | alpha ms | bound ms | " + " | ".join(f"{LABEL[n]} ms" for n in POLICIES)
                + " | best other / D-Credit | D-Credit's pick (search winner) |",
                "|" + "---|" * (len(POLICIES) + 5)]
        for row in rows:
            others = {n: row[n] for n in POLICIES if n != "dcredit"}
            best = min(others, key=others.get)
            out.append(f"| {row['workers']} | {row['alpha_ms']:.1f} | {row['bound'] * 1e3:.1f} | "
                       + " | ".join(f"{row[n] * 1e3:.1f}" for n in POLICIES)
                       + f" | {others[best] / row['dcredit']:.3f}x ({LABEL[best]}) | {row['pick']} |")
        out.append("")
    out += ["## Ordering: the papers' claims beside ours", "",
            "Our ranking, fastest first, per model and worker count:", ""]
    for model, rows in results.items():
        for row in rows:
            out.append(f"- {model}, {row['workers']} workers: " + ranking(row))
    out += ["", "| claim (abstract) | holds in our simulation at |", "|---|---|"]
    for ahead, behind, text in CLAIMS:
        held = [f"{model} {row['workers']}" for model, rows in results.items() for row in rows
                if row[ahead] < row[behind] * (1 - 1e-9)]
        ties = [f"{model} {row['workers']}" for model, rows in results.items() for row in rows
                if abs(row[ahead] - row[behind]) <= 1e-9 * row[behind]]
        total = sum(len(rows) for rows in results.values())
        where = "everywhere" if len(held) == total else (", ".join(held) if held else "nowhere")
        if ties and len(held) < total:
            where += f" (ties: {', '.join(ties)})"
        out.append(f"| {text} | {where} |")
    out += ["", WHERE_THEY_DIFFER, "",
            "Plots: `benchmarks/results/simulated-scale-{" + ",".join(MODELS) + "}.png`.", ""]
    return "\n".join(out)


WHERE_THEY_DIFFER = """**Where they differ, and why.** D-Credit is never slower than any other policy here, by
construction: its search tries every baseline's plan as a D-Credit plan (fixed windows are a special case of
dynamic ones, DeAR's plan is one with decoupled blocks). Its own windows win in 9 of the 15 cases (1.0002x to
1.068x over the best other policy), every one of them with decoupled blocks (reduce-scatter in backward,
all-gather in the next forward: issue S1's question, answered in this model): decoupling gains 0.1 % to 8.5 %
over D-Credit's best all-reduce plan (most on ResNet-18 at 64 and 256 workers, where the input side's many
small tensors leave the last all-reduces on the critical path), nothing at 2 workers. It ties the best in
the other six by adopting that plan: ByteScheduler's (credit 1) on ResNet-18 at 2 workers, US-Byte's on GPT
at 2, DeAR's on VGG at 1024 and GPT at 256, OASR's merges on ResNet-18 and GPT at 1024, where alpha is
205 ms and the fewest collectives win. The paper's ordering (D-Credit ahead of ByteScheduler, DeAR, DDP and
WFBP) holds but for those ties; D-Credit's margin over DeAR stays below the paper's 1.21x (at most 1.12x, GPT
at 1024 workers), and over ByteScheduler it grows far beyond the paper's 1.26x at scale (up to 5x at 1024
workers), because with collectives one after another on 2 channels a fixed credit pays a start-up for every
tensor and every block, and alpha grows as p-1 here while the paper's clusters had 8 nodes. DeAR is ahead of
MG-WFBP in 12 of 15 cases, by up to 1.29x (GPT at 256 workers; the paper claims up to 1.83x over the state of
the art), tied at 1024 workers on ResNet-18 and GPT (one group, as MG-WFBP merges everything there), and
behind on ResNet-18 at 2 workers, where its one-at-a-time all-gathers leave the forward waiting. US-Byte is
ahead of ByteScheduler only at moderate scale (ResNet-18 at 16, GPT at 2 and 16; tied on ResNet-18 at 2); from
64 workers on, its one message per tensor in phase 2 costs more than its gap-filling saves. OASR's merges are
never behind WFBP or MG-WFBP (its model is the simulator's for these plans), ahead of MG-WFBP wherever the
greedy merge hurts later overlap, and ahead of WFBP by far more than the paper's 5-16 % once alpha is large,
since WFBP pays one start-up per tensor. Each stage of a decoupled block is priced at half an all-reduce (the
ring formula, what NCCL's ring reaches); on Gloo at 1 Gbit/s the profiler measured 1.0-1.1 for a
reduce-scatter and 0.6-0.8 for an all-gather, which makes decoupling lose
(`benchmarks/results/2026-11-25-s1-seeds-vgg-gpt-1gbit.md`)."""


def plot(model: str, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    workers = [row["workers"] for row in rows]
    for name in POLICIES:
        style = {"linewidth": 2.5, "color": "black"} if name == "dcredit" else {}
        ax.plot(workers, [row[name] * 1e3 for row in rows], marker="o", label=LABEL[name], **style)
    ax.plot(workers, [row["bound"] * 1e3 for row in rows], "k--", label="bound max(compute, comm)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers")
    ax.set_ylabel("simulated iteration (ms)")
    ax.set_title(f"{model}: simulated iteration time, 1 Gbit/s ring scaled to p workers")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "simulated_scale.md"))
    parser.add_argument("--plots", default=str(REPO / "benchmarks" / "results"), help="folder for the PNGs; '' for none")
    args = parser.parse_args(argv)
    results = {model: table(model) for model in MODELS}
    write_whole(args.out, markdown(results))
    if args.plots:
        for model, rows in results.items():
            plot(model, rows, Path(args.plots) / f"simulated-scale-{model}.png")
    print(Path(args.out).read_text())


if __name__ == "__main__":
    main()
