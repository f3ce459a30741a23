"""Every backend offers every member of ``backends.base.Backend``, and every transport of a Python-driven
backend every member of ``backends.base.Transport``: a caller uses them without asking whether they are
there. Read from the classes (no world is joined, no backend is built)."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch

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


@pytest.mark.parametrize("cls", [mpi._MPITransport, horovod._HorovodTransport, horovod._Alone])
def test_every_transport_offers_the_whole_protocol(cls):
    missing = {m for m in _members(base.Transport) if not hasattr(cls, m)}
    assert missing == set(), f"{cls.__name__} lacks {sorted(missing)}"


def test_only_the_torch_backend_sums_delayed_gradients():
    assert _members(base.DelayedSums) == {"start_delayed", "wait_delayed"}
    assert [cls.__name__ for cls in (backends.TorchDistBackend, backends.MPIBackend, backends.HorovodBackend)
            if all(hasattr(cls, m) for m in _members(base.DelayedSums))] == ["TorchDistBackend"]


def test_a_rank_alone_in_its_horovod_set_keeps_its_blocks_post_scaled_once():
    from dcredit_opt.blockops import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER

    alone = horovod._Alone()
    views = [torch.tensor([2.0, 4.0]), torch.tensor([6.0]), torch.tensor([6.0])]
    alone.set_blocks(views, 0.5, [(ALL_REDUCE, -1), (REDUCE_SCATTER, -1), (ALL_GATHER, 1)])
    for block in range(3):
        alone.wait(block, alone.start(block, 0))
        alone.finish(block)
    assert [v.tolist() for v in views] == [[1.0, 2.0], [6.0], [3.0]]
    ids, rows = torch.tensor([3, 1]), torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    (got_ids, got_rows), = alone.exchange_rows(ids, rows, True, 1.0)[0]
    assert torch.equal(got_ids, ids) and torch.equal(got_rows, rows)
    assert alone.exchange_rows(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2), False, 1.0) == ([], False)
