"""Note [Zeroed while pending] (optimizer/core.py), in a world of one: ``zero_grad(set_to_none=False)`` between a
lazy ``step()`` and the forward that applies its updates gives zeros in every ``p.grad`` and trains as plain
torch does, with spares made once and swapped in by one C++ pass."""

import pytest
import torch

import dcredit_opt as dc
from tests.unit.test_gradient_path import LAZY, assert_same, loss, net, pair

pytestmark = pytest.mark.timeout(120)


def kept(model, opt, ref, ropt, steps):
    """Training with ``zero_grad(set_to_none=False)``, both sides; after each zero_grad every p.grad reads as plain
    torch's: zeros (None before the first backward), or what a zero_grad of the class's own kept."""
    for s in steps:
        opt.zero_grad(set_to_none=False)
        ropt.zero_grad(set_to_none=False)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None)
            assert p.grad is None or torch.allclose(p.grad, q.grad, atol=1e-6)
        loss(model, s).backward()
        opt.step()
        loss(ref, s).backward()
        ropt.step()


@pytest.fixture
def settled():
    """A wrapped model and its plain copy after four iterations with kept gradients (the plan, the first-read
    learning and the lazy step settled); closed afterwards."""
    model, opt, ref, ropt = pair(LAZY)
    try:
        kept(model, opt, ref, ropt, range(4))
        yield model, opt, ref, ropt
    finally:
        opt._dc.close()


def test_kept_gradients_train_as_plain_torch_on_the_fast_path(settled):
    model, opt, ref, ropt = settled
    core = opt._dc
    before = core.backward.python_handovers
    kept(model, opt, ref, ropt, range(4, 9))
    assert core.lazy.npending  # lazy all along: each zero_grad met pending updates
    assert core.backward.python_handovers == before  # every gradient handed over in C++
    opt.synchronize()
    assert_same(model, ref)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)  # the reduced gradient of a world of one


def test_the_spares_are_made_once_and_zeroed_at_each_call(settled):
    model, opt, _, _ = settled
    core = opt._dc
    opt.zero_grad(set_to_none=False)
    first = [p.grad for p in model.parameters()]
    assert all(g is s for g, s in zip(first, core._spares))
    loss(model, 4).backward()
    opt.step()
    assert all(p.grad is not s for p, s in zip(model.parameters(), first))  # the slots' aliases again
    first[0].fill_(7.0)  # a held reference written by user code: zeroed at the next call all the same
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is s for p, s in zip(model.parameters(), first))
    assert not any(s.any() for s in first)
    opt.zero_grad()  # to None: the spares go
    assert core._spares is None and all(p.grad is None for p in model.parameters())


def test_a_step_without_backward_after_kept_zeros_steps_as_plain_torch(settled):
    """Zeros put in place of a slot are this rank's gradient of zero, not a replaced gradient: a step() with no
    backward since (as ``hvd.broadcast_optimizer_state`` makes one) steps on them as plain torch does."""
    model, opt, ref, ropt = settled
    opt.zero_grad(set_to_none=False)
    ropt.zero_grad(set_to_none=False)
    opt.step()
    ropt.step()
    kept(model, opt, ref, ropt, range(4, 6))
    opt.synchronize()
    assert_same(model, ref)


def test_give_spares_refuses_a_spare_of_another_shape_and_changes_nothing_for_it(settled):
    model, opt, ref, _ = settled
    core = opt._dc
    params = list(model.parameters())
    assert all(core.lazy.pending)
    held = [p.grad for p in params]
    # Made from the plain copy: a torch call on a pending parameter would apply its update first.
    spares = [torch.zeros_like(q) for q in ref.parameters()]
    spares[1] = torch.zeros(spares[1].numel() + 1)
    spares[2] = spares[2].double()
    assert core.backward.path.give_spares(spares) == [1, 2]
    assert params[1].grad is held[1] and params[2].grad is held[2]
    assert all(params[i].grad is spares[i] for i in range(len(params)) if i not in (1, 2))
    with pytest.raises(ValueError, match="one spare per parameter"):
        core.backward.path.give_spares(spares[:-1])
    core.close()
    assert core.backward.path.give_spares(spares) == []  # closed: nothing pending, nothing given


