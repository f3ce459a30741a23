"""What each rank runs for the gradient patterns of test_patterns.py (issue C2): gradients read, changed or
replaced between ``backward()`` and ``step()``, gradients assigned by hand, groups added and models cast
after wrapping, whole-model saves and unwrapped teachers.

Each pattern runs lazily (the lazy step on from step 2, small blocks) and eagerly (``lazy_step='off'``),
and rank 1 sleeps a few milliseconds at random points, so that rank 0 reads its gradients while their
blocks are still travelling (Note [Gradient reads]). The reference is the one of ``pattern_workers.py``:
synchronous data parallelism by hand, with the same change applied to the averaged gradients.
"""

from __future__ import annotations

import copy
import io

import torch
import torch.nn.functional as F
from torch import nn

from . import pattern_workers as pw
from .workers import Net, batch

STEPS = pw.STEPS


def _train(job: pw.Job, lazy: bool, model_fn, change, seed: int = 0, opt_fn=pw._sgd, steps: int = STEPS,
           set_to_none: bool = True):
    """The standard loop with ``change(model, step, reference)`` between backward and step on both the
    model (reference=False) and the reference (reference=True, after averaging; its gradients are new
    tensors at every step)."""
    config = job.config(lazy_step="auto" if lazy else "off")
    model, ref, opt, ropt = job.make(model_fn, opt_fn, config=config, seed=seed)
    skew = pw.Skew(job.rank, seed)
    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        pw.mse(model, step, job.rank).backward()
        skew()
        change(model, step, False)
        skew()
        job.step(opt)
        pw.reference_grads(ref, lambda r, step=step: pw.mse(ref, step, r), job.world)
        change(ref, step, True)
        ropt.step()
    return model, ref, opt


def _both(fn):
    """``fn(job, lazy)`` as two patterns: ``<name>_lazy`` and ``<name>_eager``."""
    return {"lazy": lambda job: fn(job, True), "eager": lambda job: fn(job, False)}


def grad_scaled(job, lazy):
    """``p.grad = p.grad * 0.5`` on even steps (a new tensor computed from the gradient just reduced)."""
    def change(m, step, reference):
        if step % 2 == 0:
            for p in m.parameters():
                p.grad = p.grad * 0.5

    return job.result(*_train(job, lazy, Net, change))


def grad_noise(job, lazy):
    """``p.grad = p.grad + noise`` on odd steps, the same noise on every rank (seeded by step)."""
    def change(m, step, reference):
        if step % 2 == 1:
            g = torch.Generator().manual_seed(step)
            for p in m.parameters():
                p.grad = p.grad + 1e-3 * torch.randn(p.shape, generator=g)

    return job.result(*_train(job, lazy, Net, change))


def grad_none(job, lazy):
    """``p.grad = None`` for one layer after backward on steps 2 and 4: that layer is not updated then."""
    def change(m, step, reference):
        if step in (2, 4):
            m.mid.weight.grad = None
            m.out.bias.grad = None

    return job.result(*_train(job, lazy, Net, change))


def grad_clip(job, lazy):
    """``clip_grad_norm_`` between backward and step, no synchronize(): it clips the averaged gradients."""
    def change(m, step, reference):
        nn.utils.clip_grad_norm_(m.parameters(), 0.05)

    return job.result(*_train(job, lazy, Net, change))


def grad_clip_per_tensor(job, lazy):
    """``clip_grad_norm_(foreach=False)``: a norm, then a scaling, per gradient. The first read releases the
    blocks; a later one, once none is in flight, makes every gradient final at once (Note [Gradient reads]);
    with the ranks' skew, some steps' reads come while blocks travel, some after."""
    def change(m, step, reference):
        nn.utils.clip_grad_norm_(m.parameters(), 0.05, foreach=False)

    return job.result(*_train(job, lazy, Net, change))


def grad_norm_read(job, lazy):
    """A gradient norm logged between backward and step (values only): the norm of the averaged gradient."""
    norms = {False: [], True: []}

    def change(m, step, reference):
        norms[reference].append(float(torch.norm(torch.stack([p.grad.norm() for p in m.parameters()]))))

    out = job.result(*_train(job, lazy, Net, change))
    out["norm_diff"] = max(abs(a - b) for a, b in zip(norms[False], norms[True]))
    return out


def grad_scaled_in_place(job, lazy):
    """``p.grad.mul_(0.5)`` and ``p.grad.add_(...)`` between backward and step: applied to the averaged
    gradient, and what step() uses."""
    def change(m, step, reference):
        for p in m.parameters():
            p.grad.mul_(0.5).add_(1e-3)

    return job.result(*_train(job, lazy, Net, change))


def _kept_aliases(set_to_none: bool):
    """``p.grad.data`` or ``p.grad.detach()`` taken once, after the first backward, kept, and written through
    (``g.mul_(0.5)``) after every backward (Note [Kept aliases] in watched.py). After ``zero_grad()`` to None,
    plain torch's aliases are of gradients nothing uses any more: the writes change nothing; with
    ``set_to_none=False`` they are of ``p.grad`` itself."""
    def pattern(job, lazy):
        def change(m, step, reference):
            if step == 0:
                m.kept = [p.grad.data if k % 2 else p.grad.detach() for k, p in enumerate(m.parameters())]
            if reference and not set_to_none:
                for p in m.parameters():  # the reference's p.grad is a new tensor at every step
                    p.grad.mul_(0.5)
                return
            for g in m.kept:
                g.mul_(0.5)

        return job.result(*_train(job, lazy, Net, change, set_to_none=set_to_none))

    return pattern


