"""Re-planning while training: the runtime's side of planner/adaptive.py.

One :class:`Replanner` per optimizer, owner of its state (nothing else reads
its private fields). The optimizer calls it at three points:

- :meth:`Replanner.observe` at the start of each iteration, where the last
  iteration's blocks have all finished: on the few iterations a window
  observes (the last :data:`SAMPLES` before each check), it reads the
  scheduler's trace and ready times; on the others it costs one ``if``
  (and, on a CPU, one read of the thread's CPU clock: the backward starts
  here, Note [Compute in CPU time] in planner/adaptive.py).
- :meth:`Replanner.profiled` in each ``step()`` while the job profiles itself:
  on a CPU, the backward's wall-time span and CPU time, from which rank 0
  corrects the profile's compute at the first baseline where it was measured
  under load (Note [Profiled under load] in planner/adaptive.py).
- :meth:`Replanner.check` in each ``step()`` once the first plan is in force,
  before the step decides whether it may be lazy. Every ``Config.replan_every``
  steps of a plan, every rank starts sending its window to every rank (one
  all-gather of a few numbers), reads what it received at the next ``step()``
  and computes the same decision from it. When the hysteresis triggers, rank 0
  plans on the rescaled profile on a thread of its own and, from the next
  ``step()`` on, broadcasts the plan (or "keep") as JSON once it has one, as
  the first plan is agreed on (``profiler.agree_on_plan``). A plan returned here is staged by the
  optimizer exactly as the first plan is: the staging ``step()`` is eager, and
  every rank switches at the start of the next iteration.

Note [The check in flight]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A check costs the training thread nothing it has to wait for. Gathered where
it is taken, a window waits for the slowest rank's ``step()`` (the iteration
skew, which the next blocks would absorb anyway), and rank 0's planning (the
simulator over candidate plans, tens of milliseconds) held every rank in the
broadcast: measured, 1.6 % of a 189 ms iteration on a quiet job that never
re-planned (benchmarks/results/2026-11-27-p2-replan-cost-2.md), against a
0.5 % goal. So the window travels as a fixed-size vector of float64
(``adaptive.Window.to_vector``: one collective, no length exchange) started
without waiting at the check's step and read at the next ``step()``, by when
the next iteration's blocks have brought every rank past it; the decision is
taken there, on every rank from the same numbers; rank 0 plans on a thread and
broadcasts its verdict :data:`PLAN_STEPS` steps later, or "still planning",
and then every rank asks again at the next step: rank 0 never waits for its
planner (60-125 ms of CPU, which on a busy machine outlasted an iteration), and
a slow planner delays the verdict, never a rank's agreement (past
``Config.timeout_s`` it is an error every rank hears). The planner is Python,
so while it runs it shares the interpreter with the training thread: it runs
freely while that thread is in the backward's C++ or waits for the link, and
slows its Python (a forward's operator calls) otherwise; so it runs seldom
(Note [Judged conditions] in planner/adaptive.py).
The gather goes one step before each ``replan_every``-th step, so the decision
falls where the check in place was taken, and a switch comes one step later
than it did. Every step of this happens at the same ``step()`` count of the
plan on every rank, so the ranks still switch together. Where the control plane is on the GPU, a collective
there must not overlap our channels' (``control_on_gpu``): each is started
only with this step's blocks done, and the gather is waited for at once.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import statistics
import threading
import time

import torch

from ..config import Config
from ..planner import adaptive, sharing
from ..planner.floors import synchronous_floor
from ..planner.plan import Plan, validate
from ..planner.simulate import iteration_time
from ..world import control, process_sets, runtime
from .planning import CHANNEL_FIFO, make_plan

log = logging.getLogger("dcredit_opt")

PATIENCE = 2
"""Checks in a row at which an estimate must have moved beyond ``Config.replan_threshold`` before rank 0
re-plans (with the default ``replan_every``, a change is acted on about 20 iterations after it happens)."""

PLAN_STEPS = 1
"""Steps from a decision to re-plan to the first step where every rank asks for rank 0's verdict (Note [The
check in flight]): rank 0 plans on a thread of its own meanwhile."""

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
        # the profiled iterations' backward: (wall-time span, CPU seconds) each (Note [Profiled under load])
        self._profiled: list[tuple[float, float]] = []
        # where its collectives run: a process set's ranks (Note [Process sets]), or every rank
        self._plane = process_sets.everyone() if plane is None else plane
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
        self._first_profile = None  # rank 0: what profiling measured
        self._kept: list = []  # rank 0: the conditions the plan in force was kept for (Note [Judged conditions])
        self._off = False  # rank 0 failed to plan once: said, and re-planning stops on every rank
        self._replans: list[adaptive.Replan] = []
        self._quiet_first = control_on_gpu()
        self._gathering = None  # (the check's all-gather in flight, the step it started at)
        self._planning: _Planning | None = None  # a decision to re-plan whose verdict is not shared yet
        self._name: str | None = None  # the gather's name (_gather_name)

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

    def profiled(self, ready_ns) -> None:
        """In each profiling ``step()``: the backward's wall-time span (``ready_ns()``, each tensor's ready
        time, read only where it is used) and its thread's CPU time, read as a window reads them, where that thread does all of the backward's
        work (one intra-op thread: Note [Profiled under load])."""
        if not self._cpu_clock or torch.get_num_threads() != 1:
            return
        cpu, span = self._backward_cpu_s(), adaptive.backward_span(ready_ns())
        if cpu is not None and cpu > 0 and span is not None:
            self._profiled.append((span, cpu))

    def _backward_cpu_s(self) -> float | None:
        """In ``step()``: this thread's CPU seconds since the iteration opened on it, or None (not read there)."""
        opened, self._opened = self._opened, None
        if opened is None or opened[0] != threading.get_ident():
            return None
        return time.thread_time() - opened[1]

    def check(self, iteration: int, plan: Plan, profile, numels, timeline=None, wait_blocks=None) -> Plan | None:
        """Once per ``step()`` with a planned plan in force: the plan to stage now, or None.

        ``plan`` is the plan in force, ``profile`` what profiling measured (rank 0; None elsewhere),
        ``numels()`` the elements each tensor has in blocks now (called on rank 0 when it re-plans),
        ``iteration`` the optimizer's iteration (for the record), ``timeline`` the optimizer's ``RankTimeline``
        or None, ``wait_blocks()`` waits until this step's blocks are done (called before a collective is
        started when the control plane is on the GPU). Collective at fixed steps of a plan: every rank calls it
        at every ``step()`` (Note [The check in flight]).
        """
        if self._off:
            return None
        self._cpu_s = self._backward_cpu_s() if self._cpu_clock else None
        if self._profile is None:
            self._profile = self._first_profile = profile
        if plan is not self._plan:  # a new plan: a new baseline
            self._settle()
            self._plan, self._steps, self._base = plan, 0, None
            # the condition it was made for is judged (Note [Judged conditions]); rank 0 alone has profiles
            self._kept = [] if self._profile is None else [adaptive.condition(self._first_profile, self._profile)]
            self._window.take()
            self._hysteresis.reset()
        self._steps += 1
        # a check's gather goes a step before every replan_every-th step, its decision there (Note [The check in
        # flight]): a plan's check windows end where they ended when the check was taken in place
        position = (self._steps + 1) % self._every
        self._observe_next = self._steps > 1 and position >= self._every - self._samples
        quiet = wait_blocks if self._quiet_first and wait_blocks is not None else (lambda: None)
        if self._planning is not None and self._steps >= self._planning.due:
            fresh = self._conclude(iteration, plan, timeline, quiet)
            if fresh is not None or self._off:
                self._settle()  # a gather in flight belongs to the plan that goes
                return fresh
        if self._gathering is not None and self._gathering[1] < self._steps:
            windows = [adaptive.Window.from_vector(row.tolist()) for row in self._gathering[0].wait()]
            self._gathering = None
            if self._planning is None:
                self._decide(plan, windows, numels)
        if not position:
            quiet()
            mine = adaptive.Window.to_vector(self._window.take())
            tensor = torch.tensor(mine, dtype=torch.float64, device=self._plane.control_device())
            gathering = self._all_gather_async(tensor, self._gather_name())
            if self._quiet_first:
                gathering.wait()  # Note [The check in flight]: on the GPU nothing of ours stays in flight
            self._gathering = (gathering, self._steps)
        return None

    def close(self) -> None:
        """Wait for a check's gather still in flight (every rank started it; it must end before the plane does)
        and let rank 0's planning go: from ``close()`` of the optimizer."""
        self._off = True
        try:
            self._settle()
        except (RuntimeError, TimeoutError) as e:  # the job is ending: said, not raised
            log.warning("dcredit_opt: re-planning's last check did not finish: %s", e)
        self._planning = None

    # ---- the check ------------------------------------------------------------------------------------------

    def _settle(self) -> None:
        """Wait for the gather in flight, if any, and drop it."""
        gathering, self._gathering = self._gathering, None
        if gathering is not None:
            gathering[0].wait()

    def _decide(self, plan: Plan, windows: list, numels) -> None:
        """The windows of every rank, gathered: the same decision on every rank. When the hysteresis triggers,
        rank 0 starts planning (off this thread), and the verdict is shared at the next ``step()``."""
        base = self._base
        if base is None:  # this plan's baseline; its compute is already compared (Note [Compute across a switch])
            if not all(w is not None for w in windows):
                return
            self._base = windows
            if self._reference is None:
                self._reference = windows
                if all(w.cpu_s is not None for w in windows):  # Note [Profiled under load]
                    self._level_profile()
                self._profiled = []
                return
        estimate = adaptive.combine(base, windows, self._reference)
        if not self._hysteresis.update(estimate):
            return
        self._hysteresis.reset()
        work = None
        if self._rank() == 0:
            numels_now = numels()
            work = functools.partial(self._plan_on_rank0, plan, estimate, numels_now)
        self._planning = _Planning(self._steps + PLAN_STEPS, estimate, windows, work)

    def _level_profile(self) -> None:
        """Rank 0 at the first baseline: the profile's compute scaled down to within the threshold of its CPU
        time where it was measured under load, said once; nothing on the other ranks, nor where nothing was read
        (Note [Profiled under load])."""
        if self._profile is None or not self._profiled:
            return
        wall_s = statistics.median(s for s, _ in self._profiled)
        cpu_s = statistics.median(c for _, c in self._profiled)
        scale = adaptive.profile_level(wall_s, cpu_s, self._threshold)
        if scale >= 1.0:
            return
        self._profile = adaptive.rescale(self._profile, adaptive.Estimate(
            compute=scale, link=1.0, beta=1.0, link_rank=-1, span_s=(wall_s, cpu_s), cpu=True))
        log.info("dcredit_opt: the profile's compute was measured under load: its backward took %.1f ms of wall "
                 "time for %.1f ms of CPU time, beyond replan_threshold (%g), so re-planning takes its compute "
                 "x%.2f, to within the threshold of its CPU time", wall_s * 1e3, cpu_s * 1e3, self._threshold, scale)

    def _conclude(self, iteration: int, plan: Plan, timeline, quiet) -> Plan | None:
        """At the step the verdict is due: rank 0's plan (or "keep", or its error) on every rank."""
        planning, self._planning = self._planning, None
        first = self._rank() == 0
        text = planning.verdict(self._config.timeout_s) if first else None
        quiet()
        data = json.loads(self._broadcast_text(text, 0))
        if data.get("planning"):  # rank 0's planner is not done: every rank asks again at the next step
            planning.due = self._steps + 1
            self._planning = planning
            return None
        estimate, windows = planning.estimate, planning.windows
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
            if first and data.get("near"):
                log.info("dcredit_opt: iteration %d: estimates moved (%s), to within half the threshold of a condition "
                         "the plan in force was already kept for: kept", iteration, data["reason"])
            elif first and data.get("floor"):
                log.info("dcredit_opt: iteration %d: estimates moved (%s), but the plan in force, predicted at %.1f "
                         "ms, is within the threshold of the synchronous floor (%.1f ms), which no plan beats: kept",
                         iteration, data["reason"], old_s * 1e3, new_s * 1e3)
            elif first:
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

    def _gather_name(self) -> str:
        """Horovod matches operations by name, and two optimizers' gathers may be in flight together: each its
        own, numbered as the backends are at its first check (the same on every rank: every rank checks its
        optimizers in the same order); a process set's plane has a group of its own."""
        if self._name is None:
            self._name = f"replan.window.{runtime.next_backend_id()}" if self._plane.everyone else "replan.window"
        return self._name

    def _all_gather_async(self, tensor, name: str):
        return self._plane.all_gather_async(tensor, name)

    def _broadcast_text(self, text: str | None, root: int) -> str:
        return self._plane.broadcast_text(text, root)

    def _rank(self) -> int:
        return self._plane.rank

    def _plan_on_rank0(self, plan: Plan, estimate: adaptive.Estimate, numels: list) -> str:
        """Rank 0, on the planning thread: the fresh plan for the rescaled profile, if worth a switch, as JSON for
        every rank. Reads only what the training thread no longer changes until the verdict is shared."""
        config = self._config
        try:
            if self._profile is None:
                raise ValueError("no profile to rescale (profiling measured nothing)")
            profile = adaptive.rescale(self._profile, estimate)
            try:
                old_s = iteration_time(plan, profile, channel_fifo=CHANNEL_FIFO)
            except ValueError:  # the plan in force no longer fits the profile (rows taken out since): unknown
                old_s = math.inf
            data = {"reason": adaptive.describe(estimate, self._threshold), "old_s": old_s}
            where = adaptive.condition(self._first_profile, profile)
            if adaptive.near(where, self._kept, self._threshold / 2):
                data.update(new_s=old_s, near=True)  # Note [Judged conditions]
                return json.dumps(data)
            floor_s = synchronous_floor(profile)
            if not adaptive.worth_switching(old_s, floor_s, self._threshold):
                # no plan beats the floor (floors.py), so none could be worth a switch: the search is spared
                data.update(new_s=floor_s, floor=True)
            else:
                fresh = make_plan(profile, config.policy, channels=config.channels,
                                  overlap_forward=config.overlap_forward)
                validate(fresh, numels=numels, max_channels=config.channels, dtypes=self._dtypes)
                new_s = data["new_s"] = iteration_time(fresh, profile, channel_fifo=CHANNEL_FIFO)
                if fresh != plan and adaptive.worth_switching(old_s, new_s, self._threshold):
                    data["plan"] = fresh.to_dict()
            if "plan" not in data:
                self._kept.append(where)
            return json.dumps(data)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, or the others would wait
            return json.dumps({"error": f"{type(e).__name__}: {e}"})


class _Planning:
    """A decision to re-plan, waiting for rank 0's verdict: asked for at the step ``due`` (Note [The check in
    flight]). On rank 0, ``work()`` runs on a thread of its own from the decision on."""

    def __init__(self, due: int, estimate: adaptive.Estimate, windows: list, work=None):
        self.due, self.estimate, self.windows = due, estimate, windows
        self._text: str | None = None
        self._thread = None
        self._started = time.monotonic()
        if work is not None:
            self._thread = threading.Thread(target=self._run, args=(work,), name="dcredit-replan", daemon=True)
            self._thread.start()

    def _run(self, work) -> None:
        with sharing.beside_training():
            self._text = work()

    def verdict(self, timeout_s: float) -> str:
        """Rank 0, without waiting: the planning's JSON; ``{"planning": true}`` while the planner runs, an error
        once it has run longer than ``timeout_s``."""
        if self._thread.is_alive():
            if time.monotonic() - self._started <= timeout_s:
                return json.dumps({"planning": True})
            return json.dumps({"error": f"planning did not finish within {timeout_s:g} s (Config.timeout_s)"})
        if self._text is None:
            return json.dumps({"error": "the planner ended without a verdict"})
        return self._text
