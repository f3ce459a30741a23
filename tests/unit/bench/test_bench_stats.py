import math
import random

import numpy as np
import pytest

from benchmarks.stats import (
    Launch,
    bound_s,
    median,
    quantile,
    ratio,
    schedule,
    speedup_interval,
    summarize,
    table,
)

# -- schedule -------------------------------------------------------------------


def test_schedule_interleaves_schemes_round_by_round():
    got = schedule(["vgg"], ["1gbit"], ["a", "b", "c"], rounds=3)
    assert [x.scheme for x in got] == list("abcabcabc")
    assert [x.round for x in got] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_schedule_groups_by_rate_then_model():
    got = schedule(["vgg", "gpt"], ["1gbit", "10gbit"], ["a", "b"], rounds=2)
    assert len(got) == 2 * 2 * 2 * 2
    # A rate's launches are contiguous: the network is rebuilt once per rate.
    rates = [x.rate for x in got]
    assert rates == ["1gbit"] * 8 + ["10gbit"] * 8
    assert got[:4] == [Launch("vgg", "1gbit", 0, "a"), Launch("vgg", "1gbit", 0, "b"),
                       Launch("vgg", "1gbit", 1, "a"), Launch("vgg", "1gbit", 1, "b")]
    assert {x.model for x in got[4:8]} == {"gpt"}


def test_schedule_each_scheme_runs_once_per_round():
    got = schedule(["m"], ["r"], ["a", "b", "c", "d"], rounds=5)
    for k in range(5):
        assert sorted(x.scheme for x in got if x.round == k) == ["a", "b", "c", "d"]


@pytest.mark.parametrize("rounds", [0, -1])
def test_schedule_rejects_no_rounds(rounds):
    with pytest.raises(ValueError):
        schedule(["m"], ["r"], ["a"], rounds)


def test_schedule_rejects_duplicate_schemes():
    with pytest.raises(ValueError):
        schedule(["m"], ["r"], ["a", "a"], 1)


# -- statistics -------------------------------------------------------------------


@pytest.mark.parametrize("xs", [[1.0], [3.0, 1.0], [5.0, 1.0, 2.0, 4.0, 3.0], [0.1, 0.7, 0.2, 0.9]])
@pytest.mark.parametrize("q", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_quantile_matches_numpy_linear(xs, q):
    assert quantile(xs, q) == pytest.approx(float(np.quantile(xs, q)))


def test_median_odd_and_even():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 2.0, 3.0]) == 2.5


def test_quantile_rejects_bad_input():
    with pytest.raises(ValueError):
        quantile([], 0.5)
    with pytest.raises(ValueError):
        quantile([1.0], 1.5)


def test_summarize():
    s = summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    assert (s.n, s.median_s, s.min_s, s.max_s) == (5, 3.0, 1.0, 100.0)
    assert (s.q1_s, s.q3_s, s.iqr_s) == (2.0, 4.0, 2.0)


def test_bound_is_max_of_known_parts():
    assert bound_s(0.5, 1.2) == 1.2
    assert bound_s(1.5, 1.2) == 1.5
    assert bound_s(None, 1.2) == 1.2
    assert bound_s(0.5, None) == 0.5
    assert bound_s(None, None) is None


def test_ratio_handles_missing_and_zero():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None
    assert ratio(1.0, None) is None
    assert ratio(1.0, 0.0) is None


def test_table_speedup_and_ratio_to_bound():
    times = {
        "compute": [0.5, 0.5, 0.5],
        "comm": [1.0, 1.0, 1.0],
        "ddp": [1.5, 1.4, 1.6],
        "dc-dcredit": [1.2, 1.1, 1.3],
    }
    schemes = ["compute", "comm", "ddp", "dc-dcredit", "horovod"]
    rows, bound = table(times, schemes, {"horovod": "skipped: not installed"})
    assert bound == 1.0
    by = {r.scheme: r for r in rows}
    assert [r.scheme for r in rows] == schemes  # order kept, missing ones included
    assert by["ddp"].speedup_vs_ddp == 1.0
    assert by["ddp"].ratio_to_bound == pytest.approx(1.5)
    assert by["dc-dcredit"].speedup_vs_ddp == pytest.approx(1.5 / 1.2)
    assert by["dc-dcredit"].ratio_to_bound == pytest.approx(1.2)
    # The bound schemes are not compared with the bound or with DDP.
    assert by["comm"].speedup_vs_ddp is None and by["comm"].ratio_to_bound is None
    assert by["horovod"].summary is None and by["horovod"].note == "skipped: not installed"


def test_table_without_ddp_or_bounds():
    rows, bound = table({"dc-wfbp": [2.0, 2.0]}, ["dc-wfbp", "ddp"])
    assert bound is None
    assert rows[0].speedup_vs_ddp is None and rows[0].ratio_to_bound is None
    assert rows[1].summary is None and rows[1].note == "no data"
    assert not math.isnan(rows[0].summary.median_s)


def test_speedup_interval_holds_the_point_estimate_and_narrows_with_more_launches():
    rng = random.Random(1)
    ddp = [[1.2 + rng.gauss(0, 0.05) for _ in range(10)] for _ in range(3)]
    fast = [[1.0 + rng.gauss(0, 0.05) for _ in range(10)] for _ in range(3)]
    lo, hi = speedup_interval(ddp, fast)
    point = median([t for x in ddp for t in x]) / median([t for x in fast for t in x])
    assert lo <= point <= hi and lo > 1.0, (lo, point, hi)
    more = speedup_interval(ddp * 4, fast * 4)
    assert more[1] - more[0] < hi - lo
    assert speedup_interval(ddp, fast) == (lo, hi), "the interval is not reproducible"


def test_speedup_interval_holds_one_for_the_same_distribution_and_none_without_data():
    rng = random.Random(2)
    a = [[1.0 + rng.gauss(0, 0.1) for _ in range(10)] for _ in range(3)]
    b = [[1.0 + rng.gauss(0, 0.1) for _ in range(10)] for _ in range(3)]
    lo, hi = speedup_interval(a, b)
    assert lo < 1.0 < hi
    assert speedup_interval([], b) is None and speedup_interval(a, [[]]) is None


def test_one_launch_that_differs_widens_the_interval():
    # Launch-to-launch spread (one slow launch) must show in the interval, not be averaged away as if every
    # iteration were an independent draw.
    steady = [[1.0] * 10, [1.0] * 10, [1.0] * 10]
    drifting = [[1.0] * 10, [1.0] * 10, [1.3] * 10]
    lo, hi = speedup_interval(steady, drifting)
    assert lo < 0.8 and hi == pytest.approx(1.0)


def test_table_gives_each_speedup_its_interval():
    times = {"ddp": [1.2] * 6, "dc-dcredit": [1.0] * 6}
    launches = {"ddp": [[1.2] * 3, [1.2] * 3], "dc-dcredit": [[1.0] * 3, [1.0] * 3]}
    rows, _ = table(times, ["ddp", "dc-dcredit"], launches=launches)
    by = {r.scheme: r for r in rows}
    assert by["dc-dcredit"].speedup_ci == pytest.approx((1.2, 1.2))
    assert by["ddp"].speedup_ci == pytest.approx((1.0, 1.0))


def test_speedup_text_says_no_difference_when_the_interval_holds_one():
    from benchmarks.report import speedup_text

    assert speedup_text(1.08, (1.02, 1.15)) == "1.08x [1.02, 1.15]"
    assert speedup_text(1.01, [0.97, 1.05]) == "1.01x [0.97, 1.05] no difference"
    assert speedup_text(None, None) == "-" and speedup_text(1.5, None) == "1.50x"
