"""Note [Pickled hooks] in lazy.py, in a world of one: a model that carries our hooks pickles and
deep-copies at any step, the copy carries nothing that reaches the optimizer, and modules whose parameters
the optimizer does not own (a teacher) get nothing of ours."""

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import dcredit_opt as dc

pytestmark = pytest.mark.timeout(120)

LAZY = dc.Config(block_bytes=64, window=2, policy="fixed", lazy_step="on")


def net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def batch(s):
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(s))


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def plain_step(model, opt, s):
    opt.zero_grad()
    model(batch(s)).pow(2).mean().backward()
    opt.step()


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def our_hooks(module):
    """Our hooks (live or inert) on ``module`` alone, by kind."""
    def ours(h):
        return type(getattr(h, "hook", h)).__module__ == "dcredit_opt.optimizer.lazy"
    return {name: [h for h in getattr(module, name).values() if ours(h)]
            for name in ("_forward_pre_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks")}


def no_hooks_at_all(model):
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._state_dict_pre_hooks and not m._load_state_dict_pre_hooks, \
            f"{type(m).__name__} carries hooks"


def same(a, b, what):
    for (n, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(x, y, atol=1e-6), f"{what}: '{n}' differs"


class Both(nn.Module):
    """A parent of the wrapped student and an unwrapped teacher (distillation)."""

    def __init__(self):
        super().__init__()
        self.student, self.teacher = net(0), net(1)
        self.teacher.requires_grad_(False)

    def forward(self, x):
        return self.student(x), self.teacher(x)


def test_whole_model_saves_and_deep_copies_at_every_step():
    model, teacher = net(0), net(1)
    ref = copy.deepcopy(model)
    opt = dc.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(), config=LAZY)
    ref_opt = sgd(ref)
    lazy_saves = 0
    for s in range(6):
        opt.zero_grad()
        with torch.no_grad():
            target = teacher(batch(s))  # runs in the first iteration after step(), as the student's does
        (model(batch(s)) - target).pow(2).mean().backward()
        opt.step()
        ref_opt.zero_grad()
        (ref(batch(s)) - target).pow(2).mean().backward()
        ref_opt.step()
        lazy_saves += bool(opt._dc.lazy.npending)
        loaded = roundtrip(model)  # right after step(), updates pending from the second step on
        same(loaded, ref, f"step {s}, torch.load(torch.save(model))")
        copies = [loaded]
        if s > 0:  # at step 0 a deep copy is the first read of every parameter: the step would stay eager
            copies.append(copy.deepcopy(model))
            same(copies[-1], ref, f"step {s}, copy.deepcopy(model)")
        for m in (m for c in copies for m in c.modules()):
            for kind, hooks in our_hooks(m).items():
                assert all(type(getattr(h, "hook", h)).__name__.startswith("_Inert") for h in hooks), \
                    f"step {s}: a copy's {kind} reach the optimizer: {hooks}"
        no_hooks_at_all(teacher)
        pickle.dumps(teacher)
        roundtrip(teacher)
    assert lazy_saves >= 3, "no step was lazy: this test needs updates pending when the model is saved"
    assert any(any(our_hooks(m).values()) for m in model.modules()), "no hook was installed: nothing was tested"
    same(model, ref, "the live model")


def test_deep_copy_right_after_the_first_step():
    # The first iteration after step() learns where each parameter is first read: a deep copy there is
    # that read (outside any forward), so those updates are applied in step() from then on. Still right.
    model = net(0)
    ref = copy.deepcopy(model)
    opt, ref_opt = dc.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(), config=LAZY), sgd(ref)
    for s in range(3):
        plain_step(model, opt, s)
        plain_step(ref, ref_opt, s)
        same(copy.deepcopy(model), ref, f"step {s}, copy.deepcopy(model)")
        same(roundtrip(model), ref, f"step {s}, torch.load(torch.save(model))")


