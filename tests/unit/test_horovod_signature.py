"""E1: Horovod's DistributedOptimizer signature and helpers, in a world of one.

Same positions and names as ``horovod.torch.DistributedOptimizer``; Horovod's
own constants and compressors are accepted; what dcredit_opt cannot honour is
refused with a clear error before anything changes. The reductions themselves
(fp16 on the wire, groups, Sum) are checked on 2 ranks in
tests/distributed/test_horovod_api.py.
"""

import copy
import dataclasses
import gc
import inspect
import weakref

import pytest
import torch
from torch import nn

import dcredit_opt as dc
from dcredit_opt.optimizer import grouping
from dcredit_opt.optimizer.layout import fixed_plan

pytestmark = pytest.mark.timeout(120)

CONFIG = dc.Config(block_bytes=64, window=2, policy="fixed")
HOROVOD_ORDER = ["optimizer", "named_parameters", "compression", "backward_passes_per_step", "op",
                 "gradient_predivide_factor", "num_groups", "groups", "sparse_as_dense", "process_set"]


def model_and_opt(**kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, **kw)


def test_positional_order_is_horovods():
    params = list(inspect.signature(dc.DistributedOptimizer).parameters)
    assert params[:len(HOROVOD_ORDER)] == HOROVOD_ORDER
    assert inspect.signature(dc.DistributedOptimizer).parameters["config"].kind is inspect.Parameter.KEYWORD_ONLY
    model, opt = model_and_opt()
    wrapped = dc.DistributedOptimizer(opt, model.named_parameters(), dc.Compression.none, 2, config=CONFIG)
    assert wrapped._dc.backward.passes == 2 and wrapped._dc.buffers.wire is None
    wrapped._dc.close()


def test_horovod_signature_matches_when_horovod_is_installed():
    hvd = pytest.importorskip("horovod.torch")
    theirs = list(inspect.signature(hvd.DistributedOptimizer).parameters)
    assert theirs == HOROVOD_ORDER
    # Horovod's constants and compressors are taken as they are.
    for op, ours in ((hvd.Average, dc.Average), (hvd.Sum, dc.Sum)):
        model, opt = model_and_opt()
        wrapped = dc.DistributedOptimizer(opt, model.named_parameters(), hvd.Compression.fp16, op=op,
                                          process_set=hvd.global_process_set, config=CONFIG)
        assert wrapped._dc.buffers.wire is torch.float16
        assert wrapped._dc.buffers.postscale == (1.0 if ours is dc.Sum else 1.0 / dc.size())
        wrapped._dc.close()
    # Min, Max and Product reduce the blocks with that op, unscaled (Note [Reduce ops]).
    for op in (hvd.Min, hvd.Max, hvd.Product):
        model, opt = model_and_opt()
        wrapped = dc.DistributedOptimizer(opt, model.named_parameters(), op=op, config=CONFIG)
        assert wrapped._dc.buffers.postscale == 1.0 and wrapped._dc.buffers.prescale == 1.0
        wrapped._dc.close()
    # Adasum combines each rank's step (Note [Adasum optimizer]); fp16 compression sends the deltas as float16.
    model, opt = model_and_opt()
    wrapped = dc.DistributedOptimizer(opt, model.named_parameters(), hvd.Compression.fp16, op=hvd.Adasum,
                                      process_set=hvd.global_process_set, config=CONFIG)
    assert wrapped._dc.wire is torch.float16 and type(wrapped._dc).__name__ == "AdasumCore"
    wrapped._dc.close()


