"""Note [Gradient path] (csrc/torch/gradient_path.h), in a world of one: each gradient's hand-over runs in the
C++ post-hook on its accumulator, Python only where it must, and training equals plain torch either way."""

import dataclasses
import itertools

import pytest
import torch
from torch import nn

import dcredit_opt as dc

pytestmark = pytest.mark.timeout(120)

LAZY = dc.Config(block_bytes=64, window=2, policy="fixed", lazy_step="on")
EAGER = dc.Config(block_bytes=64, window=2, policy="fixed", lazy_step="off")


def net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def batch(s):
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(s))


def loss(model, s):
    return model(batch(s)).pow(2).mean()


def pair(config, models=None, **wrap):
    """A wrapped model and a plain copy with its own plain SGD: ``models`` (the model and its copy), or two
    ``net()``."""
    model, ref = models if models is not None else (net(), net())
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters(), config=config, **wrap)
    return model, opt, ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)


def plain(ref, ropt, s):
    ropt.zero_grad()
    loss(ref, s).backward()
    ropt.step()


def train(model, opt, steps, ref=None, ropt=None):
    """Steps ``steps`` (a range) of the wrapped model, and of the plain copy beside it when given."""
    for s in steps:
        opt.zero_grad()
        loss(model, s).backward()
        opt.step()
        if ref is not None:
            plain(ref, ropt, s)


def assert_same(model, ref):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.detach(), q.detach(), atol=1e-6), f"{name} differs from plain torch"


@pytest.mark.parametrize("config", [LAZY, EAGER], ids=["lazy", "eager"])
def test_steady_state_hands_every_gradient_over_in_cpp(config):
    model, opt, ref, ropt = pair(config)
    try:
        for s in range(4):  # the plan, the first-read learning and the lazy step settle here
            opt.zero_grad()
            loss(model, s).backward()
            opt.step()
            plain(ref, ropt, s)
        before, opened = opt._dc.backward.python_handovers, opt._dc.backward.iteration
        train(model, opt, range(4, 10), ref, ropt)
        # No gradient goes through Python's hand-over: Python only opens each iteration, at its first gradient,
        # which the C++ hook then hands over itself; nothing is said about it.
        assert opt._dc.backward.iteration - opened == 6
        assert opt._dc.backward.python_handovers - before == 0
        assert "python path" not in opt._dc.told
        opt.synchronize()
        assert_same(model, ref)
        assert all(type(p.grad).__name__ == "WatchedGradient" for p in model.parameters())
    finally:
        opt._dc.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the hook runs on autograd's device "
                                                           "thread there, and marks blocks ready on its stream)")
def test_steady_state_on_a_gpu_hands_every_gradient_over_in_cpp_and_equals_plain_torch():
    model, opt, ref, ropt = pair(LAZY, models=(net().cuda(), net().cuda()))

    def gpu_loss(m, s):
        return m(batch(s).cuda()).pow(2).mean()

    try:
        for s in range(10):
            if s == 4:
                before = opt._dc.backward.python_handovers
            opt.zero_grad()
            gpu_loss(model, s).backward()
            opt.step()
            ropt.zero_grad()
            gpu_loss(ref, s).backward()
            ropt.step()
        assert opt._dc.backward.python_handovers - before == 0
        opt.synchronize()
        assert_same(model, ref)
    finally:
        opt._dc.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Note [Device windows]: launches "
                                                           "ordered behind earlier blocks on a device stream)")
@pytest.mark.parametrize("lazy_step", ["on", "off"])
def test_device_windows_on_a_gpu_equal_plain_torch(lazy_step):
    """Config(device_windows=True) with a window of one block: every block but the first is launched behind
    the one before it on the device; training equals plain torch, lazy or eager, and the launches did not
    wait for the device: with the device held up in the last backward, every block of that iteration was
    launched before the first had finished."""
    config = dc.Config(block_bytes=64, window=1, policy="fixed", lazy_step=lazy_step, device_windows=True)
    model, opt, ref, ropt = pair(config, models=(net().cuda(), net().cuda()))
    inputs = [batch(s).cuda() for s in range(8)]
    try:
        for s in range(8):
            opt.zero_grad()
            out = model(inputs[s])
            if s == 7:
                out.register_hook(lambda grad: (torch.cuda._sleep(200_000_000), grad)[1])  # about 0.1 s
            out.pow(2).mean().backward()
            opt.step()
            ropt.zero_grad()
            ref(inputs[s]).pow(2).mean().backward()
            ropt.step()
        opt.synchronize()
        assert_same(model, ref)
        trace = opt._dc.engine.trace()  # (block, channel, window, group, seq, release_ns, launch_ns, end_ns)
        assert len(trace) > 2 and all(t[2] == 1 for t in trace)
        last_launch = max(t[6] for t in trace)
        first_end = min(t[7] for t in trace)
        assert last_launch < first_end, "a block waited on the host for the device to finish an earlier one"
    finally:
        opt._dc.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Note [Stream-ordered waits]: the lazy "
                                                           "step's wait on a device stream)")
