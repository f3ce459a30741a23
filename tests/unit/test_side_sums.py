"""Note [Side sums] (csrc/torch/side_sums.h): the side group's sums are started from C++ on the calling thread, in
the order of the calls, and waited for through their tickets; anything else started on that group comes after them.
Two ranks here are two threads of this process, each with its own Gloo group over one store."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from dcredit_opt import _ext
from dcredit_opt.errors import CollectiveError, CollectiveTimeout

C = _ext.load()


def _groups(world: int = 2):
    """``world`` process groups over one in-memory store, made at once (each waits for the others)."""
    store = dist.HashStore()
    groups = [None] * world

    def make(rank: int) -> None:
        gloo = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=30))
        group = dist.ProcessGroup(store, rank, world)
        group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        groups[rank] = group

    threads = [threading.Thread(target=make, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(g is not None for g in groups), "the groups did not form"
    return groups


def _on_ranks(work, world: int = 2):
    """``work(rank)`` on one thread per rank; the first exception raised is raised here."""
    errors = []

    def run(rank: int) -> None:
        try:
            work(rank)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]


def test_sums_start_in_the_order_of_the_calls_and_come_back_through_their_tickets():
    groups = _groups()
    sums = [C.SideSums(g) for g in groups]
    tensors = [[torch.tensor([1 + r, 2], dtype=torch.int32), torch.full((5,), 0.5 * (r + 1)),
                torch.arange(3, dtype=torch.int64) * (r + 1)] for r in range(2)]

    def rank(r: int) -> None:
        tickets = [sums[r].start(t) for t in tensors[r]]  # three in flight at once, of three dtypes
        for ticket in reversed(tickets):
            sums[r].wait(ticket, 20.0)
        sums[r].wait(tickets[0], 0.001)  # a ticket waited for already: at once

    _on_ranks(rank)
    for r in range(2):
        assert tensors[r][0].tolist() == [3, 4]
        assert tensors[r][1].tolist() == [1.5] * 5
        assert tensors[r][2].tolist() == [0, 3, 6]
    for s in sums:
        s.close()


def test_a_wait_times_out_while_the_peer_has_not_started_and_the_sum_still_finishes():
    groups = _groups()
    s0, s1 = C.SideSums(groups[0]), C.SideSums(groups[1])
    a0, a1 = torch.ones(4), torch.full((4,), 2.0)
    ticket = s0.start(a0)
    with pytest.raises(CollectiveTimeout, match="did not finish within 0.2 s"):
        s0.wait(ticket, 0.2)
    assert isinstance(CollectiveTimeout("x"), TimeoutError)
    other = s1.start(a1)
    s0.wait(ticket, 20.0)  # the same ticket, waited for again once the peer has started
    s1.wait(other, 20.0)
    assert a0.tolist() == a1.tolist() == [3.0] * 4
    s0.close()
    s1.close()


def test_what_the_training_thread_starts_itself_on_the_group_pairs_with_the_peers_after_the_sums():
    groups = _groups()
    sums = [C.SideSums(g) for g in groups]
    started = [torch.full((8,), float(r + 1)) for r in range(2)]
    direct = [torch.full((2,), 10.0 * (r + 1)) for r in range(2)]

    def rank(r: int) -> None:
        ticket = sums[r].start(started[r])
        groups[r].allreduce([direct[r]]).wait(datetime.timedelta(seconds=20))  # second on the group, on both ranks
        sums[r].wait(ticket, 20.0)

    _on_ranks(rank)
    for r in range(2):
        assert started[r].tolist() == [3.0] * 8
        assert direct[r].tolist() == [30.0, 30.0]
    for s in sums:
        s.close()


def test_close_refuses_more_and_a_sum_in_flight_still_finishes():
    groups = _groups()
    s0, s1 = C.SideSums(groups[0]), C.SideSums(groups[1])
    a0, a1 = torch.ones(3), torch.ones(3)
    t0 = s0.start(a0)
    s0.close()
    s0.close()  # idempotent
    with pytest.raises(CollectiveError, match="the side group is closed"):
        s0.start(torch.ones(3))
    t1 = s1.start(a1)
    s1.wait(t1, 20.0)
    s0.wait(t0, 20.0)  # a sum in flight at close finishes, and can be waited for
    assert a0.tolist() == a1.tolist() == [2.0] * 3
    s1.close()


def test_a_tensor_it_cannot_sum_is_refused_at_once():
    (group,) = _groups(1)
    sums = C.SideSums(group)
    for bad in (torch.ones(4, 4).t(), torch.ones(2).to_sparse()):
        with pytest.raises(ValueError, match="a dense contiguous CPU tensor"):
            sums.start(bad)
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        sums.wait(0, 0.0)
    ok = torch.ones(2)
    sums.wait(sums.start(ok), 20.0)  # nothing started by the refusals: the next ticket is the next sum
    assert ok.tolist() == [1.0, 1.0]
    sums.close()


def _turn_inputs(r: int):
    """Rank ``r``'s part of a tally of three tensors: its used flags, its rows proposal (two per tensor) and the
    int32 tensor they are written into (with two more values: an update count and its square)."""
    used = memoryview(bytearray([1, r, 1])).cast("B")
    tail = memoryview(bytearray(24)).cast("i")
    tail[0] = 1
    return used, tail, torch.full((3 + 6 + 2,), -7, dtype=torch.int32)


def test_a_tally_turn_writes_waits_for_the_last_starts_the_next_and_clears_the_flags():
    groups = _groups()
    sums = [C.SideSums(g) for g in groups]
    firsts, seconds = {}, {}

    def rank(r: int) -> None:
        used, tail, first = _turn_inputs(r)
        ticket = sums[r].turn_tally(-1, first, used, tail, [5, 25], None, 9, [], 2, 20.0)  # no tally before it
        assert ticket >= 0 and bytes(used) == b"\0\0\0"  # started; the flags ready for the next iteration
        used[1] = 1
        second = torch.zeros(11, dtype=torch.int32)
        # The next turn waits for the first, finds both ranks sent 5 (sum 10, squares 50), and starts itself.
        nxt = sums[r].turn_tally(ticket, second, used, tail, [6, 36], first, 9, [5], 2, 20.0)
        assert nxt >= 0
        sums[r].wait(nxt, 20.0)
        firsts[r], seconds[r] = first.tolist(), second.tolist()

    _on_ranks(rank)
    for r in range(2):
        assert firsts[r] == [2, 1, 2, 2, 0, 0, 0, 0, 0, 10, 50]  # rank 1 used the middle tensor, rank 0 did not
        assert seconds[r] == [0, 2, 0, 2, 0, 0, 0, 0, 0, 12, 72]
    for s in sums:
        s.close()


def test_a_tally_turn_whose_last_sums_show_another_count_starts_nothing_on_any_rank():
    groups = _groups()
    sums = [C.SideSums(g) for g in groups]
    got = {}

    def rank(r: int) -> None:
        used, tail, first = _turn_inputs(r)
        count = 5 + r  # rank 1 took one update more
        ticket = sums[r].turn_tally(-1, first, used, tail, [count, count * count], None, 9, [], 2, 20.0)
        used[0] = 1
        second = torch.zeros(11, dtype=torch.int32)
        got[r] = sums[r].turn_tally(ticket, second, used, tail, [6, 36], first, 9, [count], 2, 20.0)
        assert used[0] == 1, "a turn that started nothing left the flags as they were"
        # Nothing was started on either rank: a sum both start now pairs with the peer's, not with a tally.
        probe = torch.full((2,), float(r + 1))
        sums[r].wait(sums[r].start(probe), 20.0)
        assert probe.tolist() == [3.0, 3.0]

    _on_ranks(rank)
    assert got == {0: -1, 1: -1}
    for s in sums:
        s.close()


def test_a_tally_turn_refuses_what_it_cannot_read_before_starting_anything():
    (group,) = _groups(1)
    sums = C.SideSums(group)
    used, tail, out = _turn_inputs(0)
    with pytest.raises(ValueError, match="fill_tally: out must be a contiguous int32 CPU tensor of 11 values"):
        sums.turn_tally(-1, torch.zeros(10, dtype=torch.int32), used, tail, [1, 1], None, 9, [], 1, 20.0)
    with pytest.raises(ValueError, match="summed must be a contiguous int32 CPU tensor of at least 11 values"):
        sums.turn_tally(-1, out, used, tail, [1, 1], torch.zeros(10, dtype=torch.int32), 9, [1], 1, 20.0)
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        sums.turn_tally(-1, out, used, tail, [1, 1], None, 9, [], 1, 0.0)
    with pytest.raises(BufferError):
        sums.turn_tally(-1, out, bytes(used), tail, [1, 1], None, 9, [], 1, 20.0)  # flags it could not clear
    assert bytes(used) == b"\1\0\1"
    ticket = sums.turn_tally(-1, out, used, tail, [1, 1], None, 9, [], 1, 20.0)  # nothing started before: this pairs
    sums.wait(ticket, 20.0)
    assert out.tolist() == [1, 0, 1, 1, 0, 0, 0, 0, 0, 1, 1]
    sums.close()
