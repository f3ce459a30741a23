"""Our host work per iteration where compute is small: a world of one, on the CPU.

    .venv/bin/python -m benchmarks.host_cost [--model gpt|transformer|resnet50|mlp|lstm] [--rounds 4] [--iters 150]
    .venv/bin/python -m benchmarks.host_cost --together [--rounds 8] [--block 25] [--ways plain,ddp,dc,dc-link]

On a fast GPU an iteration of the benchmark's models takes milliseconds, and
what the optimizer does on the host (the gradient hooks, the read guard,
the hand-off of blocks to the scheduler's thread, the wrapped step) decides
the iteration time. Without a GPU this is its stand-in: a model with the
GPT-like model's structure (its layers and heads, 77 parameters in 40
modules) at width 64, vocabulary 512 and context 16, so that its compute
takes a few milliseconds on one core. Three more shapes with many small
tensors: ``transformer``, the same blocks 12 deep with 4 heads (149
parameter tensors), ``resnet50``, ResNet-50's bottleneck stages at base
width 8 on 32x32 images (161 parameter tensors, batch norm in every block),
and ``mlp``, 24 pre-norm residual blocks of width 64 (100 parameter tensors,
LayerNorm in every block, under a millisecond of compute). And one with few
large tensors: ``lstm``, a language model (an embedding of 5000 x 128, two
LSTM layers of 256, an output layer: 11 tensors, 11.6 MB of gradients), whose
forward needs the embedding's update at once. ``--optimizer adamw`` trains
with AdamW instead of SGD with momentum.

Three ways to train it, each in its own process, one at a time, the rounds
interleaving them: ``plain`` (the optimizer alone), ``ddp`` (DDP at a
world of one over Gloo) and ``dc`` (``dc.DistributedOptimizer`` at a world of
one over Gloo; it measures and plans in the warm-up), and, with ``--ways
plain,dc,dc-link``, ``dc-link``: the same planned for the link alone
(``Config(collective_host_s=0)``). Each process runs 30 warm-up iterations,
then ``--iters`` timed ones, and reports every iteration's wall time, its
training thread's CPU time per iteration and, for ours, the collectives per
iteration of its plan. Printed: medians per way, and ``dc`` against the
others with bootstrap intervals over processes (``benchmarks/stats.py``). A
benchmark, not a test: it prints numbers and checks nothing.

With ``--together`` every way runs in one process on its own copy of the
model, taking turns in blocks of ``--block`` iterations: on a machine that
other jobs share (the 2-core development machine always is), load then weighs
on every way alike, and the ratios are the figures to quote; the intervals
are over turns. It also prints each phase's median per way (``zero_grad``,
forward, backward, ``step()``) and ours minus the others': with a lazy step
our forward applies the updates that the others make in ``step()``.

What each iteration does besides one forward, backward and step (``Loop``):
``--zero-grad zeros`` zeroes the gradients in place instead of dropping them,
``--clip`` clips their norm between backward and step, and ``--passes N``
accumulates N forward-backward passes per step (DDP reduces only the last,
under ``no_sync()`` before it; ours counts them, ``backward_passes_per_step``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from benchmarks.netem import LoopbackNetwork

WAYS = ("plain", "ddp", "dc", "dc-link")
"""``dc-link`` is ``dc`` planned for the link alone (``Config(collective_host_s=0)``): what charging each
collective's host time in the plan is worth. Not run unless ``--ways`` names it."""
WARMUP = 30


@dataclasses.dataclass(frozen=True)
class Loop:
    """What each timed iteration does besides forward, backward and ``step()``, the same for every way."""

    set_to_none: bool = True  # zero_grad() drops the gradients (torch's default), else zeroes them in place
    clip: bool = False  # clip_grad_norm_ between backward and step
    passes: int = 1  # forward-backward passes per step: gradients accumulated over them

    def args(self) -> list[str]:
        """The command-line arguments that give this loop to a child process."""
        return (["--zero-grad", "none" if self.set_to_none else "zeros", "--passes", str(self.passes)]
                + (["--clip"] if self.clip else []))

    def describe(self) -> str:
        return (("" if self.set_to_none else ", zero_grad to zeros") + (", clip_grad_norm_" if self.clip else "")
                + (f", {self.passes} passes per step" if self.passes > 1 else ""))


