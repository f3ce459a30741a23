"""Adaptive re-planning's pure part (how: planner/adaptive.py): the estimators on
synthetic traces, the decision over gathered windows (the same on every rank whatever each rank measured),
the hysteresis (no flapping), the rescaled profile."""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dcredit_opt
from dcredit_opt.planner import adaptive
from dcredit_opt.planner.adaptive import Estimate, Hysteresis, Window, WindowRecorder
from dcredit_opt.planner.profile import Profile
from dcredit_opt.planner.simulate import iteration_time
from dcredit_opt.planner.synthetic import model_like_profile
from dcredit_opt.profiling import planning

MS = 1_000_000  # ns
PROFILES = Path(dcredit_opt.__file__).parent / "profiles"


def serial_trace(sizes, alpha_s, beta_s, start_ns=MS, gap_ns=0, channels=1):
    """Rows of ``Engine.trace()`` for blocks of ``sizes`` bytes run one after another (a gap of ``gap_ns``
    between them: 0 makes one busy period), and the bytes per block."""
    rows, t = [], start_ns
    for b, n in enumerate(sizes):
        dur = round((alpha_s + beta_s * n) * 1e9)
        rows.append((b, b % channels, 1, b, b, t, t, t + dur))
        t += dur + gap_ns
    return rows, list(sizes)


def window(sizes, alpha_s, beta_s, span_s, iterations=4, gap_ns=MS, cpu_s=None):
    rec = WindowRecorder()
    for _ in range(iterations):
        rows, nbytes = serial_trace(sizes, alpha_s, beta_s, gap_ns=gap_ns)
        rec.add(rows, nbytes, [1, 1 + int(span_s * 1e9)], cpu_s)
    return rec.take()


SIZES = [1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 18, 1 << 20]


def test_busy_periods_merge_overlapping_blocks_across_channels():
    rows = [(0, 0, 2, 0, 0, 0, 10, 50), (1, 1, 2, 0, 1, 0, 20, 70),  # overlap: one period 10..70
            (2, 0, 1, 1, 2, 0, 70, 90),  # touches the end: same period
            (3, 1, 1, 2, 3, 0, 100, 130),  # a gap: a new period
            (4, 0, 1, 3, -1, 0, 0, 0)]  # never launched
    assert adaptive.busy_periods(rows, [8, 16, 4, 32, 64]) == [(3, 28, 80e-9), (1, 32, 30e-9)]
    assert adaptive.busy_periods([], []) == []


def test_backward_span_ignores_tensors_not_ready():
    assert adaptive.backward_span([0, 5 * MS, 2 * MS, 0]) == pytest.approx(3e-3)
    assert adaptive.backward_span([0, 5]) is None


def test_a_window_fits_alpha_and_beta_where_sizes_spread():
    w = window(SIZES, 2e-4, 1e-9, 0.05)
    assert w.iterations == 4 and w.span_s == pytest.approx(0.05)
    assert w.alpha_s == pytest.approx(2e-4, rel=1e-3) and w.beta_s_per_byte == pytest.approx(1e-9, rel=1e-3)
    assert w.collectives == len(SIZES) and w.nbytes == sum(SIZES)
    # one size: no intercept to fit
    w1 = window([1 << 20] * 5, 2e-4, 1e-9, 0.05)
    assert w1.alpha_s is None and w1.beta_s_per_byte is None
    assert WindowRecorder().take() is None


def travel(w: Window | None) -> Window | None:
    """``w`` as a check gathers it: a float64 vector, and back."""
    return Window.from_vector(torch.tensor(Window.to_vector(w), dtype=torch.float64).tolist())


def test_a_window_travels_as_a_vector_exactly():
    w = window(SIZES, 3.3e-4, 1.7e-9, 0.0123)
    assert travel(w) == w and travel(None) is None
    one = window([1 << 20] * 5, 2e-4, 1e-9, 0.05)  # no fit: None fields
    assert one.alpha_s is None and travel(one) == one
    with pytest.raises(ValueError, match="8 numbers"):
        Window.from_vector([1.0, 2.0])
    with pytest.raises(ValueError, match="whole number"):
        Window.from_vector([1.5] + [0.0] * 7)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 10**6), st.lists(st.one_of(st.none(), st.floats(0, 1e12, allow_nan=False)), min_size=7,
                                       max_size=7))
