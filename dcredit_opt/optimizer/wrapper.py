"""The drop-in wrapper: hooks, the lazy step, synchronize (Note [Lazy step] in ``updates.py``).

Note [Replaced gradients]
-------------------------
Between ``backward()`` and ``step()`` user code may change what ``step()``
uses, as under DDP (reads and in-place changes: Note [Gradient reads] in
``watched.py``). ``p.grad = None`` skips that parameter's update this step,
as plain torch does: it is simply not applied (lazily or eagerly); its
blocks were reduced like every other, so every rank still launched the same
collectives. ``p.grad = t`` (a new tensor) is what the wrapped step uses:
such a step is eager, since ``t`` is the user's and may change after
``step()`` returns. A ``p.grad`` assigned by hand where no hook fired
(gradients from ``torch.autograd.grad``) is reduced at ``step()``, as
Horovod's ``synchronize()`` reduces every gradient whose hook did not fire;
a ``step()`` with nothing computed or assigned since the last one is
refused. Parameters added to the wrapped optimizer after wrapping are
refused at the next ``step()``, before anything is applied.

A compiled model (``torch.compile(model)``, ``model.compile()``) takes the
same path: the hooks are hidden from Dynamo and run eagerly at a graph break
(Note [Compiled models] in ``lazy.py``).
"""

from __future__ import annotations

import logging
import weakref

import torch

from .. import timeline
from ..config import Config
from ..errors import DCreditError
from ..planner.plan import Plan
from ..reduce_ops import HOROVOD_OP_CODES, Adasum, Average, ReduceOp, Sum
from ..world import process_sets
from . import adasum, checks, devices, grouping
from .compression import wire_dtype_of
from .core import Core
from .lazy import PendingState, core_of

log = logging.getLogger("dcredit_opt")


# A script passes Horovod's ints as op=hvd.Average (dcredit_opt.Min, Max and Product are those ints too);
# hvd.Adasum combines steps instead of gradients (Note [Adasum optimizer] in adasum.py).
_HOROVOD_OPS = {code: ReduceOp(name) for code, name in HOROVOD_OP_CODES.items()}


def reduce_op(op) -> ReduceOp:
    """``op`` as ours: dcredit_opt.Average/Sum/Adasum/Min/Max/Product or Horovod's hvd.Average, ..., hvd.Product."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, int) and not isinstance(op, bool) and op in _HOROVOD_OPS:
        return _HOROVOD_OPS[op]
    raise ValueError(f"op must be Average, Sum, Adasum, Min, Max or Product (dcredit_opt's or Horovod's, e.g. "
                     f"hvd.Average), got {op!r}")


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, backward_passes_per_step: int = 1,
                         op=Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                         sparse_as_dense: bool = False, process_set=None, *, config: Config | None = None):
    """Wrap ``optimizer`` so that its gradients are averaged across ranks.

    The signature of ``horovod.torch.DistributedOptimizer``, same positions,
    names and meaning, plus ``config`` (keyword only). ``compression`` is
    ``Compression.none`` or ``Compression.fp16`` (ours or Horovod's; Note [Wire
    dtype] in ``compression.py``); ``op`` is ``Average``, ``Sum``, ``Min``, ``Max`` or ``Product`` (ours or
    Horovod's; ``Min``, ``Max`` and ``Product`` reduce each gradient element with that instead of a sum), or
    ``Adasum``, which combines each rank's step instead of reducing gradients (Note [Adasum optimizer] in
    ``adasum.py``); ``groups`` (a list of lists of parameters, or a number of
    groups; ``num_groups`` is its old name) reduces each group's gradients
    together, in one block, once all of them are ready; ``process_set`` (ours,
    a list of ranks, a torch process group, or Horovod's) reduces over those
    ranks only (Note [Process sets] in ``process_sets.py``). The returned
    object is an instance of a subclass of ``optimizer``'s class that shares its parameter groups and state, so LR
    schedulers and ``isinstance`` checks keep working.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(  # noqa: TRY004 - a supported type is a question of value here
            "torch.optim.LBFGS is not supported: it re-evaluates the closure inside step()")
    if core_of(optimizer) is not None:
        raise ValueError("optimizer is already a dcredit_opt.DistributedOptimizer")
    wire = wire_dtype_of(compression)
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be a positive integer, got {backward_passes_per_step!r}")
    op = reduce_op(op)
    if not (isinstance(gradient_predivide_factor, (int, float)) and gradient_predivide_factor > 0):
        raise ValueError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor!r}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    process_sets.check_argument(process_set)
    if config is None:
        config = Config.from_env()
    elif not isinstance(config, Config):
        raise TypeError(f"config must be a dcredit_opt.Config, got {type(config).__name__}")
    config.validate()
    if op not in (Average, Sum) and config.policy == "deft":
        raise ValueError(f"Config(policy='deft') adds each delayed gradient to the next iteration's, which "
                         f"op={op.value.capitalize()} has no meaning for: use op=Average or op=Sum with it, or "
                         "another policy")
    names, params, frozen, outside = checks.named_tracked_params(optimizer, named_parameters)
    owners = _earlier_owners(names, params)
    group_of = grouping.tensor_groups(groups if groups is not None else (num_groups or None), names, params)
    _check_devices(names, params)
    _take_over(owners)
    if op == Adasum:  # Note [Adasum optimizer] in adasum.py: each rank steps, the steps are combined
        return _marked(adasum.wrap(optimizer, names, params, frozen, wire, backward_passes_per_step, process_set,
                                   config, sparse_as_dense, group_of), params)

    base = optimizer.__class__
    cls = type(base.__name__, (base,), {k: v for k, v in _Wrapper.__dict__.items()
                                         if k not in ("__dict__", "__weakref__", "__module__", "__doc__")})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(checks.copied_fields(optimizer))
    wrapped._dc = Core(wrapped, base, names, params, frozen, backward_passes_per_step, op,
                       float(gradient_predivide_factor), config, sparse_as_dense, wire, group_of, process_set,
                       step_noted=checks.StepNoted.of(optimizer), outside=outside, reduced_elsewhere=_reduced_elsewhere)
    checks.LoadInPlace.install(wrapped)
    checks.InnerStep.install(wrapped, wrapped._dc)
    return _marked(wrapped, params)