def test_min_max_product_refuse_what_only_a_sum_means():
    """Note [Reduce ops]: DeFT's delayed sums are refused up front; a sparse gradient names the op and the fix."""
    model, opt = model_and_opt()
    with pytest.raises(ValueError, match="policy='deft'.*op=Min"):
        dc.DistributedOptimizer(opt, model.named_parameters(), op=dc.Min,
                                config=dc.Config(policy="deft", accept_delayed_updates=True))
    dc.DistributedOptimizer(opt, model.named_parameters(), op=dc.Min, config=CONFIG)._dc.close()  # nothing taken
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    wrapped = dc.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), emb.named_parameters(), op=dc.Max,
                                      config=CONFIG)
    before = emb.weight.detach().clone()
    with pytest.raises(dc.DCreditError, match=r"'weight' has a sparse gradient \(op=Max reduces dense tensors only\)"
                                              r"; pass sparse_as_dense=True"):
        emb(torch.tensor([1, 2])).sum().backward()
    assert torch.equal(emb.weight, before)
    wrapped._dc.close()
    # With sparse_as_dense=True it trains as a dense gradient would.
    emb.weight.grad = None
    wrapped = dc.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), emb.named_parameters(), op=dc.Max,
                                      sparse_as_dense=True, config=CONFIG)
    emb(torch.tensor([1, 2])).sum().backward()
    wrapped.step()
    wrapped.synchronize()
    expected = before.clone()
    expected[[1, 2]] -= 0.1
    assert torch.allclose(emb.weight.detach(), expected)
    wrapped._dc.close()


@pytest.mark.parametrize("kwargs, error, message", [
    ({"op": 7}, ValueError, "op must be"),
    ({"op": "average"}, ValueError, "op must be"),
    ({"op": True}, ValueError, "op must be"),
    ({"compression": object}, NotImplementedError, "Compression.none and Compression.fp16"),
    ({"process_set": object()}, TypeError, "process_set must be"),
    ({"process_set": [0, 0]}, ValueError, "listed twice"),
    ({"process_set": [1]}, dc.DCreditError, r"rank\(s\) \[1\] are not in this job"),
    ({"groups": 0}, ValueError, "positive number of groups"),
    ({"groups": "all"}, ValueError, "positive number of groups"),
    ({"groups": [torch.zeros(2)]}, ValueError, r"groups\[0\] must be a list"),
    ({"groups": [[1.0]]}, ValueError, "must consist of torch.Tensor"),
    ({"groups": [[torch.zeros(2)]]}, ValueError, "not a parameter of the optimizer"),
])
def test_bad_horovod_arguments_are_refused_before_anything_changes(kwargs, error, message):
    model, opt = model_and_opt()
    with pytest.raises(error, match=message):
        dc.DistributedOptimizer(opt, model.named_parameters(), config=CONFIG, **kwargs)
    dc.DistributedOptimizer(opt, model.named_parameters(), op=dc.Min, config=CONFIG)._dc.close()  # nothing taken
    wrapped = dc.DistributedOptimizer(opt, model.named_parameters(), config=CONFIG)  # nothing was left behind
    wrapped._dc.close()


def test_a_parameter_in_two_groups_is_named():
    model, opt = model_and_opt()
    w = model[0].weight
    with pytest.raises(ValueError, match=r"parameter '0.weight' appears in groups\[0\] and groups\[1\]"):
        dc.DistributedOptimizer(opt, model.named_parameters(), groups=[[w, model[0].bias], [w]], config=CONFIG)


def test_groups_become_merges_moved_to_their_last_member():
    # Six tensors of float32, one of bfloat16; ready order 5, 4, ..., 0.
    plan = fixed_plan([10, 20, 30, 40, 50, 60, 70], [4] * 7, block_bytes=32, window=1, channels=1)
    dtypes = [torch.float32] * 6 + [torch.bfloat16]
    grouped = grouping.merge_groups(plan, ((0, 4), (1, 2, 6)), dtypes)
    # (0, 4): 4 is expected before 0, so 4 moves next to 0; (1, 2, 6): 6 is another dtype, only (2, 1) merge.
    assert grouped.order == (6, 5, 3, 2, 1, 4, 0)
    assert set(grouped.merges) == {(4, 0), (2, 1)}
    for t in (0, 1, 2, 4):
        assert grouped.partition[t] == (plan.numels[t],)
    assert grouped.partition[3] == plan.partition[3]
    assert grouping.tensor_groups(3, ["a"] * 8, [None] * 8) == ((0, 1, 2), (3, 4, 5), (6, 7))


def test_a_new_optimizer_over_the_same_parameters_takes_over():
    # `opt = DistributedOptimizer(...)` again, to change optimizers mid-training: the earlier one is closed
    # (its pending updates applied), so that no gradient is taken by two sets of hooks.
    model, opt = model_and_opt()
    first = dc.DistributedOptimizer(opt, model.named_parameters(), config=CONFIG)
    model(torch.randn(2, 4)).sum().backward()
    first.step()
    second = dc.DistributedOptimizer(torch.optim.Adam(model.parameters()), model.named_parameters(), config=CONFIG)
    assert first._dc.closed and not first._dc.lazy.npending
    with pytest.raises(dc.DCreditError, match="shut down"):
        first.step()
    second.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    second.step()
    second._dc.close()


