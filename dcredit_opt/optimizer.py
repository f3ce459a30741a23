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

import atexit
import contextlib
import logging
import warnings
import weakref

import torch

from . import (
    _ext,
    backends,
    checks,
    devices,
    grouping,
    runtime,
    separable,
    timeline,
)
from .buffers import GradientBuffers, per_tensor
from .compression import wire_dtype_of
from .config import Config
from .errors import DCreditError
from .gradients import (
    GradientHooks,
    WeakMethod,
    clear,
    weak_rows_hook,
)
from .layout import fixed_plan
from .lazy import LazyStep, group_ids, watch_module_hooks_when_compiled
from .notices import Notices
from .planner.plan import Plan
from .planner.profile import RING_STAGE_RATIOS
from .profiling import profiler, replanner
from .profiling.planning import DECOUPLING_POLICIES
from .reduce_ops import HOROVOD_OP_CODES, Average, ReduceOp
from .updates import LazyUpdates
from .usage import UsageTally

log = logging.getLogger("dcredit_opt")


# A script passes Horovod's ints as op=hvd.Average. A gradient average or sum is what an optimizer takes.
_HOROVOD_OPS = {code: ReduceOp(name) for code, name in HOROVOD_OP_CODES.items() if name in ("average", "sum")}
_HOROVOD_UNSUPPORTED = {code: name.capitalize() for code, name in HOROVOD_OP_CODES.items() if code not in _HOROVOD_OPS}


def reduce_op(op) -> ReduceOp:
    """``op`` as ours: dcredit_opt.Average/Sum or Horovod's hvd.Average/hvd.Sum."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, int) and not isinstance(op, bool):
        if op in _HOROVOD_OPS:
            return _HOROVOD_OPS[op]
        if op in _HOROVOD_UNSUPPORTED:
            raise NotImplementedError(
                f"op=hvd.{_HOROVOD_UNSUPPORTED[op]} is not supported: dcredit_opt reduces gradients with "
                "Average or Sum (hvd.Average, hvd.Sum, dcredit_opt.Average, dcredit_opt.Sum); for Adasum use "
                "horovod.torch.DistributedOptimizer")
    raise ValueError(f"op must be dcredit_opt.Average or dcredit_opt.Sum (or Horovod's hvd.Average, hvd.Sum), "
                     f"got {op!r}")


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, backward_passes_per_step: int = 1,
                         op=Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                         sparse_as_dense: bool = False, process_set=None, *, config: Config | None = None):
    """Wrap ``optimizer`` so that its gradients are averaged across ranks.

    The signature of ``horovod.torch.DistributedOptimizer``, same positions,
    names and meaning, plus ``config`` (keyword only). ``compression`` is
    ``Compression.none`` or ``Compression.fp16`` (ours or Horovod's; Note [Wire
    dtype] in ``compression.py``); ``op`` is ``Average`` or ``Sum`` (ours or
    Horovod's); ``groups`` (a list of lists of parameters, or a number of
    groups; ``num_groups`` is its old name) reduces each group's gradients
    together, in one block, once all of them are ready; ``process_set`` must be
    the global one. The returned object is an instance of a subclass of
    ``optimizer``'s class that shares its parameter groups and state, so LR
    schedulers and ``isinstance`` checks keep working.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(  # noqa: TRY004 - a supported type is a question of value here
            "torch.optim.LBFGS is not supported: it re-evaluates the closure inside step()")
    if getattr(optimizer, "_dc_names", None) is not None:
        raise ValueError("optimizer is already a dcredit_opt.DistributedOptimizer")
    wire = wire_dtype_of(compression)
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be a positive integer, got {backward_passes_per_step!r}")
    op = reduce_op(op)
    if not (isinstance(gradient_predivide_factor, (int, float)) and gradient_predivide_factor > 0):
        raise ValueError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor!r}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    _check_process_set(process_set)
    if config is None:
        config = Config.from_env()
    elif not isinstance(config, Config):
        raise TypeError(f"config must be a dcredit_opt.Config, got {type(config).__name__}")
    config.validate()
    names, params, frozen = checks.named_tracked_params(optimizer, named_parameters)
    owners = _earlier_owners(names, params)
    group_of = grouping.tensor_groups(groups if groups is not None else (num_groups or None), names, params)
    _check_devices(names, params)
    _take_over(owners)

    base = optimizer.__class__
    parts = (LazyStep, GradientHooks, _DistributedOptimizer)
    body = {k: v for part in parts for k, v in part.__dict__.items()
            if k not in ("__dict__", "__weakref__", "__module__", "__doc__")}
    body["_dc_base"] = base
    cls = type(base.__name__, (base,), body)
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._dc_setup(names, params, frozen, backward_passes_per_step, op, float(gradient_predivide_factor), config,
                      sparse_as_dense, wire, group_of)
    return wrapped


