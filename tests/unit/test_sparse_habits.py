"""Note [Sparse gradients] (optimizer/sparse.py), in a world of one: the habits of training scripts around a sparse
embedding (GradScaler, gradients zeroed in place by the model or the optimizer, a gradient dropped after backward,
clipping, the eager step) under optimizers whose state follows the gradient's layout (SGD's momentum, Adagrad,
SparseAdam beside Adam) train as plain torch does."""

import pytest
import torch
from torch import nn

import dcredit_opt as dc

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself"),
              pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")]

STEPS = 6


class EmbedHead(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 50, (4, 5), generator=g), torch.randint(0, 3, (4,), generator=g)


OPTIMIZERS = {
    "sgd_momentum": lambda m: [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)],
    "adagrad": lambda m: [torch.optim.Adagrad(m.parameters(), lr=0.1)],
    "sparse_adam_and_adam": lambda m: [torch.optim.SparseAdam(list(m.emb.parameters()), lr=0.05),
                                       torch.optim.Adam(m.head.parameters(), lr=0.01)],
}
HABITS = ["grad_scaler", "model_zero_grad_kept", "optimizer_zero_grad_kept", "dropped_at_odd_steps", "clipped",
          "eager"]


def _train(optimizers: str, habit: str, ours: bool) -> list:
    model = EmbedHead()
    opts = OPTIMIZERS[optimizers](model)
    if ours:
        names = {id(p): n for n, p in model.named_parameters()}
        config = dc.Config(lazy_step="off") if habit == "eager" else None
        opts = [dc.DistributedOptimizer(o, named_parameters=[(names[id(p)], p) for g in o.param_groups
                                                             for p in g["params"]], config=config) for o in opts]
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2) if habit == "grad_scaler" else None
    try:
        for step in range(STEPS):
            for o in opts:
                if habit == "optimizer_zero_grad_kept":
                    o.zero_grad(set_to_none=False)
                elif habit != "model_zero_grad_kept":
                    o.zero_grad()
            ids, y = _batch(step)
            loss = nn.functional.cross_entropy(model(ids), y)
            (scaler.scale(loss) if scaler else loss).backward()
            if habit == "dropped_at_odd_steps" and step % 2:
                model.emb.weight.grad = None
            if habit == "clipped":
                nn.utils.clip_grad_norm_(model.head.parameters(), 0.1)
            for o in opts:
                if scaler:
                    scaler.step(o)
                else:
                    o.step()
            if scaler:
                scaler.update()
            if habit == "model_zero_grad_kept":
                model.zero_grad(set_to_none=False)
        for o in opts:
            if ours:
                o.synchronize()
        return [p.detach().clone() for p in model.parameters()]
    finally:
        for o in opts:
            if ours:
                o._dc.close()


@pytest.mark.parametrize("habit", HABITS)
@pytest.mark.parametrize("optimizers", list(OPTIMIZERS))
def test_a_sparse_embedding_trains_as_plain_torch_does(optimizers, habit):
    want = _train(optimizers, habit, ours=False)
    got = _train(optimizers, habit, ours=True)
    moved = max(float((w - q.detach()).abs().max()) for w, q in zip(want, EmbedHead().parameters()))
    assert moved > 1e-3, "plain torch did not train"
    for name, w, g in zip(("emb.weight", "head.weight", "head.bias"), want, got):
        assert torch.allclose(w, g, atol=1e-5), f"{optimizers}, {habit}: {name} differs by {(w - g).abs().max()}"