def test_an_optimizer_dropped_after_a_lazy_step_still_applies_its_updates():
    # The model's hooks keep the optimizer while updates wait (lazy.Keeper); the next forward applies them.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  model.named_parameters(), config=dataclasses.replace(CONFIG, lazy_step="on"))
    for s in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(torch.randn(5, 4, generator=torch.Generator().manual_seed(s))).pow(2).mean().backward()
            o.step()
    assert opt._dc.lazy.npending, "the last step was not lazy: this test needs the lazy path"
    gone = weakref.ref(opt)
    del opt
    assert gone() is not None, "dropped with updates pending: nothing would apply them"
    x = torch.randn(2, 4)
    assert torch.allclose(model(x), ref(x), atol=1e-6)
    gc.collect()
    assert gone() is None, "the optimizer outlived its pending updates"


def test_set_backward_passes_per_step():
    model, opt = model_and_opt()
    wrapped = dc.DistributedOptimizer(opt, model.named_parameters(), config=CONFIG)
    wrapped.set_backward_passes_per_step(2)
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
    wrapped.step()
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(dc.DCreditError, match="after a backward pass"):
        wrapped.set_backward_passes_per_step(1)
    with pytest.raises(ValueError, match="positive integer"):
        wrapped.set_backward_passes_per_step(0)
    wrapped._dc.close()


def test_horovods_state_initialisation_steps_on_zero_gradients_and_reduces_others():
    # hvd.broadcast_optimizer_state on a fresh optimizer: zero gradients, then opt.step().
    model, opt = model_and_opt(momentum=0.9)
    wrapped = dc.DistributedOptimizer(opt, model.named_parameters(), config=CONFIG)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    wrapped.step()
    assert len(wrapped.state_dict()["state"]) == 4, "the state was not created"
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    # A gradient set by hand (from torch.autograd.grad, say) is reduced at step(), as Horovod's synchronize()
    # reduces every p.grad whose hook did not fire; at a world of one the average is the gradient itself.
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    wrapped.step()
    wrapped.synchronize()
    assert all(torch.allclose(p, a - 0.1) for a, p in zip(before, model.parameters()))
    # Nothing computed or assigned since: the gradients left are applied again, as a plain second step() does
    # (momentum 0.9: the buffer becomes 0.9 * 1 + 1).
    wrapped.step()
    wrapped.synchronize()
    assert all(torch.allclose(p, a - 0.1 - 0.1 * 1.9) for a, p in zip(before, model.parameters()))
    wrapped._dc.close()


def test_horovod_broadcast_optimizer_state_on_a_fresh_wrapped_optimizer():
    hvd = pytest.importorskip("horovod.torch")
    model, opt = model_and_opt(momentum=0.9)
    wrapped = dc.DistributedOptimizer(opt, model.named_parameters(), config=CONFIG)  # joins a world of one
    hvd.init()
    try:
        hvd.broadcast_optimizer_state(wrapped, root_rank=0)
        assert len(wrapped.state_dict()["state"]) == 4
    finally:
        wrapped._dc.close()


def test_sparse_as_dense_gives_a_sparse_optimizer_its_gradient_back_sparse():
    # SparseAdam takes sparse gradients only; reduced dense, they are handed back sparse (as Horovod does).
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True)
    ref = copy.deepcopy(emb)
    opt = dc.DistributedOptimizer(torch.optim.SparseAdam(emb.parameters(), lr=0.1), emb.named_parameters(),
                                  sparse_as_dense=True, config=CONFIG)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
    for s in range(3):
        idx = torch.tensor([s, s + 1, 7])
        for m, o in ((emb, opt), (ref, ref_opt)):
            o.zero_grad()
            m(idx).pow(2).sum().backward()
            o.step()
    opt.synchronize()
    assert torch.allclose(emb.weight, ref.weight, atol=1e-6)
    opt._dc.close()
