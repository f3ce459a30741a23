"""F4 in one process: joining through Horovod or MPI, and each bad installation's one clear error.

Every case runs in a fresh interpreter: ``dc.init()`` and the libraries it
loads (Horovod, MPI) are process-wide, and the launcher variables are the
input under test.
"""

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import timing

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HOROVOD_RANK", "HOROVOD_SIZE",
                 "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "DCREDIT_BACKEND",
                 "HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_LOCALID",
                 "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_RESV_PORTS")

TRAIN = """
import torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                              config=dc.Config(block_bytes=16, window=2, policy="fixed"))
for step in range(3):
    opt.zero_grad()
    model(torch.ones(2, 4) * step).pow(2).mean().backward()
    opt.step()
opt.synchronize()
print("backend", opt._dc.backend.name, "size", dc.size(), "kind", dc.world.runtime.kind())
opt._dc.close()
dc.shutdown()
"""
TRAIN_ON_HOROVOD_OPS = TRAIN.replace('policy="fixed"', 'policy="fixed", backend="horovod"')
TORCH_BESIDE = TRAIN.replace('policy="fixed"', 'policy="fixed", backend="torch"')  # our channels beside Horovod


def run(code: str, env: dict | None = None, pythonpath: str | None = None, timeout: float = 150):
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    clean["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, str(ROOT), clean.get("PYTHONPATH")) if p)
    clean.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=clean, capture_output=True, text=True,
                          timeout=timing.scaled(timeout), cwd=ROOT, check=False)


@functools.cache
def importable(code: str) -> bool:
    """Whether ``code`` runs in a fresh interpreter; asked once per session (importing Horovod takes seconds)."""
    return run(code, timeout=120).returncode == 0


def launch_error(out) -> str:
    assert out.returncode != 0, out.stdout
    assert "LaunchError" in out.stderr, out.stderr
    return out.stderr.strip().splitlines()[-1]


# ---- bad installations --------------------------------------------------------


def test_horovod_not_installed_says_how_to_install():
    out = run("import sys; sys.modules['horovod'] = None\nimport dcredit_opt as dc\ndc.init(backend='horovod')")
    message = launch_error(out)
    assert "Horovod is not installed" in message and "make horovod" in message


def test_horovodrun_environment_without_horovod_says_how_to_install():
    out = run("import sys; sys.modules['horovod'] = None\nimport dcredit_opt as dc\ndc.init()",
              env={"HOROVOD_RANK": "0", "HOROVOD_SIZE": "1"})
    assert "Horovod is not installed" in launch_error(out)


def test_horovod_without_pytorch_support_says_how_to_rebuild(tmp_path):
    # What a HOROVOD_WITHOUT_PYTORCH build looks like from Python: the
    # package is there, its torch extension is not.
    fake = tmp_path / "horovod"
    (fake / "torch").mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '0.28.1'\n")
    (fake / "torch" / "__init__.py").write_text("from horovod.torch import mpi_lib_v2\n")
    out = run("import dcredit_opt as dc\ndc.init(backend='horovod')", pythonpath=str(tmp_path))
    message = launch_error(out)
    assert "Horovod 0.28.1 is installed without working PyTorch support" in message
    assert "mpi_lib_v2" in message and "HOROVOD_WITH_PYTORCH=1" in message


def test_mpi4py_not_installed_under_mpiexec_says_how_to_install():
    out = run("import sys; sys.modules['mpi4py'] = None\nimport dcredit_opt as dc\ndc.init()",
              env={"PMI_RANK": "0", "PMI_SIZE": "1"})
    message = launch_error(out)
    assert "mpi4py is not installed" in message and "pip install mpich mpi4py" in message


@pytest.mark.parametrize("backend", [None, "mpi"])
def test_mpi4py_without_an_mpi_library_says_what_to_install(backend):
    if not importable("import mpi4py"):
        pytest.skip("mpi4py is not installed")
    env = {"MPI4PY_LIBMPI": "/nonexistent/libmpi.so.12"}
    if backend is None:
        env.update({"PMI_RANK": "0", "PMI_SIZE": "1"})  # as mpiexec would set them
    out = run(f"import dcredit_opt as dc\ndc.init(backend={backend!r})", env=env)
    message = launch_error(out)
    assert "mpi4py is installed but cannot load an MPI library" in message
    assert "/nonexistent/libmpi.so.12" in message and "mpiexec -n N" in message


