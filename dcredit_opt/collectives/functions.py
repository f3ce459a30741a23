"""Horovod-style helpers: broadcast parameters and optimizer state from one rank.

Nothing received from a peer is unpickled: tensors travel as tensors, and the
optimizer state's structure travels as JSON text in a uint8 tensor.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

import torch

from ..errors import MismatchError
from ..optimizer.lazy import core_of
from ..world import control, job, runtime
from .objects import TENSOR_DTYPES


def _broadcast_(tensor: torch.Tensor, root_rank: int, name: str) -> None:
    """In-place broadcast that also works for tensors the control plane cannot send directly."""
    dev = control.control_device()
    if tensor.device == dev and tensor.is_contiguous():
        control.broadcast_(tensor, root_rank, name)
        return
    tmp = tensor.detach().to(dev).contiguous()
    control.broadcast_(tmp, root_rank, name)
    with torch.no_grad():
        tensor.copy_(tmp)


def _check_root(root_rank: int) -> None:
    if not isinstance(root_rank, int) or not 0 <= root_rank < runtime.size():
        raise ValueError(f"root_rank must be a rank in 0..{runtime.size() - 1}, got {root_rank!r}")


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable, root_rank: int = 0) -> None:
    """Overwrite ``params`` (a ``state_dict()`` or ``named_parameters()``) with ``root_rank``'s values."""
    job.init()
    _check_root(root_rank)
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ValueError("params must be a state_dict() or a sequence of (name, tensor) pairs")
    if runtime.size() == 1:
        return
    for key, tensor in sorted(items, key=lambda kv: kv[0]):
        if isinstance(tensor, torch.Tensor):
            with torch.no_grad():
                _broadcast_(tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor, root_rank,
                            f"param.{key}")


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyperparameters.

    Ranks whose optimizer has no state yet (a fresh start beside a restored
    checkpoint on the root) get the root's state structure first.
    """
    job.init()
    _check_root(root_rank)
    if runtime.size() == 1:
        return
    core = core_of(optimizer)  # a DistributedOptimizer's pending updates first
    if core is not None:
        core.apply_pending()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    description, failure = None, None
    if runtime.rank() == root_rank:
        try:
            description = _describe_state(optimizer, params)
        except TypeError as e:  # every rank must hear of it, or the others would wait for the state
            failure = e
            description = json.dumps({"error": f"{type(e).__name__}: {e}"})
    desc = json.loads(control.broadcast_text(description, root_rank))
    if failure is not None:
        raise failure
    if "error" in desc:
        raise TypeError(f"broadcast_optimizer_state: rank {root_rank} (the root) could not send its optimizer "
                        f"state: {desc['error']}")
    if desc["params"] != len(params) or len(desc["groups"]) != len(optimizer.param_groups):
        raise MismatchError(f"optimizer on rank {runtime.rank()} has {len(params)} parameters in "
                            f"{len(optimizer.param_groups)} groups; rank {root_rank} has {desc['params']} in "
                            f"{len(desc['groups'])}")
    for group, hyper in zip(optimizer.param_groups, desc["groups"]):
        group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in hyper.items()})
    tally = getattr(core, "tally", None)  # op=Adasum's has none
    if tally is not None:
        tally.hyperparameters_replaced()  # Note [Same hyperparameters] in optimizer/usage.py
    for i, (p, entries) in enumerate(zip(params, desc["state"])):
        st = optimizer.state[p]
        for key, spec in entries.items():
            if "value" in spec:
                st[key] = spec["value"]
                continue
            dtype = TENSOR_DTYPES.get(spec["dtype"])  # peer data never reaches getattr(torch, ...)
            if dtype is None:
                raise MismatchError(f"broadcast_optimizer_state: rank {root_rank} described state '{key}' of "
                                    f"parameter {i} with dtype {spec['dtype']!r}, which is not a tensor dtype")
            current = st.get(key)
            if not (isinstance(current, torch.Tensor) and list(current.shape) == spec["tensor"]
                    and current.dtype == dtype):
                device = p.device if spec["tensor"] else torch.device("cpu")
                st[key] = current = torch.zeros(spec["tensor"], dtype=dtype, device=device)
            _broadcast_(current, root_rank, f"state.{i}.{key}")


def _describe_state(optimizer: torch.optim.Optimizer, params: list) -> str:
    """The root's state and hyperparameters as JSON: shapes and dtypes of tensors, plain values as they are."""
    state = []
    for i, p in enumerate(params):
        entries = {}
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                dtype = str(value.dtype).replace("torch.", "")
                if dtype not in TENSOR_DTYPES:
                    raise TypeError(f"optimizer state entry '{key}' of parameter {i} is a {dtype} tensor, "
                                    "which cannot be broadcast")
                entries[key] = {"tensor": list(value.shape), "dtype": dtype}
            elif isinstance(value, (int, float, bool)) or value is None:
                entries[key] = {"value": value}
            else:
                raise TypeError(f"optimizer state entry '{key}' of parameter {i} has type "
                                f"{type(value).__name__}, which cannot be broadcast")
        state.append(entries)
    groups = [{k: v for k, v in g.items() if k != "params" and _jsonable(v)} for g in optimizer.param_groups]
    return json.dumps({"params": len(params), "state": state, "groups": groups})


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False
