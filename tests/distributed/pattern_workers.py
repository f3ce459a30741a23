"""What each rank runs in test_patterns.py: training patterns of real scripts, against a synchronous reference.

Issue C1, "no silent wrong result": every pattern either trains exactly like
synchronous data parallelism or raises ``DCreditError`` naming the parameter
and the fix, on every rank, without hanging.

The reference is the one of ``workers.py``: each rank regenerates every
rank's batch (seeded by step and rank), computes each rank's gradient on a
copy of the model, averages them by hand (a parameter no rank used gets a zero
gradient, as dcredit_opt and Horovod give it) and steps a plain optimizer.

Several patterns run in one launch (a launch costs seconds); each runs on a
fresh model and a fresh optimizer, closed at its end, and reports on its own:
an exception that escapes a pattern is caught and reported under its name
(``error``), and the next pattern goes on.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import io
import logging
import random
import time
import traceback
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import dcredit_opt as dc

from .workers import Net, batch, checksum

STEPS = 6



def fixed_config(**kw) -> dc.Config:
    """The plan of the brief: small blocks, so that every tensor spans blocks; the lazy step on from step 2;
    the ranks' weights compared every other iteration (Note [Same weights]), so that every pattern that
    trains like the reference shows the comparison raises nothing where nothing differs."""
    return dc.Config(**{"policy": "fixed", "block_bytes": 128, "window": 2, "channels": 2, "check_weights_every": 2,
                        **kw})


# ---- models ------------------------------------------------------------------------------


class ParamListNet(nn.Module):
    """P3a/P10: ``nn.ParameterList`` entries read by the parent's forward (the list's forward never runs)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.mid = nn.Linear(32, 61)
        self.out = nn.Linear(61, 7)
        self.scales = nn.ParameterList([nn.Parameter(torch.linspace(0.5, 1.5, 32)),
                                        nn.Parameter(torch.linspace(1.5, 0.5, 61))])

    def forward(self, x):
        h = torch.relu(self.inp(x)) * self.scales[0]
        h = torch.tanh(self.mid(h)) * self.scales[1]
        return self.out(h)


class FunctionalChildNet(nn.Module):
    """P3b: ``F.linear(h, self.mid.weight, self.mid.bias)`` in the parent; ``mid`` is never called."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.mid = nn.Linear(32, 61)
        self.out = nn.Linear(61, 7)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        h = torch.tanh(F.linear(h, self.mid.weight, self.mid.bias))
        return self.out(h)


class FunctionalBareNet(nn.Module):
    """P3c: bare parameters of the parent used functionally (``F.linear``)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.w = nn.Parameter(torch.randn(61, 32) * 0.15)
        self.b = nn.Parameter(torch.zeros(61))
        self.out = nn.Linear(61, 7)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        h = torch.tanh(F.linear(h, self.w, self.b))
        return self.out(h)


class BareParamNet(nn.Module):
    """Bare parameters of the parent, used elementwise: one before any child runs, one between children."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Parameter(torch.linspace(0.5, 1.5, 16))
        self.inp = nn.Linear(16, 32)
        self.mid = nn.Linear(32, 61)
        self.gain = nn.Parameter(torch.linspace(1.5, 0.5, 61))
        self.out = nn.Linear(61, 7)

    def forward(self, x):
        h = torch.relu(self.inp(x * self.pre))
        h = torch.tanh(self.mid(h)) * self.gain
        return self.out(h)


class TiedNet(nn.Module):
    """Input embedding and output head share one weight."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tok):
        h = self.emb(tok).mean(1)
        return self.head(torch.tanh(self.mid(h)))


class EmbedNet(nn.Module):
    """An input embedding (looked up by its own module) and an untied output head, GPT-style."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 12)
        self.mid = nn.Linear(12, 12)
        self.head = nn.Linear(12, 20)

    def forward(self, tok):
        return self.head(torch.tanh(self.mid(self.emb(tok).mean(1))))


class MaxNormNet(EmbedNet):
    """EmbedNet whose embedding renormalises the rows it looks up (``max_norm``), in place, in every forward."""

    def __init__(self):
        super().__init__()
        self.emb.max_norm = 1.0


class TwiceNet(nn.Module):
    """One module called twice in a forward."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.sq = nn.Linear(32, 32)
        self.out = nn.Linear(32, 7)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        h = torch.tanh(self.sq(h))
        h = torch.tanh(self.sq(h))
        return self.out(h)


class CkptNet(nn.Module):
    """A block run under activation checkpointing (recomputed in backward)."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(16, 32)
        self.block = nn.Sequential(nn.Linear(32, 61), nn.Tanh(), nn.Linear(61, 32))
        self.out = nn.Linear(32, 7)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.out(torch.tanh(h))


class SelectiveCkptNet(nn.Module):
    """A block of bias-free layers under selective activation checkpointing that saves matrix products
    (``aten.mm``) and recomputes the rest."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.block = nn.Sequential(nn.Linear(32, 61, bias=False), nn.Tanh(), nn.Linear(61, 32, bias=False))
        self.out = nn.Linear(32, 7)

    def forward(self, x):
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        def policy(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else \
                CheckpointPolicy.PREFER_RECOMPUTE

        h = torch.relu(self.inp(x))
        h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False,
                                              context_fn=lambda: create_selective_checkpoint_contexts(policy))
        return self.out(torch.tanh(h))


class StaleNet(nn.Module):
    """P3d/P3e: from step 5 on, ``a.weight`` is read by the parent before ``a`` runs (learned: in ``a``).

    ``mode`` says how: "sum" (``h + a.weight.sum()``, then ``a`` runs: the brief's case; autograd saves
    nothing of the early read), "saved" (``h + (a.weight ** 2).sum()``, then ``a`` runs: autograd saves the
    tensor), "functional" (``F.linear(h, a.weight, a.bias)`` instead of calling ``a``), "untracked"
    (``h + a.weight.detach().sum()``, then ``a`` runs: a read that autograd does not record); "thread" and
    "thread_untracked": "sum" and "untracked" computed on another thread, which the read guard (Note
    [Guarded reads]) does not watch.

    The forward first normalises its input (five operations before its first read of a parameter), so the
    forward's leader does not wait for the first update itself (Note [Resting hooks] in updates.py): the updates
    are still pending when the parent reads early, as in a model that computes a while before its first layer.
    ``at_once``: no normalisation, the first layer first; there the leader waits for its update and applies, with
    it, what has ended, so the early read finds ``a.weight`` updated (and training equals the reference, on any
    thread)."""

    def __init__(self, mode: str = "sum", at_once: bool = False):
        super().__init__()
        self.mode = mode
        self.at_once = at_once
        self.a = nn.Linear(16, 32)
        self.out = nn.Linear(32, 7)
        self.step = 0

    def forward(self, x):
        h = x if self.at_once else (x - x.mean()) / (x.std() + 1e-5)
        if self.step >= 5:
            if self.mode == "functional":
                return self.out(torch.relu(F.linear(h, self.a.weight, self.a.bias)))
            if self.mode == "sum":
                h = h + self.a.weight.sum()
            elif self.mode == "untracked":
                h = h + self.a.weight.detach().sum()
            elif self.mode in ("thread", "thread_untracked"):
                read = (lambda: self.a.weight.sum()) if self.mode == "thread" else lambda: self.a.weight.detach().sum()
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    h = h + pool.submit(read).result()
            else:
                h = h + (self.a.weight ** 2).sum() * 1e-2
        return self.out(torch.relu(self.a(h)))


class ClipSGD(torch.optim.Optimizer):
    """P6: a custom optimizer whose step looks at every parameter together (global gradient-norm clip)."""

    def __init__(self, params, lr: float = 0.05, max_norm: float = 0.05):
        super().__init__(params, {"lr": lr, "max_norm": max_norm})

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        total = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        for g in self.param_groups:
            coef = min(1.0, g["max_norm"] / (total + 1e-6))
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["lr"] * coef)


# ---- data, losses, the reference ------------------------------------------------------------


class Skew:
    """Rank 1 sleeps 0-20 ms at each call (seeded): rank 0 then meets blocks still on the wire."""

    def __init__(self, rank: int, seed: int = 0):
        self.rank = rank
        self.random = random.Random(1000 * seed + rank)

    def __call__(self) -> None:
        if self.rank == 1:
            time.sleep(self.random.uniform(0.0, 0.02))


def tokens(step: int, rank: int):
    g = torch.Generator().manual_seed(104729 * step + rank)
    return torch.randint(0, 20, (8, 5), generator=g), torch.randint(0, 20, (8,), generator=g)


def mse(model, step, rank):
    x, y = batch(step, rank)
    return F.mse_loss(model(x), y)


def tied_loss(model, step, rank):
    tok, tgt = tokens(step, rank)
    return F.cross_entropy(model(tok), tgt)


def reference_grads(ref: nn.Module, loss_of_rank, world: int) -> None:
    """Synchronous data parallelism by hand: each rank's gradient summed, divided by ``world``;
    a parameter no rank used keeps ``None``, and the optimizer skips it (as in one process, or DDP)."""
    for p in ref.parameters():
        p.grad = None
    for r in range(world):
        loss_of_rank(r).backward()
    finish_reference_grads(ref, world)


