"""What each rank runs in test_replan.py: adaptive re-planning while training (planner/adaptive.py).

The world changes mid-run: from step ``change_at`` on, the backward of
``mid`` does more work, longer on rank 1 than on rank 0 (a slower model, slower on
one rank), so the compute estimate moves for real. What rank 0 plans then
depends on the simulator's verdict for this toy model, which may well be
"keep the plan"; ``forced=True`` makes rank 0's planner return a plan with
other blocks and call it faster, so that a switch surely happens and its
mechanics (the same step on every rank, an eager staging step, synchronous
results across the switch) are what is tested. ``decoupled=True`` makes
every check after a plan's baseline decide to re-plan, on every rank (the
hysteresis triggers whatever the estimates), and the forced plans decouple
every tensor, every other one, then none, in turn (two-stage blocks: a
reduce-scatter in backward, an all-gather at the flush), with ever smaller
blocks: switches run into, between and out of decoupled plans.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import torch

import dcredit_opt as dc
from dcredit_opt.blockops import REDUCE_SCATTER
from dcredit_opt.optimizer.layout import fixed_plan
from dcredit_opt.planner import adaptive
from dcredit_opt.profiling import replanner

from .workers import OPTIMIZERS, Net, _join, batch, loss_of, max_diff, reference_grads

DECOUPLED = ("all", "every other", "none")
"""Which tensors the forced plans decouple with ``decoupled=True``, in turn."""

DECOUPLED_SIZES = (512, 256, 128, 64)
"""The forced plans' block bytes with ``decoupled=True``, in turn: each plan's largest block is smaller than
the last one's, so the forced simulator calls every fresh plan the faster one."""


def _force_replans(decoupled: bool = False, always: bool = False) -> None:
    """Rank 0's planner returns equal blocks of a size that alternates between re-plans, and the simulator
    calls the plan with the smaller largest block the faster one (with ``always``, the fresh plan: every
    decision to re-plan switches). With ``decoupled``, the plans decouple the tensors of :data:`DECOUPLED`
    in turn, with the block sizes of :data:`DECOUPLED_SIZES`."""
    sizes = iter(DECOUPLED_SIZES if decoupled else [64, 512] * 100)
    splits = iter(DECOUPLED * 100)

    def make_plan(profile, policy, *, channels, overlap_forward=True):
        plan = fixed_plan(list(profile.numels), [4] * profile.num_tensors, next(sizes), 2, channels, 0,
                          overlap_forward)
        if not decoupled:
            return plan
        T, which = profile.num_tensors, next(splits)
        split = range(T) if which == "all" else range(0, T, 2) if which == "every other" else ()
        return dataclasses.replace(plan, decoupled=tuple(split))

    made: list = []

    def planned(profile, policy, **kwargs):
        made.append(make_plan(profile, policy, **kwargs))
        return made[-1]

    def iteration_time(plan, profile, channel_fifo=False):
        if always:  # the plan just made is the faster one
            return 1.0 if made and plan is made[-1] else 2.0
        return float(adaptive.largest_block(plan.partition))

    replanner.make_plan = planned
    replanner.iteration_time = iteration_time


def _force_decisions() -> None:
    """Every check with every rank's window in (after a plan's baseline) decides to re-plan."""
    adaptive.Hysteresis.update = lambda self, estimate: estimate is not None


def _slow_down(model: Net, seconds) -> None:
    """``seconds()`` of work in the backward, when ``mid.weight``'s gradient is computed: CPU time of the
    backward's thread, as a bigger model costs (a sleep would be another job holding the core, which the
    compute estimate does not count: Note [Compute in CPU time])."""

    def work(grad):
        end = time.thread_time() + seconds()
        while time.thread_time() < end:
            pass

    model.mid.weight.register_hook(work)


