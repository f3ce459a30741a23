"""F4: the F1 equivalence on every backend, each started by its own launcher.

torch.distributed (Gloo, torchrun-style spawn) is covered by
test_equivalence.py. Here: mpi4py under ``mpiexec -n 2`` (the mpich wheel),
and Horovod under ``horovodrun --gloo`` (dcredit_opt initialises Horovod from
horovodrun's variables) and ``horovodrun --mpi`` (the script calls
``hvd.init()`` first and dcredit_opt adopts it, fusion left on). A launcher
or library that is not installed skips with the reason; ``make test`` installs
Horovod first, so in CI nothing skips.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import timing

from . import spawn, workers
from .test_equivalence import CONFIG_STEPS, SCENARIOS, _check, check_scenario

VENV_BIN = Path(sys.executable).parent


def _tool(name: str) -> str | None:
    """A launcher from this Python's environment (where the mpich wheel and Horovod put theirs)."""
    path = VENV_BIN / name
    return str(path) if path.exists() else None


def _probe(code: str) -> str | None:
    """None if ``code`` runs in a fresh interpreter, else the last line it printed."""
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=timing.scaled(120), check=False)
    except subprocess.TimeoutExpired:
        return f"`python -c {code!r}` did not finish in {timing.scaled(120):g} s"
    if out.returncode == 0:
        return None
    lines = (out.stderr or out.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit code {out.returncode}"


@functools.cache
def mpi_missing() -> str | None:
    if _tool("mpiexec") is None:
        return "mpiexec is not installed next to this Python (pip install mpich)"
    problem = _probe("from mpi4py import MPI")
    return f"mpi4py cannot load MPI ({problem}): pip install mpich mpi4py" if problem else None


@functools.cache
def horovod_missing(controller: str) -> str | None:
    if _tool("horovodrun") is None:
        return "Horovod is not installed (make horovod)"
    problem = _probe(f"import sys, horovod.torch as hvd; sys.exit(0 if hvd.{controller}_built() else "
                     f"'built without {controller}')")
    if problem:
        return f"Horovod with PyTorch and {controller} support is not importable ({problem}): make horovod"
    return mpi_missing() if controller == "mpi" else None


# "backend": the one a test asks for by name; "auto": what Config(backend="auto") picks there (under Horovod on
# CPUs, our own C++ channels beside Horovod: Note [C++ channels under Horovod] in world/channels.py).
LAUNCHES = {
    "mpi": {"launcher": ["mpiexec", "-n", "2"], "backend": "mpi", "auto": "mpi", "horovod_first": False,
            "missing": mpi_missing},
    "horovod-gloo": {"launcher": ["horovodrun", "-np", "2", "-H", "localhost:2", "--gloo"], "backend": "horovod",
                     "auto": "torch", "horovod_first": False, "missing": lambda: horovod_missing("gloo")},
    "horovod-mpi": {"launcher": ["horovodrun", "-np", "2", "-H", "localhost:2", "--mpi"], "backend": "horovod",
                    "auto": "torch", "horovod_first": True, "missing": lambda: horovod_missing("mpi")},
}


@pytest.mark.timeout(420)
def test_equivalence_on_backend(launch):
    # Fewer, larger blocks than test_equivalence.py where the window is small:
    # a Python-driven backend pays a thread hand-off per block, and these
    # tests share 2 cores with busy-polling MPI and Horovod threads.
    backend = launch["backend"]
    configs = [{"opt": o, "phase2": p2, "window": w, "block_bytes": 512, "channels": c, "backend": backend}
               for o in ("sgd", "adam") for p2 in (True, False) for w, c in ((1, 1), (4, 2))]
    configs += [{"opt": "sgd", "phase2": True, "window": 2, "block_bytes": 96, "channels": 2, "backend": backend},
                {"opt": "rmsprop", "phase2": True, "window": -1, "block_bytes": 64, "channels": 3, "backend": backend},
                {"opt": "adamw", "phase2": False, "window": 2, "block_bytes": 1 << 20, "backend": backend}]
    _check(spawn.run_launched(workers.equivalence, launch["launcher"], 2, timeout_s=400, configs=configs,
                              steps=CONFIG_STEPS, horovod_first=launch["horovod_first"]))


@pytest.mark.timeout(420)
def test_scenarios_and_profiled_plan_on_backend(launch):
    names = [*SCENARIOS, "profiled_dcredit"]
    per_rank = spawn.run_launched(workers.scenarios, launch["launcher"], 2, timeout_s=400, names=names,
                                  horovod_first=launch["horovod_first"])
    for name in names:
        check_scenario(name, [r[name] for r in per_rank], backend=launch["auto"])
    plans0, plans1 = per_rank[0]["profiled_dcredit"]["plans"], per_rank[1]["profiled_dcredit"]["plans"]
    assert plans0 == plans1, "ranks ran different plans in some iteration"
    switch = [i for i in range(1, len(plans0)) if plans0[i] != plans0[i - 1]]
    assert switch == [3], f"expected one switch, right after the 3 profiled iterations: {switch}"


@pytest.mark.timeout(300)
def test_stalled_peer_ends_the_job_with_a_timeout_error(launch):
    """Nothing hangs: rank 0 raises the scheduler's timeout naming itself, and the job ends (under
    MPI by MPI_Abort at exit, since MPI_Finalize would wait for the stalled rank forever)."""
    code, output = spawn.run_launched(stalled_peer, launch["launcher"], 2, timeout_s=240, expect_failure=True,
                                      horovod_first=launch["horovod_first"], stall_timeout_s=timing.STALL_TIMEOUT_S)
    assert code != 0, output[-3000:]
    lines = [line for line in output.splitlines() if "STALL-DETECTED rank 0" in line]
    assert lines, output[-3000:]
    assert "Timeout" in lines[0] and "rank 0 of 2" in lines[0], lines[0]
    assert f"within {timing.STALL_TIMEOUT_S:g} s" in lines[0], lines[0]


def stalled_peer(horovod_first: bool, stall_timeout_s: float) -> dict:
    """``workers.stalled_peer`` with ``Config.timeout_s`` long enough that rank 1 slowed by other jobs is not
    taken for stalled (tests/timing.py); ``spawn`` keeps ``timeout_s`` for its own limit."""
    return workers.stalled_peer(horovod_first=horovod_first, timeout_s=stall_timeout_s)


def _run_example(argv: list, timeout_s: float) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=f"{spawn.ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    out = subprocess.run(argv, cwd=spawn.ROOT, env=env, capture_output=True, text=True,
                         timeout=timing.scaled(timeout_s), start_new_session=True, check=False)
    assert out.returncode == 0, f"{' '.join(argv)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.mark.timeout(300)
