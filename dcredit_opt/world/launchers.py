"""Joining a job that horovodrun or mpirun/mpiexec started.

``job.init()`` comes here when the job is Horovod's or MPI's; torchrun's
``env://`` path stays in ``job``. Both functions return the world as the
launcher sees it and whether we initialised it (so that ``shutdown()`` knows
what to undo).

Note [Horovod fusion]
---------------------
Horovod fuses tensors that become ready in the same negotiation cycle into
one all-reduce of up to ``HOROVOD_FUSION_THRESHOLD`` bytes. Applied to our
blocks, that would merge what the scheduler deliberately cut apart and
released one window at a time: results stay right, but a low-priority block
fused with a high-priority one delays it, and a window of k blocks becomes
one collective. Horovod reads the threshold once, in ``hvd.init()``, and
offers no call to change it later, so: when we initialise Horovod we set it
to 0 (unless the user set it); when the user already did, we cannot change
it, and we say so once (``horovodrun --fusion-threshold-mb 0`` fixes it).

Note [Horovod cycle time]
-------------------------
Horovod's background thread negotiates with every other rank once per
cycle (``HOROVOD_CYCLE_TIME``, 1 ms unless set), whether or not any tensor
is waiting: measured here (2 ranks, Gloo controller, nothing submitted),
23-24 % of a core per rank; with a 20 ms cycle, 2-3 %. When our own channels
carry the gradients beside Horovod (a CPU job, Note [C++ channels under
Horovod] in ``channels.py``), Horovod only serves the script's own calls
(metrics, broadcasts), and that polling competes with the training thread
for the cores. So when our channels are set up beside a Horovod whose cycle
is short, we say so once: ``horovodrun --cycle-time-ms 20`` (or
``HOROVOD_CYCLE_TIME=20``). Each of the script's own Horovod calls then
waits up to one cycle longer. We do not set it ourselves: ``hvd.init()``
reads it before we know whether blocks will go on Horovod's operations
(``Config(backend="horovod")``), where a long cycle would delay every block.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket

import numpy as np
import torch.distributed as dist

from ..errors import LaunchError

log = logging.getLogger("dcredit_opt")

HOROVOD_HELP = ("install Horovod 0.28.1 with PyTorch support into this environment: `make horovod` "
                "(it runs .ci/install_horovod.sh), or HOROVOD_WITH_PYTORCH=1 pip install --no-build-isolation "
                "horovod==0.28.1 against your torch")
MPI_HELP = ("install an MPI library and mpi4py (`pip install mpich mpi4py`, or Debian's `libopenmpi-dev "
            "openmpi-bin` then `pip install mpi4py`), and launch with `mpiexec -n N python train.py`")

# (rank, size) variables of the MPI launchers we know: MPICH's Hydra (also
# Intel MPI and the mpich wheel) and Open MPI.
_MPI_VARS = (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"))

# Room for rank 0's "host port" rendezvous line in the fixed-size MPI broadcast.
_RENDEZVOUS_BYTES = 512


def horovodrun_environment(environ=os.environ) -> bool:
    """Started by ``horovodrun --gloo`` (or its elastic driver), which exports the ranks.

    ``horovodrun --mpi`` exports nothing of its own: it looks like ``mpirun``,
    and is recognised as Horovod only once ``hvd.init()`` has run.
    """
    return "HOROVOD_RANK" in environ and "HOROVOD_SIZE" in environ


def mpi_environment(environ=os.environ) -> tuple[str, str] | None:
    """The (rank, size) variables of the MPI launcher that started us, or None."""
    for rank_var, size_var in _MPI_VARS:
        if rank_var in environ and size_var in environ:
            return rank_var, size_var
    return None


# srun exports these for each task of a job step; a batch script run without srun has the job's
# SLURM_NTASKS but no step of its own.
_SLURM_STEP_VARS = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS")
_SLURM_PORT_BASE, _SLURM_PORT_SPAN = 20000, 10000


def slurm_environment(environ=os.environ) -> dict | None:
    """torchrun's variables for a task that ``srun`` started, or None when srun did not start us.

    RANK, WORLD_SIZE and LOCAL_RANK come from SLURM_PROCID,
    SLURM_STEP_NUM_TASKS and SLURM_LOCALID; MASTER_ADDR from the user, else
    the first host of the step's node list; MASTER_PORT from the user, else
    a port every task of the step derives alike from the job and step ids.
    """
    if not all(v in environ for v in _SLURM_STEP_VARS):
        ntasks = environ.get("SLURM_NTASKS", "1")
        if ntasks.isdigit() and int(ntasks) > 1:
            log.warning("dcredit_opt: SLURM_NTASKS=%s, but srun did not start this process (no SLURM_PROCID and "
                        "SLURM_STEP_NUM_TASKS): running as a world of one. Launch each rank with `srun python "
                        "train.py` (or torchrun)", ntasks)
        return None
    rank, size = environ["SLURM_PROCID"], environ["SLURM_STEP_NUM_TASKS"]
    local = environ.get("SLURM_LOCALID", "0")
    for var, value in (("SLURM_PROCID", rank), ("SLURM_STEP_NUM_TASKS", size), ("SLURM_LOCALID", local)):
        if not value.isdigit():
            raise LaunchError(f"{var}={value!r} is not a non-negative integer: is this an srun task?")
    address = environ.get("MASTER_ADDR")
    if not address:
        nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or ""
        address = first_host(nodes)
        if address is None:
            raise LaunchError(f"cannot tell rank 0's host from SLURM's node list {nodes!r}: export MASTER_ADDR "
                              "(rank 0's host name or address) to every task, e.g. `export MASTER_ADDR=$(scontrol "
                              "show hostnames $SLURM_JOB_NODELIST | head -n 1)`")
    port = environ.get("MASTER_PORT")
    reserved = environ.get("SLURM_STEP_RESV_PORTS", "").split("-")[0].split(",")[0]
    if not port and reserved.isdigit():  # srun --resv-ports: a port SLURM reserved for this step
        port = reserved
    if not port:
        job, step = environ.get("SLURM_JOB_ID", "0"), environ.get("SLURM_STEP_ID", "0")
        if not (job.isdigit() and step.isdigit()):
            raise LaunchError(f"cannot derive a port from SLURM_JOB_ID={job!r} SLURM_STEP_ID={step!r}: export "
                              "MASTER_PORT (a free port on rank 0's host) to every task")
        port = str(_SLURM_PORT_BASE + (int(job) * 131 + int(step)) % _SLURM_PORT_SPAN)
    return {"RANK": rank, "WORLD_SIZE": size, "LOCAL_RANK": local, "MASTER_ADDR": address, "MASTER_PORT": port}


def srun_pmi(environ=os.environ) -> bool:
    """The MPI variables are srun's own PMI (``srun --mpi=pmi2``): PMI_RANK and PMI_SIZE equal to the step's
    SLURM_PROCID and SLURM_STEP_NUM_TASKS. Such a task joins through SLURM's variables, needing no mpi4py."""
    return (all(v in environ for v in _SLURM_STEP_VARS)
            and environ.get("PMI_RANK") == environ["SLURM_PROCID"]
            and environ.get("PMI_SIZE") == environ["SLURM_STEP_NUM_TASKS"])


