"""A pip user's install, end to end: sdist -> wheel -> a fresh venv -> use it from elsewhere.

The source tree (without build products) is copied to a temporary folder,
an sdist is built from it, a wheel is built from that sdist alone (as pip
does, ``--no-build-isolation`` against this environment's torch) and
installed with ``pip install --no-index`` into a fresh venv. Offline and
without copying torch: the fresh venv sees this environment's third-party
packages (torch, numpy, ...) through a ``.pth`` file naming a folder of
links to them, leaving out dcredit-opt's own install, so pip resolves the
wheel's requirements to them and the installed package is the one in use.
Then, from a folder outside the tree: import, ``--help``, ``plan`` and
``simulate`` on a shipped profile, and ``profile`` on a model defined in a
temporary file.

Slow (two builds of the extension: about 1 to 3 minutes on two cores), so
one module-scoped build serves every test here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests import timing

ROOT = Path(__file__).resolve().parents[2]
# Build products and tools of a checkout: not part of the source an sdist is made from.
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "*.so",
                                    "_build_info.py", ".pytest_cache", ".hypothesis", ".ruff_cache")
BUILD_TIMEOUT_S = 480  # one build of the extension: 45-80 s idle on two cores, ~4x that when busy
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 120)

MODEL_FILE = '''
import torch

def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    batch = (torch.randn(16, 32), torch.randint(0, 10, (16,)))
    return model, batch, torch.nn.functional.cross_entropy
'''


def _clean_env(**extra: str) -> dict:
    """No launcher, no DCREDIT_* configuration, no PYTHONPATH into the checkout."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DCREDIT_", "PYTHON", "PIP_REQUIRE", "VIRTUAL_ENV"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    # ninja (in this environment's bin) makes the extension build parallel.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.update(extra)
    return env


def _run(args, cwd: Path, timeout: float = 120, env: dict | None = None, check: bool = True):
    out = subprocess.run([str(a) for a in args], cwd=cwd, env=env or _clean_env(), capture_output=True,
                         text=True, timeout=timing.scaled(timeout), check=False)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} exited {out.returncode}:\n"
                             f"{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
    return out


def _site_packages(python: Path) -> Path:
    out = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=python.parent)
    return Path(out.stdout.strip())


def _third_party_links(folder: Path) -> Path:
    """A folder of links to this environment's installed packages, dcredit-opt's own install left out."""
    folder.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        name = entry.name.lower()
        if name.endswith(".pth") or name.startswith(("dcredit", "__editable__")):
            continue
        (folder / entry.name).symlink_to(entry)
    return folder


@dataclasses.dataclass
class Install:
    """What the module-scoped build made."""

    sdist: Path = None
    wheel: Path = None
    python: Path = None  # the fresh venv's
    bin: Path = None
    elsewhere: Path = None  # a working folder outside the source tree


@pytest.fixture(scope="module")
def install(tmp_path_factory) -> Install:
    tmp = tmp_path_factory.mktemp("packaging")
    it = Install()
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=NOT_SOURCE, symlinks=True)

    # The sdist, as `python -m build --sdist --no-isolation` makes it.
    dist = tmp / "dist"
    build_sdist = f"from setuptools import build_meta; print(build_meta.build_sdist({str(dist)!r}))"
    out = _run([sys.executable, "-c", build_sdist], cwd=src, timeout=120)
    it.sdist = dist / out.stdout.strip().splitlines()[-1]

    # The wheel, from the sdist alone.
    wheels = tmp / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index", "--no-cache-dir",
          "-w", wheels, it.sdist], cwd=tmp, timeout=BUILD_TIMEOUT_S, env=_clean_env(MAX_JOBS="2"))
    (it.wheel,) = wheels.glob("dcredit_opt-*.whl")

    # A fresh venv that sees torch through a .pth, then pip, offline.
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp)
    it.bin = venv / "bin"
    it.python = it.bin / "python"
    links = _third_party_links(tmp / "third_party")
    (_site_packages(it.python) / "third_party.pth").write_text(f"{links}\n")
    _run([sys.executable, "-m", "pip", "--python", it.python, "install", "--no-index", "--no-cache-dir", it.wheel],
         cwd=tmp, timeout=120)

    it.elsewhere = tmp / "elsewhere"
    it.elsewhere.mkdir()
    return it


