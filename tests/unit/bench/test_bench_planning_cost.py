"""How long planning takes (benchmarks/planning_cost.py): it runs and prints its table."""

from benchmarks import planning_cost


def test_planning_cost_runs(capsys):
    planning_cost.main(["--tensors", "12", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "dcredit" in out and "plan ms" in out
