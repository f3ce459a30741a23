"""The alpha-beta cost model of one all-reduce, its fit, and its scaling.

Every policy and the simulator price a collective of ``n`` bytes as
``alpha + beta * n`` (:func:`window_time`). The two numbers come from a
microbenchmark on the live job (:func:`fit_alpha_beta`), so they already
include whatever algorithm the backend picked at that world size. When no
measurement exists for a world size (simulated scale), they are extrapolated
with the ring all-reduce formula (:func:`scale_to_workers`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def window_time(alpha_s: float, beta_s_per_byte: float, nbytes: float) -> float:
    """Seconds for one all-reduce (or one window of concurrent ones) carrying ``nbytes`` in all."""
    return alpha_s + beta_s_per_byte * nbytes


def ring_allreduce(alpha_s: float, beta_s_per_byte: float, nbytes: float, world_size: int) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``world_size`` ranks.

    Here ``alpha_s``/``beta_s_per_byte`` are *per message on one link*: the
    ring does ``2(p-1)`` steps (reduce-scatter then all-gather), each paying
    the latency once and moving ``n/p`` bytes, so
    ``T = 2(p-1) alpha + 2(p-1)/p * n * beta``. One rank sends nothing.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    p = world_size
    return 2 * (p - 1) * alpha_s + 2 * (p - 1) / p * nbytes * beta_s_per_byte


def fit_alpha_beta(sizes_bytes: Sequence[float], times_s: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``(alpha_s, beta_s_per_byte)`` with ``times ~ alpha + beta * size``, both >= 0.

    Repeated sizes are fine (and reduce noise). A negative intercept or
    slope is not a physical network, so the fit is constrained to the
    quadrant ``alpha >= 0, beta >= 0``: when the unconstrained optimum lies
    outside, the constrained one lies on an edge (the objective is a convex
    quadratic), and the better of the two edge optima is returned.
    """
    n = np.asarray(sizes_bytes, dtype=np.float64).ravel()
    t = np.asarray(times_s, dtype=np.float64).ravel()
    if n.shape != t.shape:
        raise ValueError(f"fit_alpha_beta got {n.size} sizes but {t.size} times")
    if not (np.all(np.isfinite(n)) and np.all(np.isfinite(t))):
        raise ValueError("fit_alpha_beta: sizes and times must be finite")
    if np.any(n < 0) or np.any(t < 0):
        raise ValueError("fit_alpha_beta: sizes and times must be >= 0")
    distinct = np.unique(n)
    if distinct.size < 2:
        seen = "no sizes" if distinct.size == 0 else f"only {distinct[0]:.0f} bytes"
        raise ValueError(f"fit_alpha_beta needs at least 2 distinct message sizes to tell alpha from beta; got {seen}")
    # Centred normal equations: well conditioned even for sizes near 1e9.
    n_mean, t_mean = n.mean(), t.mean()
    dn = n - n_mean
    beta = float(np.dot(dn, t - t_mean) / np.dot(dn, dn))
    alpha = float(t_mean - beta * n_mean)
    if alpha >= 0 and beta >= 0:
        return alpha, beta

    def sse(a: float, b: float) -> float:
        r = t - (a + b * n)
        return float(np.dot(r, r))

    nn = float(np.dot(n, n))
    on_alpha_zero = (0.0, max(0.0, float(np.dot(n, t)) / nn) if nn > 0 else 0.0)
    on_beta_zero = (max(0.0, float(t_mean)), 0.0)
    return min(on_alpha_zero, on_beta_zero, key=lambda ab: sse(*ab))


def scale_to_workers(alpha_s: float, beta_s_per_byte: float, p_measured: int,
                     p_target: int) -> tuple[float, float]:
    """Extrapolate all-reduce ``(alpha_s, beta_s_per_byte)`` measured at ``p_measured`` ranks to ``p_target``.

    Assumption: the backend runs a ring all-reduce over links whose own
    latency and bandwidth do not depend on the number of ranks (a flat,
    non-blocking network). Then, by :func:`ring_allreduce`, the all-reduce
    latency grows as ``(p - 1)`` and the per-byte time as ``(p - 1) / p``;
    the per-link parameters cancel out of the ratio. Tree or hierarchical
    algorithms (NCCL at scale, latency ~ log p) and oversubscribed networks
    are not modelled: the result is pessimistic for alpha at large scale
    and optimistic for beta on a congested fabric.
    """
    if p_measured < 2:
        raise ValueError(f"p_measured must be >= 2 (one rank communicates nothing to scale from), got {p_measured}")
    if p_target < 1:
        raise ValueError(f"p_target must be >= 1, got {p_target}")
    if not (math.isfinite(alpha_s) and math.isfinite(beta_s_per_byte)) or alpha_s < 0 or beta_s_per_byte < 0:
        raise ValueError(f"alpha and beta must be finite and >= 0, got {alpha_s}, {beta_s_per_byte}")
    latency = (p_target - 1) / (p_measured - 1)
    bandwidth = ((p_target - 1) / p_target) / ((p_measured - 1) / p_measured)
    return alpha_s * latency, beta_s_per_byte * bandwidth