def finish_reference_grads(ref: nn.Module, world: int) -> None:
    for p in ref.parameters():
        if p.grad is not None:
            p.grad /= world


def keep_zeros_where_had(ref: nn.Module, had: set) -> None:
    """Plain torch's ``zero_grad(set_to_none=False)`` for a reference whose gradients were computed afresh (each
    ``p.grad`` set to None first): a parameter that had a gradient once (``had``, its index; filled here) holds
    zeros where this step gave it none, and the optimizer steps with them."""
    for i, p in enumerate(ref.parameters()):
        if p.grad is not None:
            had.add(i)
        elif i in had:
            p.grad = torch.zeros_like(p)


def state_diff(a: dict, b: dict) -> float:
    assert list(a) == list(b), (list(a), list(b))
    return max((float((x.float() - y.float()).abs().max()) for x, y in zip(a.values(), b.values())), default=0.0)


def param_diff(model: nn.Module, ref: nn.Module) -> float:
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))


class Job:
    """One pattern's rank, its model, the reference, and the optimizers it made (closed at the end)."""

    def __init__(self, backend: str):
        self.rank, self.world, self.backend = dc.rank(), dc.size(), backend
        self.opts: list = []

    def config(self, **kw) -> dc.Config:
        return fixed_config(backend=self.backend, **kw)

    def make(self, model_fn, opt_fn, config=None, seed: int = 0, **wrap):
        torch.manual_seed(seed)
        model = model_fn()
        ref = copy.deepcopy(model)
        opt = self.wrap(opt_fn(model.parameters()), model, config, **wrap)
        return model, ref, opt, opt_fn(ref.parameters())

    def wrap(self, torch_opt, model, config=None, **wrap):
        """``torch_opt`` wrapped, with ``model``'s ``named_parameters()``; ``model`` may instead be the (name,
        parameter) pairs to name, or None to name none (Horovod's call without ``named_parameters``)."""
        named = model.named_parameters() if isinstance(model, nn.Module) else model
        opt = dc.DistributedOptimizer(torch_opt, named_parameters=named, config=config or self.config(), **wrap)
        self.opts.append(opt)
        return opt

    def train(self, model, ref, opt, ropt, loss_fn=mse, steps: int = STEPS, after_step=None, scheds=(),
              set_to_none: bool = True, skew=None):
        """``skew``: a :class:`Skew` called after the backward and after ``step()``."""
        skew = skew or (lambda: None)
        for step in range(steps):
            opt.zero_grad(set_to_none=set_to_none)
            loss_fn(model, step, self.rank).backward()
            skew()
            self.step(opt)
            skew()
            reference_grads(ref, lambda r, step=step: loss_fn(ref, step, r), self.world)
            ropt.step()
            for s in scheds:
                s.step()
            if after_step is not None:
                after_step(step)

    def result(self, model, ref, opt, **extra) -> dict:
        """The worst difference from the reference, read through model.state_dict() (whose hooks must apply
        what is pending) and again from the parameters after closing; a checksum for the ranks to agree on."""
        out = {"diff": state_diff(model.state_dict(), ref.state_dict()), "backend": opt._dc.backend.name,
               "deferred": getattr(self, "deferred", 0), "eager": [opt._dc.names[i] for i in opt._dc.lazy.eager]}
        opt._dc.close()
        out["closed_diff"] = param_diff(model, ref)
        out["checksum"] = checksum(model)
        out.update(extra)
        return out

    def step(self, opt, *args, **kwargs):
        """``opt.step()``, noting how many updates it deferred (the lazy step was on if any)."""
        out = opt.step(*args, **kwargs)
        self.note(opt)
        return out

    def note(self, opt) -> None:
        self.deferred = max(getattr(self, "deferred", 0), int(opt._dc.lazy.npending))

    def close(self) -> None:
        for opt in self.opts:
            with contextlib.suppress(Exception):  # the pattern's own failure is what is reported
                opt._dc.close()


# ---- patterns that must train like the reference ------------------------------------------------


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-4)


def _adam(ps):
    return torch.optim.Adam(ps, lr=1e-2)


def _module_pattern(model_fn, opt_fn=_sgd, loss_fn=mse):
    def run(job: Job) -> dict:
        model, ref, opt, ropt = job.make(model_fn, opt_fn)
        job.train(model, ref, opt, ropt, loss_fn)
        return job.result(model, ref, opt)
    return run


def _clamp_grad(p) -> None:
    p.grad.clamp_(-0.01, 0.01)