MODELS = ("gpt", "transformer", "resnet50", "mlp", "lstm")
OPTIMIZERS = ("sgd", "adamw")
"""``sgd``: SGD with momentum; ``adamw``: AdamW with weight decay (its default, foreach, implementation)."""
MLP_BLOCKS = 24
"""The ``mlp`` model: this many residual blocks of LayerNorm then Linear at width 64 (4 parameter tensors each,
plus the stem's and the head's: 100 tensors) on 16 inputs of 64 features."""


def _model_and_batch(name: str):
    import torch

    from benchmarks.models import GPT_HEADS, GPT_LAYERS, GPTLike, LSTMLanguageModel, ResidualMLP, ResNet50Shaped

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name == "mlp":
        return ResidualMLP(blocks=MLP_BLOCKS), torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    if name == "lstm":
        shape = (8, 24)
        return (LSTMLanguageModel(), torch.randint(0, 5000, shape, generator=gen),
                torch.randint(0, 5000, shape, generator=gen))
    if name == "resnet50":
        return ResNet50Shaped(width=8), torch.randn(2, 3, 32, 32, generator=gen), torch.randint(0, 10, (2,),
                                                                                               generator=gen)
    layers, heads = (GPT_LAYERS, GPT_HEADS) if name == "gpt" else (12, 4)
    model = GPTLike(vocab=512, context=16, width=64, layers=layers, heads=heads)
    return model, torch.randint(0, 512, (2, 16), generator=gen), torch.randint(0, 512, (2, 16), generator=gen)


def _optimizer(name: str, params):
    import torch

    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _build(way: str, model_name: str, optimizer: str = "sgd", passes: int = 1):
    """The model, its batch and its optimizer trained the way ``way``: ``(net, opt, x, y, parameter tensors)``.
    The default process group (and ``dc.init()`` for ours) must be up for every way but ``plain``. ``passes``:
    backward passes per step (ours is told; DDP's are skipped with ``no_sync()`` in ``_timed``)."""
    import torch

    model, x, y = _model_and_batch(model_name)
    opt = _optimizer(optimizer, model.parameters())
    net = torch.nn.parallel.DistributedDataParallel(model) if way == "ddp" else model
    if way in ("dc", "dc-link"):
        import dcredit_opt as dc

        config = dc.Config(collective_host_s=0.0) if way == "dc-link" else None
        opt = dc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), config=config,
                                      backward_passes_per_step=passes)
    return net, opt, x, y, len(list(model.parameters()))


PHASES = ("zero_grad", "forward", "backward", "step")
"""The phases of an iteration timed apart; ``backward`` includes the clip where there is one. With a lazy step our
``step()`` leaves the optimizer's own work to the next forward, which applies the updates."""


def _timed(net, opt, x, y, iters: int, loop: Loop, phases: dict | None = None) -> tuple[list[float], float]:
    """``iters`` training iterations as ``loop`` says: each one's wall time, and the training thread's CPU per
    iteration. ``phases``: where given, each phase's time of each iteration is appended to its list
    (:data:`PHASES`; with several passes, forward and backward are their sums)."""
    import torch

    from benchmarks.models import loss_fn

    walls = []
    clock = time.perf_counter
    cpu0 = time.thread_time()
    no_sync = getattr(net, "no_sync", contextlib.nullcontext)  # DDP's: no reduction before the last pass
    for _ in range(iters):
        t0 = clock()
        opt.zero_grad(set_to_none=loop.set_to_none)
        t1 = clock()
        forward = backward = 0.0
        for k in range(loop.passes):
            with no_sync() if k < loop.passes - 1 else contextlib.nullcontext():
                a = clock()
                loss = loss_fn(net(x), y)
                b = clock()
                loss.backward()
                forward, backward = forward + b - a, backward + clock() - b
        if loop.clip:
            c = clock()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            backward += clock() - c
        t3 = clock()
        opt.step()
        t4 = clock()
        walls.append(t4 - t0)
        if phases is not None:
            for name, dt in zip(PHASES, (t1 - t0, forward, backward, t4 - t3)):
                phases[name].append(dt)
    return walls, (time.thread_time() - cpu0) / iters


def _collectives(opt) -> int | None:
    """Collectives per iteration of our optimizer's plan; None for the others."""
    from dcredit_opt.planner.plan import stages_of

    return len(stages_of(opt.plan)) if hasattr(opt, "plan") else None


