"""F1: training through dcredit_opt equals synchronous data parallelism."""

import itertools

import pytest

from . import spawn, workers

TOL = 2e-5  # float32 sums in a different order; 20 steps of Adam amplify little
# Steps per configuration in the many-configuration runs here and in test_backends.py (20 before: CI time). A block
# reduced wrongly, twice, late or not at all parts the weights from the reference at the step it happens, and
# every step here has the same plan; 8 steps still apply 7 lazy (phase 2) updates over the next forward and carry
# momentum, Adam, RMSprop, Adagrad and Adadelta state through 7 updates. The long runs (test_long_run.py, the
# scenarios) keep their lengths.
CONFIG_STEPS = 8


def _check(results):
    for key in results[0]:
        diffs = [r[key][0] for r in results]
        sums = [r[key][1] for r in results]
        assert max(diffs) < TOL, f"{key}: parameters differ from the synchronous reference by {max(diffs)}"
        assert len({round(s, 6) for s in sums}) == 1, f"{key}: ranks disagree: {sums}"


@pytest.mark.timeout(600)
def test_every_optimizer_phase2_and_windows_on_2_ranks():
    # Every optimizer with phase 2 on and off; the windows go round so that every (phase 2, window) pair meets
    # two optimizers and each optimizer two windows (the full product, 36 configurations, took 140 s of CI).
    windows = (1, 2, 4)
    configs = [{"opt": o, "phase2": p2, "window": windows[(i + p2) % len(windows)], "block_bytes": 96}
               for i, o in enumerate(workers.OPTIMIZERS) for p2 in (True, False)]
    assert {(c["phase2"], c["window"]) for c in configs} == set(itertools.product((True, False), windows))
    _check(spawn.run(workers.equivalence, 2, timeout_s=540, configs=configs, steps=CONFIG_STEPS))


@pytest.mark.timeout(600)
def test_4_ranks_small_blocks_and_release_all():
    configs = [{"opt": "sgd", "phase2": True, "window": w, "block_bytes": 64, "channels": c}
               for w, c in ((1, 1), (2, 2), (4, 4), (-1, 2))]
    configs.append({"opt": "adam", "phase2": False, "window": 2, "block_bytes": 1 << 20})
    _check(spawn.run(workers.equivalence, 4, timeout_s=560, configs=configs, steps=CONFIG_STEPS))


SCENARIOS = ["backward_passes", "clipping", "unused_on_one_rank", "frozen", "eval_after_step", "checkpoint",
             "lr_scheduler", "reduce_ops"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_matches_reference(name):
    check_scenario(name, spawn.run(workers.scenario, 2, timeout_s=160, name=name))


def check_scenario(name, results, backend=None):
    """Every rank matches the reference (and any *_diff / flag it reports), and the ranks agree."""
    for r in results:
        if backend is not None:
            assert r["backend"] == backend, f"{name}: blocks went through {r['backend']}"
        assert r["diff"] < TOL, f"{name}: differs from the reference by {r['diff']}"
        for key, value in r.items():
            if key.endswith("_diff"):
                assert value < TOL, f"{name}: {key} = {value}"
            elif isinstance(value, bool):
                assert value, f"{name}: {key} is False"
    assert len({round(r["checksum"], 6) for r in results}) == 1, f"{name}: ranks disagree"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("policy", ["dcredit", "bytescheduler", "mgwfbp", "oasr", "usbyte"])
def test_profiled_plan_is_agreed_and_switched_together(policy):
    results = spawn.run(workers.scenario, 2, timeout_s=220, name=f"profiled_{policy}")
    for r in results:
        assert r["diff"] < TOL, f"{policy}: differs from the reference by {r['diff']}"
        assert r["policy"] == policy
    plans0, plans1 = results[0]["plans"], results[1]["plans"]
    assert plans0 == plans1, "ranks ran different plans in some iteration"
    switch = [i for i in range(1, len(plans0)) if plans0[i] != plans0[i - 1]]
    assert switch == [3], f"expected one switch, right after the 3 profiled iterations: {switch}"