def test_any_window_travels_exactly(iterations, fields):
    fields[1:4] = [0.0 if f is None else f for f in fields[1:4]]  # busy_s, collectives, nbytes: always numbers
    w = Window(iterations, *fields)
    assert travel(w) == w


@pytest.mark.parametrize("spread", [True, False])
@pytest.mark.parametrize("factor", [0.25, 1.0, 2.0, 4.0])
def test_link_estimate_reads_a_bandwidth_change(spread, factor):
    sizes = SIZES if spread else [1 << 20] * 6
    base = window(sizes, 2e-4, 1e-9, 0.05)
    now = window(sizes, 2e-4, factor * 1e-9, 0.05)
    link, beta = adaptive.link_estimate(base, now)
    expected = sum(2e-4 + factor * 1e-9 * n for n in sizes) / sum(2e-4 + 1e-9 * n for n in sizes)
    assert link == pytest.approx(expected, rel=1e-3)
    if spread:  # the fit knows the start-up: beta's own change
        assert beta == pytest.approx(factor, rel=1e-2)
    else:  # the baseline's link is all per byte: beta takes the whole change
        assert beta == pytest.approx(expected, rel=1e-3)


def test_link_estimate_is_one_when_nothing_changed_even_if_the_mix_did():
    base = window(SIZES, 2e-4, 1e-9, 0.05)
    now = window(SIZES[::-1] + [1 << 16] * 4, 2e-4, 1e-9, 0.05)
    assert adaptive.link_estimate(base, now)[0] == pytest.approx(1.0, rel=1e-3)


def test_combine_takes_the_slowest_compute_and_the_least_slowed_link():
    base = [window(SIZES, 2e-4, 1e-9, 0.05), window(SIZES, 2e-4, 1e-9, 0.04)]
    # rank 1 computes 3x slower; rank 0 waits for it in its collectives, so its link looks 2x slower
    now = [window(SIZES, 2e-4, 2e-9, 0.05), window(SIZES, 2e-4, 1e-9, 0.12)]
    est = adaptive.combine(base, now)
    assert est.compute == pytest.approx(0.12 / 0.05)
    assert est.link == pytest.approx(1.0, rel=1e-3) and est.link_rank == 1
    assert adaptive.moved(est, 0.1) == ("compute",)
    assert adaptive.combine(base, [now[0], None]) is None
    assert adaptive.combine(base, now[:1]) is None
    text = adaptive.describe(est, 0.1)
    assert text.startswith("moved: compute x2.40 (backward 50.0 ms -> 120.0 ms)") and "link x1.00" in text


def test_combine_reads_the_compute_in_cpu_time_where_every_window_carries_it():
    """Note [Compute in CPU time]: the wall-time span moved with other jobs' load (x0.5 here) while the work
    doubled (CPU x2): the CPU time is the estimate; a window without it (a device) falls back to the span."""
    base = [window(SIZES, 2e-4, 1e-9, 0.10, cpu_s=0.08), window(SIZES, 2e-4, 1e-9, 0.12, cpu_s=0.07)]
    now = [window(SIZES, 2e-4, 1e-9, 0.05, cpu_s=0.16), window(SIZES, 2e-4, 1e-9, 0.06, cpu_s=0.15)]
    est = adaptive.combine(base, now)
    assert est.cpu and est.compute == pytest.approx(2.0) and est.span_s == pytest.approx((0.08, 0.16))
    assert adaptive.describe(est, 0.1).startswith("moved: compute x2.00 (backward 80.0 ms -> 160.0 ms of CPU)")
    wall = [dataclasses.replace(now[0], cpu_s=None), now[1]]
    est = adaptive.combine(base, wall)
    assert not est.cpu and est.compute == pytest.approx(0.06 / 0.12)
    assert window(SIZES, 2e-4, 1e-9, 0.05).cpu_s is None
    assert travel(now[0]) == now[0]


