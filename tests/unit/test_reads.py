"""Which parameters an operation's arguments touch, by memory (Note [First read], Note [Guard cost])."""

import pytest
import torch

from dcredit_opt.optimizer.buffers import per_tensor
from dcredit_opt.optimizer.reads import Addresses


def _flat_params():
    """Three parameters that are views of one flat buffer, as a flattened model holds them."""
    flat = torch.zeros(30)
    return flat, [torch.nn.Parameter(flat[0:10].view(2, 5)), torch.nn.Parameter(flat[10:20]),
                  torch.nn.Parameter(flat[20:30])]


def test_a_parameter_and_its_aliases_touch_it():
    a, b = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))
    addr = Addresses([a, b])
    assert addr.read_by((a,), None) == [0]
    assert addr.read_by((torch.ones(3), b.detach()), None) == [1]
    assert addr.read_by((a.data.t(),), None) == [0]  # not contiguous
    assert addr.read_by((a[2:, 1:],), None) == [0]  # a strided view inside
    assert addr.read_by((), {"weight": b.view(5, 1)}) == [1]
    assert addr.read_by(([torch.ones(2), a],), None) == [0]  # one level into lists
    assert sorted(addr.read_by((a, b), {"out": a})) == [0, 0, 1]


def test_other_tensors_touch_nothing():
    a = torch.nn.Parameter(torch.randn(4, 3))
    addr = Addresses([a])
    assert addr.read_by((torch.randn(4, 3), torch.zeros(1000), 3, "x", None), {"dim": 1}) == []
    assert addr.read_by((a[1:1],), None) == []  # empty: no byte of the parameter
    sparse = torch.sparse_coo_tensor([[0]], [1.0], (4,), check_invariants=True)
    assert addr.read_by((sparse,), None) == []  # no address


def test_a_buffer_over_several_parameters_touches_each():
    flat, params = _flat_params()
    addr = Addresses(params)
    assert sorted(addr.read_by((flat,), None)) == [0, 1, 2]
    assert sorted(addr.read_by((flat[8:12],), None)) == [0, 1]  # straddles the first two
    assert addr.read_by((flat[25:],), None) == [2]
    assert addr.read_by((flat[::10],), None) == [0, 1, 2]  # strided: 0, 10, 20


def test_a_buffer_that_starts_below_every_parameter_and_reaches_in():
    big = torch.zeros(100)
    p = torch.nn.Parameter(big[50:60])
    addr = Addresses([p])
    assert addr.read_by((big[:51],), None) == [0]  # starts below the span, ends inside it
    assert addr.read_by((big[:50],), None) == []  # ends exactly where the parameter starts
    assert addr.read_by((big[60:],), None) == []  # starts exactly where it ends
    assert addr.read_by((big[59:],), None) == [0]


def test_no_parameters_touch_nothing():
    assert Addresses([]).read_by((torch.ones(3),), None) == []


def _flags(n, pending=()):
    flags = per_tensor(n, "B")
    for i in pending:
        flags[i] = 1
    return flags


def _layouts():
    """Argument lists over three parameters (two views of one flat buffer, one apart) and other tensors: aliases,
    strided and transposed views, expanded and empty ones, lists, kwargs, sparse and meta tensors, numbers."""
    flat, params = _flat_params()
    a, b, c = params
    other = torch.nn.Parameter(torch.randn(4, 3))
    big = torch.zeros(100)
    return [a, b, c, other], [
        ((a,), None), ((b.detach(), 3), {}), ((flat,), None), ((flat[8:12],), None), ((flat[::10],), None),
        ((flat[25:],), None), ((other.t(),), None), ((other[2:, 1:],), None), (([torch.ones(2), a, other],), None),
        ((), {"weight": other.view(12, 1), "bias": (c, b)}), ((a[1:1],), None), ((torch.randn(4, 3), "x", None), None),
        ((big, big[:50]), {"out": big}), ((torch.zeros(1).expand(5),), None),
        ((torch.sparse_coo_tensor([[0]], [1.0], (4,), check_invariants=True),), None), ((torch.empty(3, device="meta"),), None),
        ((other.detach().as_strided((2, 2), (1, 3), 1),), None)]


def test_the_guards_cpp_table_touches_what_the_python_search_touches():
    """Note [Guard cost]: ``pending_read_by`` through the C++ table equals the Python search filtered by the pending
    flags, over every layout, whichever parameters are pending; ``touched`` equals ``read_by`` itself."""
    params, cases = _layouts()
    for pending in ((), (0,), (1, 3), (0, 1, 2, 3), (2,)):
        flags = _flags(len(params), pending)
        fast, slow = Addresses(params, flags), Addresses(params)
        assert fast._table is not None and slow._table is None
        slow._pending = flags
        for args, kwargs in cases:
            assert fast._table.touched(args, kwargs) == slow.read_by(args, kwargs or {}), (args, kwargs)
            assert fast.pending_read_by(args, kwargs) == slow.pending_read_by(args, kwargs or {}), (args, kwargs)
    flags = _flags(4, (0, 1, 2, 3))
    table = Addresses(params, flags)
    assert table.pending_read_by((params[3], params[0], params[3]), None) == [3, 0]  # each once, first touched first
    flags[3] = 0  # the flags are read at each call, not copied when made
    assert table.pending_read_by((params[3], params[0]), None) == [0]


def test_the_cpp_table_refuses_ranges_out_of_order_or_naming_no_tensor():
    from dcredit_opt import _ext

    table = _ext.load().AddressTable
    flags = _flags(2)
    with pytest.raises(ValueError, match="range 1 is empty, out of order, or names no tensor"):
        table([(100, 200, 0), (50, 60, 1)], flags)
    with pytest.raises(ValueError, match="range 0"):
        table([(100, 200, 5)], flags)
    with pytest.raises(ValueError, match="range 0"):
        table([(100, 100, 0)], flags)
