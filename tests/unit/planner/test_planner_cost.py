"""The alpha-beta model: formulas, the constrained fit, scaling with the number of ranks."""

from __future__ import annotations

import numpy as np
import pytest

from dcredit_opt.planner.cost import (
    fit_alpha_beta,
    ring_allreduce,
    scale_to_workers,
    window_time,
)


def test_window_time():
    assert window_time(1e-4, 1e-9, 4e6) == pytest.approx(1e-4 + 4e-3)


def test_ring_allreduce_by_hand():
    # p = 4: 2(p-1) = 6 latencies, 2(p-1)/p = 1.5 times the bytes.
    assert ring_allreduce(1e-5, 1e-9, 1e6, 4) == pytest.approx(6e-5 + 1.5e-3)
    assert ring_allreduce(1e-5, 1e-9, 1e6, 1) == 0.0
    with pytest.raises(ValueError):
        ring_allreduce(1e-5, 1e-9, 1e6, 0)


def test_fit_recovers_alpha_beta_from_noisy_data():
    # Timer jitter of a few microseconds on 1 KB .. 10 MB all-reduces.
    rng = np.random.default_rng(0)
    alpha, beta = 50e-6, 0.8e-9
    sizes = np.repeat(np.logspace(3, 7, 9), 20)
    times = alpha + beta * sizes + rng.normal(0.0, 3e-6, sizes.size)
    a, b = fit_alpha_beta(sizes, times)
    assert a == pytest.approx(alpha, rel=0.05)
    assert b == pytest.approx(beta, rel=0.01)


def test_fit_exact_line():
    sizes = [0, 1000, 2000]
    a, b = fit_alpha_beta(sizes, [1.0, 2.0, 3.0])
    assert (a, b) == (pytest.approx(1.0), pytest.approx(1e-3))


def test_fit_clamps_negative_intercept_to_zero():
    sizes = np.array([1e3, 2e3, 3e3, 4e3])
    a, b = fit_alpha_beta(sizes, 1e-6 * sizes - 5e-4)  # a straight line through a negative intercept
    assert a == 0.0
    assert b > 0
    assert b == pytest.approx(np.dot(sizes, 1e-6 * sizes - 5e-4) / np.dot(sizes, sizes))


def test_fit_clamps_negative_slope_to_zero():
    a, b = fit_alpha_beta([1e3, 2e3, 3e3], [3.0, 2.0, 1.0])
    assert b == 0.0
    assert a == pytest.approx(2.0)


@pytest.mark.parametrize(("sizes", "times"), [([1024, 1024, 1024], [1.0, 1.1, 0.9]), ([], [])])
def test_fit_needs_two_distinct_sizes(sizes, times):
    with pytest.raises(ValueError, match="at least 2 distinct message sizes"):
        fit_alpha_beta(sizes, times)


@pytest.mark.parametrize(("sizes", "times", "message"), [
    ([1, 2], [1.0], "2 sizes but 1 times"),
    ([1, -2], [1.0, 2.0], ">= 0"),
    ([1, 2], [1.0, float("inf")], "finite"),
])
def test_fit_rejects_bad_input(sizes, times, message):
    with pytest.raises(ValueError, match=message):
        fit_alpha_beta(sizes, times)


def test_scale_follows_the_ring_formula():
    link_alpha, link_beta, n = 20e-6, 1e-9, 64e6
    measured = (ring_allreduce(link_alpha, 0.0, 1, 2), ring_allreduce(0.0, link_beta, 1, 2))
    for p in (2, 3, 16, 1024):
        alpha, beta = scale_to_workers(*measured, p_measured=2, p_target=p)
        assert window_time(alpha, beta, n) == pytest.approx(ring_allreduce(link_alpha, link_beta, n, p))
    assert scale_to_workers(1.0, 1.0, 4, 4) == (1.0, 1.0)
    assert scale_to_workers(1.0, 1.0, 4, 1) == (0.0, 0.0)


def test_scale_rejects_one_measured_rank():
    with pytest.raises(ValueError, match="p_measured must be >= 2"):
        scale_to_workers(1e-4, 1e-9, 1, 8)
    with pytest.raises(ValueError, match="p_target"):
        scale_to_workers(1e-4, 1e-9, 2, 0)