def test_the_replanner_reads_the_backwards_cpu_time_not_its_wall_time(monkeypatch):
    """From the iteration's start (observe) to its step() (check), on the same thread: a sleep there (another
    job holding the core) adds nothing, work does; on another thread nothing is read."""
    import threading
    import time

    from dcredit_opt.profiling import replanner
    from dcredit_opt.profiling.replanner import Replanner

    monkeypatch.setattr(replanner, "control_on_gpu", lambda: False)  # no world in a unit test
    r = Replanner(dcredit_opt.Config(), [], cpu_clock=True)
    r.observe(None, None)
    time.sleep(0.3)
    cpu_start = time.thread_time()
    while time.thread_time() - cpu_start < 0.05:
        pass
    cpu = r._backward_cpu_s()
    assert 0.05 <= cpu < 0.25, cpu
    assert r._backward_cpu_s() is None  # read once per opening
    r.observe(None, None)
    seen = []
    t = threading.Thread(target=lambda: seen.append(r._backward_cpu_s()))
    t.start()
    t.join(timeout=30)
    assert seen == [None]
    assert Replanner(dcredit_opt.Config(), [])._cpu_clock is False


def test_combine_compares_the_compute_with_its_reference_and_the_link_with_the_plans_baseline():
    """Note [Compute across a switch]: the compute against the reference, the link against the plan's own
    baseline, and a plan with no baseline yet reads an unchanged link."""
    reference = [window(SIZES, 2e-4, 1e-9, 0.05, cpu_s=0.1)] * 2
    base = [window(SIZES, 2e-4, 1e-9, 0.05, cpu_s=0.4)] * 2
    now = [window(SIZES, 2e-4, 2e-9, 0.05, cpu_s=0.4)] * 2
    est = adaptive.combine(base, now, reference)
    assert est.compute == pytest.approx(4.0) and est.link > 1.5
    est = adaptive.combine(None, base, reference)
    assert est.compute == pytest.approx(4.0) and (est.link, est.beta, est.link_rank) == (1.0, 1.0, -1)
    assert adaptive.rescale(model_like_profile(4, total_params=10_000), est).beta_s_per_byte == \
        model_like_profile(4, total_params=10_000).beta_s_per_byte
    assert adaptive.combine(base, now).compute == pytest.approx(1.0)
    assert adaptive.combine(None, now) is None


class OneRank:
    """Rank 0 of two with the collectives stood in for: every rank's window is the one ``feed`` holds when the
    gather starts, and the broadcast returns rank 0's text; the planner returns ``plans`` in turn, and the
    simulator prices the plan in force at 2 s, any other at 1 s. ``steps(plan, busy_s, cpu_s, n)``: ``n`` steps
    of ``plan``, what each returns. With ``replan_every=2`` (Note [The check in flight]) a plan's odd steps start
    a gather, its even steps decide, and a verdict comes at the odd step after a decision to re-plan."""

    def __init__(self, monkeypatch, plans, config=None, make_plan=None, cpu_clock=False):
        from dcredit_opt.profiling import replanner

        self.feed: dict = {}
        self.waited: list = []
        self.made: list = []
        self.planned_for: list = []  # the profile each planning was given
        fresh = iter(plans)

        def gathered(tensor, name):
            rows = [torch.tensor(Window.to_vector(self.feed["w"]), dtype=torch.float64)] * 2
            return replanner.control.Gathering(lambda: self.waited.append(name) or rows)

        def planned(profile, policy, **kwargs):
            self.planned_for.append(profile)
            self.made.append(next(fresh))
            return self.made[-1]

        monkeypatch.setattr(replanner, "control_on_gpu", lambda: False)
        monkeypatch.setattr(replanner.control, "control_device", lambda: torch.device("cpu"))
        monkeypatch.setattr(replanner.control, "all_gather_async", gathered)
        monkeypatch.setattr(replanner.runtime, "next_backend_id", lambda: 0)
        monkeypatch.setattr(replanner.control, "broadcast_text", lambda text, root, plane=None: text)
        monkeypatch.setattr(replanner.runtime, "rank", lambda: 0)
        monkeypatch.setattr(replanner, "make_plan", make_plan or planned)
        monkeypatch.setattr(replanner, "validate", lambda plan, **kwargs: None)
        monkeypatch.setattr(replanner, "iteration_time",
                            lambda plan, profile, **kwargs: 2.0 if plan is self.in_force else 1.0)
        self.in_force = None
        # The stand-in planner returns at once; its thread still needs the CPU, which a busy machine may not give
        # it before the verdict's step. Each step waits for it, so that the verdict comes where the design puts
        # it. A planner of the test's own (make_plan) runs as it would.
        self._settle = make_plan is None
        self.r = replanner.Replanner(config or dcredit_opt.Config(replan_every=2, replan_threshold=0.1), [],
                                     cpu_clock=cpu_clock)
        self.profile = model_like_profile(4, total_params=10_000)

    def steps(self, plan, busy_s, cpu_s, n):
        self.in_force = plan
        self.feed["w"] = Window(iterations=1, span_s=0.05, busy_s=busy_s, collectives=2, nbytes=1e6, alpha_s=None,
                                beta_s_per_byte=None, cpu_s=cpu_s)
        return [self._step(plan) for _ in range(n)]

    def _step(self, plan):
        planning = self.r._planning
        if self._settle and planning is not None and planning._thread is not None:
            planning._thread.join(60.0)
        return self.r.check(0, plan, self.profile, lambda: [4096])