def post_accumulate_hook_clamps_own_gradient(job: Job) -> dict:
    """A post-accumulate-grad hook registered after wrapping clamps ``p.grad`` in place. Autograd runs it before
    the accumulator's own post-hooks, ours (and DDP's reducer's) among them: it clamps this rank's gradient, and
    the update uses the average of the clamped gradients, as under DDP. The reference clamps each rank's own."""
    model, ref, opt, ropt = job.make(Net, _sgd)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(_clamp_grad)
    params = list(ref.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        mse(model, step, job.rank).backward()
        job.step(opt)
        grads = [torch.zeros_like(p) for p in params]
        for r in range(job.world):
            for g, own in zip(grads, torch.autograd.grad(mse(ref, step, r), params)):
                g += own.clamp(-0.01, 0.01) / job.world
        for p, g in zip(params, grads):
            p.grad = g
        ropt.step()
    return job.result(model, ref, opt)


def p4_functional_call_other_weights(job: Job) -> dict:
    model, ref, opt, ropt = job.make(Net, _sgd)
    other = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    x = batch(999, 0)[0]
    y_other = torch.func.functional_call(model, other, (x,))
    y_ref = torch.func.functional_call(ref, other, (x,))
    job.train(model, ref, opt, ropt)
    return job.result(model, ref, opt, functional_call_diff=float((y_other - y_ref).abs().max()))


def functional_call_own(job: Job) -> dict:
    model, ref, opt, ropt = job.make(Net, _sgd)

    def loss(m, step, rank):
        x, y = batch(step, rank)
        return F.mse_loss(torch.func.functional_call(m, dict(m.named_parameters()), (x,)), y)

    job.train(model, ref, opt, ropt, loss)
    return job.result(model, ref, opt)


def branch_skipped_everywhere(job: Job) -> dict:
    model, ref, opt, ropt = job.make(lambda: Net(branch=True), _adam)
    before = model.branch.weight.detach().clone()
    job.train(model, ref, opt, ropt)  # Net's forward skips the branch unless asked
    out = job.result(model, ref, opt)
    out["branch_unchanged"] = bool(torch.equal(before, model.branch.weight))
    return out


def eval_after_step(job: Job) -> dict:
    model, ref, opt, ropt = job.make(Net, _sgd)
    worst = [0.0]

    def evaluate(step):
        probe = batch(10_000 + step, 0)[0]
        with torch.no_grad():
            worst[0] = max(worst[0], float((model(probe) - ref(probe)).abs().max()))

    # The reference has stepped when after_step runs; the model's last update may still be pending.
    job.train(model, ref, opt, ropt, after_step=evaluate)
    return job.result(model, ref, opt, eval_diff=worst[0])


def _scheduled(make_sched):
    def run(job: Job) -> dict:
        model, ref, opt, ropt = job.make(Net, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
        s, rs = make_sched(opt), make_sched(ropt)
        lrs = []
        job.train(model, ref, opt, ropt, scheds=(s, rs), after_step=lambda step: lrs.append(
            (float(opt.param_groups[0]["lr"]), float(ropt.param_groups[0]["lr"]))))
        return job.result(model, ref, opt, lr_diff=max(abs(a - b) for a, b in lrs),
                          lr_changed=len({a for a, _ in lrs}) > 1)
    return run


def p5_tensor_lr_steplr(job: Job) -> dict:
    def adam(ps):
        return torch.optim.Adam(ps, lr=torch.tensor(0.01))

    model, ref, opt, ropt = job.make(Net, adam)
    s = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    rs = torch.optim.lr_scheduler.StepLR(ropt, step_size=2, gamma=0.5)
    lrs = []
    job.train(model, ref, opt, ropt, scheds=(s, rs),
              after_step=lambda step: lrs.append(float(opt.param_groups[0]["lr"])))
    return job.result(model, ref, opt, lr_is_tensor=isinstance(opt.param_groups[0]["lr"], torch.Tensor),
                      lr_changed=len(set(lrs)) > 1)


def backward_passes_2(job: Job) -> dict:
    model, ref, opt, ropt = job.make(Net, _sgd, backward_passes_per_step=2)
    for step in range(STEPS):
        opt.zero_grad()
        for k in range(2):
            mse(model, 2 * step + k, job.rank).backward()
        job.step(opt)
        for p in ref.parameters():
            p.grad = None
        for r in range(job.world):
            for k in range(2):
                mse(ref, 2 * step + k, r).backward()
        finish_reference_grads(ref, job.world)
        ropt.step()
    return job.result(model, ref, opt)


def zero_grad_variants(job: Job) -> dict:
    """optimizer.zero_grad() (None), optimizer.zero_grad(set_to_none=False) and model.zero_grad(), in turn,
    each just before the forward."""
    model, ref, opt, ropt = job.make(Net, _sgd)
    for step in range(STEPS):
        kind = step % 3
        if kind == 0:
            opt.zero_grad()
        elif kind == 1:
            opt.zero_grad(set_to_none=False)
        else:
            model.zero_grad()
        mse(model, step, job.rank).backward()
        job.step(opt)
        reference_grads(ref, lambda r, step=step: mse(ref, step, r), job.world)
        ropt.step()
    return job.result(model, ref, opt)


def bf16_autocast(job: Job) -> dict:
    def loss(m, step, rank):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return mse(m, step, rank)

    model, ref, opt, ropt = job.make(Net, _sgd)
    job.train(model, ref, opt, ropt, loss)
    return job.result(model, ref, opt, tol=5e-3)


def adafactor_bf16_autocast(job: Job) -> dict:
    """The forward under bf16 autocast, Adafactor (whose update of a matrix multiplies its row and column
    variances): a deferred update is applied inside the next forward's autocast region, but must be computed
    as step() computes it, in full precision."""
    def loss(m, step, rank):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return mse(m, step, rank)

    model, ref, opt, ropt = job.make(Net, lambda ps: torch.optim.Adafactor(ps, lr=1e-2))
    job.train(model, ref, opt, ropt, loss, skew=Skew(job.rank))
    return job.result(model, ref, opt, optimizer_state_diff=optimizer_state_diff(opt, ropt))


def selective_checkpoint_adafactor(job: Job) -> dict:
    """Adafactor (its update multiplies matrices: ``aten.mm``) with a block under selective activation
    checkpointing that caches ``aten.mm`` outputs: the block's deferred updates are applied inside the
    checkpointed forward, but the checkpoint's cache must hold only the forward's products."""
    model, ref, opt, ropt = job.make(SelectiveCkptNet, lambda ps: torch.optim.Adafactor(ps, lr=1e-2))
    job.train(model, ref, opt, ropt, skew=Skew(job.rank))
    return job.result(model, ref, opt, optimizer_state_diff=optimizer_state_diff(opt, ropt))


def inference_mode_eval_first_update(job: Job) -> dict:
    """An evaluation under ``torch.inference_mode()`` right after steps 1 and 3, reading the branch first; the
    branch is trained from step 1 on, so its first update (which makes its Adam state) is applied inside that
    evaluation. The state must be made as in step(), not as inference tensors, which the next update outside
    inference mode (step 2's, in the training forward) could not change."""
    model, ref, opt, ropt = job.make(lambda: Net(branch=True), _adam)
    worst = [0.0]

    def loss(m, step, rank):
        x, y = batch(step, rank)
        return F.mse_loss(m(x, use_branch=step >= 1), y)

    def evaluate(step):
        if step in (1, 3):
            probe = batch(10_000 + step, 0)[0]
            with torch.inference_mode():
                worst[0] = max(worst[0], float((model(probe, use_branch=True) - ref(probe, use_branch=True))
                                               .abs().max()))

    job.train(model, ref, opt, ropt, loss, after_step=evaluate, skew=Skew(job.rank))
    return job.result(model, ref, opt, eval_diff=worst[0], optimizer_state_diff=optimizer_state_diff(opt, ropt))


def save_after_step(job: Job) -> dict:
    model, ref, opt, ropt = job.make(Net, _adam)
    worst = [0.0]

    def save(step):
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
        buf.seek(0)
        worst[0] = max(worst[0], state_diff(torch.load(buf), ref.state_dict()))

    job.train(model, ref, opt, ropt, after_step=save)
    return job.result(model, ref, opt, save_diff=worst[0])


def horovod_amp_recipe(job: Job) -> dict:
    if not hasattr(torch.amp, "GradScaler"):
        return {"skip": "torch.amp.GradScaler does not exist in this torch"}
    try:
        torch.amp.GradScaler("cpu")
    except Exception as e:  # noqa: BLE001
        return {"skip": f"torch.amp.GradScaler('cpu') cannot be made: {e}"}
    model, ref, opt, ropt = job.make(Net, _sgd)
    scaler, rscaler = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(mse(model, step, job.rank)).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            scaler.step(opt)
            job.note(opt)
        scaler.update()
        for p in ref.parameters():
            p.grad = None
        for r in range(job.world):
            rscaler.scale(mse(ref, step, r)).backward()
        finish_reference_grads(ref, job.world)
        rscaler.unscale_(ropt)
        nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        rscaler.step(ropt)
        rscaler.update()
    return job.result(model, ref, opt, scale_diff=abs(scaler.get_scale() - rscaler.get_scale()))


def grad_scaler_with_inf(job: Job, clip: bool = False) -> dict:
    """P13': scaler.scale(loss).backward(); scaler.step(opt); scaler.update(), no synchronize; at step 3
    rank 0's loss is multiplied by inf, so only rank 0's local gradient is Inf: every rank must skip it.
    ``clip``: P13, torch's recipe for clipping under AMP (scaler.unscale_(opt), clip_grad_norm_, then
    scaler.step(opt)), with a branch that rank 1 alone takes, at odd steps: rank 0 has no gradient of it when its
    scaler lists them (Note [A scaler's unscale_])."""
    model, ref, opt, ropt = job.make(lambda: Net(branch=clip), _sgd)
    scaler, rscaler = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")

    def loss(m, step, rank):
        x, y = batch(step, rank)
        value = F.mse_loss(m(x, use_branch=step % 2 == 1 and rank == 1), y)
        return value * float("inf") if (step == 3 and rank == 0) else value

    def unscaled_and_clipped(s, o, m):
        if clip:
            s.unscale_(o)
            nn.utils.clip_grad_norm_(m.parameters(), 0.5)

    scales, rscales = [], []
    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(loss(model, step, job.rank)).backward()
        unscaled_and_clipped(scaler, opt, model)
        scaler.step(opt)
        job.note(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        for p in ref.parameters():
            p.grad = None
        for r in range(job.world):
            rscaler.scale(loss(ref, step, r)).backward()
        finish_reference_grads(ref, job.world)
        unscaled_and_clipped(rscaler, ropt, ref)
        rscaler.step(ropt)
        rscaler.update()
        rscales.append(rscaler.get_scale())
    return job.result(model, ref, opt, scales=scales, ref_scales=rscales,
                      scale_diff=max(abs(a - b) for a, b in zip(scales, rscales)),
                      inf_step_skipped=rscales[3] < rscales[2])


def ema_after_step(job: Job) -> dict:
    model, ref, opt, ropt = job.make(Net, _sgd)
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    rema = {n: p.detach().clone() for n, p in ref.named_parameters()}

    def update(step):
        with torch.no_grad():
            for n, p in model.named_parameters():
                ema[n].mul_(0.9).add_(p, alpha=0.1)
            for n, p in ref.named_parameters():
                rema[n].mul_(0.9).add_(p, alpha=0.1)

    job.train(model, ref, opt, ropt, after_step=update)
    return job.result(model, ref, opt, ema_diff=state_diff(ema, rema))


# ---- weights written, read or reloaded between step() and the next forward; other scripts' patterns ---------
# From the second step() on, after the first iteration learned where each weight is first read (Note [First
# read]): the update of every weight still waits then, and the read guard (Note [Guarded reads]) must apply it
# before the write or the read. Rank 1 sleeps at random, so that blocks are still on the wire.


def _after_step(change, model_fn=Net, opt_fn=_sgd):
    """``change(m, o, step, log)`` after every ``step()`` but the first, to the model (with its wrapped
    optimizer) and to the reference (with its own); what each logs is compared (``log_diff``)."""
    def run(job: Job) -> dict:
        model, ref, opt, ropt = job.make(model_fn, opt_fn)
        logs = {id(model): [], id(ref): []}

        def after_step(step):
            if step:  # the first step() is followed by the iteration that learns the reads
                for m, o in ((model, opt), (ref, ropt)):
                    change(m, o, step, logs[id(m)])

        job.train(model, ref, opt, ropt, after_step=after_step, skew=Skew(job.rank))
        extra = {"optimizer_state_diff": optimizer_state_diff(opt, ropt)}
        if logs[id(model)]:
            extra["log_diff"] = max(abs(a - b) for a, b in zip(logs[id(model)], logs[id(ref)]))
        return job.result(model, ref, opt, **extra)
    return run


def optimizer_state_diff(opt, ropt) -> float:
    """The worst difference between two optimizers' per-parameter state tensors (momentum, Adam's moments)."""
    state, rstate = opt.state_dict()["state"], ropt.state_dict()["state"]
    assert list(state) == list(rstate), (list(state), list(rstate))
    return max((float((state[k][key].float() - v.float()).abs().max()) for k in rstate
                for key, v in rstate[k].items() if isinstance(v, torch.Tensor)), default=0.0)


def _write_weights(m, o, step, log):
    """One write per step, in turn: a WGAN weight clip, ``.data`` scaled, ``copy_``, ``vector_to_parameters``
    (which replaces each ``.data``: the weights move in memory), a norm divided out by hand."""
    ps = list(m.parameters())
    with torch.no_grad():
        kind = step % 5
        if kind == 0:
            for p in ps:
                p.clamp_(-0.1, 0.1)
        elif kind == 1:
            for p in ps:
                p.data.mul_(0.9)
        elif kind == 2:
            for p in ps:
                p.copy_(p * 0.9 + 1e-3)
        elif kind == 3:
            nn.utils.vector_to_parameters(nn.utils.parameters_to_vector(ps) * 0.95, ps)
        else:
            m.mid.weight.div_(m.mid.weight.norm())


class TempNet(Net):
    """``Net`` with a one-element parameter (a learned temperature), read with ``.item()``."""

    def __init__(self):
        super().__init__()
        self.temp = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        return super().forward(x) * self.temp


def _read_weights(m, o, step, log):
    """Reads that bypass the module, logged: ``.data``, ``.numpy()``, ``.tolist()``, ``.item()``, and
    ``parameters_to_vector`` under ``no_grad``."""
    log.append(m.mid.weight.data.sum().item())
    log.append(float(m.out.weight.detach().numpy().sum()))
    log.append(sum(m.inp.bias.tolist()))
    log.append(m.temp.item())
    with torch.no_grad():
        log.append(float(nn.utils.parameters_to_vector(m.parameters()).sum()))


def _evaluate_submodule(m, o, step, log):
    """``out`` (the last layer the forward reads) evaluated alone, in eval mode under no_grad."""
    m.eval()
    with torch.no_grad():
        log.append(float(m.out(torch.linspace(-1, 1, 2 * 61).view(2, 61)).sum()))
    m.train()


def _move_to_own_device(m, o, step, log):
    """``model.to(device)`` and ``model.float()`` to the device and dtype the model has: no-ops in torch."""
    m.to(next(m.parameters()).device)
    m.float()


def _read_optimizer_state(m, o, step, log):
    """Adam's state read through ``opt.state`` (its moments and step count logged, as when monitoring it)."""
    for p in m.parameters():
        log.append(float(o.state[p]["exp_avg_sq"].sum()))
        log.append(float(o.state[p]["step"]))


def _reset_optimizer_state(m, o, step, log):
    """The momentum buffers zeroed in place through ``opt.state`` after step 2, and the state cleared after
    step 4 (a restart of the optimizer's memory)."""
    if step == 2:
        for p in m.parameters():
            o.state[p]["momentum_buffer"].zero_()
    elif step == 4:
        o.state.clear()


def _resume(model_too: bool):
    """At step 3, the checkpoint of step 1 is loaded: the optimizer's state, and the model's with it."""
    saved = {}

    def change(m, o, step, log):
        if step == 1:
            saved[id(m)] = copy.deepcopy((m.state_dict(), o.state_dict()))
        elif step == 3:
            sd, osd = saved[id(m)]
            if model_too:
                m.load_state_dict(sd)
            o.load_state_dict(osd)
    return change


def _freeze_mid(m, o, step, log):
    """``mid`` frozen after step 2's step() and unfrozen after step 4's: its gradient is None meanwhile."""
    if step in (2, 4):
        m.mid.requires_grad_(step == 4)


def wrapped_optimizer_checkpointed_after_step(job: Job) -> dict:
    """The optimizer object the script built and wrapped, kept under its own name: its ``state_dict()`` saved
    after every step() from the second on (Adam: the moments and the step count), and at step 3 its
    ``load_state_dict()`` of step 1's checkpoint."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    inner, ropt = _adam(model.parameters()), _adam(ref.parameters())
    opt = job.wrap(inner, model)
    worst, saved = [0.0], {}

    def save(step):
        if step:
            worst[0] = max(worst[0], _saved_state_diff(inner.state_dict(), ropt.state_dict()))
        if step == 1:
            saved.update(mine=copy.deepcopy(inner.state_dict()), reference=copy.deepcopy(ropt.state_dict()))
        elif step == 3:
            inner.load_state_dict(saved["mine"])
            ropt.load_state_dict(saved["reference"])

    job.train(model, ref, opt, ropt, after_step=save, skew=Skew(job.rank))
    return job.result(model, ref, opt, saved_diff=worst[0], optimizer_state_diff=optimizer_state_diff(opt, ropt))


def scheduler_before_wrapping_resumed(job: Job) -> dict:
    """A StepLR built on the optimizer before it is wrapped, and the wrapper's ``load_state_dict()`` of step 1's
    checkpoint at step 3: the schedule must go on reaching the optimizer that steps."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    scheds = (torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.7),
              torch.optim.lr_scheduler.StepLR(ropt, step_size=1, gamma=0.7))
    opt = job.wrap(inner, model)
    saved, lrs = {}, []

    def resume(step):
        lrs.append((opt.param_groups[0]["lr"], ropt.param_groups[0]["lr"]))
        if step == 1:
            saved.update(mine=copy.deepcopy(opt.state_dict()), reference=copy.deepcopy(ropt.state_dict()))
        elif step == 3:
            opt.load_state_dict(saved["mine"])
            ropt.load_state_dict(saved["reference"])

    with warnings.catch_warnings():  # the scheduler sees inner.step() uncalled: the wrapper's step() is called
        warnings.simplefilter("ignore", UserWarning)
        job.train(model, ref, opt, ropt, after_step=resume, scheds=scheds, skew=Skew(job.rank))
    return job.result(model, ref, opt, lr_diff=max(abs(a - b) for a, b in lrs),
                      optimizer_state_diff=optimizer_state_diff(opt, ropt))


def _saved_state_diff(sd, rsd) -> float:
    return max(float((sd["state"][k][key].float() - v.float()).abs().max()) for k in rsd["state"]
               for key, v in rsd["state"][k].items())


def swa_after_step(job: Job) -> dict:
    """``AveragedModel.update_parameters(model)`` after every step() from the third on."""
    from torch.optim.swa_utils import AveragedModel

    model, ref, opt, ropt = job.make(Net, _sgd)
    averaged = {}

    def update(step):
        if step >= 2:
            for m in (model, ref):
                averaged.setdefault(id(m), AveragedModel(m)).update_parameters(m)

    job.train(model, ref, opt, ropt, after_step=update, skew=Skew(job.rank))
    return job.result(model, ref, opt, average_diff=param_diff(averaged[id(model)], averaged[id(ref)]))


def step_with_closure(job: Job) -> dict:
    """``opt.step(closure)``, the closure doing zero_grad, forward and backward (the LBFGS-style loop)."""
    model, ref, opt, ropt = job.make(Net, _adam)
    skew = Skew(job.rank)
    for step in range(STEPS):
        def closure(step=step):
            opt.zero_grad()
            loss = mse(model, step, job.rank)
            loss.backward()
            skew()
            return loss

        job.step(opt, closure)

        def reference_closure(step=step):
            reference_grads(ref, lambda r: mse(ref, step, r), job.world)

        ropt.step(reference_closure)
    return job.result(model, ref, opt, optimizer_state_diff=optimizer_state_diff(opt, ropt))


class MaskedBiasNet(Net):
    """``Net`` whose ``mid.bias`` is multiplied by ``gate``: a gradient of exactly zero where it is 0."""

    def forward(self, x, gate: float = 1.0):
        h = F.linear(torch.relu(self.inp(x)), self.mid.weight, self.mid.bias * gate)
        return self.out(self.norm(torch.relu(h)))


def zero_gradient_on_one_rank(job: Job) -> dict:
    """``mid.bias`` gets a gradient of exactly zero on rank 1 on even steps (it is still used there: the
    average is half rank 0's gradient, as in synchronous training)."""
    def loss(m, step, rank):
        x, y = batch(step, rank)
        return F.mse_loss(m(x, gate=0.0 if rank == 1 and step % 2 == 0 else 1.0), y)

    model, ref, opt, ropt = job.make(MaskedBiasNet, _sgd)
    job.train(model, ref, opt, ropt, loss, skew=Skew(job.rank))
    return job.result(model, ref, opt, optimizer_state_diff=optimizer_state_diff(opt, ropt))


def _parametrized(kind: str):
    """``Net`` with ``mid``'s weight behind a parametrization (``torch.nn.utils.parametrize``) or an older
    weight hook (``spectral_norm``, ``weight_norm``): the parameters the optimizer sees are read in a
    parametrization module's forward or in ``mid``'s own forward pre-hook."""
    def make():
        net = Net()
        utils = nn.utils
        {"orthogonal": utils.parametrizations.orthogonal, "weight_norm": utils.parametrizations.weight_norm,
         "spectral_norm": utils.parametrizations.spectral_norm, "spectral_norm_hook": utils.spectral_norm,
         "weight_norm_hook": utils.weight_norm}[kind](net.mid)
        return net
    return make


def replicated(model_fn, opt_fn=_sgd):
    """For models whose forward changes their own state (spectral norm's power iteration updates ``u`` and
    ``v`` at every training forward): the reference is one replica per rank, each running its rank's forward
    once per step, their gradients averaged by hand; this rank is compared with its own replica."""
    def run(job: Job) -> dict:
        def build():
            torch.manual_seed(0)
            return model_fn()

        model, replicas = build(), [build() for _ in range(job.world)]
        opt = job.wrap(opt_fn(model.parameters()), model)
        ropts = [opt_fn(r.parameters()) for r in replicas]
        skew = Skew(job.rank)
        for step in range(STEPS):
            opt.zero_grad()
            mse(model, step, job.rank).backward()
            skew()
            job.step(opt)
            skew()
            for r, replica in enumerate(replicas):
                replica.zero_grad()
                mse(replica, step, r).backward()
            for ps in zip(*(r.parameters() for r in replicas)):
                mean = sum(p.grad for p in ps) / job.world
                for p in ps:
                    p.grad = mean.clone()
            for o in ropts:
                o.step()
        ref, ropt = replicas[job.rank], ropts[job.rank]
        return job.result(model, ref, opt, optimizer_state_diff=optimizer_state_diff(opt, ropt))
    return run


def _gan_models():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16)), \
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def _gan_losses(step: int, rank: int):
    """The discriminator's and the generator's loss of ``rank``'s batch at ``step``, as functions of (G, D)."""
    real = batch(step, rank)[0]
    z = torch.randn(8, 8, generator=torch.Generator().manual_seed(7919 * step + rank))
    ones, zeros = torch.ones(8, 1), torch.zeros(8, 1)

    def d_loss(g, d):
        return F.binary_cross_entropy_with_logits(d(real), ones) + \
            F.binary_cross_entropy_with_logits(d(g(z).detach()), zeros)

    def g_loss(g, d):
        return F.binary_cross_entropy_with_logits(d(g(z)), ones)

    return d_loss, g_loss


