"""F5.2: ranks that disagree: detected and reported, never a hang.

- Different models, and different optimizer settings (which would cut the
  gradients into different blocks): refused when the optimizer is built,
  on every rank, naming the parameter position (or the setting) and the
  ranks that differ.
- A rank that runs one backward() more than backward_passes_per_step
  allows: it raises at once, naming the parameter; its peers get an engine
  error naming the block, the tensor and the phase.
- A rank that runs one iteration more than the others: it raises within
  the timeout, naming the block it waited for.
- Parameters used only on some ranks (so their gradients become ready in a
  different order, or never during backward): the block sequence must stay
  the same on every rank (Note [Same order on every rank]) and training
  must equal the synchronous reference.
"""

from __future__ import annotations

import copy
import datetime
import re
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dcredit_opt as dc
from tests import timing

from . import spawn, workers

# Config.timeout_s: long enough that a rank slowed by other jobs is not taken
# for a stalled one (tests/timing.py).
TIMEOUT_S = timing.STALL_TIMEOUT_S
# How late after TIMEOUT_S a rank may raise: the block it waits for is
# launched a little after its peer stopped reducing, and Python formats and
# prints the error, all on a busy machine.
RAISE_MARGIN_S = timing.scaled(10.0)


def _init() -> int:
    # The launcher's group, with a generous timeout for a loaded machine.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timing.scaled(120)))
    return dist.get_rank()


# ---- at construction ------------------------------------------------------------


def construction_worker() -> dict:
    """Each variant builds a model/optimizer that differs on rank 1; returns each rank's error."""
    rank = _init()
    fixed = {"block_bytes": 64, "window": 2, "policy": "fixed", "timeout_s": TIMEOUT_S}

    def build(variant):
        torch.manual_seed(0)
        model = workers.Net(branch=(variant == "count" and rank == 1))
        kwargs, config = {}, dc.Config(**fixed)
        if rank == 1:
            if variant == "shape":
                model.mid = nn.Linear(32, 61 + 1)  # position 2: mid.weight
            elif variant == "dtype":
                model.out.double()  # position 6: out.weight
            elif variant == "frozen":
                model.inp.weight.requires_grad_(False)  # position 0 is inp.bias here, inp.weight on rank 0
            elif variant == "config":
                config = dc.Config(**{**fixed, "block_bytes": 128})
            elif variant == "bpps":
                kwargs["backward_passes_per_step"] = 2
        return dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), config=config, **kwargs)

    out = {}
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)  # torch's first optimizer imports dynamo: seconds
    dist.barrier()  # start-up skew is not ours to time
    for variant in ("shape", "count", "dtype", "frozen", "config", "bpps"):
        start = time.monotonic()
        try:
            build(variant)._dc.close()
            out[variant] = "no error"
        except ValueError as e:
            out[variant] = f"ValueError: {e}"
        out[variant + "_s"] = time.monotonic() - start
    # The job is still healthy: the same model trains.
    torch.manual_seed(0)
    model = workers.Net()
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), config=dc.Config(**fixed))
    for step in range(3):
        opt.zero_grad()
        workers.loss_of(model, workers.batch(step, rank)).backward()
        opt.step()
    opt.synchronize()
    out["checksum"] = workers.checksum(model)
    return out


