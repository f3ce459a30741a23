"""F1 API and bad input, in a world of one: each misuse raises a clear error and changes nothing."""

import concurrent.futures
import copy
import dataclasses
import os
import subprocess
import sys
import warnings
from unittest import mock

import pytest
import torch
from torch import nn

import dcredit_opt as dc
from dcredit_opt.optimizer import checks
from dcredit_opt.profiling import profiler
from tests import timing

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


def test_a_lazy_module_not_yet_run_is_named():
    """A lazy module's parameters take their shape at its first forward; torch's optimizers accept them before,
    but their gradients' places are laid out at wrapping: refused, naming the parameter and the fix."""
    model = nn.Sequential(nn.LazyLinear(3), nn.ReLU(), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"parameter '0\.weight' is not initialized.*Run one forward pass"):
        dc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), config=FIXED)
    model(torch.ones(4, 5))  # the dry run: now it wraps
    dc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), config=FIXED)._dc.close()


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
    with pytest.raises(dc.DCreditError, match="add_param_group"):
        wrapped.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    assert isinstance(wrapped, torch.optim.SGD)


def test_a_second_step_without_backward_steps_on_the_same_gradients_as_plain_torch():
    """Note [No gradient here]: the gradients a step() left are reduced again (every rank has the same average,
    whose average it stays) and applied again, as plain torch's second step() applies them again."""
    model, opt = model_and_opt(momentum=0.9)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = dc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), config=FIXED)
    for m, o in ((model, opt), (ref, ref_opt)):
        train_step(m, o)
        o.step()
    opt.synchronize()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


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



def _two_optimizers(wrap_second: bool, named: bool = True):
    """The model's last layer on an optimizer of its own; the first optimizer wrapped, naming the whole model
    (``named``) or only its own parameters."""
    model, _ = model_and_opt()
    first = dc.DistributedOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1), config=FIXED,
                                    named_parameters=model.named_parameters() if named else
                                    model[0].named_parameters(prefix="0"))
    second = torch.optim.SGD(model[2].parameters(), lr=0.1)
    if wrap_second:
        second = dc.DistributedOptimizer(second, named_parameters=model[2].named_parameters(prefix="2"), config=FIXED)
    return model, first, second


@pytest.mark.parametrize("named", [True, False], ids=["named", "found"])
@pytest.mark.parametrize("wrap_second, told", [(False, True), (True, False)])
def test_a_parameter_of_the_model_that_an_unwrapped_optimizer_trains_is_told_once(caplog, wrap_second, told, named):
    """Note [Parameters outside the optimizer] in checks.py: the second step() that finds a parameter of the model
    outside the optimizer changed, with no optimizer of ours reducing it, warns once, naming it; not where the
    other optimizer is wrapped too. Whether named_parameters names it or it is found in the model the forward
    runs."""
    model, first, second = _two_optimizers(wrap_second, named)
    outside = first._dc.outside
    assert (outside.names, outside.found_names) == ((["2.weight", "2.bias"], []) if named else ([], []))
    with caplog.at_level("WARNING", logger="dcredit_opt"):
        for seed in range(4):
            first.zero_grad()
            second.zero_grad()
            model(torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))).pow(2).mean().backward()
            first.step()
            second.step()
    if not named:  # found in the first forward after step(): the model's (where it began) others, not ours
        assert outside.found_names == ([] if wrap_second else ["2.weight", "2.bias"])
    how = "is named in named_parameters but is not in" if named else "neither in it nor named"
    warned = [r.getMessage() for r in caplog.records if how in r.getMessage()]
    if told:
        assert len(warned) == 1 and "parameter '2.weight'" in warned[0] and "Wrap every optimizer" in warned[0], \
            warned
    else:
        assert not warned, warned
    first._dc.close()
    if wrap_second:
        second._dc.close()


def test_named_parameters_outside_the_optimizer_are_those_that_need_a_gradient(caplog):
    """A named parameter outside the optimizer that no one changes is never told, nor one changed every step
    without a gradient (an average of the weights kept in the model); frozen ones, the optimizer's own and a tied
    one counted once are not among those compared."""
    model, _ = model_and_opt()
    model[2].bias.requires_grad_(False)
    named = [*model.named_parameters(), ("tied.weight", model[2].weight)]  # the same parameter under a second name
    opt = dc.DistributedOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1), named_parameters=named,
                                  config=FIXED)
    assert opt._dc.outside.names == ["2.weight"]
    with caplog.at_level("WARNING", logger="dcredit_opt"):
        for seed in range(3):
            train_step(model, opt, seed)
        model[2].weight.grad = None
        for seed in range(3):
            opt.zero_grad()
            model[0](torch.randn(5, 4)).pow(2).mean().backward()  # the last layer gets no gradient
            opt.step()
            with torch.no_grad():
                model[2].weight.mul_(0.9).add_(model[0].weight[:3, :].T[:, :3].sum() * 0.1)  # moved every step
    assert not [r for r in caplog.records if "is named in named_parameters" in r.getMessage()]
    opt._dc.close()
    everything = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), config=FIXED)
    for seed in range(3):
        train_step(model, everything, seed)
    outside = everything._dc.outside
    assert (outside.names, outside.found_names, outside.watching) == ([], [], False)
    everything._dc.close()


