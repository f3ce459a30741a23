"""``dc.ProcessSet`` and ``process_set=`` in a world of one (Note [Process sets]); the sets of several ranks are
tested in tests/distributed/test_process_sets.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dcredit_opt as dc

pytestmark = pytest.mark.timeout(120)

CONFIG = dc.Config(block_bytes=64, window=2, policy="fixed")


def model_and_opt():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_process_set_is_its_sorted_ranks():
    assert dc.ProcessSet([2, 0]).ranks == [0, 2]
    assert dc.ProcessSet((1,)) == dc.ProcessSet([1]) and dc.ProcessSet([0, 1]) != dc.ProcessSet([0])
    assert "ProcessSet([0, 2])" in repr(dc.ProcessSet([0, 2]))


@pytest.mark.parametrize("bad, error, message", [
    ([], ValueError, "non-empty"),
    ([0, 0], ValueError, "listed twice"),
    ([-1], ValueError, "ints >= 0"),
    ([True], ValueError, "ints >= 0"),
    (3, TypeError, "list of ranks"),
])
def test_a_bad_process_set_is_refused(bad, error, message):
    with pytest.raises(error, match=message):
        dc.ProcessSet(bad)


def test_a_set_of_this_rank_alone_trains_as_plain_training():
    model, opt = model_and_opt()
    ref_model, ref_opt = model_and_opt()
    wrapped = dc.DistributedOptimizer(opt, model.named_parameters(), process_set=dc.ProcessSet([0]), config=CONFIG)
    for step in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, wrapped), (ref_model, ref_opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    wrapped.synchronize()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.allclose(p, q)
    wrapped._dc.close()


@pytest.mark.parametrize("process_set, message", [
    ([1], r"rank\(s\) \[1\] are not in this job of 1 ranks"),
    (dist.GroupMember.NON_GROUP_MEMBER, "does not hold it"),
])
def test_a_set_this_rank_cannot_use_is_refused_naming_the_fix(process_set, message):
    model, opt = model_and_opt()
    with pytest.raises(dc.DCreditError, match=message):
        dc.DistributedOptimizer(opt, model.named_parameters(), process_set=process_set, config=CONFIG)
    opt.step()  # the optimizer is untouched


def test_the_global_process_sets_are_every_rank():
    for process_set in (None, dc.global_process_set):
        model, opt = model_and_opt()
        wrapped = dc.DistributedOptimizer(opt, model.named_parameters(), process_set=process_set, config=CONFIG)
        assert wrapped._dc.members.everyone
        wrapped._dc.close()