def _watch_checks(opts: list, seen: list) -> None:
    """The control plane taken for the GPU's (replanner.control_on_gpu): at each check's gather and each verdict's
    broadcast, whether every optimizer's scheduler had nothing in flight."""
    replanner.control_on_gpu = lambda: True
    gather, broadcast = replanner.Replanner._all_gather_async, replanner.Replanner._broadcast_text

    def idle() -> bool:
        return all(opt._dc.engine.idle() for opt in opts)

    def watched_gather(self, tensor, name):
        seen.append(idle())
        return gather(self, tensor, name)

    def watched_broadcast(self, text, root):
        seen.append(idle())
        return broadcast(self, text, root)

    replanner.Replanner._all_gather_async = watched_gather
    replanner.Replanner._broadcast_text = watched_broadcast


def _step(model: Net, opts: list, passes: int, step: int, rank: int) -> list:
    """One training step through every optimizer; for each that re-planned in it, whether its staging step()
    applied every update (nothing waits in the old slots)."""
    for opt in opts:
        opt.zero_grad()
    for k in range(passes):
        loss_of(model, batch(step * passes + k, rank)).backward()
    before = [len(opt.replans) for opt in opts]
    for opt in opts:
        opt.step()
    return [opt._dc.lazy.npending == 0 for opt, n in zip(opts, before) if len(opt.replans) > n]


def train(steps: int = 24, change_at: int = 9, passes: int = 1, optimizers: int = 1, forced: bool = True,
          replan_every: int = 3, work_ms: tuple = (15, 30), timeline_path: str | None = None,
          gpu_control: bool = False, decoupled: bool = False, backend: str = "auto",
          horovod_first: bool = False) -> dict:
    """Train through the change; the re-plans each optimizer recorded, and the worst difference from
    synchronous training. ``gpu_control``: as if the control plane were on the GPU, recording whether the
    blocks were all done at each check's collective. ``decoupled``: the forced plans decouple blocks
    (module docstring). ``backend``: ``Config.backend``, with ``horovod_first`` as in ``workers._join``;
    the result names the backend the blocks went through, and each step's reduce-scatters and blocks."""
    _join(horovod_first)
    world, rank = dc.size(), dc.rank()
    if forced and rank == 0:
        _force_replans(decoupled)
    if decoupled:
        _force_decisions()
    quiet: list = []
    opts: list = []
    if gpu_control:
        _watch_checks(opts, quiet)
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    now = {"step": 0}
    _slow_down(model, lambda: work_ms[rank % len(work_ms)] / 1000 if now["step"] >= change_at else 0.0)
    config = dc.Config(policy="dcredit", profile_iters=3, replan_every=replan_every, replan_threshold=0.2,
                       channels=2, timeline_path=timeline_path, backend=backend)
    named = list(model.named_parameters())
    if optimizers == 1:
        parts = [named]
    else:
        parts = [[(n, p) for n, p in named if n.startswith(("inp", "mid"))],
                 [(n, p) for n, p in named if not n.startswith(("inp", "mid"))]]
    opts += [dc.DistributedOptimizer(OPTIMIZERS["sgd"]([p for _, p in part]), named_parameters=part,
                                     backward_passes_per_step=passes, config=config) for part in parts]
    ref_params = dict(ref.named_parameters())
    ropts = [OPTIMIZERS["sgd"]([ref_params[n] for n, _ in part]) for part in parts]
    staged_eagerly, ops = [], []
    for step in range(steps):
        now["step"] = step
        staged_eagerly += _step(model, opts, passes, step, rank)
        layouts = [opt._dc.buffers.layout.block_op for opt in opts]
        ops.append([[kinds.count(REDUCE_SCATTER), len(kinds)] for kinds in layouts])
        reference_grads(ref, step, world, passes=passes)
        for ropt in ropts:
            ropt.step()
    for opt in opts:
        opt.synchronize()
    out = {"diff": max_diff(model, ref), "replans": [[r.to_dict() for r in opt.replans] for opt in opts],
           "staged_eagerly": staged_eagerly, "plans": [opt.plan.to_dict() for opt in opts], "quiet_checks": quiet,
           "backend": opts[0]._dc.backend.name, "ops": ops}
    dc.shutdown()
    return out


