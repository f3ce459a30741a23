"""Note [Several guards] (optimizer/reads.py), in a world of one: two optimizers of ours over one model. One's own
work (a zero_grad to None, a wrapped step applying its deferred updates) lifts the other's guard too, and training
still equals plain torch with two optimizers; where the work might read the other's parameters (a step hook, shared
memory), the other guard stays and applies its updates first."""

import pytest
import torch
from torch import nn

import dcredit_opt as dc
from dcredit_opt.optimizer import lazy, reads
from tests.unit.test_gradient_path import LAZY, batch, net

pytestmark = pytest.mark.timeout(120)


def split(model):
    """Two optimizers of ours over ``model`` (the first layer and the rest), and plain torch's pair over a copy."""
    ref = net()
    mine, theirs = [], []
    for m, out in ((model, mine), (ref, theirs)):
        first = list(m[0].parameters())
        rest = [p for p in m.parameters() if not any(p is q for q in first)]
        out += [torch.optim.SGD(first, lr=0.1, momentum=0.9), torch.optim.AdamW(rest, lr=0.01)]
    names = {id(p): n for n, p in model.named_parameters()}
    ours = [dc.DistributedOptimizer(o, named_parameters=[(names[id(p)], p) for p in o.param_groups[0]["params"]],
                                    config=LAZY) for o in mine]
    return ours, ref, theirs


def step(model, opts, s, set_to_none=True):
    for o in opts:
        o.zero_grad(set_to_none=set_to_none)
    model(batch(s)).pow(2).mean().backward()
    for o in opts:
        o.step()


def guard_calls(monkeypatch):
    """Every call a guard's handler takes, as (the guard, the phase it came in)."""
    seen, phase = [], ["outside"]
    handler = reads.PendingReadGuard.__torch_function__

    def counted(self, func, types, args=(), kwargs=None):
        seen.append((self, phase[0]))
        return handler(self, func, types, args, kwargs)

    base_step = lazy.Stepper._base_step

    def in_phase(self, optimizer):
        phase[0] = "wrapped step"
        try:
            return base_step(self, optimizer)
        finally:
            phase[0] = "outside"

    monkeypatch.setattr(reads.PendingReadGuard, "__torch_function__", counted)
    monkeypatch.setattr(lazy.Stepper, "_base_step", in_phase)
    return seen, phase


def assert_equal(model, ref):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach()), f"{name} differs from plain torch with two optimizers"


@pytest.mark.parametrize("set_to_none", [True, False], ids=["to-none", "zeros"])
def test_two_optimizers_equal_plain_torch_and_their_own_work_passes_no_other_guard(monkeypatch, set_to_none):
    model = net()
    ours, ref, theirs = split(model)
    try:
        for s in range(3):
            step(model, ours, s, set_to_none)
            step(ref, theirs, s, set_to_none)
        assert all(o._dc.lazy.npending for o in ours)  # both deferred: both guards armed
        seen, phase = guard_calls(monkeypatch)
        phase[0] = "zero_grad"
        for o in ours:
            o.zero_grad(set_to_none=set_to_none)
        phase[0] = "outside"
        zeroing = [g for g, where in seen if where == "zero_grad"]
        if set_to_none:
            assert zeroing == []  # gets and sets of p.grad only: every guard stood aside
        del seen[:]
        model(batch(3)).pow(2).mean().backward()  # each applies its updates at the forward's first module
        assert not any(o._dc.lazy.npending for o in ours)
        assert [where for _, where in seen if where == "wrapped step"] == []
        for o in ours:
            o.step()
        monkeypatch.undo()
        for o in theirs:
            o.zero_grad(set_to_none=set_to_none)
        ref(batch(3)).pow(2).mean().backward()
        for o in theirs:
            o.step()
        for s in range(4, 7):
            step(model, ours, s, set_to_none)
            step(ref, theirs, s, set_to_none)
        for o in ours:
            o.synchronize()
        assert_equal(model, ref)
    finally:
        for o in ours:
            o._dc.close()


def test_a_step_hook_registered_since_keeps_the_other_guard_and_reads_its_update():
    """A hook on the first optimizer, registered after its step() deferred, runs in the wrapped step that applies
    the update, and reads a parameter of the second optimizer whose update still waits: the second guard stays on
    the stack and applies that update first, as it does for any read (Note [Guarded reads])."""
    model = net()
    ours, ref, theirs = split(model)
    try:
        for s in range(3):
            step(model, ours, s)
            step(ref, theirs, s)
        first, second = ours
        last = model[4].weight
        assert second._dc.lazy.npending and first._dc.lazy.npending
        seen = []
        hook = first.register_step_post_hook(lambda *_: seen.append(last.sum().item()))
        try:
            model[0].weight.sum()  # a read of the first optimizer's pending parameter applies its update
        finally:
            hook.remove()
        assert seen == [ref[4].weight.sum().item()]  # the second optimizer's update, applied for the hook's read
        # That read applied its tensor's update (and, where their reductions had ended, others': timing decides).
        assert not second._dc.lazy.pending[second._dc.names.index("4.weight")]
    finally:
        for o in ours:
            o._dc.close()


def test_optimizers_over_one_memory_keep_each_others_guard():
    """Two parameters over the same memory, one in each optimizer: a wrapped step of one writes what the other
    guards, so that guard is not lifted for it (Addresses.apart_from)."""
    shared = torch.zeros(8)
    a, b = nn.Parameter(shared[:6]), nn.Parameter(shared[4:])
    c = nn.Parameter(torch.zeros(3))
    assert not reads.Addresses([a]).apart_from(reads.Addresses([b]))
    assert reads.Addresses([a]).apart_from(reads.Addresses([c]))
    guard_a, guard_b, guard_c = (reads.PendingReadGuard(lambda: None) for _ in range(3))
    for guard, p in ((guard_a, a), (guard_b, b), (guard_c, c)):
        guard._addresses, guard.armed = reads.Addresses([p]), True
    stack = [guard_b, guard_c, guard_a]
    for g in stack:
        torch._C._push_on_torch_function_stack(g)
    try:
        with guard_a.paused("apart"):
            assert [torch._C._get_function_stack_at(k) for k in range(torch._C._len_torch_function_stack())] == [
                guard_b]  # c lifted, b kept: it shares memory with a
        with guard_a.paused("all"):
            assert torch._C._len_torch_function_stack() == 0
        # Back under everything, in the order they were in; the paused guard at the bottom (Note [Guard cost]).
        assert {torch._C._get_function_stack_at(k) for k in range(3)} == set(stack)
    finally:
        while torch._C._len_torch_function_stack():
            torch._C._pop_torch_function_stack()
