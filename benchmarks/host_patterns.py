"""Our host work in the training patterns users write, against plain torch: a world of one, on the CPU.

    .venv/bin/python -m benchmarks.host_patterns [--patterns plain,two_optimizers,...] [--rounds 10] [--block 25]

``host_cost`` times a handful of models with one optimizer and one loop.
Scripts do more around their step, and each habit can take our Python
somewhere the plain loop never goes: a second optimizer (whose read guard
sees the first one's work), ``model.zero_grad()`` instead of the
optimizer's (an armed guard sees every ``p.grad``), gradients clipped one
tensor at a time (each operation passes the watch), GradScaler (it reads
every gradient's dtype and device), an EMA of the weights, an LR schedule,
frozen layers, LoRA adapters, weight tying, batch norm. Each pattern here
trains one small model (AdamW unless it says otherwise, a 24-block MLP with
LayerNorm at width 64 unless it says otherwise) two ways in one process,
plain torch and ``dc.DistributedOptimizer``, taking turns in blocks of
``--block`` iterations (the first of each block not counted, ours
synchronized before each switch), ``--rounds`` blocks each. Printed per
pattern: both medians and ours over plain with a bootstrap interval over
turns (``benchmarks/stats.py``). A benchmark, not a test: it checks nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from benchmarks.netem import LoopbackNetwork

PATTERNS = {
    "plain": "one optimizer, optimizer.zero_grad()",
    "frozen": "every third tensor frozen (requires_grad=False)",
    "groups": "AdamW with decayed and undecayed groups",
    "layer_groups": "a parameter group per layer, each with its own learning rate (layer-wise decay)",
    "two_optimizers": "two optimizers, half of the tensors each (AdamW, SGD with momentum)",
    "body_and_head": "the output layer on an optimizer of its own",
    "model_zero_grad": "model.zero_grad() instead of the optimizer's",
    "clip_per_tensor": "clip_grad_norm_(foreach=False): one operation per gradient",
    "grad_scaler": "GradScaler and autocast to bfloat16",
    "ema": "an EMA of the weights after each step, one tensor at a time",
    "lr_schedule": "a cosine LR schedule stepped after each step",
    "hf_like": "model.zero_grad(), clip_grad_norm_ and an LR schedule, as the HF Trainer loop",
    "lora": "the model frozen, rank-4 adapters on every Linear trained",
    "tied": "an embedding tied to the output layer, 16 Linear blocks",
    "conv_bn": "20 convolutions with batch norm",
    "root_reads_all": "300 tensors of a ParameterList read by the root's own forward (F.linear)",
    "shared_block": "one block applied 12 times (ALBERT-style weight sharing)",
    "reversed": "the layers read in the reverse of the order they were registered in",
    "sparse_embedding": "an embedding with sparse gradients under 16 Linear blocks (SGD)",
}
WARMUP = 30


def _model(pattern: str):
    import torch
    from torch import nn

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if pattern == "tied":
        from benchmarks.models import TiedLM

        return TiedLM(), torch.randint(0, 512, (2, 16), generator=gen), torch.randint(0, 512, (32,), generator=gen)
    if pattern == "root_reads_all":
        from benchmarks.models import RootReadsAll

        return RootReadsAll(), torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    if pattern == "shared_block":
        from benchmarks.models import SharedBlock

        return SharedBlock(), torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    if pattern == "sparse_embedding":
        from benchmarks.models import SparseEmbeddingMLP

        return (SparseEmbeddingMLP(), torch.randint(0, 5000, (16, 8), generator=gen),
                torch.randint(0, 10, (16,), generator=gen))
    if pattern == "conv_bn":
        layers = [nn.Conv2d(3, 16, 3, padding=1)]
        for _ in range(20):
            layers += [nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1)]
        model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
        return model, torch.randn(2, 3, 16, 16, generator=gen), torch.randint(0, 10, (2,), generator=gen)
    layers = []
    for _ in range(24):
        layers += [nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(64, 10))
    if pattern == "reversed":
        from benchmarks.models import ReadBackwards

        model = ReadBackwards(model)
    if pattern == "lora":
        for p in model.parameters():
            p.requires_grad_(False)
        for layer in model:
            if isinstance(layer, nn.Linear):
                layer.lora = nn.Sequential(nn.Linear(layer.in_features, 4, bias=False),
                                           nn.Linear(4, layer.out_features, bias=False))
                nn.init.zeros_(layer.lora[1].weight)
                layer.register_forward_hook(lambda mod, args, out: out + mod.lora(args[0]))
    if pattern == "frozen":
        for i, p in enumerate(model.parameters()):
            p.requires_grad_(i % 3 != 0)
    return model, torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)


class Setup:
    """One pattern trained one way: the model, its optimizers, its batch, and what the loop does around them."""

    def __init__(self, pattern: str, way: str):
        import torch

        self.pattern, self.way = pattern, way
        self.model, self.x, self.y = _model(pattern)
        trained = [p for p in self.model.parameters() if p.requires_grad]
        if pattern in ("two_optimizers", "body_and_head"):
            cut = len(trained) // 2 if pattern == "two_optimizers" else len(trained) - 2
            opts = [torch.optim.AdamW(trained[:cut], lr=1e-3), torch.optim.SGD(trained[cut:], lr=1e-2, momentum=0.9)]
        elif pattern == "groups":
            opts = [torch.optim.AdamW([{"params": [p for p in trained if p.dim() > 1], "weight_decay": 0.1},
                                       {"params": [p for p in trained if p.dim() <= 1], "weight_decay": 0.0}],
                                      lr=1e-3)]
        elif pattern == "sparse_embedding":
            opts = [torch.optim.SGD(trained, lr=1e-2)]  # torch's AdamW takes no sparse gradient
        elif pattern == "layer_groups":
            layers = [m for m in self.model if any(p.requires_grad for p in m.parameters(recurse=False))]
            opts = [torch.optim.AdamW([{"params": list(m.parameters()), "lr": 1e-3 * 0.9 ** (len(layers) - k)}
                                       for k, m in enumerate(layers)], lr=1e-3)]
        else:
            opts = [torch.optim.AdamW(trained, lr=1e-3)]
        if way == "dc":
            import dcredit_opt as dc

            names = {id(p): n for n, p in self.model.named_parameters()}
            opts = [dc.DistributedOptimizer(o, named_parameters=[(names[id(p)], p) for g in o.param_groups
                                                                 for p in g["params"]]) for o in opts]
        self.opts = opts
        self.ema = [p.detach().clone() for p in self.model.parameters()] if pattern == "ema" else None
        self.schedule = (torch.optim.lr_scheduler.CosineAnnealingLR(opts[0], 10_000)
                         if pattern in ("lr_schedule", "hf_like") else None)
        self.scaler = torch.amp.GradScaler("cpu") if pattern == "grad_scaler" else None

    def iteration(self) -> None:
        import torch
        from torch import nn

        model, opts, pattern = self.model, self.opts, self.pattern
        if pattern in ("model_zero_grad", "hf_like"):
            model.zero_grad()
        else:
            for o in opts:
                o.zero_grad()
        if self.scaler is not None:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(self.x), self.y)
            self.scaler.scale(loss).backward()
            for o in opts:
                self.scaler.step(o)
            self.scaler.update()
            return
        nn.functional.cross_entropy(model(self.x), self.y).backward()
        if pattern == "clip_per_tensor":
            nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
        elif pattern == "hf_like":
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for o in opts:
            o.step()
        if self.schedule is not None:
            self.schedule.step()
        if self.ema is not None:
            with torch.no_grad():
                for e, p in zip(self.ema, model.parameters()):
                    e.mul_(0.99).add_(p, alpha=0.01)

    def turn(self, iters: int) -> list[float]:
        """``iters`` iterations, each one's wall time; then ours apply what they left pending, so that no read
        guard of theirs is armed while the other way runs."""
        clock = time.perf_counter
        walls = []
        for _ in range(iters):
            t = clock()
            self.iteration()
            walls.append(clock() - t)
        for o in self.opts:
            if hasattr(o, "synchronize"):
                o.synchronize()
        return walls


def run(patterns: list[str], rounds: int, block: int) -> dict:
    """In this process (a world of one): each pattern, plain and ours taking turns. Iteration times per turn."""
    import warnings

    import torch
    import torch.distributed as dist

    import dcredit_opt as dc

    warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    dc.init()
    out = {}
    for pattern in patterns:
        setups = {way: Setup(pattern, way) for way in ("plain", "dc")}
        walls = {way: [] for way in setups}
        for way, s in setups.items():
            s.turn(WARMUP)
        for _ in range(rounds):
            for way, s in setups.items():
                walls[way].append(s.turn(block)[1:])
        out[pattern] = {"walls": walls, "tensors": sum(p.requires_grad for p in setups["plain"].model.parameters())}
    dc.shutdown()
    dist.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--patterns", default=",".join(PATTERNS), help=f"comma-separated, of {', '.join(PATTERNS)}")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--block", type=int, default=25)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    patterns = args.patterns.split(",")
    unknown = [x for x in patterns if x not in PATTERNS]
    if unknown:
        p.error(f"unknown pattern(s) {', '.join(unknown)}; known: {', '.join(PATTERNS)}")
    if args.rounds < 1 or args.block < 2:
        p.error(f"--rounds must be at least 1 and --block at least 2; got {args.rounds} and {args.block}")
    if args.child:
        print(json.dumps(run(patterns, args.rounds, args.block)))
        return
    from benchmarks.stats import speedup_interval

    net = LoopbackNetwork(1)
    env = dict(os.environ, MASTER_ADDR=net.master_addr, MASTER_PORT=str(net.next_port()), OMP_NUM_THREADS="1")
    child = subprocess.run([sys.executable, "-m", "benchmarks.host_patterns", "--child", "--patterns",
                            ",".join(patterns), "--rounds", str(args.rounds), "--block", str(args.block)],
                           env=env, capture_output=True, text=True, timeout=3600, check=False)
    if child.returncode != 0:
        raise SystemExit(f"the timed process failed:\n{child.stderr[-3000:]}")
    results = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"# host cost of training patterns, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"a world of one, one process, {args.rounds} turns of {args.block} iterations per way")
    print(f"{'pattern':16s} {'tensors':>7s} {'plain ms':>9s} {'dc ms':>7s}  dc / plain [95 % interval]  what it does")
    for pattern in patterns:
        r = results[pattern]
        plain, ours = r["walls"]["plain"], r["walls"]["dc"]
        med = {w: statistics.median(t for turn in r["walls"][w] for t in turn) for w in ("plain", "dc")}
        ci = speedup_interval(plain, ours)
        interval = f"[{1 / ci[1]:.2f}, {1 / ci[0]:.2f}]" if ci else "-"
        print(f"{pattern:16s} {r['tensors']:7d} {med['plain'] * 1e3:9.2f} {med['dc'] * 1e3:7.2f}  "
              f"{med['dc'] / med['plain']:.2f}x {interval:14s}  {PATTERNS[pattern]}")


if __name__ == "__main__":
    main()
