"""What each rank runs in test_decoupled.py: plans whose blocks go as a reduce-scatter in backward and an
all-gather at the flush (``Plan.decoupled``, Note [Two-stage blocks] in ``csrc/core/scheduler.cc``)."""

from __future__ import annotations

import dataclasses
import random
import time

import dcredit_opt as dc
from dcredit_opt.blockops import ALL_GATHER, REDUCE_SCATTER
from dcredit_opt.optimizer.layout import fixed_plan
from dcredit_opt.planner import search
from dcredit_opt.planner.dcredit import partition_by_bytes
from dcredit_opt.planner.profile import Profile, TensorProfile

from .workers import OPTIMIZERS, _make, batch, loss_of, max_diff, reference_grads

STEPS_PER_PLAN = 5


def _plans(numels: list, itemsizes: list) -> list:
    """Every tensor decoupled (small blocks, phase 2 on); every other tensor decoupled with one window and
    phase 2 off (``step()`` waits for the all-gathers); all decoupled in one block per tensor, merged in pairs."""
    T = len(numels)
    small = fixed_plan(numels, itemsizes, 256, 2, 2)
    one_window = fixed_plan(numels, itemsizes, 1024, 1, 2, overlap_forward=False)
    whole = fixed_plan(numels, itemsizes, 1 << 20, -1, 2)
    order = whole.order
    merges = tuple(tuple(order[i:i + 2]) for i in range(0, T - 1, 2))
    return [dataclasses.replace(small, decoupled=tuple(range(T))),
            dataclasses.replace(one_window, decoupled=tuple(range(0, T, 2))),
            dataclasses.replace(whole, decoupled=tuple(range(T)), merges=merges, phase1_windows=(1,) * T)]


def _train(model, ref, opt, ropt, steps, rng, max_sleep_ms: float) -> None:
    """Steps through dcredit_opt, with a random sleep between backward and step() on each rank, beside the
    synchronous reference."""
    world, rank = dc.size(), dc.rank()
    for step in steps:
        opt.zero_grad()
        loss_of(model, batch(step, rank)).backward()
        time.sleep(rng.uniform(0, max_sleep_ms / 1000))
        opt.step()
        reference_grads(ref, step, world)
        ropt.step()


def decoupled(backend: str = "auto", horovod_first: bool = False, opt_name: str = "adam",
              max_sleep_ms: float = 15.0) -> dict:
    """Train under each plan in turn (staged at a step boundary, as a profiled plan is), with random per-rank
    sleeps so that the ranks' first stages complete in different orders; compare with the synchronous
    reference after each plan."""
    if horovod_first:
        import horovod.torch as hvd

        hvd.init()
    dc.init()
    rank = dc.rank()
    rng = random.Random(11 + 101 * rank)
    config = dc.Config(policy="fixed", block_bytes=512, window=2, channels=2, backend=backend)
    model, ref, opt, ropt = _make(opt_name, config)
    model.mid.register_forward_pre_hook(lambda module, args: time.sleep(rng.uniform(0, max_sleep_ms / 1000)))
    params = list(model.parameters())
    plans = _plans([p.numel() for p in params], [p.element_size() for p in params])
    out = {"diffs": [], "ops": [], "backend": opt._dc.backend.name}
    for k, plan in enumerate(plans):
        opt._dc.staged_plan = plan  # switched at the next backward, on every rank
        _train(model, ref, opt, ropt, range(k * STEPS_PER_PLAN, (k + 1) * STEPS_PER_PLAN), rng, max_sleep_ms)
        ops = opt._dc.buffers.layout.block_op
        out["ops"].append([ops.count(REDUCE_SCATTER), ops.count(ALL_GATHER), len(ops)])
        opt.synchronize()
        out["diffs"].append(max_diff(model, ref))
    out["checksum"] = float(sum(p.double().sum() for p in model.state_dict().values()))
    opt._dc.close()
    return out


def _planned_profile(params: list) -> Profile:
    """The same profile on every rank (fixed timings, no measurement), so that each rank plans alike."""
    tensors = tuple(TensorProfile(f"t{i}", p.numel(), str(p.dtype).removeprefix("torch."), i, 0.002, 0.004)
                    for i, p in enumerate(params))
    return Profile(tensors, alpha_s=1e-3, beta_s_per_byte=2e-6, world_size=2)


def policies(cases: list, backend: str = "auto", horovod_first: bool = False, opt_name: str = "adam",
             max_sleep_ms: float = 10.0) -> dict:
    """S1's plans on a real job, each case ``(name, phase2)``: ``dear`` is the profiled DeAR plan (the job
    measures itself, rank 0 plans, every rank switches); ``dcredit-all`` and ``dcredit-flush`` are the D-Credit
    search's decoupled candidates (every block, or those its all-reduce plan leaves for the flush), planned on
    every rank from one fixed profile and staged at a step boundary. Returns, per case, the plan's collectives
    and the worst difference from synchronous training."""
    if horovod_first:
        import horovod.torch as hvd

        hvd.init()
    dc.init()
    rank = dc.rank()
    rng = random.Random(5 + 17 * rank)
    out = {"backend": None, "cases": {}}
    for name, phase2 in cases:
        policy = "dear" if name == "dear" else "fixed"
        # A host cost below any collective's (Note [Measured host cost]): the profile's is then the one measured.
        config = dc.Config(policy=policy, profile_iters=3, block_bytes=512, window=2, channels=2,
                           overlap_forward=phase2, backend=backend, collective_host_s=1e-9)
        model, ref, opt, ropt = _make(opt_name, config)
        model.mid.register_forward_pre_hook(lambda module, args: time.sleep(rng.uniform(0, max_sleep_ms / 1000)))
        params = list(model.parameters())
        if name != "dear":
            profile = _planned_profile(params)
            base = search._layout(profile, partition_by_bytes(profile, 256), channels=2, overlap_forward=phase2)
            plan = search._decoupled_dcredit(profile, base, 256, name.removeprefix("dcredit-"), 0.0, True)
            opt._dc.staged_plan = dataclasses.replace(plan, overlap_forward=phase2)
        _train(model, ref, opt, ropt, range(12), rng, max_sleep_ms)
        opt.synchronize()
        ops = opt._dc.buffers.layout.block_op
        out["cases"][f"{name} phase2={phase2}"] = {
            "policy": opt.plan.policy, "overlap_forward": opt.plan.overlap_forward,
            "ops": [ops.count(REDUCE_SCATTER), ops.count(ALL_GATHER), len(ops)],
            "diff": max_diff(model, ref),
            # Rank 0's profile: the reduce-scatter and all-gather sweeps (profiler.measure_stage_ratios).
            "stage_ratios": list(opt.profile.stage_ratios) if opt.profile is not None else None,
            "host_s": opt.profile.host_s_per_collective if opt.profile is not None else None,
            "checksum": float(sum(p.double().sum() for p in model.state_dict().values()))}
        out["backend"] = opt._dc.backend.name
        opt._dc.close()
    return out


__all__ = ["OPTIMIZERS", "decoupled", "policies"]