def _skew_windows(rng) -> None:
    """Each window this rank sends is skewed at random before it leaves: its link time and backward span
    scaled by factors drawn per window (half of them 1.0, the rest in [0.5, 2]), as a rank with other local
    timings would measure them."""
    take = adaptive.WindowRecorder.take

    def factor() -> float:
        return 1.0 if rng.random() < 0.5 else rng.uniform(0.5, 2.0)

    def skewed(self):
        w = take(self)
        if w is None:
            return None
        return dataclasses.replace(w, busy_s=w.busy_s * factor(),
                                   span_s=None if w.span_s is None else w.span_s * factor(),
                                   cpu_s=None if w.cpu_s is None else w.cpu_s * factor())

    adaptive.WindowRecorder.take = skewed


def _record_estimates(seen: list) -> None:
    """Every estimate any check computes (what the gathered windows say), in order."""
    combine = adaptive.combine

    def recorded(base, now, reference=None):
        est = combine(base, now, reference)
        seen.append(None if est is None else [est.compute, est.link, est.beta, est.link_rank])
        return est

    adaptive.combine = recorded


def random_timings(seeds: tuple = tuple(range(1, 7)), steps: int = 24) -> list:
    """For each seed: a job whose shape (backward passes per step, one or two optimizers, the check interval)
    the seed draws, the same on every rank, and whose timings each rank draws on its own: work in the
    backward that jumps between levels at random steps, and windows skewed at random before they are
    gathered (:func:`_skew_windows`). Odd seeds plan with rank 0's forced planner (:func:`_force_replans`:
    every decision to re-plan switches), even ones with the real planner. Per seed: every estimate the checks
    computed, each optimizer's re-plans and its plan at every step, the worst difference from synchronous
    training, and whether each staging step was eager."""
    import random

    dc.init()
    world, rank = dc.size(), dc.rank()
    originals = (replanner.make_plan, replanner.iteration_time, adaptive.WindowRecorder.take, adaptive.combine)
    out = []
    for seed in seeds:
        shared, own = random.Random(seed), random.Random(1000 * seed + rank)
        passes, optimizers, every = shared.choice((1, 2)), shared.choice((1, 2)), shared.choice((2, 3, 4))
        replanner.make_plan, replanner.iteration_time, adaptive.WindowRecorder.take, adaptive.combine = originals
        if seed % 2 and rank == 0:
            _force_replans(always=True)
        _skew_windows(own)
        estimates: list = []
        _record_estimates(estimates)
        torch.manual_seed(seed)
        model = Net()
        ref = copy.deepcopy(model)
        level = {"ms": 0.0}
        _slow_down(model, lambda level=level: level["ms"] / 1000)
        config = dc.Config(policy="dcredit", profile_iters=3, replan_every=every, replan_threshold=0.1, channels=2)
        named = list(model.named_parameters())
        parts = [named] if optimizers == 1 else [named[:4], named[4:]]
        opts = [dc.DistributedOptimizer(OPTIMIZERS["sgd"]([p for _, p in part]), named_parameters=part,
                                        backward_passes_per_step=passes, config=config) for part in parts]
        ref_params = dict(ref.named_parameters())
        ropts = [OPTIMIZERS["sgd"]([ref_params[n] for n, _ in part]) for part in parts]
        plans, eager = [], []
        for step in range(steps):
            if own.random() < 0.3:
                level["ms"] = own.choice((0.0, 2.0, 6.0, 12.0))
            eager += _step(model, opts, passes, step, rank)
            plans.append([opt.plan.to_dict() for opt in opts])
            reference_grads(ref, step, world, passes=passes)
            for ropt in ropts:
                ropt.step()
        for opt in opts:
            opt.synchronize()
        out.append({"seed": seed, "shape": [passes, optimizers, every], "estimates": estimates,
                    "replans": [[r.iteration for r in opt.replans] for opt in opts], "plans": plans,
                    "diff": max_diff(model, ref), "staged_eagerly": eager})
        for opt in opts:
            opt._dc.close()
    replanner.make_plan, replanner.iteration_time, adaptive.WindowRecorder.take, adaptive.combine = originals
    dc.shutdown()
    return out