def test_the_parameters_found_outside_the_optimizer_are_the_models_others_that_need_a_gradient():
    """Note [Parameters outside the optimizer] in checks.py: where named_parameters names only some, the others
    found are the parameters of the module where the forward began that need a gradient and are neither ours
    nor named: not frozen ones, not a teacher's whose forward also ran (it holds none of ours), each once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    teacher = nn.Linear(4, 3)
    model[4].bias.requires_grad_(False)
    named = [("first.weight", model[0].weight), ("first.bias", model[0].bias), ("mid.weight", model[2].weight)]
    opt = dc.DistributedOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1), named_parameters=named,
                                  config=FIXED)
    for seed in range(3):
        opt.zero_grad()
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))
        (model(x) - teacher(x).detach()).pow(2).mean().backward()
        opt.step()
    outside = opt._dc.outside
    assert outside.names == ["mid.weight"]
    assert outside.found_names == ["2.bias", "4.weight"]
    outside.find([model, model[4]], {id(p) for p in model[0].parameters()}, model[0].weight.device)
    assert outside.found_names == ["2.bias", "4.weight"]  # each once, however often looked for
    opt._dc.close()

def test_sparse_gradients_train_with_or_without_sparse_as_dense():
    # Note [Sparse gradients]: reduced as rows (one rank: its own), or dense with sparse_as_dense=True; SparseAdam
    # and SGD get them sparse either way and train as plain torch does.
    for opt_fn in (lambda p: torch.optim.SparseAdam(list(p), lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)):
        for sparse_as_dense in (False, True):
            torch.manual_seed(0)
            emb = nn.Embedding(10, 3, sparse=True)
            ref = nn.Embedding(10, 3, sparse=True)
            ref.load_state_dict(emb.state_dict())
            opt = dc.DistributedOptimizer(opt_fn(emb.parameters()), named_parameters=emb.named_parameters(),
                                          config=FIXED, sparse_as_dense=sparse_as_dense)
            ropt = opt_fn(ref.parameters())
            for step in range(4):
                ids = torch.tensor([[1, 2, 2], [5, 1, 6]]) + step
                for m, o in ((emb, opt), (ref, ropt)):
                    o.zero_grad()
                    m(ids).pow(2).sum().backward()
                    o.step()
            opt.synchronize()
            torch.testing.assert_close(emb.weight, ref.weight)
            assert opt._dc.tally.sparse_rows() == ([] if sparse_as_dense else [0])
            opt._dc.close()


def test_a_sparse_gradient_with_sparse_dimensions_other_than_rows_is_refused():
    p = nn.Parameter(torch.zeros(3, 4))
    opt = dc.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), named_parameters=[("w", p)], config=FIXED)
    p.grad = torch.eye(3, 4).to_sparse(2)  # two sparse dimensions: not rows
    with pytest.raises(dc.DCreditError, match="'w' has a sparse gradient of layout .* 2 sparse dimension"):
        opt.step()
    assert bool((p == 0).all())


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


@pytest.mark.filterwarnings("error:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")
@pytest.mark.parametrize("op", [dc.Average, dc.Adasum])
def test_a_scheduler_built_before_wrapping_sees_the_wrappers_step(op):
    """torch's LR scheduler notes the step() of the object it was built on and warns at its first step() where
    none was noted; the wrapper's step() notes itself there (checks.StepNoted), so no warning is spurious, and
    the schedule is the plain one."""
    model, opt = model_and_opt()
    ref_model, ref_opt = model_and_opt()
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_schedule = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    wrapped = dc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=op, config=FIXED)
    x = torch.randn(5, 4)
    for m, o, s in ((model, wrapped, schedule), (ref_model, ref_opt, ref_schedule)):
        for _ in range(3):
            o.zero_grad()
            m(x).sum().backward()
            o.step()
            s.step()
    assert wrapped.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.1 * 0.5 ** 3
    wrapped.synchronize()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    with pytest.warns(UserWarning, match="before `optimizer.step"):  # the check is still torch's own
        torch.optim.lr_scheduler.StepLR(torch.optim.SGD(ref_model.parameters(), lr=0.1), step_size=1).step()


def _run_init(env, timeout=60):
    code = "import dcredit_opt as dc; dc.init(timeout_s=3.0); print('size', dc.size())"
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    clean.update(env)
    return subprocess.run([sys.executable, "-c", code], check=False, env=clean, capture_output=True, text=True,
                          timeout=timing.scaled(timeout))


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


class _Unfinished:
    """The optimizer's engine, except that the tensors named report their reduction as unfinished."""

    def __init__(self, engine, unfinished):
        self._engine, self._unfinished = engine, set(unfinished)

    def tensor_done(self, i):
        return i not in self._unfinished and self._engine.tensor_done(i)

    def tensor_final(self, i):
        return i not in self._unfinished and self._engine.tensor_final(i)

    def finals(self):
        return bytes(0 if i in self._unfinished else f for i, f in enumerate(self._engine.finals()))

    def __getattr__(self, name):
        return getattr(self._engine, name)


class CountingSGD(torch.optim.SGD):
    calls = 0

    def step(self, closure=None):
        CountingSGD.calls += 1
        return super().step(closure)


def _lazy_counting_net():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    # A subclass of SGD may look at all its parameters in step(): this one does not, and says so.
    opt = dc.DistributedOptimizer(CountingSGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                  config=dataclasses.replace(FIXED, lazy_step="on"))
    for s in range(3):
        train_step(model, opt, s)
        train_step(ref, ref_opt, s)
    assert opt._dc.lazy.npending == 8, "the step was not lazy: this test needs the lazy path"
    opt._dc.engine.wait_all(30.0)
    return model, ref, opt