@pytest.mark.timeout(300)
def test_different_models_and_settings_are_refused_at_construction():
    results = spawn.run(construction_worker, 2, timeout_s=280)
    expect = {
        "shape": r"model differs between ranks: at parameter position 2, rank {r} has 'mid\.weight' with shape "
                 r"\({w}, 32\).*ranks \[1\] differ from rank 0",
        "count": r"at parameter position 8, rank {r} has {here}.*ranks \[1\] differ from rank 0 there "
                 r"\(parameter counts per rank: \[8, 10\]\)",
        "dtype": r"at parameter position 6, rank {r} has 'out\.weight' .* dtype torch\.{dt}.*ranks \[1\]",
        "frozen": r"at parameter position 0, rank {r} has '{first}'.*ranks \[1\]",
        "config": r"settings differ between ranks: Config\.block_bytes \(ranks \[1\] differ from rank 0\)\. "
                  r"Rank {r} has Config\.block_bytes={bb}$",
        "bpps": r"settings differ between ranks: backward_passes_per_step \(ranks \[1\] differ from rank 0\)",
    }
    for r, out in enumerate(results):
        fill = {"r": r, "w": 61 if r == 0 else 62, "here": "no parameter" if r == 0 else r"'branch\.weight'",
                    "dt": "float32" if r == 0 else "float64", "first": "inp.weight" if r == 0 else "inp.bias",
                    "bb": 64 if r == 0 else 128}
        for variant, pattern in expect.items():
            message = out[variant]
            assert message.startswith("ValueError: "), f"rank {r}, {variant}: {message}"
            assert re.search(pattern.format(**fill), message), f"rank {r}, {variant}: {message}"
            assert out[variant + "_s"] < TIMEOUT_S, f"rank {r}, {variant}: took {out[variant + '_s']:.1f} s"
    assert results[0]["checksum"] == results[1]["checksum"]


# ---- a different number of backward passes or iterations ---------------------------


def extra_backward_worker() -> None:
    """Rank 1 runs a second backward() in step 2 with backward_passes_per_step=1."""
    rank = _init()
    torch.manual_seed(0)
    model = workers.Net()
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  config=dc.Config(block_bytes=64, window=2, policy="fixed", timeout_s=TIMEOUT_S))
    try:
        for step in range(6):
            opt.zero_grad()
            workers.loss_of(model, workers.batch(step, rank)).backward()
            if rank == 1 and step == 2:
                workers.loss_of(model, workers.batch(step, rank)).backward()
            opt.step()
        opt.synchronize()
    except Exception as e:
        print(f"RAISED rank={rank} at={time.time():.3f} {type(e).__module__}.{type(e).__name__}: {e}", flush=True)
        raise


def extra_iteration_worker() -> None:
    """Rank 1 runs one iteration more; rank 0 stops reducing and does something else for a while."""
    rank = _init()
    torch.manual_seed(0)
    model = workers.Net()
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  config=dc.Config(block_bytes=64, window=2, policy="fixed", timeout_s=TIMEOUT_S))
    steps = 4 + rank
    try:
        for step in range(steps):
            opt.zero_grad()
            workers.loss_of(model, workers.batch(step, rank)).backward()
            opt.step()
        opt.synchronize()
        print(f"DONE rank={rank} at={time.time():.3f}", flush=True)
        if rank == 0:
            # Evaluating, say: alive, sockets open, not reducing, for as long as rank 1 may take to raise.
            time.sleep(TIMEOUT_S + RAISE_MARGIN_S)
    except Exception as e:
        print(f"RAISED rank={rank} at={time.time():.3f} {type(e).__module__}.{type(e).__name__}: {e}", flush=True)
        raise


def _raised(out: str) -> str:
    m = re.search(r"^RAISED .*$", out, re.MULTILINE)
    assert m, out[-3000:]
    return m.group(0)


@pytest.mark.timeout(300)
def test_one_backward_too_many_on_one_rank():
    codes, outputs = spawn.run(extra_backward_worker, 2, timeout_s=280, expect_failure=True)
    assert codes == [1, 1], codes
    culprit = _raised(outputs[1])
    assert re.search(r"DCreditError: gradient of parameter 'out\.(bias|weight)' was computed 2 times before step\(\), "
                     r"but backward_passes_per_step=1", culprit), culprit
    peer = _raised(outputs[0])
    assert re.search(r"dcredit_opt\._C\.(SchedulerError|Timeout): rank 0 of 2, .*phase [12].*block \d+ \(tensors "
                     r"[\d,]+, \d+ bytes, channel \d, launch \d+, phase [12]\)", peer), peer
    for out in outputs:
        assert "terminate called" not in out and "Fatal Python error" not in out