def test_a_compute_change_just_after_a_switch_is_seen_by_the_new_plan(monkeypatch):
    """A re-plan (here on a link that moved), then the batch grows before the new plan's baseline window: the
    new plan's checks compare the compute with the windows the profile was rescaled to, so the change is
    re-planned for two checks later (it used to become the new baseline, unseen)."""
    from dcredit_opt.optimizer.layout import fixed_plan

    a, b, c = plans = [fixed_plan([4096], [4], 1024 * k, 1, 1) for k in (1, 2, 3)]
    job = OneRank(monkeypatch, plans[1:])
    assert job.steps(a, 0.1, 0.1, 6) == [None] * 6  # the baseline, then nothing moves
    # the link moved in two windows in a row: the second one's decision, then rank 0's verdict a step later
    assert job.steps(a, 0.2, 0.1, 5) == [None] * 4 + [b]
    # b's baseline, at 4x the compute its profile was made for: one move; two in a row: re-planned for it
    assert job.steps(b, 0.2, 0.4, 5) == [None] * 4 + [c]
    assert [rp.reason.startswith("moved: compute x4.00") for rp in job.r.replans] == [False, True]
    assert job.waited == ["replan.window.0"] * len(job.waited) and len(job.waited) == 7  # every gather waited for


def test_rank_0_plans_off_the_training_thread_and_no_rank_waits_for_it(monkeypatch):
    """Note [The check in flight]: the planner runs on a thread of its own from the decision's step; while it
    runs, each step's broadcast says so and every rank asks again at the next; its verdict comes at the first
    step after it is done."""
    import threading
    import time

    from dcredit_opt.optimizer.layout import fixed_plan

    a, b = fixed_plan([4096], [4], 1024, 1, 1), fixed_plan([4096], [4], 2048, 1, 1)
    ran: list = []
    go = threading.Event()

    def slow_plan(profile, policy, **kwargs):
        ran.append(threading.current_thread().name)
        assert go.wait(30)
        job.made.append(b)
        return b

    job = OneRank(monkeypatch, [], make_plan=slow_plan)
    assert job.steps(a, 0.1, 0.1, 4) + job.steps(a, 0.2, 0.1, 3) == [None] * 7
    assert not ran
    assert job.steps(a, 0.2, 0.1, 1) == [None]  # the second move's decision: planning starts
    t0 = time.monotonic()
    assert job.steps(a, 0.2, 0.1, 5) == [None] * 5  # still planning: nobody waits
    assert time.monotonic() - t0 < 5 and ran == ["dcredit-replan"]  # not this thread's name
    go.set()
    deadline = time.monotonic() + 10
    while job.r._planning._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert job.steps(a, 0.2, 0.1, 1) == [b] and len(job.r.replans) == 1  # the verdict, at the next step


def test_a_planner_past_the_timeout_stops_replanning_on_every_rank(monkeypatch, caplog):
    """Rank 0's planner still running at the verdict's step after ``Config.timeout_s``: an error every rank hears
    (the broadcast), re-planning stops, the plan in force stays; close() afterwards is quiet."""
    import logging
    import time

    from dcredit_opt.optimizer.layout import fixed_plan

    a = fixed_plan([4096], [4], 1024, 1, 1)

    def stuck(profile, policy, **kwargs):
        time.sleep(1.0)
        return a

    job = OneRank(monkeypatch, [], config=dcredit_opt.Config(replan_every=2, replan_threshold=0.1, timeout_s=0.05),
                  make_plan=stuck)
    assert job.steps(a, 0.1, 0.1, 4) == [None] * 4
    with caplog.at_level(logging.WARNING, logger="dcredit_opt"):
        assert job.steps(a, 0.2, 0.1, 4) == [None] * 4  # the decision at the fourth
        time.sleep(0.1)
        assert job.steps(a, 0.2, 0.1, 1) == [None]  # the verdict: an error
    assert "re-planning stops" in caplog.text and "did not finish within 0.05 s" in caplog.text
    assert job.steps(a, 0.4, 0.1, 6) == [None] * 6 and job.r.replans == []
    job.r.close()