def _check_same(model, ref):
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_lazy_step_applies_finished_updates_together_at_the_first_module():
    # Note [Lazy step]: with every reduction finished, the first module's forward applies all eight
    # updates in one wrapped step (not one per module). The result is still plain SGD's.
    model, ref, opt = _lazy_counting_net()
    before = CountingSGD.calls
    model[0](torch.randn(2, 4))
    assert CountingSGD.calls == before + 1
    assert opt._dc.lazy.npending == 0
    _check_same(model, ref)


def test_lazy_step_applies_ahead_only_up_to_the_first_unfinished_update():
    # In first-read order: model[0]'s own two, then model[2]'s (finished), then model[4].weight (not): the
    # first forward applies four, model[4] and model[5] wait for their own modules, one wrapped step each.
    model, ref, opt = _lazy_counting_net()
    opt._dc.engine = _Unfinished(opt._dc.engine, [opt._dc.names.index("4.weight")])
    before = CountingSGD.calls
    model[0](torch.randn(2, 4))
    assert CountingSGD.calls == before + 1
    assert [n for n, w in zip(opt._dc.names, opt._dc.lazy.pending) if w] == ["4.weight", "4.bias", "5.weight", "5.bias"]
    model[2](torch.randn(2, 8))  # applied already: nothing to do
    assert CountingSGD.calls == before + 1
    model[4](torch.randn(2, 8))  # its own two, and model[5]'s, finished
    assert CountingSGD.calls == before + 2 and opt._dc.lazy.npending == 0
    _check_same(model, ref)


class PeekNet(nn.Module):
    """Three layers; ``peek`` makes the forward read the last layer's weight before running it: "graph"
    (``h + c.weight.sum()``, recorded by autograd), "untracked" (through ``detach()``), "data" (through
    ``.data`` under no_grad), or "thread" (``c.weight.sum()`` computed on another thread, with autograd)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.peek = None

    def forward(self, x):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        if self.peek == "graph":
            h = h + self.c.weight.sum()
        elif self.peek == "untracked":
            h = h + self.c.weight.detach().sum()
        elif self.peek == "data":
            with torch.no_grad():
                peeked = self.c.weight.data.sum()
            h = h + peeked
        elif self.peek == "thread":
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                h = h + pool.submit(lambda: self.c.weight.sum()).result()
        return self.c(h)


def _lazy_peek_net():
    torch.manual_seed(0)
    model = PeekNet()
    ref = copy.deepcopy(model)
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters(),
                                  config=dataclasses.replace(FIXED, lazy_step="on"))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    return model, ref, opt, ref_opt


def _peek_net_with_c_pending():
    """``_lazy_peek_net`` after three steps, with c's reduction held unfinished so that its update is still
    pending (and the guard armed) after the last ``step()``: a's forward would apply it otherwise."""
    model, ref, opt, ref_opt = _lazy_peek_net()
    opt._dc.engine = _Unfinished(opt._dc.engine, [opt._dc.names.index("c.weight")])
    for s in range(3):
        train_step(model, opt, s)
        train_step(ref, ref_opt, s)
    assert opt._dc.lazy.npending and opt._dc.lazy.guard.armed, "the step was not lazy: this test needs the lazy path"
    return model, ref, opt, ref_opt


@pytest.mark.parametrize("peek", ["graph", "untracked", "data"])
def test_early_read_in_forward_sees_the_update(peek, caplog):
    # Note [Guarded reads]: from step 3 on, the parent reads c.weight before c's forward, where the first
    # iteration learned to apply its update. The guard applies it at that read instead: plain SGD's result.
    model, ref, opt, ref_opt = _lazy_peek_net()
    # c's reduction unfinished when a's forward runs, or a's forward would apply c's update too, ahead of the
    # read (Note [Lazy step]), and the guard would have nothing to do.
    opt._dc.engine = _Unfinished(opt._dc.engine, [opt._dc.names.index("c.weight")])
    for s in range(6):
        model.peek = ref.peek = peek if s >= 3 else None
        train_step(model, opt, s)
        train_step(ref, ref_opt, s)
        if s == 2:
            assert opt._dc.lazy.npending, "the step was not lazy: this test needs the lazy path"
    opt.synchronize()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    assert "'c.weight' was read before the place" in caplog.text


