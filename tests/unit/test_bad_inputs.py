"""F5.3: the bad-input catalogue, in a world of one.

Each refused input asserts the exact exception type, that the message names
the culprit, and that parameters, gradients and optimizer state are
unchanged afterwards. Each odd-but-valid input (zero-size, one-element,
huge, ten thousand tiny, mixed dtypes, non-contiguous, tied) must train
exactly like plain single-process PyTorch. The F1 items (bad arguments,
names, step() after a step without backward, zero_grad() while reducing,
sparse gradients, launcher variables) live in ``test_api.py``; their
2-rank counterparts (NaN on one rank, mixed dtypes across ranks) in
``tests/distributed/test_bad_inputs_2ranks.py``.
"""

from __future__ import annotations

import copy
import logging
import math
import time

import pytest
import torch
from torch import nn

import dcredit_opt as dc

FIXED = dc.Config(block_bytes=64, window=2, policy="fixed")


# ---- helpers ------------------------------------------------------------------


def snapshot(model, opt):
    """Parameters, gradients and optimizer state, deep-copied."""
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()],
            copy.deepcopy(opt.state_dict()))


def assert_unchanged(before, model, opt):
    params, grads, state = before
    for k, v in model.state_dict().items():
        assert _same(v, params[k]), f"parameter {k} changed"
    for i, (g0, p) in enumerate(zip(grads, model.parameters())):
        assert (g0 is None) == (p.grad is None) and (g0 is None or _same(g0, p.grad)), f"gradient {i} changed"
    now = opt.state_dict()
    assert now["param_groups"] == state["param_groups"], "hyperparameters changed"
    assert now["state"].keys() == state["state"].keys(), "optimizer state gained or lost entries"
    for k in state["state"]:
        for n, v in state["state"][k].items():
            assert _same(now["state"][k][n], v), f"optimizer state {k}.{n} changed"


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.nan_to_num(), b.nan_to_num())) \
            and bool(torch.equal(a.isnan(), b.isnan()))
    return a == b


def assert_same_params(model, ref):
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m, name=name: f"{name}: {m}")


def wrap(model, opt_cls=torch.optim.SGD, config=FIXED, **kw):
    opt = dc.DistributedOptimizer(opt_cls(model.parameters(), **kw), named_parameters=model.named_parameters(),
                                  config=config)
    return opt


def train_both(model, loss_fn, steps=3, opt_cls=torch.optim.SGD, config=FIXED, **kw):
    """Train ``model`` through dcredit_opt and a deep copy plainly; both must agree exactly."""
    ref = copy.deepcopy(model)
    opt = wrap(model, opt_cls, config, **kw)
    ref_opt = opt_cls(ref.parameters(), **kw)
    for step in range(steps):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            loss_fn(m, step).backward()
            o.step()
    opt.synchronize()
    assert_same_params(model, ref)
    return opt


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def data(step, n=5, width=4):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, width, generator=g)


# ---- NaN and Inf ------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_inf_gradients_are_reduced_faithfully(bad):
    """Like synchronous DDP: no check by default, a NaN/Inf gradient reaches the update as it is."""
    def loss(m, step):
        out = m(data(step)).pow(2).mean()
        return out + (m[2].bias * bad).sum() if step == 1 else out  # 2.bias gets a non-finite gradient
    model = mlp()
    train_both(model, loss, steps=2, lr=0.1, momentum=0.9)  # the bad gradient comes in the last step
    assert not bool(torch.isfinite(model[2].bias).all()), "the non-finite gradient was dropped"
    assert bool(torch.isfinite(model[0].weight).all())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("overlap_forward", [True, False])
def test_check_finite_refuses_the_whole_step(bad, overlap_forward):
    config = dc.Config(block_bytes=64, window=2, policy="fixed", check_finite=True, overlap_forward=overlap_forward)
    model = mlp()
    opt = wrap(model, torch.optim.SGD, config, lr=0.1, momentum=0.9)
    for step in range(2):  # momentum state exists, a lazy update may be pending
        opt.zero_grad()
        model(data(step)).pow(2).mean().backward()
        opt.step()
    opt.zero_grad()
    # 0.weight (nearest the input) is fine; 2.weight is not: a lazy per-layer
    # check would already have updated layer 0 when it found layer 2.
    (model(data(5)).pow(2).mean() + (model[2].weight * bad).sum()).backward()
    before = snapshot(model, opt)
    with pytest.raises(dc.DCreditError, match=r"reduced gradient of '2\.weight' holds NaN or Inf.*step\(\) skipped"):
        opt.step()
    with torch.no_grad():
        model(data(6))  # a forward must not apply anything either
    assert_unchanged(before, model, opt)
    # The job goes on: skip the batch, train the next one.
    opt.zero_grad()
    model(data(7)).pow(2).mean().backward()
    opt.step()
    opt.synchronize()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert not torch.equal(model[0].weight, before[0]["0.weight"])


# ---- odd shapes and sizes ----------------------------------------------------------