def test_a_plan_within_the_threshold_of_the_floor_is_kept_without_a_search(monkeypatch, caplog):
    """The plan in force predicted within ``replan_threshold`` of the synchronous floor under the new estimates:
    no plan can beat it by more (floors.py), so rank 0 says "keep" without running the planner; 20 % above the
    floor, the planner runs."""
    import logging

    from dcredit_opt.optimizer.layout import fixed_plan
    from dcredit_opt.planner.floors import synchronous_floor
    from dcredit_opt.profiling import replanner

    a, b = fixed_plan([4096], [4], 1024, 1, 1), fixed_plan([4096], [4], 2048, 1, 1)
    job = OneRank(monkeypatch, [b])
    above = {"x": 1.05}
    monkeypatch.setattr(replanner, "iteration_time", lambda plan, profile, **kwargs:
                        synchronous_floor(profile) * (1.0 if plan is b else above["x"]))
    assert job.steps(a, 0.1, 0.1, 4) == [None] * 4
    with caplog.at_level(logging.INFO, logger="dcredit_opt"):
        assert job.steps(a, 0.2, 0.1, 5) == [None] * 5
    assert "within the threshold of the synchronous floor" in caplog.text and job.made == []
    above["x"] = 1.2  # the kept estimates are the new baseline: the link moves again, twice
    assert job.steps(a, 0.4, 0.1, 6) == [None] * 5 + [b] and job.made == [b]


def test_conditions_and_their_neighbourhood():
    p = model_like_profile(4, total_params=10_000)
    q = adaptive.rescale(p, Estimate(compute=2.0, link=1.0, beta=0.5, link_rank=0, span_s=(0.0, 0.0)))
    assert adaptive.condition(p, p) == (0.0, 0.0)
    assert adaptive.condition(p, q) == pytest.approx((math.log(2.0), math.log(0.5)))
    assert adaptive.near((0.04, -0.04), [(0.0, 0.0)], 0.05) and not adaptive.near((0.06, 0.0), [(0.0, 0.0)], 0.05)
    assert not adaptive.near((0.0, 0.06), [(0.0, 0.0)], 0.05) and not adaptive.near((0.0, 0.0), [], 0.05)


def test_a_decision_near_a_condition_already_kept_for_is_kept_without_planning(monkeypatch, caplog):
    """Note [Judged conditions]: the planner runs for a condition (here compute x1.5) and keeps the plan; the
    estimates wander off and back to within half the threshold of it: kept without a search; a condition far from
    it (compute x3) is planned for."""
    import logging

    from dcredit_opt.optimizer.layout import fixed_plan

    a = fixed_plan([4096], [4], 1024, 1, 1)
    job = OneRank(monkeypatch, [a, a])  # the planner's fresh plan is the plan in force: kept
    assert job.steps(a, 0.1, 0.1, 4) == [None] * 4
    assert job.steps(a, 0.1, 0.15, 5) == [None] * 5 and len(job.made) == 1  # planned at x1.5: kept
    assert job.steps(a, 0.1, 0.1, 6) == [None] * 6 and len(job.made) == 1  # x1.0: within the threshold
    with caplog.at_level(logging.INFO, logger="dcredit_opt"):
        assert job.steps(a, 0.1, 0.148, 6) == [None] * 6  # x1.48 against the kept x1.0: near x1.5
    assert "a condition the plan in force was already kept for" in caplog.text and len(job.made) == 1
    assert job.steps(a, 0.1, 0.3, 6) == [None] * 6 and len(job.made) == 2  # x3: planned for