# id(parameter) -> (weak parameter, weak DistributedOptimizer that reduces its gradient). Keyed by id:
# a WeakKeyDictionary would compare tensors with ==.
_REDUCED_BY: dict = {}


def _reduced_by(p):
    entry = _REDUCED_BY.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


def _mark_reduced_by(p, ref) -> None:
    key = id(p)
    _REDUCED_BY[key] = (weakref.ref(p, lambda _, key=key: _REDUCED_BY.pop(key, None)), ref)


def _earlier_owners(names, params) -> list:
    """The live optimizers that reduce some of ``params`` already, with the first such parameter's name."""
    owners: dict = {}
    for name, p in zip(names, params):
        other = _reduced_by(p)
        if other is not None and not getattr(other, "_dc_closed", False):
            owners.setdefault(id(other), (other, name))
    return list(owners.values())


def _take_over(owners) -> None:
    """A new optimizer over parameters that an earlier one reduces replaces it (``opt =
    DistributedOptimizer(...)`` again, to change optimizers mid-training): both hooks would take the
    gradient. The earlier one is closed, after applying its pending updates; using it later raises."""
    for other, name in owners:
        log.warning("dcredit_opt: parameter '%s' is reduced by an earlier DistributedOptimizer (%s); that one is "
                    "closed now, its pending updates applied, and the new one takes over", name,
                    type(other).__name__)
        other._dc_close()


def _check_process_set(process_set) -> None:
    """Only the global process set: every rank reduces every gradient."""
    if process_set is None:
        return
    if getattr(process_set, "process_set_id", None) == 0:
        return  # Horovod's hvd.global_process_set
    raise NotImplementedError(
        f"process_set={process_set!r}: dcredit_opt reduces over every rank of the job (the global process set); "
        "leave process_set out, or use horovod.torch.DistributedOptimizer for a subset of ranks")


def _check_devices(names, params):
    devices.device_of(names, params)  # one device, CPU or CUDA; the rest after runtime.init()