def gan(kind: str):
    """A GAN: the discriminator's step on real and ``G(z).detach()``, then the generator's step through the
    discriminator, each model with its own optimizer. The discriminator's parameters stay out of the
    generator's backward: "pix2pix" sets ``requires_grad=False`` on them meanwhile (pytorch-CycleGAN-and-pix2pix's
    ``set_requires_grad``), "inputs" passes ``backward(inputs=...)``; "dcgan" does neither (PyTorch's DCGAN
    example), so the generator's backward gives them a gradient that no step() of theirs reduces: refused,
    naming the parameter and the fix."""
    def run(job: Job) -> dict:
        (g, d), (rg, rd) = _gan_models(), _gan_models()

        def adam(ps):
            return torch.optim.Adam(ps, lr=1e-2, betas=(0.5, 0.999))

        og, od = job.wrap(adam(g.parameters()), g), job.wrap(adam(d.parameters()), d)
        rog, rod = adam(rg.parameters()), adam(rd.parameters())
        skew = Skew(job.rank)

        def body(step, where):
            d_loss, g_loss = _gan_losses(step, job.rank)
            d.requires_grad_(True)
            where[0] = f"the discriminator's zero_grad() of step {step}"
            od.zero_grad()
            where[0] = f"the discriminator's backward of step {step}"
            d_loss(g, d).backward()
            skew()
            job.step(od)
            d.requires_grad_(kind != "pix2pix")
            og.zero_grad()
            where[0] = f"the generator's backward of step {step}"
            g_loss(g, d).backward(inputs=list(g.parameters()) if kind == "inputs" else None)
            skew()
            job.step(og)
            for model, ropt, which in ((rd, rod, 0), (rg, rog, 1)):
                reference_grads(model, lambda r, which=which: _gan_losses(step, r)[which](rg, rd), job.world)
                ropt.step()

        if kind == "dcgan":
            return _expect_error(job, d, rd, od, rod, body, loss_fn=None)
        for step in range(STEPS):
            body(step, ["?"])
        discriminator = {"discriminator_diff": state_diff(d.state_dict(), rd.state_dict()),
                         "optimizer_state_diff": max(optimizer_state_diff(og, rog), optimizer_state_diff(od, rod))}
        out = job.result(g, rg, og, **discriminator)
        od._dc.close()
        out["closed_discriminator_diff"] = param_diff(d, rd)
        return out
    return run


