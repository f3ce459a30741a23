"""Writes each test's outcome on this rank to ``<DIR>/rank<N>.json`` (a pytest plugin: ``--peer-outcomes DIR``).

Each rank of the launched job runs the same pytest session; ``test_peer_suite.py`` reads every rank's file. A
record holds, per test, ``outcome`` (``passed``, ``failed`` or ``skipped``) and ``message`` (the skip reason or the
failure's last line, with the full report in ``detail``), and ``DistributedOptimizer``, what
``horovod.torch.DistributedOptimizer`` resolved to during the run (Horovod's own, or ours where swapped).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# The launcher's rank variable: horovodrun --gloo sets HOROVOD_RANK; MPI launchers set theirs.
RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def pytest_addoption(parser):
    parser.addoption("--peer-outcomes", metavar="DIR", default=None,
                     help="write this rank's test outcomes to DIR/rank<N>.json")


def pytest_configure(config):
    directory = config.getoption("peer_outcomes")
    if directory:
        config.pluginmanager.register(_Recorder(Path(directory)), "peer-outcomes-recorder")


class _Recorder:
    def __init__(self, directory: Path):
        self.directory = directory
        self.tests: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report):
        name = report.nodeid.split("::")[-1]
        if report.when != "call" and report.passed:
            return
        if report.when != "call" and name in self.tests and self.tests[name]["outcome"] != "passed":
            return  # keep the first failure or skip
        if report.skipped:
            message = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        elif report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            message = crash.message if crash is not None else str(report.longrepr).strip().splitlines()[-1]
        else:
            message = ""
        self.tests[name] = {"outcome": report.outcome, "when": report.when, "message": message,
                            "detail": report.longreprtext[-8000:] if report.failed else ""}

    def pytest_sessionfinish(self, session):
        import horovod.torch as hvd

        rank = next((os.environ[v] for v in RANK_VARIABLES if v in os.environ), "0")
        resolved = hvd.DistributedOptimizer
        record = {"rank": int(rank), "tests": self.tests,
                  "DistributedOptimizer": f"{resolved.__module__}.{resolved.__qualname__}"}
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
