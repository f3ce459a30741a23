"""F5.6: security hygiene.

- No listening socket of our own. Every process group is a Gloo device
  with a listening socket, so "no new socket" cannot be the test; instead a
  fresh process records which listening sockets appear *inside*
  torch.distributed's own calls (``init_process_group``, ``new_group``),
  builds and trains an optimizer (profiling, planning, broadcasts,
  timeline), and asserts that every listening socket it owns at the end
  was opened by one of those calls; and the C++ extension imports no
  socket functions at all.
- Nothing received from a peer is unpickled: no pickle, ``torch.load``,
  torch.distributed's or Horovod's ``*_object`` collectives or pickle-based
  mpi4py calls anywhere in the package, and no unpickling symbol in the
  extension. dcredit_opt's own ``broadcast_object``/``allgather_object``
  (Horovod's names) send JSON (``objects.py``); calling them bare is fine,
  calling a module's (``hvd.broadcast_object``) is not.
- ``DCREDIT_*`` variables are read in one place (``config.py``), when a
  configuration is made, never during training; an unknown one is reported
  once per process, naming the known ones; a bad value names its variable.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dcredit_opt.config import Config
from tests import timing

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dcredit_opt"
SOURCES = sorted(PACKAGE.rglob("*.py"))
CSRC = sorted((ROOT / "csrc").rglob("*.[ch]*"))


def _run(code: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("DCREDIT_") and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    clean.update(env or {})
    clean["PYTHONPATH"] = str(ROOT) + os.pathsep + clean.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], check=False, env=clean, capture_output=True, text=True,
                          timeout=timing.scaled(timeout), cwd=ROOT)


# ---- sockets --------------------------------------------------------------------

SOCKET_PROBE = r'''
import json, os, tempfile
import torch, torch.distributed as dist

def listening():
    """Listening TCP sockets this process owns: (table, local address) from /proc/net/tcp{,6}."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    found.add(f"{table[10:]} {cols[1]}")
    return found

by_torch, calls = set(), []
def attributed(name, fn):
    def wrapper(*args, **kwargs):
        before = listening()
        try:
            return fn(*args, **kwargs)
        finally:
            by_torch.update(listening() - before)
            calls.append(name)
    return wrapper
for name in ("init_process_group", "new_group"):
    setattr(dist, name, attributed(name, getattr(dist, name)))
dist.distributed_c10d.new_group = dist.new_group

start = listening()
import dcredit_opt as dc
dc.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
timeline = os.path.join(tempfile.mkdtemp(), "trace.json")
config = dc.Config(block_bytes=64, channels=3, profile_iters=2, policy="dcredit", timeline_path=timeline)
opt = dc.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                              named_parameters=model.named_parameters(), config=config)
dc.broadcast_parameters(model.state_dict(), root_rank=0)
dc.broadcast_optimizer_state(opt, root_rank=0)
for step in range(5):  # profiles 2 iterations, plans, switches
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
opt.synchronize()
opt.state_dict()
end = listening()
print(json.dumps({"start": sorted(start), "end": sorted(end), "by_torch": sorted(by_torch), "calls": calls,
                  "policy": opt.plan.policy}))