class TwoHeadNet(nn.Module):
    """A shared body and one head per task; each batch is one task's."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.a = nn.Linear(32, 7)
        self.b = nn.Linear(32, 7)

    def forward(self, x, task: str):
        return getattr(self, task)(torch.relu(self.body(x)))


def heads_per_rank_one_optimizer(job: Job) -> dict:
    """One optimizer over the whole model, a parameter group per part (or an optimizer per part:
    ``optimizer_per_head``); rank 0's batches are task a's, rank 1's task b's, so each head is used on one rank only."""
    def grouped(ps):
        ps = list(ps)
        return torch.optim.SGD([{"params": ps[:2]}, {"params": ps[2:4], "lr": 0.1}, {"params": ps[4:]}],
                               lr=0.05, momentum=0.9)

    def loss(m, step, rank):
        x, y = batch(step, rank)
        return F.mse_loss(m(x, "ab"[rank % 2]), y)

    model, ref, opt, ropt = job.make(TwoHeadNet, grouped)
    job.train(model, ref, opt, ropt, loss, skew=Skew(job.rank))
    return job.result(model, ref, opt, optimizer_state_diff=optimizer_state_diff(opt, ropt))


def optimizer_per_head(by_rank: bool, set_to_none: bool = True):
    """An optimizer per part (body, head a, head b), every step() called each iteration (Note [No gradient
    here] in core.py). ``by_rank``: at each step the ranks' batches are of different tasks (rank 0 a, b, a...,
    rank 1 b, a, b...), so each head's optimizer has a gradient on one rank only and the other joins with none:
    the head gets the average (half the one rank's gradient), as under DDP and Horovod; a rank's head updates
    then wait, pending, through a forward that does not read them. Otherwise the task alternates by step, the same on every rank:
    the unused head's optimizer has no gradient anywhere, and its parameters stay as they are. With
    ``set_to_none=False`` the unused head keeps zeros in its gradients instead of ``None``: the rank joins the
    same way (not the local step on zero gradients that ``hvd.broadcast_optimizer_state`` takes)."""
    def run(job: Job) -> dict:
        torch.manual_seed(0)
        model = TwoHeadNet()
        ref = copy.deepcopy(model)
        parts = ("body", "a", "b")
        opts = {k: dc.DistributedOptimizer(
            _sgd(getattr(model, k).parameters()), config=job.config(),
            named_parameters=[(n, p) for n, p in model.named_parameters() if n.startswith(f"{k}.")]) for k in parts}
        job.opts.extend(opts.values())
        ropts = {k: _sgd(getattr(ref, k).parameters()) for k in parts}

        def task(step, rank):
            return "ab"[(rank + step) % 2] if by_rank else "ab"[step % 2]

        def loss(m, step, rank):
            x, y = batch(step, rank)
            return F.mse_loss(m(x, task(step, rank)), y)

        skew = Skew(job.rank)
        for step in range(STEPS):
            for opt in opts.values():
                opt.zero_grad(set_to_none=set_to_none)
            loss(model, step, job.rank).backward()
            skew()
            for opt in opts.values():
                job.step(opt)
            reference_grads(ref, lambda r, step=step: loss(ref, step, r), job.world)
            for ropt in ropts.values():
                ropt.step()
        out = job.result(model, ref, opts["body"])
        for k in ("a", "b"):
            opts[k]._dc.close()
        out["closed_diff"] = param_diff(model, ref)
        out["checksum"] = checksum(model)
        return out
    return run


@contextlib.contextmanager
def logged():
    """The messages logged on logger 'dcredit_opt' inside the block, as a list that fills as they come."""
    records = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Capture()
    logger = logging.getLogger("dcredit_opt")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def p6_custom_global_clip(job: Job) -> dict:
    with logged() as records:
        model, ref, opt, ropt = job.make(Net, ClipSGD)
        job.train(model, ref, opt, ropt)
    lazy_notices = [m for m in records if "lazy_step" in m]
    return job.result(model, ref, opt, lazy_step_notices=lazy_notices, log_records=records)


def p7_step_post_hook(job: Job) -> dict:
    model, ref, opt, ropt = job.make(Net, _sgd)
    calls = []

    def hook(optimizer, args, kwargs):
        ps = [p for g in optimizer.param_groups for p in g["params"]]
        calls.append((len(ps), sum(p.grad is not None for p in ps)))

    opt.register_step_post_hook(hook)
    job.train(model, ref, opt, ropt)
    return job.result(model, ref, opt, hook_calls=calls, num_params=len(list(model.parameters())))


def unused_on_every_rank(job: Job) -> dict:
    """Note [Global usage]: the branch is used on both ranks (steps 0-1), on none (2-3), on rank 1 only (4),
    on none (5). With momentum and weight decay a zero gradient would still move it; synchronous training
    leaves its gradient None, and the optimizer skips it."""
    model, ref, opt, ropt = job.make(lambda: Net(branch=True), _sgd)

    def uses(rank, step):
        return step < 2 or (step == 4 and rank == 1)

    def loss(m, step, rank):
        x, y = batch(step, rank)
        return F.mse_loss(m(x, use_branch=uses(rank, step)), y)

    job.train(model, ref, opt, ropt, loss)
    opt.synchronize()  # the last update applied: the branch's gradient is what synchronous training leaves
    return job.result(model, ref, opt, branch_grad_none_when_unused=model.branch.weight.grad is None)


def _rows_kinds(opt) -> dict:
    """Note [Embedding rows]: the tensors on the rows path, by name: "rows only" or "tied"."""
    from dcredit_opt.optimizer import rows
    return {opt._dc.names[i]: "rows only" if r.kind == rows.ROWS_ONLY else "tied" for i, r in opt._dc.tally.rows.items()}


def embedding_rows(kind: str):
    """Note [Embedding rows]: an untied embedding ("untied"), one tied to the output layer ("tied"), an
    untied one that a regulariser also reads from step 4 on ("regularised": its dense rest is reduced in step()),
    an untied one whose gradients are zeroed, not dropped ("kept": zero_grad(set_to_none=False)), and a tied
    one whose gradient the script sets to None after every other backward ("dropped": no update at those steps,
    Note [Replaced gradients], the rows and the rest alike; "dropped_untied": the same for an untied one, whose
    p.grad only the rows make), and an untied one whose gradients are clipped after backward, without
    synchronize() ("clipped": its p.grad must be there, non-None, with its rows, for the norm)."""
    model_fn = TiedNet if kind in ("tied", "dropped") else EmbedNet

    def run(job: Job) -> dict:
        model, ref, opt, ropt = job.make(model_fn, _adam)

        def loss(m, step, rank):
            out = tied_loss(m, step, rank)
            if kind == "regularised" and step >= 4:
                out = out + 1e-2 * m.emb.weight.pow(2).sum()
            return out

        if kind in ("dropped", "dropped_untied", "clipped"):
            for step in range(STEPS):
                opt.zero_grad()
                loss(model, step, job.rank).backward()
                if kind == "clipped":
                    nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                elif step % 2:
                    model.emb.weight.grad = None
                job.step(opt)
                reference_grads(ref, lambda r, step=step: loss(ref, step, r), job.world)
                if kind == "clipped":
                    nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
                elif step % 2:
                    ref.emb.weight.grad = None
                ropt.step()
        else:
            job.train(model, ref, opt, ropt, loss, set_to_none=kind != "kept")
        kinds = _rows_kinds(opt)
        expected = {"emb.weight": "tied" if kind in ("tied", "dropped") else "rows only"}
        # The dense all-reduce of a rows-only weight's other gradient runs only when it has one.
        rest = any(str(key).startswith("rows rest") for key in opt._dc.told)
        return job.result(model, ref, opt, rows_path=kinds == expected, kinds=kinds,
                          dense_rest_only_when_read_otherwise=rest == (kind == "regularised"),
                          plan_numel_of_emb=opt._dc.buffers.plan.numels[opt._dc.names.index("emb.weight")])
    return run


def p10_paramlist_profiled(job: Job) -> dict:
    model, ref, opt, ropt = job.make(ParamListNet, _adam,
                                     config=job.config(policy="dcredit", profile_iters=3))
    after = []
    job.train(model, ref, opt, ropt, steps=8,
              after_step=lambda step: after.append((opt.plan.policy, opt._dc.recorder is None)))
    return job.result(model, ref, opt, after_step=after)


def p2_branch_on_rank1_while_profiling(job: Job) -> dict:
    """Rank 1 alone takes the branch during the 3 profiled iterations (and never after)."""
    model, ref, opt, ropt = job.make(lambda: Net(branch=True), _adam,
                                     config=job.config(policy="dcredit", profile_iters=3))

    def uses(rank, step):
        return rank == 1 and step < 3

    plans, policies = [], []
    for step in range(8):
        opt.zero_grad()
        x, y = batch(step, job.rank)
        F.mse_loss(model(x, use_branch=uses(job.rank, step)), y).backward()
        plans.append(opt._dc.buffers.plan.to_json())
        job.step(opt)
        policies.append(opt.plan.policy)

        def loss(r, step=step):
            xr, yr = batch(step, r)
            return F.mse_loss(ref(xr, use_branch=uses(r, step)), yr)

        reference_grads(ref, loss, job.world)
        ropt.step()
    return job.result(model, ref, opt, plans=plans, policies=policies)


def p3d_early_read(mode: str, at_once: bool = False):
    """The guard applies ``a.weight``'s update at the parent's early read: trains like the reference. ``at_once``:
    the forward's leader has applied it before (Note [Resting hooks]), on any thread."""
    def stale_loss(model, step, rank):
        model.step = step
        return mse(model, step, rank)

    return _module_pattern(lambda: StaleNet(mode, at_once), _sgd, stale_loss)


class _SkipBatch(Exception):
    """Raised by a hook inside backward; the script catches it and skips the batch."""


SKIP = 3
"""The step whose update the skipped-step patterns skip."""


def skipped_step(kind: str):
    """Note [Skipped steps]: every rank skips the update of step :data:`SKIP`, then trains on; the reference
    skips it too. ``"synchronized"``: after a finished backward, on a look at the reduced gradients (a norm
    check); ``"interrupted"``: after a backward that a hook on ``mid``'s output ended part-way with an
    exception, caught. Both then call ``synchronize()`` and ``zero_grad()``, and no ``step()``."""
    def run(job: Job) -> dict:
        model, ref, opt, ropt = job.make(Net, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
        armed = [False]

        def boom(grad):
            if armed[0]:
                raise _SkipBatch(f"a hook ended the backward of step {SKIP}")

        def hook_output(module, inputs, out):
            if out.requires_grad:
                out.register_hook(boom)

        model.mid.register_forward_hook(hook_output)
        norms = []
        for step in range(STEPS):
            opt.zero_grad()
            armed[0] = kind == "interrupted" and step == SKIP
            loss = mse(model, step, job.rank)
            try:
                loss.backward()
            except _SkipBatch:
                assert armed[0]
            if step == SKIP:
                opt.synchronize()
                norms.append(float(torch.stack([p.grad.norm() for p in model.parameters()
                                                if p.grad is not None]).norm()))
                opt.zero_grad()
                continue
            job.step(opt)
            reference_grads(ref, lambda r, step=step: mse(ref, step, r), job.world)
            ropt.step()
        return job.result(model, ref, opt, skipped_norm=norms[0])
    return run


def numpy_alias_written_after_step(job: Job) -> dict:
    """On rank 0, a NumPy view of ``mid.weight`` taken after step 1's ``step()`` and used from step 2 on to clip
    the weight right after ``step()``, then dropped before the last two steps: NumPy's writes are no torch
    operations, so while the view lives every step of rank 0 is eager (Note [Hidden writes]) and the clip lands
    after the update, as in synchronous training; once it is gone the lazy step comes back. Rank 1 makes the
    same clip with a torch operation, which the read guard sees: it stays lazy, so the ranks step one eagerly,
    one lazily, from their own decisions. Per step, the updates left pending."""
    model, ref, opt, ropt = job.make(Net, _sgd)
    alias = []
    pending = []

    def after_step(step):
        pending.append(int(opt._dc.lazy.npending))
        if step == 1 and job.rank == 0:
            alias.append(model.mid.weight.detach().numpy())
        elif 1 < step < STEPS - 2:
            with torch.no_grad():
                if job.rank == 0:
                    alias[0].clip(-0.05, 0.05, out=alias[0])
                else:
                    model.mid.weight.clamp_(-0.05, 0.05)
                ref.mid.weight.clamp_(-0.05, 0.05)
        elif step == STEPS - 2:
            alias.clear()

    job.train(model, ref, opt, ropt, after_step=after_step, skew=Skew(job.rank))
    return job.result(model, ref, opt, pending=pending)


def _zero_through_data(model) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.data.zero_()


def p11_model_zero_grad_keep(job: Job, zero=lambda model: model.zero_grad(set_to_none=False)) -> dict:
    """Older scripts' loop: backward, step(), then model.zero_grad(set_to_none=False) (or ``zero``), with no
    optimizer.zero_grad() before backward. The zeroing writes gradients whose updates wait for the next forward
    (Note [Gradient reads] and Note [Unseen writes] in watched.py): they are applied first, and the next backward
    adds to the zeros, as in plain torch."""
    with logged() as records:
        model, ref, opt, ropt = job.make(Net, _sgd)
        zeroed = []
        for step in range(STEPS):
            mse(model, step, job.rank).backward()
            job.step(opt)
            zero(model)
            zeroed.append(all(not p.grad.any() for p in model.parameters()))
            reference_grads(ref, lambda r, step=step: mse(ref, step, r), job.world)
            ropt.step()
    notices = [m for m in records if "was changed in place after step()" in m]
    return job.result(model, ref, opt, zeroed=all(zeroed), told_once=len(notices) == 1)


WORK = {
    "P11_model_zero_grad_set_to_none_false": p11_model_zero_grad_keep,
    "P11b_grad_data_zeroed_after_step": lambda job: p11_model_zero_grad_keep(job, _zero_through_data),
    "P3a_parameterlist_in_parent": _module_pattern(ParamListNet),
    "post_accumulate_hook_clamps_own_gradient": post_accumulate_hook_clamps_own_gradient,
    "P3b_child_weight_via_F_linear": _module_pattern(FunctionalChildNet),
    "P3c_bare_weight_via_F_linear": _module_pattern(FunctionalBareNet),
    "P4_functional_call_other_weights_first": p4_functional_call_other_weights,
    "P5_tensor_lr_adam_steplr": p5_tensor_lr_steplr,
    "P6_custom_optimizer_global_clip": p6_custom_global_clip,
    "P7_step_post_hook": p7_step_post_hook,
    "P13p_plain_grad_scaler_with_inf": grad_scaler_with_inf,
    "P13_amp_clip_recipe": lambda job: grad_scaler_with_inf(job, clip=True),
    "tied_weights": _module_pattern(TiedNet, _adam, tied_loss),
    "module_called_twice": _module_pattern(TwiceNet),
    "branch_skipped_on_all_ranks": branch_skipped_everywhere,
    "unused_on_every_rank_with_momentum": unused_on_every_rank,
    "embedding_rows_untied": embedding_rows("untied"),
    "embedding_rows_tied": embedding_rows("tied"),
    "embedding_rows_regularised_later": embedding_rows("regularised"),
    "embedding_rows_gradients_kept": embedding_rows("kept"),
    "embedding_rows_gradient_dropped": embedding_rows("dropped"),
    "embedding_rows_gradient_dropped_untied": embedding_rows("dropped_untied"),
    "embedding_rows_clipped_without_synchronize": embedding_rows("clipped"),
    "bare_parameter_of_parent": _module_pattern(BareParamNet),
    "functional_call_own_weights": functional_call_own,
    "no_grad_eval_after_step": eval_after_step,
    "steplr_float": _scheduled(lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)),
    "onecyclelr": _scheduled(lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=STEPS)),
    "backward_passes_per_step_2": backward_passes_2,
    "zero_grad_variants": zero_grad_variants,
    "bf16_autocast": bf16_autocast,
    "adafactor_bf16_autocast": adafactor_bf16_autocast,
    "inference_mode_eval_first_update": inference_mode_eval_first_update,
    "selective_checkpoint_adafactor": selective_checkpoint_adafactor,
    "adam_weight_decay": _module_pattern(Net, lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01)),
    "adamw_weight_decay": _module_pattern(Net, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    "torch_save_after_step": save_after_step,
    "checkpoint_reentrant": _module_pattern(lambda: CkptNet(True)),
    "checkpoint_non_reentrant": _module_pattern(lambda: CkptNet(False)),
    "horovod_amp_recipe": horovod_amp_recipe,
    "ema_after_step": ema_after_step,
    "P3d_early_read": p3d_early_read("sum"),
    "P3d_early_read_saved_for_backward": p3d_early_read("saved"),
    "P3d_early_read_module_not_called": p3d_early_read("functional"),
    "P3d_early_read_untracked": p3d_early_read("untracked"),
    "P3e_early_read_on_thread_when_read_at_once": p3d_early_read("thread", at_once=True),
    "P3e_early_read_untracked_on_thread_when_read_at_once": p3d_early_read("thread_untracked", at_once=True),
    "step_skipped_after_synchronize": skipped_step("synchronized"),
    "step_skipped_after_interrupted_backward": skipped_step("interrupted"),
    "weights_written_after_step": _after_step(_write_weights),
    "weights_read_around_the_module_after_step": _after_step(_read_weights, TempNet),
    "submodule_evaluated_after_step": _after_step(_evaluate_submodule),
    "model_moved_to_its_own_device_after_step": _after_step(_move_to_own_device),
    "optimizer_state_read_after_step": _after_step(_read_optimizer_state, opt_fn=_adam),
    "optimizer_state_reset_after_step": _after_step(_reset_optimizer_state),
    "checkpoint_resumed_after_step": _after_step(_resume(model_too=True), opt_fn=_adam),
    "optimizer_state_loaded_after_step": _after_step(_resume(model_too=False)),
    "layer_frozen_and_unfrozen_mid_training": _after_step(_freeze_mid, opt_fn=_adam),
    "wrapped_optimizer_checkpointed_after_step": wrapped_optimizer_checkpointed_after_step,
    "scheduler_before_wrapping_resumed": scheduler_before_wrapping_resumed,
    "swa_averaged_model_after_step": swa_after_step,
    "step_with_closure": step_with_closure,
    "zero_gradient_on_one_rank": zero_gradient_on_one_rank,
    **{f"parametrized_{kind}": replicated(_parametrized(kind)) for kind in (
        "orthogonal", "weight_norm", "spectral_norm", "spectral_norm_hook", "weight_norm_hook")},
    "heads_per_rank_one_optimizer": heads_per_rank_one_optimizer,
    "optimizer_per_head_head_unused_everywhere": optimizer_per_head(by_rank=False),
    "optimizer_per_head_tasks_differ_by_rank": optimizer_per_head(by_rank=True),
    "optimizer_per_head_tasks_differ_by_rank_zeros_kept": optimizer_per_head(by_rank=True, set_to_none=False),
    "gan_discriminator_frozen_for_generator": gan("pix2pix"),
    "gan_generator_backward_inputs": gan("inputs"),
    "numpy_alias_written_after_step": numpy_alias_written_after_step,
}