def test_profile_level_scales_down_only_beyond_the_threshold():
    """Note [Profiled under load]: to the threshold's edge where the wall time exceeds the CPU time by more than
    the threshold (continuous there); 1.0 within it, never above 1, and 1.0 where either was not read."""
    assert adaptive.profile_level(0.18, 0.10, 0.1) == pytest.approx(1.1 / 1.8)
    assert adaptive.profile_level(0.18, 0.10, 0.0) == pytest.approx(1 / 1.8)
    assert adaptive.profile_level(0.1101, 0.10, 0.1) == pytest.approx(1.0, abs=1e-3)
    assert adaptive.profile_level(0.105, 0.10, 0.1) == 1.0 and adaptive.profile_level(0.09, 0.10, 0.1) == 1.0
    assert adaptive.profile_level(0.0, 0.10, 0.1) == 1.0 and adaptive.profile_level(0.18, 0.0, 0.1) == 1.0


def profiled_under(job, monkeypatch, wall_s: float, cpu_s: float, iterations: int = 4, threads: int = 1) -> None:
    """``iterations`` profiling steps whose backward spans ``wall_s`` of wall time for ``cpu_s`` of the training
    thread's CPU time, on ``threads`` intra-op threads."""
    monkeypatch.setattr(job.r, "_backward_cpu_s", lambda: cpu_s)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    for _ in range(iterations):
        job.r.profiled(lambda: [MS, MS + round(wall_s * 1e9), MS + round(wall_s * 1e9 / 2)])


def total_compute(profile: Profile) -> tuple[float, float]:
    return sum(t.fwd_s for t in profile.tensors), sum(t.bwd_s for t in profile.tensors)


def test_a_profile_measured_under_load_is_planned_on_near_its_cpu_time(monkeypatch, caplog):
    """Note [Profiled under load]: profiled iterations whose backward took 1.8x its CPU time in wall time; at the
    first baseline rank 0 says so once, and the next planning (here for a link that moved) sees the profile's
    compute x1.1/1.8 (to the edge of the threshold, 0.1), forward and backward; the ranks decide as before."""
    import logging

    from dcredit_opt.optimizer.layout import fixed_plan

    a, b = fixed_plan([4096], [4], 1024, 1, 1), fixed_plan([4096], [4], 2048, 1, 1)
    job = OneRank(monkeypatch, [b], cpu_clock=True)
    profiled_under(job, monkeypatch, 0.18, 0.10)
    with caplog.at_level(logging.INFO, logger="dcredit_opt"):
        assert job.steps(a, 0.1, 0.1, 4) == [None] * 4  # the first baseline
        assert job.steps(a, 0.2, 0.1, 5) == [None] * 4 + [b]  # the link moved twice: re-planned
    said = [m for m in caplog.messages if "measured under load" in m]
    assert len(said) == 1 and "180.0 ms of wall time for 100.0 ms of CPU time" in said[0], caplog.messages
    (profile,) = job.planned_for
    fwd, bwd = total_compute(job.profile)
    assert total_compute(profile) == pytest.approx((fwd * 1.1 / 1.8, bwd * 1.1 / 1.8))
    assert job.r.replans[0].reason.startswith("moved: link x") and job.r.replans[0].compute == pytest.approx(1.0)


def test_a_profile_measured_quiet_is_planned_on_as_measured(monkeypatch, caplog):
    """Wall time within the threshold of the CPU time (x1.05 against 0.1): the job's own threads and noise, not
    load: the profile's compute stays as measured, and nothing is said."""
    import logging

    from dcredit_opt.optimizer.layout import fixed_plan

    a, b = fixed_plan([4096], [4], 1024, 1, 1), fixed_plan([4096], [4], 2048, 1, 1)
    job = OneRank(monkeypatch, [b], cpu_clock=True)
    profiled_under(job, monkeypatch, 0.105, 0.10)
    with caplog.at_level(logging.INFO, logger="dcredit_opt"):
        assert job.steps(a, 0.1, 0.1, 4) + job.steps(a, 0.2, 0.1, 5) == [None] * 8 + [b]
    assert not [m for m in caplog.messages if "measured under load" in m]
    (profile,) = job.planned_for
    assert total_compute(profile) == pytest.approx(total_compute(job.profile))


