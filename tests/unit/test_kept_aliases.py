"""Note [Kept aliases] (optimizer/watched.py), in a world of one: a ``.data`` or ``detach()`` alias of ``p.grad``
kept across iterations is given memory of its own where plain torch's ``p.grad`` is dropped, and otherwise gets
the reduced gradient before backward returns and its update in ``step()``. The 2-rank patterns that write through
such aliases are in ``tests/distributed/gradient_patterns.py``."""

from __future__ import annotations

import gc
import logging

import torch
from torch import nn

import dcredit_opt as dc
from dcredit_opt import _ext

C = _ext.load()


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters(),
                                  config=dc.Config(block_bytes=64, window=2, policy="fixed"))
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    return model, opt, lambda: nn.functional.cross_entropy(model(x), y)


def _iteration(opt, loss, set_to_none=True):
    opt.zero_grad(set_to_none=set_to_none)
    loss().backward()
    opt.step()


def test_an_alias_of_its_own_keeps_what_it_held_and_its_writes_reach_nothing():
    slot = torch.arange(6.0)
    for alias in (slot.detach(), slot.data):
        before = slot._version
        C.give_own_memory(alias)
        alias.mul_(10)
        assert slot.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and slot._version == before
        assert alias.tolist() == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]


def test_only_live_aliases_are_kept_and_none_is_looked_at_until_one_is_taken():
    model, opt, loss = _setup()
    buffers = opt._dc.buffers
    try:
        _iteration(opt, loss)
        assert buffers.aliases == {} and buffers.aliased() == ()
        model[0].weight.grad.data.mul_(1.0)  # taken and dropped at once: forgotten at the next look
        kept = model[2].bias.grad.detach()
        assert set(buffers.aliases) == {0, 3}
        assert buffers.aliased() == (3,) and set(buffers.aliases) == {3}
        del kept
        gc.collect()
        assert buffers.aliased() == () and buffers.aliases == {}
    finally:
        opt._dc.close()


def test_after_zero_grad_to_none_a_kept_alias_holds_the_old_gradient_and_writes_through_it_change_nothing():
    model, opt, loss = _setup()
    ref_model, ref_opt, ref_loss = _setup()
    try:
        for o, l in ((opt, loss), (ref_opt, ref_loss)):
            o.zero_grad()
            l().backward()
        kept = model[0].weight.grad.data
        ref_kept = ref_model[0].weight.grad.data
        old = kept.clone()
        for o in (opt, ref_opt):
            o.step()
        for step in range(3):
            for m, o, l, k in ((model, opt, loss, kept), (ref_model, ref_opt, ref_loss, ref_kept)):
                o.zero_grad()  # to None: plain torch's alias is of a gradient nothing uses any more
                l().backward()
                k.mul_(0.5)
                o.step()
        assert kept.data_ptr() != opt._dc.buffers.slots[0].data_ptr()
        assert torch.equal(kept, old * 0.5 ** 3) and torch.equal(ref_kept, old * 0.5 ** 3)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(p, q)
    finally:
        opt._dc.close()
        ref_opt._dc.close()


def test_with_p_grad_kept_a_kept_alias_sees_the_reduced_gradient_when_backward_returns(caplog):
    model, opt, _ = _setup()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    core = opt._dc
    try:
        for m, o in ((model, opt), (ref, ref_opt)):  # the first iteration learns where the forward reads
            o.zero_grad(set_to_none=False)
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
        kept = model[2].weight.grad.data  # taken between step() and the next backward, and kept
        ref_kept = ref[2].weight.grad.data
        with caplog.at_level(logging.INFO, logger="dcredit_opt"):
            for step in range(3):
                for m, o, k in ((model, opt, kept), (ref, ref_opt, ref_kept)):
                    o.zero_grad(set_to_none=False)
                    nn.functional.cross_entropy(m(x), y).backward()
                    if m is model:
                        # The backward ended by releasing every block and waiting for the kept alias's tensor.
                        assert core.backward.flushed and core.backward.final[2]
                    k.mul_(0.5)  # the averaged gradient, which step() uses
                    o.step()
                    if m is model:
                        assert not core.lazy.pending[2]  # its update applied in step(), before any later write
                        assert core.lazy.npending  # the others still wait for the next forward
        told = [r.getMessage() for r in caplog.records if "has an alias taken in an earlier iteration" in r.getMessage()]
        assert len(told) == 1 and "'2.weight'" in told[0]
        opt.synchronize()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
    finally:
        opt._dc.close()