def first_host(nodelist: str) -> str | None:
    """The first host of a SLURM node list (``node[01-04,07],gpu3`` -> ``node01``), or None if unreadable."""
    depth, end = 0, len(nodelist)
    for k, ch in enumerate(nodelist):  # the first entry ends at the first comma outside brackets
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            end = k
            break
    entry, out = nodelist[:end].strip(), []
    while entry:
        open_, close = entry.find("["), entry.find("]")
        if open_ < 0:
            if "]" in entry:
                return None
            out.append(entry)
            break
        if close < open_:
            return None
        first = entry[open_ + 1:close].split(",")[0].split("-")[0]
        if not first.isdigit():
            return None
        out += [entry[:open_], first]
        entry = entry[close + 1:]
    host = "".join(out)
    return host or None


def import_horovod():
    """``horovod.torch``, or a LaunchError that says how to get it."""
    try:
        import horovod
    except ImportError:
        raise LaunchError(f"Horovod is not installed: {HOROVOD_HELP}") from None
    try:
        import horovod.torch as hvd
    except ImportError as e:  # built with HOROVOD_WITHOUT_PYTORCH, or against another torch
        version = getattr(horovod, "__version__", "?")
        raise LaunchError(f"Horovod {version} is installed without working PyTorch support (importing "
                          f"horovod.torch failed: {e}); {HOROVOD_HELP}") from None
    return hvd


