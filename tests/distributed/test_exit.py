"""Leaving the job: errors of one kind, a clean exit, and shutdown/init cycles (issue 29, items 7 and 9).

- An uneven last step on 2 ranks (one rank stops a step early, and either
  leaves or lingers) raises a ``DCreditError`` on the other within its
  ``timeout_s``: a ``CollectiveError`` when the peer left, a
  ``CollectiveTimeout`` when it lingers.
- ``exit_script.py`` under torchrun, as a script (the interpreter's own
  exit, not ``spawn``'s ``os._exit``): ``dc.shutdown()``, ``dc.init()`` and a
  fresh optimizer, three times, the weights equal on both ranks each time,
  then a last training and an ``all_gather`` on the default group; every
  rank exits 0, and no Gloo thread or thread of ours is left after
  ``dc.shutdown()`` (Note [Orderly exit] in world/job.py).

Under load, the exit once aborted in about 50 runs, so a few runs here catch
a regression of the cause (the threads left) at once and its symptom only
rarely. The 200-run check under load, by hand:

    (python -c 'while 1: pass' &) ; (python -c 'while 1: pass' &)
    for i in $(seq 200); do .venv/bin/torchrun --nproc_per_node 2 --master_port $((31000 + i)) \\
        tests/distributed/exit_script.py > /tmp/exit$i.log 2>&1 || echo "run $i: exit $?"; done
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dcredit_opt as dc
from tests import timing

from . import spawn

SCRIPT = Path(__file__).with_name("exit_script.py")
# The collective timeout of the uneven-step test: waited out once when the peer lingers.
TIMEOUT_S = timing.STALL_TIMEOUT_S
STEPS = 4


def uneven_worker(peer: str) -> dict:
    """Rank 1 runs one step fewer than rank 0, then leaves (returns) or lingers; rank 0 reports what its
    extra step raised, and how long after the step began."""
    dc.init(timeout_s=TIMEOUT_S)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                  named_parameters=model.named_parameters(),
                                  config=dc.Config(timeout_s=TIMEOUT_S, block_bytes=64, policy="fixed"))

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # waits for the update

    for _ in range(STEPS - 1):
        step()
    if dc.rank() == 1:
        if peer == "lingers":
            time.sleep(TIMEOUT_S + timing.scaled(5.0))
        return {}
    start = time.monotonic()
    try:
        step()
    except Exception as e:  # noqa: BLE001 - what the user would catch is the point
        return {"raised": True, "elapsed": time.monotonic() - start, "message": str(e),
                "dcredit": isinstance(e, dc.DCreditError), "timeout": isinstance(e, dc.CollectiveTimeout),
                "collective": isinstance(e, dc.CollectiveError), "type": type(e).__qualname__}
    return {"raised": False, "elapsed": time.monotonic() - start}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("peer", ["leaves", "lingers"])
def test_uneven_last_step_raises_a_dcredit_error_in_time(peer):
    got = spawn.run(uneven_worker, 2, timeout_s=200, peer=peer)[0]
    assert got["raised"], f"rank 0's extra step returned after {got['elapsed']:.1f} s"
    assert got["dcredit"] and got["collective"], got
    assert "rank 0 of 2" in got["message"], got
    if peer == "lingers":
        assert got["timeout"], got
    # The engine's timeout, plus a margin for a loaded machine; far below the spawn's limit.
    assert got["elapsed"] < TIMEOUT_S + timing.scaled(20.0), got


def _torchrun(*args: str, timeout_s: float) -> tuple[int, str, float]:
    """exit_script.py on 2 ranks under torchrun: (exit status, output, seconds)."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
                "PYTHONPATH": str(spawn.ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nproc_per_node", "2", "--master_port", str(spawn.free_port()), str(SCRIPT), *args]
    start = time.monotonic()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=spawn.ROOT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timing.scaled(timeout_s))
    except subprocess.TimeoutExpired:
        spawn.kill_session(proc)
        output, _ = proc.communicate()
        pytest.fail(f"exit_script.py {' '.join(args)} did not end within {timing.scaled(timeout_s):g} s:\n"
                    f"{output[-6000:]}")
    return proc.returncode, output, time.monotonic() - start


def _check_run(code: int, output: str, trainings: int) -> None:
    assert code == 0, f"exit status {code}:\n{output[-6000:]}"
    for rank in (0, 1):
        equal = re.findall(rf"^rank {rank}: weights equal: (\w+)$", output, re.MULTILINE)
        assert equal == ["True"] * trainings, f"rank {rank}: {equal}\n{output[-6000:]}"
        left = re.findall(rf"^rank {rank}: threads left: (.*)$", output, re.MULTILINE)
        assert left == ["[]"], f"rank {rank}: threads still running after dc.shutdown(): {left}"


@pytest.mark.timeout(300)
def test_shutdown_init_cycles_then_a_clean_exit():
    # Each incarnation's groups must find each other (the agent's store outlives them) well within the
    # timeout; before fresh store prefixes, 4 of 6 such runs failed with Gloo's "Connect timeout".
    code, output, _ = _torchrun("--cycles", "3", "--timeout", "20", timeout_s=240)
    _check_run(code, output, trainings=4)


@pytest.mark.timeout(300)
def test_script_that_ends_normally_exits_0():
    for _ in range(2):
        code, output, _ = _torchrun(timeout_s=120)
        _check_run(code, output, trainings=1)
