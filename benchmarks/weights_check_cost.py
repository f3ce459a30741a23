"""What comparing the ranks' weights costs (Note [Same weights] in dcredit_opt/optimizer/usage.py).

    .venv/bin/python -m benchmarks.weights_check_cost [--reps 7] [--every 100]

Every ``Config.check_weights_every`` iterations each rank takes an exact fingerprint of every parameter on
its training thread (``usage.fingerprints``: an integer sum of its bits) and sends two integers per parameter
in that iteration's tally. For each model of the benchmarks (built as the benchmarks build them, on the CPU,
one thread), this prints the fingerprint's time (median of ``--reps``), the tally's extra bytes, and what
that adds to an iteration on average at ``--every``, against the model's own compute (forward and backward at
its default batch, measured here): a benchmark, it checks nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.models import MODELS, get_model, loss_fn
from dcredit_opt.optimizer.usage import fingerprints


def _median_s(fn, reps: int) -> float:
    fn()  # warm
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--every", type=int, default=100)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"# weights check, {torch.get_num_threads()} thread, a check every {args.every} iterations")
    print("| model | parameter tensors | MiB of weights | fingerprint | extra tally bytes | compute (fwd+bwd) "
          "| per iteration at the interval | share of compute |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in MODELS:
        spec = get_model(name)
        torch.manual_seed(0)
        model = spec.build()
        params = [q for q in model.parameters() if q.requires_grad]
        x, y = spec.make_batch(spec.default_batch, torch.Generator().manual_seed(1))

        def iteration(model=model, x=x, y=y):
            model.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()

        check_s = _median_s(lambda params=params: fingerprints(params), args.reps)
        compute_s = _median_s(iteration, max(1, args.reps // 2))
        mib = sum(q.numel() * q.element_size() for q in params) / 2**20
        per_iter = check_s / args.every
        print(f"| {name} | {len(params)} | {mib:.1f} | {check_s * 1e3:.2f} ms | {8 * len(params)} | "
              f"{compute_s * 1e3:.1f} ms | {per_iter * 1e6:.1f} us | {per_iter / compute_s * 100:.3f} % |")


if __name__ == "__main__":
    main()