def autograd_grad_assigned(job, lazy):
    """Gradients from ``torch.autograd.grad``, assigned to ``p.grad`` by hand, then ``step()``: reduced there,
    as Horovod's synchronize() does."""
    config = job.config(lazy_step="auto" if lazy else "off")
    model, ref, opt, ropt = job.make(Net, pw._sgd, config=config)
    skew = pw.Skew(job.rank)
    for step in range(STEPS):
        opt.zero_grad()
        params = list(model.parameters())
        grads = torch.autograd.grad(pw.mse(model, step, job.rank), params)
        skew()
        for p, g in zip(params, grads):
            p.grad = g
        job.step(opt)
        pw.reference_grads(ref, lambda r, step=step: pw.mse(ref, step, r), job.world)
        ropt.step()
    return job.result(model, ref, opt)


def parameters_to_vector_after_step(job, lazy):
    """``parameters_to_vector(model.parameters())`` with autograd on, right after ``step()``: ``view(-1)`` then
    ``cat``; no false stale-read alarm, and the vector holds the updated weights."""
    worst = [0.0]
    config = job.config(lazy_step="auto" if lazy else "off")
    model, ref, opt, ropt = job.make(Net, pw._sgd, config=config)
    for step in range(STEPS):
        opt.zero_grad()
        pw.mse(model, step, job.rank).backward()
        job.step(opt)
        pw.reference_grads(ref, lambda r, step=step: pw.mse(ref, step, r), job.world)
        ropt.step()
        if step >= 2:  # from the third step on: the first iteration after step() is the learned one
            v = nn.utils.parameters_to_vector(model.parameters())
            worst[0] = max(worst[0], float((v.detach() - nn.utils.parameters_to_vector(ref.parameters())).abs().max()))
    return job.result(model, ref, opt, vector_diff=worst[0])


def whole_model_saved(job, lazy):
    """``torch.save(model)`` (the whole module) after every step, and an unwrapped teacher whose forward runs
    right after ``step()``: both pickle at every step, and the saved weights are the synchronous ones."""
    config = job.config(lazy_step="auto" if lazy else "off")
    model, ref, opt, ropt = job.make(Net, pw._sgd, config=config)
    torch.manual_seed(1)
    teacher = Net()
    worst = [0.0]
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, job.rank)
        with torch.no_grad():
            soft = teacher(x)
        (F.mse_loss(model(x), y) + 0.1 * F.mse_loss(model(x), soft)).backward()
        job.step(opt)

        def loss_of(r, step=step):
            xr, yr = batch(step, r)
            with torch.no_grad():
                soft_r = teacher(xr)
            return F.mse_loss(ref(xr), yr) + 0.1 * F.mse_loss(ref(xr), soft_r)

        pw.reference_grads(ref, loss_of, job.world)
        ropt.step()
        if step == 0:
            continue  # after the first step() the tracer learns where each weight is first read: a save then
            # would count as the first read of every weight, outside any forward (eager for good)
        for m in (model, teacher):
            buf = io.BytesIO()
            torch.save(m, buf)
            buf.seek(0)
            loaded = torch.load(buf, weights_only=False)
            if m is model:
                worst[0] = max(worst[0], pw.state_diff(loaded.state_dict(), ref.state_dict()))
        copy.deepcopy(model)
    hooks = len(teacher._forward_pre_hooks) + len(teacher._state_dict_pre_hooks) + \
        len(teacher._load_state_dict_pre_hooks)
    return job.result(model, ref, opt, save_diff=worst[0], teacher_has_no_hooks=hooks == 0)


def whole_model_saved_on_rows_path(job, lazy):
    """``torch.save(model)`` and ``copy.deepcopy(model)`` after every step of a model whose embedding is
    reduced as rows (Note [Embedding rows]): its embedding carries our swap hooks then."""
    config = job.config(lazy_step="auto" if lazy else "off")
    model, ref, opt, ropt = job.make(pw.EmbedNet, pw._adam, config=config)
    worst = [0.0]

    def save(step):
        if step == 0:
            return  # the first iteration after step() is where the tracer learns the reads
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        worst[0] = max(worst[0], pw.state_diff(torch.load(buf, weights_only=False).state_dict(), ref.state_dict()))
        copy.deepcopy(model)

    job.train(model, ref, opt, ropt, pw.tied_loss, after_step=save)
    return job.result(model, ref, opt, save_diff=worst[0], rows_path=bool(opt._dc.tally.rows))


# ---- two passes per update: sharpness-aware minimisation ------------------------------------------------


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation as its users write it: ``first_step()`` moves each parameter up its
    gradient by ``rho`` over the gradients' norm, a second forward and backward there, ``second_step()`` puts
    the weights back and steps the base optimizer (built here over the same groups) with the second gradients.
    ``step(closure)`` is the same with the second pass in ``closure``."""

    def __init__(self, params, base, rho: float = 0.05, **kw):
        super().__init__(params, dict(rho=rho, **kw))
        self.base = base(self.param_groups, **kw)
        self.param_groups = self.base.param_groups

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    self.state[p]["before"] = p.detach().clone()
                    p.add_(p.grad * (g["rho"] / (norm + 1e-12)))
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False):
        for g in self.param_groups:
            for p in g["params"]:
                if "before" in self.state[p]:
                    p.copy_(self.state[p].pop("before"))
        self.base.step()
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def step(self, closure=None):
        self.first_step(zero_grad=True)
        with torch.enable_grad():
            closure()
        self.second_step()


def _sam(ps):
    return SAM(ps, torch.optim.SGD, lr=0.05, momentum=0.9)


def _sam_reference(ref, ropt, step: int, world: int) -> None:
    """Synchronous SAM: both passes' gradients averaged over the ranks."""
    pw.reference_grads(ref, lambda r: pw.mse(ref, step, r), world)
    ropt.first_step(zero_grad=True)
    pw.reference_grads(ref, lambda r: pw.mse(ref, step, r), world)
    ropt.second_step(zero_grad=True)