class Odd(nn.Module):
    """Zero-size, one-element and scalar parameters beside an ordinary layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.empty = nn.Parameter(torch.zeros(0))
        self.empty2d = nn.Parameter(torch.zeros(0, 3))
        self.lin = nn.Linear(4, 3)
        self.one = nn.Parameter(torch.tensor([0.5]))
        self.scalar = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        y = self.lin(x) * self.one + self.scalar
        return y + self.empty.sum() + self.empty2d.sum()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("opt_cls, kw", [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                         (torch.optim.Adam, {"lr": 0.01})])
def test_zero_size_one_element_and_scalar_parameters(opt_cls, kw):
    model = Odd()
    opt = train_both(model, lambda m, s: m(data(s)).pow(2).mean(), steps=4, opt_cls=opt_cls, **kw)
    assert model.one.shape == (1,) and model.scalar.shape == () and model.empty2d.shape == (0, 3)
    blocks = [len(p) for p in opt.plan.partition]  # tensors in forward order: empty, empty2d, lin.w, lin.b, ...
    assert blocks == [0, 0, 1, 1, 1, 1], f"a zero-size tensor has no block, the others one each: {blocks}"


@pytest.mark.timeout(60)
def test_only_zero_size_parameters():
    model = nn.Module()
    model.a = nn.Parameter(torch.zeros(0))
    model.b = nn.Parameter(torch.zeros(2, 0))
    opt = wrap(model, lr=0.1)
    (model.a.sum() + model.b.sum()).backward()
    opt.step()
    opt.synchronize()
    assert model.a.grad.shape == (0,) and model.b.grad.shape == (2, 0)


def _mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return 0.0


LARGE = 256 * 2**20  # elements: 1 GiB of fp32


@pytest.mark.timeout(120)
@pytest.mark.skipif(_mem_available_gib() < 5, reason="needs about 4 GiB of free memory (a 1 GiB parameter, "
                                                     "its gradient and its slot)")
def test_a_256m_element_parameter():
    """1 GiB parameter; peak about 3.3 GiB (parameter, autograd's gradient, our slot, one bool mask)."""
    lr = 0.5
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(LARGE))
    opt = wrap(model, config=dc.Config(policy="fixed"), lr=lr)  # default 4 MiB blocks: 256 of them
    start = time.perf_counter()
    model.w.sum().backward()  # gradient: all ones
    opt.step()
    opt.synchronize()
    took = time.perf_counter() - start
    assert bool((model.w == -lr).all()), "the update of the large parameter is wrong"
    assert opt._dc.buffers.layout.num_blocks == 256
    print(f"\n256M-element parameter: backward + step + synchronize in {took:.2f} s")
    del opt, model


@pytest.mark.timeout(180)
def test_ten_thousand_tiny_parameters():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.ps = nn.ParameterList([nn.Parameter(torch.randn(3)) for _ in range(10_000)])

        def forward(self, x):
            return x @ torch.stack(list(self.ps)).t()

    model = Tiny()
    ref = copy.deepcopy(model)
    opt = wrap(model, torch.optim.SGD, dc.Config(policy="fixed"), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    times, ref_times = [], []
    for step in range(4):
        for m, o, t in ((model, opt, times), (ref, ref_opt, ref_times)):
            start = time.perf_counter()
            o.zero_grad()
            m(data(step, width=3)).pow(2).mean().backward()
            o.step()
            if hasattr(o, "synchronize"):
                o.synchronize()
            t.append(time.perf_counter() - start)
    assert_same_params(model, ref)
    step_s, ref_s = sorted(times[1:])[1], sorted(ref_times[1:])[1]
    # Reported, not asserted: how fast depends on what else the machine runs.
    print(f"\n10,000 tiny parameters: step {step_s * 1e3:.0f} ms with dcredit_opt, {ref_s * 1e3:.0f} ms plain "
          "(median of 3 after one warm-up)")


@pytest.mark.timeout(60)
def test_mixed_dtypes_in_one_model():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a = nn.Linear(4, 8)
            self.b = nn.Linear(8, 8).to(torch.float16)
            self.c = nn.Linear(8, 3).to(torch.bfloat16)

        def forward(self, x):
            h = torch.relu(self.a(x))
            h = torch.relu(self.b(h.half()))
            return self.c(h.bfloat16()).float()

    model = Mixed()
    opt = train_both(model, lambda m, s: m(data(s)).pow(2).mean(), steps=4, lr=0.05, momentum=0.9)
    assert len(opt._dc.buffers.flat) == 3, "one flat buffer per dtype"
    assert {p.dtype for p in model.parameters()} == {torch.float32, torch.float16, torch.bfloat16}


@pytest.mark.timeout(60)
def test_non_contiguous_gradients():
    class Strided(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
            self.wt = nn.Parameter(torch.randn(6, 16).t())  # a transposed (column-major) weight

        def forward(self, x):
            return self.conv(x).flatten(1)[:, :16] @ self.wt

    model = Strided()
    assert not model.conv.weight.is_contiguous() and not model.wt.is_contiguous()
    x = [torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(s)).to(memory_format=torch.channels_last)
         for s in range(3)]
    grads = {}

    def seen(p):
        grads.setdefault("wt", p.grad.is_contiguous())

    model.wt.register_post_accumulate_grad_hook(seen)
    train_both(model, lambda m, s: m(x[s]).pow(2).mean(), steps=3, lr=0.1, momentum=0.9)
    assert grads["wt"] is False, "the test meant a non-contiguous gradient to reach the hook"


@pytest.mark.timeout(60)
def test_tied_weights_shared_between_two_modules():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(10, 6)
            self.mid = nn.Linear(6, 6)
            self.out = nn.Linear(6, 10, bias=False)
            self.out.weight = self.emb.weight  # tied

        def forward(self, idx):
            return self.out(torch.tanh(self.mid(self.emb(idx))))

    model = Tied()
    idx = [torch.randint(0, 10, (7,), generator=torch.Generator().manual_seed(s)) for s in range(4)]
    opt = train_both(model, lambda m, s: nn.functional.cross_entropy(m(idx[s]), idx[s]), steps=4,
                     opt_cls=torch.optim.Adam, lr=0.01)
    assert model.out.weight is model.emb.weight
    assert len(opt._dc.params) == 3, "a tied weight is reduced once"
    # Named twice (remove_duplicate=False) it is still reduced once.
    model2 = Tied()
    opt2 = dc.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1),
                                   named_parameters=model2.named_parameters(remove_duplicate=False), config=FIXED)
    assert len(opt2._dc.params) == 3