def test_read_between_step_and_forward_sees_the_update():
    # An EMA of the weights that first runs late in training (after the first iteration learned where each
    # parameter is read), between step() and the next forward: it reads updated values.
    model, ref, opt, ref_opt = _lazy_peek_net()
    for s in range(3):
        train_step(model, opt, s)
        train_step(ref, ref_opt, s)
    assert opt._dc.lazy.npending, "the step was not lazy: this test needs the lazy path"
    ema = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(ema, ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    with torch.no_grad():
        norms = [float(p.data.norm()) for p in model.parameters()]
    assert norms == pytest.approx([float(p.detach().norm()) for p in ref.parameters()], abs=1e-5)


def test_stale_read_on_another_thread_is_refused_where_the_update_would_be_applied():
    # The guard watches the training thread only. A read with autograd on another thread still shows in
    # the parameter's gradient accumulator (Note [Graph reads]): c's pre-hook refuses, naming the
    # parameter, and leaves it as it was.
    model, _, opt, _ = _lazy_peek_net()
    for s in range(3):
        train_step(model, opt, s)
    i = opt._dc.names.index("c.weight")
    assert opt._dc.lazy.pending[i], "the step was not lazy: this test needs the lazy path"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # unseen by the guard, so nothing is applied
        old = pool.submit(lambda: model.c.weight.detach().clone()).result()
    # c's reduction unfinished when a's forward runs, so c's update waits for c's own forward (finished, it
    # would be applied at a's forward, before the read: test_read_on_another_thread_after_the_update_...).
    opt._dc.engine = _Unfinished(opt._dc.engine, [i])
    model.peek = "thread"
    try:
        with pytest.raises(dc.DCreditError, match=r"parameter 'c\.weight' was read .* before its update"):
            model(torch.randn(5, 4))
        assert opt._dc.lazy.pending[i]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            assert torch.equal(pool.submit(lambda: model.c.weight.detach().clone()).result(), old), \
                "the refused update was applied"
    finally:
        opt._dc.close()  # its guard leaves the mode stack: later tests count the modes on it


def test_read_on_another_thread_after_the_update_was_applied_ahead_sees_it():
    # Every reduction finished: a's forward applies c's update too (Note [Lazy step]), so the read of
    # c.weight on another thread, later in the forward, is no stale read: plain SGD's result.
    model, ref, opt, ref_opt = _lazy_peek_net()
    for s in range(6):
        model.peek = ref.peek = "thread" if s >= 3 else None
        if s == 3:
            assert opt._dc.lazy.npending, "the step was not lazy: this test needs the lazy path"
            opt._dc.engine.wait_all(30.0)
        train_step(model, opt, s)
        train_step(ref, ref_opt, s)
        opt._dc.engine.wait_all(30.0)
    opt.synchronize()
    _check_same(model, ref)


def test_stale_read_on_another_thread_of_a_parameter_whose_module_does_not_run_is_refused_before_backward():
    model, _, opt, _ = _lazy_peek_net()
    for s in range(3):
        train_step(model, opt, s)
    assert opt._dc.lazy.npending
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a's forward never runs
        loss = pool.submit(lambda: torch.nn.functional.linear(torch.randn(5, 4), model.a.weight).sum()).result()
    try:
        with pytest.raises(dc.DCreditError, match=r"parameter 'a\.weight' was read .* before its update"):
            loss.backward()
    finally:
        opt._dc.close()


def _write_unseen(how, weight, value):
    """Write ``value`` into ``weight`` in place, past the read guard (Note [Unseen parameter writes])."""
    if how == "set_":  # bound without the __torch_function__ check: no mode sees it
        with torch.no_grad():
            weight.set_(value.clone())
    elif how == "compiled":  # traced by Dynamo (the guard passes it through); the graph's aten ops, mostly unseen
        def copy_in(w, v):
            with torch.no_grad():
                w.copy_(v)

        torch.compile(copy_in, backend="aot_eager", fullgraph=True)(weight, value)
    else:  # on another thread: the guard watches the training thread only
        def copy_in():
            with torch.no_grad():
                weight.copy_(value)

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(copy_in).result()


@pytest.mark.parametrize("how", ["set_", "compiled", "thread"])
def test_a_write_the_guard_cannot_see_is_refused_before_the_update_would_land_on_it(how):
    # A pending update applied after such a write would land on the written value, where synchronous training
    # writes over the updated one. Its version counter shows the write: the next apply refuses, naming
    # c.weight, before anything is applied (for the compiled write, the apply that an aten operation of the
    # compiled graph calls for, after the write; for the others, c's in the next forward).
    model, _, opt, _ = _peek_net_with_c_pending()
    try:
        i = opt._dc.names.index("c.weight")
        assert opt._dc.lazy.pending[i]
        value = torch.full(tuple(model.c.weight.shape), 0.25)  # not full_like: the guard takes that for a read
        with pytest.raises(dc.DCreditError, match=r"parameter 'c\.weight' was changed in place after step\(\)"):
            _write_unseen(how, model.c.weight, value)
            model(torch.randn(5, 4))
        assert opt._dc.lazy.pending[i], "the refused update was applied"
        if how != "compiled":
            with concurrent.futures.ThreadPoolExecutor(1) as pool:  # past the guard, which would apply and raise
                assert torch.equal(pool.submit(lambda: model.c.weight.detach().clone()).result(), value)
    finally:
        opt._dc.close()  # its guard leaves the mode stack (the update is refused again, and said)


def test_a_write_the_guard_cannot_see_of_a_parameter_whose_module_does_not_run_is_refused_before_backward():
    # a's forward never runs before this backward, so no apply looks at a.weight: the start of the backward
    # does, before this rank launches anything. (a's and c's reductions held unfinished, so that the read of
    # b.weight applies b's updates alone: Note [Lazy step].)
    model, _, opt, _ = _peek_net_with_c_pending()
    try:
        names = opt._dc.names
        i = names.index("a.weight")
        opt._dc.engine = _Unfinished(opt._dc.engine._engine, [i, names.index("c.weight")])
        assert opt._dc.lazy.pending[i]
        loss = torch.nn.functional.linear(torch.randn(5, 8), model.b.weight).sum()  # b's updates applied first
        assert not opt._dc.lazy.pending[names.index("b.weight")] and opt._dc.lazy.pending[i]
        _write_unseen("set_", model.a.weight, torch.zeros(tuple(model.a.weight.shape)))
        with pytest.raises(dc.DCreditError, match=r"parameter 'a\.weight' was changed in place after step\(\)"):
            loss.backward()
        assert opt._dc.lazy.pending[i]
    finally:
        opt._dc.close()


def test_a_write_the_guard_sees_lands_after_the_update():
    # The same writes made where the guard sees them (eager code, the training thread) apply the pending
    # update first: plain SGD's result, the lazy step kept.
    model, ref, opt, ref_opt = _peek_net_with_c_pending()
    for m in (model, ref):
        with torch.no_grad():
            m.c.weight.copy_(torch.full_like(m.c.weight, 0.25))
        m.b.weight.data = m.b.weight.data * 0.5
    for s in range(3, 5):
        train_step(model, opt, s)
        train_step(ref, ref_opt, s)
    opt.synchronize()
    _check_same(model, ref)


def test_read_guard_sits_under_the_scripts_own_modes_and_leaves_at_close():
    # A script that trains inside its own TorchFunctionMode (here torch.device's) leaves it at the end:
    # our guard, armed by a step() inside that block, must not be what it pops.
    from torch.overrides import _get_current_function_mode_stack as stack

    model, ref, opt, ref_opt = _lazy_peek_net()
    with torch.device("cpu"):
        for s in range(4):
            train_step(model, opt, s)
            train_step(ref, ref_opt, s)
        assert opt._dc.lazy.npending and opt._dc.lazy.guard.armed
        assert stack()[0] is opt._dc.lazy.guard and isinstance(stack()[-1], torch.utils._device.DeviceContext)
    assert opt._dc.lazy.guard in stack(), "the script's mode took the guard with it"
    assert not any(isinstance(m, torch.utils._device.DeviceContext) for m in stack()), "the script's mode stayed"
    model(torch.randn(5, 4))  # the forward applies every pending update: the guard disarms
    assert not opt._dc.lazy.npending and not opt._dc.lazy.guard.armed
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    opt._dc.close()
    assert opt._dc.lazy.guard not in stack()


def test_our_own_work_runs_with_the_read_guard_off_the_stack_and_puts_it_back_at_the_bottom():
    # Note [Guard cost]: while our bookkeeping or the wrapped step runs, the guard is not on the mode stack at
    # all (a mode on the stack costs every call a trip through Python), a script's mode above it stays where it
    # is, and afterwards the guard is back under it, armed as before. Where it was not on the stack, pausing
    # leaves it off.
    from torch.overrides import TorchFunctionMode
    from torch.overrides import _get_current_function_mode_stack as stack

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    model, ref, opt, ref_opt = _peek_net_with_c_pending()
    guard = opt._dc.lazy.guard
    assert stack()[0] is guard  # guards of other tests' optimizers, still holding updates, may sit above
    with Seen() as seen:
        with guard.paused():
            assert guard not in stack() and stack()[-1] is seen and not guard.armed
            torch.ones(3).add_(1)
        assert seen.calls == 2, "the script's own mode stopped seeing calls (ones, add_)"
        assert stack()[0] is guard and stack()[-1] is seen and guard.armed
    model(torch.randn(5, 4))
    assert not opt._dc.lazy.npending and guard not in stack()
    with guard.paused():
        assert guard not in stack()
    assert guard not in stack() and not guard.armed
    train_step(model, opt, 3)
    train_step(ref, ref_opt, 3)
    opt.synchronize()
    _check_same(model, ref)


def test_graphs_of_earlier_iterations_do_not_count_as_reads():
    # Kept-alive, freed and no-grad graphs around the lazy step: none is a stale
    # read, and training equals plain SGD. A loop that keeps the last loss alive
    # through the next forward, one that frees it right after step() (a
    # train-step function returning loss.item()), and a no-grad evaluation
    # between step() and the next forward.
    model, ref, opt, ref_opt = _lazy_peek_net()
    kept = []
    for s in range(6):
        g = torch.Generator().manual_seed(s)
        x = torch.randn(5, 4, generator=g)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            loss = m(x).pow(2).mean()
            loss.backward()
            o.step()
            if m is model:
                if s % 3 == 0:
                    kept.append(loss)  # the graph stays alive for good
                elif s % 3 == 1:
                    del loss  # freed before the next forward
                else:
                    with torch.no_grad():
                        model(x)  # an evaluation between step() and the next forward applies every update
    opt.synchronize()
    assert opt._dc.lazy.deferred, "no step was lazy: this test needs the lazy path"
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_replacing_parameter_data_after_step_applies_the_pending_update_first():
    # Rolling the weights back to a snapshot right after step() (vector_to_parameters assigns p.data): a
    # synchronous step would have applied the update before the assignment, so the guard applies it there,
    # and the snapshot is what training goes on from.
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    model, ref, opt, ref_opt = _lazy_peek_net()
    for s in range(3):
        train_step(model, opt, s)
        train_step(ref, ref_opt, s)
    snapshot = parameters_to_vector(ref.parameters()).detach().clone()
    for s in range(3, 5):
        train_step(model, opt, s)
        train_step(ref, ref_opt, s)
    assert opt._dc.lazy.npending, "the step was not lazy: this test needs the lazy path"
    vector_to_parameters(snapshot.clone(), model.parameters())
    vector_to_parameters(snapshot.clone(), ref.parameters())
    for s in range(5, 7):
        train_step(model, opt, s)
        train_step(ref, ref_opt, s)
    opt.synchronize()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


class SkipNet(nn.Module):
    """``c`` runs only when ``use_c``: skipped, its update from the last step() is still pending at backward."""

    def __init__(self):
        super().__init__()
        self.a, self.c = nn.Linear(4, 3), nn.Linear(3, 3)
        self.use_c = True

    def forward(self, x):
        h = self.a(x)
        return self.c(h) if self.use_c else h


def test_write_to_a_pending_parameter_between_backward_and_step_applies_its_update_first():
    # Manual weight decay between backward() and step(), on a parameter the forward skipped: its update from
    # the last step() is still pending then, and must land before the decay, as in synchronous training.
    # Plain SGD: a skipped parameter's zero gradient and the reference's None both leave it unchanged.
    torch.manual_seed(0)
    model = SkipNet()
    ref = copy.deepcopy(model)
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  config=dataclasses.replace(FIXED, lazy_step="on"))
    # c's reduction unfinished at a's forward: its update waits for c's own (Note [Lazy step]).
    opt._dc.engine = _Unfinished(opt._dc.engine, [opt._dc.names.index("c.weight")])
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    pending_at_decay = 0
    for s in range(7):
        for m, o in ((model, opt), (ref, ref_opt)):
            g = torch.Generator().manual_seed(s)
            o.zero_grad()
            m.use_c = not (s >= 3 and s % 2)
            m(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
            if m is model:
                pending_at_decay = max(pending_at_decay, sum(opt._dc.lazy.pending))
            with torch.no_grad():
                for p in m.parameters():
                    p.mul_(0.99)
            o.step()
    assert pending_at_decay, "no update was pending at the decay: this test needs the lazy path"
    opt.synchronize()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_pickling_parameters_right_after_step_saves_updated_values():
    import io

    model, ref, opt, ref_opt = _lazy_peek_net()
    for s in range(4):
        train_step(model, opt, s)
        train_step(ref, ref_opt, s)
    assert opt._dc.lazy.npending, "the step was not lazy: this test needs the lazy path"
    buffer = io.BytesIO()
    torch.save(list(model.parameters()), buffer)  # reads storages (untyped_storage()), not through an operation
    buffer.seek(0)
    for a, b in zip(torch.load(buffer), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_a_read_of_a_buffer_that_holds_several_parameters_applies_each_of_them():
    # Parameters laid out in one flat buffer (views of it), and an EMA of the whole buffer right after step():
    # the read touches every parameter in it, not only the first. The script keeps no tensor of its own over the
    # buffer (one would make every step eager: Note [Hidden writes]); it takes the buffer back from a parameter.
    torch.manual_seed(0)
    flat = torch.zeros(4 * 8 + 8 + 8 * 3 + 3)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            flat[offset:offset + p.numel()].copy_(p.reshape(-1))
            p.data = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
    del flat
    ref = copy.deepcopy(model)
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters(),
                                  config=dataclasses.replace(FIXED, lazy_step="on"))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for s in range(4):
        train_step(model, opt, s)
        train_step(ref, ref_opt, s)
    assert opt._dc.lazy.npending, "the step was not lazy: this test needs the lazy path"
    flat = torch.empty(0).set_(model[0].weight.untyped_storage())
    ema = flat.clone()  # one read of the whole buffer
    expected = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    assert torch.allclose(ema, expected, atol=1e-6)


def test_parameter_unused_on_every_rank_is_left_alone_by_a_stateful_optimizer():
    torch.manual_seed(0)
    model = SkipNet()
    ref = copy.deepcopy(model)
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters(), config=FIXED)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for s in range(5):
        for m, o in ((model, opt), (ref, ref_opt)):
            g = torch.Generator().manual_seed(s)
            o.zero_grad()
            m.use_c = s < 2  # c sits out from the third iteration on
            m(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
            o.step()
    opt.synchronize()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_our_own_gradient_bookkeeping_passes_the_read_guard_and_leaves_it_armed():
    # Note [Guard cost]: zero_grad() and the gradient hooks touch gradients and slots only; the guard lets
    # them through unexamined, and is armed again afterwards (else a later early read would go unseen).
    model, ref, opt, ref_opt = _peek_net_with_c_pending()
    guard = opt._dc.lazy.guard
    examined = []
    real = guard._addresses.pending_read_by

    def pending_read_by(args, kwargs):  # operations on tensors (the wrapped zero_grad's profiler marks take none)
        if any(isinstance(a, torch.Tensor) for a in (*args, *(kwargs or {}).values())):
            examined.append(1)
        return real(args, kwargs)

    guard._addresses.pending_read_by = pending_read_by
    opt.zero_grad()
    assert not examined and guard.armed
    with torch.no_grad():
        model.c.weight.mul_(1.0)  # an early write: examined, c's update applied first
    assert examined and not opt._dc.lazy.pending[opt._dc.names.index("c.weight")]
    for s in range(3, 5):
        train_step(model, opt, s)
        train_step(ref, ref_opt, s)
    opt.synchronize()
    _check_same(model, ref)


def test_profiling_calls_no_deprecated_torch_distributed_function():
    # The profiler's sweeps (the stage sweep: reduce-scatter and all-gather) run in every user's job: a
    # FutureWarning from torch.distributed there would be printed on every rank of every launch. DeAR's plans
    # decouple at any world size, so its profiling sweeps the stages here too.
    model, opt = model_and_opt()
    config = dc.Config(block_bytes=64, profile_iters=2, policy="dear")
    dopt = dc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), config=config)
    sweep = mock.patch.object(profiler, "measure_stage_ratios", wraps=profiler.measure_stage_ratios)
    with warnings.catch_warnings(record=True) as caught, sweep as stage_sweep:
        warnings.simplefilter("always")
        for s in range(4):  # profiles 2 iterations, sweeps, plans
            train_step(model, dopt, s)
        dopt.synchronize()
    assert stage_sweep.call_count == 1 and dopt.profile is not None, "the sweeps did not run"
    deprecated = [f"{w.category.__name__}: {w.message} ({w.filename})" for w in caught
                  if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert not deprecated, deprecated


def test_a_world_of_one_plans_all_reduce_blocks_without_the_stage_sweep():
    # Note [A world of one never decouples] (planner/search.py): one rank's D-Credit plan has no reduce-scatter
    # and all-gather pairs, so profiling skips their sweep; the plan is still the search's, and trains exactly.
    model, opt = model_and_opt()
    ref, ref_opt = model_and_opt()
    config = dc.Config(block_bytes=64, profile_iters=2, policy="dcredit")
    dopt = dc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), config=config)
    with mock.patch.object(profiler, "measure_stage_ratios", wraps=profiler.measure_stage_ratios) as stage_sweep:
        for s in range(5):  # profiles 2 iterations, plans, trains on the plan
            train_step(model, dopt, s)
            train_step(ref, ref_opt, s)
        dopt.synchronize()
    assert dopt.profile is not None and dopt.profile.world_size == 1, "no plan was made from a profile"
    assert stage_sweep.call_count == 0
    assert dopt.plan.policy == "dcredit" and dopt.plan.decoupled == ()
    _check_same(model, ref)
    dopt._dc.close()


