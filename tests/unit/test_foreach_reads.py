"""Note [Gradient reads] (optimizer/watched.py), foreach operations, in a world of one: ``clip_grad_norm_`` and other
foreach calls over watched gradients take torch's foreach path, as over plain tensors, and wait for all of their
gradients in one call per optimizer."""

import time

import pytest
import torch
from torch import nn
from torch.utils._foreach_utils import _has_foreach_support

import dcredit_opt as dc
from dcredit_opt.optimizer import gradients, watched
from tests.unit.test_gradient_path import LAZY, assert_same, batch, loss, net, pair, plain, train

pytestmark = pytest.mark.timeout(120)


def clipped(model, opt, ref, ropt, steps):
    for s in steps:
        for m, o in ((model, opt), (ref, ropt)):
            o.zero_grad()
            loss(m, s).backward()
            nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            o.step()


def _counted_reads():
    """Every ``Backward.gradients_read`` call's indices, once ``counted`` replaces it."""
    calls = []
    read = gradients.Backward.gradients_read

    def counted(self, indices):
        calls.append(list(indices))
        return read(self, indices)

    return calls, counted


def test_clip_grad_norm_takes_the_foreach_path_and_reads_once_per_operation(monkeypatch):
    model, opt, ref, ropt = pair(LAZY)
    calls, counted = _counted_reads()
    try:
        clipped(model, opt, ref, ropt, range(3))
        opt.zero_grad()
        loss(model, 3).backward()
        grads = [p.grad for p in model.parameters()]
        assert all(type(g).__name__ == "WatchedGradient" for g in grads)
        assert _has_foreach_support(grads, torch.device("cpu"))
        monkeypatch.setattr(gradients.Backward, "gradients_read", counted)
        nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        everything = list(range(len(grads)))
        # The norms: one call, every tensor. The scaling finds every gradient final already (Core.reads_wait):
        # no call, and no list of the tensors made.
        assert calls == [everything]
        opt.step()
        ropt.zero_grad()
        loss(ref, 3).backward()
        nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ropt.step()
        monkeypatch.undo()
        clipped(model, opt, ref, ropt, range(4, 7))
        opt.synchronize()
        assert_same(model, ref)
    finally:
        opt._dc.close()


def test_one_foreach_operation_over_two_optimizers_gradients_waits_for_each():
    """Each optimizer's watched gradients in one list: each optimizer waits for its own (and releases its
    iteration's blocks first), and the values are the averaged gradients, here plain torch's."""
    models = [net(0), net(1)]
    refs = [net(0), net(1)]
    opts = [dc.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                    config=LAZY) for m in models]
    try:
        for m, r in zip(models, refs):
            m(batch(0)).pow(2).mean().backward()
            r(batch(0)).pow(2).mean().backward()
        assert all(o._dc.backward.open and not o._dc.backward.flushed for o in opts)
        grads = [p.grad for m in models for p in m.parameters()]
        norms = torch._foreach_norm(grads)
        assert all(o._dc.backward.flushed and all(o._dc.backward.final) for o in opts)
        expected = torch._foreach_norm([p.grad for r in refs for p in r.parameters()])
        assert all(type(n) is torch.Tensor for n in norms)
        for n, e in zip(norms, expected):
            assert torch.allclose(n, e, atol=1e-6)
        for o in opts:
            o.step()
    finally:
        for o in opts:
            o._dc.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the waits there are for the device's "
                                                           "blocks, and the spares are device memory)")
def test_on_a_gpu_kept_gradients_and_clipping_equal_plain_torch():
    """``zero_grad(set_to_none=False)`` and ``clip_grad_norm_`` every iteration, on a GPU: the spares swapped in,
    the clip's foreach calls over watched gradients, the same weights as plain torch."""
    model, opt, ref, ropt = pair(LAZY, models=(net().cuda(), net().cuda()))
    try:
        for s in range(8):
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad(set_to_none=False)
                m(batch(s).cuda()).pow(2).mean().backward()
                nn.utils.clip_grad_norm_(m.parameters(), 0.05)
                o.step()
        assert opt._dc._spares is not None and opt._dc._spares[0].is_cuda
        opt.synchronize()
        assert_same(model, ref)
    finally:
        opt._dc.close()


