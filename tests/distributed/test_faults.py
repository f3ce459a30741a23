"""F5.1: a peer killed (SIGKILL) or stalled (SIGSTOP) mid-training.

Three Gloo ranks train; one of them, at a point drawn from a seeded RNG,
either kills itself or stops itself, in the middle of backward (from the
gradient hook of a randomly chosen parameter) or in phase 2 (after
``step()`` returned, before the next forward). Every other rank must raise
a clear exception within ``Config.timeout_s`` (plus a margin), naming
itself, the tensor or block and the phase, and exit non-zero through
Python's normal exception path: no C++ abort, no hang at interpreter exit.

A SIGKILLed peer closes its sockets, so Gloo reports a closed connection at
once; a SIGSTOPped one keeps them open, so only a timeout can tell. Rank 0
(which also hosts the rendezvous store) is among the victims.
"""

from __future__ import annotations

import datetime
import os
import random
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist

import dcredit_opt as dc
from tests import timing

from . import spawn, workers

WORLD = 3
STEPS = 8
# Config.timeout_s: long enough that a rank slowed by other jobs is not taken
# for the victim (tests/timing.py).
TIMEOUT_S = timing.STALL_TIMEOUT_S
# Margins over Config.timeout_s, generous because this 2-core machine runs 3
# ranks (and often other jobs): the block that times out is launched a
# little after the fault, and Python must print a traceback and exit. Far
# below the launcher group's timeout (GROUP_TIMEOUT_S), so that a rank that
# raised within them was stopped by the optimizer's own timeout.
RAISE_MARGIN_S = timing.scaled(20.0)
# Exit: Gloo's process group destructor drains its queue, and each queued
# collective on a dead pair can take up to the group's timeout (timeout_s)
# before the pair is closed; a few of those, never one per block.
EXIT_MARGIN_S = 3 * TIMEOUT_S + timing.scaled(30.0)
# The launcher's own group: start-up on a loaded machine is slow.
GROUP_TIMEOUT_S = timing.scaled(120.0)