def sam_two_passes_with_synchronize(job: pw.Job) -> dict:
    """SAM with ``optimizer.synchronize()`` after each backward, then its own ``first_step()`` and
    ``second_step()`` (zero_grad after synchronize() ends each pass's iteration: Note [Skipped steps]); rank 1
    late at random points. Equals synchronous SAM, both passes averaged."""
    model, ref, opt, ropt = job.make(Net, _sam)
    skew = pw.Skew(job.rank)
    for step in range(STEPS):
        opt.zero_grad()
        pw.mse(model, step, job.rank).backward()
        skew()
        opt.synchronize()
        opt.first_step(zero_grad=True)
        pw.mse(model, step, job.rank).backward()
        skew()
        opt.synchronize()
        opt.second_step(zero_grad=True)
        _sam_reference(ref, ropt, step, job.world)
    return job.result(model, ref, opt)


def sam_first_step_without_synchronize(job: pw.Job) -> dict:
    """SAM's ``first_step(zero_grad=True)`` right after backward, without ``synchronize()``: its zero_grad
    would drop gradients still being reduced. Refused there on every rank, naming a parameter and
    ``synchronize()``."""
    model, ref, opt, ropt = job.make(Net, _sam)

    def body(step, where):
        opt.zero_grad()
        where[0] = f"first backward of step {step}"
        pw.mse(model, step, job.rank).backward()
        where[0] = f"first_step() of step {step}"
        opt.first_step(zero_grad=True)
        where[0] = f"second backward of step {step}"
        pw.mse(model, step, job.rank).backward()
        where[0] = f"second_step() of step {step}"
        opt.second_step(zero_grad=True)
        _sam_reference(ref, ropt, step, job.world)

    return pw._expect_error(job, model, ref, opt, ropt, body, loss_fn=None)


def sam_step_with_closure(job: pw.Job) -> dict:
    """SAM's ``step(closure)`` after a backward: ours runs the closure first (as it reduces the gradients a
    closure computes), a second pass before step(): refused there on every rank, naming a parameter, the
    closure and ``synchronize()``."""
    model, ref, opt, ropt = job.make(Net, _sam)

    def body(step, where):
        opt.zero_grad()
        where[0] = f"backward of step {step}"
        pw.mse(model, step, job.rank).backward()
        where[0] = f"step(closure) of step {step}"
        opt.step(lambda: pw.mse(model, step, job.rank).backward())
        _sam_reference(ref, ropt, step, job.world)

    return pw._expect_error(job, model, ref, opt, ropt, body, loss_fn=None)


# ---- two optimizers, named_parameters the whole model's ---------------------------------------------------


def _two_optimizers(job: pw.Job, wrap_second: bool, named: str = "model"):
    """``Net`` trained by two SGD optimizers, the output layer's its own; the first wrapped with the whole
    model's ``named_parameters`` (``named="model"``, the usual argument), its own parameters' only
    (``"body"``) or none (``"none"``, Horovod's call without them); the second wrapped (each its own) or left
    plain."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    body = [(n, p) for n, p in model.named_parameters() if not n.startswith("out.")]
    first = job.wrap(pw._sgd([p for _, p in body]), {"model": model, "body": body, "none": None}[named])
    second = pw._sgd(model.out.parameters())
    if wrap_second:
        second = job.wrap(second, model.out)
    ref_opts = [pw._sgd([p for n, p in ref.named_parameters() if not n.startswith("out.")]),
                pw._sgd(ref.out.parameters())]
    return model, ref, first, second, ref_opts


def two_optimizers(named: str = "model", by_hand: bool = False):
    """Both optimizers wrapped, the first naming the whole model (``named``: see ``_two_optimizers``): the output
    layer's weights, outside the first, are compared with its own every other iteration (Note [Parameters outside
    the optimizer] in checks.py) where named, left to the second where found (it compares them), and never differ;
    equals synchronous training. ``by_hand``: the second is a plain torch optimizer whose gradients the script
    averages itself (all_reduce, as another library's distributed optimizer would): found in the first's model and
    compared there, equal on every rank, nothing refused."""
    def run(job: pw.Job) -> dict:
        model, ref, first, second, ref_opts = _two_optimizers(job, wrap_second=not by_hand, named=named)
        skew = pw.Skew(job.rank)
        for step in range(STEPS):
            first.zero_grad()
            second.zero_grad()
            pw.mse(model, step, job.rank).backward()
            skew()
            job.step(first)
            if by_hand:
                for p in model.out.parameters():
                    torch.distributed.all_reduce(p.grad)
                    p.grad /= job.world
            second.step()
            skew()
            pw.reference_grads(ref, lambda r, step=step: pw.mse(ref, step, r), job.world)
            for o in ref_opts:
                o.step()
        out = job.result(model, ref, first)
        if not by_hand:
            second._dc.close()
        return out
    return run


def _two_steps(job: pw.Job, first, second, ref, ref_opts, loss):
    """An iteration of two optimizers and of the synchronous reference, as a ``_expect_error`` body: ``loss(step)``
    is this rank's loss; ``ref`` (its optimizers ``ref_opts``) trains on every rank's."""
    def body(step, where):
        first.zero_grad()
        second.zero_grad()
        where[0] = f"forward/backward of step {step}"
        loss(step).backward()
        where[0] = f"step() of step {step}"
        job.step(first)
        second.step()
        pw.reference_grads(ref, lambda r: pw.mse(ref, step, r), job.world)
        for o in ref_opts:
            o.step()
    return body


def second_optimizer_not_wrapped(named: str = "model"):
    """The output layer on a plain torch optimizer beside the wrapped one (a DDP script's second optimizer left
    as it was): its updates use each rank's own gradient and the ranks drift apart. The output layer's weights
    are compared between ranks with the first optimizer's own, whether its named_parameters names them (the whole
    model's) or not (its own parameters' only, or none: found in the model its forward runs): refused at the first
    comparison after they differ, on every rank, naming them and saying to wrap every optimizer (Note [Parameters
    outside the optimizer] in checks.py)."""
    def run(job: pw.Job) -> dict:
        model, ref, first, second, ref_opts = _two_optimizers(job, wrap_second=False, named=named)
        body = _two_steps(job, first, second, ref, ref_opts, lambda step: pw.mse(model, step, job.rank))
        return pw._expect_error(job, model, ref, first, None, body, loss_fn=None)
    return run


def _head_apart(job: pw.Job, wrap_head: bool):
    """A body and a head as two modules, the forward calling one after the other (no parent module): the body on
    a wrapped SGD naming its own parameters, the head on an SGD of its own, wrapped or left plain. Returns the two
    parts as one ``nn.Sequential`` (for the comparison only: the forward never calls it), its reference, the
    body's optimizer, the head's, the reference's optimizers, and the loss of a step."""
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 24))
    head = nn.Linear(24, 7)
    model = nn.Sequential(body, head)
    ref = copy.deepcopy(model)
    first = job.wrap(pw._sgd(body.parameters()), body)
    second = job.wrap(pw._sgd(head.parameters()), head) if wrap_head else pw._sgd(head.parameters())
    ref_opts = [pw._sgd(ref[0].parameters()), pw._sgd(ref[1].parameters())]

    def loss(step):
        x, y = batch(step, job.rank)
        return F.mse_loss(head(body(x)), y)

    return model, ref, first, second, ref_opts, loss