def test_a_profile_is_not_corrected_where_the_compute_is_read_as_a_span(monkeypatch):
    """No CPU clock (a device: Note [Compute in CPU time]), windows without CPU time, or a backward on several
    intra-op threads (the training thread's CPU time is then a share of the work): the profile's compute stays
    as measured, whatever the profiling steps would have read."""
    from dcredit_opt.optimizer.layout import fixed_plan

    a, b = fixed_plan([4096], [4], 1024, 1, 1), fixed_plan([4096], [4], 2048, 1, 1)
    for cpu_clock, cpu_s, threads in ((False, None, 1), (True, None, 1), (True, 0.1, 2)):
        job = OneRank(monkeypatch, [b], cpu_clock=cpu_clock)
        profiled_under(job, monkeypatch, 0.18, 0.10, threads=threads)
        assert job.steps(a, 0.1, cpu_s, 4) + job.steps(a, 0.2, cpu_s, 5) == [None] * 8 + [b]
        (profile,) = job.planned_for
        assert total_compute(profile) == pytest.approx(total_compute(job.profile))


def test_close_waits_for_a_gather_in_flight(monkeypatch):
    """A check's gather started at the last step() before close(): every rank started it, so every rank waits
    for it before the plane goes (``Replanner.close``)."""
    from dcredit_opt.optimizer.layout import fixed_plan

    a = fixed_plan([4096], [4], 1024, 1, 1)
    job = OneRank(monkeypatch, [])
    assert job.steps(a, 0.1, 0.1, 1) == [None] and job.waited == []  # started, not waited for
    job.r.close()
    assert job.waited == ["replan.window.0"]
    assert job.steps(a, 0.1, 0.1, 2) == [None, None] and job.waited == ["replan.window.0"]


def est(compute=1.0, link=1.0):
    return Estimate(compute=compute, link=link, beta=link, link_rank=0, span_s=(0.0, 0.0))


def test_hysteresis_needs_patience_consecutive_moves():
    h = Hysteresis(0.1, 2)
    assert [h.update(e) for e in (est(1.5), est(1.05), est(1.5), est(1.5))] == [False, False, False, True]
    h.reset()
    assert h.streak == 0
    assert not h.update(None)
    assert [h.update(est(link=0.5)) for _ in range(2)] == [False, True]
    with pytest.raises(ValueError):
        Hysteresis(0.1, 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-0.095, 0.095), min_size=1, max_size=50), st.integers(1, 4))
def test_noise_within_the_threshold_never_triggers(noise, patience):
    h = Hysteresis(0.1, patience)
    assert not any(h.update(est(math.exp(a), math.exp(-a))) for a in noise)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 5), st.integers(0, 2**31 - 1))
def test_ranks_with_different_timings_agree_on_every_decision(world, seed):
    """Each rank measures its own timings (random skew, noise, a compute change on some ranks at a random
    check, a link change at another); the windows go through JSON as the runtime gathers them; each rank runs
    its own hysteresis on what it received. Every rank triggers at the same checks."""
    rng = random.Random(seed)
    checks = 12
    compute_change = {r: rng.choice([1.0, 1.0, 2.5, 0.4]) for r in range(world)}
    compute_at, link_at = rng.randrange(checks), rng.randrange(checks)
    link_factor = rng.choice([0.25, 1.0, 4.0])

    def measure(r, k):
        c = compute_change[r] if k >= compute_at else 1.0
        f = link_factor if k >= link_at else 1.0
        skew = 1.0 + rng.random() * 0.5  # waiting for peers: a rank-local inflation of its link times
        sizes = rng.sample(SIZES, 4)
        return window(sizes, 2e-4 * skew, f * 1e-9 * skew, (0.03 + 0.01 * r) * c * (1 + rng.random() * 0.05),
                      iterations=rng.randint(1, 4))

    decisions = [[] for _ in range(world)]
    hyst = [Hysteresis(0.2, 2) for _ in range(world)]
    base = None
    for k in range(checks):
        gathered = torch.tensor([Window.to_vector(measure(r, k)) for r in range(world)], dtype=torch.float64)
        for r in range(world):  # each rank decodes and decides on its own
            windows = [Window.from_vector(row.tolist()) for row in gathered.clone()]
            if base is None:
                decisions[r].append(("baseline",))
                continue
            e = adaptive.combine(base, windows)
            decisions[r].append((hyst[r].update(e), e))
        base = base or [Window.from_vector(row.tolist()) for row in gathered]
    assert all(d == decisions[0] for d in decisions)