def test_setup_and_pyproject_agree_on_torch():
    """The range setup.py names when torch is missing is the one the metadata requires."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch_req,) = [r for r in project["dependencies"] if r.startswith("torch")]
    setup_py = (ROOT / "setup.py").read_text()
    assert f'TORCH_RANGE = "{torch_req[len("torch"):]}"' in setup_py
    makefile_pin = re.search(r"^TORCH_VERSION := (\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE).group(1)
    assert f'TESTED_TORCH = "{makefile_pin}"' in setup_py
    assert "torch" not in " ".join(tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"])


def _members_of_sdist(sdist: Path) -> set[str]:
    with tarfile.open(sdist) as tar:
        return {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}


def test_the_sdist_holds_every_source_and_no_build_product(install):
    members = _members_of_sdist(install.sdist)
    sources = {str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*") if p.suffix in (".h", ".cc")}
    assert "csrc/torch/cuda_sync.cc" in sources and any(s.endswith(".h") for s in sources)
    assert sources <= members, f"the sdist lacks {sorted(sources - members)}"
    profiles = {f"dcredit_opt/profiles/{n}.json" for n in ("vgg", "resnet18", "gpt")}
    assert profiles <= members
    assert {"LICENSE", "README.md", "pyproject.toml", "setup.py", "MANIFEST.in"} <= members
    built = [m for m in members if m.endswith((".so", ".pyc", "_build_info.py"))]
    assert not built, built


def test_the_wheel_is_stripped_and_carries_its_metadata(install):
    with zipfile.ZipFile(install.wheel) as whl:
        names = whl.namelist()
        (so,) = [n for n in names if n.startswith("dcredit_opt/_C") and n.endswith(".so")]
        size = whl.getinfo(so).file_size
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = whl.read(metadata).decode()
        build_info = whl.read("dcredit_opt/_build_info.py").decode()
    # With debug info the CPU extension is ~18 MB; stripped, ~0.4 MB.
    assert size < 4 * 2**20, f"{so} is {size / 2**20:.1f} MiB: built with debug info?"
    assert {f"dcredit_opt/profiles/{n}.json" for n in ("vgg", "resnet18", "gpt")} <= set(names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in meta
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist: torch")]
    assert requires and "<2.15" in requires[0] and ">=2.13" in requires[0], requires
    for extra in ("plot", "mpi", "horovod"):
        assert f"Provides-Extra: {extra}" in meta
    assert "Requires-Dist: matplotlib; extra == \"plot\"" in meta
    assert "drop-in distributed optimizer" in meta.split("\n\n", 1)[1], "the README is the long description"
    import torch

    assert f"TORCH_VERSION = {torch.__version__!r}" in build_info


def test_building_without_torch_says_what_to_run(install, tmp_path):
    """What an isolated build (no torch in it) gets: one clear message, not `No module named 'torch'`."""
    with tarfile.open(install.sdist) as tar:
        tar.extractall(tmp_path, filter="data")
    (src,) = tmp_path.iterdir()
    bare = tmp_path / "bare"
    _run([sys.executable, "-m", "venv", "--without-pip", bare], cwd=tmp_path)
    probe = _run([bare / "bin" / "python", "-c", "import torch"], cwd=tmp_path, check=False)
    assert probe.returncode != 0, "the bare venv sees a torch: cannot check the message"
    out = _run([bare / "bin" / "python", "setup.py", "--name"], cwd=src, check=False)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr
    assert "pip install torch==" in out.stderr and "pip install --no-build-isolation ." in out.stderr, out.stderr
    assert "isolated" in out.stderr


def test_installed_package_stands_alone(install):
    py = install.python
    code = ("import dcredit_opt; print(dcredit_opt.__file__); print(dcredit_opt.__version__); "
            "from dcredit_opt import _ext; print(_ext.load().__file__)")
    out = _run([py, "-c", code], cwd=install.elsewhere)
    module, version, ext = out.stdout.split()
    venv = str(install.python.parent.parent)
    assert module.startswith(venv) and ext.startswith(venv), out.stdout
    assert version == "0.1.0"
    for command in ([install.bin / "dcredit-opt", "--help"], [py, "-m", "dcredit_opt", "--help"],
                    [py, "-m", "dcredit_opt", "plan", "--help"], [py, "-m", "dcredit_opt", "profile", "--help"]):
        out = _run(command, cwd=install.elsewhere)
        assert "examples:" in out.stdout, out.stdout


def test_plan_and_simulate_on_a_shipped_profile(install):
    out = _run([install.python, "-m", "dcredit_opt", "plan", "--profile", "vgg", "--policy", "all"],
               cwd=install.elsewhere)
    for policy in ("wfbp", "ddp", "dcredit"):
        assert f"policy {policy}:" in out.stdout, out.stdout
    out = _run([install.bin / "dcredit-opt", "simulate", "--profile", "gpt", "--workers", "16,64",
                "--policy", "ddp,dcredit"], cwd=install.elsewhere)
    lines = out.stdout.strip().splitlines()
    assert lines[0].split()[:2] == ["workers", "bound"] and len(lines) == 3, out.stdout


def test_profile_a_model_from_a_file(install):
    folder = install.elsewhere / "mine"
    folder.mkdir()
    (folder / "mymodel.py").write_text(MODEL_FILE)
    out = _run([install.python, "-m", "dcredit_opt", "profile", "--model", "mine/mymodel.py:make",
                "--out", "mine.json", "--iters", "2", "--threads", "1"], cwd=install.elsewhere, timeout=180)
    assert "wrote mine.json: 4 tensors, 2,762 parameters" in out.stdout, out.stdout + out.stderr
    profile = json.loads((install.elsewhere / "mine.json").read_text())
    assert [t["name"] for t in profile["tensors"]] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    # The same model by module name, importable from the current folder.
    out = _run([install.bin / "dcredit-opt", "profile", "--model", "mymodel:make", "--out", "again.json",
                "--iters", "2", "--threads", "1"], cwd=folder, timeout=180)
    assert "wrote again.json" in out.stdout
    out = _run([install.python, "-m", "dcredit_opt", "plan", "--profile", "mine.json"], cwd=install.elsewhere)
    assert "policy dcredit:" in out.stdout
