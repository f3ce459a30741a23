"""Profiling a user's own model: ``python -m dcredit_opt profile --model pkg.module:factory``.

The factory is any callable taking no arguments that returns ``(model,
batch, loss_fn)``; one training iteration is then::

    inputs, target = batch
    loss_fn(model(inputs), target).backward()

with ``model(*inputs)`` when ``inputs`` is a tuple or list and
``model(**inputs)`` when it is a dict. The model is trained for a few
iterations under a :class:`~dcredit_opt.DistributedOptimizer` whose own
profiler measures it (see ``profiling/profiler.py``), so the profile is exactly what
the optimizer would measure in the user's job, on whatever device the factory
put the model.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..config import Config
from ..optimizer import DistributedOptimizer
from ..planner.cost import ring_allreduce
from ..planner.profile import Profile
from ..world import job


class FactoryError(ValueError):
    """The ``--model`` spec names nothing importable, or the factory breaks the contract."""


CONTRACT = ("a factory takes no arguments and returns (model, batch, loss_fn) with batch = (inputs, target); "
            "one iteration is loss_fn(model(inputs), target).backward()")


def load_factory(spec: str) -> Callable[[], Any]:
    """The callable that ``spec`` names: ``pkg.module:factory`` or ``path/to/file.py:factory``.

    A module name is looked up from the current directory first (as
    ``python -m`` does, so the ``dcredit-opt`` script behaves the same); a
    file is loaded by path, with its own directory importable for its
    neighbours.
    """
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise FactoryError(f"--model wants pkg.module:factory or path/to/file.py:factory, got {spec!r}")
    if where.endswith(".py") or os.sep in where or (os.altsep and os.altsep in where):
        module = _load_file(Path(where))
    else:
        module = _load_module(where)
    factory = getattr(module, name, None)
    if factory is None:
        raise FactoryError(f"{where} has no attribute {name!r}")
    if not callable(factory):
        raise FactoryError(f"{where}:{name} is not callable ({type(factory).__name__})")
    return factory


def _load_file(path: Path):
    if not path.is_file():
        raise FactoryError(f"no such file: {path}")
    module_name = f"_dcredit_user_model_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise FactoryError(f"cannot import {path} (not a Python file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as e:
        raise FactoryError(f"{path} imports {e.name!r}, which is not installed") from None
    return module


def _load_module(name: str):
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            raise FactoryError(f"no module named {e.name!r} (run from the folder that holds it, or add that "
                               "folder to PYTHONPATH)") from None
        raise FactoryError(f"{name} imports {e.name!r}, which is not installed") from None


def call_factory(factory: Callable[[], Any], spec: str = "the factory"):
    """``(model, (inputs, target), loss_fn)`` from ``factory()``, checked against the contract."""
    made = factory()
    if not isinstance(made, (tuple, list)) or len(made) != 3:
        raise FactoryError(f"{spec} returned {type(made).__name__}, not (model, batch, loss_fn): {CONTRACT}")
    model, batch, loss_fn = made
    if not isinstance(model, torch.nn.Module):
        raise FactoryError(f"{spec}: the model is a {type(model).__name__}, not a torch.nn.Module")
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise FactoryError(f"{spec}: the batch must be a pair (inputs, target): {CONTRACT}")
    if not callable(loss_fn):
        raise FactoryError(f"{spec}: loss_fn is not callable: {CONTRACT}")
    if not any(p.requires_grad for p in model.parameters()):
        raise FactoryError(f"{spec}: the model has no trainable parameters")
    return model, tuple(batch), loss_fn


def forward(model, inputs):
    """``model(inputs)``, spreading a tuple/list as positional and a dict as keyword arguments."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def profile_model(model, batch, loss_fn, *, iters: int = 5) -> Profile | None:
    """What a :class:`~dcredit_opt.DistributedOptimizer` measures on ``model`` over ``iters`` iterations.

    Joins the job (``dcredit_opt.init()``: a world of one outside a
    launcher) and returns rank 0's profile (None on other ranks). The model's
    parameters are updated with a tiny SGD step: the optimizer's choice does
    not change the compute times measured.
    """
    job.init()
    inputs, target = batch
    params = [p for p in model.parameters() if p.requires_grad]
    opt = DistributedOptimizer(torch.optim.SGD(params, lr=1e-3), named_parameters=[
        (n, p) for n, p in model.named_parameters() if p.requires_grad], config=Config(policy="dcredit",
                                                                                        profile_iters=iters))
    # Profiling ends at exactly `iters` steps; one more step switches to the plan.
    for _ in range(iters + 1):
        opt.zero_grad()
        loss_fn(forward(model, inputs), target).backward()
        opt.step()
    opt.synchronize()
    return opt.profile


def assume_link(profile: Profile, gbit: float, alpha_us: float) -> Profile:
    """A profile measured on one rank, given the network of a ring of two over a ``gbit`` Gbit/s link.

    One rank measures no network, and the planner needs alpha/beta to weigh
    blocks against their start-up cost; ``simulate`` scales a ring of two to
    larger worlds.
    """
    link_beta_s_per_byte = 8.0 / (gbit * 1e9)
    alpha = ring_allreduce(alpha_us * 1e-6, 0.0, 0, 2)
    beta = ring_allreduce(0.0, link_beta_s_per_byte, 1, 2)
    return dataclasses.replace(profile, alpha_s=alpha, beta_s_per_byte=beta, world_size=2)