def test_rescale_scales_compute_and_link():
    p = model_like_profile(8, total_params=1_000_000)
    e = Estimate(compute=2.0, link=3.0, beta=3.5, link_rank=0, span_s=(0.0, 0.0))
    q = adaptive.rescale(p, e)
    assert q.alpha_s == p.alpha_s and q.beta_s_per_byte == pytest.approx(p.beta_s_per_byte * 3.5)
    assert [t.bwd_s for t in q.tensors] == pytest.approx([2 * t.bwd_s for t in p.tensors])
    assert [t.fwd_s for t in q.tensors] == pytest.approx([2 * t.fwd_s for t in p.tensors])
    assert q.numels == p.numels and q.order() == p.order()


def test_worth_switching_needs_a_gain_beyond_the_threshold():
    assert adaptive.worth_switching(1.2, 1.0, 0.1)
    assert not adaptive.worth_switching(1.05, 1.0, 0.1)
    assert not adaptive.worth_switching(1.0, 1.0, 0.0)
    assert adaptive.worth_switching(math.inf, 1.0, 0.1)
    assert not adaptive.worth_switching(1.0, math.nan, 0.1)


def test_a_changed_link_makes_a_fresh_plan_worth_it_where_the_old_one_is_wrong():
    """The point of it all, in the simulator, on the shipped VGG profile: the link becomes 4x faster; the plan
    made for the new estimates is predicted faster than the old one under them by more than 10 %. With
    nothing changed, the fresh plan is predicted no faster (no switch)."""
    p = Profile.load(PROFILES / "vgg.json")
    kw = {"channels": 2, "overlap_forward": True}
    fifo = planning.CHANNEL_FIFO
    old = planning.make_plan(p, "dcredit", **kw)
    t_same = iteration_time(planning.make_plan(p, "dcredit", **kw), p, channel_fifo=fifo)
    assert not adaptive.worth_switching(iteration_time(old, p, channel_fifo=fifo), t_same, 0.0)
    q = adaptive.rescale(p, est(link=0.25))
    t_old = iteration_time(old, q, channel_fifo=fifo)
    t_new = iteration_time(planning.make_plan(q, "dcredit", **kw), q, channel_fifo=fifo)
    assert adaptive.worth_switching(t_old, t_new, 0.1), (t_old, t_new)


def test_rescale_prices_the_links_change_with_the_profiles_own_alpha():
    """The estimate carries the traffic it saw: beta takes the whole change where the profile's start-up is
    nothing, and the part the profile's start-up leaves where it is not; the window fit's split (``beta``,
    x0.06 here, as once measured under load) is not used."""
    p = model_like_profile(8, total_params=1_000_000)
    nbytes, collectives = 4e6, 8.0
    free = dataclasses.replace(p, alpha_s=0.0)
    e = Estimate(compute=1.0, link=0.6, beta=0.06, link_rank=0, span_s=(0.0, 0.0), traffic=(collectives, nbytes))
    assert adaptive.rescale(free, e).beta_s_per_byte == pytest.approx(0.6 * p.beta_s_per_byte)
    q = adaptive.rescale(p, e)
    before = p.alpha_s * collectives + p.beta_s_per_byte * nbytes
    after = q.alpha_s * collectives + q.beta_s_per_byte * nbytes
    assert q.alpha_s == p.alpha_s and after == pytest.approx(0.6 * before)


def test_a_planner_beside_training_lets_go_of_the_interpreter_between_steps(monkeypatch):
    """Note [Planning beside training]: inside ``beside_training`` the search pauses (a blocking call, which hands
    the interpreter to a waiting thread) at every candidate it replays; outside, and on other threads, never."""
    import threading

    from dcredit_opt.planner import sharing
    from dcredit_opt.profiling.planning import make_plan

    slept: list = []
    monkeypatch.setattr(sharing.time, "sleep", lambda s: slept.append((threading.current_thread().name, s)))
    profile = model_like_profile(8, total_params=1_000_000)
    plan = make_plan(profile, "dcredit", channels=2, overlap_forward=True)
    assert slept == []
    with sharing.beside_training():
        assert make_plan(profile, "dcredit", channels=2, overlap_forward=True) == plan  # the same plan
        other = threading.Thread(target=lambda: make_plan(profile, "dcredit", channels=2, overlap_forward=True),
                                 name="elsewhere")
        other.start()
        other.join()
    assert len(slept) > 10 and all(s == ("MainThread", 0) for s in slept)
    n = len(slept)
    make_plan(profile, "dcredit", channels=2, overlap_forward=True)
    assert len(slept) == n
