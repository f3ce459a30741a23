"""What each rank runs in test_sparse.py: sparse gradients (Note [Sparse gradients]) against synchronous training.

The reference is synchronous data parallelism on the global batch: every rank
regenerates every rank's batch (seeded by step and rank), and a plain copy of
the model takes the gradient of ``sum over ranks of loss_r / world`` (of the
sum for ``op=Sum``): for a sparse embedding that is the sparse gradient at the
union of every rank's rows, the one synchronous training hands its optimizer.
Several patterns run in one launch, each on a fresh model and optimizer, each
reported on its own (an exception is reported under the pattern's name).
"""

from __future__ import annotations

import copy
import time
import traceback

import torch
from torch import nn

import dcredit_opt as dc

STEPS = 6
VOCAB = 40


class EmbedHead(nn.Module):
    """A sparse embedding (or embedding bag) and, optionally, a dense head reading its output."""

    def __init__(self, bag: bool = False, head: bool = False, tied: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.bag = bag
        self.emb = nn.EmbeddingBag(VOCAB, 6, mode="sum", sparse=True) if bag else nn.Embedding(VOCAB, 6, sparse=True)
        self.head = nn.Linear(6, 3) if head else None
        self.tied = tied

    def forward(self, ids):
        h = self.emb(ids) if self.bag else self.emb(ids).sum(1)
        if self.tied:  # the output layer reads the embedding's weight too: the gradient is dense
            return torch.tanh(h) @ self.emb.weight.t()[:, :3]
        return self.head(torch.tanh(h)) if self.head is not None else h


def ids_of(step: int, rank: int, rows: int = 4) -> torch.Tensor:
    """Rank 0 looks up rows 0-19, rank 1 rows 10-29 (overlapping 10-19), rank r rows 10r-10r+19; 30+ never."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    lo = 10 * rank
    return torch.randint(lo, lo + 20, (rows, 3), generator=g)


def target_of(step: int, rank: int, width: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(4, width, generator=g)


def mse(model, step: int, rank: int, rows: int = 4) -> torch.Tensor:
    out = model(ids_of(step, rank, rows))
    return (out - target_of(step, rank, out.shape[1])[:out.shape[0]]).pow(2).mean()


def sparse_adam(params):
    return torch.optim.SparseAdam(list(params), lr=0.05)


def sgd(params):
    return torch.optim.SGD(list(params), lr=0.1)


def sgd_momentum(params):
    return torch.optim.SGD(list(params), lr=0.05, momentum=0.9)


class Job:
    def __init__(self, backend: str):
        self.rank, self.world = dc.rank(), dc.size()
        self.backend = backend
        self.opts = []

    def make(self, model_fn, opt_fn, config=None, **kw):
        model = model_fn()
        ref = copy.deepcopy(model)
        return model, ref, self.wrap(model, opt_fn, config, **kw), opt_fn(ref.parameters())

    def wrap(self, model, opt_fn, config=None, **kw):
        """A ``DistributedOptimizer`` over ``model``'s parameters (it takes over from an earlier one)."""
        config = dc.Config(**{"policy": "fixed", "block_bytes": 128, "window": 2, "channels": 2,
                              "backend": self.backend, **(config or {})})
        if callable(kw.get("groups")):
            kw["groups"] = kw["groups"](model)
        opt = dc.DistributedOptimizer(opt_fn(model.parameters()), named_parameters=model.named_parameters(),
                                      config=config, **kw)
        self.opts.append(opt)
        return opt

    def train(self, model, ref, opt, ropt, loss, steps=STEPS, passes=1, scale=None):
        """``loss(m, step, rank, k)`` for pass ``k``; the reference takes every rank's, times ``scale``."""
        scale = 1.0 / self.world if scale is None else scale
        for step in range(steps):
            opt.zero_grad()
            for k in range(passes):
                out = loss(model, step, self.rank, k)
                if out is not None:
                    out.backward()
            opt.step()
            ropt.zero_grad()
            total = None
            for r in range(self.world):
                for k in range(passes):
                    out = loss(ref, step, r, k)
                    if out is not None:
                        total = out * scale if total is None else total + out * scale
            total.backward()
            ropt.step()
        opt.synchronize()

    def result(self, model, ref, opt, **extra) -> dict:
        diff = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
        moved = max(float((p - q).abs().max()) for p, q in zip(ref.parameters(), self.initial(ref)))
        return {"max_diff": diff, "moved": moved,
                "checksum": [p.detach().clone() for p in model.parameters()],
                "sparse": [opt._dc.names[i] for i in opt._dc.tally.sparse_rows()],
                "numels": list(opt._dc.buffers.plan.numels), **extra}

    @staticmethod
    def initial(ref):
        return [p.detach() for p in type(ref)(**_kwargs(ref)).parameters()]

    def close(self):
        for opt in self.opts:
            opt._dc.close()


def _kwargs(model) -> dict:
    return {"bag": model.bag, "head": model.head is not None, "tied": model.tied}


def plain(opt_fn, model_fn=EmbedHead, **kw):
    """Ranks looking up different and overlapping rows; every step."""
    def run(job: Job) -> dict:
        model, ref, opt, ropt = job.make(model_fn, opt_fn, **kw)
        scale = 1.0 if kw.get("op") is dc.Sum else None
        job.train(model, ref, opt, ropt, lambda m, s, r, k: mse(m, s, r), scale=scale)
        return job.result(model, ref, opt)
    return run


def no_rows_on_rank1(job: Job) -> dict:
    """Rank 1 looks up no row at steps 1 and 2 (an empty batch: an empty sparse gradient), rank 0 neither at
    step 2 (no rank has a row: SparseAdam still counts the step, as in synchronous training)."""
    model, ref, opt, ropt = job.make(EmbedHead, sparse_adam)

    def loss(m, step, rank, k):
        if rank == 1 and step in (1, 2) or rank == 0 and step == 2:
            return m(torch.zeros(0, 3, dtype=torch.int64)).sum()
        return mse(m, step, rank)

    job.train(model, ref, opt, ropt, loss)
    return job.result(model, ref, opt)


def not_called_on_rank1(job: Job) -> dict:
    """Rank 1 does not call the embedding at steps 1, 3 and 4 (its gradient is None there), both ranks at step 4
    (no rank has a gradient: no update, as in synchronous training); the dense head is always read."""
    model, ref, opt, ropt = job.make(lambda: EmbedHead(head=True), sgd_momentum)

    def loss(m, step, rank, k):
        if rank == 1 and step in (1, 3, 4) or step == 4:
            return m.head(torch.full((2, 6), 0.5)).pow(2).mean()
        return mse(m, step, rank)

    job.train(model, ref, opt, ropt, loss)
    return job.result(model, ref, opt)


def bag_with_head(job: Job) -> dict:
    """An ``nn.EmbeddingBag(sparse=True)`` and a dense head under one SGD with momentum."""
    model, ref, opt, ropt = job.make(lambda: EmbedHead(bag=True, head=True), sgd_momentum)
    job.train(model, ref, opt, ropt, lambda m, s, r, k: mse(m, s, r))
    return job.result(model, ref, opt)


def two_passes(job: Job) -> dict:
    """``backward_passes_per_step=2``: the two passes' sparse gradients accumulate in p.grad, then are reduced."""
    model, ref, opt, ropt = job.make(EmbedHead, sparse_adam, backward_passes_per_step=2)
    job.train(model, ref, opt, ropt, lambda m, s, r, k: mse(m, 10 * s + k, r), passes=2)
    return job.result(model, ref, opt)


def tied(job: Job) -> dict:
    """The embedding's weight read by a dense layer too: plain torch makes the gradient dense; so do we."""
    model, ref, opt, ropt = job.make(lambda: EmbedHead(tied=True), sgd)
    job.train(model, ref, opt, ropt, lambda m, s, r, k: mse(m, s, r))
    return job.result(model, ref, opt)


def dense_on_rank1_sometimes(job: Job) -> dict:
    """Rank 1 adds a dense regulariser of the weight at steps 0 and 3: those steps' sums are dense, the
    others sparse (SGD takes both)."""
    model, ref, opt, ropt = job.make(EmbedHead, sgd_momentum)

    def loss(m, step, rank, k):
        out = mse(m, step, rank)
        if rank == 1 and step in (0, 3):
            out = out + 1e-2 * m.emb.weight.pow(2).sum()
        return out

    job.train(model, ref, opt, ropt, loss)
    return job.result(model, ref, opt)


def profiled(job: Job) -> dict:
    """The default planner: profiled for 3 iterations, then its own plan, staged after the sparse one."""
    model, ref, opt, ropt = job.make(lambda: EmbedHead(head=True), sgd_momentum,
                                     config={"policy": "dcredit", "profile_iters": 3})
    job.train(model, ref, opt, ropt, lambda m, s, r, k: mse(m, s, r), steps=8)
    return job.result(model, ref, opt, policy=opt.plan.policy)


def in_a_group(job: Job) -> dict:
    """The sparse weight in a Horovod ``groups=`` group with the head's weight: cut out of the group's block."""
    model, ref, opt, ropt = job.make(lambda: EmbedHead(head=True), sgd,
                                     groups=lambda m: [[m.emb.weight, m.head.weight]])
    job.train(model, ref, opt, ropt, lambda m, s, r, k: mse(m, s, r))
    return job.result(model, ref, opt)


def sparse_first_seen_later(job: Job) -> dict:
    """The sparse embedding is not called in the first iteration on any rank: refused at its first use, in a
    backward whose head gradients came first and released their blocks, one in flight at a time (Note
    [Interrupted backward]). As the refusal advises, a new optimizer with ``sparse_as_dense=True`` takes over
    at once (closing the refused one) and trains on: every rank must have finished exactly the released
    blocks when the refused optimizer closed, and the weights must then follow synchronous training, in which
    the refused iteration applies nothing."""
    small = {"block_bytes": 16, "window": -1, "credit_bytes": 16}  # 6 head blocks, one in flight at a time
    model, ref, opt, ropt = job.make(lambda: EmbedHead(head=True), sgd, config=small)
    for m in (model, ref):  # the first iteration: the head alone, the same on every rank
        m.head(torch.ones(2, 6)).pow(2).mean().backward()
    opt.step()
    ropt.step()
    opt.zero_grad()
    engine = opt._dc.engine
    try:
        mse(model, 1, job.rank).backward()
        refused = "no error"
    except dc.DCreditError as e:
        refused = f"{type(e).__name__}: {e}"
    fresh = job.wrap(model, sgd, config=small, sparse_as_dense=True)  # closes the refused optimizer
    trace = engine.trace()  # (block, channel, window, group, seq, release_ns, launch_ns, end_ns)
    job.train(model, ref, fresh, ropt, lambda m, s, r, k: mse(m, s + 1, r), steps=4)
    return {**job.result(model, ref, fresh), "refused": refused,
            "released": sorted(t[0] for t in trace if t[5]), "finished": sorted(t[0] for t in trace if t[7])}


def grad_scaler(job: Job, recipe: str = "") -> dict:
    """GradScaler (``scaler.step(opt)``, scale 2**10 growing every 2 steps) over a sparse embedding and a dense
    head: the scaler unscales the reduced rows themselves, which the step then takes; at step 2 rank 1's rows
    alone are infinite, and every rank skips that step, as the reference on the summed loss does. ``recipe``:
    Horovod's AMP recipe instead (``"horovod"``: ``synchronize()``, ``scaler.unscale_``, then ``scaler.step`` under
    ``skip_synchronize()``), or torch's for clipping (``"torch_clip"``: ``scaler.unscale_``, ``clip_grad_norm_`` of the
    head, ``scaler.step``; Note [A scaler's unscale_])."""
    model, ref, opt, ropt = job.make(lambda: EmbedHead(head=True), sgd_momentum)
    scaler, rscaler = (torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2) for _ in range(2))

    def loss(m, step, rank):
        out = mse(m, step, rank)
        if step == 2 and rank == 1:  # infinite gradients in the embedding's rows only
            out = out + m.emb(ids_of(step, rank)).sum() * float("inf")
        return out

    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(loss(model, step, job.rank)).backward()
        if recipe == "horovod":
            opt.synchronize()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
        elif recipe == "torch_clip":
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.head.parameters(), 0.5)  # torch's norm takes no sparse gradient
            scaler.step(opt)
        else:
            scaler.step(opt)
        scaler.update()
        ropt.zero_grad()
        rscaler.scale(sum(loss(ref, step, r) for r in range(job.world)) / job.world).backward()
        if recipe == "torch_clip":
            rscaler.unscale_(ropt)
            nn.utils.clip_grad_norm_(ref.head.parameters(), 0.5)
        rscaler.step(ropt)
        rscaler.update()
    opt.synchronize()
    assert scaler.get_scale() == rscaler.get_scale(), (scaler.get_scale(), rscaler.get_scale())
    return job.result(model, ref, opt)