@pytest.mark.parametrize("configured, measured, charged", [
    (20e-6, 5e-3, 5e-3),  # a collective dearer to the CPU than configured: what was measured
    (20e-6, 1e-6, 20e-6),  # cheaper: the configured floor
    (0.0, None, 0.0),  # planned for the link alone: nothing measured
])
def test_profiling_charges_each_collective_the_cpu_it_measured(configured, measured, charged):
    # Note [Measured host cost] (profiling/profiler.py): on the CPU, the larger of the configured host cost
    # and what one small all-reduce cost this process's CPU goes into the profile the plan is made from.
    model, opt = model_and_opt()
    config = dc.Config(block_bytes=64, profile_iters=2, policy="dcredit", collective_host_s=configured)
    dopt = dc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), config=config)
    with mock.patch.object(profiler, "measure_host_per_collective", return_value=measured) as sweep:
        for s in range(4):  # profiles 2 iterations, sweeps, plans
            train_step(model, dopt, s)
        dopt.synchronize()
    assert sweep.call_count == (0 if measured is None else 1)
    assert dopt.profile is not None and dopt.profile.host_s_per_collective == charged
    dopt._dc.close()


def test_the_wrapper_is_horovods_surface_over_one_field_of_its_own():
    # The returned object is an instance of a subclass of the user's optimizer class (isinstance checks, LR
    # schedulers); what it adds is Horovod's optimizer API, and one field, the core that does the work. `state`
    # stays the optimizer's own dict, behind a property that applies pending updates before handing it out.
    model, opt = model_and_opt()
    before = set(vars(opt))
    wrapped = dc.DistributedOptimizer(opt, named_parameters=model.named_parameters(), config=FIXED)
    assert isinstance(wrapped, torch.optim.SGD) and wrapped.param_groups is opt.param_groups
    assert set(vars(wrapped)) - before == {"_dc"}
    own = {name for name in type(wrapped).__dict__ if not name.startswith("__")}
    assert own == {"step", "synchronize", "set_backward_passes_per_step", "skip_synchronize", "zero_grad",
                   "state", "state_dict", "load_state_dict", "add_param_group", "plan", "replans", "profile",
                   "_step_supports_amp_scaling"}
    wrapped._dc.close()