def test_on_a_gpu_the_lazy_step_waits_on_the_stream_not_on_the_host():
    """Note [Stream-ordered waits]: the device is held up in backward (a long sleep before every gradient), so
    the blocks finish late on the device. The next forward applies their updates without the host waiting for
    that: when it returns, the device has not yet passed the sleep. The updates still land after the reduced
    gradients, as plain torch's do. No credit window here: a block waiting for a slot in one waits for the
    device to finish an earlier block (the window counts device completion), and the host with it."""
    config = dc.Config(block_bytes=64, window=-1, policy="fixed", lazy_step="on")
    model, opt, ref, ropt = pair(config, models=(net().cuda(), net().cuda()))
    # On the GPU beforehand: a copy from pageable host memory would wait, on the host, behind the sleep.
    inputs = [batch(s).cuda() for s in range(8)] + [batch(100 + s).cuda() for s in range(8)]
    torch.cuda.synchronize()
    try:
        for s in range(8):
            opt.zero_grad()
            out = model(inputs[s])
            passed = torch.cuda.Event()
            if s >= 4:  # the plan and the first-read learning have settled
                def hold_up(grad, passed=passed):
                    torch.cuda._sleep(2_000_000_000)  # about a second of device time
                    passed.record()
                    return grad
                out.register_hook(hold_up)
            # Where the host was when the device passed the sleep, if it did before the check: the first
            # of these after which the event had passed is where the host waited for the device.
            passed_after = []

            def mark(where, passed=passed, s=s, passed_after=passed_after):
                if s >= 4 and not passed_after and passed.query():
                    passed_after.append(where)
            out.pow(2).mean().backward()
            mark("the wrapped model's backward")
            opt.step()
            mark("opt.step()")
            ropt.zero_grad()
            ref(inputs[s]).pow(2).mean().backward()
            ropt.step()
            mark("the plain copy's iteration")
            if s >= 4:
                with torch.no_grad():
                    model(inputs[8 + s])  # applies every pending update at its first read
                mark("the forward that applied the updates")
                assert not opt._dc.lazy.npending
                assert not passed_after, f"the host waited for the device in {passed_after[0]} (iteration {s})"
            torch.cuda.synchronize()
        opt.synchronize()
        assert_same(model, ref)
    finally:
        opt._dc.close()


@pytest.mark.parametrize("config", [LAZY, EAGER], ids=["lazy", "eager"])
@pytest.mark.parametrize("passes", [2, 3])
def test_several_backward_passes_per_step_stay_in_cpp(config, passes, caplog):
    """backward_passes_per_step > 1: the passes before the last are counted in C++ and autograd sums them in
    p.grad; the last hands the sum over in C++. No gradient through Python after the first iteration, no notice,
    and the weights of plain torch's accumulation."""
    model, opt, ref, ropt = pair(config, backward_passes_per_step=passes)
    try:
        for s in range(4):
            if s == 1:
                before = opt._dc.backward.python_handovers + opt._dc.backward.path.take_slow_count()
            opt.zero_grad()
            ropt.zero_grad()
            for k in range(passes):
                loss(model, passes * s + k).backward()
                loss(ref, passes * s + k).backward()
            opt.step()  # the passes' gradients summed, as autograd accumulates them (and Horovod reduces them)
            ropt.step()
        opt.synchronize()
        assert_same(model, ref)
        assert opt._dc.backward.python_handovers + opt._dc.backward.path.take_slow_count() == before
        assert not [m for m in caplog.messages if "handed over in Python" in m], caplog.messages
    finally:
        opt._dc.close()


def test_a_parameter_used_in_one_pass_of_two_is_reduced_at_step():
    """A parameter whose gradient came in one of the two passes only (counted once, never handed over by its
    hook) is staged by step()'s flush with what autograd summed: the weights of plain torch."""
    model, ref = (nn.ModuleList([nn.Linear(4, 3), nn.Linear(4, 3)]) for _ in range(2))
    ref.load_state_dict(model.state_dict())
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters(), config=LAZY, backward_passes_per_step=2)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    try:
        for s in range(4):
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                (m[0](batch(2 * s)) + m[1](batch(2 * s))).pow(2).mean().backward()  # both
                m[0](batch(2 * s + 1)).pow(2).mean().backward()  # the first alone
                o.step()
        opt.synchronize()
        assert_same(model, ref)
    finally:
        opt._dc.close()