def run_one(way: str, iters: int, model_name: str = "gpt", optimizer: str = "sgd", loop: Loop = Loop()) -> dict:
    """In this process: train the small model ``model_name`` the way ``way`` and return its timings."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if way != "plain":
        dist.init_process_group("gloo", rank=0, world_size=1)
    if way in ("dc", "dc-link"):
        import dcredit_opt as dc

        dc.init()
    net, opt, x, y, params = _build(way, model_name, optimizer, loop.passes)
    _timed(net, opt, x, y, WARMUP, loop)
    walls, cpu = _timed(net, opt, x, y, iters, loop)
    collectives = _collectives(opt)
    if way in ("dc", "dc-link"):
        dc.shutdown()
    if way != "plain":
        dist.destroy_process_group()
    return {"way": way, "iter_s": walls, "train_cpu_s": cpu, "params": params, "collectives": collectives}


def run_together(ways: list[str], rounds: int, block: int, model_name: str, optimizer: str = "sgd",
                 loop: Loop = Loop()) -> dict:
    """In this process: every way on its own copy of the model, taking turns in blocks of ``block``
    iterations (the first of each block, after the switch, not counted), ``rounds`` blocks each, so that
    whatever else the machine runs weighs on every way alike. Our optimizers apply what is pending before
    each switch (``synchronize()``), so no way runs with another's read guard armed."""
    import torch
    import torch.distributed as dist

    import dcredit_opt as dc

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    dc.init()
    runners = {way: _build(way, model_name, optimizer, loop.passes) for way in ways}
    walls = {w: [] for w in ways}
    cpus = {w: [] for w in ways}
    phases = {w: {name: [] for name in PHASES} for w in ways}

    def turn(way: str, iters: int, keep: bool) -> None:
        net, opt, x, y, _ = runners[way]
        timed = {name: [] for name in PHASES}
        block_walls, cpu = _timed(net, opt, x, y, iters, loop, timed)
        if keep:
            walls[way].append(block_walls[1:])
            cpus[way].append(cpu)
            for name in PHASES:
                phases[way][name].extend(timed[name][1:])
        if hasattr(opt, "synchronize"):
            opt.synchronize()

    for way in ways:
        turn(way, WARMUP, keep=False)
    for _ in range(rounds):
        for way in ways:
            turn(way, block, keep=True)
    collectives = {way: _collectives(runners[way][1]) for way in ways}
    dc.shutdown()
    dist.destroy_process_group()
    medians = {w: {name: statistics.median(phases[w][name]) for name in PHASES} for w in ways}
    return {"walls": walls, "cpus": cpus, "collectives": collectives, "params": runners[ways[0]][4],
            "phases": medians}


def _child(net: LoopbackNetwork, timeout_s: float, *args: str) -> dict:
    """``python -m benchmarks.host_cost *args`` in a process of its own at a world of one; its JSON line."""
    env = dict(os.environ, MASTER_ADDR=net.master_addr, MASTER_PORT=str(net.next_port()), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "benchmarks.host_cost", *args],
                         env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _summary(ways: list[str], walls: dict, cpus: dict, plans: dict, params: int) -> None:
    """Medians per way, then ``dc`` against each other way with a bootstrap interval over ``walls``' lists
    (launches, or turns). ``walls[way]``: lists of iteration times; ``cpus[way]``: CPU per iteration, one per
    list; ``plans[way]``: what to say of its collectives ("" for nothing)."""
    from benchmarks.stats import speedup_interval

    med = {}
    for way in ways:
        med[way] = statistics.median(t for times in walls[way] for t in times)
        cpu = statistics.median(cpus[way])
        print(f"{way:7s} iteration {med[way] * 1e3:7.2f} ms (median)   training thread CPU {cpu * 1e3:7.2f} ms"
              f"{plans[way]}")
    for base in [w for w in ("plain", "ddp", "dc-link") if w in ways]:
        ci = speedup_interval(walls[base], walls["dc"])
        ratio = med["dc"] / med[base]
        text = f"[{1 / ci[1]:.2f}, {1 / ci[0]:.2f}]" if ci else "-"
        print(f"dc / {base}: {ratio:.2f}x the time {text}; {(med['dc'] - med[base]) * 1e3:+.2f} ms per iteration "
              f"({(med['dc'] - med[base]) / params * 1e6:+.1f} us per parameter)")