def head_apart(wrap_head: bool):
    """``_head_apart``: with the head's optimizer wrapped too, equals synchronous training (the head, outside the
    body's optimizer, is reduced by its own and not compared by the body's). Left plain, the head trains from each
    rank's own gradient: its parameters had a gradient from the same backward as the body's, so the body's
    optimizer found them (Note [Parameters outside the optimizer] in checks.py) and compares them: refused at the
    first comparison after they differ, on every rank, naming them."""
    def run(job: pw.Job) -> dict:
        model, ref, first, second, ref_opts, loss = _head_apart(job, wrap_head)
        body = _two_steps(job, first, second, ref, ref_opts, loss)
        if not wrap_head:
            return pw._expect_error(job, model, ref, first, None, body, loss_fn=None)
        for step in range(STEPS):
            body(step, [None])
        out = job.result(model, ref, first)
        second._dc.close()
        return out
    return run


def head_per_rank_stepped_and_cleared_first(job: pw.Job) -> dict:
    """A head trained on each rank's own gradient on purpose (a head per rank), called apart after the body, its
    plain optimizer stepping and clearing its gradients before the body's step(): the remedy the refusal of
    ``head_called_apart_on_an_unwrapped_optimizer`` names. The head has no gradient at our step(), so it is
    neither found nor compared (Note [Parameters outside the optimizer] in checks.py): no refusal. The body equals
    synchronous training with every rank's own head (simulated here, one head per rank), and each rank's head its
    own reference head, which differ between ranks."""
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 24))
    head = nn.Linear(24, 7)
    ref_body, ref_heads = copy.deepcopy(body), [copy.deepcopy(head) for _ in range(job.world)]
    first, second = job.wrap(pw._sgd(body.parameters()), body), pw._sgd(head.parameters())
    ref_first, ref_seconds = pw._sgd(ref_body.parameters()), [pw._sgd(h.parameters()) for h in ref_heads]
    for step in range(STEPS):
        first.zero_grad()
        x, y = batch(step, job.rank)
        F.mse_loss(head(body(x)), y).backward()
        second.step()
        second.zero_grad()
        job.step(first)
        ref_first.zero_grad()
        for r, (h, o) in enumerate(zip(ref_heads, ref_seconds)):
            o.zero_grad()
            xr, yr = batch(step, r)
            F.mse_loss(h(ref_body(xr)), yr).backward()  # the body's gradients summed over ranks: averaged below
            o.step()
        for p in ref_body.parameters():
            p.grad /= job.world
        ref_first.step()
    found = list(first._dc.outside.found_names)
    return job.result(body, ref_body, first, head_diff=pw.param_diff(head, ref_heads[job.rank]),
                      head_not_found=not found, reference_heads_differ=pw.param_diff(ref_heads[0], ref_heads[1]) > 1e-3)