def train_two_passes(model, opt, steps):
    """Steps ``steps`` of the wrapped model, two backward passes each (batches ``2 * s`` and ``2 * s + 1``)."""
    for s in steps:
        opt.zero_grad()
        loss(model, 2 * s).backward()
        loss(model, 2 * s + 1).backward()
        opt.step()


def test_a_third_pass_of_two_is_refused_in_cpp_too():
    """One pass more than backward_passes_per_step: refused before autograd adds it, naming the parameter, after
    the C++ hook counted the first two."""
    model, opt, _, _ = pair(LAZY, backward_passes_per_step=2)
    try:
        train_two_passes(model, opt, range(3))
        opt.zero_grad()
        loss(model, 10).backward()
        loss(model, 11).backward()
        held = [p.grad.clone() for p in model.parameters()]
        with pytest.raises(dc.DCreditError, match=r"was computed 3 times before step\(\), but backward_passes_per_step=2"):
            loss(model, 12).backward()
        assert all(torch.equal(p.grad, h) for p, h in zip(model.parameters(), held))  # nothing added
    finally:
        opt._dc.close()


def test_a_graph_built_before_step_is_refused_after_it_with_two_passes():
    """With two passes per step, a graph built before step() (kept from a pass) and backward-ed after it would
    add gradients of the old weights: never silently. Its saved weights make that step eager (Note [Hidden
    writes]), and torch refuses the graph as plain torch does (the weights it saved were changed in place)."""
    model, opt, _, _ = pair(LAZY, backward_passes_per_step=2)
    try:
        train_two_passes(model, opt, range(3))
        opt.zero_grad()
        loss(model, 10).backward()
        kept = loss(model, 11)  # built now, backward-ed after step()
        loss(model, 12).backward()
        opt.step()
        held = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        with pytest.raises(RuntimeError, match="modified by an inplace operation|parameter '"):
            kept.backward()
        assert all(p.grad is None for p in model.parameters())
        assert all(torch.equal(p.detach(), h) for p, h in zip(model.parameters(), held))
    finally:
        opt._dc.close()


class _Odd(nn.Module):
    """Parameters of odd sizes side by side, so that the large ones start at offsets of their slots' buffer that
    are not 16-byte aligned and end in a partial vector (what a copy by vectors must get right)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(3))
        self.big = nn.Parameter(torch.randn(1027, 3))  # 12 324 bytes
        self.b = nn.Parameter(torch.randn(5))
        self.small = nn.Parameter(torch.randn(1023))  # 4 092 bytes
        self.edge = nn.Parameter(torch.randn(1025))  # 4 100 bytes

    def forward(self, x):
        return ((self.big * x).sum() * self.a.sum() + self.b.pow(2).sum() + (self.small * self.small).sum()
                + self.edge.sin().sum())


@pytest.mark.parametrize("config", [LAZY, EAGER], ids=["lazy", "eager"])
def test_large_gradients_at_unaligned_offsets_are_copied_exactly(config):
    """Every gradient handed over in C++ equals, bit for bit, the one plain torch computes (a world of one
    averages over one rank), whatever its size and its slot's alignment."""
    torch.manual_seed(0)
    model = _Odd()
    ref = _Odd()
    ref.load_state_dict(model.state_dict())
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(), config=config)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.01)
    try:
        slow = []
        for s in range(4):
            x = torch.randn(3, generator=torch.Generator().manual_seed(s))
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                m(x).backward()
            slow.append(opt._dc.backward.path.take_slow_count())
            opt.synchronize()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert torch.equal(p.grad, q.grad), f"the gradient of {name} differs from plain torch's"
            with opt.skip_synchronize():
                opt.step()
            ropt.step()
        assert slow[1:] == [0, 0, 0]  # handed over in C++
        large = [t for t in opt._dc.buffers.slots if t.numel() * t.element_size() >= 4096]
        assert len(large) == 2 and any(t.data_ptr() % 16 for t in large), "no large slot at an unaligned address"
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.detach(), q.detach()), f"{name} differs from plain torch"
    finally:
        opt._dc.close()


def test_user_post_accumulate_hooks_still_run_and_see_the_gradient():
    model, opt, ref, ropt = pair(LAZY)
    seen = []
    first = next(model.parameters())
    first.register_post_accumulate_grad_hook(lambda p: seen.append(float(p.grad.abs().sum())))
    try:
        train(model, opt, range(5), ref, ropt)
        assert len(seen) == 5 and all(v > 0 for v in seen)
        opt.synchronize()
        assert_same(model, ref)
    finally:
        opt._dc.close()