class KeepsGradients(torch.optim.SGD):
    """A zero_grad of its own, which zeroes only the first layer's gradients when asked to keep them."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        if set_to_none:
            super().zero_grad(set_to_none=True)
            return
        for p in self.param_groups[0]["params"][:2]:
            if p.grad is not None:
                p.grad.zero_()


def test_a_zero_grad_of_the_wrapped_class_own_finds_the_reduced_gradients(caplog):
    """Plain torch's p.grad after step() is the reduced gradient; a zero_grad of the class's own that keeps some
    lets the next backward add to it. The pending updates are applied first, so that it finds them there."""
    model, ref = net(), net()
    opt = dc.DistributedOptimizer(KeepsGradients(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters(), config=LAZY)
    ropt = KeepsGradients(ref.parameters(), lr=0.1, momentum=0.9)
    try:
        with caplog.at_level("WARNING"):
            kept(model, opt, ref, ropt, range(6))
        assert "has a zero_grad of its own" in caplog.text
        assert opt._dc._spares is None
        opt.synchronize()
        assert_same(model, ref)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-6)
    finally:
        opt._dc.close()


def after_step_writes(model, opt, ref, ropt, steps, write):
    """Older scripts' loop: backward, step(), then ``write(model)`` on p.grad (no optimizer.zero_grad() before
    backward), on both sides: the next backward adds to what the write left, as in plain torch."""
    for s in steps:
        loss(model, s).backward()
        opt.step()
        loss(ref, s).backward()
        ropt.step()
        write(model)
        write(ref)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-6)


def _add_one(model):
    for p in model.parameters():
        p.grad += 1.0  # an in-place operator: a write, as zero_() is


def _through_data(model):
    for p in model.parameters():
        p.grad.data.zero_()  # .data: a version counter of its own (Note [Unseen writes])


def _through_detach(model):
    for p in model.parameters():
        p.grad.detach().mul_(0.5)


def _through_numpy(model):
    for p in model.parameters():
        p.grad.numpy()[...] = 0.25  # NumPy's write moves no version counter


@pytest.mark.parametrize("write", [lambda m: m.zero_grad(set_to_none=False), _add_one,
                                   lambda m: torch._foreach_mul_([p.grad for p in m.parameters()], 0.5),
                                   _through_data, _through_detach, _through_numpy],
                         ids=["model.zero_grad(set_to_none=False)", "p.grad += 1", "_foreach_mul_",
                              "p.grad.data.zero_()", "p.grad.detach().mul_()", "p.grad.numpy()"])
def test_a_write_to_p_grad_after_a_lazy_step_applies_the_pending_updates_first(settled, caplog, write):
    """Plain torch's p.grad after step() is the reduced gradient, and an in-place write after step() changes
    what the next backward adds to. Ours still waits for the next forward's updates there: they are applied
    first, then the write lands on the gradient. Before, a write through p.grad stopped at the next apply with a
    DCreditError, and one through p.grad.data or NumPy (which move no version counter) was lost: the pending update
    was applied with what the write left, silently."""
    model, opt, ref, ropt = settled
    core = opt._dc
    with caplog.at_level("WARNING"):
        after_step_writes(model, opt, ref, ropt, range(4, 9), write)
    assert caplog.text.count("was changed in place after step()") == 1  # said once
    loss(model, 9).backward()
    opt.step()
    assert core.lazy.npending  # the step is lazy all along; the writes applied its updates
    loss(ref, 9).backward()
    ropt.step()
    opt.synchronize()
    assert_same(model, ref)


def test_a_read_of_p_grad_after_a_lazy_step_leaves_the_updates_pending(settled):
    """Only writes apply early: logging a gradient after step(), or copying it into a buffer of one's own (an
    in-place operation on the buffer, not on the gradient), keeps the overlap."""
    model, opt, ref, _ = settled
    core = opt._dc
    loss(model, 4).backward()
    opt.step()
    npending = core.lazy.npending
    assert npending
    norms = [float(p.grad.norm()) for p in model.parameters()]
    assert all(n > 0 for n in norms)
    # Buffers made from the plain copy: a torch call on a pending parameter would apply its update first.
    kept = [torch.zeros_like(q) for q in ref.parameters()]
    for buf, p in zip(kept, model.parameters()):
        buf.copy_(p.grad)
    torch._foreach_add_(kept, [p.grad for p in model.parameters()])
    assert core.lazy.npending == npending
    assert all(torch.allclose(buf, 2 * p.grad) for buf, p in zip(kept, model.parameters()))


def test_a_write_after_a_lazy_step_on_another_thread_is_refused_and_changes_nothing(settled):
    """Applying the pending updates there would race the training thread's next forward: refused, naming the
    parameter, before anything is applied or written."""
    import threading

    model, opt, ref, ropt = settled
    core = opt._dc
    loss(model, 4).backward()
    opt.step()
    loss(ref, 4).backward()
    ropt.step()
    npending = core.lazy.npending
    grads = [q.grad.clone() for q in ref.parameters()]
    seen = []

    def other():
        try:
            next(model.parameters()).grad.data.zero_()
        except dc.DCreditError as e:
            seen.append(str(e))

    t = threading.Thread(target=other)
    t.start()
    t.join(30)
    assert len(seen) == 1 and "'0.weight'" in seen[0] and "another thread" in seen[0]
    assert core.lazy.npending == npending  # nothing applied
    for p, g in zip(model.parameters(), grads):
        assert torch.allclose(p.grad, g, atol=1e-6)  # nothing written
    opt.synchronize()
    assert_same(model, ref)