def _penalised(model, x, *, through_p_grad: bool):
    """A loss with a penalty on its gradients' squared norm: through p.grad after backward(create_graph=True), or
    through torch.autograd.grad; the backward of the total runs here (the first form's second)."""
    loss = model(x).pow(2).mean()
    if through_p_grad:
        loss.backward(create_graph=True)
        penalty = sum(p.grad.pow(2).sum() for p in model.parameters())
    else:
        grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        penalty = sum(g.pow(2).sum() for g in grads)
        penalty = loss + penalty
    penalty.backward()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")  # torch's, for the refused form
def test_a_gradient_with_a_graph_is_refused_naming_the_parameter_and_the_way_that_works():
    # Note [Gradients with a graph]: after backward(create_graph=True), a penalty built from p.grad would be a
    # constant once p.grad is our averaged gradient. Refused at the first such gradient, before any is reduced;
    # the same penalty through torch.autograd.grad trains as plain torch does, with the same optimizer.
    model, inner = model_and_opt(momentum=0.9)
    ref, ref_opt = model_and_opt(momentum=0.9)
    opt = dc.DistributedOptimizer(inner, named_parameters=model.named_parameters(), config=FIXED)
    try:
        x = [torch.randn(5, 4, generator=torch.Generator().manual_seed(s)) for s in range(4)]
        opt.zero_grad()
        with pytest.raises(dc.DCreditError, match=r"parameter '\d\.(weight|bias)' carries an autograd graph"
                                                  r".*torch\.autograd\.grad\(loss, params, create_graph=True\)"):
            _penalised(model, x[0], through_p_grad=True)
        assert not any(opt._dc.backward.marked), "a gradient with a graph was handed to the scheduler"
        for s in range(4):
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                _penalised(m, x[s], through_p_grad=False)
                o.step()
        opt.synchronize()
        _check_same(model, ref)
    finally:
        opt._dc.close()