def test_a_closed_optimizer_leaves_backward_alone():
    model, opt, _, _ = pair(LAZY)
    train(model, opt, range(3))
    opt._dc.close()
    for p in model.parameters():
        p.grad = None
    loss(model, 3).backward()  # no hook of ours runs: plain gradients, no error
    assert all(type(p.grad) is torch.Tensor for p in model.parameters())


def test_a_scheduler_failure_in_the_hook_is_a_dcredit_error():
    model, opt, _, _ = pair(EAGER)
    try:
        train(model, opt, range(2))
        opt.zero_grad()
        out = loss(model, 2)
        # The engine stops after the iteration opens: the next gradient's mark-ready in C++ fails.
        first = [True]

        def stop_engine(_):
            if first[0]:
                first[0] = False
                opt._dc.engine.shutdown()

        handle = next(iter(model.parameters())).register_hook(stop_engine)  # the last gradient of the backward
        with pytest.raises(dc.DCreditError, match="at the gradient of"):
            out.backward()
        handle.remove()
    finally:
        opt._dc.close()


def test_path_rejects_state_arrays_of_the_wrong_size():
    from dcredit_opt import _ext
    from dcredit_opt.optimizer.buffers import per_tensor

    model, opt, _, _ = pair(EAGER)
    try:
        params = list(model.parameters())
        with pytest.raises(ValueError, match="counts must be"):
            _ext.load().GradientPath(opt._dc.engine, params, per_tensor(len(params) + 1, "i"),
                                     per_tensor(len(params), "B"), per_tensor(len(params), "B"),
                                     per_tensor(len(params), "B"), per_tensor(len(params), "q"), print, print,
                                     print, print)
    finally:
        opt._dc.close()


def test_a_python_hook_registered_after_wrapping_keeps_every_check():
    """Python empties a parameter's hook list when a script registers its first Python hook on it, and the C++
    pre-hook with it (Note [Gradient path]): that parameter's next gradient finds it gone, puts it back and takes
    the Python path once; after that the refusals hold as before, and training equals plain torch."""
    model, opt, ref, ropt = pair(EAGER)
    try:
        train(model, opt, range(3), ref, ropt)
        seen = []
        model[2].weight.register_hook(lambda g: seen.append(g.shape))
        before = opt._dc.backward.python_handovers
        train(model, opt, range(3, 6), ref, ropt)
        assert seen == [model[2].weight.shape] * 3
        assert opt._dc.backward.python_handovers - before == 1  # the gradient that found its pre-hook gone
        opt.synchronize()
        assert_same(model, ref)
        # A second backward before step() is refused before autograd adds its gradient.
        opt.zero_grad()
        loss(model, 6).backward()
        held = [p.grad.clone() for p in model.parameters()]
        with pytest.raises(dc.DCreditError, match=r"'4.bias' was computed 2 times before step\(\)"):
            loss(model, 7).backward()
        assert all(torch.equal(p.grad, h) for p, h in zip(model.parameters(), held))
    finally:
        opt._dc.close()


def test_a_pre_hook_lost_between_two_passes_still_refuses_the_second():
    """The pre-hook is emptied away after the first backward of an iteration: the second pass's gradient finds it
    gone after autograd added it, and the same refusal comes then (late, but it comes)."""
    model, opt, _, _ = pair(EAGER)
    try:
        train(model, opt, range(2))
        opt.zero_grad()
        loss(model, 2).backward()
        model[4].bias.register_hook(lambda g: None)  # the first gradient of the second pass
        with pytest.raises(dc.DCreditError, match=r"'4.bias' was computed 2 times before step\(\)"):
            loss(model, 3).backward()
    finally:
        opt._dc.close()


def test_the_gradient_path_finds_a_parameter_cast_after_wrapping():
    """What refuses a model cast after wrapping at the next backward (the whole case: gradient_patterns.py)."""
    model, opt, _, _ = pair(EAGER)
    try:
        opt.zero_grad()
        loss(model, 0).backward()
        opt.step()
        assert opt._dc.backward.path.first_moved() == -1
        weight = model[2].weight
        weight.data = weight.data.double()
        assert opt._dc.backward.path.first_moved() == 2  # 0.weight, 0.bias, 2.weight
        weight.data = weight.data.float()
        assert opt._dc.backward.path.first_moved() == -1
    finally:
        opt._dc.close()


def _apply_hooks(module):
    return [h for h in module._forward_pre_hooks.values() if type(h).__name__ == "_ForwardHook"]


