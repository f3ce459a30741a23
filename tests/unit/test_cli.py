"""``python -m dcredit_opt``: help with examples, policies listed and ``all`` honoured, one-line errors,
shipped profiles as package data, ``profile`` on a user's own model, nothing from ``benchmarks/``.

Everything that fails before the job is joined runs in this process; ``profile`` itself joins a
world of one, so it runs in a subprocess (this process's runtime stays untouched)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dcredit_opt.cli import commands as cli
from dcredit_opt.cli.model_profile import forward
from dcredit_opt.config import reference_markdown
from dcredit_opt.planner.cost import ring_allreduce
from dcredit_opt.planner.profile import Profile
from tests import timing

ROOT = Path(__file__).resolve().parents[2]

MODEL_FILE = '''
import torch

NOT_CALLABLE = 3

def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    batch = (torch.randn(16, 32), torch.randint(0, 10, (16,)))
    return model, batch, torch.nn.functional.cross_entropy

def two_things():
    return torch.nn.Linear(2, 2), None

def bad_batch():
    return torch.nn.Linear(2, 2), torch.randn(3, 2), torch.nn.functional.mse_loss

def not_a_model():
    return "model", (1, 2), print
'''


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as e:  # argparse: --help (0) and usage errors (2)
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 1, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def model_file(tmp_path) -> Path:
    path = tmp_path / "mymodels.py"
    path.write_text(MODEL_FILE)
    return path


# ---- help ------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", [[], ["profile"], ["plan"], ["simulate"], ["config"]])
def test_every_command_has_help_with_examples(capsys, command):
    code, out, _ = run_cli(capsys, *command, "--help")
    assert code == 0
    assert "examples:" in out and "python -m dcredit_opt " in out.split("examples:")[1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_policy_help_lists_every_policy_and_all(capsys, command):
    _, out, _ = run_cli(capsys, command, "--help")
    choices = re.search(r"--policy \{([^}]*)\}", out).group(1).split(",")
    assert choices == ["all", *cli.POLICY_ORDER]
    text = " ".join(out.split())  # argparse wraps lines wherever the width falls
    for name in cli.POLICY_ORDER:
        assert f"{name} (" in text, f"--help does not describe {name}"


@pytest.mark.timeout(60)
def test_config_prints_the_configuration_reference(capsys):
    code, out, err = run_cli(capsys, "config")
    assert code == 0 and not err
    assert out == reference_markdown() and out.startswith("# Configuration\n")


@pytest.mark.timeout(60)
def test_an_unknown_policy_is_refused_naming_the_known_ones(capsys):
    code, _, err = run_cli(capsys, "plan", "--profile", "vgg", "--policy", "fastest")
    assert code == 2
    assert "unknown policy fastest" in err and "all, " + ", ".join(cli.POLICY_ORDER) in err


# ---- plan and simulate ---------------------------------------------------------------


@pytest.mark.timeout(120)
def test_plan_policy_all_plans_every_policy(capsys):
    code, out, _ = run_cli(capsys, "plan", "--profile", "vgg", "--policy", "all")
    assert code == 0
    planned = re.findall(r"^policy (\w+):", out, re.MULTILINE)
    assert planned == list(cli.POLICY_ORDER), out


@pytest.mark.timeout(120)
def test_plan_json_one_policy_or_several(capsys):
    code, out, _ = run_cli(capsys, "plan", "--profile", "vgg", "--policy", "wfbp", "--json")
    assert code == 0 and json.loads(out)["policy"] == "wfbp"
    code, out, _ = run_cli(capsys, "plan", "--profile", "vgg", "--policy", "ddp,dcredit", "--json")
    plans = json.loads(out)
    assert code == 0 and list(plans) == ["ddp", "dcredit"] and plans["dcredit"]["policy"] == "dcredit"


@pytest.mark.timeout(120)
def test_simulate_table_plot_and_timeline(capsys, tmp_path):
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed (pip install 'dcredit-opt[plot]')")
    png, trace = tmp_path / "scale.png", tmp_path / "trace.json"
    code, out, err = run_cli(capsys, "simulate", "--profile", "gpt", "--workers", "16,64", "--policy", "ddp,dcredit",
                             "--plot", str(png), "--timeline", str(trace))
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0].split() == ["workers", "bound", "ms", "ddp", "ms", "dcredit", "ms", "ddp", "vs", "ddp",
                                "dcredit", "vs", "ddp"]
    assert [line.split()[0] for line in lines[1:]] == ["16", "64"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(trace.read_text())


@pytest.mark.timeout(60)
def test_shipped_profiles_are_package_data_and_load_from_anywhere(capsys, tmp_path, monkeypatch):
    shipped = sorted(p.stem for p in (ROOT / "dcredit_opt" / "profiles").glob("*.json"))
    assert shipped == sorted(cli.SHIPPED_PROFILES)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dcredit_opt = ["profiles/*.json"]' in pyproject, "the profiles must be package data"
    monkeypatch.chdir(tmp_path)
    for name in cli.SHIPPED_PROFILES:
        assert cli.load_profile(name).world_size >= 2


@pytest.mark.timeout(60)
def test_a_profile_file_beats_a_shipped_name(tmp_path, monkeypatch):
    mine = cli.load_profile("gpt")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "vgg").write_text(mine.to_json())
    assert cli.load_profile("vgg").num_tensors == mine.num_tensors


# ---- one-line errors -------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_a_missing_profile_is_one_line(capsys, tmp_path, command):
    code, _, err = run_cli(capsys, command, "--profile", str(tmp_path / "nope.json"))
    assert_one_line_error(code, err, "no profile file", "shipped profiles: vgg")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text, needle", [("{not json", "not valid JSON"), ('{"tensors": []}', "not a valid profile")])
def test_a_broken_profile_is_one_line(capsys, tmp_path, text, needle):
    path = tmp_path / "broken.json"
    path.write_text(text)
    code, _, err = run_cli(capsys, "plan", "--profile", str(path))
    assert_one_line_error(code, err, needle)


@pytest.mark.timeout(60)
def test_plot_without_matplotlib_is_one_line_before_any_work(capsys, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    code, out, err = run_cli(capsys, "simulate", "--profile", "vgg", "--plot", str(tmp_path / "x.png"))
    assert_one_line_error(code, err, "--plot needs matplotlib", "pip install 'dcredit-opt[plot]'")
    assert out == ""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("option", ["--plot", "--timeline"])
def test_an_output_in_a_missing_folder_is_one_line(capsys, tmp_path, option):
    code, out, err = run_cli(capsys, "simulate", "--profile", "vgg", option, str(tmp_path / "no" / "such" / "x"))
    assert_one_line_error(code, err, f"{option} ", "does not exist")
    assert out == ""


@pytest.mark.timeout(60)
def test_simulate_refuses_a_one_rank_profile_in_one_line(capsys, tmp_path):
    import dataclasses

    path = tmp_path / "one.json"
    dataclasses.replace(cli.load_profile("vgg"), world_size=1).save(path)
    code, _, err = run_cli(capsys, "simulate", "--profile", str(path))
    assert_one_line_error(code, err, "measured on one rank")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec, needle", [
    ("mymodels", "--model wants pkg.module:factory"),
    ("{dir}/mymodels.py:", "--model wants pkg.module:factory"),
    ("no_such_module_dcredit:make", "no module named 'no_such_module_dcredit'"),
    ("{dir}/missing.py:make", "no such file"),
    ("{dir}/mymodels.py:nothere", "has no attribute 'nothere'"),
    ("{dir}/mymodels.py:NOT_CALLABLE", "not callable"),
    ("{dir}/mymodels.py:two_things", "not (model, batch, loss_fn)"),
    ("{dir}/mymodels.py:bad_batch", "must be a pair (inputs, target)"),
    ("{dir}/mymodels.py:not_a_model", "not a torch.nn.Module"),
    ("{dir}/needs_missing.py:make", "imports 'no_such_package_dcredit', which is not installed"),
])
def test_a_bad_model_spec_is_one_line(capsys, model_file, spec, needle):
    (model_file.parent / "needs_missing.py").write_text("import no_such_package_dcredit\n")
    out = model_file.parent / "out.json"
    code, _, err = run_cli(capsys, "profile", "--model", spec.format(dir=model_file.parent), "--out", str(out))
    assert_one_line_error(code, err, needle)
    assert not out.exists()


@pytest.mark.timeout(60)
def test_profile_checks_its_output_folder_first(capsys, model_file):
    code, _, err = run_cli(capsys, "profile", "--model", f"{model_file}:make", "--out", "/no/such/folder/p.json")
    assert_one_line_error(code, err, "--out", "does not exist")


# ---- profile on a user's model -------------------------------------------------------------


def _python(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DCREDIT_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                         "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timing.scaled(timeout), check=False)


@pytest.mark.timeout(180)
def test_profile_a_model_defined_in_a_file(model_file, capsys):
    out = _python("-m", "dcredit_opt", "profile", "--model", "mymodels.py:make", "--out", "mine.json", "--iters", "2",
                  "--threads", "1", "--gbit", "10", cwd=model_file.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("wrote mine.json: 4 tensors, 2,762 parameters"), out.stdout
    assert "assumed: 10 Gbit/s links" in out.stdout
    profile = Profile.load(model_file.parent / "mine.json")
    assert [t.name for t in profile.tensors] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert profile.world_size == 2  # a ring of two over the assumed link
    assert profile.beta_s_per_byte == pytest.approx(ring_allreduce(0.0, 8 / 10e9, 1, 2))
    assert profile.alpha_s == pytest.approx(ring_allreduce(100e-6, 0.0, 0, 2))
    assert all(t.bwd_s >= 0 for t in profile.tensors)
    code, text, err = run_cli(capsys, "plan", "--profile", str(model_file.parent / "mine.json"), "--policy", "all")
    assert code == 0 and len(re.findall(r"^policy ", text, re.MULTILINE)) == len(cli.POLICY_ORDER), err


@pytest.mark.timeout(180)
def test_profile_a_model_by_module_name_from_the_current_folder(tmp_path):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(MODEL_FILE)
    out = _python("-m", "dcredit_opt", "profile", "--model", "mypkg.models:make", "--out", "p.json", "--iters", "1",
                  cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "p.json").is_file()


@pytest.mark.timeout(60)
def test_inputs_spread_as_positional_or_keyword_arguments():
    class Two(torch.nn.Module):
        def forward(self, a, b=0):
            return a * 10 + b

    two = Two()
    assert forward(two, torch.tensor(1)).item() == 10
    assert forward(two, (torch.tensor(1), torch.tensor(2))).item() == 12
    assert forward(two, {"a": torch.tensor(1), "b": torch.tensor(3)}).item() == 13


# ---- the installed package stands alone ----------------------------------------------------


@pytest.mark.timeout(60)
def test_the_package_imports_nothing_from_the_repository(tmp_path):
    importing = [str(p.relative_to(ROOT)) for p in (ROOT / "dcredit_opt").rglob("*.py")
                 if re.search(r"^\s*(from|import)\s+(benchmarks|tests|examples)\b", p.read_text(), re.MULTILINE)]
    assert not importing, importing
    probe = ("import sys, dcredit_opt.cli.commands, dcredit_opt.cli.model_profile; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('benchmarks', 'tests', 'examples')))")
    out = _python("-c", probe, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
