"""The profiler's network sweeps, on a fake clock: an all-reduce line fitted exactly, and the reduce-scatter's
and all-gather's costs as ratios of it (``Profile.stage_ratios``), clamped where the sweep is noise."""

from __future__ import annotations

import pytest
import torch

from dcredit_opt.planner.profile import RING_STAGE_RATIOS
from dcredit_opt.profiling import profiler


class FakeClock:
    """``time.perf_counter`` for the profiler: each fake collective advances it by its own line."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def collective(self, alpha: float, beta: float, calls: list):
        def run(buf: torch.Tensor) -> None:
            calls.append(buf.numel())
            self.now += alpha + beta * buf.numel() * buf.element_size()
        return run


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(profiler.time, "perf_counter", fake)
    return fake


def test_all_reduce_sweep_fits_its_line(clock):
    calls: list = []
    alpha, beta, samples = profiler.measure_alpha_beta(clock.collective(1e-4, 8e-9, calls), lambda: None,
                                                       torch.device("cpu"))
    assert (alpha, beta) == pytest.approx((1e-4, 8e-9))
    assert [n for n, _ in samples] == list(profiler.SWEEP_BYTES)


def test_stage_ratios_are_each_collectives_line_over_the_all_reduces(clock):
    # Gloo-like: a reduce-scatter dearer than the all-reduce, an all-gather at 0.4 of its start-up and 0.7 of
    # its per-byte time.
    rs_calls: list = []
    ag_calls: list = []
    ratios = profiler.measure_stage_ratios(
        (clock.collective(1.1e-4, 8.8e-9, rs_calls), clock.collective(0.4e-4, 5.6e-9, ag_calls)), lambda: None,
        torch.device("cpu"), 3, 1e-4, 8e-9)
    assert ratios == pytest.approx((1.1, 1.1, 0.4, 0.7))
    # Buffers whose length the world size divides, one warm-up and SWEEP_REPEATS timed calls per size.
    assert all(n % 3 == 0 for n in rs_calls + ag_calls)
    assert len(rs_calls) == len(ag_calls) == len(profiler.STAGE_SWEEP_BYTES) * (1 + profiler.SWEEP_REPEATS)


def test_stage_ratios_are_clamped_and_fall_back_to_the_ring_without_a_whole(clock):
    low, high = profiler.STAGE_RATIO_RANGE
    ratios = profiler.measure_stage_ratios(
        (clock.collective(1.0, 0.0, []), clock.collective(0.0, 1e-15, [])), lambda: None,
        torch.device("cpu"), 2, 1e-4, 8e-9)
    assert ratios == pytest.approx((high, low, low, low))
    # A link without start-up or per-byte cost to compare with: the ring formula's halves.
    assert profiler.measure_stage_ratios(
        (clock.collective(1e-4, 1e-9, []), clock.collective(1e-4, 1e-9, [])), lambda: None,
        torch.device("cpu"), 2, 0.0, 0.0) == RING_STAGE_RATIOS


def test_host_cost_per_collective_is_the_processs_cpu_per_small_all_reduce(monkeypatch):
    # Note [Measured host cost]: each all-reduce costs the process 300 us of CPU, but one run of the three
    # meets 4 ms of it elsewhere (a burst on another thread): the median run's share per collective.
    cpu = {"now": 0.0, "runs": 0}
    calls: list = []

    def allreduce(buf):
        calls.append(buf.numel())
        cpu["now"] += 300e-6

    def barrier():
        cpu["runs"] += 1
        if cpu["runs"] == 2:
            cpu["now"] += 4e-3

    monkeypatch.setattr(profiler.time, "process_time", lambda: cpu["now"])
    assert profiler.measure_host_per_collective(allreduce, barrier) == pytest.approx(300e-6)
    assert calls == [profiler.HOST_SWEEP_BYTES // 4] * (1 + 3 * profiler.HOST_SWEEP_REPEATS)