PROFILED = {
    "P2_branch_on_rank1_while_profiling": p2_branch_on_rank1_while_profiling,
    "P10_parameterlist_profiled": p10_paramlist_profiled,
}


# ---- patterns that must raise DCreditError ------------------------------------------------------


def _expect_error(job: Job, model, ref, opt, ropt, body, loss_fn=mse) -> dict:
    """Run ``body(step)`` for each step; the DCreditError it raises (type, message, where), or that none came.
    The reference difference is reported too, to tell a silent wrong result from a harmless miss.
    ``loss_fn=None``: ``body`` steps the reference itself."""
    where = ["?"]
    try:
        for step in range(STEPS + 2):
            body(step, where)
            if loss_fn is not None:
                reference_grads(ref, lambda r, step=step: loss_fn(ref, step, r), job.world)
                ropt.step()
    except Exception as e:  # noqa: BLE001 - the type is the test's to judge
        return {"raised": type(e).__name__, "is_dcredit_error": isinstance(e, dc.DCreditError),
                "message": str(e), "where": where[0], "step": step}
    out = job.result(model, ref, opt)
    out["raised"] = None
    return out


def _standard_body(job, model, opt, before_forward=None, before_step=None, after_step=None, loss_fn=mse):
    def body(step, where):
        opt.zero_grad()
        if before_forward is not None:
            before_forward(step)
        where[0] = f"forward of step {step}"
        loss = loss_fn(model, step, job.rank)
        where[0] = f"backward of step {step}"
        loss.backward()
        if before_step is not None:
            before_step(step)
        where[0] = f"step() of step {step}"
        job.step(opt)
        where[0] = f"after step() of step {step}"
        if after_step is not None:
            after_step(step)
    return body


