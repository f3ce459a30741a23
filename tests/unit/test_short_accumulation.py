"""Note [Short accumulations] (csrc/torch/gradient_path.cc), in a world of one: a step() after fewer backward
passes than backward_passes_per_step reduces what there is; a change to a counted gradient before it (this rank's
own, not reduced) is refused, naming the parameter and synchronize(), with nothing changed; synchronize() first
makes the same change train as plain torch does; a backward after that synchronize() is refused."""

import pytest
import torch
from torch import nn

import dcredit_opt as dc
from tests.unit.test_gradient_path import EAGER, LAZY, assert_same, loss, pair

pytestmark = pytest.mark.timeout(120)


def full_steps(model, opt, ref, ropt, steps):
    """Steps of two passes each, the wrapped model beside plain torch."""
    for s in steps:
        for m, o in ((model, opt), (ref, ropt)):
            o.zero_grad()
            loss(m, 2 * s).backward()
            loss(m, 2 * s + 1).backward()
            o.step()


def short_pass(model, opt, ref, ropt, s=20):
    """One backward pass of two, on both."""
    for m, o in ((model, opt), (ref, ropt)):
        o.zero_grad()
        loss(m, s).backward()


def clip(model):
    nn.utils.clip_grad_norm_(model.parameters(), 0.01)


@pytest.mark.parametrize("config", [LAZY, EAGER], ids=["lazy", "eager"])
@pytest.mark.parametrize("change", ["clip_grad_norm_", "clip_grad_value_", "mul_", "replaced"])
def test_a_change_to_a_counted_gradient_before_step_is_refused_and_changes_nothing(config, change):
    model, opt, ref, ropt = pair(config, backward_passes_per_step=2)
    try:
        full_steps(model, opt, ref, ropt, range(3))
        short_pass(model, opt, ref, ropt)
        first = model[0].weight
        if change == "clip_grad_norm_":
            clip(model)
        elif change == "clip_grad_value_":
            nn.utils.clip_grad_value_(model.parameters(), 1e-3)
        elif change == "mul_":
            model[2].bias.grad.mul_(0.5)
        else:
            model[2].bias.grad = model[2].bias.grad.clone()
        name = "2.bias" if change in ("mul_", "replaced") else "0.weight"
        opt._dc.apply_pending()  # so that "nothing changed" compares the weights step() itself would change
        before = [p.detach().clone() for p in model.parameters()]
        for call in (opt.step, opt.synchronize):
            with pytest.raises(dc.DCreditError, match=rf"p\.grad of '{name}' was changed .* after 1 backward "
                                                      rf"pass\(es\) of backward_passes_per_step=2, before "
                                                      rf"{call.__name__}\(\).*Nothing was changed.*"
                                                      r"optimizer\.synchronize\(\) after the last backward pass"):
                call()
        assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
        assert not opt._dc.backward.open and first.grad is not None
    finally:
        opt._dc.close()


def short_step_trains_as_plain_torch(config, ours, theirs):
    """Three full steps, one pass of two on both, then ``ours(model, opt)`` (up to and with our step()) beside
    ``theirs(ref)`` and plain torch's step, two more full steps: the weights of plain torch."""
    model, opt, ref, ropt = pair(config, backward_passes_per_step=2)
    try:
        full_steps(model, opt, ref, ropt, range(3))
        short_pass(model, opt, ref, ropt)
        ours(model, opt)
        theirs(ref)
        ropt.step()
        full_steps(model, opt, ref, ropt, range(4, 6))
        opt.synchronize()
        assert_same(model, ref)
    finally:
        opt._dc.close()


@pytest.mark.parametrize("config", [LAZY, EAGER], ids=["lazy", "eager"])
def test_synchronize_first_reduces_a_short_accumulation_and_the_clip_trains_as_plain_torch(config):
    """Horovod's recipe after one pass of two: synchronize() opens the iteration and reduces what there is, the
    clip reads (and writes) the final gradients, step() inside skip_synchronize() takes them."""
    def ours(model, opt):
        opt.synchronize()
        assert opt._dc.backward.open and opt._dc.backward.synchronized
        clip(model)
        with opt.skip_synchronize():
            opt.step()

    short_step_trains_as_plain_torch(config, ours, clip)


def test_reads_and_a_gradient_set_to_none_after_a_short_accumulation_are_no_change():
    """Reading the gradients (a norm for the log) writes nothing; ``p.grad = None`` drops that gradient, as plain
    torch's step() then leaves its parameter (with momentum, SGD skips a parameter without a gradient)."""
    def read_and_drop(m):
        float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in m.parameters()])))
        m[4].bias.grad = None

    def ours(model, opt):
        read_and_drop(model)
        opt.step()

    short_step_trains_as_plain_torch(LAZY, ours, read_and_drop)


def test_a_counted_pass_on_the_python_path_is_recorded_too():
    """A Python hook registered after wrapping sends that parameter's next gradient down the Python path (Note
    [Gradient path]): its counted pass is recorded there, so a step() without a change goes through and trains as
    plain torch, and a change after another such pass is still refused."""
    model, opt, ref, ropt = pair(EAGER, backward_passes_per_step=2)
    try:
        full_steps(model, opt, ref, ropt, range(2))
        model[2].weight.register_hook(lambda g: g)
        path = opt._dc.backward.path
        path.take_slow_count()
        short_pass(model, opt, ref, ropt)
        assert path.take_slow_count() == 1  # the gradient that found its pre-hook gone
        opt.step()
        ropt.step()
        opt.synchronize()
        assert_same(model, ref)
        model[0].bias.register_hook(lambda g: g)
        short_pass(model, opt, ref, ropt, s=21)
        assert path.take_slow_count() == 1
        model[0].bias.grad.add_(1.0)
        with pytest.raises(dc.DCreditError, match=r"p\.grad of '0\.bias' was changed"):
            opt.step()
    finally:
        opt._dc.close()


@pytest.mark.parametrize("passes", [2, 3])
def test_a_backward_after_synchronize_of_a_short_accumulation_is_refused_before_it_adds(passes):
    """After synchronize() reduced a short accumulation, a further pass would add onto the reduced gradient and
    never be reduced: refused by the pre-hook, before autograd adds it, naming the parameter."""
    model, opt, _, _ = pair(LAZY, backward_passes_per_step=passes)
    try:
        opt.zero_grad()
        loss(model, 0).backward()
        opt.synchronize()
        held = [p.grad.clone() for p in model.parameters()]
        with pytest.raises(dc.DCreditError, match=r"gradient of parameter '\w+\.\w+' was computed after this "
                                                  r"iteration's gradients were already being reduced whole"):
            loss(model, 1).backward()
        assert all(torch.equal(p.grad, h) for p, h in zip(model.parameters(), held))
    finally:
        opt._dc.close()