@pytest.mark.timeout(300)
def test_one_iteration_too_many_on_one_rank():
    codes, outputs = spawn.run(extra_iteration_worker, 2, timeout_s=280, expect_failure=True)
    assert codes == [0, 1], codes
    done = float(re.search(r"^DONE rank=0 at=([0-9.]+)", outputs[0], re.MULTILINE).group(1))
    line = _raised(outputs[1])
    waited = float(re.search(r" at=([0-9.]+)", line).group(1)) - done
    assert waited < TIMEOUT_S + RAISE_MARGIN_S, f"rank 1 raised {waited:.1f} s after rank 0 stopped reducing"
    assert re.search(r"dcredit_opt\._C\.Timeout: rank 1 of 2, .*phase [12].*block \d+ "
                     r"\(tensors [\d,]+, \d+ bytes, channel \d, launch \d+, phase [12]\)", line), line
    assert "a peer may be dead, stalled, or issuing different collectives" in line or \
        f"did not complete within {TIMEOUT_S:g} s" in line, line


# ---- parameters used only on some ranks ----------------------------------------------


class Forked(nn.Module):
    """A trunk, two heads, and a layer some ranks skip."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 24)
        self.skip = nn.Linear(24, 24)
        self.head_a = nn.Linear(24, 7)
        self.head_b = nn.Linear(24, 7)

    def forward(self, x, use):
        h = torch.relu(self.inp(x))
        if "skip" in use:
            h = h + torch.tanh(self.skip(h))
        y = 0
        for name in ("head_a", "head_b"):
            if name in use:
                y = y + getattr(self, name)(h)
        return y


def _uses(rank: int, step: int) -> tuple:
    """Which parts each rank uses: never the same set on every rank, and it changes each step."""
    table = [("head_a",), ("head_b", "skip"), ("head_a", "head_b")]
    if step % 2:
        table = [("head_b",), ("head_a",), ("skip", "head_a")]
    if step % 3 == 2:
        table[2] = ("head_b",)  # nothing of inp's gradient on rank 2 comes from skip
    return table[rank % 3]


def partial_use_worker(steps: int = 8) -> dict:
    dc.init()
    world, rank = dc.size(), dc.rank()
    model = Forked()
    ref = copy.deepcopy(model)
    # window 1 and ALL (-1): the sequence must not depend on the window either.
    out = {"traces": [], "diff": 0.0}
    for window in (1, -1):
        model, ref = copy.deepcopy(ref), copy.deepcopy(ref)
        opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3),
                                      named_parameters=model.named_parameters(),
                                      config=dc.Config(block_bytes=64, window=window, channels=2, policy="fixed"))
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
        for step in range(steps):
            opt.zero_grad()
            x, y = workers.batch(step, rank)
            nn.functional.mse_loss(model(x, _uses(rank, step)), y).backward()
            opt.step()
            opt.synchronize()
            rows = sorted(opt._dc.engine.trace(), key=lambda row: row[4])  # by launch sequence number
            out["traces"].append([(row[0], row[1]) for row in rows])
            ref_opt.zero_grad()
            for r in range(world):
                xr, yr = workers.batch(step, r)
                nn.functional.mse_loss(ref(xr, _uses(r, step)), yr).backward()
            for p in ref.parameters():
                if p.grad is not None:  # one no rank used keeps None: the optimizer skips it
                    p.grad /= world
            ref_opt.step()
        out["diff"] = max(out["diff"], workers.max_diff(model, ref))
        opt._dc.close()
    return out


@pytest.mark.timeout(300)
def test_parameters_used_on_some_ranks_keep_one_block_sequence():
    results = spawn.run(partial_use_worker, 3, timeout_s=280)
    for r in range(1, 3):
        for it, (a, b) in enumerate(zip(results[0]["traces"], results[r]["traces"])):
            assert a == b, f"iteration {it}: rank {r} launched {b}, rank 0 launched {a}"
    assert all(len(t) == len(results[0]["traces"][0]) > 10 for t in results[0]["traces"])
    for r, res in enumerate(results):
        assert res["diff"] < 2e-5, f"rank {r}: differs from the synchronous reference by {res['diff']}"