def test_the_apply_hooks_rest_once_nothing_is_pending_and_step_wakes_the_leader_alone():
    """Note [Resting hooks]: a lazy step() puts the leader's hook (the model's own: its forward began first) in
    its module, first; with every reduction finished, it applies every update before the forward's first operation
    and the hooks rest, so the whole forward takes torch's fast call path. Training equals plain torch."""
    model, opt, ref, ropt = pair(LAZY)
    users = []
    model.register_forward_pre_hook(lambda m, args: users.append(_apply_hooks(m) == []))
    try:
        train(model, opt, range(3), ref, ropt)  # the plan and the first-read learning settle here
        for s in range(3, 6):
            train(model, opt, range(s, s + 1), ref, ropt)
            assert opt._dc.lazy.npending
            assert [m for m in [model, *model] if _apply_hooks(m)] == [model]
            assert next(iter(model._forward_pre_hooks.values())) is _apply_hooks(model)[0]
        opt._dc.engine.wait_all(30.0)  # every reduction finished before the forward, however busy the machine
        with torch.no_grad():
            model(batch(99))
        assert not opt._dc.lazy.npending and not any(_apply_hooks(m) for m in [model, *model])
        assert users[-1], "the user's pre-hook ran while ours was still in the module"
        opt.synchronize()
        assert_same(model, ref)
    finally:
        opt._dc.close()


class _Unfinished:
    """The optimizer's engine, except that the tensors named report their reduction as unfinished."""

    def __init__(self, engine, unfinished):
        self._engine, self._unfinished = engine, set(unfinished)

    def finals(self):
        return bytes(0 if i in self._unfinished else f for i, f in enumerate(self._engine.finals()))

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_a_leader_that_leaves_updates_pending_wakes_every_apply_point():
    """Note [Resting hooks]: where a reduction has not finished when the forward begins, the leader applies those
    before it and every apply point's hook wakes for the rest; the modules apply theirs as the forward reaches
    them, and training equals plain torch."""
    model, opt, ref, ropt = pair(LAZY)
    try:
        train(model, opt, range(4), ref, ropt)
        engine = opt._dc.engine
        engine.wait_all(30.0)
        opt._dc.engine = _Unfinished(engine, [opt._dc.names.index("2.weight")])
        seen = []
        model[1].register_forward_pre_hook(lambda m, args: seen.append(
            ([n for n, w in zip(opt._dc.names, opt._dc.lazy.pending) if w], bool(_apply_hooks(model[4])))))
        with torch.no_grad():
            model(batch(99))
        opt._dc.engine = engine
        assert seen == [(["2.weight", "2.bias", "4.weight", "4.bias"], True)]  # between model[0] and model[2]
        assert not opt._dc.lazy.npending and not any(_apply_hooks(m) for m in [model, *model])
        train(model, opt, range(4, 6), ref, ropt)
        opt.synchronize()
        assert_same(model, ref)
    finally:
        opt._dc.close()


class _Positions(nn.Module):
    """A forward that begins with operations of its own (positions added, as a GPT's does) before any layer."""

    def __init__(self):
        super().__init__()
        self.layers = net()
        self.modes = []  # torch function modes on the stack as each forward begins

    def forward(self, x):
        self.modes.append(torch._C._len_torch_function_stack())
        return self.layers(x + torch.arange(x.shape[1], dtype=x.dtype))


def test_the_leader_takes_the_read_guard_off_before_the_forwards_first_operation():
    """Note [Resting hooks]: with every reduction finished when the next forward begins, the leader's hook applies
    every update first, so the model's own operations ahead of its first layer run with no mode of ours on the
    stack (no guard cost); training equals plain torch."""
    model, ref = _Positions(), _Positions()
    ref.load_state_dict(model.state_dict())
    model, opt, ref, ropt = pair(LAZY, models=(model, ref))
    try:
        for s in range(6):
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                m(batch(s)).pow(2).mean().backward()
                o.step()
            assert s < 2 or opt._dc.lazy.npending  # lazy once the apply points are learned
            opt._dc.engine.wait_all(30.0)  # every reduction finished before the next forward
        assert model.modes[3:] == [0, 0, 0]
        opt.synchronize()
        assert_same(model, ref)
    finally:
        opt._dc.close()


