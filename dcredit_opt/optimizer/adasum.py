"""``DistributedOptimizer(opt, op=Adasum)``: each rank steps on its own gradient, the steps are combined.

Note [Adasum optimizer]
-----------------------
Horovod's ``DistributedOptimizer(op=hvd.Adasum)`` (its
``_DistributedAdasumOptimizer``, 0.28) does not reduce gradients. Each rank
runs the wrapped optimizer's step on its own, unreduced gradient; the change
that step made to each parameter (its delta) is combined across the ranks
with Adasum (Note [Adasum] in ``dcredit_opt/adasum.py``, per tensor), and
every rank's parameter becomes its value before the step plus the combined
delta. The optimizer state (momentum, Adam's moments) stays each rank's own:
it is built from that rank's gradients. Horovod's ``Adasum`` needs no larger
learning rate for more ranks (its examples scale the rate by ``size()`` for
Average, by 1 for Adasum).

Ours does the same, with these choices:

- the deltas travel in one all-gather over the optimizer's ranks (each rank
  receives every rank's deltas, N times the model's bytes, after the step:
  nothing overlaps the backward), and every rank evaluates the same tree on
  the same bytes, so every rank ends with the same bits (Note [Same bits on
  every rank]). Horovod's runs its bandwidth-optimal exchange on MPI, one
  tensor at a time from the backward hooks, on a power-of-two global world
  only;
- every parameter the optimizer holds that required a gradient at wrapping
  takes part in every ``step()`` (a parameter without a gradient this step
  has a zero delta, as Horovod's); a frozen one that has a gradient at
  ``step()`` is refused, as is a change to the parameter groups, before
  anything is applied;
- the wrapped step runs once over all parameters (Horovod runs it once per
  parameter, from the hook), so an optimizer whose step couples parameters
  (a global norm) sees them all, as it would alone;
- ``compression=Compression.fp16`` sends the float32/float64 deltas as
  float16 and rounds the combined delta to float16, as Horovod compresses
  the delta; ``process_set`` is honoured (Horovod refuses any but the global
  set); ``backward_passes_per_step`` only says how often Horovod's hooks
  launch, so it changes nothing here (the gradient that ``step()`` uses is
  whatever autograd accumulated); ``groups`` and ``sparse_as_dense`` shape
  how gradients are reduced, and none are, so they are checked and have no
  effect, as in Horovod; ``gradient_predivide_factor`` other than 1 is
  refused (Horovod's ValueError: it is for op=Average);
- ``synchronize()`` has nothing to wait for (the gradients are local), and
  ``skip_synchronize()`` is accepted (Horovod raises) so that the clipping
  recipe (``synchronize()``, clip, ``with skip_synchronize(): step()``)
  clips the local gradient and still combines the step;
- with ``torch.amp.GradScaler`` a step is skipped on every rank when any
  rank found Inf/NaN, and every rank's scaler is told so, so that the
  scales stay equal;
- a world of one (or a process set of one) is the wrapped step alone.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from .. import adasum, timeline
from ..errors import DCreditError
from ..world import job, process_sets, runtime
from . import checks, devices

log = logging.getLogger("dcredit_opt")


def wrap(optimizer, names, params, frozen, wire, passes: int, process_set, config, sparse_as_dense: bool, group_of):
    """The ``op=Adasum`` form of ``DistributedOptimizer`` (Note [Adasum optimizer]); the arguments already
    checked by ``wrapper.DistributedOptimizer``."""
    job.init(timeout_s=config.timeout_s, backend=config.backend)
    # As Core does, in the same order: the world checks (under Horovod, the job-wide CPU decision is a collective),
    # then the model and the settings, so that a rank with another op meets the same calls.
    devices.check_world(names, params, config.backend)
    device = devices.device_of(names, params)
    plane = _plane(process_set, config, device)
    checks.check_same_model_on_all_ranks(names, params, plane)
    # The same settings as any DistributedOptimizer compares (core.py), so that a rank with op=Adasum beside one
    # with another op meets a MismatchError naming op, not a collective of another length.
    checks.check_same_setup_on_all_ranks(config, plane, backward_passes_per_step=passes, op="adasum",
                                          gradient_predivide_factor=1.0, sparse_as_dense=sparse_as_dense,
                                          compression=str(wire), groups=group_of)
    base = optimizer.__class__
    cls = type(base.__name__, (base,), {k: v for k, v in _AdasumWrapper.__dict__.items()
                                         if k not in ("__dict__", "__weakref__", "__module__", "__doc__")})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(checks.copied_fields(optimizer))
    wrapped._dc = AdasumCore(base, names, params, frozen, wire, passes, plane, checks.StepNoted.of(optimizer))
    checks.LoadInPlace.install(wrapped)
    job.register_user(wrapped._dc)
    return wrapped


def _plane(process_set, config, device):
    """The ranks the steps are combined over: the optimizer's process set, as for any DistributedOptimizer
    (``process_sets.members``: a rank outside Horovod's set trains alone, as in Horovod; outside ours, an
    error)."""
    return process_sets.members(process_set, config.timeout_s, device, config.backend)


class AdasumCore:
    """What a ``DistributedOptimizer(op=Adasum)`` does (Note [Adasum optimizer]): the wrapper's ``_dc``."""

    def __init__(self, base: type, names, params, frozen, wire, passes: int, plane, step_noted=None):
        self.base = base
        self.kind = base.__name__
        self.names, self.params, self.frozen = list(names), list(params), list(frozen)
        self.wire = wire
        self.passes = passes
        self.plane = plane
        self.closed = False
        self.steps = 0
        self._step_noted = step_noted  # checks.StepNoted, for an LR scheduler built before wrapping
        self._held = [id(p) for p in self.params] + [id(p) for _, p in self.frozen]

    # ---- the step ------------------------------------------------------------------------------

    def step(self, optimizer, closure, grad_scaler):
        self._check(optimizer)
        if self._step_noted is not None:
            self._step_noted()
        if grad_scaler is not None and self._skip_for_scaler(optimizer, grad_scaler):
            return None
        if self.plane.size == 1:
            return self.base.step(optimizer, closure)
        with torch.no_grad():
            starts = [p.detach().clone() for p in self.params]
        loss = self.base.step(optimizer, closure)
        try:
            with torch.no_grad():
                self._combine(starts)
        except BaseException:
            with torch.no_grad():  # the weights as they were: this rank's lone step is not kept
                for p, start in zip(self.params, starts):
                    p.copy_(start)
            raise
        self.steps += 1
        return loss

    def _combine(self, starts) -> None:
        """Every parameter's delta, combined over the ranks; the parameters set to start + combined."""
        sent = [self._on_wire(p - start) for p, start in zip(self.params, starts)]
        rows = self.plane.all_gather(adasum.pack(sent, device=self.plane.control_device()),
                                     name=f"adasum.step{self.steps}")
        for p, start, per_rank, wired in zip(self.params, starts, adasum.unpack_rows(rows, sent), sent):
            delta = adasum.adasum_rows(per_rank).to(wired.dtype).to(device=p.device, dtype=p.dtype)
            p.copy_(start + delta.reshape(p.shape))

    def _on_wire(self, delta: torch.Tensor) -> torch.Tensor:
        if self.wire is not None and delta.dtype in (torch.float32, torch.float64):
            return delta.to(self.wire)
        return delta

    def _check(self, optimizer) -> None:
        """Refusals that come before anything is applied."""
        if self.closed:
            raise DCreditError(f"this DistributedOptimizer(op=Adasum) ({self.kind}) is closed (dcredit_opt.shutdown(), "
                               "or a newer DistributedOptimizer over the same parameters took over): build a new one")
        held = [id(p) for g in optimizer.param_groups for p in g["params"]]
        if sorted(held) != sorted(self._held):
            raise DCreditError("the optimizer's parameters changed after it was wrapped with op=Adasum: their "
                               "steps would not be combined. Build a new DistributedOptimizer over the optimizer")
        for name, p in self.frozen:
            if p.grad is not None:
                raise DCreditError(f"parameter '{name}' did not require a gradient when the DistributedOptimizer "
                                   "(op=Adasum) was built, but has one now: its step would not be combined across "
                                   "ranks. Set requires_grad before wrapping, or build a new DistributedOptimizer")

    def _skip_for_scaler(self, optimizer, scaler) -> bool:
        """``GradScaler.step(opt)``: unscale this rank's gradients; skip the step on every rank if any rank found
        Inf/NaN, and make every rank's scaler see that, so that their scales stay equal."""
        from torch.amp.grad_scaler import OptState

        state = scaler._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.READY:
            scaler.unscale_(optimizer)
        found = scaler._found_inf_per_device(optimizer)
        mine = sum(float(v.item()) for v in found.values())
        if self.plane.size > 1:
            flag = torch.tensor([1.0 if mine else 0.0], dtype=torch.float64, device=self.plane.control_device())
            mine = sum(float(t.item()) for t in self.plane.all_gather(flag, name=f"adasum.inf{self.steps}"))
        if not mine:
            return False
        for v in found.values():
            v.fill_(1.0)
        return True

    # ---- the rest of the surface ----------------------------------------------------------------

    def set_backward_passes_per_step(self, passes: int) -> None:
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be a positive integer, got {passes!r}")
        self.passes = passes

    def apply_pending(self) -> None:
        """Nothing is pending between steps (``broadcast_optimizer_state`` asks)."""

    def use_timeline(self, recorder) -> None:
        """``start_timeline``: nothing of this optimizer's is recorded (it has no blocks); the previous recorder
        ``stop_timeline`` gets back is None."""
        if recorder is not None and runtime.rank() == 0:
            log.info("dcredit_opt: a DistributedOptimizer(op=Adasum) records nothing on the timeline")

    def close(self) -> None:
        """Idempotent; a process set's control group goes with it (Note [Orderly exit] in world/job.py)."""
        if self.closed:
            return
        self.closed = True
        self.plane.close()