@pytest.mark.parametrize("after_step", ["zero_grad_in_place", "foreach_scaled"])
def test_written_after_a_clipped_step_while_every_gradient_is_final(after_step):
    """A clip makes every gradient of the iteration final, and the watch stops listing them for later reads
    (``Core.reads_wait``). A write after ``step()`` (``model.zero_grad(set_to_none=False)``, a foreach scaling)
    still lands after the pending updates, as in plain torch: the weights stay plain torch's."""
    model, opt, ref, ropt = pair(LAZY)
    try:
        for s in range(6):
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                loss(m, s).backward()
                nn.utils.clip_grad_norm_(m.parameters(), 0.05)
                o.step()
                grads = [p.grad for p in m.parameters()]
                if after_step == "zero_grad_in_place":
                    m.zero_grad(set_to_none=False)
                else:
                    torch._foreach_mul_(grads, 0.0)
            assert all(not bool(p.grad.any()) for p in ref.parameters())
            assert all(not bool(p.grad.any()) for p in model.parameters())
        opt.synchronize()
        assert_same(model, ref)
    finally:
        opt._dc.close()


def test_gradients_read_one_by_one_after_every_reduction_ended_wait_once(monkeypatch):
    """A script that reads and scales its gradients one by one (``clip_grad_norm_(foreach=False)``, a norm per
    layer): the first read releases the iteration's blocks; once none is in flight, the next read makes every
    gradient final at once, and the reads after it go through the watch without a wait (``Backward
    .gradients_read``). The step still uses the clipped gradients: plain torch's weights."""
    model, opt, ref, ropt = pair(LAZY)
    calls, counted = _counted_reads()
    try:
        for s in range(5):
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                loss(m, s).backward()
                if o is opt:
                    monkeypatch.setattr(gradients.Backward, "gradients_read", counted)
                    last = len(list(m.parameters())) - 1
                    m[-1].bias.grad.sum()  # the first read, of the last tensor: releases every block
                    deadline = time.monotonic() + 60
                    while not opt._dc.engine.idle():
                        assert time.monotonic() < deadline, "the blocks of one rank never ended"
                        time.sleep(0.001)
                nn.utils.clip_grad_norm_(m.parameters(), 0.05, foreach=False)
                if o is opt:
                    monkeypatch.undo()
                    # The first read, and (where its blocks were still in flight then) the clip's first, of tensor
                    # 0; every gradient final after it.
                    assert calls in ([[last]], [[last], [0]]), calls
                    assert opt._dc.backward.every_final and all(opt._dc.backward.final)
                    del calls[:]
                o.step()
        opt.synchronize()
        assert_same(model, ref)
    finally:
        opt._dc.close()


def _watch_calls(monkeypatch) -> list:
    """Every operation and attribute read the watch sees from here on (Note [Gradient reads])."""
    seen = []
    handler = watched.WatchedGradient.__torch_function__.__func__

    def counted(cls, func, types, args=(), kwargs=None):
        seen.append(getattr(func, "__name__", func))
        return handler(cls, func, types, args, kwargs)

    monkeypatch.setattr(watched.WatchedGradient, "__torch_function__", classmethod(counted))
    return seen


def test_a_watched_gradients_dtype_device_and_layout_are_read_without_the_watch(monkeypatch):
    """Note [Metadata reads]: what never changes is kept when the watched alias is made and read without a call of
    the watch; the shape and the values still go through it; one made elsewhere reads torch's own getters."""
    model, opt, ref, ropt = pair(LAZY)
    try:
        train(model, opt, range(2), ref, ropt)
        opt.zero_grad()
        loss(model, 2).backward()
        grads = [p.grad for p in model.parameters()]
        slots = opt._dc.buffers.slots
        seen = _watch_calls(monkeypatch)
        for g, slot in zip(grads, slots):
            assert type(g) is watched.WatchedGradient
            assert (g.dtype, g.device, g.layout, g.is_sparse, g.is_cuda) == (
                slot.dtype, slot.device, slot.layout, slot.is_sparse, slot.is_cuda)
        assert seen == []
        assert grads[0].shape == slots[0].shape and seen == ["__get__"]
        with pytest.raises(AttributeError, match="'dtype' of a tensor is not writable"):
            grads[0].dtype = torch.float64
        elsewhere = torch.zeros(3, dtype=torch.float64).as_subclass(watched.WatchedGradient)
        assert (elsewhere.dtype, elsewhere.device, elsewhere.is_sparse) == (torch.float64, torch.device("cpu"), False)
        monkeypatch.undo()
        opt.step()
        plain(ref, ropt, 2)
        opt.synchronize()
        assert_same(model, ref)
    finally:
        opt._dc.close()


@pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself:FutureWarning")
def test_grad_scaler_step_unscales_the_plain_slots_and_equals_plain_torch(monkeypatch):
    """``scaler.step(opt)`` waits for every reduced gradient, then unscales them and steps with the plain slots in
    ``p.grad`` (``Stepper.slots_lent``): the watch sees none of it, and the weights, the skipped step of a
    non-finite loss and the scale are plain torch's with its own scaler."""
    model, opt, ref, ropt = pair(LAZY)
    scalers = {opt: torch.amp.GradScaler("cpu", init_scale=2.0 ** 8), ropt: torch.amp.GradScaler("cpu",
                                                                                                init_scale=2.0 ** 8)}
    try:
        for s in range(6):
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                scaler = scalers[o]
                scaler.scale(loss(m, s) * (float("inf") if s == 3 else 1.0)).backward()
                seen = _watch_calls(monkeypatch) if o is opt and s > 1 else []
                scaler.step(o)
                monkeypatch.undo()
                assert seen == []
                scaler.update()
        assert scalers[opt].get_scale() == scalers[ropt].get_scale() < 2.0 ** 8  # the non-finite step backed off
        opt.synchronize()
        assert_same(model, ref)
    finally:
        opt._dc.close()


class Branched(nn.Module):
    """``net()`` with a side branch that the forward takes at odd steps only."""

    def __init__(self):
        super().__init__()
        self.body, self.side = net(), nn.Linear(3, 3)
        torch.manual_seed(1)
        nn.init.normal_(self.side.weight)

    def forward(self, x, side: bool):
        y = self.body(x)
        return y + self.side(y) if side else y


def scaled_clipped(m, o, scaler, s):
    """torch's recipe for clipping under AMP, without ``synchronize()``; the loss is Inf at step 3."""
    o.zero_grad()
    value = m(batch(s), s % 2 == 1).pow(2).mean() * (float("inf") if s == 3 else 1.0)
    scaler.scale(value).backward()
    scaler.unscale_(o)
    nn.utils.clip_grad_norm_(m.parameters(), 0.05)
    scaler.step(o)
    scaler.update()


@pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself:FutureWarning")
def test_amp_clip_recipe_without_synchronize_equals_plain_torch():
    """Note [A scaler's unscale_]: ``scaler.unscale_(opt)``, ``clip_grad_norm_``, ``scaler.step(opt)`` as torch's
    AMP recipe has them. The side branch has no gradient when the scaler lists them at even steps (no rank used it:
    its zeros are dropped at the step)."""
    model, ref = Branched(), Branched()
    opt, ropt = pair(LAZY, (model, ref))[1::2]
    scalers = {opt: torch.amp.GradScaler("cpu", init_scale=2.0 ** 8), ropt: torch.amp.GradScaler("cpu",
                                                                                                init_scale=2.0 ** 8)}
    try:
        for s in range(6):
            scaled_clipped(model, opt, scalers[opt], s)
            scaled_clipped(ref, ropt, scalers[ropt], s)
            assert model.side.weight.grad is None if s % 2 == 0 else model.side.weight.grad is not None
        assert scalers[opt].get_scale() == scalers[ropt].get_scale() < 2.0 ** 8  # the non-finite step backed off
        opt.synchronize()
        assert_same(model, ref)
    finally:
        opt._dc.close()


@pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself:FutureWarning")
def test_a_gradient_the_scaler_did_not_unscale_is_refused_at_step(monkeypatch):
    """Where a tensor had no gradient when the scaler listed them (this rank's backward reached none of the
    optimizer's tensors: Note [Missed here] in core.py) and the flush gave it the sum of another rank, which used
    it, ``scaler.step(opt)`` refuses, naming it, and applies nothing. Another rank's use is pretended here (a world
    of one, the side branch not taken)."""
    from dcredit_opt.optimizer.usage import UsageTally

    model, ref = Branched(), Branched()
    opt = pair(LAZY, (model, ref))[1]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    try:
        for s in range(2):
            scaled_clipped(model, opt, scaler, s)
        opt.synchronize()
        before = [p.detach().clone() for p in model.parameters()]
        monkeypatch.setattr(UsageTally, "unused_everywhere", lambda tally, indices: [])
        with pytest.raises(dc.DCreditError, match=r"did not unscale the reduced gradient of parameter 'side\.weight'.*"
                                                  r"Nothing was applied.*optimizer\.synchronize\(\)"):
            scaled_clipped(model, opt, scaler, 2)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    finally:
        opt._dc.close()


def test_a_tensor_unused_at_a_world_of_one_keeps_none_after_backward():
    """Note [Unused here] gives a tensor this rank did not reach the other ranks' sum as ``p.grad``; in a world of
    one there is none, so its ``p.grad`` stays None after backward, as in plain torch, and a loop over the gradients
    that are not None skips it."""
    model, ref = Branched(), Branched()
    opt = pair(LAZY, (model, ref))[1]
    try:
        for s in range(4):
            opt.zero_grad()
            model(batch(s), s % 2 == 1).pow(2).mean().backward()
            assert (model.side.weight.grad is None) == (s % 2 == 0)
            assert not opt._dc.backward.stood
            opt.step()
    finally:
        opt._dc.close()