def zeros_kept(job: Job, how: str) -> dict:
    """Gradients zeroed in place, not dropped, under SGD with momentum (whose buffer is sparse, as the gradient it
    was made from): ``model.zero_grad(set_to_none=False)`` after each step, or ``optimizer.zero_grad(set_to_none=
    False)`` before each backward (while a lazy step's updates wait: Note [Zeroed while pending]). Plain torch
    zeroes a sparse gradient sparse, so the next one adds to it sparse, and the momentum takes it: so here (Note
    [Sparse gradients]; ``p.grad`` read between steps is dense, as that note says)."""
    model, ref, opt, ropt = job.make(lambda: EmbedHead(head=True), sgd_momentum)
    for step in range(STEPS):
        if how == "optimizer":
            opt.zero_grad(set_to_none=False)
        mse(model, step, job.rank).backward()
        opt.step()
        if how == "model":
            model.zero_grad(set_to_none=False)
        ropt.zero_grad(set_to_none=False)
        (sum(mse(ref, step, r) for r in range(job.world)) / job.world).backward()
        ropt.step()
    opt.synchronize()
    return job.result(model, ref, opt)


def dropped_at_odd_steps(job: Job) -> dict:
    """``p.grad = None`` for the embedding after every other backward (Note [Replaced gradients]): no update of
    it at those steps, on every rank, as the reference has none."""
    model, ref, opt, ropt = job.make(lambda: EmbedHead(head=True), sgd_momentum)
    for step in range(STEPS):
        opt.zero_grad()
        mse(model, step, job.rank).backward()
        if step % 2:
            model.emb.weight.grad = None
        opt.step()
        ropt.zero_grad()
        (sum(mse(ref, step, r) for r in range(job.world)) / job.world).backward()
        if step % 2:
            ref.emb.weight.grad = None
        ropt.step()
    opt.synchronize()
    return job.result(model, ref, opt)