def import_mpi():
    """``mpi4py.MPI``, or a LaunchError that says how to get an MPI library."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        raise LaunchError(f"mpi4py is not installed: {MPI_HELP}") from None
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as e:  # mpi4py loads libmpi at import; both types occur
        raise LaunchError(f"mpi4py is installed but cannot load an MPI library ({' '.join(str(e).split())}); "
                          f"{MPI_HELP}") from None
    return MPI


def join_horovod():
    """Initialise Horovod if nobody has; returns (hvd, we_initialised_it). See Note [Horovod fusion]."""
    hvd = import_horovod()
    owns = False
    if not hvd.is_initialized():
        os.environ.setdefault("HOROVOD_FUSION_THRESHOLD", "0")
        hvd.init()
        owns = True
    if dist.is_initialized() and (dist.get_world_size() != hvd.size() or dist.get_rank() != hvd.rank()):
        raise LaunchError(
            f"torch.distributed and Horovod disagree about this process: torch.distributed says rank "
            f"{dist.get_rank()} of {dist.get_world_size()}, Horovod says rank {hvd.rank()} of {hvd.size()}. "
            "They were started by different launchers; launch once (e.g. `horovodrun -np N python train.py`) "
            "and initialise only Horovod, or give both the same ranks")
    return hvd, owns


_told: set = set()  # the launch notices below already given in this process
QUIET_CYCLE_MS = 20  # Note [Horovod cycle time]


def _say_once(key: str, hvd, message: str, *args) -> None:
    """Rank 0 logs ``message`` (a warning) the first time ``key`` comes up in this process."""
    if hvd.rank() == 0 and key not in _told:
        _told.add(key)
        log.warning(message, *args)


def warn_if_cycle_short(hvd) -> None:
    """Our channels carry the blocks beside Horovod: say once if Horovod polls every few milliseconds."""
    raw = os.environ.get("HOROVOD_CYCLE_TIME")
    try:
        cycle_ms = float(raw) if raw is not None else 1.0
    except ValueError:
        return
    if cycle_ms < QUIET_CYCLE_MS / 2:
        _say_once("cycle", hvd,
                  "dcredit_opt: Horovod's background thread negotiates every %g ms even when idle (about a "
                  "quarter of a core per rank, measured on 2 ranks), while dcredit_opt's own channels carry "
                  "the gradients; launch with `horovodrun --cycle-time-ms %d` (or HOROVOD_CYCLE_TIME=%d) to "
                  "give those cores back (Note [Horovod cycle time])", cycle_ms, QUIET_CYCLE_MS, QUIET_CYCLE_MS)


def warn_if_timeline_spins(hvd) -> None:
    """Our channels carry the blocks beside Horovod: say once if Horovod's timeline is on. Its writer thread
    (Horovod 0.28.1) yields in a loop without sleeping, most of a core per rank, and on a machine with few cores
    that keeps Horovod's background loop, and our channels, waiting for a core (Note [C++ channels under
    Horovod] in channels.py has the measurements)."""
    timeline = os.environ.get("HOROVOD_TIMELINE")
    if timeline:
        _say_once("timeline", hvd,
                  "dcredit_opt: Horovod's timeline is on (HOROVOD_TIMELINE=%s): its writer thread spins on a "
                  "core per rank for as long as Horovod runs (measured: most of a core), which slows training "
                  "and, with few cores, can starve Horovod's own background loop past its Gloo timeout. Unset "
                  "it unless you need Horovod's timeline; DCREDIT_TIMELINE_PATH records dcredit_opt's blocks "
                  "without a spinning thread", timeline)


def warn_if_fusion_on(hvd) -> None:
    """Blocks on Horovod's operations: say once per job if Horovod may fuse them (Note [Horovod fusion])."""
    fusion = os.environ.get("HOROVOD_FUSION_THRESHOLD")
    if fusion is None or fusion.strip() != "0":
        _say_once("fusion", hvd,
                  "dcredit_opt: Horovod's tensor fusion is on (HOROVOD_FUSION_THRESHOLD=%s), so Horovod may "
                  "merge blocks that the scheduler releases together; results are unchanged, but priorities "
                  "and windows are kept only approximately. Launch with `horovodrun --fusion-threshold-mb 0` "
                  "(or HOROVOD_FUSION_THRESHOLD=0) to keep them exact.",
                  fusion if fusion is not None else "unset: 128 MiB")