@pytest.mark.parametrize("code", [TRAIN, TORCH_BESIDE], ids=["auto", "torch"])
def test_a_horovod_job_on_cpus_trains_on_channels_beside_horovod(code):
    # Note [C++ channels under Horovod]: by default ("auto") and by name, torch.distributed is set up beside
    # Horovod, through its broadcast; Config(backend="horovod") keeps Horovod's operations (the next tests).
    if not importable("import horovod.torch"):
        pytest.skip("Horovod with PyTorch support is not installed (make horovod)")
    out = run("import dcredit_opt as dc\ndc.init(backend='horovod')\n" + code)
    assert out.returncode == 0, out.stderr
    assert "backend torch size 1 kind horovod" in out.stdout, out.stdout
    assert "process groups beside Horovod" in out.stderr


# ---- worlds of one through each launcher path -------------------------------------


def test_horovod_world_of_one_trains_with_fusion_off():
    if not importable("import horovod.torch"):
        pytest.skip("Horovod with PyTorch support is not installed (make horovod)")
    out = run("import os, dcredit_opt as dc\ndc.init(backend='horovod')\n"
              "print('fusion', os.environ.get('HOROVOD_FUSION_THRESHOLD'))\n"
              "print('cycle', os.environ.get('HOROVOD_CYCLE_TIME'))\n" + TRAIN_ON_HOROVOD_OPS)
    assert out.returncode == 0, out.stderr
    assert "fusion 0" in out.stdout and "backend horovod size 1 kind horovod" in out.stdout, out.stdout
    # Note [Horovod cycle time]: we never change Horovod's cycle (blocks on its operations would wait for it).
    assert "cycle None" in out.stdout, out.stdout
    assert "tensor fusion is on" not in out.stderr


def test_adopting_horovod_with_fusion_on_warns_once():
    if not importable("import horovod.torch"):
        pytest.skip("Horovod with PyTorch support is not installed (make horovod)")
    out = run("import horovod.torch as hvd\nhvd.init()\nimport dcredit_opt as dc\ndc.init()\n" + TRAIN_ON_HOROVOD_OPS)
    assert out.returncode == 0, out.stderr
    assert "backend horovod size 1 kind horovod" in out.stdout, out.stdout
    assert out.stderr.count("tensor fusion is on") == 1 and "--fusion-threshold-mb 0" in out.stderr
    # By default the blocks go on our own channels beside Horovod: fusion does not touch them.
    out = run("import horovod.torch as hvd\nhvd.init()\nimport dcredit_opt as dc\ndc.init()\n" + TRAIN)
    assert out.returncode == 0, out.stderr
    assert "backend torch size 1 kind horovod" in out.stdout, out.stdout
    assert "tensor fusion is on" not in out.stderr


def test_our_channels_beside_a_busy_horovod_cycle_warn_once():
    """Note [Horovod cycle time]: Horovod's 1 ms default cycle beside our channels is said once; 20 ms is quiet;
    we never change it (blocks on Horovod's operations would wait for its cycles)."""
    if not importable("import horovod.torch"):
        pytest.skip("Horovod with PyTorch support is not installed (make horovod)")
    user_init = "import horovod.torch as hvd\nhvd.init()\nimport dcredit_opt as dc\ndc.init()\n" + TRAIN
    out = run(user_init)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("--cycle-time-ms 20") == 1, out.stderr
    assert "timeline is on" not in out.stderr
    out = run(user_init, env={"HOROVOD_CYCLE_TIME": "20"})
    assert out.returncode == 0, out.stderr
    assert "--cycle-time-ms" not in out.stderr
    # That we never set HOROVOD_CYCLE_TIME when we start Horovod: test_horovod_world_of_one_trains_with_fusion_off.


def test_our_channels_beside_horovods_spinning_timeline_writer_warn_once(tmp_path):
    """Horovod's timeline writer spins on a core per rank (Note [C++ channels under Horovod]): said once, with
    the variable's value and what to do."""
    if not importable("import horovod.torch"):
        pytest.skip("Horovod with PyTorch support is not installed (make horovod)")
    trace = tmp_path / "horovod_timeline.json"
    out = run("import horovod.torch as hvd\nhvd.init()\nimport dcredit_opt as dc\ndc.init()\n" + TRAIN,
              env={"HOROVOD_TIMELINE": str(trace), "HOROVOD_CYCLE_TIME": "20"})
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("Horovod's timeline is on") == 1, out.stderr
    assert f"HOROVOD_TIMELINE={trace}" in out.stderr and "DCREDIT_TIMELINE_PATH" in out.stderr


def test_mpi_world_of_one_trains_with_gloo_of_its_own_for_control():
    """Note [Private groups]: the control plane is a Gloo group of ours; torch.distributed stays the script's."""
    if not importable("from mpi4py import MPI"):
        pytest.skip("mpi4py cannot load an MPI library (pip install mpich mpi4py)")
    out = run("import torch.distributed as dist, dcredit_opt as dc\nfrom dcredit_opt.world import control\n"
              "dc.init(backend='mpi')\nprint('gloo', dist.is_initialized(), control.control_backend())\n" + TRAIN)
    assert out.returncode == 0, out.stderr
    assert "gloo False gloo" in out.stdout and "backend mpi size 1 kind mpi" in out.stdout, out.stdout