'''


@pytest.mark.timeout(120)
def test_no_listening_socket_of_its_own():
    out = _run(SOCKET_PROBE)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["policy"] == "dcredit", "the probe should have profiled and planned"
    own = set(r["end"]) - set(r["start"]) - set(r["by_torch"])
    assert not own, f"listening sockets opened outside torch.distributed's own calls: {own}"
    # What torch.distributed opened on our behalf: the default group, one group per channel and the
    # side group of the tally (Note [Global usage]), a Gloo device each; nothing more.
    assert r["calls"] == ["init_process_group", "new_group", "new_group", "new_group", "new_group"], r["calls"]
    assert len(r["by_torch"]) == 5, r


def _undefined_symbols(library: Path) -> list[str]:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed: cannot list the extension's imported symbols")
    out = subprocess.run([nm, "-D", "--undefined-only", str(library)], capture_output=True, text=True, check=True)
    return [line.split()[-1] for line in out.stdout.splitlines() if line.strip()]


def _extension() -> Path:
    found = sorted(PACKAGE.glob("_C*.so"))
    if not found:
        pytest.skip("the C++ extension is not built (make install)")
    return found[0]


@pytest.mark.timeout(60)
def test_extension_imports_no_socket_or_unpickling_functions():
    symbols = _undefined_symbols(_extension())
    assert symbols, "nm listed no symbols at all"
    socket_calls = sorted({s.split("@")[0] for s in symbols} & {"socket", "bind", "listen", "accept", "accept4",
                                                                 "connect", "getaddrinfo"})
    assert not socket_calls, f"the extension calls {socket_calls} itself (networking belongs to the engines)"
    unpickling = [s for s in symbols if re.search(r"unpickl|pickle_load|Unpickler", s)]
    assert not unpickling, unpickling


# ---- pickle -----------------------------------------------------------------------

# How Python code could turn bytes from a peer into objects.
UNPICKLING = [
    r"\bimport pickle\b|\bfrom pickle\b|\bpickle\.", r"\bcPickle\b|\bdill\b|\bcloudpickle\b|\bjsonpickle\b",
    r"\bmarshal\.loads?\b|\bshelve\b", r"\btorch\.load\b|\bserialization\.load\b", r"\bnp\.load\b|\bnumpy\.load\b",
    # torch.distributed's pickle-based helpers
    r"\b(all_gather|gather)_object\b", r"\b(broadcast|scatter)_object_list\b", r"\b(send|recv)_object_list\b",
    # Horovod's, called through its module (hvd.broadcast_object); ours, of the same names, send JSON
    r"\.(broadcast_object|allgather_object)\b", r"\bfrom horovod\S* import .*\b(broadcast|allgather)_object\b",
    # mpi4py's lower-case methods pickle; the upper-case ones move buffers.
    (r"\b_?comm\w*(\[[^\]]*\])?\.(bcast|gather|allgather|scatter|recv|irecv|sendrecv|alltoall|reduce|allreduce|"
     r"send|isend|ibcast|mrecv)\("),
    r"\bMPI\.COMM_WORLD\.(bcast|gather|allgather|scatter|recv|sendrecv|alltoall|reduce|allreduce)\(",
]


@pytest.mark.timeout(60)
def test_package_never_unpickles():
    assert len(SOURCES) > 10
    found = []
    for path in SOURCES:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if code.strip().startswith(('"', "'")) or not code.strip():
                continue
            for pattern in UNPICKLING:
                if re.search(pattern, code):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "possible unpickling of peer data:\n" + "\n".join(found)
    for path in CSRC:
        text = path.read_text()
        assert not re.search(r"pickle|torch::load|jit::load", text), f"{path.relative_to(ROOT)} (de)serialises"


@pytest.mark.timeout(60)
def test_the_pickle_patterns_would_catch_what_they_are_for():
    bad = ["import pickle", "obj = pickle.loads(data)", "torch.load(buf)", "dist.all_gather_object(out, x)",
           "dist.broadcast_object_list(objs, src=0)", "hvd.broadcast_object(state)", "x = comm.bcast(x, root=0)",
           "dist.gather_object(x, out)", "dist.scatter_object_list(out, objs)", "rows = world.hvd.allgather_object(x)",
           "import horovod.torch.functions; horovod.torch.functions.broadcast_object(x)",
           "from horovod.torch import allgather_object, broadcast_parameters",
           "self._comms[0].allgather(x)", "MPI.COMM_WORLD.bcast(x)", "np.load(f, allow_pickle=True)"]
    good = ["comm.Bcast(message, root=0)", "self._comms[c].Iallreduce(IN_PLACE, a, op=SUM)",
            "rows = world.hvd.allgather(tensor, name=n)", "dist.broadcast(tensor, src=0)", "json.loads(text)",
            "def broadcast_object(obj, root_rank=0, name=None):", "rows = allgather_object(pair, name=n)",
            "from .collectives import allgather_object, broadcast_object"]
    for line in bad:
        assert any(re.search(p, line) for p in UNPICKLING), line
    for line in good:
        assert not any(re.search(p, line) for p in UNPICKLING), line


# ---- environment ---------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_dcredit_variables_are_read_in_config_only():
    # A string literal that starts with DCREDIT_ (prose in docstrings may mention the variables).
    readers = [str(p.relative_to(ROOT)) for p in SOURCES if re.search(r"(\bf)?[\"']DCREDIT_", p.read_text())]
    assert readers == ["dcredit_opt/config.py"], readers


ENV_PROBE = r'''
import collections.abc, json, os
import torch
import dcredit_opt as dc

dc.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
other = torch.nn.Linear(4, 2)  # a second optimizer over parameters of its own (over the same ones it would take over)
opt2 = dc.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), named_parameters=other.named_parameters())
opt2._dc.close()

class Counting(collections.abc.MutableMapping):
    """os.environ, counting every read of a DCREDIT_* variable and every full scan."""
    def __init__(self, real):
        self.real, self.reads = real, []
    def __getitem__(self, key):
        if str(key).startswith("DCREDIT_"):
            self.reads.append(key)
        return self.real[key]
    def __iter__(self):
        self.reads.append("<scan>")
        return iter(self.real)
    def __len__(self):
        return len(self.real)
    def __setitem__(self, key, value):
        self.real[key] = value
    def __delitem__(self, key):
        del self.real[key]

counting = Counting(os.environ)
os.environ = counting
os.environ["DCREDIT_WINDOW"] = "7"  # too late: the optimizer read its configuration when it was built
for step in range(4):
    opt.zero_grad()
    model(torch.randn(5, 4)).pow(2).mean().backward()
    opt.step()
opt.synchronize()
opt.state_dict()
model.state_dict()
print(json.dumps({"window": opt._dc.config.window, "profile_iters": opt._dc.config.profile_iters,
                  "reads": counting.reads}))
'''


@pytest.mark.timeout(120)
def test_environment_read_when_configured_never_during_training_and_unknowns_reported_once():
    out = _run(ENV_PROBE, env={"DCREDIT_WINDOW": "3", "DCREDIT_PROFILE_ITERS": "0", "DCREDIT_BOGUS_KNOB": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert (r["window"], r["profile_iters"]) == (3, 0), "the DCREDIT_* values were not applied"
    assert r["reads"] == [], f"the environment was read during training: {r['reads']}"
    warnings = [line for line in out.stderr.splitlines() if "DCREDIT_BOGUS_KNOB" in line]
    # dc.init() and two DistributedOptimizer(config=None) each read the environment: one warning.
    assert len(warnings) == 1, out.stderr[-3000:]
    for known in (f"DCREDIT_{f.upper()}" for f in Config.__dataclass_fields__):
        assert known in warnings[0], f"the warning does not name {known}: {warnings[0]}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("var, raw", [("DCREDIT_WINDOW", "0"), ("DCREDIT_CHANNELS", "100"),
                                      ("DCREDIT_POLICY", "fastest"), ("DCREDIT_BACKEND", "pigeon"),
                                      ("DCREDIT_BLOCK_BYTES", "-4")])
def test_an_invalid_value_names_its_variable(var, raw):
    with pytest.raises(ValueError, match=re.escape(f"{var}={raw!r}")):
        Config.from_env(environ={var: raw})
