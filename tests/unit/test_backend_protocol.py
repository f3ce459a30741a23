"""Every backend offers every member of ``backends.base.Backend``, and every transport of a Python-driven
backend every member of ``backends.base.Transport``: a caller uses them without asking whether they are
there. Read from the classes (no world is joined, no backend is built)."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from dcredit_opt import backends
from dcredit_opt.backends import base, horovod, mpi

pytestmark = pytest.mark.timeout(60)


def _members(protocol) -> set[str]:
    """What ``protocol`` declares: its annotated fields and its methods."""
    return set(protocol.__annotations__) | {n for n, v in vars(protocol).items()
                                            if not n.startswith("_") and callable(v)}


def _set_in_init(cls) -> set[str]:
    """The fields ``cls.__init__`` (or a base's) sets on ``self``."""
    out = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if not inspect.isfunction(init):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        out |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return out


@pytest.mark.parametrize("cls", [backends.TorchDistBackend, backends.MPIBackend, backends.HorovodBackend])
def test_every_backend_offers_the_whole_protocol(cls):
    missing = {m for m in _members(base.Backend) if not hasattr(cls, m) and m not in _set_in_init(cls)}
    assert missing == set(), f"{cls.__name__} lacks {sorted(missing)}"
    assert cls.name in backends.BACKENDS


@pytest.mark.parametrize("cls", [mpi._MPITransport, horovod._HorovodTransport])
def test_every_transport_offers_the_whole_protocol(cls):
    missing = {m for m in _members(base.Transport) if not hasattr(cls, m)}
    assert missing == set(), f"{cls.__name__} lacks {sorted(missing)}"


def test_only_the_torch_backend_sums_delayed_gradients():
    assert _members(base.DelayedSums) == {"start_delayed", "wait_delayed"}
    assert [cls.__name__ for cls in (backends.TorchDistBackend, backends.MPIBackend, backends.HorovodBackend)
            if all(hasattr(cls, m) for m in _members(base.DelayedSums))] == ["TorchDistBackend"]
