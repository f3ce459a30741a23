"""Made-up profiles: for tests, for the planning benchmark, for simulated scale.

Nothing here is measured; a real profile comes from ``dcredit_opt.profiler``.
"""

from __future__ import annotations

import numpy as np

from .profile import Profile, TensorProfile, bytes_of


def random_profile(seed: int, num_tensors: int, *, max_numel: int = 64, numel_multiple: int = 1,
                   allow_empty: bool = False, dtypes: tuple[str, ...] = ("float32",),
                   shuffle_ready: bool = False, comm_to_compute: float | None = None) -> Profile:
    """A small random profile, reproducible from ``seed``.

    Every numel is a multiple of ``numel_multiple`` (so that blocks of that
    many elements are all equal), at most ``max_numel``; ``allow_empty`` lets
    some be 0. Times are uniform in [0, 1) s. ``alpha`` and ``beta`` are drawn
    so that communicating everything costs about ``comm_to_compute`` times
    the compute (random in [0.1, 4) when ``None``), with alpha up to half of
    one tensor's backward.
    """
    rng = np.random.default_rng(seed)
    units = max(1, max_numel // numel_multiple)
    low = 0 if allow_empty else 1
    numels = [int(rng.integers(low, units + 1)) * numel_multiple for _ in range(num_tensors)]
    tensors = [
        TensorProfile(f"t{i}", numels[i], str(rng.choice(dtypes)), i,
                      float(rng.uniform(0, 1)), float(rng.uniform(0, 1)))
        for i in range(num_tensors)
    ]
    compute = sum(t.fwd_s + t.bwd_s for t in tensors)
    total = sum(t.numel * bytes_of(t.dtype) for t in tensors)
    ratio = float(rng.uniform(0.1, 4.0)) if comm_to_compute is None else comm_to_compute
    alpha = float(rng.uniform(0, 0.5))
    beta = ratio * compute / total if total else 0.0
    ready = None
    if shuffle_ready:
        ready = [int(x) for x in rng.permutation(num_tensors)]
    return Profile(tuple(tensors), alpha, beta, 2, ready)


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