def _join(horovod_first: bool) -> None:
    if horovod_first:
        import horovod.torch as hvd

        hvd.init()
    dc.init()


PATTERNS = {
    "sparse_adam": plain(sparse_adam),
    "sgd": plain(sgd),
    "sgd_momentum_sum": plain(sgd_momentum, op=dc.Sum),
    "no_rows_on_rank1": no_rows_on_rank1,
    "not_called_on_rank1": not_called_on_rank1,
    "embedding_bag_with_head": bag_with_head,
    "two_backward_passes": two_passes,
    "tied_to_a_dense_layer": tied,
    "dense_on_rank1_sometimes": dense_on_rank1_sometimes,
    "profiled_plan": profiled,
    "in_a_horovod_group": in_a_group,
    "grad_scaler": grad_scaler,
    "grad_scaler_horovod_recipe": lambda job: grad_scaler(job, recipe="horovod"),
    "grad_scaler_torch_clip_recipe": lambda job: grad_scaler(job, recipe="torch_clip"),
    "model_zero_grad_kept_with_momentum": lambda job: zeros_kept(job, "model"),
    "optimizer_zero_grad_kept_with_momentum": lambda job: zeros_kept(job, "optimizer"),
    "gradient_dropped_at_odd_steps": dropped_at_odd_steps,
}
RAISE = {
    "sparse_first_seen_later": sparse_first_seen_later,
}


def patterns(names: list, backend: str = "auto", horovod_first: bool = False) -> dict:
    """Each named pattern in turn on this rank; ``{name: result}``."""
    _join(horovod_first)
    out = {}
    for name in names:
        job = Job(backend)
        start = time.monotonic()
        try:
            out[name] = (PATTERNS.get(name) or RAISE[name])(job)
        except Exception as e:  # noqa: BLE001 - reported under the pattern's name
            out[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        finally:
            job.close()
        out[name]["seconds"] = time.monotonic() - start
    return out
