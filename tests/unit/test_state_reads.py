"""Note [Reading the state] (optimizer/lazy.py), in a world of one: ``opt.state`` reads as synchronous training
has it between a lazy ``step()`` and the forward that applies its updates, while the wrapped step's own reads of
it run no Python of ours."""

import collections
import copy

import pytest
import torch

from dcredit_opt.optimizer import lazy
from tests.unit.test_gradient_path import LAZY, assert_same, loss, pair, train

pytestmark = pytest.mark.timeout(120)


def test_the_wrapped_step_reads_the_state_without_our_python():
    """The wrapped SGD's step reads ``self.state[p]`` per parameter: none of those reads reaches the wrapper's
    descriptor, in a lazy apply or an eager step, and training equals plain torch."""
    model, opt, ref, ropt = pair(LAZY)
    calls = []
    get = lazy.PendingState.__get__

    def counted(self, optimizer, owner=None):
        calls.append(optimizer)
        return get(self, optimizer, owner)

    try:
        train(model, opt, range(3), ref, ropt)
        lazy.PendingState.__get__ = counted
        for s in range(3, 6):
            train(model, opt, range(s, s + 1), ref, ropt)
            assert opt._dc.lazy.npending  # deferred: the next forward applies them
        opt.synchronize()
        assert calls == []
        assert_same(model, ref)
    finally:
        lazy.PendingState.__get__ = get
        opt._dc.close()


def test_reading_the_state_after_a_lazy_step_applies_the_updates_first():
    model, opt, ref, ropt = pair(LAZY)
    try:
        train(model, opt, range(4), ref, ropt)
        assert opt._dc.lazy.npending and "state" not in vars(opt)
        buffers = [opt.state[p]["momentum_buffer"] for p in model.parameters()]  # a log of the momentum
        assert not opt._dc.lazy.npending and "state" in vars(opt)
        for b, q in zip(buffers, ref.parameters()):
            assert torch.allclose(b, ropt.state[q]["momentum_buffer"], atol=1e-6)
        assert_same(model, ref)
        train(model, opt, range(4, 6), ref, ropt)
        opt.synchronize()
        assert_same(model, ref)
    finally:
        opt._dc.close()


@pytest.mark.parametrize("reset", ["assign", "clear"])
def test_resetting_the_state_after_a_lazy_step_resets_it_after_the_updates(reset):
    """``opt.state = defaultdict(dict)`` or ``opt.state.clear()`` between ``step()`` and the next forward: in plain
    torch that step's update used the momentum it had, and the next step starts afresh. So here."""
    model, opt, ref, ropt = pair(LAZY)
    try:
        train(model, opt, range(4), ref, ropt)
        assert opt._dc.lazy.npending
        for o in (opt, ropt):
            if reset == "assign":
                o.state = collections.defaultdict(dict)
            else:
                o.state.clear()
        assert not opt._dc.lazy.npending and not opt.state
        train(model, opt, range(4, 7), ref, ropt)
        opt.synchronize()
        assert_same(model, ref)
    finally:
        opt._dc.close()


def test_a_checkpoint_loaded_while_updates_wait_is_the_state_that_stays():
    """``load_state_dict()`` between ``step()`` and the next forward: the pending updates first, then the loaded
    state (moments, hyperparameters) is the one the next steps use, as in plain torch."""
    model, opt, ref, ropt = pair(LAZY)
    try:
        train(model, opt, range(3), ref, ropt)
        saved = copy.deepcopy(opt.state_dict())  # its tensors are the live ones
        train(model, opt, range(3, 5), ref, ropt)
        assert opt._dc.lazy.npending
        opt.load_state_dict(copy.deepcopy(saved))
        ropt.load_state_dict(copy.deepcopy(saved))
        assert not opt._dc.lazy.npending and "state" in vars(opt)
        train(model, opt, range(5, 8), ref, ropt)
        opt.synchronize()
        assert_same(model, ref)
    finally:
        opt._dc.close()


def test_an_optimizer_closed_with_updates_pending_leaves_its_state_in_place():
    model, opt, ref, ropt = pair(LAZY)
    train(model, opt, range(4), ref, ropt)
    assert opt._dc.lazy.npending
    opt._dc.close()
    assert "state" in vars(opt) and len(opt.state) == len(list(model.parameters()))
    assert_same(model, ref)


def test_an_optimizer_dropped_with_updates_pending_applies_them_at_the_next_forward():
    """The model's hooks keep the optimizer while its updates wait; its state is read where they are applied."""
    model, opt, ref, ropt = pair(LAZY)
    train(model, opt, range(4), ref, ropt)
    core = opt._dc
    del opt
    try:
        with torch.no_grad():
            loss(model, 4)
        assert not core.lazy.npending
        assert_same(model, ref)
    finally:
        core.close()