class _AdasumWrapper:
    """Body of the generated subclass (see :func:`wrap`): Horovod's surface over the user's optimizer class.
    Its one field of its own is ``_dc``, the :class:`AdasumCore`."""

    _step_supports_amp_scaling = True  # GradScaler.step() hands us the scaler (AdasumCore._skip_for_scaler)

    @timeline.profiled_call("dcredit_opt::step")
    def step(self, closure=None, grad_scaler=None):
        return self._dc.step(self, closure, grad_scaler)

    def synchronize(self) -> None:
        """Nothing to wait for: with op=Adasum the gradients are not reduced, the steps are (Note [Adasum
        optimizer])."""

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Horovod's setter; with op=Adasum it changes nothing (Note [Adasum optimizer])."""
        self._dc.set_backward_passes_per_step(passes)

    def skip_synchronize(self):
        """Accepted for the clipping recipe; ``step()`` still combines the step across ranks."""
        return contextlib.nullcontext()

    def add_param_group(self, param_group):
        raise DCreditError("add_param_group() on a DistributedOptimizer is not supported: its steps would not "
                           "be combined. Add the group to the wrapped optimizer before calling "
                           "dcredit_opt.DistributedOptimizer, or build a new DistributedOptimizer over the whole "
                           "optimizer (it takes over from this one)")