def test_a_forward_that_begins_elsewhere_than_the_leader_applies_as_the_apply_points_would():
    """Note [Resting hooks]: a forward that does not begin at the leader (its layers called one by one) reaches
    a pending parameter with the leader's hook unrun: the read guard applies what that parameter's apply point
    would have, and every hook wakes. Two such forwards in a row, and step() wakes every hook from then on.
    Training equals plain torch throughout."""
    model, opt, ref, ropt = pair(LAZY)
    try:
        train(model, opt, range(3), ref, ropt)
        for s in range(3, 6):
            assert opt._dc.lazy.npending
            asleep = not any(_apply_hooks(m) for m in model)
            assert asleep == (s < 5), f"step {s}: the apply points' hooks should sleep for two missed forwards"
            opt.zero_grad()
            h = batch(s)
            for layer in model:  # not model(h): the leader's hook does not run
                h = layer(h)
            h.pow(2).mean().backward()
            opt.step()
            plain(ref, ropt, s)
        opt.synchronize()
        assert_same(model, ref)
    finally:
        opt._dc.close()


def test_another_model_that_runs_first_is_not_the_leader():
    """The leader is the first module at the top of the forward that holds any of this optimizer's parameters: a
    teacher run before the model gets no hook of ours."""
    model, opt, ref, ropt = pair(LAZY)
    teacher = net(seed=1)
    try:
        for s in range(4):
            with torch.no_grad():
                teacher(batch(s))
            train(model, opt, range(s, s + 1), ref, ropt)
        assert not _apply_hooks(teacher) and [m for m in [model, *model] if _apply_hooks(m)] == [model]
        with torch.no_grad():
            teacher(batch(9))
        assert opt._dc.lazy.npending  # the teacher reads none of ours
        opt.synchronize()
        assert_same(model, ref)
    finally:
        opt._dc.close()


def test_the_checks_in_one_pass_see_what_the_python_loops_saw():
    """The per-step checks that ask the gradient path in one C++ pass: which p.grad are not the watched aliases
    (Note [Replaced gradients]), which slot was written since its hand-over (Note [Lazy step]), the parameters'
    addresses (the read guard's table), and which reduced gradients are final."""
    model, opt, _, _ = pair(LAZY)
    try:
        train(model, opt, range(3))
        opt.synchronize()
        params, path, T = list(model.parameters()), opt._dc.backward.path, len(list(model.parameters()))
        assert path.not_watched() == [] and path.first_written([]) == -1
        assert path.addresses() == [p.data_ptr() for p in params]
        assert opt._dc.engine.finals() == bytes([1] * T)
        opt._dc.buffers.slots[3].add_(1.0)  # a write that went around p.grad
        assert path.first_written(list(range(T))) == 3 and path.first_written([0, 1, 2]) == -1
        assert path.first_written([4, 3]) == 3 and path.first_written([]) == -1
        with pytest.raises(IndexError, match="tensor 6 out of range"):
            path.first_written([6])
        opt._dc.buffers.versions[3] = opt._dc.buffers.slots[3]._version
        params[1].grad = None
        params[4].grad = params[4].grad.clone()
        assert path.not_watched() == [1, 4]
    finally:
        opt._dc.close()


def test_the_apply_hooks_stay_while_a_timeline_records_the_forward(tmp_path):
    """Note [Resting hooks]: the timeline marks each module's forward, so its hooks do not rest."""
    config = dataclasses.replace(LAZY, timeline_path=str(tmp_path / "timeline.json"))
    model, opt, ref, ropt = pair(config)
    try:
        train(model, opt, range(5), ref, ropt)
        with torch.no_grad():
            model(batch(99))
        assert not opt._dc.lazy.npending
        assert [m for m in model if _apply_hooks(m)] == [model[0], model[2], model[4]]
        opt.synchronize()
        assert_same(model, ref)
    finally:
        opt._dc.close()


def test_a_parameter_put_in_a_group_after_a_lazy_step_is_not_stepped_by_its_apply():
    """The wrapped step over every update takes the groups as they are only while they hold exactly what was
    wrapped: a parameter appended to a group between step() and the next forward is left alone there (its
    gradient was never reduced), and the next step() refuses it before applying anything."""
    model, opt, ref, ropt = pair(LAZY)
    try:
        train(model, opt, range(4), ref, ropt)
        assert opt._dc.lazy.npending == 6
        extra = nn.Parameter(torch.ones(3))
        extra.grad = torch.ones(3)  # a local gradient: stepping with it would leave synchronous training
        opt.param_groups[0]["params"].append(extra)
        with torch.no_grad():
            model(batch(99))  # applies every pending update
        assert not opt._dc.lazy.npending
        assert torch.equal(extra.detach(), torch.ones(3))
        opt.param_groups[0]["params"].pop()
        opt.synchronize()
        assert_same(model, ref)
        opt.param_groups[0]["params"].append(extra)
        opt.zero_grad()
        loss(model, 4).backward()
        with pytest.raises(dc.DCreditError, match="did not hold when dcredit_opt.DistributedOptimizer was built"):
            opt.step()
    finally:
        opt.param_groups[0]["params"][:] = list(model.parameters())
        opt._dc.close()


