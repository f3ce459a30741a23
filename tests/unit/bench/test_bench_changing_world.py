"""benchmarks/changing_world.py and benchmarks/replan_cost.py without processes: the jobs of a round, the
per-phase summary and the reports, on made-up iteration times."""

import datetime

import pytest

from benchmarks import changing_world, replan_cost


def _run(times, replans=()):
    return {"iter_times_s": list(times), "replans": [{"from_timed_iteration": k, "reason": "moved: link x4",
                                                      "predicted_old_s": 2.0, "predicted_new_s": 1.0}
                                                     for k in replans], "profile": None, "log": []}


def test_a_round_runs_both_whole_jobs_and_a_fresh_job_per_condition():
    names = [j[0] for j in changing_world.jobs("rate-down-up")]
    # and the launch-to-launch control: the last condition's fresh job once more
    assert names == ["adaptive", "once", "fresh@1gbit/b8", "fresh@250mbit/b8", "again@1gbit/b8"]
    (_, phases, iters, adaptive, policy), (_, _, _, once, _) = changing_world.jobs("compute")[:2]
    assert adaptive and not once and phases[-1][2] == 32 and iters == 70 and policy == "dcredit"
    fresh = changing_world.jobs("compute")[3]
    assert fresh[1] == [(0, "1gbit", 32)] and not fresh[3]
    # --history adds the fixed-plan control: the whole scenario, and a job started in each condition
    extra = changing_world.jobs("compute", history=True)[5:]
    assert [(j[0], j[1], j[3], j[4]) for j in extra] == [
        ("history", phases, False, "fixed"), ("history-fresh@1gbit/b16", [(0, "1gbit", 16)], False, "fixed"),
        ("history-fresh@1gbit/b32", [(0, "1gbit", 32)], False, "fixed")]


def test_each_phase_is_measured_after_it_settled_against_the_fresh_job():
    # adaptive: slow for 22 iterations after the switch at 30, then as fast as the fresh job; once stays slow
    adaptive = [1.0] * 30 + [2.0] * 22 + [1.0] * 18
    runs = {"adaptive": [_run(adaptive, replans=[52])], "once": [_run([1.0] * 30 + [2.0] * 40)],
            "fresh@1gbit/b16": [_run([1.0] * 15)], "fresh@1gbit/b32": [_run([1.0] * 15)]}
    first, second = changing_world.summarize("compute", runs)
    assert first["measured_from"] == 0 and first["adaptive_over_fresh"] == pytest.approx(1.0)
    assert second["measured_from"] == 30 + changing_world.SETTLE and second["iterations"] == [30, 70]
    assert second["adaptive_s"] == pytest.approx(1.0)  # iterations 50-69: 2 slow, 18 fast
    assert second["once_over_adaptive"] == pytest.approx(2.0 / second["adaptive_s"])
    assert second["replans"] == [[52]] and first["replans"] == [[]]
    record = {"scenario": "compute", "model": "vgg", "phases": changing_world.SCENARIOS["compute"][1], "rounds": 1,
              "date": "2026-11-27", "hardware": {}, "runs": runs, "summary": [first, second],
              "conditions": {"load_start": [1, 1, 1], "load_end": [2, 2, 2], "wall_s": 10.0}}
    text = changing_world.markdown(record)
    assert "| 1 (50-70) | 1gbit/b32 |" in text and "from iteration 52: moved: link x4" in text
    assert "history / history-fresh" not in text  # no control was run


