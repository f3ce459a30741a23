"""Adasum (Note [Adasum], Note [Adasum optimizer]) in one process: the combination against the independent
reference and the cases known in closed form; the optimizer and the collectives in a world of one; refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dcredit_opt as dc
from dcredit_opt import adasum
from tests import adasum_reference as ref

pytestmark = pytest.mark.timeout(120)


def _vectors(n: int, numel: int, seed: int, dtype=torch.float32) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g).to(dtype) for _ in range(n)]


# ---- the combination ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("numel", [1, 7, 1000])
def test_the_combination_equals_the_reference(n, numel):
    vectors = _vectors(n, numel, seed=10 * n + numel, dtype=torch.float64)
    got = adasum.adasum_rows(torch.stack(vectors))
    torch.testing.assert_close(got, ref.combine(vectors), rtol=1e-12, atol=1e-12)


def test_the_tree_pairs_neighbours_and_carries_the_odd_one_up():
    v = _vectors(6, 9, seed=3, dtype=torch.float64)
    p = ref.pair
    torch.testing.assert_close(adasum.adasum(v[:3]), p(p(v[0], v[1]), v[2]), rtol=1e-12, atol=0)
    torch.testing.assert_close(adasum.adasum(v[:4]), p(p(v[0], v[1]), p(v[2], v[3])), rtol=1e-12, atol=0)
    torch.testing.assert_close(adasum.adasum(v[:5]), p(p(p(v[0], v[1]), p(v[2], v[3])), v[4]), rtol=1e-12, atol=0)
    torch.testing.assert_close(adasum.adasum(v), p(p(p(v[0], v[1]), p(v[2], v[3])), p(v[4], v[5])),
                               rtol=1e-12, atol=0)


def test_closed_forms():
    e = torch.eye(4, dtype=torch.float64)
    a = torch.tensor([1.0, 2.0, -3.0, 0.5], dtype=torch.float64)
    assert torch.equal(adasum.adasum([e[0], 2 * e[1]]), e[0] + 2 * e[1])  # orthogonal: the sum
    assert torch.equal(adasum.adasum([e[0], e[1], e[2], e[3]]), e.sum(0))
    assert torch.equal(adasum.adasum([a, a]), a)  # equal: the vector itself
    assert torch.equal(adasum.adasum([a, a, a, a]), a)
    assert torch.equal(adasum.adasum([a, a, a]), a)
    torch.testing.assert_close(adasum.adasum([a, 2 * a]), 1.5 * a)  # parallel: 0 * a + (1 - 2/8) * 2a
    assert torch.equal(adasum.adasum([a, -a]), torch.zeros(4, dtype=torch.float64))  # opposite: nothing
    zero = torch.zeros(4, dtype=torch.float64)
    assert torch.equal(adasum.adasum([a, zero]), a)  # a zero vector adds nothing, takes nothing away
    assert torch.equal(adasum.adasum([zero, a]), a)
    assert torch.equal(adasum.adasum([zero, zero]), zero)
    assert torch.equal(adasum.adasum([torch.full((3,), 1e-170, dtype=torch.float64)] * 2),
                       torch.full((3,), 2e-170, dtype=torch.float64))  # below the guard: plain sum, as Horovod
    assert adasum.adasum([torch.zeros(0), torch.zeros(0)]).shape == (0,)


def test_the_sums_do_not_depend_on_the_thread_count():
    x = torch.randn(3, 100_003, dtype=torch.float64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = adasum.pairwise_sum(x)
        torch.set_num_threads(max(2, before))
        assert torch.equal(adasum.pairwise_sum(x), one)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(one[:, 0], x.sum(1), rtol=1e-12, atol=1e-9)


def test_pack_and_unpack_keep_every_dtype_exact():
    tensors = [torch.randn(3, 2), torch.tensor([1.5], dtype=torch.float16), torch.randn(5, dtype=torch.float64),
               torch.randn(0), torch.randn(7).to(torch.bfloat16)]
    buffers = [adasum.pack(tensors), adasum.pack(tensors)]
    for rows in (buffers, torch.stack(buffers)):
        for t, got in zip(tensors, adasum.unpack_rows(rows, tensors)):
            assert got.dtype == t.dtype and got.shape == (2, t.numel())
            assert torch.equal(got[1], t.reshape(-1))


def test_bad_inputs_to_the_combination():
    with pytest.raises(ValueError, match="must be the same"):
        adasum.adasum([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(TypeError, match="floating-point"):
        adasum.adasum([torch.zeros(2, dtype=torch.int64)] * 2)


# ---- the optimizer and the collectives, in a world of one ---------------------------------------


@pytest.fixture(autouse=True)
def world_of_one():
    dc.init()
    assert dc.size() == 1


def _model_and_opt(opt_cls=torch.optim.Adam, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    return model, opt_cls(model.parameters(), lr=0.1, **kw)


def _step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
    opt.step()


@pytest.mark.parametrize("op", [dc.Adasum, 2])
def test_a_world_of_one_is_the_plain_step(op):
    model, opt = _model_and_opt()
    plain_model = copy.deepcopy(model)
    plain_opt = torch.optim.Adam(plain_model.parameters(), lr=0.1)
    wrapped = dc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=op)
    assert isinstance(wrapped, torch.optim.Adam)
    schedule = torch.optim.lr_scheduler.StepLR(wrapped, step_size=1, gamma=0.5)
    plain_schedule = torch.optim.lr_scheduler.StepLR(plain_opt, step_size=1, gamma=0.5)
    for seed in range(3):
        _step(model, wrapped, seed)
        _step(plain_model, plain_opt, seed)
        schedule.step()
        plain_schedule.step()
    for p, q in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(p, q)
    assert wrapped.state_dict()["param_groups"][0]["lr"] == plain_opt.state_dict()["param_groups"][0]["lr"]
    wrapped.synchronize()
    with wrapped.skip_synchronize():
        wrapped.step()
    wrapped.set_backward_passes_per_step(2)


def test_a_scheduler_built_before_wrapping_still_reaches_the_wrapper_after_a_load():
    """The Adasum wrapper shares its state and groups with the optimizer it wraps, across a load_state_dict()
    on either (checks.LoadInPlace), as DistributedOptimizer's does: a scheduler built on the script's own
    optimizer before wrapping keeps setting the learning rate the wrapper steps with, as in plain torch."""
    model, opt = _model_and_opt()
    plain_model = copy.deepcopy(model)
    plain_opt = torch.optim.Adam(plain_model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    plain_schedule = torch.optim.lr_scheduler.StepLR(plain_opt, step_size=1, gamma=0.5)
    wrapped = dc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=dc.Adasum)
    for seed in range(4):
        if seed == 2:  # a resume: the wrapper loads its own checkpoint
            wrapped.load_state_dict(copy.deepcopy(wrapped.state_dict()))
            plain_opt.load_state_dict(copy.deepcopy(plain_opt.state_dict()))
        _step(model, wrapped, seed)
        _step(plain_model, plain_opt, seed)
        schedule.step()
        plain_schedule.step()
    assert wrapped.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == plain_opt.param_groups[0]["lr"]
    for p, q in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(p, q)
    assert wrapped.param_groups is opt.param_groups and wrapped.state is opt.state


@pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself:FutureWarning")
def test_a_grad_scaler_skips_the_step_on_inf_and_lowers_the_scale():
    model, opt = _model_and_opt(torch.optim.SGD)
    wrapped = dc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=dc.Adasum)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    before = [p.detach().clone() for p in model.parameters()]
    wrapped.zero_grad()
    scaler.scale(model(torch.full((2, 4), float("inf"))).sum()).backward()
    scaler.step(wrapped)
    scaler.update()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert scaler.get_scale() == 2.0
    wrapped.zero_grad()
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.step(wrapped)
    scaler.update()
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def _unchanged(model, before) -> bool:
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_refusals_come_before_anything_changes():
    model, opt = _model_and_opt(torch.optim.SGD)
    with pytest.raises(ValueError, match="gradient_predivide_factor not supported with op != Average"):
        dc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=dc.Adasum,
                                gradient_predivide_factor=2.0)
    frozen = model[0].bias
    frozen.requires_grad_(False)
    wrapped = dc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=dc.Adasum)
    with pytest.raises(dc.DCreditError, match="add_param_group"):
        wrapped.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
    model(torch.ones(2, 4)).sum().backward()
    frozen.grad = torch.ones_like(frozen)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(dc.DCreditError, match=r"'0\.bias' did not require a gradient"):
        wrapped.step()
    assert _unchanged(model, before)
    frozen.grad = None
    wrapped.param_groups[0]["params"] = wrapped.param_groups[0]["params"][:-1]
    with pytest.raises(dc.DCreditError, match="parameters changed after it was wrapped"):
        wrapped.step()
    assert _unchanged(model, before)


def test_a_new_optimizer_over_the_same_parameters_takes_over():
    model, opt = _model_and_opt(torch.optim.SGD)
    first = dc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=dc.Adasum)
    second = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), op=dc.Adasum)
    model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(dc.DCreditError, match="is closed"):
        first.step()
    second.step()


def test_adasum_is_a_name_of_ours_now():
    assert dc.Adasum is dc.ReduceOp.ADASUM and "Adasum" in dc.__all__
    x = torch.tensor([1.0, -2.0])
    assert torch.equal(dc.allreduce(x, op=dc.Adasum), x)
    assert torch.equal(dc.allreduce(x, op=2, prescale_factor=2.0, postscale_factor=0.25), x * 0.5)
    assert torch.equal(dc.synchronize(dc.allreduce_async(x, op=dc.Adasum)), x)
    assert torch.equal(dc.grouped_allreduce([x, 2 * x], op=dc.Adasum)[1], 2 * x)
    with torch.no_grad():
        assert torch.equal(dc.allreduce(x.clone().requires_grad_(), op=dc.Adasum), x)
