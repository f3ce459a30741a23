"""Re-planning while training: the runtime's side of planner/adaptive.py.

One :class:`Replanner` per optimizer, owner of its state (nothing else reads
its private fields). The optimizer calls it at two points:

- :meth:`Replanner.observe` at the start of each iteration, where the last
  iteration's blocks have all finished: on the few iterations a window
  observes (the last :data:`SAMPLES` before each check), it reads the
  scheduler's trace and ready times; on the others it costs one ``if``
  (and, on a CPU, one read of the thread's CPU clock: the backward starts
  here, Note [Compute in CPU time] in planner/adaptive.py).
- :meth:`Replanner.check` in each ``step()`` once the first plan is in force,
  before the step decides whether it may be lazy. Every ``Config.replan_every``
  steps of a plan, every rank sends its window to every rank (one small
  all-gather of JSON text) and computes the same decision from what it
  received. When the hysteresis triggers, rank 0 plans on the rescaled
  profile and broadcasts the plan (or "keep") as JSON, as the first plan is
  agreed on (``profiler.agree_on_plan``). A plan returned here is staged by
  the optimizer exactly as the first plan is: the staging ``step()`` is
  eager, and every rank switches at the start of the next iteration.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time

from ..config import Config
from ..planner import adaptive
from ..planner.plan import Plan, validate
from ..planner.simulate import iteration_time
from ..world import control, runtime
from .planning import CHANNEL_FIFO, make_plan

log = logging.getLogger("dcredit_opt")

PATIENCE = 2
"""Checks in a row at which an estimate must have moved beyond ``Config.replan_threshold`` before rank 0
re-plans (with the default ``replan_every``, a change is acted on about 20 iterations after it happens)."""

SAMPLES = 4
"""Iterations observed per check window (its last ones): the watching's cost is this share of the
iterations, each one trace read and a few numpy operations over its blocks."""

NOT_REPLANNED = ("deft",)
"""Policies that are not re-planned while training: a DeFT plan switch drops the delayed sum in flight."""


def control_on_gpu() -> bool:
    """Whether the control plane's collectives run on the GPU (the default group is NCCL's).

    There they go on the default group's communicator, beside our channels' communicators, issued by the
    training thread in no fixed order with the blocks our launching thread issues; concurrent NCCL
    communicators can deadlock when their kernels meet in different orders on different ranks. So there a
    check first waits until this step's blocks are done."""
    return control.control_device().type == "cuda"


def wanted(config: Config, world_size: int, has_params: bool) -> bool:
    """Whether an optimizer with ``config`` re-plans: a planned policy, profiling on, more than one rank."""
    return (config.replan_every > 0 and config.policy != "fixed" and config.policy not in NOT_REPLANNED
            and config.profile_iters > 0 and world_size > 1 and has_params)