def test_device_windows_change_nothing_for_cpu_blocks():
    """Note [Device windows]: CPU blocks cannot be ordered on a device; the host keeps the window, and
    training equals plain torch as without it."""
    model, opt, ref, ropt = pair(dataclasses.replace(LAZY, window=1, device_windows=True))
    try:
        train(model, opt, range(6), ref, ropt)
        opt.synchronize()
        assert_same(model, ref)
        trace = opt._dc.engine.trace()  # (block, channel, window, group, seq, release_ns, launch_ns, end_ns)
        by_seq = sorted(trace, key=lambda t: t[4])
        # A window of one on the host: each block launched after the one before it had ended.
        assert all(b[6] >= a[7] for a, b in itertools.pairwise(by_seq))
    finally:
        opt._dc.close()


def lazy_again_and_same(model, opt, ref, ropt, steps):
    """Nothing but our parameters holds their storage: the steps ``steps`` are lazy again (Note [Hidden
    writes]), and the model equals plain torch's."""
    assert opt._dc.backward.path.first_shared() == (-1, False)
    train(model, opt, steps, ref, ropt)
    assert opt._dc.lazy.npending > 0
    opt.synchronize()
    assert_same(model, ref)


@pytest.mark.parametrize("alias", ["numpy", "detached", "view", "state_dict", "storage"])
def test_a_parameter_whose_storage_another_tensor_holds_steps_eagerly_and_equals_plain_torch(alias, caplog):
    """Note [Hidden writes]: while another tensor holds a parameter's storage (a NumPy array over it, a kept
    alias, view, state_dict() or storage object), a write no torch operation shows could land before a deferred
    update: every step() is then eager, said once; dropped, the lazy step comes back. Our own machinery holds
    none, and neither does the storage object torch keeps once untyped_storage() was called (the pickler's)."""
    model, opt, ref, ropt = pair(LAZY)
    path = opt._dc.backward.path
    train(model, opt, range(3), ref, ropt)
    assert path.first_shared() == (-1, False) and opt._dc.lazy.npending > 0  # lazy, with no alias of ours
    model[0].weight.untyped_storage()  # torch keeps this Python object for the storage; nobody holds it
    assert path.first_shared() == (-1, False)
    weight = model[2].weight
    kept = {"numpy": lambda: weight.detach().numpy(), "detached": weight.detach, "view": lambda: weight.data[1:],
            "state_dict": model.state_dict, "storage": weight.untyped_storage}[alias]()
    first = 0 if alias == "state_dict" else 2  # every parameter, or model[2].weight (the third)
    assert path.first_shared() == (first, False)
    with caplog.at_level("INFO", logger="dcredit_opt"):
        for s in range(3, 6):
            train(model, opt, [s])
            plain(ref, ropt, s)
            assert opt._dc.lazy.npending == 0, f"step {s} deferred updates while '{alias}' held a parameter"
            if alias == "numpy":  # written as the script clips a weight: after the update, as in plain torch
                kept.clip(-0.05, 0.05, out=kept)
                with torch.no_grad():
                    ref[2].weight.clamp_(-0.05, 0.05)
    name = opt._dc.names[first]
    assert sum("shares its memory" in r.getMessage() and f"'{name}'" in r.getMessage()
               for r in caplog.records) == 1
    del kept
    lazy_again_and_same(model, opt, ref, ropt, range(6, 8))


def test_parameters_over_one_buffer_step_lazily_until_another_tensor_holds_it():
    """Note [Hidden writes]: parameters laid out over one buffer hold its storage once each, which is ours; the
    script's own tensor over the buffer (the base kept) is another holder, and makes the steps eager."""
    model, opt, ref, ropt = pair(LAZY)
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    with torch.no_grad():
        for p in params:
            p.data = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
    path = opt._dc.backward.path
    assert path.first_shared() == (0, False)  # the base, kept
    train(model, opt, range(3), ref, ropt)
    assert opt._dc.lazy.npending == 0
    del flat
    lazy_again_and_same(model, opt, ref, ropt, range(3, 6))