def _marked(wrapped, params):
    """``wrapped``, recorded as the optimizer that reduces ``params`` (a later one takes over from it)."""
    core = weakref.ref(wrapped._dc)
    for p in params:
        _mark_reduced_by(p, core)
    return wrapped


# id(parameter) -> (weak parameter, weak core of the DistributedOptimizer that reduces its gradient). Keyed by id:
# a WeakKeyDictionary would compare tensors with ==.
_REDUCED_BY: dict = {}


def _reduced_by(p):
    entry = _REDUCED_BY.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


def _reduced_elsewhere(p) -> bool:
    """Whether a live DistributedOptimizer of ours reduces ``p``'s gradient (Note [Parameters outside the optimizer]
    in checks.py)."""
    other = _reduced_by(p)
    return other is not None and not other.closed


def _mark_reduced_by(p, ref) -> None:
    key = id(p)
    _REDUCED_BY[key] = (weakref.ref(p, lambda _, key=key: _REDUCED_BY.pop(key, None)), ref)


def _earlier_owners(names, params) -> list:
    """The live optimizers that reduce some of ``params`` already, with the first such parameter's name."""
    owners: dict = {}
    for name, p in zip(names, params):
        other = _reduced_by(p)
        if other is not None and not other.closed:
            owners.setdefault(id(other), (other, name))
    return list(owners.values())


def _take_over(owners) -> None:
    """A new optimizer over parameters that an earlier one reduces replaces it (``opt =
    DistributedOptimizer(...)`` again, to change optimizers mid-training): both hooks would take the
    gradient. The earlier one is closed, after applying its pending updates; using it later raises."""
    for other, name in owners:
        log.warning("dcredit_opt: parameter '%s' is reduced by an earlier DistributedOptimizer (%s); that one is "
                    "closed now, its pending updates applied, and the new one takes over", name, other.kind)
        other.close()


def _check_devices(names, params):
    devices.device_of(names, params)  # one device, CPU or CUDA; the rest after job.init()


class _Wrapper:
    """Body of the generated subclass (see :func:`DistributedOptimizer`): Horovod's surface over the user's
    optimizer class. Its one field of its own is ``_dc``, the :class:`Core` that does the work."""

    _step_supports_amp_scaling = True  # GradScaler.step() hands us the scaler (Stepper.scaled_skip)

    @timeline.profiled_call("dcredit_opt::step")
    def step(self, closure=None, grad_scaler=None):
        return self._dc.step(closure, grad_scaler)

    def synchronize(self) -> None:
        """Finish reducing this iteration's gradients (and apply any pending update)."""
        self._dc.synchronize()

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Horovod's setter: the backward passes per ``step()`` from now on; only between iterations."""
        self._dc.set_backward_passes_per_step(passes)

    def skip_synchronize(self):
        """Use after ``synchronize()``: ``step()`` then does not synchronize again."""
        return self._dc.skip_synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._dc.zero_grad(set_to_none)

    state = PendingState()

    def __setattr__(self, name, value) -> None:
        if name == "state":  # Note [Reading the state]: the pending updates use the state they had, as in plain torch
            core = core_of(self)
            if core is not None and core.lazy.npending:
                core.apply_pending()
        super(type(self), self).__setattr__(name, value)

    def state_dict(self):
        self._dc.apply_pending()
        return super(type(self), self).state_dict()

    def load_state_dict(self, state_dict):
        self._dc.apply_pending()
        self._dc.tally.hyperparameters_replaced()  # Note [Same hyperparameters] in usage.py
        return super(type(self), self).load_state_dict(state_dict)

    def add_param_group(self, param_group):
        raise DCreditError("add_param_group() on a DistributedOptimizer is not supported: its gradients would not "
                           "be reduced. Add the group to the wrapped optimizer before calling "
                           "dcredit_opt.DistributedOptimizer, or build a new DistributedOptimizer over the whole "
                           "optimizer (it takes over from this one)")

    @property
    def plan(self) -> Plan:
        """The plan in force (the staged one, once profiling has produced it)."""
        return self._dc.plan

    @property
    def replans(self) -> list:
        """Every re-plan so far, oldest first, the same on every rank (``planner.adaptive.Replan`` records: the
        iteration, why, the predicted iteration times before and after); empty with re-planning off."""
        replanner = self._dc.replanner
        return [] if replanner is None else replanner.replans

    @property
    def profile(self):
        """What profiling measured (rank 0 only; None elsewhere or before)."""
        return self._dc.profile
