"""Where one optimizer's gradients may live, checked before any communication.

One ``DistributedOptimizer`` reduces the parameters of one device: its
gradients live in flat buffers (one per dtype) that the scheduler cuts into
blocks, and a collective, its stream and its communicator belong to one
device. What can carry them depends on the process group: NCCL carries CUDA
tensors only, Gloo both. Each check here raises ``ValueError`` naming a
parameter and saying what to change, before a single collective is issued;
a mistake found later would surface as a hang or as a message from deep
inside c10d.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _ext, backends
from ..world import control

DEVICE_TYPES = ("cpu", "cuda")


def device_of(names, params) -> torch.device:
    """The one device of ``params`` (the CPU when there are none)."""
    first: dict = {}
    for n, p in zip(names, params):
        first.setdefault(p.device, n)
    for device, name in first.items():
        if device.type not in DEVICE_TYPES:
            raise ValueError(f"parameter '{name}' is on {device}; dcredit_opt reduces parameters on the CPU or "
                             "on CUDA devices")
    if len(first) <= 1:
        return next(iter(first), torch.device("cpu"))
    described = ", ".join(f"'{n}' on {d}" for d, n in first.items())
    types = {d.type for d in first}
    if types == {"cpu", "cuda"}:
        advice = ("move the whole model to this rank's GPU before creating the optimizer "
                  "(model.to(f'cuda:{local_rank}')), or keep it all on the CPU")
    else:
        advice = ("run one process per GPU (torchrun --nproc_per_node=<GPUs per node>), each with its model on "
                  "its own device, or give each device's parameters to an optimizer of their own")
    raise ValueError(f"parameters are on different devices ({described}): one DistributedOptimizer reduces the "
                     f"parameters of one device; {advice}")


def device_types(backend: str) -> set | None:
    """Device types a process group's backend carries; None for a backend we do not know."""
    backend = str(backend).lower()
    if ":" in backend:  # "cpu:gloo,cuda:nccl": one backend per device type
        return {pair.split(":", 1)[0].strip() for pair in backend.split(",") if ":" in pair}
    capability = getattr(dist.Backend, "backend_capability", {})
    return set(capability[backend]) if backend in capability else None


def check_group(names, params, backend: str, control: torch.device | None = None) -> None:
    """The default process group (``backend``) must carry the parameters' device.

    ``control`` is where the control plane puts its tensors
    (``control.control_device()``): under NCCL, this rank's current CUDA
    device, which must then be the parameters' device, or the model check
    and the broadcasts would open communicators on another GPU.
    """
    if not params:
        return
    device = device_of(names, params)
    name = names[0]
    carried = device_types(backend)
    if carried is not None and device.type not in carried:
        if device.type == "cpu":
            raise ValueError(
                f"the default process group uses {backend}, which carries {', '.join(sorted(carried))} tensors "
                f"only, but the parameters are on the CPU ('{name}'). Move the model to this rank's GPU, or "
                "create the group yourself before dc.init() with torch.distributed.init_process_group('gloo') "
                "(or 'cpu:gloo,cuda:nccl' for both); dc.init() picks NCCL whenever CUDA is available")
        raise ValueError(f"the default process group uses {backend}, which does not carry {device.type} tensors, "
                         f"but the parameters are on {device} ('{name}')")
    if control is not None and control.type == "cuda" and device.type == "cuda" and control != device:
        raise ValueError(
            f"the parameters are on {device} ('{name}') but this rank's current CUDA device is {control}, which "
            f"the {backend} group uses for its own tensors: call torch.cuda.set_device({device.index}) (under "
            "torchrun, torch.cuda.set_device(local_rank)) before creating the model and the optimizer")


def check_extension(names, params, with_cuda: bool) -> None:
    """The C++ extension must have been built with CUDA to order blocks on a GPU."""
    device = device_of(names, params)
    if device.type == "cuda" and not with_cuda:
        raise ValueError(
            f"the parameters are on {device} ('{names[0]}') but dcredit_opt._C was built without CUDA (torch "
            f"{torch.__version__}{'' if torch.version.cuda else ', a CPU build'}): install a CUDA build of "
            "torch and the CUDA toolkit, then rebuild with `pip install --no-build-isolation -e .`")


def check_world(names, params, backend: str) -> None:
    """Every check that needs the joined world (after ``job.init()``) for ``Config.backend``."""
    backend_name = control.control_backend()
    if backend_name is not None:
        # The control plane (the model check, broadcasts, the plan) runs on the
        # default group (or ours, Gloo), and the torch backend's channels inherit its backend.
        on_cuda = device_of(names, params).type == "cuda"
        check_group(names, params, backend_name, control.control_device() if on_cuda else None)
    if (backends.detect() if backend == "auto" else backend) == "torch":
        # Only the torch engine orders blocks on CUDA streams itself.
        check_extension(names, params, bool(getattr(_ext.load(), "WITH_CUDA", False)))
