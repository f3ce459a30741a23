"""Rank 0's CPU by kind of thread (benchmarks/cpu_use.py)."""

import sys
import threading
import time

import pytest

from benchmarks import cpu_use

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task (Linux)")


def test_threads_are_sorted_by_name_and_the_training_thread_by_id():
    assert cpu_use.kind_of(7, "python", 7) == "training"
    assert cpu_use.kind_of(8, "gloo_tcp_loop", 7) == "library"
    assert cpu_use.kind_of(9, "pt_gloo_runloop", 7) == "library"
    assert cpu_use.kind_of(10, "pt_nccl_watchdg", 7) == "library"
    assert cpu_use.kind_of(11, "dc_dispatch", 7) == "dcredit_opt"
    assert cpu_use.kind_of(12, "python", 7) == "other"


def test_differences_per_kind_count_threads_that_started_in_between_from_zero():
    before = {7: ("python", 1.0), 8: ("gloo_tcp_loop", 0.5)}
    after = {7: ("python", 3.0), 8: ("gloo_tcp_loop", 0.75), 11: ("dc_dispatch", 0.25)}
    assert cpu_use.cpu_by_kind(before, after, 7) == {"training": 2.0, "library": 0.25, "dcredit_opt": 0.25,
                                                     "other": 0.0}
    assert cpu_use.cpu_by_kind({}, after, 7) == {}  # nothing read at the start: nothing claimed


@linux_only
def test_a_busy_thread_shows_its_own_cpu_under_its_name():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=spin)
    before = cpu_use.thread_cpu_s()
    t.start()
    deadline = time.monotonic() + 10
    try:
        while time.monotonic() < deadline:  # until the spinning thread has 0.05 s of CPU to show (busy machines)
            after = cpu_use.thread_cpu_s()
            if after.get(t.native_id, ("", 0.0))[1] >= 0.05:
                break
            time.sleep(0.02)
    finally:
        stop.set()
        t.join()
    assert after[t.native_id][1] >= 0.05
    assert threading.get_native_id() in before
    assert cpu_use.cpu_by_kind(before, after, threading.get_native_id())["other"] >= 0.05