# ---- wrong call order ---------------------------------------------------------------


@pytest.mark.timeout(60)
def test_step_without_backward_on_a_fresh_optimizer_changes_nothing_and_says_so(caplog):
    """Note [No gradient here]: with no gradient anywhere the step is plain torch's, a no-op (here a world of
    one joins its own reduction with none), and a notice names the forgotten backward."""
    model = mlp()
    opt = wrap(model, torch.optim.Adam, lr=0.01)
    before = snapshot(model, opt)
    with caplog.at_level(logging.WARNING, logger="dcredit_opt"):
        opt.step()
        opt.synchronize()
    assert_unchanged(before, model, opt)
    said = [r.getMessage() for r in caplog.records if "found no gradient on this rank" in r.getMessage()]
    assert len(said) == 1 and "loss.backward()" in said[0] and "Note [No gradient here]" in said[0], said
    # And it trains normally afterwards.
    model(data(0)).sum().backward()
    opt.step()
    opt.synchronize()


@pytest.mark.timeout(60)
def test_backward_beyond_backward_passes_per_step_changes_nothing():
    model = mlp()
    ref = copy.deepcopy(model)
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters(), backward_passes_per_step=2,
                                  config=FIXED)
    for k in range(2):
        model(data(k)).pow(2).mean().backward()
    before = snapshot(model, opt)
    with pytest.raises(dc.DCreditError, match=r"'2\.bias' was computed 3 times.*backward_passes_per_step=2"):
        model(data(2)).pow(2).mean().backward()
    assert_unchanged(before, model, opt)  # refused before autograd added it to p.grad (the slot on the wire)
    # torch.autograd.grad() leaves p.grad alone, so it is not counted as a pass.
    torch.autograd.grad(model(data(3)).sum(), list(model.parameters()))
    opt.step()
    opt.synchronize()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for k in range(2):
        ref(data(k)).pow(2).mean().backward()
    ref_opt.step()
    assert_same_params(model, ref)


# ---- init and shutdown ---------------------------------------------------------------


@pytest.mark.timeout(60)
def test_init_twice_is_a_no_op():
    dc.init()
    world = (dc.size(), dc.rank(), dc.local_rank())
    dc.init()
    dc.init(timeout_s=7.0)  # the first call's settings stay in force
    assert (dc.size(), dc.rank(), dc.local_rank()) == world == (1, 0, 0)
    train_both(mlp(), lambda m, s: m(data(s)).pow(2).mean(), steps=2, lr=0.1)


@pytest.mark.timeout(60)
def test_shutdown_then_init_again():
    dc.init()
    model = mlp()
    old = wrap(model, lr=0.1, momentum=0.9)
    model(data(0)).sum().backward()
    old.step()
    old.synchronize()
    dc.shutdown()
    assert not dc.is_initialized()
    dc.shutdown()  # twice: a no-op
    dc.init()
    assert dc.is_initialized() and dc.size() == 1
    # A new optimizer works in the new world, exactly like plain training.
    train_both(mlp(), lambda m, s: m(data(s)).pow(2).mean(), steps=3, opt_cls=torch.optim.Adam, lr=0.01)
    # The old one was closed by shutdown(): its model is a plain model again, and its step() is refused
    # without changing anything.
    old.zero_grad()
    model(data(1)).sum().backward()
    before = snapshot(model, old)
    with pytest.raises(dc.DCreditError, match=r"DistributedOptimizer that was shut down \(dc\.shutdown\(\) shuts down"):
        old.step()
    assert_unchanged(before, model, old)