# ---- SLURM: srun tasks -------------------------------------------------------------


@pytest.mark.parametrize("nodes, first", [
    ("node[01-04,07],gpu3", "node01"), ("gpu3", "gpu3"), ("node1,node2", "node1"), ("a[1-2]b[05-06]-ib", "a1b05-ib"),
    ("rack[2,4]n[1]", "rack2n1"), ("x[a-b]", None), ("n[1-3", None), ("n1]", None), ("", None),
])
def test_first_host_of_a_slurm_node_list(nodes, first):
    from dcredit_opt.world.launchers import first_host

    assert first_host(nodes) == first


SRUN_TASK = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
             "SLURM_STEP_NODELIST": "cn[07-08]", "SLURM_JOB_NODELIST": "cn[07-09]", "SLURM_JOB_ID": "4242",
             "SLURM_STEP_ID": "3"}


def test_srun_task_gets_torchrun_variables():
    from dcredit_opt.world.launchers import slurm_environment

    env = slurm_environment(SRUN_TASK)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")} == {
        "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "cn07"}
    # Every task of the step derives the same port; another step of the job gets another one.
    assert env["MASTER_PORT"] == slurm_environment({**SRUN_TASK, "SLURM_PROCID": "0"})["MASTER_PORT"]
    assert env["MASTER_PORT"] != slurm_environment({**SRUN_TASK, "SLURM_STEP_ID": "4"})["MASTER_PORT"]
    assert 20000 <= int(env["MASTER_PORT"]) < 30000
    given = slurm_environment({**SRUN_TASK, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29600"})
    assert (given["MASTER_ADDR"], given["MASTER_PORT"]) == ("10.0.0.5", "29600")


def test_srun_task_with_an_unreadable_node_list_says_to_export_master_addr():
    from dcredit_opt.errors import LaunchError
    from dcredit_opt.world.launchers import slurm_environment

    with pytest.raises(LaunchError, match="export MASTER_ADDR"):
        slurm_environment({**SRUN_TASK, "SLURM_STEP_NODELIST": "cn[a-b]"})
    with pytest.raises(LaunchError, match="SLURM_PROCID='x'"):
        slurm_environment({**SRUN_TASK, "SLURM_PROCID": "x"})


def test_batch_script_without_srun_is_a_world_of_one_and_says_so():
    out = run("import dcredit_opt as dc\ndc.init()\nprint('size', dc.size())", env={"SLURM_NTASKS": "4",
                                                                                      "SLURM_JOB_ID": "7"})
    assert out.returncode == 0, out.stderr
    assert "size 1" in out.stdout and "srun did not start this process" in out.stderr


def test_two_srun_tasks_train_together():
    # What srun exports to the two tasks of a step on one node; dc.init() joins them with no torchrun variable.
    port = str(29000 + os.getpid() % 900)
    env = {**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "localhost",
           "SLURM_JOB_NODELIST": "localhost", "MASTER_PORT": port}
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    clean["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), clean.get("PYTHONPATH")) if p)
    code = "import dcredit_opt as dc\n" + TRAIN
    procs = [subprocess.Popen([sys.executable, "-c", code], env={**clean, **env, "SLURM_PROCID": str(r),
                                                                  "SLURM_LOCALID": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for r in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timing.scaled(150)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, (stdout, stderr) in zip(procs, outs):
        assert p.returncode == 0, stderr
        assert "backend torch size 2 kind torch" in stdout, stdout


def test_srun_with_pmi2_joins_through_slurm_and_takes_a_reserved_port():
    from dcredit_opt.world.launchers import slurm_environment, srun_pmi

    pmi2 = {**SRUN_TASK, "PMI_RANK": "1", "PMI_SIZE": "4"}
    assert srun_pmi(pmi2)
    assert not srun_pmi({**SRUN_TASK, "PMI_RANK": "0", "PMI_SIZE": "4"}), "PMI that disagrees with SLURM is MPI's"
    assert not srun_pmi({"PMI_RANK": "0", "PMI_SIZE": "2"}), "mpiexec outside SLURM is MPI's"
    assert slurm_environment({**SRUN_TASK, "SLURM_STEP_RESV_PORTS": "12301-12310"})["MASTER_PORT"] == "12301"


def test_srun_pmi2_task_is_a_torch_job_not_an_mpi_one():
    out = run("import dcredit_opt as dc\nprint('launcher', dc.world.job._launcher('auto'))",
              env={**SRUN_TASK, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "PMI_RANK": "0", "PMI_SIZE": "1"})
    assert out.returncode == 0, out.stderr
    assert "launcher torch" in out.stdout, out.stdout
