"""What the read guard (Note [Guarded reads] in ``dcredit_opt/optimizer/reads.py``) costs per iteration.

    .venv/bin/python -m benchmarks.guard_cost --models gpt,vgg,resnet18

One process (a world of one: the lazy step still defers every update to
the next forward, so the guard is armed exactly as in a real job). For each
model it prints the torch operations the armed guard sees per iteration,
the guard's cost per operation (an armed guard against none, on one small
operation, best of several repeats), their product as the cost per
iteration, and that cost as a share of the measured iteration time. It also
times whole forwards with the guard armed and with it kept disarmed,
interleaved, and prints the medians: on a busy machine that difference is
noise-bound, which is why the product is the figure to quote. A benchmark,
not a test: it prints numbers and checks nothing.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
import timeit
import types

import torch
from torch.overrides import TorchFunctionMode

import dcredit_opt as dc
from benchmarks.models import get_model, loss_fn
from dcredit_opt.optimizer.buffers import per_tensor
from dcredit_opt.optimizer.reads import PendingReadGuard


class _Counter(TorchFunctionMode):
    """Counts the torch operations that run while the guard is armed."""

    def __init__(self, guard: PendingReadGuard):
        super().__init__()
        self.guard, self.ops = guard, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.guard.armed:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def per_op_cost_us(search: str = "cpp", op_kind: str = "other", repeats: int = 7, number: int = 5000) -> float:
    """An armed guard's cost on one small operation, in µs: ``op_kind`` "other" reads no parameter
    (``torch.add(x, 1)``), "applied" reads two parameters whose updates were applied already (``F.linear(x, w,
    b)``, a forward's usual operation while other updates wait). ``search``: "cpp", the guard's C++ address table
    (Note [Guard cost]), or "python", the same search in Python (``Addresses.read_by``)."""
    weight, bias, waiting = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.zeros(8)), torch.zeros(4)
    params = [weight, bias, waiting]
    pending = per_tensor(len(params), "B")
    pending[2] = 1  # one pending update, never read here
    idle = types.SimpleNamespace(lazy=types.SimpleNamespace(npending=1, pending=pending))  # an optimizer's core
    guard = PendingReadGuard(lambda: idle)
    guard.arm(params, [p.data_ptr() for p in params], pending)
    if search == "python":
        guard._addresses._table = None
    x = torch.ones(8)

    def op():
        if op_kind == "other":
            torch.add(x, 1)
        else:
            torch.nn.functional.linear(x, weight, bias)

    armed = min(timeit.repeat(op, number=number, repeat=repeats)) / number
    guard.remove()
    plain = min(timeit.repeat(op, number=number, repeat=repeats)) / number
    return max(0.0, armed - plain) * 1e6


def measure(name: str, iters: int, warmup: int) -> dict:
    spec = get_model(name)
    torch.manual_seed(0)
    model = spec.build()
    x, y = spec.make_batch(spec.default_batch, torch.Generator().manual_seed(0))
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                  named_parameters=model.named_parameters(),
                                  config=dc.Config(policy="fixed", lazy_step="on"))
    guard = opt._dc.lazy.guard
    arm = guard.arm
    counter = _Counter(guard)
    iteration, forward = {True: [], False: []}, {True: [], False: []}
    ops = []
    for i in range(warmup + 2 * iters):
        on = i % 2 == 0  # this forward's guard, interleaved: armed, disarmed, armed, ...
        t0 = time.perf_counter()
        opt.zero_grad()
        with counter:
            counter.ops = 0
            t1 = time.perf_counter()
            loss = loss_fn(model(x), y)
            t2 = time.perf_counter()
        loss.backward()
        guard.arm = (lambda params, where, pending: None) if on else arm  # step() arms the guard for the next forward
        opt.step()
        t3 = time.perf_counter()
        if i >= warmup:
            forward[on].append(t2 - t1)
            iteration[on].append(t3 - t0)
            if on:
                ops.append(counter.ops)
    guard.arm = arm
    assert opt._dc.lazy.deferred, "the lazy step was off: nothing to measure"
    opt._dc.close()
    return {"model": name, "ops": statistics.median(ops),
            "forward_armed_s": statistics.median(forward[True]),
            "forward_disarmed_s": statistics.median(forward[False]),
            "iteration_s": statistics.median(iteration[True] + iteration[False])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,vgg,resnet18")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per setting")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    dc.init()
    costs = {(search, kind): per_op_cost_us(search, kind) for kind in ("other", "applied") for search in ("python", "cpp")}
    per_op = max(costs["cpp", "other"], costs["cpp", "applied"])
    print(f"# read guard cost, {datetime.date.today()}, torch {torch.__version__}, {platform.processor() or '?'} "
          f"({torch.get_num_threads()} threads), world of one")
    for kind, what in (("other", "reading no parameter, torch.add(x, 1)"),
                       ("applied", "reading two parameters already updated, F.linear(x, w, b)")):
        print(f"armed guard, per torch operation {what}: {costs['cpp', kind]:.2f} us with the C++ table, "
              f"{costs['python', kind]:.2f} us with the search in Python (best of 7 x 5000)")
    print("| model | ops seen armed | cost per iteration | iteration | share | forward armed | forward disarmed |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        r = measure(name, args.iters, args.warmup)
        cost_s = r["ops"] * per_op * 1e-6
        print(f"| {name} | {r['ops']:.0f} | {cost_s * 1e3:.2f} ms | {r['iteration_s']:.3f} s | "
              f"{100 * cost_s / r['iteration_s']:.2f} % | {r['forward_armed_s']:.3f} s | "
              f"{r['forward_disarmed_s']:.3f} s |")
    dc.shutdown()


if __name__ == "__main__":
    main()