def test_parameters_made_as_views_of_one_buffer_share_a_version_counter_and_step_eagerly(caplog):
    """Note [Shared version counters]: nn.Parameter(buffer[i:j]) share the buffer's version counter, so an update
    applied in the forward would move the counter of tensors that autograd saved before it (autograd's error in
    backward), and would hide a write the guard cannot see (Note [Unseen parameter writes]). Every step() is
    eager while they share it, said once; the result is plain torch's."""
    model, ref = net(), net()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    offset = 0
    for layer in (model[0], model[2], model[4]):
        for name, p in list(layer.named_parameters(recurse=False)):
            setattr(layer, name, nn.Parameter(flat[offset:offset + p.numel()].view_as(p)))
            offset += p.numel()
    del flat
    model, opt, ref, ropt = pair(LAZY, models=(model, ref))
    assert opt._dc.backward.path.first_shared() == (0, True)
    with caplog.at_level("INFO", logger="dcredit_opt"):
        for s in range(6):
            train(model, opt, [s], ref, ropt)
            assert opt._dc.lazy.npending == 0, f"step {s} deferred updates of parameters that share a counter"
    told = [r.getMessage() for r in caplog.records if "version counter" in r.getMessage()]
    assert len(told) == 1 and "'0.weight'" in told[0], told
    opt.synchronize()
    assert_same(model, ref)


def test_first_stale_names_a_graph_read_before_a_moved_version():
    """GradientPath.first_stale, the apply's check (Note [Graph reads], Note [Unseen parameter writes]): after
    forget_graph_reads, a parameter a graph read since is named first, wherever it stands among the indices;
    else the first whose version moved; else none."""
    model, opt, _, _ = pair(LAZY)
    try:
        train(model, opt, range(3))
        opt.synchronize()
        params, path = list(model.parameters()), opt._dc.backward.path
        T = len(params)
        path.forget_graph_reads(list(range(T)))
        assert tuple(path.first_stale(list(range(T)))) == (-1, False)
        with torch.no_grad():
            params[3].add_(1.0)  # a write no graph records: its version moves
        assert tuple(path.first_stale(list(range(T)))) == (3, True)
        kept = params[1] * 2.0  # a graph read: a new accumulator for params[1]
        assert tuple(path.first_stale(list(range(T)))) == (1, False)
        assert tuple(path.first_stale([3, 1])) == (1, False)
        assert tuple(path.first_stale([0, 3])) == (3, True) and tuple(path.first_stale([0, 2])) == (-1, False)
        with pytest.raises(IndexError, match="tensor 9 out of range"):
            path.first_stale([0, 9])
        del kept
    finally:
        opt._dc.close()


def test_the_slots_lent_to_the_wrapped_step_go_back_as_they_came():
    """GradientPath.lend_slots: p.grad is each tensor's slot for the wrapped step (past the watched alias), and
    return_slots puts back whatever p.grad held, the watched alias or a tensor the script put there; a second
    lend before the return is refused."""
    model, opt, ref, ropt = pair(LAZY)
    train(model, opt, range(3), ref, ropt)
    opt.synchronize()
    params, buffers, path = list(model.parameters()), opt._dc.buffers, opt._dc.backward.path
    theirs = torch.zeros_like(params[1])
    params[1].grad = theirs
    before = [p.grad for p in params]
    assert before[0] is buffers.watched[0]
    path.lend_slots([0, 1, 3])
    assert [p.grad is buffers.slots[i] for i, p in enumerate(params)] == [True, True, False, True, False, False]
    with pytest.raises(RuntimeError, match="not returned"):
        path.lend_slots([2])
    path.return_slots()
    assert all(p.grad is g for p, g in zip(params, before))
    path.return_slots()  # nothing lent: nothing changes
    assert all(p.grad is g for p, g in zip(params, before))
    params[2].grad = None
    path.lend_slots(range(len(params)), watched_only=True)  # the eager step's: only where p.grad is ours
    assert [p.grad is buffers.slots[i] for i, p in enumerate(params)] == [True, False, False, True, True, True]
    assert params[1].grad is theirs and params[2].grad is None
    path.return_slots()
    assert params[0].grad is buffers.watched[0] and params[1].grad is theirs and params[2].grad is None


@pytest.mark.parametrize("config", [LAZY, EAGER], ids=["lazy", "eager"])
def test_staging_moves_the_slots_version_as_a_copy_does(config):
    """The C++ hook copies a CPU gradient into its slot with one memcpy (Note [Gradient path]); the slot's version
    still moves, so a graph that saved last iteration's p.grad refuses to run on the overwritten values, as it
    would under plain torch, where the next backward writes that p.grad in place."""
    model, opt, ref, ropt = pair(config)
    try:
        train(model, opt, range(4), ref, ropt)
        opt.synchronize()
        x = torch.ones(3, requires_grad=True)
        kept = (x * model[4].bias.grad).sum()  # saves the gradient for its backward
        train(model, opt, range(4, 5), ref, ropt)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            kept.backward()
        opt.synchronize()
        assert_same(model, ref)
    finally:
        opt._dc.close()
