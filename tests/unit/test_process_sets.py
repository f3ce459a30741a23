"""``dc.ProcessSet`` and ``process_set=`` in a world of one (Note [Process sets]); the sets of several ranks are
tested in tests/distributed/test_process_sets.py."""

from __future__ import annotations

import json
import time

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


# ---- the meeting of a set's ranks in the store (Note [Process sets]), with the peer's side written by hand ----


def _peer_is(store, rank: int, ranks: list, k: int, purpose: str) -> None:
    store.set(f"dcredit_opt/sets/building/{rank}", json.dumps([ranks, k, purpose]))


@pytest.mark.parametrize("theirs, words", [
    (([0, 1], 0, "optimizer"), ("rank 0 makes the set's first collective on process_set [0, 1], while rank 1 "
                                "makes a DistributedOptimizer on that set")),
    (([0, 1, 2], 0, "collectives"), "while rank 1 makes the set's first collective on process_set [0, 1, 2]"),
    (([0, 1], 1, "collectives"), "its number 1 on that set"),
])
def test_a_peer_doing_something_else_on_a_shared_set_is_a_mismatch_at_once(theirs, words):
    from dcredit_opt.world import process_sets

    store = dist.HashStore()
    _peer_is(store, 1, *theirs)
    started = time.monotonic()
    with pytest.raises(dc.MismatchError) as info:
        process_sets._meet(store, [0, 1], 0, 10.0, "collectives")
    assert words in str(info.value)
    assert time.monotonic() - started < 2.0
    # Counted out again: once the peer meets it, the same set and count (0) meet.
    _peer_is(store, 1, [0, 1], 0, "collectives")
    store.add("dcredit_opt/sets/arrived/collectives/0,1/0", 1)
    assert process_sets._meet(store, [0, 1], 0, 10.0, "collectives") == 0


def test_a_peer_that_never_comes_is_named_within_the_timeout():
    from dcredit_opt.world import process_sets

    store = dist.HashStore()
    started = time.monotonic()
    with pytest.raises(dc.CollectiveTimeout, match=r"did not come to make the set's first collective within 0.3 s \(rank 1 is not at it\)"):
        process_sets._meet(store, [0, 1], 0, 0.3, "collectives")
    assert time.monotonic() - started < 2.0


def test_the_collectives_of_a_rank_outside_the_set_are_refused_naming_it():
    for call in (lambda: dc.allreduce(torch.ones(1), process_set=dc.ProcessSet([0, 1])),
                 lambda: dc.barrier(process_set=[1])):
        with pytest.raises(dc.DCreditError, match="process_set"):
            call()
