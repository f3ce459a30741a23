"""The package's layers (DESIGN.md section 2): each depends only on the ones below it.

Read from the source with ``ast`` (no import runs): which ``dcredit_opt``
modules, and which outside packages, each module imports, at any depth of
the file (imports inside functions count: they are still dependencies). And
the name lists several layers need: each written out once, in the lowest
layer that needs it, and imported by the others.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "dcredit_opt"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


TREES = {_module_name(p): (p, ast.parse(p.read_text(), filename=str(p))) for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, tree: ast.Module) -> set[str]:
    """Absolute names of every module ``path`` imports (``from . import x`` resolved against its package)."""
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
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


MODULES = {module: _imports(path, tree) for module, (path, tree) in TREES.items()}


def _within(name: str, *places: str) -> bool:
    """Whether ``name`` is one of ``places`` or inside one."""
    return any(name == p or name.startswith(p + ".") for p in places)


def _importers_of(target: str, within: str) -> list[str]:
    return sorted(m for m, names in MODULES.items() if m.startswith(within) and any(_within(n, target) for n in names))


def _ours(names: set[str]) -> set[str]:
    """The package's modules among ``names`` (``dcredit_opt`` alone is what ``from .. import x`` adds beside x)."""
    return {n for n in names if _within(n, "dcredit_opt") and n != "dcredit_opt"}


def test_the_module_map_was_read():
    assert "dcredit_opt.optimizer.wrapper" in MODULES and "dcredit_opt.backends.torch_dist" in MODULES
    assert "dcredit_opt.profiling.profiler" in MODULES["dcredit_opt.optimizer.core"]


LAYERS = (
    ("the pure planner", ("dcredit_opt.planner", "dcredit_opt.blockops", "dcredit_opt.files")),
    ("the ground", ("dcredit_opt._build_info", "dcredit_opt._ext", "dcredit_opt.adasum", "dcredit_opt.config",
                    "dcredit_opt.errors", "dcredit_opt.reduce_ops", "dcredit_opt.timeline")),
    ("the world", ("dcredit_opt.world",)),
    ("the backends", ("dcredit_opt.backends",)),
    ("profiling", ("dcredit_opt.profiling",)),
    ("the optimizer", ("dcredit_opt.optimizer",)),
    ("Horovod's API", ("dcredit_opt.collectives",)),
    ("the package's front", ()),
    ("the tools", ("dcredit_opt.cli", "dcredit_opt.__main__")),
)
"""The package's layers (DESIGN.md section 2), lowest first: a module imports its own layer and those below
it, never one above. The planner is pure (profiles in, plans out); the ground is what every layer may use
(the configuration, the errors, the extension's loader, the timeline's files); the world says which job we
are in and owns the control plane; a backend launches one block's collective on it; profiling measures the
live job and turns it into plans; the optimizer (its folder) is the wrapper and the objects that own its
state; Horovod's
API is what a script calls; ``dcredit_opt/__init__.py`` is the front; the command line sits on top."""


def _layer_of(module: str) -> int:
    if module == "dcredit_opt":
        return [name for name, _ in LAYERS].index("the package's front")
    for i, (_, places) in enumerate(LAYERS):
        if _within(module, *places):
            return i
    raise AssertionError(f"{module} is in no layer: add it (or its folder) to LAYERS")


def test_every_module_has_its_layer():
    for module in MODULES:
        _layer_of(module)


def test_every_layer_names_modules_that_exist():
    """A layer's places are modules or folders of the package (a moved module must move in the table too)."""
    for name, places in LAYERS:
        for place in places:
            assert any(_within(m, place) for m in MODULES), f"{name}: {place} is no module of the package"


def test_each_module_imports_only_its_layer_and_below():
    upward = []
    for module, names in MODULES.items():
        for name in sorted(_ours(names)):
            if name in MODULES and _layer_of(name) > _layer_of(module):
                upward.append(f"{module} ({LAYERS[_layer_of(module)][0]}) imports {name} "
                              f"({LAYERS[_layer_of(name)][0]})")
    assert upward == []


PURE = LAYERS[0][1]
"""The planner, the block-op values it shares with the backends, and how files are written whole (modules
that import nothing of ours)."""

FRAMEWORKS = ("torch", "horovod", "mpi4py")