def join_mpi(timeout_s: float):
    """Join the MPI job; returns (MPI, rank, size, local_rank, store).

    Gloo groups of our own carry the control operations (model check,
    broadcasts, plan) and the "torch" backend, made on ``store`` (Note
    [Private groups] in ``groups.py``); mpi4py carries blocks with the "mpi"
    backend. ``store`` is None when the script initialised torch.distributed
    itself first: its default group serves then, as under torchrun. The
    rendezvous: ``rendezvous_store``, over one MPI broadcast.
    """
    MPI = import_mpi()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    _check_mpi_matches_launcher(MPI, size)
    local_rank = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank).Get_rank()
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, size):
            raise LaunchError(
                f"torch.distributed says rank {dist.get_rank()} of {dist.get_world_size()} but MPI says rank "
                f"{rank} of {size}: they were started by different launchers; launch once")
        return MPI, rank, size, local_rank, None
    store = rendezvous_store(rank, size, timeout_s, lambda message: comm.Bcast(message, root=0), "the MPI job",
                             "and GLOO_SOCKET_IFNAME to every rank")
    return MPI, rank, size, local_rank, store


def rendezvous_store(rank: int, size: int, timeout_s: float, broadcast, over: str, hint: str):
    """A TCPStore shared by every rank of a job whose ranks can already broadcast (MPI, Horovod), for Gloo
    groups of our own (Note [Private groups] in ``groups.py``); torch.distributed's default group is left alone.

    Rank 0 opens a TCPStore on a port the OS picks and tells the others where
    with one ``broadcast(message)`` of fixed-size bytes (a numpy uint8 array,
    in place; never a pickle); an error on rank 0 travels the same way, so no
    rank is left waiting. Ranks on rank 0's machine use loopback (it works
    even where the host name resolves to nothing routable) unless
    ``MASTER_ADDR`` says where rank 0 is.
    """
    before_default_group()
    timeout = datetime.timedelta(seconds=timeout_s)
    message = np.zeros(_RENDEZVOUS_BYTES, dtype=np.uint8)
    store = None
    if rank == 0:
        try:
            store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
            text = f"ok {socket.gethostname()} {_address_for_others()} {store.port}"
        except Exception as e:  # noqa: BLE001 - tell the others instead of leaving them in the broadcast
            text = f"error {type(e).__name__}: {e}"
        raw = text.encode()[:_RENDEZVOUS_BYTES]
        message[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    broadcast(message)
    words = bytes(message).rstrip(b"\0").decode(errors="replace").split(" ", 3)
    if words[0] != "ok":
        raise LaunchError(f"rank 0 could not open the rendezvous for torch.distributed over {over}: "
                          f"{' '.join(words[1:])}")
    host, address, port = words[1], words[2], int(words[3])
    try:
        if store is None:
            same_host = host == socket.gethostname() and not os.environ.get("MASTER_ADDR")
            store = dist.TCPStore("127.0.0.1" if same_host else address, port, size, is_master=False,
                                  timeout=timeout)
        return store
    except Exception as e:
        raise LaunchError(f"could not reach rank 0's rendezvous store over {over} at {address}:{port} within "
                          f"{timeout_s:g} s ({type(e).__name__}: {e}); on several machines, export MASTER_ADDR "
                          f"(rank 0's reachable address) {hint}") from e


def _address_for_others() -> str:
    """Where other machines reach rank 0: MASTER_ADDR when the user gave one, else our host name's address."""
    given = os.environ.get("MASTER_ADDR")
    if given:
        return given
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.gethostname()


def _check_mpi_matches_launcher(MPI, size: int) -> None:
    """mpi4py's library must be the one whose launcher started us, or every rank is a world of one."""
    found = mpi_environment()
    if found is None:
        return
    expected = os.environ[found[1]]
    if expected.isdigit() and int(expected) != size:
        vendor = MPI.get_vendor()
        raise LaunchError(f"the launcher started {expected} ranks ({found[1]}), but mpi4py's MPI library "
                          f"({vendor[0]} {'.'.join(map(str, vendor[1]))}) sees a world of {size}: mpi4py uses a "
                          "different MPI than the mpiexec/mpirun that launched this job. Launch with the "
                          "mpiexec that belongs to mpi4py's MPI (with the mpich wheel: the mpiexec next to "
                          "this Python), or point mpi4py at the launcher's library (MPI4PY_LIBMPI)")


def before_default_group() -> None:
    """Import, while no default group exists, the torch modules that would pin it (Note [Orderly exit] in
    job.py): every path that makes the default group calls this first."""
    try:
        import torch.distributed.nn.functional  # noqa: F401
    except ImportError:  # a torch without it: nothing to pin the group either
        pass
