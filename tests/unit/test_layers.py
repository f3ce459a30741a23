"""The package's layers (DESIGN.md section 2): each depends only on the ones below it.

Read from the source with ``ast`` (no import runs): which ``dcredit_opt``
modules, and which outside packages, each module imports, at any depth of
the file (imports inside functions count: they are still dependencies).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "dcredit_opt"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (``from . import x`` resolved against its package)."""
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


MODULES = {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def _importers_of(target: str, within: str) -> list[str]:
    return sorted(m for m, names in MODULES.items() if m.startswith(within)
                  and any(n == target or n.startswith(target + ".") for n in names))


def test_the_module_map_was_read():
    assert "dcredit_opt.optimizer" in MODULES and "dcredit_opt.backends.torch_dist" in MODULES
    assert "dcredit_opt.profiler" in MODULES["dcredit_opt.optimizer"]


def _pure(name: str) -> bool:
    """The planner, and ``planning.py`` (the runtime's door into it, itself made of planner calls only)."""
    return name.startswith("dcredit_opt.planner") or name.split(".")[:2] == ["dcredit_opt", "planning"]


def test_the_planner_is_pure():
    """Pure functions of profiles: nothing of the runtime, no processes, no torch."""
    for module, names in MODULES.items():
        if not _pure(module):
            continue
        ours = {n for n in names if n.startswith("dcredit_opt") and not _pure(n)}
        assert not ours, f"{module} imports {sorted(ours)} from above the planner"
        assert not {n for n in names if n.split(".")[0] in ("torch", "horovod", "mpi4py")}, \
            f"{module} imports a framework: {sorted(names)}"


@pytest.mark.parametrize("above", ["dcredit_opt.profiler", "dcredit_opt.optimizer", "dcredit_opt.lazy"])
def test_backends_only_launch_collectives(above):
    """A backend launches and completes collectives; measuring them (the profiler's sweep) and the optimizer
    sit above it and call it, never the other way round."""
    assert _importers_of(above, "dcredit_opt.backends") == []


def test_launchers_do_not_import_the_runtime():
    """runtime.py owns "which world are we in"; launchers.py only says how each launcher joins one."""
    assert _importers_of("dcredit_opt.runtime", "dcredit_opt.launchers") == []


def test_the_installed_package_stands_alone():
    """Nothing under dcredit_opt/ imports the repository's benchmarks or tests (they are not installed)."""
    for top in ("benchmarks", "tests"):
        assert _importers_of(top, "dcredit_opt") == []