def test_the_planner_is_pure():
    """Pure functions of profiles: nothing of the runtime, no processes, no torch; not even
    ``profiling/planning.py``, the runtime's door into the planner, which sits above it."""
    for module, names in MODULES.items():
        if not _within(module, "dcredit_opt.planner"):
            continue
        ours = {n for n in _ours(names) if not _within(n, *PURE)}
        assert not ours, f"{module} imports {sorted(ours)} from above the planner"
        assert not {n for n in names if _within(n, *FRAMEWORKS)}, f"{module} imports a framework: {sorted(names)}"


@pytest.mark.parametrize("low", ["dcredit_opt.blockops", "dcredit_opt.files", "dcredit_opt.errors",
                                 "dcredit_opt.reduce_ops"])
def test_the_lowest_modules_import_nothing_of_ours(low):
    assert not _ours(MODULES[low]), f"{low} imports {sorted(_ours(MODULES[low]))}"
    assert not {n for n in MODULES[low] if _within(n, *FRAMEWORKS)}


def test_planning_is_made_of_planner_calls():
    """``profiling/planning.py`` turns the runtime's Config into planner calls: it imports the planner and
    nothing else of ours."""
    names = MODULES["dcredit_opt.profiling.planning"]
    assert {n for n in _ours(names) if not _within(n, *PURE)} == set()
    assert not {n for n in names if _within(n, *FRAMEWORKS)}


def test_the_horovod_api_is_only_the_packages_front():
    """Only ``dcredit_opt/__init__.py`` imports Horovod's API; the layers under it (the profiler, the job's
    set-up) use the world's own control plane instead."""
    importers = [m for m in _importers_of("dcredit_opt.collectives", "dcredit_opt")
                 if not _within(m, "dcredit_opt.collectives")]
    assert importers == ["dcredit_opt"], f"the collectives are imported by {importers}"


def test_nothing_below_the_optimizer_imports_it():
    """``optimizer/``, the drop-in wrapper and its parts, is the runtime's top: the package's front, the tool
    that builds one to profile a model, and ``broadcast_optimizer_state`` (which applies a wrapped optimizer's
    pending updates first) import it; what both the optimizer and the collectives take (their ``Average`` and
    ``Sum``) lives below both (``reduce_ops.py``)."""
    above = ("dcredit_opt", "dcredit_opt.cli.model_profile", "dcredit_opt.collectives.functions")
    importers = [m for m in _importers_of("dcredit_opt.optimizer", "dcredit_opt")
                 if not _within(m, "dcredit_opt.optimizer")]
    assert [m for m in importers if m not in above] == []


def test_only_the_entry_point_imports_the_command_line():
    assert _importers_of("dcredit_opt.cli", "dcredit_opt") == ["dcredit_opt.__main__", "dcredit_opt.cli.commands"]


WORLD = ("runtime", "launchers", "groups", "peers", "control", "channels", "job", "process_sets")
"""The world's modules, lowest first: each imports only those before it (``launchers.py`` says how each
launcher joins a job, and knows nothing of the world we are in; ``job.py`` joins and leaves it; a process
set, some of its ranks with their own channels and control plane, is built on all of those)."""


def test_the_world_is_layered_too():
    assert {m for m in MODULES if _within(m, "dcredit_opt.world") and m != "dcredit_opt.world"} == {
        f"dcredit_opt.world.{m}" for m in WORLD}
    for i, module in enumerate(WORLD):
        above = {n for n in _ours(MODULES[f"dcredit_opt.world.{module}"])
                 if _within(n, *(f"dcredit_opt.world.{m}" for m in WORLD[i:]))} - {f"dcredit_opt.world.{module}"}
        assert above == set(), f"world/{module}.py imports {sorted(above)}"


def test_the_installed_package_stands_alone():
    """Nothing under dcredit_opt/ imports the repository's benchmarks or tests (they are not installed)."""
    for top in ("benchmarks", "tests"):
        assert _importers_of(top, "dcredit_opt") == []


