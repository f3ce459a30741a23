"""`make demo`'s side-by-side (examples/side_by_side.py) end to end, in its quickest form.

Real ranks on loopback, the tiny model, a few iterations: checks what it
prints and that the ranks agree, never speed. Every limit here only stops a
hang (see tests/timing.py).
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import timing

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "examples" / "side_by_side.py"
ITERS, ROUNDS = 2, 1
# As in test_bench_smoke.py: a launch is fresh interpreters importing torch
# and a few iterations of the tiny model, 5-35 s on a busy 2-core machine and
# past 90 s at times; each gets the harness's own default limit.
LAUNCH_LIMIT_S = 300
LAUNCHES = 2 * ROUNDS  # DDP, then dcredit-opt, per round
OVERHEAD_S = 120  # the launcher's own imports and checks
NUMBER = r"\d+\.\d+"


def run_demo(*extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(SCRIPT), "--network", "loopback", "--model", "tiny",
            "--iters", str(ITERS), "--warmup", "0", "--rounds", str(ROUNDS),
            "--launch-timeout-s", f"{timing.scaled(LAUNCH_LIMIT_S):g}", *extra]
    # dcredit-opt's collective timeout: the patience DDP's process group gets.
    env = dict(os.environ, DCREDIT_TIMEOUT_S=f"{timing.scaled(180):g}")
    return subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False,
                          timeout=timing.scaled(LAUNCHES * LAUNCH_LIMIT_S + OVERHEAD_S))


@pytest.mark.timeout(LAUNCHES * LAUNCH_LIMIT_S + OVERHEAD_S + 60)  # scaled in tests/conftest.py
def test_side_by_side_on_loopback():
    pytest.importorskip("dcredit_opt._C", reason="the C++ runtime is not built")
    proc = run_demo()
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    lines = out.splitlines()

    # Loopback is said once, in one line, before anything else.
    assert lines[0].startswith("note: ranks talk over loopback") and "NOT rate-limited" in lines[0]
    assert sum("loopback" in line and "NOT rate-limited" in line for line in lines) == 1
    assert re.match(r"DDP vs dcredit-opt: tiny \([\d,]+ parameters, .* 2 ranks over loopback, "
                    rf"batch 32 per rank, {ROUNDS} round\(s\) of {ITERS} timed iterations$", lines[1])

    # Interleaved launches, DDP first in every round.
    launches = re.findall(r"^  round (\d+)/(\d+)  (DDP|dcredit-opt) +median (\S+) s per iteration",
                          out, re.MULTILINE)
    assert [(int(r), int(n), s) for r, n, s, _ in launches] == [
        (r + 1, ROUNDS, s) for r in range(ROUNDS) for s in ("DDP", "dcredit-opt")]

    # The table: a median, an IQR and the count of every scheme's iterations.
    for label in ("DDP", "dcredit-opt"):
        (row,) = re.findall(rf"^{label} +({NUMBER}) +({NUMBER}) +(\d+)$", out, re.MULTILINE)
        assert float(row[0]) > 0 and float(row[1]) >= 0 and int(row[2]) == ITERS * ROUNDS
    assert re.search(rf"^speed-up of dcredit-opt over DDP: {NUMBER}x$", out, re.MULTILINE)

    # Behaviour: every rank ends with the same parameters, and DDP with dcredit-opt's.
    assert re.search(r"^ranks agree \(identical parameters on every rank\): DDP yes, dcredit-opt yes$",
                     out, re.MULTILINE), out
    assert re.search(r"^DDP and dcredit-opt agree \(parameters within rtol \S+, atol \S+\): yes "
                     r"\(largest difference \S+\)$", out, re.MULTILINE), out
    assert lines[-1].startswith("machine: ")


def test_make_demo_runs_the_example_then_the_side_by_side():
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", (REPO_ROOT / "Makefile").read_text(), re.MULTILINE)
    assert recipe, "no demo target in the Makefile"
    commands = [line.strip() for line in recipe.group(1).splitlines() if not line.strip().startswith("@")]
    assert [c.split()[-1] for c in commands] == ["examples/train.py", "examples/side_by_side.py"]


def _load_example():
    spec = importlib.util.spec_from_file_location("side_by_side", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_namespaces_one_line_says_loopback(monkeypatch, capsys):
    demo = _load_example()
    monkeypatch.setattr(demo.netem, "namespaces_available", lambda: (False, "not running as root"))
    with demo.open_network(2, "1gbit", "auto") as net:
        assert not net.limited and [ep.netns for ep in net.endpoints] == [None, None]
    out, err = capsys.readouterr()
    note = ("note: ranks talk over loopback (not running as root), which is NOT rate-limited: "
            "the times below are not those of a 1gbit link")
    assert out.splitlines() == [note]
    assert err == ""
    with pytest.raises(RuntimeError, match="not running as root"):
        demo.open_network(2, "1gbit", "netns")
