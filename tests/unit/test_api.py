"""F1 API and bad input, in a world of one: each misuse raises a clear error and changes nothing."""

import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import dcredit_opt as dc

pytestmark = pytest.mark.timeout(120)

FIXED = dc.Config(block_bytes=64, window=2, policy="fixed")


def model_and_opt(opt_cls=torch.optim.SGD, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    return model, opt_cls(model.parameters(), lr=0.1, **kw)


def snapshot(model, opt):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), [
        None if p.grad is None else p.grad.clone() for p in model.parameters()]


def assert_unchanged(before, model, opt):
    params, state, grads = before
    for k, v in model.state_dict().items():
        assert torch.equal(v, params[k]), f"parameter {k} changed"
    assert repr(opt.state_dict()) == repr(state) or _same_state(opt.state_dict(), state)
    for g0, p in zip(grads, model.parameters()):
        assert (g0 is None and p.grad is None) or torch.equal(g0, p.grad), "a gradient changed"


def _same_state(a, b):
    return a["param_groups"] == b["param_groups"] and all(
        torch.equal(a["state"][k][n], b["state"][k][n]) for k in a["state"] for n in a["state"][k])


def train_step(model, opt, seed=0):
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
    opt.step()


@pytest.mark.parametrize("make_named, message", [
    (lambda m: [("w", p) for p in m.parameters()], "unique"),
    (lambda m: list(m.named_parameters())[:-1], "not named"),
    (lambda m: [p for p in m.parameters()], "tuples"),
])
def test_horovod_value_errors_for_names(make_named, message):
    model, opt = model_and_opt()
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=message):
        dc.DistributedOptimizer(opt, named_parameters=make_named(model), config=FIXED)
    assert_unchanged(before, model, opt)
    hooked = [p for p in model.parameters() if getattr(p, "_post_accumulate_grad_hooks", None)]
    assert not hooked, f"{len(hooked)} parameter(s) keep a hook after the refused construction"


@pytest.mark.parametrize("kwargs, message", [
    ({"backward_passes_per_step": 0}, "backward_passes_per_step"),
    ({"backward_passes_per_step": 1.5}, "backward_passes_per_step"),
    ({"op": dc.Sum, "gradient_predivide_factor": 2.0}, "gradient_predivide_factor"),
    ({"gradient_predivide_factor": 0.0}, "gradient_predivide_factor"),
    ({"op": "adasum"}, "op must be"),
    ({"config": "fast"}, "config must be"),
])
def test_bad_arguments(kwargs, message):
    model, opt = model_and_opt()
    before = snapshot(model, opt)
    with pytest.raises((ValueError, TypeError), match=message):
        dc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kwargs)
    assert_unchanged(before, model, opt)


@pytest.mark.parametrize("field, value", [("block_bytes", 0), ("block_bytes", -4), ("window", 0), ("window", -2),
                                          ("channels", 0), ("timeout_s", 0), ("credit_bytes", -1),
                                          ("policy", "fastest"), ("backend", "carrier-pigeon")])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        dc.Config(**{field: value})


def test_lbfgs_is_refused():
    model, opt = model_and_opt(torch.optim.LBFGS)
    with pytest.raises(ValueError, match="LBFGS"):
        dc.DistributedOptimizer(opt, named_parameters=model.named_parameters())


def test_wrapping_twice_and_adding_groups_are_refused():
    model, opt = model_and_opt()
    wrapped = dc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), config=FIXED)
    with pytest.raises(ValueError, match="already"):
        dc.DistributedOptimizer(wrapped, named_parameters=model.named_parameters())
    with pytest.raises(ValueError, match="add_param_group"):
        wrapped.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    assert isinstance(wrapped, torch.optim.SGD)


def test_step_without_backward_raises_and_changes_nothing():
    model, opt = model_and_opt(momentum=0.9)
    opt = dc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), config=FIXED)
    train_step(model, opt)
    opt.synchronize()
    before = snapshot(model, opt)
    with pytest.raises(dc.DCreditError, match="no gradient was computed"):
        opt.step()
    assert_unchanged(before, model, opt)