def test_the_history_control_compares_a_fixed_plan_with_its_past_against_one_started_there():
    # the same fixed plan: 1.1 s per iteration at batch 32 after running batch 16, 1.0 s when started at 32
    runs = {"adaptive": [_run([1.0] * 70)], "once": [_run([1.0] * 70)],
            "fresh@1gbit/b16": [_run([1.0] * 15)], "fresh@1gbit/b32": [_run([1.0] * 15)],
            "history": [_run([0.5] * 30 + [1.1] * 40)], "history-fresh@1gbit/b16": [_run([0.5] * 15)],
            "history-fresh@1gbit/b32": [_run([1.0] * 15)]}
    first, second = changing_world.summarize("compute", runs)
    assert first["history_over_fresh"] == pytest.approx(1.0) and second["history_over_fresh"] == pytest.approx(1.1)
    record = {"scenario": "compute", "model": "vgg", "phases": changing_world.SCENARIOS["compute"][1], "rounds": 1,
              "date": "2026-11-27", "hardware": {}, "runs": runs, "summary": [first, second],
              "conditions": {"load_start": [1, 1, 1], "load_end": [2, 2, 2], "wall_s": 10.0}}
    assert "- phase 1 (1gbit/b32): history / history-fresh 1.100" in changing_world.markdown(record)


def test_the_cost_report_counts_replans_and_the_timed_watching():
    on, off = [0.1] * 200, [0.1] * 200
    result = {"on_s": on, "off_s": off, "observe_s": [1e-4] * 200, "check_s": [0.0] * 180 + [1e-3] * 20,
              "gather_s": [5e-4] * 20, "replans": [], "estimates": [[1.0, 1.0, []]] * 20,
              "config": {"replan_every": 10, "replan_threshold": 0.1}}
    record = {"date": datetime.date.today().isoformat(), "model": "tiny", "batch": 2, "hardware": {},
              "conditions": {"load_start": [1, 1, 1], "load_end": [1, 1, 1], "wall_s": 1.0}, "result": result}
    text = replan_cost.markdown(record)
    assert "| **re-plans** | **0** |" in text
    assert "| checks (every 10 steps) / with estimates moved beyond 10% | 20 / 0 |" in text
    # (200 * 0.1 ms + 20 * 1 ms) / 200 iterations = 0.2 ms, 0.2 % of 100 ms
    assert "**200.0 us, 0.200 %**" in text


def test_two_launches_of_one_job_and_the_plans_are_compared_in_the_last_phase():
    from dcredit_opt.optimizer.layout import fixed_plan
    from dcredit_opt.planner.profile import Profile, TensorProfile

    profile = Profile(tensors=tuple(TensorProfile(f"t{i}", 1 << 16, "float32", i, 1e-3, 2e-3) for i in range(4)),
                      alpha_s=1e-4, beta_s_per_byte=1e-9, world_size=2)
    small, large = (fixed_plan([1 << 16] * 4, [4] * 4, b, 1, 1, 0, True).to_dict() for b in (1 << 14, 1 << 20))
    adaptive, fresh = _run([1.0] * 70), _run([1.0] * 15)
    adaptive["plan"], fresh["plan"], fresh["profile"] = small, large, profile.to_dict()
    runs = {"adaptive": [adaptive], "once": [_run([1.0] * 70)], "fresh@1gbit/b16": [_run([1.0] * 15)],
            "fresh@1gbit/b32": [fresh], "again@1gbit/b32": [_run([1.2] * 15)]}
    first, second = changing_world.summarize("compute", runs)
    assert "again_over_fresh" not in first and second["again_over_fresh"] == pytest.approx(1.2)
    (compared,) = second["plans"]
    # 16 blocks of 64 KiB pay 16 start-ups where 4 blocks of 256 KiB pay 4: the small blocks' plan is slower
    assert not compared["same"] and compared["adaptive_plan_over_fresh"] > 1.0
    record = {"scenario": "compute", "model": "vgg", "phases": changing_world.SCENARIOS["compute"][1], "rounds": 1,
              "date": "2026-11-28", "hardware": {}, "runs": runs, "summary": [first, second],
              "conditions": {"load_start": [1, 1, 1], "load_end": [2, 2, 2], "wall_s": 10.0}}
    text = changing_world.markdown(record)
    assert "(`again`) took 1.200x the `fresh` job's time" in text
    assert "- round 0: the adaptive job's last plan is not the fresh job's" in text
