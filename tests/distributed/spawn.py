"""Run a function on N local ranks, each its own process, and collect results.

The test process picks a free port, starts ``world_size`` Python processes
with torchrun's environment variables, and waits for all of them with a
timeout, so a hang fails the test instead of stalling the suite. Each rank
calls ``module.function(**kwargs)`` and saves what it returns.

Every rank runs with ``PYTHONFAULTHANDLER=1``: a rank that dies of a signal
(a segmentation fault, an abort) prints every thread's Python stack.

The ``timeout_s`` a test passes is written for a busy machine and multiplied
here by ``DC_TEST_TIME_SCALE`` (``tests/timing.py``), as the test's own
pytest-timeout limit is: it only guards against hangs.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tests import timing

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailure(AssertionError):
    def __init__(self, message: str, returncodes: list, outputs: list, results: list | None = None):
        super().__init__(message)
        self.returncodes = returncodes
        self.outputs = outputs
        self.results = results  # every rank's result, where each wrote one before the launch failed


def run(function, world_size: int, timeout_s: float = 120.0, env: dict | None = None,
        expect_failure: bool = False, stalled: tuple = (), **kwargs) -> list:
    """Results of ``function(**kwargs)`` on every rank, in rank order.

    With ``expect_failure`` a failing rank is not an error: the return codes
    and outputs are returned instead, for tests of error paths. Ranks in
    ``stalled`` are expected to stop themselves (SIGSTOP): they are not
    waited for, and are killed once the other ranks have ended. ``timeout_s``
    is scaled by ``DC_TEST_TIME_SCALE``.
    """
    timeout_s = timing.scaled(timeout_s)
    module = function.__module__
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="dcredit-test-") as out:
        procs, logs = [], []
        for rank in range(world_size):
            e = dict(os.environ)
            e.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                      "PYTHONFAULTHANDLER": "1",
                      "PYTHONPATH": str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")})
            e.update(env or {})
            log = open(Path(out) / f"log{rank}.txt", "w+")  # noqa: SIM115 - closed after the rank ends
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.distributed.spawn", module, function.__name__, out,
                 json.dumps(kwargs)], env=e, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        deadline = time.monotonic() + timeout_s
        timed_out = False
        for rank, p in enumerate(procs):
            if rank in stalled:
                continue
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        for rank in stalled:
            procs[rank].kill()
            procs[rank].wait(timeout=timing.scaled(30))
        if timed_out:
            for p in procs:
                p.kill()
            for p in procs:
                p.wait(timeout=timing.scaled(30))
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
        codes = [p.returncode for p in procs]
        if timed_out:
            raise RankFailure(f"ranks did not finish within {timeout_s:g} s:\n" + _tails(outputs), codes, outputs)
        if expect_failure:
            return [codes, outputs]
        if any(codes):
            raise RankFailure(f"rank(s) failed with exit codes {codes}:\n" + _tails(outputs), codes, outputs)
        return [torch.load(Path(out) / f"result{r}.pt", weights_only=False) for r in range(world_size)]


def run_launched(function, launcher: list, world_size: int, timeout_s: float = 180.0, env: dict | None = None,
                 expect_failure: bool = False, **kwargs) -> list:
    """Like :func:`run`, but the ranks are started by a launcher command.

    ``launcher`` is what goes before the Python command line, e.g.
    ``["mpiexec", "-n", "2"]`` or ``["horovodrun", "-np", "2", "-H",
    "localhost:2", "--gloo"]``: the launcher, not this function, sets the
    ranks, so torchrun's variables are removed from the environment. The
    launcher runs in a session of its own, killed whole on timeout. With
    ``expect_failure`` returns ``[returncode, output]`` instead of raising.
    ``timeout_s`` is scaled by ``DC_TEST_TIME_SCALE``.
    """
    timeout_s = timing.scaled(timeout_s)
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                          "MASTER_PORT")}
    # The venv's launchers and MPI first: horovodrun --mpi runs the first mpirun on PATH.
    e.update({"OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
              "PATH": str(Path(sys.executable).parent) + os.pathsep + e.get("PATH", ""),
              "PYTHONPATH": str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")})
    e.update(env or {})
    with tempfile.TemporaryDirectory(prefix="dcredit-test-") as out:
        with open(Path(out) / "launcher.txt", "w+") as log:
            proc = subprocess.Popen(
                [*launcher, sys.executable, "-m", "tests.distributed.spawn", function.__module__, function.__name__,
                 out, json.dumps(kwargs)], env=e, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                start_new_session=True)
            try:
                proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
                kill_session(proc)
            log.seek(0)
            output = log.read()
        if timed_out:
            raise RankFailure(f"{launcher[0]} did not finish within {timeout_s:g} s:\n{output[-6000:]}",
                              [proc.returncode], [output])
        if expect_failure:
            return [proc.returncode, output]
        missing = [r for r in range(world_size) if not (Path(out) / f"result{r}.pt").exists()]
        results = None
        if not missing:
            try:
                results = [torch.load(Path(out) / f"result{r}.pt", weights_only=False) for r in range(world_size)]
            except Exception:  # a file a failed launch left half written: no results
                if not proc.returncode:
                    raise
        if proc.returncode or missing:
            raise RankFailure(f"{launcher[0]} exited with {proc.returncode}, no result from rank(s) {missing}:\n"
                              f"{output[-6000:]}", [proc.returncode], [output], results)
        return results


def launch_once(cache: dict, key, start):
    """What ``start()`` returns, launched once per ``key`` for the whole test module (``cache``): a launch that
    failed (``RankFailure``) fails every test that reads it; a ``pytest.skip.Exception`` it returned skips them."""
    import pytest

    if key not in cache:
        try:
            cache[key] = start()
        except RankFailure as e:
            cache[key] = e
    out = cache[key]
    if isinstance(out, pytest.skip.Exception):
        pytest.skip(str(out))
    if isinstance(out, Exception):
        pytest.fail(f"the launch {key!r} failed: {out}")
    return out


def kill_session(proc: subprocess.Popen) -> None:
    """Stop the launcher we started and every process in its session: politely, then not."""
    for sig, grace in ((signal.SIGTERM, timing.scaled(10)), (signal.SIGKILL, timing.scaled(30))):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _launched_rank() -> str:
    """This process's rank under a launcher that does not set RANK."""
    for var in ("HOROVOD_RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if var in os.environ:
            return os.environ[var]
    raise RuntimeError("no rank in the environment (RANK, HOROVOD_RANK, PMI_RANK, OMPI_COMM_WORLD_RANK)")


def _tails(outputs: list) -> str:
    return "\n".join(f"--- rank {r} ---\n{text[-3000:]}" for r, text in enumerate(outputs))


def _main() -> None:
    module, name, out, kwargs = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    torch.set_num_threads(1)
    result = getattr(importlib.import_module(module), name)(**kwargs)
    torch.save(result, Path(out) / f"result{os.environ.get('RANK') or _launched_rank()}.pt")


def exit_after_exit_handlers(code: int = 0) -> None:
    """Run the exit handlers (dcredit_opt's orderly shutdown, mpi4py's MPI_Finalize, Horovod's shutdown), then
    end the process without the interpreter's teardown. Under heavy load a rank whose work and exit handlers
    had all finished has aborted there a few times ("terminate called without an active exception", a
    joinable C++ thread destroyed during static destruction; not yet traced to its owner): the result is
    already written, so the launch is not failed for it."""
    import atexit

    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    mpi = sys.modules.get("mpi4py.MPI")  # mpi4py finalizes from a C-level exit hook, which os._exit skips
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        if _ABORT_STATUS:  # as mpi4py's hook would: MPI_Finalize would wait for a stopped peer forever
            mpi.COMM_WORLD.Abort(_ABORT_STATUS[-1])
        mpi.Finalize()
    os._exit(code)


_ABORT_STATUS: list = []


def _remember_abort_status() -> None:
    """``mpi4py.run.set_abort_status`` (dcredit_opt's MPI backend calls it when a collective will never
    finish), remembered for ``exit_after_exit_handlers``: mpi4py's own exit hook, which honours it, is skipped."""
    try:
        import mpi4py.run
    except ImportError:
        return
    original = mpi4py.run.set_abort_status

    def remember(status):
        _ABORT_STATUS.append(status if isinstance(status, int) and status else 1)
        original(status)

    mpi4py.run.set_abort_status = remember


if __name__ == "__main__":
    _remember_abort_status()
    _main()
    exit_after_exit_handlers()