def test_backward_more_often_than_backward_passes_per_step():
    model, opt = model_and_opt()
    opt = dc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), config=FIXED)
    x = torch.randn(5, 4)
    model(x).sum().backward()
    with pytest.raises(dc.DCreditError, match=r"'2.bias'.*backward_passes_per_step=1"):
        model(x).sum().backward()


def test_zero_grad_while_reducing_is_refused():
    model, opt = model_and_opt()
    opt = dc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), config=FIXED)
    model(torch.randn(5, 4)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(dc.DCreditError, match="zero_grad"):
        opt.zero_grad()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))


def test_sparse_gradient_needs_sparse_as_dense():
    for sparse_as_dense in (False, True):
        torch.manual_seed(0)
        emb = nn.Embedding(10, 3, sparse=True)
        opt = dc.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                      named_parameters=emb.named_parameters(), config=FIXED,
                                      sparse_as_dense=sparse_as_dense)
        before = emb.weight.detach().clone()
        loss = emb(torch.tensor([1, 2])).sum()
        if not sparse_as_dense:
            with pytest.raises(dc.DCreditError, match="'weight' has a sparse gradient"):
                loss.backward()
            assert torch.equal(before, emb.weight)
        else:
            loss.backward()
            opt.step()
            opt.synchronize()
            assert not torch.equal(before, emb.weight)


def test_step_after_synchronize_without_skip_warns():
    model, opt = model_and_opt()
    opt = dc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), config=FIXED)
    model(torch.randn(5, 4)).sum().backward()
    opt.synchronize()
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.step()
    model(torch.randn(5, 4)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opt.skip_synchronize():
            opt.step()


def test_world_of_one_matches_plain_training_for_every_optimizer():
    for cls, kw in [(torch.optim.SGD, {"momentum": 0.9}), (torch.optim.Adam, {}), (torch.optim.AdamW, {}),
                    (torch.optim.RMSprop, {}), (torch.optim.Adagrad, {}), (torch.optim.Adadelta, {})]:
        model, opt = model_and_opt(cls, **kw)
        ref, ref_opt = copy.deepcopy(model), cls(model.parameters(), lr=0.1, **kw)
        ref_opt = cls(ref.parameters(), lr=0.1, **kw)
        opt = dc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), config=FIXED)
        for s in range(5):
            train_step(model, opt, s)
            train_step(ref, ref_opt, s)
        opt.synchronize()
        for a, b in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(a, b, atol=1e-6), cls.__name__
        assert dc.size() == 1 and dc.rank() == 0 and dc.local_rank() == 0


def _run_init(env, timeout=60):
    code = "import dcredit_opt as dc; dc.init(timeout_s=3.0); print('size', dc.size())"
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    clean.update(env)
    return subprocess.run([sys.executable, "-c", code], check=False, env=clean, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0"}, "WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT"),
    ({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}, "not below"),
])
def test_half_set_launcher_environment(env, message):
    out = _run_init(env)
    assert out.returncode != 0
    assert "LaunchError" in out.stderr and message in out.stderr and "torchrun" in out.stderr


def test_master_that_does_not_answer_is_a_launch_error_within_the_timeout():
    out = _run_init({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"})
    assert out.returncode != 0
    assert "LaunchError" in out.stderr and "could not join" in out.stderr


def test_no_launcher_is_a_world_of_one():
    out = _run_init({})
    assert out.returncode == 0, out.stderr
    assert "size 1" in out.stdout


def test_lazy_step_applies_every_finished_update_in_one_wrapped_step():
    # Four modules with parameters. Once every reduction has finished, the
    # first forward applies all pending updates in one wrapped step(), not one
    # per module, and the result is still plain SGD's.
    class CountingSGD(torch.optim.SGD):
        calls = 0

        def step(self, closure=None):
            CountingSGD.calls += 1
            return super().step(closure)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = dc.DistributedOptimizer(CountingSGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                  config=FIXED)
    for s in range(3):
        train_step(model, opt, s)
        train_step(ref, ref_opt, s)
    assert opt._dc_npending, "the step was not lazy: this test needs the lazy path"
    opt._dc_engine.wait_all(30.0)
    before = CountingSGD.calls
    with torch.no_grad():
        model(torch.randn(2, 4))
    assert CountingSGD.calls == before + 1
    assert not opt._dc_npending
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