def fault_worker(victim: int, mode: str, phase: str, seed: int, window: int) -> None:
    """Train; the victim injects its fault, the others must raise (never return)."""
    rng = random.Random(seed)
    fault_step = rng.randrange(2, STEPS - 2)  # later steps exist: survivors always wait on the victim
    # The launcher's own group, with a long timeout: start-up on a loaded
    # machine is slow. The optimizer's channels get Config.timeout_s.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = workers.Net()
    params = list(model.parameters())
    config = dc.Config(block_bytes=64, window=window, channels=2, policy="fixed", timeout_s=TIMEOUT_S)
    opt = dc.DistributedOptimizer(torch.optim.SGD(params, lr=0.05, momentum=0.9),
                                  named_parameters=model.named_parameters(), config=config)
    trigger = rng.randrange(len(params))  # backward: fault right after this parameter's gradient
    phase2_delay_s = rng.uniform(0.0, 0.05)
    state = {"step": -1}

    def inject(where: str) -> None:
        print(f"FAULT {mode} rank={rank} step={state['step']} where={where} at={time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
        time.sleep(600)  # not reached: SIGKILL ends us; a stopped rank is killed by the harness

    if rank == victim and phase == "backward":
        def hook(p):
            if state["step"] == fault_step:
                inject(f"backward, after the gradient of parameter {trigger}")
        params[trigger].register_post_accumulate_grad_hook(hook)
    try:
        for step in range(STEPS):
            state["step"] = step
            opt.zero_grad()
            workers.loss_of(model, workers.batch(step, rank)).backward()
            opt.step()
            if rank == victim and phase == "phase2" and step == fault_step:
                time.sleep(phase2_delay_s)
                inject("phase 2, after step() and before the next forward")
        opt.synchronize()
    except Exception as e:
        message = str(e).replace("\n", " ")
        print(f"RAISED rank={rank} at={time.time():.3f} {type(e).__module__}.{type(e).__name__}: {message}",
              flush=True)
        raise  # out through the interpreter, as in a real job
    print(f"NO ERROR rank={rank}", flush=True)


def _line(prefix: str, text: str) -> str:
    m = re.search(f"^{re.escape(prefix)}.*$", text, re.MULTILINE)
    assert m, f"no line starting {prefix!r} in:\n{text[-3000:]}"
    return m.group(0)


def _at(line: str) -> float:
    return float(re.search(r" at=([0-9.]+)", line).group(1))


# (mode, phase, seed, window); the victim is seed % 3. Window -1 releases
# every ready block at once, so many collectives are queued in Gloo when the
# peer goes.
CASES = [
    ("kill", "backward", 1, 2),
    ("kill", "backward", 3, -1),
    ("kill", "phase2", 2, 2),
    ("kill", "phase2", 6, 1),
    ("stop", "backward", 4, -1),
    ("stop", "phase2", 5, 2),
]
INJECTED = {"faults": 0, "survived": 0}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode, phase, seed, window", CASES)
def test_peer_failure_is_reported_by_every_other_rank(mode, phase, seed, window):
    victim = seed % WORLD
    stalled = (victim,) if mode == "stop" else ()
    codes, outputs = spawn.run(fault_worker, WORLD, timeout_s=220, expect_failure=True, stalled=stalled,
                               victim=victim, mode=mode, phase=phase, seed=seed, window=window)
    ended = time.time()
    fault_at = _at(_line(f"FAULT {mode} rank={victim}", outputs[victim]))
    INJECTED["faults"] += 1
    assert codes[victim] == -signal.SIGKILL, codes
    delays = []
    for r in range(WORLD):
        if r == victim:
            continue
        out = outputs[r]
        assert "NO ERROR" not in out, f"rank {r} finished although rank {victim} was gone"
        assert codes[r] == 1, f"rank {r} exited with {codes[r]} (want 1: a Python exception):\n{out[-3000:]}"
        for crash in ("terminate called", "Aborted", "core dumped", "Segmentation fault", "Fatal Python error"):
            assert crash not in out, f"rank {r}: {crash!r} in its output:\n{out[-3000:]}"
        raised = _line(f"RAISED rank={r}", out)
        delay = _at(raised) - fault_at
        delays.append(delay)
        assert delay < TIMEOUT_S + RAISE_MARGIN_S, f"rank {r} raised {delay:.1f} s after the fault: {raised}"
        kind = raised.split(" ", 3)[3]
        assert re.match(r"dcredit_opt\._C\.(SchedulerError|Timeout): ", kind), raised
        assert f"rank {r} of {WORLD}, " in raised, f"the error does not name the rank: {raised}"
        assert re.search(r"phase [12]", raised), f"the error does not name the phase: {raised}"
        # The block (with the tensors it covers), or the tensor waited for when nothing was in flight.
        assert re.search(r"block \d+ \(tensors [\d,]+, \d+ bytes, channel \d", raised) or \
            re.search(r"'[\w.]+' \(tensor \d+\).*tensor \d+ not reduced", raised), \
            f"the error names neither a block nor a tensor: {raised}"
        # The exception left through the interpreter (a traceback), not through a C++ abort.
        assert "Traceback (most recent call last)" in out
        INJECTED["survived"] += 1
    took = ended - fault_at
    assert took < TIMEOUT_S + EXIT_MARGIN_S, f"the survivors' processes ended {took:.1f} s after the fault"
    print(f"{mode}/{phase} seed {seed} window {window}: victim rank {victim}, survivors raised "
          f"{', '.join(f'{d:.1f}' for d in delays)} s and exited {took:.1f} s after the fault (limits "
          f"{TIMEOUT_S + RAISE_MARGIN_S:g} s, {TIMEOUT_S + EXIT_MARGIN_S:g} s); totals so far {INJECTED}")