def test_horovod_migration_example_runs_and_ranks_agree():
    reason = horovod_missing("gloo")
    if reason:
        pytest.skip(reason)
    out = _run_example([_tool("horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                        "examples/horovod_train.py", "--epochs", "1", "--samples", "512"], 280)
    assert "ranks agree on the parameters: True (2 ranks)" in out, out


@pytest.mark.timeout(300)
def test_train_example_under_mpiexec_ranks_agree():
    reason = mpi_missing()
    if reason:
        pytest.skip(reason)
    out = _run_example([_tool("mpiexec"), "-n", "2", sys.executable, "examples/train.py", "--epochs", "1",
                        "--batches", "4"], 280)
    assert "ranks agree on the parameters: True" in out, out


# ---- bad input: one clear error each -------------------------------------------


@pytest.mark.timeout(180)
def test_horovod_and_torch_distributed_in_different_worlds_is_a_launch_error():
    reason = horovod_missing("gloo")
    if reason:
        pytest.skip(reason)
    messages = spawn.run(workers.launch_error, 2, timeout_s=160, case="horovod_beside_torch")
    for rank, message in enumerate(messages):
        assert "torch.distributed says rank" in message and "of 2, Horovod says rank 0 of 1" in message, message
        assert "horovodrun" in message, message


@pytest.mark.timeout(180)
def test_mpi_backend_without_mpiexec_is_a_launch_error():
    reason = mpi_missing()
    if reason:
        pytest.skip(reason)
    messages = spawn.run(workers.launch_error, 2, timeout_s=160, case="mpi_backend_under_torchrun")
    for message in messages:
        assert "backend 'mpi' needs a job launched by mpiexec/mpirun" in message and "mpiexec -n N" in message, message