class Replanner:
    """Watches one optimizer's blocks and backward, and re-plans with the other ranks (module docstring)."""

    def __init__(self, config: Config, dtypes, plane=None, cpu_clock: bool = False):
        self._config = config
        # Note [Compute in CPU time]: on a CPU the backward is read in the CPU time of its thread, from the
        # iteration's start (observe()) to its step() (check()).
        self._cpu_clock = cpu_clock
        self._opened: tuple[int, float] | None = None  # (thread, its CPU seconds) where this iteration opened
        self._cpu_s: float | None = None  # the CPU seconds of the iteration that just ended
        self._plane = plane  # a process set's ranks (Note [Process sets]); None: every rank
        self._every = config.replan_every
        self._samples = max(1, min(SAMPLES, self._every - 1))
        self._threshold = config.replan_threshold
        self._dtypes = list(dtypes)
        self._hysteresis = adaptive.Hysteresis(self._threshold, PATIENCE)
        self._window = adaptive.WindowRecorder()
        self._plan = None  # the plan in force whose steps are counted
        self._steps = 0  # step() calls since it took effect
        self._observe_next = False  # the iteration that just ended is observed at the next start
        self._base = None  # every rank's baseline window of this plan (gathered, the same everywhere)
        # the windows the profile's compute stands for, across plans (Note [Compute across a switch])
        self._reference = None
        self._profile = None  # rank 0: the profile the plan in force was made for, rescaled at each decision
        self._off = False  # rank 0 failed to plan once: said, and re-planning stops on every rank
        self._replans: list[adaptive.Replan] = []
        self._quiet_first = control_on_gpu()

    @property
    def replans(self) -> list[adaptive.Replan]:
        """Every re-plan so far, oldest first (a copy)."""
        return list(self._replans)

    def observe(self, engine, block_bytes) -> None:
        """At the start of an iteration (the last one's blocks all finished): read it if the window wants it."""
        if self._observe_next:
            self._observe_next = False
            self._window.add(engine.trace(), block_bytes, engine.ready_times(), self._cpu_s)
        if self._cpu_clock:
            self._opened = (threading.get_ident(), time.thread_time())

    def _backward_cpu_s(self) -> float | None:
        """In ``step()``: this thread's CPU seconds since the iteration opened on it, or None (not read there)."""
        opened, self._opened = self._opened, None
        if opened is None or opened[0] != threading.get_ident():
            return None
        return time.thread_time() - opened[1]

    def check(self, iteration: int, plan: Plan, profile, numels, timeline=None, wait_blocks=None) -> Plan | None:
        """Once per ``step()`` with a planned plan in force: the plan to stage now, or None.

        ``plan`` is the plan in force, ``profile`` what profiling measured (rank 0; None elsewhere),
        ``numels()`` the elements each tensor has in blocks now (called only when re-planning), ``iteration``
        the optimizer's iteration (for the record), ``timeline`` the optimizer's ``RankTimeline`` or None,
        ``wait_blocks()`` waits until this step's blocks are done (called before a check's collectives when the
        control plane is on the GPU). Collective every ``replan_every`` steps of a plan: every rank calls it at
        the same steps.
        """
        if self._off:
            return None
        self._cpu_s = self._backward_cpu_s() if self._cpu_clock else None
        if plan is not self._plan:  # a new plan: a new baseline
            self._plan, self._steps, self._base = plan, 0, None
            self._window.take()
            self._hysteresis.reset()
        if self._profile is None:
            self._profile = profile
        self._steps += 1
        position = self._steps % self._every
        self._observe_next = self._steps > 1 and position >= self._every - self._samples
        if position:
            return None
        if self._quiet_first and wait_blocks is not None:
            wait_blocks()
        return self._decide(iteration, plan, numels, timeline)

    # ---- the check ------------------------------------------------------------------------------------------

    def _decide(self, iteration: int, plan: Plan, numels, timeline) -> Plan | None:
        mine = self._window.take()
        gathered = control.all_gather_text(json.dumps(None if mine is None else mine.to_dict()), "replan.window",
                                           plane=self._plane)
        windows = [None if w is None else adaptive.Window.from_dict(w) for w in map(json.loads, gathered)]
        base = self._base
        if base is None:  # this plan's baseline; its compute is already compared (Note [Compute across a switch])
            if not all(w is not None for w in windows):
                return None
            self._base = windows
            if self._reference is None:
                self._reference = windows
                return None
        estimate = adaptive.combine(base, windows, self._reference)
        if not self._hysteresis.update(estimate):
            return None
        self._hysteresis.reset()
        first = self._rank() == 0
        text = self._plan_on_rank0(plan, estimate, numels) if first else None
        data = json.loads(control.broadcast_text(text, 0, plane=self._plane))
        if "error" in data:
            self._off = True
            log.warning("dcredit_opt: re-planning stops for this optimizer: rank 0 could not re-plan with policy "
                        "%r: %s; the plan in force stays", self._config.policy, data["error"])
            return None
        if first:
            self._profile = adaptive.rescale(self._profile, estimate)
        self._reference = windows  # the rescaled profile's compute is what these windows measured
        old_s, new_s = data["old_s"], data["new_s"]
        if "plan" not in data:  # not worth a switch: these estimates are the new normal
            self._base = windows
            if first:
                log.info("dcredit_opt: iteration %d: estimates moved (%s), but a fresh plan is predicted at %.1f ms "
                         "against %.1f ms for the plan in force: kept", iteration, data["reason"], new_s * 1e3,
                         old_s * 1e3)
            return None
        fresh = Plan.from_dict(data["plan"])
        record = adaptive.Replan(iteration=iteration, reason=data["reason"], compute=estimate.compute,
                                 link=estimate.link, predicted_old_s=old_s, predicted_new_s=new_s,
                                 largest_block=(adaptive.largest_block(plan.partition),
                                                adaptive.largest_block(fresh.partition)))
        self._replans.append(record)
        if first:
            log.info("dcredit_opt: re-plan %d at iteration %d: %s; predicted iteration %.1f ms with the plan in "
                     "force, %.1f ms with the new one, which every rank switches to at the next iteration",
                     len(self._replans), iteration, record.reason, old_s * 1e3, new_s * 1e3)
        if timeline is not None:
            timeline.mark("re-plan", record.to_dict())
        return fresh

    def _rank(self) -> int:
        return runtime.rank() if self._plane is None else self._plane.rank

    def _plan_on_rank0(self, plan: Plan, estimate: adaptive.Estimate, numels) -> str:
        """Rank 0: the fresh plan for the rescaled profile, if worth a switch, as JSON for every rank."""
        config = self._config
        try:
            if self._profile is None:
                raise ValueError("no profile to rescale (profiling measured nothing)")
            profile = adaptive.rescale(self._profile, estimate)
            fresh = make_plan(profile, config.policy, channels=config.channels, overlap_forward=config.overlap_forward)
            validate(fresh, numels=numels(), max_channels=config.channels, dtypes=self._dtypes)
            new_s = iteration_time(fresh, profile, channel_fifo=CHANNEL_FIFO)
            try:
                old_s = iteration_time(plan, profile, channel_fifo=CHANNEL_FIFO)
            except ValueError:  # the plan in force no longer fits the profile (rows taken out since): unknown
                old_s = math.inf
            data = {"reason": adaptive.describe(estimate, self._threshold), "old_s": old_s, "new_s": new_s}
            if fresh != plan and adaptive.worth_switching(old_s, new_s, self._threshold):
                data["plan"] = fresh.to_dict()
            return json.dumps(data)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, or the others would wait
            return json.dumps({"error": f"{type(e).__name__}: {e}"})