def test_copies_train_under_plain_torch_without_our_hooks_doing_anything():
    model = net(0)
    opt = dc.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(), config=LAZY)
    for s in range(3):
        plain_step(model, opt, s)
    assert opt._dc.lazy.npending, "the step was not lazy: this test needs updates pending"
    copies = {"torch.load": roundtrip(model), "copy.deepcopy": copy.deepcopy(model)}  # applies them (reads)
    plain_step(model, opt, 3)
    assert opt._dc.lazy.npending, "the step was not lazy: this test needs updates pending while the copies train"
    pending = list(opt._dc.lazy.pending)
    calls = []

    def spy(name):
        real = getattr(opt._dc, name)
        setattr(opt._dc, name, lambda *a: calls.append(name) or real(*a))

    spy("before_forward")
    spy("apply_pending")
    for how, c in copies.items():
        fresh = net(7)
        fresh.load_state_dict(c.state_dict())
        c_opt, fresh_opt = sgd(c), sgd(fresh)
        for s in range(3, 6):
            plain_step(c, c_opt, s)
            plain_step(fresh, fresh_opt, s)
        same(c, fresh, how)
        assert not any(m._forward_pre_hooks for m in c.modules()), f"{how}: an inert forward hook stayed"
        c.load_state_dict(fresh.state_dict())
        assert list(opt._dc.lazy.pending) == pending, f"{how}: the copy's forward or state_dict touched the optimizer"
        assert not calls, f"{how}: the copy's hooks called the optimizer: {calls}"
    model(batch(9))
    assert "before_forward" in calls and opt._dc.lazy.npending == 0, "the live model's hooks stopped working"


def test_unwrapped_modules_get_nothing_a_parent_of_ours_gets_the_state_dict_hooks():
    both = Both()
    opt = dc.DistributedOptimizer(sgd(both.student), named_parameters=both.student.named_parameters(), config=LAZY)
    for s in range(3):
        opt.zero_grad()
        out, target = both(batch(s))
        (out - target).pow(2).mean().backward()
        opt.step()
    assert opt._dc.lazy.npending, "the step was not lazy: this test needs updates pending"
    no_hooks_at_all(both.teacher)
    top = our_hooks(both)
    assert top["_state_dict_pre_hooks"] and top["_load_state_dict_pre_hooks"], \
        "the parent's state_dict covers our parameters: it must apply pending updates first"
    # The forward begins at the parent, which holds ours: its hook is the one step() wakes (Note [Resting hooks]).
    assert our_hooks(both)["_forward_pre_hooks"]
    saved = both.state_dict()
    assert opt._dc.lazy.npending == 0, "the parent's state_dict() did not apply what was pending"
    loaded = roundtrip(both)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, saved[k]), k
    pickle.dumps(both.teacher)


def test_rewrapping_a_loaded_model_does_not_pile_up_inert_hooks():
    model = net(0)
    opt = dc.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(), config=LAZY)
    for s in range(3):
        plain_step(model, opt, s)
    counts = {id(m): {k: len(v) for k, v in our_hooks(m).items()} for m in model.modules()}
    for cycle in range(2):
        model = roundtrip(model)
        opt = dc.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(), config=LAZY)
        for s in range(3):
            plain_step(model, opt, s)
        now = [{k: len(v) for k, v in our_hooks(m).items()} for m in model.modules()]
        assert now == list(counts.values()), f"cycle {cycle}: hooks per module {now}, first wrap {counts}"
        opt._dc.close()


def test_hooks_pickle_to_inert_ones():
    from dcredit_opt.optimizer import lazy

    class Core:
        calls = 0

        def apply_pending(self):
            Core.calls += 1

    class Opt:
        _dc = Core()

    o = Opt()
    keeper = lazy.Keeper(o)
    hook = lazy.weak_apply_hook(keeper)
    for c in (pickle.loads(pickle.dumps(hook)), copy.deepcopy(hook), copy.deepcopy([hook])[0]):
        assert isinstance(c, lazy._InertApplyHook)
        c(nn.Linear(1, 1), "", False)
    assert Core.calls == 0
    hook(nn.Linear(1, 1), "", False)
    assert Core.calls == 1
    assert isinstance(pickle.loads(pickle.dumps(lazy.weak_forward_hook(keeper))), lazy._InertForwardHook)