class LookupNet(nn.Module):
    """Nothing but an embedding: on the rows path, no other gradient tells a second backward apart."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 7)

    def forward(self, tok):
        return self.emb(tok).mean(1)


def rows_second_backward(job: Job) -> dict:
    """From step 5 on (the rows path is on from step 3), two backward passes before one step()."""
    model, ref, opt, ropt = job.make(LookupNet, _sgd)

    def loss(m, step, rank):
        return F.mse_loss(m(tokens(step, rank)[0]), batch(step, rank)[1])

    def body(step, where):
        opt.zero_grad()
        for k in range(2 if step >= 5 else 1):
            where[0] = f"backward {k} of step {step}"
            loss(model, step, job.rank).backward()
        where[0] = f"step() of step {step}"
        job.step(opt)

    return _expect_error(job, model, ref, opt, ropt, body, loss)


def embedding_max_norm(job: Job) -> dict:
    """An embedding with max_norm: each rank renormalises the rows of its own batch, in place; refused at the
    first step() (the weights of the ranks would drift apart)."""
    model, ref, opt, ropt = job.make(MaxNormNet, _sgd)

    def body(step, where):
        opt.zero_grad()
        where[0] = f"forward/backward of step {step}"
        tied_loss(model, step, job.rank).backward()
        where[0] = f"step() of step {step}"
        job.step(opt)

    return _expect_error(job, model, ref, opt, ropt, body, tied_loss)


def step_skipped_on_one_rank(job: Job) -> dict:
    """Rank 1 alone skips the update of step :data:`SKIP` (``synchronize()``, ``zero_grad()``); rank 0 steps.
    The weights differ from then on, and no collective notices: refused on every rank at a later flush
    (Note [Same updates] in usage.py)."""
    model, ref, opt, ropt = job.make(Net, _sgd)

    def body(step, where):
        opt.zero_grad()
        where[0] = f"forward of step {step}"
        loss = mse(model, step, job.rank)
        where[0] = f"backward of step {step}"
        loss.backward()
        where[0] = f"step() of step {step}"
        if step == SKIP and job.rank == 1:
            opt.synchronize()
            opt.zero_grad()
            return
        job.step(opt)

    return _expect_error(job, model, ref, opt, ropt, body)


def weight_changed_on_one_rank(job: Job) -> dict:
    """After step() of step 2, rank 1 alone adds to ``out.bias`` in place (a rank's own condition): the weights
    differ from then on; refused on every rank, naming it, at a later flush (Note [Same weights] in usage.py)."""
    model, ref, opt, ropt = job.make(Net, _sgd)

    def after(step):
        if step == 2 and job.rank == 1:
            with torch.no_grad():
                model.out.bias.add_(0.5)

    return _expect_error(job, model, ref, opt, ropt, _standard_body(job, model, opt, after_step=after))


def weight_restored_with_set_after_step(job: Job) -> dict:
    """After step() of step 4, every rank puts ``mid.weight`` back to its first value with ``p.set_()``, which no
    torch function mode sees: the pending update would land on it (Note [Unseen parameter writes] in
    csrc/torch/gradient_path.cc). Refused on every rank, naming it, where that update would be applied."""
    model, ref, opt, ropt = job.make(Net, _sgd)
    first = model.mid.weight.detach().clone()

    def after(step):
        if step == 4:
            with torch.no_grad():
                model.mid.weight.set_(first.clone())

    return _expect_error(job, model, ref, opt, ropt, _standard_body(job, model, opt, after_step=after))


def p14_unfrozen_later(job: Job) -> dict:
    def frozen_net():
        net = Net()
        net.mid.weight.requires_grad_(False)
        return net

    model, ref, opt, ropt = job.make(frozen_net, _sgd)

    def unfreeze(step):
        if step == 3:
            model.mid.weight.requires_grad_(True)
            ref.mid.weight.requires_grad_(True)

    return _expect_error(job, model, ref, opt, ropt, _standard_body(job, model, opt, before_forward=unfreeze))


def p3e_stale_read_on_thread(mode: str):
    def run(job: Job) -> dict:
        model, ref, opt, ropt = job.make(lambda: StaleNet(mode), _sgd)

        def set_step(step):
            model.step = ref.step = step

        return _expect_error(job, model, ref, opt, ropt, _standard_body(job, model, opt, before_forward=set_step))
    return run


def p8_shutdown_after_lazy_step(job: Job) -> dict:
    """dc.shutdown() right after a lazy step(); ends the job's process group, so it runs last."""
    model, ref, opt, ropt = job.make(Net, _sgd)
    job.train(model, ref, opt, ropt)
    lazy_pending = int(opt._dc.lazy.npending)  # the last step() deferred these (0: it was not lazy)
    dc.shutdown()
    out = {"pending_before_shutdown": lazy_pending, "diff": state_diff(model.state_dict(), ref.state_dict()),
           "checksum": checksum(model), "backend": opt._dc.backend.name}
    try:
        sd = opt.state_dict()
        rsd = ropt.state_dict()
        out["momentum_diff"] = max(float((sd["state"][k]["momentum_buffer"] - rsd["state"][k]["momentum_buffer"])
                                         .abs().max()) for k in rsd["state"])
        out["state_dict_error"] = None
    except Exception as e:  # noqa: BLE001
        out["state_dict_error"] = f"{type(e).__name__}: {e}"
    for call in ("step", "synchronize"):
        try:
            if call == "step":
                mse(model, 100, job.rank).backward()
                opt.step()
            else:
                opt.synchronize()
            out[call] = None
        except Exception as e:  # noqa: BLE001
            out[call] = {"raised": type(e).__name__, "is_dcredit_error": isinstance(e, dc.DCreditError),
                         "message": str(e)}
    return out


RAISE = {
    "P14_frozen_at_wrap_unfrozen_later": p14_unfrozen_later,
    "P3e_stale_read_on_thread": p3e_stale_read_on_thread("thread"),
    "P3e_stale_read_untracked_on_thread": p3e_stale_read_on_thread("thread_untracked"),
    "rows_second_backward_before_step": rows_second_backward,
    "step_skipped_on_one_rank": step_skipped_on_one_rank,
    "weight_changed_on_one_rank": weight_changed_on_one_rank,
    "weight_restored_with_set_after_step": weight_restored_with_set_after_step,
    "gan_generator_backward_reaches_discriminator": gan("dcgan"),
    "embedding_max_norm": embedding_max_norm,
}

LAST = {"P8_shutdown_after_lazy_step": p8_shutdown_after_lazy_step}

PATTERNS = {**WORK, **PROFILED, **RAISE, **LAST}


def drop_closed_optimizers(cycles: int = 8, limit_s: float = 60.0) -> int:
    """Build an optimizer, train 3 steps, close it and drop it, ``cycles`` times (a fresh optimizer per
    phase of a job). A rank still inside after ``limit_s`` prints every thread's stack and exits 1."""
    import faulthandler
    import gc

    faulthandler.dump_traceback_later(limit_s, exit=True)
    dc.init()
    for _ in range(cycles):
        torch.manual_seed(0)
        model = Net()
        opt = dc.DistributedOptimizer(_sgd(model.parameters()), named_parameters=model.named_parameters(),
                                      config=fixed_config())
        for step in range(3):
            opt.zero_grad()
            mse(model, step, dc.rank()).backward()
            opt.step()
        opt._dc.close()
        del opt, model  # the Engine and its process groups go here
        gc.collect()
    faulthandler.cancel_dump_traceback_later()
    return cycles


# ---- P9: torch.compile ---------------------------------------------------------------------------


def _inductor_problem() -> str | None:
    """None if inductor compiles a plain function here, else why not (then its variants are skipped)."""
    try:
        fn = torch.compile(lambda t: torch.sin(t) * 2 + 1)
        t = torch.randn(5)
        if not torch.allclose(fn(t), torch.sin(t) * 2 + 1):
            return "inductor compiled a plain function to a wrong result"
    except Exception as e:  # noqa: BLE001
        return f"inductor cannot compile a plain function on this machine: {type(e).__name__}: {str(e)[:300]}"
    finally:
        torch._dynamo.reset()
    return None


def compiled(how: str, backend: str, model_fn=Net, loss_fn=mse):
    def run(job: Job) -> dict:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = model_fn()
        ref = copy.deepcopy(model)
        opt = job.wrap(_sgd(model.parameters()), model)
        ropt = _sgd(ref.parameters())
        kw = {} if backend == "inductor" else {"backend": backend}
        if how == "torch.compile":
            runner = torch.compile(model, **kw)
        else:
            model.compile(**kw)
            runner = model
        job.train(runner, ref, opt, ropt, loss_fn)  # the loss calls runner(x); the reference runs eagerly
        return job.result(model, ref, opt)
    return run


# An embedding in a compiled model (Note [Embedding rows]): with or without the rows path, the same weights.
COMPILE_EMBEDDING = {"P9_torch.compile_aot_eager_embedding": ("torch.compile", "aot_eager")}
COMPILE = {**{f"P9_{how}_{backend}": (how, backend) for how in ("torch.compile", "model.compile")
              for backend in ("aot_eager", "inductor")}, **COMPILE_EMBEDDING}


# ---- entry points ------------------------------------------------------------------------------


def _join(horovod_first: bool) -> None:
    if horovod_first:
        import horovod.torch as hvd

        hvd.init()
    dc.init()


def _run_one(name: str, fn, backend: str) -> dict:
    job = Job(backend)
    start = time.monotonic()
    try:
        out = fn(job)
    except Exception as e:  # noqa: BLE001 - reported under the pattern's name
        out = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    finally:
        job.close()
    out["seconds"] = time.monotonic() - start
    return out


def patterns(names: list, backend: str = "auto", horovod_first: bool = False) -> dict:
    """Each named pattern in turn on this rank; ``{name: result}``."""
    _join(horovod_first)
    # torch's first optimizer imports dynamo (seconds): not any pattern's time.
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    return {name: _run_one(name, PATTERNS[name], backend) for name in names}


def compile_patterns(names: list, backend: str = "auto") -> dict:
    """P9: each compile variant in turn; inductor variants skip (with the reason) where inductor cannot
    compile a plain function."""
    _join(False)
    out = {}
    inductor = None
    for name in names:
        how, compiler = COMPILE[name]
        if compiler == "inductor":
            if inductor is None:
                inductor = _inductor_problem() or ""
            if inductor:
                out[name] = {"skip": inductor}
                continue
        model = (EmbedNet, tied_loss) if name in COMPILE_EMBEDDING else (Net, mse)
        out[name] = _run_one(name, compiled(how, compiler, *model), backend)
    return out