def test_a_step_of_the_object_that_was_wrapped_is_refused_while_gradients_are_reduced():
    """Note [The wrapped object's own step] in checks.py: the optimizer object the script built, stepped itself
    after a backward, would use this rank's own gradients: refused, nothing changed. With nothing being reduced
    (before any backward, as Horovod's broadcast_optimizer_state() steps it on zero gradients, or after
    synchronize()) it steps as plain torch does; the wrapper's own steps are never refused."""
    model, inner = model_and_opt(momentum=0.9)
    opt = dc.DistributedOptimizer(inner, named_parameters=model.named_parameters(), config=FIXED)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    inner.step()  # nothing being reduced: a local step on zero gradients makes the state
    assert len(inner.state) == len(list(model.parameters()))
    opt.zero_grad()
    for seed in range(2):
        train_step(model, opt, seed)
    opt.zero_grad()
    model(torch.randn(5, 4)).pow(2).mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(dc.DCreditError, match="step\\(\\) was called on the SGD that was wrapped") as raised:
        inner.step()
    assert "'0.weight'" in str(raised.value) and "dc.DistributedOptimizer returned" in str(raised.value)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.synchronize()
    with opt.skip_synchronize():
        inner.step()  # reduced and final: the wrapped object's own step is plain torch's
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.zero_grad()
    train_step(model, opt, 5)
    opt._dc.close()