def _phase_table(ways: list[str], medians: dict) -> None:
    """Each phase's median per way (``medians[way][phase]``, seconds), and ours minus each other way's. With a lazy
    step, our forward applies the updates that the others make in ``step()``."""
    print("phase medians (us): " + "  ".join(f"{w:>9s}" for w in ways)
          + "".join(f"  dc-{w:<6s}" for w in ways if w != "dc"))
    for name in PHASES:
        row = "  ".join(f"{medians[w][name] * 1e6:9.1f}" for w in ways)
        diffs = "".join(f"  {(medians['dc'][name] - medians[w][name]) * 1e6:+9.1f}" for w in ways if w != "dc")
        print(f"  {name:17s}  {row}{diffs}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--iters", type=int, default=150)
    p.add_argument("--model", choices=MODELS, default="gpt")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd")
    p.add_argument("--ways", default="plain,ddp,dc", help=f"comma-separated, of {', '.join(WAYS)}")
    p.add_argument("--together", action="store_true",
                   help="every way in one process, taking turns in blocks of --block iterations (--rounds blocks "
                        "each): on a busy machine, the comparison to trust")
    p.add_argument("--block", type=int, default=25)
    p.add_argument("--zero-grad", choices=("none", "zeros"), default="none",
                   help="each iteration's optimizer.zero_grad(): to None (torch's default) or zeros in place "
                        "(set_to_none=False)")
    p.add_argument("--clip", action="store_true", help="clip_grad_norm_ between backward and step, as most "
                                                       "transformer training does")
    p.add_argument("--passes", type=int, default=1, help="forward-backward passes per step (gradient "
                                                         "accumulation): DDP under no_sync() before the last, ours "
                                                         "with backward_passes_per_step")
    p.add_argument("--one", choices=WAYS, help=argparse.SUPPRESS)  # a child process
    p.add_argument("--child-together", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.passes < 1:
        p.error(f"--passes must be at least 1; got {args.passes}")
    loop = Loop(set_to_none=args.zero_grad == "none", clip=args.clip, passes=args.passes)
    if args.one:
        print(json.dumps(run_one(args.one, args.iters, args.model, args.optimizer, loop)))
        return
    if args.child_together:
        print(json.dumps(run_together(args.ways.split(","), args.rounds, args.block, args.model, args.optimizer,
                                      loop)))
        return

    ways = args.ways.split(",")
    unknown = sorted(set(ways) - set(WAYS))
    if unknown or "dc" not in ways:
        p.error(f"--ways must include dc and name only {', '.join(WAYS)}; got {args.ways!r}")
    net = LoopbackNetwork(1)
    machine = f"# host cost, {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    model = f"a world of one, {args.model}-shaped model, {args.optimizer}{loop.describe()}"
    extra = loop.args()
    if args.together:
        r = _child(net, 1800, "--child-together", "--ways", ",".join(ways), "--rounds", str(args.rounds),
                   "--block", str(args.block), "--model", args.model, "--optimizer", args.optimizer,
                   *extra)
        print(f"{machine}, one process, {args.rounds} turns of {args.block} iterations per way, {model} "
              f"({r['params']} parameter tensors)")
        plans = {w: "" if r["collectives"][w] is None else f"   collectives per iteration: {r['collectives'][w]}"
                 for w in ways}
        _summary(ways, r["walls"], r["cpus"], plans, r["params"])  # intervals over turns
        _phase_table(ways, r["phases"])
        return
    runs: dict[str, list[dict]] = {w: [] for w in ways}
    for _ in range(args.rounds):
        for way in ways:
            runs[way].append(_child(net, 600, "--one", way, "--iters", str(args.iters), "--model", args.model,
                                       "--optimizer", args.optimizer, *extra))
    params = runs["dc"][0]["params"]
    print(f"{machine}, {args.rounds} rounds x {args.iters} iterations, {model} ({params} parameter tensors)")
    plans = {}
    for way in ways:
        seen = sorted({r["collectives"] for r in runs[way] if r["collectives"] is not None})
        plans[way] = f"   collectives per iteration (plans of the {len(runs[way])} processes): {seen}" if seen else ""
    _summary(ways, {w: [r["iter_s"] for r in runs[w]] for w in ways},
             {w: [r["train_cpu_s"] for r in runs[w]] for w in ways}, plans, params)  # intervals over processes


if __name__ == "__main__":
    main()
