"""Note [Stream-ordered waits] (csrc/core/final_gate.h): the host side of the lazy step's wait on a GPU, as a
state machine with no CUDA in it. A block's callback marks it final once its result is enqueued (standing in
for recording its event); the waiter gets the blocks whose events its stream must wait on, once every block of
its tensors is final, or None where the scheduler's own wait must decide."""

import threading
import time

import pytest

from dcredit_opt import _ext
from dcredit_opt.errors import CollectiveTimeout

pytestmark = pytest.mark.timeout(60)

# Three tensors: tensor 0 in blocks 0 and 1 (cut in two), tensor 1 in block 1 too (a merge) and block 2,
# tensor 2 in block 3.
BLOCKS = [[0], [0, 1], [1], [2]]


def gate():
    return _ext.load().FinalGate(BLOCKS, 3)


def test_a_tensor_waits_for_every_block_that_covers_it_and_gets_each_block_once():
    g = gate()
    g.mark_final(0)
    with pytest.raises(CollectiveTimeout, match="tensor 0 not enqueued"):
        g.wait_final([0], 0.05)  # block 1 is not final yet
    assert not g.is_final(0)
    g.mark_final(1)
    assert g.is_final(0) and not g.is_final(1)
    assert g.wait_final([0], 1.0) == [0, 1]
    with pytest.raises(CollectiveTimeout, match="tensor 1 not enqueued"):
        g.wait_final([0, 1], 0.05)
    g.mark_final(2)
    assert g.wait_final([0, 1], 1.0) == [0, 1, 2]  # block 1 covers both: named once
    with pytest.raises(CollectiveTimeout, match="tensor 2"):
        g.wait_final([2], 0.05)


def test_the_waiter_wakes_when_a_callback_thread_marks_the_last_block():
    g = gate()
    g.mark_final(0)
    marker = threading.Timer(0.1, g.mark_final, args=(1,))
    marker.start()
    try:
        t0 = time.monotonic()
        assert g.wait_final([0], 30.0) == [0, 1]
        assert time.monotonic() - t0 < 25.0  # woken by the mark, not by the timeout
    finally:
        marker.cancel()


def test_a_failed_block_or_a_closed_gate_sends_the_waiter_back_to_the_scheduler():
    g = gate()
    failer = threading.Timer(0.1, g.fail)
    failer.start()
    try:
        assert g.wait_final([2], 30.0) is None
    finally:
        failer.cancel()
    g.start_iteration()  # a new iteration forgets the failure and every final flag
    with pytest.raises(CollectiveTimeout):
        g.wait_final([2], 0.05)
    g.mark_final(3)
    assert g.wait_final([2], 1.0) == [3]
    assert g.is_final(2)
    g.close()
    assert g.wait_final([0], 1.0) is None
    assert not g.is_final(2)


def test_a_new_iteration_clears_what_the_last_one_marked():
    g = gate()
    for b in range(4):
        g.mark_final(b)
    assert g.wait_final([0, 1, 2], 1.0) == [0, 1, 2, 3]
    g.start_iteration()
    with pytest.raises(CollectiveTimeout):
        g.wait_final([0], 0.05)


def test_bad_tensors_and_blocks_are_named():
    g = gate()
    with pytest.raises(IndexError, match="tensor 3 out of range"):
        g.wait_final([3], 0.05)
    g.mark_final(99)  # a block the plan does not have: ignored, as the scheduler would have refused it
    with pytest.raises(ValueError, match="block 0 covers tensor 4 of 3"):
        _ext.load().FinalGate([[4]], 3)
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        g.wait_final([0], 0.0)