def _literal_lists(tree: ast.Module):
    """Every tuple, list and set written out in ``tree``, as the strings in it."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            yield {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}


def _copies_of(names) -> list[str]:
    """The modules that write out every one of ``names`` in one literal."""
    return sorted(m for m, (_, tree) in TREES.items() if any(set(names) <= strings for strings in _literal_lists(tree)))


def test_each_name_list_is_written_once():
    """The policies' names (the planner: ``Config`` takes them from it) and the backends' names (the backends:
    ``Config`` again) are written out in one module each."""
    from dcredit_opt.config import BACKENDS
    from dcredit_opt.planner.plan import POLICY_NAMES

    assert _copies_of(POLICY_NAMES) == ["dcredit_opt.planner.plan"]
    assert _copies_of(BACKENDS) == ["dcredit_opt.config"]


def test_each_constant_is_defined_once():
    """A public constant (such as ``DEFAULT_BLOCK_BYTES``: the planner's, also ``Config``'s default) is
    assigned in one module; the others import it."""
    where: dict[str, list[str]] = {}
    for module, (_, tree) in TREES.items():
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            for name in (n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)):
                if name.isupper() and not name.startswith("_"):
                    where.setdefault(name, []).append(module)
    assert "DEFAULT_BLOCK_BYTES" in where
    assert {name: modules for name, modules in where.items() if len(modules) > 1} == {}


OWNERS = {"dcredit_opt.optimizer.usage": ("UsageTally",), "dcredit_opt.optimizer.buffers": ("GradientBuffers",),
          "dcredit_opt.optimizer.updates": ("LazyUpdates",), "dcredit_opt.profiling.replanner": ("Replanner",),
          "dcredit_opt.optimizer.gradients": ("Backward",), "dcredit_opt.optimizer.lazy": ("Stepper",),
          "dcredit_opt.optimizer.core": ("Core",)}
"""The objects that own a part of the optimizer's state (issue A1), by module: their private fields are
read and written through ``self`` in their own methods only; others use their methods and public fields."""


def _fields(cls: ast.ClassDef) -> set[str]:
    """The names ``cls`` assigns on ``self``."""
    return {node.attr for node in ast.walk(cls) if isinstance(node, ast.Attribute) and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name) and node.value.id == "self" and isinstance(node.ctx, ast.Store)}


def _private_fields(cls: ast.ClassDef) -> set[str]:
    return {name for name in _fields(cls) if name.startswith("_")}


def test_the_state_owners_own_their_fields():
    fields = {}
    for module, classes in OWNERS.items():
        tree = TREES[module][1]
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in classes):
            fields.update({name: (module, cls.name) for name in _private_fields(cls)})
    assert fields, "no owner's fields were read"
    reached = []
    for path, tree in TREES.values():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            # Another class's own ``self._names`` is its own field; ``x._names`` of anything else is a reach-in.
            if node.attr in fields and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                reached.append(f"{path.name}:{node.lineno} .{node.attr} of {fields[node.attr][1]}")
    assert reached == []


def test_only_an_owner_assigns_its_public_fields():
    """Others read an owner's public fields (``lazy.pending``, ``buffers.slots``) and change them through its
    methods: no ``x.field = ...`` on another object, for any field an owner assigns on ``self``."""
    public = {}
    for module, classes in OWNERS.items():
        for cls in (n for n in TREES[module][1].body if isinstance(n, ast.ClassDef) and n.name in classes):
            public.update({name: cls.name for name in _fields(cls) if not name.startswith("_")})
    assert {"pending", "slots", "open"} <= set(public)
    written = []
    for path, tree in TREES.values():
        # A class of this module with a field of the same name (a planner's run copied with another plan)
        # is that class's business.
        own = {name for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) for name in _fields(cls)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)) and node.attr in public
                    and node.attr not in own and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                written.append(f"{path.name}:{node.lineno} .{node.attr} of {public[node.attr]}")
    assert written == []


WRAPPERS = ("dcredit_opt.optimizer.wrapper", "dcredit_opt.optimizer.adasum")


def test_the_wrapper_is_a_thin_composition():
    """The generated optimizer subclass (``optimizer/wrapper.py``) holds one field of its own, ``_dc``: the core
    (``core.py``) that composes the owners above (with op=Adasum, ``optimizer/adasum.py``'s subclass and its own
    core, Note [Adasum optimizer]). The wrappers' modules set and read it; everyone else
    reaches the core through ``lazy.core_of`` (the model's hooks through their keeper). No other ``_dc_*``
    name is left on an optimizer; a watched gradient's own two fields are set where it is made (``watched.py``)."""
    reached = []
    for module, (path, tree) in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "_dc" and module not in WRAPPERS:
                reached.append(f"{path.name}:{node.lineno} ._dc")
            if isinstance(node, ast.Constant) and node.value == "_dc" and module != "dcredit_opt.optimizer.lazy":
                reached.append(f"{path.name}:{node.lineno} '_dc'")
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_dc_") and module != "dcredit_opt.optimizer.watched"
                    and node.attr not in ("_dc_index", "_dc_keeper")):
                reached.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert reached == []