class _DistributedOptimizer:
    """Body of the generated subclass; see :func:`DistributedOptimizer`."""

    # ---- set-up ---------------------------------------------------------

    _step_supports_amp_scaling = True  # GradScaler.step() hands us the scaler (see _dc_scaled_skip)

    def _dc_setup(self, names, params, frozen, bpps, op, predivide, config, sparse_as_dense, wire, group_of):
        runtime.init(timeout_s=config.timeout_s, backend=config.backend)
        devices.check_world(names, params, config.backend)  # before any collective
        self._dc_config = config
        self._dc_names = names
        self._dc_params = params
        self._dc_frozen = frozen
        self._dc_bpps = bpps
        world = runtime.size()
        prescale = 1.0 / predivide if op == Average else 1.0
        postscale = predivide / world if op == Average else 1.0
        self._dc_group_of = []
        for p in params:
            self._dc_group_of.append(next(gi for gi, g in enumerate(self.param_groups)
                                          if any(q is p for q in g["params"])))
        checks.check_same_model_on_all_ranks(names, params)
        self._dc_groups = group_of  # Horovod's groups, merged in every plan (grouping.py)
        checks.check_same_setup_on_all_ranks(config, backward_passes_per_step=bpps, op=op.value,
                                              gradient_predivide_factor=predivide,
                                              sparse_as_dense=sparse_as_dense, compression=str(wire),
                                              groups=group_of)
        T = len(params)
        # Per-tensor state that the gradient hooks write: flat memory, cleared in place (Note [Gradient state]).
        self._dc_counts = per_tensor(T, "i")  # backward passes since the last step()
        self._dc_marked = per_tensor(T, "B")  # handed to the scheduler in this iteration
        self._dc_final = [False] * T  # reduction waited for at a read of p.grad (Note [Gradient reads])
        self._dc_group_ids = group_ids(self.param_groups)  # what was wrapped (Note [Replaced gradients])
        # The groups hold exactly our parameters, in order (none frozen): a wrapped step over every update
        # can take them as they are.
        self._dc_whole_groups = [i for ids in self._dc_group_ids for i in ids] == [id(p) for p in params]
        self._dc_open = False
        self._dc_flushed = False
        self._dc_synchronized = False
        self._dc_skip = False
        self._dc_replan = False  # this step() stages a plan: it must be eager
        self._dc_told = Notices()
        # Note [Lazy step]: the updates that wait for their first read, and where each is applied.
        self._dc_lazy = LazyUpdates(self, names, params, self._dc_told)
        self._dc_backend = backends.create(config.backend, config.channels, config.timeout_s)
        self._dc_engine = self._dc_backend.engine
        me = weakref.ref(self)
        # Note [Global usage] and Note [Embedding rows]: which gradients exist where, and the rows agreed on.
        self._dc_tally = UsageTally(names, params, world, self._dc_backend, config, self._dc_told,
                                    weak_rows_hook(me))
        # The memory behind every gradient, laid out by the plan; the engine reduces in it.
        self._dc_buffers = GradientBuffers(names, params, self._dc_engine, self._dc_backend, config,
                                           self._dc_lazy.keeper,
                                           prescale=prescale, postscale=postscale, wire=wire, groups=group_of,
                                           sparse_as_dense=sparse_as_dense)
        if not sparse_as_dense:  # Note [Sparse gradients] in sparse.py: sparse gradients reduced as rows
            self._dc_tally.take_sparse_gradients()
            self._dc_buffers.sparse_sink = self._dc_tally.put_sparse
            self._dc_buffers.as_sparse = self._dc_tally.as_sparse
        # Note [Gradient path]: each gradient's hand-over, in C++; Python where it must.
        self._dc_path = _ext.load().GradientPath(self._dc_engine, params, self._dc_counts, self._dc_marked,
                                                 self._dc_tally.used, self._dc_lazy.pending,
                                                 self._dc_buffers.versions, WeakMethod(me, "_dc_hand_over"),
                                                 WeakMethod(me, "_dc_before_accumulate"),
                                                 WeakMethod(me, "_dc_hook_failed"))
        self._dc_buffers.use_path(self._dc_path)
        self._dc_path.set_passes_per_step(bpps)
        self._dc_python_handovers = 0
        self._dc_path.set_prescale(prescale)
        if config.policy == "deft" and not self._dc_buffers.sums_delayed():
            self._dc_backend.close()
            raise DCreditError(f"Config(policy='deft') sums its delayed gradients on backend 'torch' only; this "
                               f"job's blocks go through backend '{self._dc_backend.name}': set "
                               "Config(backend='torch') (it runs under torchrun, horovodrun and mpirun alike)")
        reducible = self._dc_backend.reducible_dtypes
        if wire is not None and reducible is not None and wire not in reducible:
            log.warning("dcredit_opt: backend '%s' cannot reduce %s, so Compression.fp16 changes nothing here: "
                        "float32 gradients travel as they are", self._dc_backend.name, wire)
        self._dc_staged_plan = None
        self._dc_profile = None
        self._dc_recorder = (profiler.Recorder(names, params, config.profile_iters)
                             if config.policy != "fixed" and config.profile_iters > 0 and params else None)
        self._dc_timeline = (timeline.RankTimeline(config.timeline_path, runtime.rank(), runtime.size())
                             if config.timeline_path else None)
        # Re-planning while training (replanner.py): watches the blocks and the backward, re-plans with the others.
        self._dc_replanner = (replanner.Replanner(config, [p.dtype for p in params])
                              if replanner.wanted(config, world, bool(params)) else None)
        self._dc_iteration = 0
        self._dc_set_plan(fixed_plan(
            [p.numel() for p in params], [p.element_size() for p in params], config.block_bytes,
            config.window, config.channels, config.credit_bytes, config.overlap_forward))
        atexit.register(_drain_at_exit, me)
        # Dropped without _dc_close() (del, garbage collection): what is in flight still
        # finishes before the channels go, or the peers would wait for blocks never launched.
        self._dc_life = _Life()
        self._dc_dropped = weakref.finalize(self, _close_dropped, self._dc_engine, self._dc_backend, self._dc_life,
                                            float(config.timeout_s))
        self._dc_dropped.atexit = False  # at exit, _drain_at_exit drains and the runtime closes
        runtime.register_user(self)
        # A gradient beyond backward_passes_per_step, or of a parameter whose update is pending, is refused
        # before autograd adds it to p.grad, which by then is our slot, possibly on the wire.
        self._dc_path.install()
        watch_module_hooks_when_compiled()
        for p in params:
            _mark_reduced_by(p, me)

    def _dc_set_plan(self, plan: Plan) -> None:
        """Switch to ``plan``; only between iterations (nothing in flight)."""
        buffers = self._dc_buffers
        buffers.set_plan(plan, self._dc_tally.rows_only())
        self._dc_path.set_slots(buffers.slots, buffers.watched)

    # ---- the public optimizer API ----------------------------------------

    def synchronize(self) -> None:
        """Finish reducing this iteration's gradients (and apply any pending update)."""
        self._dc_require_open("synchronize()")
        self._dc_end_learning()
        if self._dc_lazy.npending:
            self._dc_apply(range(len(self._dc_params)))
        if self._dc_open and not self._dc_synchronized:
            self._dc_check_frozen()
            if not self._dc_flushed:
                self._dc_flush()
            self._dc_buffers.check_writes(range(len(self._dc_params)), "synchronize()")
            self._dc_wait_final("synchronize(), waiting for every block")
            self._dc_drop_unused_grads(range(len(self._dc_params)))
            self._dc_synchronized = True
            self._dc_final = [True] * len(self._dc_params)  # every read from here on is of final values

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Horovod's setter: the backward passes per ``step()`` from now on; only between iterations."""
        if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be a positive integer, got {passes!r}")
        if any(self._dc_counts):
            raise DCreditError(f"set_backward_passes_per_step({passes}) after a backward pass: call it right "
                               "after step(), before the next loss.backward()")
        self._dc_bpps = passes
        self._dc_path.set_passes_per_step(passes)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Use after ``synchronize()``: ``step()`` then does not synchronize again."""
        self._dc_skip = True
        try:
            yield
        finally:
            self._dc_skip = False

    @timeline.profiled_call("dcredit_opt::step")
    def step(self, closure=None, grad_scaler=None):
        self._dc_require_open("step()")
        self._dc_check_groups()
        self._dc_end_learning()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._dc_synchronized and not self._dc_skip:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                          "optimizer.synchronize(). This can cause training slowdown. You may want to "
                          "consider using optimizer.skip_synchronize() context if you use "
                          "optimizer.synchronize() in your code.")
        if not self._dc_open:
            if not any(self._dc_counts):
                if self._dc_zero_gradients_only():
                    return self._dc_initialise_state(loss)
                if not self._dc_assigned_gradients():
                    raise DCreditError("step() called, but no gradient was computed since the last step(): "
                                       "call loss.backward() before optimizer.step()")
                # Gradients assigned by hand (from torch.autograd.grad): reduced now, as Horovod's
                # synchronize() reduces every p.grad whose hook did not fire.
            self._dc_begin()  # or fewer backward passes than backward_passes_per_step: reduce what there is
        if self._dc_timeline is not None:
            self._dc_timeline.settle()  # Note [Timeline writer] in timeline.py
        self._dc_check_frozen()
        if not self._dc_flushed:
            self._dc_release()  # the last step()'s updates this forward did not read, then every block
        if not self._dc_synchronized:
            self._dc_accept_final_writes()
            self._dc_buffers.check_writes(range(len(self._dc_params)), "step()")
        dropped, replaced = self._dc_replaced_gradients()
        if grad_scaler is not None and self._dc_scaled_skip(grad_scaler):
            return loss
        if self._dc_config.check_finite:
            self._dc_check_finite()
        updates = self._dc_lazy
        updates.take(self.param_groups)
        clear(self._dc_counts)
        self._dc_set_open(False)
        if self._dc_replanner is not None and self._dc_recorder is None:  # a re-plan is staged as the first plan is
            buffers = self._dc_buffers
            fresh = self._dc_replanner.check(
                self._dc_iteration, buffers.plan, self._dc_profile, lambda: buffers.numels(self._dc_tally.rows_only()),
                self._dc_timeline, wait_blocks=lambda: self._dc_wait_all("re-planning's check, waiting for the blocks"))
            if fresh is not None:
                self._dc_staged_plan, self._dc_replan = fresh, True
        lazy = self._dc_may_defer(replaced)
        self._dc_replan = False
        self._dc_synchronized = False
        if lazy:
            updates.skip(dropped)  # p.grad = None after backward(): no update this step, as in plain torch
            self._dc_apply(updates.eager)
            updates.defer(self, self._dc_path)
        else:
            self._dc_step_now()
        self._dc_tell_python_path()
        updates.start_learning(self)
        if self._dc_recorder is not None:
            self._dc_recorder.on_step(self._dc_engine.ready_times())
            if self._dc_recorder.done:
                self._dc_finish_profiling()
        return loss

    def _dc_tell_python_path(self) -> None:
        """Note [Gradient path]: once per optimizer, say so when more than the gradient that opened the
        iteration went through Python (where it must: several backward passes per step, other layouts)."""
        slow = self._dc_path.take_slow_count()
        self._dc_python_handovers += slow  # since wrapping (tests and benchmarks read it)
        if slow <= 1 or "python path" in self._dc_told:
            return
        if self._dc_bpps > 1:
            why = f"backward_passes_per_step={self._dc_bpps} (each pass's gradients are counted in Python)"
        elif self._dc_tally.sparse_rows():
            why = "sparse gradients, reduced as rows (Note [Sparse gradients])"
        elif any(self._dc_buffers.sparse):
            why = "sparse gradients, reduced as dense (sparse_as_dense=True)"
        else:
            why = ("gradients whose dtype, shape or device differ from their parameter's, or that came after "
                   "the iteration's blocks were released")
        self._dc_tell("python path", f"dcredit_opt: {slow} of {len(self._dc_params)} gradients of the last iteration "
                                     f"were handed over in Python, not in the C++ hook, because of {why}; each "
                                     "costs some microseconds more (Note [Gradient path]). Said once.")

    def _dc_zero_gradients_only(self) -> bool:
        """No backward since the last ``step()``, and every gradient present is zero (at least one is).

        ``hvd.broadcast_optimizer_state(opt, root)`` creates the state of a
        fresh optimizer that way: zero gradients, then ``opt.step()``. The
        average of zeros is zero on every rank, so stepping locally is exactly
        the synchronous step; any other gradient, set by hand, was never
        reduced and is refused.
        """
        grads = [p.grad for p in self._dc_params if p.grad is not None]
        if not grads:
            return False
        for g in grads:
            values = g.coalesce().values() if g.is_sparse else g
            if bool(values.any()):
                return False
        return True

    def _dc_initialise_state(self, loss):
        """``step()`` on zero gradients (see ``_dc_zero_gradients_only``): pending updates first, then the
        wrapped step over every parameter, nothing reduced."""
        self._dc_apply_pending()
        self._dc_base.step(self)
        return loss

    def _dc_assigned_gradients(self) -> bool:
        """Whether some ``p.grad`` was assigned by user code since the last ``step()`` (not our own)."""
        return any(p.grad is not None and p.grad is not w for p, w in zip(self._dc_params, self._dc_buffers.watched))

    def _dc_replaced_gradients(self) -> tuple[list, list]:
        """Note [Replaced gradients]: the tensors whose gradient user code set to ``None`` after
        ``backward()``, and those whose gradient it replaced by another tensor."""
        dropped, replaced = [], []
        buffers = self._dc_buffers
        for i in self._dc_path.not_watched():  # one C++ pass; nearly always none
            g = self._dc_params[i].grad
            if not self._dc_marked[i] or i in self._dc_tally.rows:
                continue
            if g is None:
                dropped.append(i)
            elif not buffers.is_ours(i, g):
                replaced.append(i)
        return dropped, replaced

    def _dc_check_groups(self) -> None:
        """Parameters added to (or removed from) the wrapped optimizer after wrapping: their gradients would
        not be reduced, or their updates not made. Refused at the next ``step()``, before anything is applied."""
        groups = self.param_groups
        if group_ids(groups) == self._dc_group_ids:
            return
        known = {id(p): name for name, p in zip(self._dc_names, self._dc_params)}
        known.update((id(p), name) for name, p in self._dc_frozen)
        now = {id(p) for g in groups for p in g["params"]}
        for gi, g in enumerate(groups):
            for p in g["params"]:
                if id(p) not in known:
                    raise DCreditError(
                        f"param_groups[{gi}] of the wrapped optimizer holds a parameter of shape {tuple(p.shape)} "
                        "that it did not hold when dcredit_opt.DistributedOptimizer was built (add_param_group() "
                        "on the wrapped optimizer, or a list changed in place): its gradient is not reduced, so its "
                        "update would use this rank's gradient alone. Nothing was applied. Add every parameter "
                        "group before wrapping, or build a new DistributedOptimizer over the whole optimizer "
                        "(it takes over from this one)")
        gone = [name for pid, name in known.items() if pid not in now]
        raise DCreditError(
            f"the wrapped optimizer's parameter groups changed after dcredit_opt.DistributedOptimizer was built "
            f"({'parameter ' + repr(gone[0]) + ' was removed' if gone else 'parameters moved between groups'}): "
            "the updates would no longer match synchronous training. Nothing was applied. Change the groups "
            "before wrapping, or build a new DistributedOptimizer over the changed optimizer")

    def _dc_may_defer(self, replaced=()) -> bool:
        """Whether this step()'s updates may wait for their first read (Note [Lazy step])."""
        if not (self._dc_buffers.plan.overlap_forward and self._dc_config.overlap_forward and self._dc_lazy.learned):
            return False
        if replaced:
            # The user's tensor may change after step() (it is theirs): the wrapped step uses it now.
            self._dc_tell("replaced", f"dcredit_opt: p.grad of '{self._dc_names[replaced[0]]}' was replaced by "
                                      "another tensor after backward(); a step that uses such gradients applies "
                                      "every update in step(), without overlap (Note [Replaced gradients]). "
                                      "Said once.")
            return False
        if self._dc_synchronized or self._dc_recorder is not None or self._dc_replan:
            # the user asked for every gradient now; or profiling, or a plan switch: nothing may wait
            return False
        reason = separable.why_eager(self._dc_base, self, self._dc_config.lazy_step)
        if reason is not None:
            self._dc_tell(reason, f"dcredit_opt: updates are applied in step() (no overlap with the next "
                                  f"forward), because {reason}")
            return False
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._dc_open and (any(self._dc_marked) or self._dc_tally.rows_captured()) and not self._dc_synchronized:
            raise DCreditError("optimizer.zero_grad() was called after loss.backward() but before "
                               "optimizer.step() or optimizer.synchronize(): the gradients are being reduced")
        # Our own bookkeeping on gradients, not a read of any parameter: the read guard stands aside (it
        # would examine every call here while updates are pending; Note [Guard cost] in reads.py).
        lazy = self._dc_lazy
        with lazy.guard.paused():
            if lazy.npending and not set_to_none:  # set to None, as the wrapped zero_grad sets every p.grad
                pending, params, buffers = lazy.pending, self._dc_params, self._dc_buffers
                for i, p in enumerate(params):
                    if pending[i] and buffers.is_ours(i, p.grad):
                        # The slot holds the reduced gradient a pending update still needs.
                        p.grad = torch.zeros_like(p)
            # Reads and writes gradients only, never a parameter's values: the guard need not see it.
            self._dc_base.zero_grad(self, set_to_none=set_to_none)

    def state_dict(self):
        self._dc_apply_pending()
        return self._dc_base.state_dict(self)

    def load_state_dict(self, state_dict):
        self._dc_apply_pending()
        return self._dc_base.load_state_dict(self, state_dict)

    def add_param_group(self, param_group):
        raise DCreditError("add_param_group() on a DistributedOptimizer is not supported: its gradients would not "
                           "be reduced. Add the group to the wrapped optimizer before calling "
                           "dcredit_opt.DistributedOptimizer, or build a new DistributedOptimizer over the whole "
                           "optimizer (it takes over from this one)")

    def _dc_require_open(self, call: str) -> None:
        if getattr(self, "_dc_closed", False):
            raise DCreditError(
                f"{call} on a DistributedOptimizer that was shut down (dc.shutdown() shuts down every one, after "
                "applying its pending updates): its hooks and channels are gone. state_dict() still works; to "
                "train on, call dc.init() and build a new DistributedOptimizer")

    def _dc_tell(self, key: str, message: str) -> None:
        """A notice, once per optimizer and reason."""
        self._dc_told.tell(key, message)

    # ---- profiling, planning, timeline ---------------------------------------

    def _dc_finish_profiling(self) -> None:
        """Every rank: measure the network; rank 0: plan; everyone: stage rank 0's plan."""
        recorder, self._dc_recorder = self._dc_recorder, None
        device = self._dc_params[0].device
        allreduce, barrier = self._dc_backend.sweep_collectives()
        alpha, beta, _ = profiler.measure_alpha_beta(allreduce, barrier, device)
        ratios = RING_STAGE_RATIOS
        if self._dc_config.policy in DECOUPLING_POLICIES:  # what a reduce-scatter and an all-gather cost here
            ratios = profiler.measure_stage_ratios(self._dc_backend.stage_collectives(), barrier, device,
                                                   runtime.size(), alpha, beta)
        buffers = self._dc_buffers
        self._dc_staged_plan, self._dc_profile = profiler.agree_on_plan(recorder, alpha, beta, self._dc_config,
                                                                        self._dc_params, buffers.wire_dtypes(),
                                                                        buffers.numels(self._dc_tally.rows_only()),
                                                                        ratios)

    @property
    def plan(self) -> Plan:
        """The plan in force (the staged one, once profiling has produced it)."""
        return self._dc_staged_plan or self._dc_buffers.plan

    @property
    def replans(self) -> list:
        """Every re-plan so far, oldest first, the same on every rank (``planner.adaptive.Replan`` records: the
        iteration, why, the predicted iteration times before and after); empty with re-planning off."""
        return [] if self._dc_replanner is None else self._dc_replanner.replans

    @property
    def profile(self):
        """What profiling measured (rank 0 only; None elsewhere or before)."""
        return self._dc_profile

    def _dc_drain(self) -> None:
        """Let this iteration's blocks finish before this process stops talking.

        After a lazy ``step()`` the last blocks are still travelling; a rank
        that exits then would leave its peers waiting on collectives it never
        joins (they would fail with "connection closed by peer"). Bounded by
        the timeout; a failure here is only logged, the job is ending anyway.
        """
        try:
            if self._dc_flushed or self._dc_lazy.npending:
                self._dc_engine.wait_all(float(self._dc_config.timeout_s))
        except (RuntimeError, TimeoutError) as e:
            log.warning("dcredit_opt: gradients still in flight at exit did not finish: %s", e)

    def _dc_use_timeline(self, tl):
        """Record into ``tl`` (or nothing, for None) from the next iteration on: ``dc.start_timeline()`` and
        ``dc.stop_timeline()``. Returns the timeline it replaces."""
        previous, self._dc_timeline = self._dc_timeline, tl
        return previous

    def _dc_end_timeline(self) -> None:
        """The last iteration into the timeline (drained: its blocks have finished), then close the file."""
        tl = self._dc_timeline
        if tl is None:
            return
        try:
            if self._dc_iteration:
                tl.record(self._dc_engine.trace(), self._dc_engine.ready_times(), self._dc_names,
                          self._dc_buffers.layout.block_tensors, self._dc_iteration)
            tl.close(self._dc_names)
        except (RuntimeError, OSError) as e:
            log.warning("dcredit_opt: the timeline's last iteration was not written: %s", e)

    def _dc_close(self) -> None:
        """Apply what is pending, then detach from the model: hooks removed, engine shut down. Idempotent."""
        if getattr(self, "_dc_closed", False):
            return
        try:
            self._dc_apply_pending()
        except (RuntimeError, TimeoutError) as e:  # DCreditError included: said once, the job goes on closing
            log.warning("dcredit_opt: the updates pending at shutdown could not be applied: %s", e)
        self._dc_closed = True
        self._dc_lazy.keeper.strong = None
        self._dc_dropped.detach()
        self._dc_drain()
        self._dc_end_timeline()
        self._dc_end_learning()
        self._dc_lazy.remove_hooks()
        self._dc_tally.close()
        self._dc_path.close()
        self._dc_buffers.release()
        self._dc_backend.close()


class _Life:
    """What a dropped optimizer's finalizer needs to know: whether this iteration's blocks were all released."""

    flushed = False


def _close_dropped(engine, backend, life: _Life, timeout_s: float) -> None:
    """Finalizer of an optimizer dropped without ``_dc_close()``: drain what was released, then close."""
    try:
        if life.flushed:
            engine.wait_all(timeout_s)
    except (RuntimeError, TimeoutError) as e:
        log.warning("dcredit_opt: a dropped optimizer's gradients in flight did not finish: %s", e)
    try:
        backend.close()
    except Exception as e:  # noqa: BLE001 - a finalizer must not raise; said once
        log.warning("dcredit_opt: closing a dropped optimizer's channels failed: %s", e)


def _drain_at_exit(ref) -> None:
    opt = ref()
    if opt is not None and not getattr(opt, "_dc_closed", False):
        opt._dc_drain()
        opt._dc_end_timeline()
