"""The Horovod peer suite: Horovod 0.28.1's own optimizer tests and PyTorch examples, run with dcredit_opt.

A Horovod user adopts dcredit_opt by changing ``hvd.DistributedOptimizer`` to ``dc.DistributedOptimizer``; the
tests Horovod wrote for its optimizer should then pass as they did. ``upstream/test/parallel/test_torch.py`` holds
those tests, verbatim (README.md lists which and why); they run under ``horovodrun -np 2 --gloo`` with
``-p tests.horovod_peer.swap`` (the user's one-line change, made for the whole session) and
``-p tests.horovod_peer.torch_compat`` (hides ``torch.optim.Muon``, which Horovod 0.28.1's optimizer loops cannot
build) and ``-p tests.horovod_peer.no_timeline`` (keeps Horovod's spinning timeline writer off). A control run without the swap shows that stock Horovod passes the same selection here, so a failure with
the swap is ours, not the environment's. Tests that fail with the swap for a known reason are strict xfails: each
must fail with its own error on every rank (a different error fails the test), and one that starts passing shows.

The two examples (``upstream/examples/pytorch/``, the swap written in) run briefly and must exit 0. The process-set
test runs first in a launch of its own (``OWN_LAUNCH``), and the sparse and process-set tests also under
``horovodrun --mpi`` (``MPI_TESTS``), stock and swapped; the process-set test also on 4 ranks under
``horovodrun --mpi`` (``MPI_4_TESTS``), where its sets hold two ranks each.

Horovod missing skips the module with the reason; ``make test`` installs it (``make horovod``).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import pytest

from tests import timing
from tests.distributed.spawn import kill_session

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PARALLEL = HERE / "upstream" / "test" / "parallel"
EXAMPLES = HERE / "upstream" / "examples" / "pytorch"
VENV_BIN = Path(sys.executable).parent
HOROVODRUN = VENV_BIN / "horovodrun"
LAUNCH = ["-np", "2", "-H", "localhost:2", "--gloo"]
LAUNCH_MPI = ["-np", "2", "-H", "localhost:2", "--mpi"]
WORLD_SIZE = 2
# The process-set test on 4 ranks, where its sets are [0, 2] and [1, 3] (on 2 ranks they are [0] and [1]).
LAUNCH_MPI_4 = ["-np", "4", "-H", "localhost:4", "--mpi"]

# One launch of the vendored tests takes 15-40 s on 2 busy cores; these limits only guard against hangs.
LAUNCH_TIMEOUT_S = 300
INNER_TEST_TIMEOUT_S = 240  # each Horovod test, inside the launch (pytest-timeout on every rank)

# The vendored tests that must pass on both ranks with the swap (stock Horovod passes them here too).
EXPECTED_TO_PASS = (
    "test_broadcast_state",
    "test_broadcast_state_no_grad",
    "test_broadcast_state_options",
    "test_duplicate_names",
    "test_dynamic_requires_grad",
    "test_force_allreduce",
    "test_gradient_clipping",
    "test_missing_named_parameters",
    "test_no_named_parameters",
    "test_optimizer_process_sets",
    "test_sparse_embeddings",
    "test_synchronize_step_warning",
    "test_delta_optimizer",  # op=hvd.Adasum; skips itself without MPI and GPUs, so here it skips
)

class Known(NamedTuple):
    why: str  # the reason shown with the xfail
    error: str  # text that the failure must contain on every rank where it fails


# The vendored tests that fail with the swap. Those that skip themselves here (no GPU, no MPI) are listed with the
# error they would meet.
KNOWN_FAILURES = {
    "test_optimizer_no_named_parameters": Known(
        why="reads Horovod's private attribute optimizer._parameter_names (a dict parameter -> name), which "
            "dcredit_opt's optimizer does not have",
        error="has no attribute '_parameter_names'"),
    "test_model_parallelism": Known(
        why="one model's parameters on two GPUs: dcredit_opt reduces parameters on one device per optimizer "
            "(ValueError); the test skips itself without 2 GPUs per rank",
        error="parameters are on different devices"),
}


# Vendored tests run first in a launch of their own (stock and swapped), with why.
OWN_LAUNCH = {
    "test_optimizer_process_sets": (
        "adds process sets to a running Horovod (hvd.add_process_set); right after the previous test's tearDown "
        "barrier, with one initialisation per launch (one_init.py), stock Horovod 0.28.1 aborts there "
        "intermittently (both ranks, 'Fatal Python error: Aborted'); as the first test of a launch it does not"),
}

# Vendored tests also run under horovodrun --mpi (stock and swapped): the optimizer's paths that differ there.
MPI_TESTS = ("test_sparse_embeddings", "test_optimizer_process_sets")
# And on 4 ranks under horovodrun --mpi (stock and swapped): the test of process sets, which "makes the most sense
# when running with > 2 processes" (its docstring): ranks 0 and 2 reduce over their set, ranks 1 and 3 are outside.
MPI_4_TESTS = ("test_optimizer_process_sets",)


class KnownFailure(AssertionError):
    """A vendored test failed with the error its entry in KNOWN_FAILURES names."""


@functools.cache
def horovod_missing() -> str | None:
    if not HOROVODRUN.exists():
        return f"Horovod is not installed next to {sys.executable} (make horovod)"
    code = "import sys, horovod.torch as hvd; sys.exit(0 if hvd.gloo_built() else 'built without Gloo')"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=timing.scaled(120), check=False)
    except subprocess.TimeoutExpired:
        return "importing horovod.torch did not finish"
    if out.returncode:
        lines = (out.stderr or out.stdout).strip().splitlines()
        return f"horovod.torch with Gloo is not importable ({lines[-1] if lines else out.returncode}): make horovod"
    return None


@pytest.fixture(scope="module", autouse=True)
def _needs_horovod():
    reason = horovod_missing()
    if reason:
        pytest.skip(reason)


def _environment() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"OMP_NUM_THREADS": "1", "PATH": str(VENV_BIN) + os.pathsep + env.get("PATH", ""),
                "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
    return env


def _horovodrun(command: list, cwd: Path, launch: list = LAUNCH) -> tuple[int, str]:
    """Run ``command`` under ``horovodrun`` (on 2 ranks with ``--gloo`` unless ``launch`` says otherwise): its exit
    code and output; killed whole on timeout."""
    timeout_s = timing.scaled(LAUNCH_TIMEOUT_S)
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([str(HOROVODRUN), *launch, *command], cwd=cwd, env=_environment(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_session(proc)
            log.seek(0)
            pytest.fail(f"horovodrun did not finish within {timeout_s:g} s:\n{log.read()[-6000:]}")
        log.seek(0)
        return proc.returncode, log.read()


def _run_vendored_tests(swap: bool, only: tuple = (), launch: list = LAUNCH, world_size: int = WORLD_SIZE) -> dict:
    """Every rank's outcomes (``outcomes.py``'s records, in rank order, ``world_size`` ranks) and the launch's
    output: of the tests ``only`` names, else of every vendored test but those of OWN_LAUNCH."""
    plugins = ["-p", "tests.horovod_peer.one_init", "-p", "tests.horovod_peer.torch_compat",
               "-p", "tests.horovod_peer.no_timeline"] + (
        ["-p", "tests.horovod_peer.swap"] if swap else [])
    with tempfile.TemporaryDirectory(prefix="dcredit-peer-") as out:
        # --rootdir/--confcutdir: the run sees Horovod's files only, not this repository's conftests.
        selection = ([f"test_torch.py::TorchTests::{name}" for name in only] if only else
                     [*(f"--deselect=test_torch.py::TorchTests::{name}" for name in OWN_LAUNCH), "test_torch.py"])
        rc, output = _horovodrun(
            [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--rootdir", ".", "--confcutdir", ".",
             "--timeout", f"{timing.scaled(INNER_TEST_TIMEOUT_S):g}", "-p", "tests.horovod_peer.outcomes",
             "--peer-outcomes", out, *plugins, *selection], cwd=PARALLEL, launch=launch)
        files = [Path(out) / f"rank{r}.json" for r in range(world_size)]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            pytest.fail(f"the vendored tests wrote no outcomes for {missing} (horovodrun exit code {rc}):\n"
                        f"{output[-6000:]}")
        return {"ranks": [json.loads(f.read_text()) for f in files], "output": output}


@pytest.fixture(scope="module")
def swapped() -> dict:
    return _run_vendored_tests(swap=True)


@pytest.fixture(scope="module")
def stock() -> dict:
    return _run_vendored_tests(swap=False)


@pytest.fixture(scope="module")
def swapped_own() -> dict:
    return _run_vendored_tests(swap=True, only=tuple(OWN_LAUNCH))


@pytest.fixture(scope="module")
def stock_own() -> dict:
    return _run_vendored_tests(swap=False, only=tuple(OWN_LAUNCH))


@functools.cache
def _mpi_missing() -> str | None:
    code = "import sys, horovod.torch as hvd; sys.exit(0 if hvd.mpi_built() else 'built without MPI')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timing.scaled(120),
                         check=False)
    return None if out.returncode == 0 else "Horovod is built without MPI"


@pytest.fixture(scope="module")
def swapped_mpi() -> dict:
    if _mpi_missing():
        pytest.skip(_mpi_missing())
    return _run_vendored_tests(swap=True, only=MPI_TESTS, launch=LAUNCH_MPI)


@pytest.fixture(scope="module")
def stock_mpi() -> dict:
    if _mpi_missing():
        pytest.skip(_mpi_missing())
    return _run_vendored_tests(swap=False, only=MPI_TESTS, launch=LAUNCH_MPI)


@pytest.fixture(scope="module")
def swapped_mpi_4() -> dict:
    if _mpi_missing():
        pytest.skip(_mpi_missing())
    return _run_vendored_tests(swap=True, only=MPI_4_TESTS, launch=LAUNCH_MPI_4, world_size=4)


@pytest.fixture(scope="module")
def stock_mpi_4() -> dict:
    if _mpi_missing():
        pytest.skip(_mpi_missing())
    return _run_vendored_tests(swap=False, only=MPI_4_TESTS, launch=LAUNCH_MPI_4, world_size=4)


def _cases() -> list:
    known = [pytest.param(name, id=name, marks=pytest.mark.xfail(strict=True, raises=KnownFailure, reason=k.why))
             for name, k in KNOWN_FAILURES.items()]
    return [pytest.param(name, id=name) for name in EXPECTED_TO_PASS] + known


@pytest.mark.timeout(420)
def test_every_vendored_test_ran_with_the_swap(swapped):
    listed = {*EXPECTED_TO_PASS, *KNOWN_FAILURES} - set(OWN_LAUNCH)
    for rank in swapped["ranks"]:
        assert rank["DistributedOptimizer"] == "dcredit_opt.optimizer.wrapper.DistributedOptimizer", rank
        ran = set(rank["tests"])
        assert ran == listed, (f"rank {rank['rank']}: ran but not listed here {sorted(ran - listed)}, listed but "
                               f"did not run {sorted(listed - ran)}")


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", _cases())
def test_horovod_test_with_dcredit_opt(request, name):
    _check_outcome(request.getfixturevalue("swapped_own" if name in OWN_LAUNCH else "swapped"), name)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", MPI_TESTS)
def test_horovod_test_with_dcredit_opt_under_mpi(swapped_mpi, name):
    _check_outcome(swapped_mpi, name)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", MPI_4_TESTS)
def test_horovod_test_with_dcredit_opt_on_4_ranks_under_mpi(swapped_mpi_4, name):
    assert len(swapped_mpi_4["ranks"]) == 4
    _check_outcome(swapped_mpi_4, name)


def _check_outcome(swapped: dict, name: str) -> None:
    results = [rank["tests"].get(name) for rank in swapped["ranks"]]
    world_size = len(results)
    if any(r is None for r in results):
        pytest.fail(f"{name} did not run on every rank:\n{swapped['output'][-6000:]}")
    outcomes = [r["outcome"] for r in results]
    if outcomes == ["skipped"] * world_size:
        pytest.skip(f"the test skips itself here: {results[0]['message'].removeprefix('Skipped: ')}")
    if outcomes == ["passed"] * world_size:
        return
    failed = [(rank, r) for rank, r in enumerate(results) if r["outcome"] == "failed"]
    known = KNOWN_FAILURES.get(name)
    if known and len(failed) == world_size and all(known.error in r["detail"] for _, r in failed):
        raise KnownFailure(f"{name}: {failed[0][1]['message']}")
    details = "\n".join(f"--- rank {rank} ({r['outcome']}): {r['message']}\n{r['detail'][-3000:]}"
                        for rank, r in enumerate(results))
    pytest.fail(f"{name}: outcomes per rank {outcomes}\n{details}")


@pytest.mark.timeout(420)
@pytest.mark.parametrize("run", ["stock", "stock_own", "stock_mpi", "stock_mpi_4"])
def test_stock_horovod_passes_the_same_selection(request, run):
    """The control: without the swap, every vendored test that does not skip itself passes here, in each launch."""
    stock = request.getfixturevalue(run)
    expected = {"stock": {*EXPECTED_TO_PASS, *KNOWN_FAILURES} - set(OWN_LAUNCH), "stock_own": set(OWN_LAUNCH),
                "stock_mpi": set(MPI_TESTS), "stock_mpi_4": set(MPI_4_TESTS)}[run]
    for rank in stock["ranks"]:
        assert rank["DistributedOptimizer"] == "horovod.torch.optimizer.DistributedOptimizer", rank
        assert set(rank["tests"]) == expected
        bad = {name: r["message"] for name, r in rank["tests"].items() if r["outcome"] == "failed"}
        assert not bad, f"rank {rank['rank']}: stock Horovod fails {bad}:\n{stock['output'][-6000:]}"


def _run_example(script: str, *flags: str) -> str:
    rc, output = _horovodrun([sys.executable, str(EXAMPLES / script), *flags], cwd=ROOT)
    assert rc == 0, f"{script} {' '.join(flags)} exited with {rc}:\n{output[-6000:]}"
    return output


@pytest.mark.timeout(420)
def test_pytorch_mnist_example():
    output = _run_example("pytorch_mnist.py", "--epochs", "1")
    assert "Test set: Average loss" in output, output[-3000:]


@pytest.mark.timeout(420)
def test_pytorch_synthetic_benchmark_example():
    output = _run_example("pytorch_synthetic_benchmark.py", "--batch-size", "4", "--num-warmup-batches", "1",
                          "--num-batches-per-iter", "2", "--num-iters", "2")
    assert "Total img/sec on 2 " in output, output[-3000:]
