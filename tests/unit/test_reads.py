"""Which parameters an operation's arguments touch, by memory (Note [First read], Note [Guard cost])."""

import torch

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