def test_a_module_called_apart_after_ours_gives_the_parameters_with_a_gradient():
    """Note [Parameters outside the optimizer] in checks.py: a module where the forward begins that holds none of
    ours gives those of its parameters that have a gradient at step(), if it began after the first module holding
    ours: a head called apart from the body is found (named after its class); a model run before the body (an
    evaluation between step() and the forward), even with gradients, and a teacher without a gradient are not."""
    torch.manual_seed(0)
    body, head, teacher, before = nn.Linear(4, 6), nn.Linear(6, 3), nn.Linear(4, 3), nn.Linear(4, 3)
    before(torch.randn(2, 4)).sum().backward()  # gradients that stay: not from our backward
    opt = dc.DistributedOptimizer(torch.optim.SGD(body.parameters(), lr=0.1),
                                  named_parameters=body.named_parameters(), config=FIXED)
    for seed in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))
        before(x)
        opt.zero_grad()
        head.zero_grad()
        with torch.no_grad():
            target = teacher(x)
        (head(body(x)) - target).pow(2).mean().backward()
        opt.step()
    assert opt._dc.outside.found_names == ["Linear.weight", "Linear.bias"]
    assert all(p is q for p, q in zip(opt._dc.outside.found_params, head.parameters()))
    opt._dc.close()


def test_a_head_stepped_and_cleared_before_our_step_is_not_found():
    """Note [Parameters outside the optimizer]: the remedy the refusal names for a module trained on each rank's
    own gradient on purpose: called apart, its own optimizer steps and clears its gradients before ours steps, so
    it has no gradient at our step() and is neither found nor compared."""
    torch.manual_seed(0)
    body, head = nn.Linear(4, 6), nn.Linear(6, 3)
    opt = dc.DistributedOptimizer(torch.optim.SGD(body.parameters(), lr=0.1),
                                  named_parameters=body.named_parameters(), config=FIXED)
    head_opt = torch.optim.SGD(head.parameters(), lr=0.1)
    for seed in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))
        opt.zero_grad()
        head(body(x)).pow(2).mean().backward()
        head_opt.step()
        head_opt.zero_grad()
        opt.step()
    assert opt._dc.outside is not None and opt._dc.outside.found_names == []
    opt._dc.close()


def test_a_head_called_after_many_blocks_called_at_the_top_is_found():
    """Note [Parameters outside the optimizer]: a script that calls its blocks one by one at the top level (no
    module around them, more of them than a first few) and a head after them: every block is looked at, and the
    head, called apart after them with a gradient and in no optimizer of ours, is found."""
    torch.manual_seed(0)
    blocks, head = [nn.Linear(4, 4) for _ in range(12)], nn.Linear(4, 3)
    params = [(f"{k}.{n}", p) for k, b in enumerate(blocks) for n, p in b.named_parameters()]
    opt = dc.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1), named_parameters=params,
                                  config=FIXED)
    for seed in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))
        opt.zero_grad()
        head.zero_grad()
        for b in blocks:
            x = torch.tanh(b(x))
        head(x).pow(2).mean().backward()
        opt.step()
    assert opt._dc.outside.found_names == ["Linear.weight", "Linear.bias"]
    assert all(p is q for p, q in zip(opt._dc.outside.found_params, head.parameters()))
    opt._dc.close()


def test_the_warning_for_a_parameter_outside_the_optimizer_is_said_once_for_named_and_found_alike():
    """checks.Outside: once a named parameter was told, parameters found later do not start the watch again."""
    named, found = nn.Linear(2, 2), nn.Linear(2, 2)
    outside = checks.Outside(["n.weight"], [named.weight], lambda p: False)
    assert outside.changed_unreduced() is None  # the first step() takes the versions
    named.weight.grad = torch.ones_like(named.weight)
    with torch.no_grad():
        named.weight.add_(1.0)
    assert outside.changed_unreduced() == ("n.weight", True)
    assert not outside.watching
    outside.find([found], set(), named.weight.device)
    assert outside.found_names == ["weight", "bias"] and not outside.watching