def model_also_in_ddp(job: pw.Job) -> dict:
    """The model still wrapped in torch's DistributedDataParallel (a DDP script half migrated): DDP's reducer
    writes its own average into p.grad, which is our slot's alias by then. Refused at step() on every rank,
    naming a parameter and DDP."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = job.wrap(pw._sgd(ddp.parameters()), ddp)
    ropt = pw._sgd(ref.parameters())

    def body(step, where):
        opt.zero_grad()
        where[0] = f"forward/backward of step {step}"
        pw.mse(ddp, step, job.rank).backward()
        where[0] = f"step() of step {step}"
        job.step(opt)

    return pw._expect_error(job, model, ref, opt, ropt, body)


# ---- a branch some ranks skip (Note [Unused here] in usage.py) ----------------------------------


class BranchFirstNet(nn.Module):
    """``Net`` whose branch comes first among the parameters: a loop over them reads the branch first."""

    def __init__(self):
        super().__init__()
        self.branch = nn.Linear(61, 7)
        self.body = Net()

    def forward(self, x, use_branch: bool = False):
        b = self.body
        h = b.norm(torch.relu(b.mid(torch.relu(b.inp(x)))))
        y = b.out(h)
        return y + self.branch(h) if use_branch else y


def _branch_used(rank: int, step: int) -> bool:
    """By rank 1 alone at odd steps; by no rank at even steps."""
    return rank == 1 and step % 2 == 1


def _train_branched(job: pw.Job, lazy: bool, model_fn, change, set_to_none: bool = True):
    """``_train`` with the branch taken as :func:`_branch_used` says: rank 0 never reaches it, and at odd steps
    rank 1's gradient of it is the average's, so rank 0's ``p.grad`` must show it after backward as DDP's does.
    ``set_to_none=False``: gradients are cleared to zeros, which plain torch keeps (and steps with) wherever a
    parameter had a gradient once."""
    config = job.config(lazy_step="auto" if lazy else "off")
    model, ref, opt, ropt = job.make(model_fn, pw._sgd, config=config)
    skew = pw.Skew(job.rank, 0)

    def loss(m, step, rank):
        x, y = batch(step, rank)
        return F.mse_loss(m(x, use_branch=_branch_used(rank, step)), y)

    had = set()  # the reference's parameters that had a gradient once
    for step in range(STEPS):
        opt.zero_grad(set_to_none=set_to_none)
        loss(model, step, job.rank).backward()
        skew()
        change(model, step)
        skew()
        job.step(opt)
        pw.reference_grads(ref, lambda r, step=step: loss(ref, step, r), job.world)
        if not set_to_none:
            pw.keep_zeros_where_had(ref, had)
        change(ref, step)
        ropt.step()
    return job.result(model, ref, opt)


def branch_clipped(job, lazy):
    """``clip_grad_norm_`` lists the gradients that are not None, then reads them: rank 0 lists the branch's too,
    whose average rank 1 computed (else its norm, so its clipping, differs from rank 1's)."""
    return _train_branched(job, lazy, lambda: Net(branch=True),
                           lambda m, step: nn.utils.clip_grad_norm_(m.parameters(), 0.05))


def branch_clipped_by_value(job, lazy):
    return _train_branched(job, lazy, lambda: Net(branch=True),
                           lambda m, step: nn.utils.clip_grad_value_(m.parameters(), 0.01))


def branch_dropped(job, lazy):
    """``p.grad = None`` for the branch's weight at odd steps, on every rank, where rank 1 took the branch: no
    update, as in plain torch, on rank 0 too, whose ``p.grad`` there was the zeros standing for rank 1's sum."""
    def change(m, step):
        if step % 2 == 1:
            m.branch.weight.grad = None

    return _train_branched(job, lazy, lambda: Net(branch=True), change)


def branch_zeros_kept_clipped(job, lazy):
    """``zero_grad(set_to_none=False)`` and the branch that rank 1 alone takes at odd steps: once it has had a
    gradient, rank 0's ``p.grad`` there is zeros (kept, as in plain torch), not None; the first read must show
    rank 1's average there too, or rank 0's norm, so its clipping, differs (Note [Held gradients])."""
    return _train_branched(job, lazy, lambda: Net(branch=True),
                           lambda m, step: nn.utils.clip_grad_norm_(m.parameters(), 0.05), set_to_none=False)


def accumulated_branch_in_fewer_passes_clipped(job, lazy):
    """``backward_passes_per_step=2`` and a branch some of the passes take: every rank in the first pass at even
    steps, rank 1 in the second at odd steps, then ``clip_grad_norm_`` without ``synchronize()``: the branch's
    gradient, never handed over in backward (fewer passes than two), must be the average when the clip reads it,
    not each rank's own (Note [Held gradients]; the ranks' average of clipped gradients is alike on every rank, so
    only this comparison sees the difference)."""
    config = job.config(lazy_step="auto" if lazy else "off")
    model, ref, opt, ropt = job.make(lambda: Net(branch=True), pw._sgd, config=config, backward_passes_per_step=2)
    skew = pw.Skew(job.rank, 0)

    def loss(m, step, k, rank):
        x, y = batch(2 * step + k, rank)
        used = k == 0 and step % 2 == 0 or k == 1 and step % 2 == 1 and rank == 1
        return F.mse_loss(m(x, use_branch=used), y)

    for step in range(STEPS):
        opt.zero_grad()
        for k in range(2):
            loss(model, step, k, job.rank).backward()
            skew()
        nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        job.step(opt)
        for p in ref.parameters():
            p.grad = None
        for r in range(job.world):
            for k in range(2):
                loss(ref, step, k, r).backward()
        pw.finish_reference_grads(ref, job.world)
        nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ropt.step()
    return job.result(model, ref, opt)


def _short_accumulation_loss(m, step, k, rank):
    x, y = batch(2 * step + k, rank)
    return F.mse_loss(m(x), y)


def _short(step: int) -> bool:
    """Every third step ends after one backward pass of ``backward_passes_per_step=2`` (an epoch's short last
    accumulation)."""
    return step % 3 == 2


def accumulated_short_synchronized_then_clipped(job):
    """``backward_passes_per_step=2``, every third step after one pass only, and Horovod's clip recipe
    (``synchronize()``, ``clip_grad_norm_``, ``step()`` inside ``skip_synchronize()``): after the short
    accumulation no iteration opened in backward, so ``synchronize()`` opens it and reduces what there is, and
    the clip reads the average, as after a full one (Note [Short accumulations] in csrc/torch/gradient_path.cc)."""
    model, ref, opt, ropt = job.make(Net, pw._sgd, backward_passes_per_step=2)
    skew = pw.Skew(job.rank, 0)
    for step in range(STEPS):
        passes = 1 if _short(step) else 2
        opt.zero_grad()
        for k in range(passes):
            _short_accumulation_loss(model, step, k, job.rank).backward()
            skew()
        opt.synchronize()
        nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        with opt.skip_synchronize():
            job.step(opt)
        for p in ref.parameters():
            p.grad = None
        for r in range(job.world):
            for k in range(passes):
                _short_accumulation_loss(ref, step, k, r).backward()
        pw.finish_reference_grads(ref, job.world)
        nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ropt.step()
    return job.result(model, ref, opt)


def accumulated_head_in_a_pass_of_its_own(job, lazy):
    """``backward_passes_per_step=2``, two passes through the model and a third through a second head alone (on the
    body's output detached), as Horovod counts passes per tensor: the head's one pass comes after the iteration
    opened, onto the zeros that stood for it (Note [Unused here]); it is this rank's gradient, reduced and applied,
    not zeros unused everywhere and dropped (Note [Held gradients])."""
    config = job.config(lazy_step="auto" if lazy else "off")
    torch.manual_seed(0)
    model = Net()
    head = nn.Linear(61, 7)
    ref, ref_head = copy.deepcopy(model), copy.deepcopy(head)
    params = [*model.named_parameters(), *(("head." + n, p) for n, p in head.named_parameters())]
    opt = job.wrap(pw._sgd([p for _, p in params]), params, config, backward_passes_per_step=2)
    ropt = pw._sgd([*ref.parameters(), *ref_head.parameters()])
    skew = pw.Skew(job.rank, 0)

    def losses(m, h, step, k, rank):
        x, y = batch(2 * step + k, rank)
        hidden = torch.relu(m.mid(torch.relu(m.inp(x))))
        return F.mse_loss(m(x), y), F.mse_loss(h(hidden.detach()), y)

    for step in range(STEPS):
        opt.zero_grad()
        for k in range(2):
            losses(model, head, step, k, job.rank)[0].backward()
            skew()
        losses(model, head, step, 0, job.rank)[1].backward()
        nn.utils.clip_grad_norm_([*model.parameters(), *head.parameters()], 0.05)
        job.step(opt)
        for p in [*ref.parameters(), *ref_head.parameters()]:
            p.grad = None
        for r in range(job.world):
            for k in range(2):
                losses(ref, ref_head, step, k, r)[0].backward()
            losses(ref, ref_head, step, 0, r)[1].backward()
        pw.finish_reference_grads(ref, job.world)
        pw.finish_reference_grads(ref_head, job.world)
        nn.utils.clip_grad_norm_([*ref.parameters(), *ref_head.parameters()], 0.05)
        ropt.step()
    return job.result(model, ref, opt, head_diff=pw.param_diff(head, ref_head))


def _scaled_in_a_loop(m, step):
    for p in m.parameters():
        if p.grad is not None:
            if step % 2 == 0:
                p.grad = p.grad * 0.5
            else:
                p.grad.mul_(0.5)  # in place: the step stays lazy (a replaced gradient makes it eager)


def branch_first_grads_replaced(job, lazy):
    """``p.grad = p.grad * 0.5`` for every gradient that is not None, the branch first: at even steps no rank used
    it, and what the loop made from the zeros it read first is a drop (plain torch had None: no update, no weight
    decay); at odd steps rank 0 scales, in place, the average rank 1 computed."""
    return _train_branched(job, lazy, BranchFirstNet, _scaled_in_a_loop)


def branch_own_optimizer_synchronized_then_clipped(job: pw.Job, passes: int = 1) -> dict:
    """Horovod's clipping recipe with two optimizers, the branch in an optimizer of its own that rank 1 alone takes
    at odd steps: ``synchronize()`` of both, ``clip_grad_norm_`` over every parameter, ``step()`` of both in
    ``skip_synchronize()``. Rank 0's backward reached none of the branch's tensors, so its ``synchronize()`` of the
    second must join rank 1's flush (Note [Missed here] in core.py): else the first's and the second's collectives
    meet in different orders, or rank 0's norm leaves out the branch's average that rank 1's includes. ``passes``:
    backward_passes_per_step, above the one pass each step takes: every step a short accumulation, where no
    iteration opens in backward (Note [Short accumulations] in csrc/torch/gradient_path.cc)."""
    torch.manual_seed(0)
    model = Net(branch=True)
    ref = copy.deepcopy(model)

    def split(m):
        return ([p for n, p in m.named_parameters() if not n.startswith("branch.")], list(m.branch.parameters()))

    (body, branch), (ref_body, ref_branch) = split(model), split(ref)
    first = job.wrap(pw._sgd(body), [(n, p) for n, p in model.named_parameters() if not n.startswith("branch.")],
                     backward_passes_per_step=passes)
    second = job.wrap(pw._sgd(branch), model.branch, backward_passes_per_step=passes)
    ref_opts = [pw._sgd(ref_body), pw._sgd(ref_branch)]
    skew = pw.Skew(job.rank)

    def loss(m, step, rank):
        x, y = batch(step, rank)
        return F.mse_loss(m(x, use_branch=_branch_used(rank, step)), y)

    for step in range(STEPS):
        first.zero_grad()
        second.zero_grad()
        loss(model, step, job.rank).backward()
        skew()
        first.synchronize()
        second.synchronize()
        nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        with first.skip_synchronize():
            job.step(first)
        with second.skip_synchronize():
            second.step()
        pw.reference_grads(ref, lambda r, step=step: loss(ref, step, r), job.world)
        nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        for o in ref_opts:
            o.step()
    second._dc.close()
    return job.result(model, ref, first)


GRADIENT_WORK = {f"{name}_{kind}": run for name, fn in {
    "grad_replaced_scaled": grad_scaled,
    "grad_replaced_noise": grad_noise,
    "grad_set_to_none_after_backward": grad_none,
    "clip_grad_norm_without_synchronize": grad_clip,
    "clip_grad_norm_per_tensor_without_synchronize": grad_clip_per_tensor,
    "grad_norm_read_before_step": grad_norm_read,
    "grad_changed_in_place_before_step": grad_scaled_in_place,
    "grad_alias_kept_and_written_after_zero_grad_to_none": _kept_aliases(True),
    "grad_alias_kept_and_written_after_zero_grad_in_place": _kept_aliases(False),
    "autograd_grad_assigned_by_hand": autograd_grad_assigned,
    "parameters_to_vector_after_step": parameters_to_vector_after_step,
    "whole_model_saved_with_teacher": whole_model_saved,
    "whole_model_saved_on_embedding_rows_path": whole_model_saved_on_rows_path,
    "branch_unused_here_clip_grad_norm": branch_clipped,
    "branch_unused_here_clip_grad_value": branch_clipped_by_value,
    "branch_first_unused_everywhere_grads_replaced_in_a_loop": branch_first_grads_replaced,
    "branch_unused_here_grad_dropped": branch_dropped,
    "branch_unused_here_zeros_kept_clip_grad_norm": branch_zeros_kept_clipped,
    "accumulation_branch_in_fewer_passes_clip_grad_norm": accumulated_branch_in_fewer_passes_clipped,
    "accumulation_head_in_a_pass_of_its_own": accumulated_head_in_a_pass_of_its_own,
}.items() for kind, run in _both(fn).items()}
GRADIENT_WORK["sam_two_passes_with_synchronize"] = sam_two_passes_with_synchronize
GRADIENT_WORK["two_optimizers_both_wrapped_first_names_the_whole_model"] = two_optimizers()
GRADIENT_WORK["two_optimizers_both_wrapped_first_names_none"] = two_optimizers("none")
GRADIENT_WORK["second_optimizer_averaged_by_hand_first_names_its_own"] = two_optimizers("body", by_hand=True)
GRADIENT_WORK["head_called_apart_on_a_wrapped_optimizer_of_its_own"] = head_apart(wrap_head=True)
GRADIENT_WORK["head_per_rank_stepped_and_cleared_first"] = head_per_rank_stepped_and_cleared_first
GRADIENT_WORK["branch_own_optimizer_synchronized_then_clipped"] = branch_own_optimizer_synchronized_then_clipped
GRADIENT_WORK["branch_own_optimizer_short_accumulation_synchronized_then_clipped"] = (
    lambda job: branch_own_optimizer_synchronized_then_clipped(job, passes=2))
GRADIENT_WORK["accumulation_short_synchronized_then_clip_grad_norm"] = accumulated_short_synchronized_then_clipped

# Steps that use a replaced gradient are eager by design (Note [Replaced gradients]); with
# autograd.grad no hook fires, so the tracer never learns reads and every step is eager.
# With an alias of every slot kept (and p.grad kept: set_to_none=False), step() applies every update itself (Note
# [Kept aliases] in watched.py).
# SAM's update is its base optimizer's step(), not ours: nothing is deferred.
# A step() after synchronize() applies every update itself (the script asked for every gradient then).
EAGER_BY_DESIGN = {name for name in GRADIENT_WORK if name.endswith("_eager")} | {
    "autograd_grad_assigned_by_hand_lazy", "grad_alias_kept_and_written_after_zero_grad_in_place_lazy",
    "sam_two_passes_with_synchronize", "branch_own_optimizer_synchronized_then_clipped",
    "accumulation_short_synchronized_then_clip_grad_norm",
    "branch_own_optimizer_short_accumulation_synchronized_then_clipped"}


# ---- refused with DCreditError -----------------------------------------------------------------


def group_added_after_wrapping(job: pw.Job) -> dict:
    """``inner.add_param_group(...)`` on the wrapped torch optimizer after wrapping (the group list is
    shared): refused at the next step(), before anything is applied."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 7))
    extra = nn.Linear(16, 7)
    ref = copy.deepcopy(model)
    inner = pw._sgd(model.parameters())
    opt = job.wrap(inner, model)
    ropt = pw._sgd(ref.parameters())

    def body(step, where):
        opt.zero_grad()
        if step == 3:
            where[0] = "add_param_group() of step 3"
            inner.add_param_group({"params": list(extra.parameters())})
        where[0] = f"forward/backward of step {step}"
        x, y = batch(step, job.rank)
        (F.mse_loss(model(x), y) + F.mse_loss(extra(x), y)).backward()
        where[0] = f"step() of step {step}"
        job.step(opt)

    def loss(m, step, rank):
        x, y = batch(step, rank)
        return F.mse_loss(m(x), y)

    return pw._expect_error(job, model, ref, opt, ropt, body, loss)


def model_cast_after_wrapping(job: pw.Job) -> dict:
    """``model.to(torch.bfloat16)`` after wrapping (at step 3): refused at the next backward, naming the
    parameter; nothing launched."""
    model, ref, opt, ropt = job.make(Net, pw._sgd)

    def loss(m, step, rank):
        x, y = batch(step, rank)
        dtype = next(m.parameters()).dtype
        return F.mse_loss(m(x.to(dtype)).float(), y)

    def body(step, where):
        opt.zero_grad()
        if step == 3:
            where[0] = "model.to(torch.bfloat16) of step 3"
            model.to(torch.bfloat16)
        where[0] = f"forward/backward of step {step}"
        loss(model, step, job.rank).backward()
        where[0] = f"step() of step {step}"
        job.step(opt)

    return pw._expect_error(job, model, ref, opt, ropt, body, loss)


def gradient_penalty_through_p_grad(job: pw.Job) -> dict:
    """From step 3, a penalty on the gradients' norm built from ``p.grad`` after ``backward(create_graph=True)``:
    refused at that backward, naming a parameter (Note [Gradients with a graph] in gradients.py); nothing
    launched."""
    model, ref, opt, ropt = job.make(Net, pw._sgd)

    def loss(m, step, rank):
        x, y = batch(step, rank)
        return F.mse_loss(m(x), y)

    def body(step, where):
        opt.zero_grad()
        where[0] = f"forward/backward of step {step}"
        if step < 3:
            loss(model, step, job.rank).backward()
        else:
            loss(model, step, job.rank).backward(create_graph=True)
            sum(p.grad.pow(2).sum() for p in model.parameters()).backward()
        where[0] = f"step() of step {step}"
        job.step(opt)

    return pw._expect_error(job, model, ref, opt, ropt, body, loss)


def wrapped_object_stepped(job: pw.Job) -> dict:
    """The optimizer object the script built kept under its own name, and from step 2 its ``step()`` called
    instead of the wrapper's (an old name left in the loop): refused in that call, on every rank, before any
    parameter changed (Note [The wrapped object's own step] in checks.py)."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    inner, ropt = pw._sgd(model.parameters()), pw._sgd(ref.parameters())
    opt = job.wrap(inner, model)

    def body(step, where):
        opt.zero_grad()
        where[0] = f"forward/backward of step {step}"
        pw.mse(model, step, job.rank).backward()
        where[0] = f"step() of step {step}"
        if step < 2:
            job.step(opt)
        else:
            before = [p.detach().clone() for p in model.parameters()]
            try:
                inner.step()
            finally:
                assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "a parameter changed"

    return pw._expect_error(job, model, ref, opt, ropt, body)


def accumulated_short_clipped_without_synchronize(job: pw.Job) -> dict:
    """``backward_passes_per_step=2``, ``clip_grad_norm_`` before ``step()`` without ``synchronize()``, and at
    step 2 one backward pass only: that clip changed each rank's own gradient, not yet reduced, so ``step()``
    refuses, naming a parameter and ``synchronize()`` (Note [Short accumulations] in
    csrc/torch/gradient_path.cc); the full accumulations before it train as the reference does."""
    model, ref, opt, ropt = job.make(Net, pw._sgd, backward_passes_per_step=2)

    def body(step, where):
        opt.zero_grad()
        where[0] = f"forward/backward of step {step}"
        for k in range(1 if _short(step) else 2):
            _short_accumulation_loss(model, step, k, job.rank).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        where[0] = f"step() of step {step}"
        job.step(opt)
        for p in ref.parameters():
            p.grad = None
        for r in range(job.world):
            for k in range(1 if _short(step) else 2):
                _short_accumulation_loss(ref, step, k, r).backward()
        pw.finish_reference_grads(ref, job.world)
        nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ropt.step()

    return pw._expect_error(job, model, ref, opt, ropt, body, None)


def scheduler_stepped_with_this_ranks_loss(job: pw.Job) -> dict:
    """``ReduceLROnPlateau`` stepped with this rank's own loss (not averaged over ranks): the ranks' learning rates
    part at the first step where one rank's loss stops improving and another's does not, and their updates of the
    same reduced gradients with them: refused at the next flush, on every rank alike, naming the hyperparameters
    and the averaged metric (Note [Same hyperparameters] in usage.py)."""
    model, ref, opt, ropt = job.make(Net, pw._sgd)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    rsched = torch.optim.lr_scheduler.ReduceLROnPlateau(ropt, patience=0, factor=0.5)

    def body(step, where):
        opt.zero_grad()
        where[0] = f"forward/backward of step {step}"
        loss = pw.mse(model, step, job.rank)
        loss.backward()
        where[0] = f"step() of step {step}"
        job.step(opt)
        sched.step(float(loss))  # this rank's loss: the bug
        pw.reference_grads(ref, lambda r, step=step: pw.mse(ref, step, r), job.world)
        ropt.step()
        rsched.step(sum(float(pw.mse(ref, step, r)) for r in range(job.world)) / job.world)

    return pw._expect_error(job, model, ref, opt, ropt, body, None)


GRADIENT_RAISE = {
    "group_added_to_wrapped_optimizer": group_added_after_wrapping,
    "model_cast_to_bf16_after_wrapping": model_cast_after_wrapping,
    "gradient_penalty_through_p_grad": gradient_penalty_through_p_grad,
    "sam_first_step_without_synchronize": sam_first_step_without_synchronize,
    "sam_step_with_closure": sam_step_with_closure,
    "wrapped_object_stepped": wrapped_object_stepped,
    "second_optimizer_not_wrapped": second_optimizer_not_wrapped(),
    "second_optimizer_not_wrapped_first_names_its_own": second_optimizer_not_wrapped("body"),
    "second_optimizer_not_wrapped_first_names_none": second_optimizer_not_wrapped("none"),
    "head_called_apart_on_an_unwrapped_optimizer": head_apart(wrap_head=False),
    "model_also_wrapped_in_ddp": model_also_in_ddp,
    "accumulation_short_clip_grad_norm_without_synchronize": accumulated_short_clipped_without_synchronize,
    "scheduler_stepped_with_this_ranks_loss": scheduler_stepped_with_this_ranks_loss,
}

GRADIENT_PATTERNS = {**GRADIENT_WORK, **GRADIENT_RAISE}


def patterns(names: list, backend: str = "auto") -> dict:
    """Each named pattern in turn on this rank; ``{name: result}``."""
    pw._join(False)
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    return {name: pw._run_one(name, GRADIENT_PATTERNS[name], backend) for name in names}
