"""Made-up profiles: a model-shaped one, for the planning benchmark and the search's tests.

Nothing here is measured; a real profile comes from ``dcredit_opt.profiler``.
"""

from __future__ import annotations

import numpy as np

from .profile import Profile, TensorProfile


def model_like_profile(num_tensors: int, *, seed: int = 0, total_params: int = 100_000_000,
                       compute_to_comm: float = 1.0, alpha_s: float = 50e-6, link_gbit_s: float = 10.0,
                       world_size: int = 8) -> Profile:
    """A deep-network-shaped profile with ``num_tensors`` float32 tensors.

    Sizes are log-normal, with small tensors (biases, norms) between the
    weights as in real models. Each tensor's forward time is proportional to
    its size plus a fixed per-layer cost, backward twice the forward, all
    scaled so that compute is ``compute_to_comm`` times the time of one
    all-reduce of every gradient. alpha/beta are a ring all-reduce on
    ``link_gbit_s`` links at ``world_size`` ranks.
    """
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(mean=0.0, sigma=1.5, size=num_tensors)
    raw[1::2] *= 1e-3
    numels = np.maximum(1, np.round(raw / raw.sum() * total_params)).astype(np.int64)
    p = world_size
    alpha = 2 * (p - 1) * alpha_s
    beta = 2 * (p - 1) / p * 8.0 / (link_gbit_s * 1e9)
    comm = alpha + beta * 4 * float(numels.sum())
    work = numels + 0.05 * float(numels.mean())
    fwd = work / work.sum() * (compute_to_comm * comm / 3.0)
    tensors = tuple(
        TensorProfile(f"layer{i // 2}.{'bias' if i % 2 else 'weight'}", int(n), "float32", i, float(f), 2.0 * float(f))
        for i, (n, f) in enumerate(zip(numels, fwd)))
    return Profile(tensors, alpha, beta, world_size)
