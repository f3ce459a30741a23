"""What a ``DistributedOptimizer`` does, without being one: the parts, composed, and the policy of ``step()``.

The wrapper (``optimizer/wrapper.py``) is a subclass of the user's optimizer class
that keeps Horovod's surface and holds one field of its own, this
:class:`Core`. The core owns the parts and says when each acts:

- :class:`GradientBuffers` (``buffers.py``): the memory behind every gradient,
  laid out by the plan, and the version checks on it;
- :class:`Backward` (``gradients.py``): an iteration's gradients, from the
  C++ hooks' hand-over to the flush, and the waits for reduced values;
- :class:`LazyUpdates` (``updates.py``): which updates wait for their first
  read, where each is applied, the read guard;
- :class:`Stepper` (``lazy.py``): the wrapped optimizer's step, eager or per
  apply point, and the checks that come before any update;
- :class:`UsageTally` (``usage.py``): which gradients exist on which rank,
  embedding rows and sparse gradients;
- the backend and its engine (the C++ scheduler), the profiling recorder,
  the re-planner and the timeline.

The parts hold one another's public methods only, and call back into the
core weakly (``WeakMethod``): nothing keeps a dropped optimizer alive.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import warnings
import weakref

import torch

from .. import backends, timeline
from ..errors import DCreditError
from ..planner.plan import Plan
from ..planner.profile import RING_STAGE_RATIOS
from ..profiling import profiler, replanner
from ..profiling.planning import measures_stages
from ..reduce_ops import Average, block_reduction
from ..world import job, process_sets
from . import checks, devices
from .buffers import GradientBuffers
from .gradients import ANOTHER_MODELS_LOSS, TWO_PASS_OPTIMIZERS, Backward, WeakMethod
from .layout import fixed_plan
from .lazy import Stepper, holds_any, watch_module_hooks_when_compiled
from .notices import Notices
from .updates import LazyUpdates
from .usage import UsageTally

log = logging.getLogger("dcredit_opt")


class Core:
    """The composed parts of one ``DistributedOptimizer`` (see the module's docstring). Public fields are
    the parts, read by the wrapper, the model's hooks and the runtime; only the core's methods assign them."""

    def __init__(self, optimizer, base: type, names, params, frozen, passes: int, op, predivide: float, config,
                 sparse_as_dense: bool, wire, group_of, process_set=None, step_noted=None, outside=(),
                 reduced_elsewhere=None):
        job.init(timeout_s=config.timeout_s, backend=config.backend)
        devices.check_world(names, params, config.backend)  # before any collective
        # Note [Process sets]: the ranks reduced over, their control plane and channels.
        device = devices.device_of(names, params)
        self.members = members = process_sets.members(process_set, config.timeout_s, device, config.backend)
        self.config = config
        self.names = names
        self.params = params
        self.kind = base.__name__  # the wrapped optimizer's class, for messages
        self.closed = False
        world = members.size
        # Note [Reduce ops]: Min, Max and Product reduce every block with that op; rows and sparse rows sum.
        reduction = block_reduction(op)
        prescale = 1.0 / predivide if op == Average else 1.0
        postscale = predivide / world if op == Average else 1.0
        # Note [Parameters outside the optimizer] in checks.py: compared only where every rank names the same ones.
        outside_agreed = checks.check_same_model_on_all_ranks(names, params, members, outside)
        checks.check_same_setup_on_all_ranks(config, members, backward_passes_per_step=passes, op=op.value,
                                              gradient_predivide_factor=predivide,
                                              sparse_as_dense=sparse_as_dense, compression=str(wire),
                                              groups=group_of)
        self.told = Notices()
        if outside and not outside_agreed:
            self.told.tell("outside differ", f"dcredit_opt: the parameters named in named_parameters but not in this "
                                             f"{base.__name__} (such as '{outside[0][0]}') differ between ranks, so their "
                                             "weights are not compared between ranks "
                                             "(Note [Parameters outside the optimizer] in checks.py)")
            outside = ()
        # Named ones now, and the model's others once its forward is watched (Core._end_learning).
        self.outside = (checks.Outside([n for n, _ in outside], [p for _, p in outside], reduced_elsewhere)
                        if reduced_elsewhere is not None else None)
        self._optimizer = weakref.ref(optimizer)
        self._step_noted = step_noted  # checks.StepNoted, for an LR scheduler built before wrapping
        self.skip = False  # inside optimizer.skip_synchronize()
        self._spares: list | None = None  # Note [Zeroed while pending]: what p.grad is in place of a slot still needed
        self._step_thread: int | None = None  # the thread of the last step()
        # Note [Zeroed while pending]: torch's own zero_grad zeroes every p.grad of the groups in place
        self._base_zeroes_all = base.zero_grad is torch.optim.Optimizer.zero_grad
        self._replan = False  # this step() stages a plan: it must be eager
        me = weakref.ref(self)
        # Note [Lazy step]: the updates that wait for their first read, and where each is applied.
        self.lazy = LazyUpdates(optimizer, names, params, self.told)
        self.lazy.watch_checkpoints(optimizer)
        self.backend = backends.create(config.backend, config.channels, config.timeout_s, members,
                                       device_windows=config.device_windows, reduction=reduction)
        self.engine = self.backend.engine
        # Note [Global usage] and Note [Embedding rows]: which gradients exist where, and the rows agreed on.
        self.tally = UsageTally(names, params, world, self.backend, config, self.told, WeakMethod(me, "rows_arrived"),
                                rows=reduction == "sum", outside=self.outside, groups=WeakMethod(me, "_param_groups"))
        # The memory behind every gradient, laid out by the plan; the engine reduces in it.
        self.buffers = GradientBuffers(names, params, self.engine, self.backend, config, self.lazy.keeper,
                                       prescale=prescale, postscale=postscale, wire=wire, groups=group_of,
                                       sparse_as_dense=sparse_as_dense,
                                       dense_only=None if reduction == "sum" else f"op={op.value.capitalize()}")
        if not sparse_as_dense and reduction == "sum":  # Note [Sparse gradients] in sparse.py: reduced as rows
            self.tally.take_sparse_gradients()
            self.buffers.take_sparse(self.tally.put_sparse, self.tally.as_sparse)
        self.backward = Backward(names, params, passes, self.engine, self.buffers, self.tally, self.lazy, config,
                                 self.told, prescale=prescale, opening=WeakMethod(me, "_opening"),
                                 restage=WeakMethod(me, "_restage"), apply_pending=WeakMethod(me, "apply_pending"),
                                 spare_of=WeakMethod(me, "_spare_of"), others=world > 1)
        parts = (self.buffers, self.lazy, self.tally, self.backward, self.engine, self.backend)
        self.stepper = Stepper(optimizer, base, names, params, frozen, parts, config, self.told, group_of)
        if config.policy == "deft" and not self.buffers.sums_delayed():
            self.backend.close()
            raise DCreditError(f"Config(policy='deft') sums its delayed gradients on backend 'torch' only; this "
                               f"job's blocks go through backend '{self.backend.name}': set "
                               "Config(backend='torch') (it runs under torchrun, horovodrun and mpirun alike)")
        reducible = self.backend.reducible_dtypes
        if wire is not None and reducible is not None and wire not in reducible:
            log.warning("dcredit_opt: backend '%s' cannot reduce %s, so Compression.fp16 changes nothing here: "
                        "float32 gradients travel as they are", self.backend.name, wire)
        self.staged_plan = None
        self.profile = None
        self.recorder = (profiler.Recorder(names, params, config.profile_iters)
                         if config.policy != "fixed" and config.profile_iters > 0 and params else None)
        self.timeline = (timeline.RankTimeline(config.timeline_path, members.rank, world)
                         if config.timeline_path else None)
        # Re-planning while training (replanner.py): watches the blocks and the backward, re-plans with the others.
        self.replanner = (replanner.Replanner(config, [p.dtype for p in params], members,
                                              cpu_clock=device.type == "cpu")
                          if replanner.wanted(config, world, bool(params)) else None)
        self._set_plan(fixed_plan(
            [p.numel() for p in params], [p.element_size() for p in params], config.block_bytes,
            config.window, config.channels, config.credit_bytes, config.overlap_forward))
        atexit.register(_drain_at_exit, me)
        # Dropped without close() (del, garbage collection): what is in flight still
        # finishes before the channels go, or the peers would wait for blocks never launched.
        self._dropped = weakref.finalize(optimizer, _close_dropped, self.engine, self.backend, self.backward.life,
                                         float(config.timeout_s))
        self._dropped.atexit = False  # at exit, _drain_at_exit drains and the runtime closes
        job.register_user(self)
        # A gradient beyond backward_passes_per_step, or of a parameter whose update is pending, is refused
        # before autograd adds it to p.grad, which by then is our slot, possibly on the wire.
        self.backward.path.install()
        watch_module_hooks_when_compiled()

    def _set_plan(self, plan: Plan) -> None:
        """Switch to ``plan``; only between iterations (nothing in flight)."""
        buffers = self.buffers
        buffers.set_plan(plan, self.tally.rows_only())
        self.backward.path.set_slots(buffers.slots, buffers.watched)

    @property
    def plan(self) -> Plan:
        """The plan in force (the staged one, once profiling has produced it)."""
        return self.staged_plan or self.buffers.plan

    # ---- the optimizer's API -------------------------------------------------------------

    def require_open(self, call: str) -> None:
        if self.closed:
            raise DCreditError(
                f"{call} on a DistributedOptimizer that was shut down (dc.shutdown() shuts down every one, after "
                "applying its pending updates): its hooks and channels are gone. state_dict() still works; to "
                "train on, call dc.init() and build a new DistributedOptimizer")

    def synchronize(self) -> None:
        """Finish reducing this iteration's gradients (and apply any pending update)."""
        self.require_open("synchronize()")
        self._end_learning()
        self.apply_pending()
        backward, everything = self.backward, range(len(self.params))
        backward.note_missed_short()
        if not backward.open and (backward.missed or any(backward.counts)):
            # Note [Missed here]: this rank joins the others' flush; or fewer backward passes than
            # backward_passes_per_step (Note [Short accumulations] in csrc/torch/gradient_path.cc): reduced now
            backward.check_short("synchronize()")
            backward.begin()
        if backward.open and not backward.synchronized:
            self.stepper.check_frozen()
            if not backward.flushed:
                backward.flush()
            self.buffers.check_writes(everything, "synchronize()")
            backward.wait_final("synchronize(), waiting for every block")
            backward.drop_unused_grads(everything)
            backward.set_synchronized(True)
            backward.all_final()

    def set_backward_passes_per_step(self, passes: int) -> None:
        if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be a positive integer, got {passes!r}")
        self.backward.set_passes_per_step(passes)

    @contextlib.contextmanager
    def skip_synchronize(self):
        self.skip = True
        try:
            yield
        finally:
            self.skip = False

    def step(self, closure, grad_scaler):
        self.require_open("step()")
        self._step_thread = threading.get_ident()  # where updates it defers may be applied ahead of a forward
        if self._step_noted is not None:
            self._step_noted()
        stepper, backward = self.stepper, self.backward
        stepper.check_groups()
        loss = None
        if closure is not None:  # its forward is the next iteration's: the tracer may be watching it
            with backward.running_closure(), torch.enable_grad():  # a refused pass there says so
                loss = closure()
        self._end_learning()
        if backward.synchronized and not self.skip:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                          "optimizer.synchronize(). This can cause training slowdown. You may want to "
                          "consider using optimizer.skip_synchronize() context if you use "
                          "optimizer.synchronize() in your code.")
        if not backward.open:
            backward.note_missed_short()
            if not any(backward.counts) and not backward.missed:  # Note [Missed here]: a backward ran
                if self._zero_gradients_only():
                    # hvd.broadcast_optimizer_state() makes a fresh optimizer's state so: pending updates
                    # first, then the wrapped step over every parameter, nothing reduced.
                    self.apply_pending()
                    stepper.step_base()
                    return loss
                if not any(p.grad is not None for p in self.params):
                    self._tell_no_gradient()  # Note [No gradient here]
                # Gradients assigned by hand (from torch.autograd.grad): reduced now, as Horovod's
                # synchronize() reduces every p.grad whose hook did not fire; none at all, this rank joins the
                # others' reduction with none (Note [No gradient here]).
            else:  # fewer backward passes than backward_passes_per_step: reduce what there is
                backward.check_short("step()")  # Note [Short accumulations] in csrc/torch/gradient_path.cc
            backward.begin()
        if self.timeline is not None:
            self.timeline.settle()  # Note [Timeline writer] in timeline.py
        stepper.check_frozen()
        if self.outside is not None and self.outside.watching:
            self._watch_outside()
        if not backward.flushed:
            backward.release()  # the last step()'s updates this forward did not read, then every block
        if not backward.synchronized:
            backward.accept_final_writes()
            self.buffers.check_writes(range(len(self.params)), "step()")
        dropped, replaced = self._replaced_gradients()
        if grad_scaler is not None and stepper.scaled_skip(grad_scaler):
            return loss
        if self.config.check_finite:
            stepper.check_finite()
        updates = self.lazy
        updates.take(self._optimizer().param_groups, self.records_forward())
        backward.end()
        if self.replanner is not None and self.recorder is None:  # a re-plan is staged as the first plan is
            buffers = self.buffers
            fresh = self.replanner.check(
                backward.iteration, buffers.plan, self.profile, lambda: buffers.numels(self.tally.rows_only()),
                self.timeline, wait_blocks=lambda: backward.wait_all("re-planning's check, waiting for the blocks"))
            if fresh is not None:
                self.staged_plan, self._replan = fresh, True
        elif self.replanner is not None:  # profiling: the profile's own wall and CPU time (replanner.py)
            self.replanner.profiled(self.engine.ready_times)
        # The user asked for every gradient now; or profiling, or a plan switch: nothing may wait.
        eager = backward.synchronized or self.recorder is not None or self._replan
        lazy = stepper.may_defer(self.buffers.plan, replaced, eager)
        self._replan = False
        backward.set_synchronized(False)
        if lazy:
            updates.skip(dropped)  # p.grad = None after backward(): no update this step, as in plain torch
            # Where an alias of a slot is kept (Note [Kept aliases] in watched.py), a write through it after
            # step() must come after that update, as in plain torch: applied now.
            now = updates.eager + self.buffers.aliased()
            if now:
                stepper.apply(now)
            updates.defer(self._optimizer(), backward.path)
        else:
            stepper.step_now()
        self._tell_python_path()
        updates.start_learning(self._optimizer())
        if self.recorder is not None:
            self.recorder.on_step(self.engine.ready_times())
            if self.recorder.done:
                self._finish_profiling()
        return loss

    # Note [Skipped steps]
    # A script may decide, after backward, not to update this iteration: a
    # gradient norm that is not finite, a batch whose backward raised part-way
    # (an out-of-memory error caught, a check in a hook). Synchronous training
    # then skips the update on every rank. Here the gradients are on the wire
    # from the first hook on, so the skip has to end what was started:
    # optimizer.synchronize() finishes reducing them (every rank launches the
    # same blocks), and zero_grad() then ends the iteration without an update,
    # as GradScaler's skipped steps end it. Without synchronize() first,
    # zero_grad() would drop gradients still being reduced: refused, saying
    # so. Skipping on one rank while another steps leaves different weights,
    # which no collective would notice: the ranks' update counts travel in
    # the tally and are compared at each flush (Note [Same updates] in
    # usage.py), so that mistake stops every rank with an error at the next
    # iteration's flush.

    def _watch_outside(self) -> None:
        """Note [Parameters outside the optimizer] in checks.py: a parameter of the model not ours, changed since
        the last step() with a gradient while no optimizer of ours reduces it, is said once."""
        changed = self.outside.changed_unreduced()
        if changed is None:
            return
        name, named = changed
        how = ("is named in named_parameters but is not in this {kind}" if named else
               "belongs to the model whose forward runs this {kind}'s parameters, but is neither in it nor named in "
               "its named_parameters").format(kind=self.kind)
        log.warning("dcredit_opt: parameter '%s' %s, and it changed since the last step(): if another optimizer "
                    "trains it, its gradient is this rank's own and the ranks drift apart. Wrap every optimizer "
                    "that trains the model with dc.DistributedOptimizer. Its weights are compared between ranks "
                    "every Config(check_weights_every) iterations, and a difference stops every rank (Note "
                    "[Parameters outside the optimizer] in checks.py). Said once.", name, how)

    def zero_grad(self, set_to_none: bool) -> None:
        backward = self.backward
        if backward.open and backward.synchronized:  # Note [Skipped steps]: no update this iteration
            backward.end()
            backward.set_synchronized(False)
        elif backward.open and (any(backward.marked) or self.tally.rows_captured()):
            first = next((f" (that of '{self.names[i]}' among them)" for i, m in enumerate(backward.marked) if m), "")
            raise DCreditError(
                f"optimizer.zero_grad() was called while this iteration's gradients are being reduced{first}: after "
                "loss.backward() (or a backward that raised part-way) and before optimizer.step() or "
                "optimizer.synchronize(). Nothing was changed. To apply them, call optimizer.step(); to skip "
                "this iteration, call optimizer.synchronize() and then optimizer.zero_grad(), on every rank "
                f"alike (Note [Skipped steps]). {TWO_PASS_OPTIMIZERS} If that backward was {ANOTHER_MODELS_LOSS}")
        # Our own bookkeeping on gradients, not a read of any parameter: the read guard stands aside (it
        # would examine every call here while updates are pending; Note [Guard cost] in reads.py).
        # A zero_grad to None of torch's own only gets and sets p.grad, which no guard takes for a read: our other
        # optimizers' guards stand aside too (Note [Several guards] in reads.py).
        lazy = self.lazy
        with lazy.guard.paused("all" if set_to_none and self._base_zeroes_all else ""):
            if set_to_none:
                self._spares = None  # as the wrapped zero_grad sets every p.grad to None
                if self.buffers.aliases:  # Note [Kept aliases] in watched.py: theirs is the gradient dropped now
                    self.buffers.let_aliases_go()
            elif lazy.npending and self._base_zeroes_all:
                self._give_spares()
            elif lazy.npending:  # Note [Zeroed while pending]: a zero_grad of the wrapped class's own
                self.told.tell("own zero_grad", f"dcredit_opt: {self.kind} has a zero_grad of its own, so "
                                                "zero_grad(set_to_none=False) applies the pending updates first, and "
                                                "it finds the reduced gradients in p.grad as plain torch has them; "
                                                "those updates did not overlap the forward. Said once.")
                self.apply_pending()
            # Reads and writes gradients only, never a parameter's values: the guard need not see it.
            self.stepper.zero_grad_base(set_to_none)

    def _param_groups(self) -> list:
        """The wrapped optimizer's param groups, for Note [Same hyperparameters] in usage.py."""
        optimizer = self._optimizer()
        return [] if optimizer is None else optimizer.param_groups

    def _spare_of(self, i: int):
        """Tensor ``i``'s spare (Note [Zeroed while pending]), or None."""
        return None if self._spares is None else self._spares[i]

    def _give_spares(self) -> None:
        """Note [Zeroed while pending]: p.grad becomes zeros apart from the slot, where the slot holds a reduced
        gradient that a pending update still needs."""
        spares = self._spares
        if spares is None:
            self._spares = spares = [torch.zeros_like(p) for p in self.params]
        for i in self.backward.path.give_spares(spares):  # a parameter reshaped since: rare
            p = self.params[i]
            p.grad = spares[i] = torch.zeros_like(p)

    # Note [Zeroed while pending]
    # ``zero_grad(set_to_none=False)`` between a lazy step() and the forward
    # that applies its updates: plain torch zeroes each p.grad in place, but
    # here p.grad is the slot (through its watched alias), which holds the
    # reduced gradient the pending update has yet to use. So p.grad becomes a
    # spare instead, a tensor of zeros of the parameter's shape, and the next
    # backward accumulates into it as plain torch's accumulates into its
    # zeroed p.grad; the hook then copies it into the slot. The spares are made
    # once, and torch's own ``Optimizer.zero_grad`` zeroes them in place as it
    # zeroes any p.grad of its groups. The swap is one C++ pass
    # (``GradientPath.give_spares``), not a Python assignment per parameter. A
    # zero_grad to None drops them. Where the wrapped class has a zero_grad of
    # its own, it may keep some gradients (plain torch then accumulates into
    # the reduced gradient of the step before): there the pending updates are
    # applied first, and that zero_grad gets p.grad as plain torch has it
    # after step(), the reduced gradient in the slot (a notice says so once).

    def apply_pending(self) -> None:
        self.stepper.apply_pending()

    # ---- what the model's hooks and the watched gradients call --------------------------------------

    def before_forward(self, module: torch.nn.Module) -> None:
        """Forward pre-hook of a module that first reads some of our parameters, or of the forward's leader
        (Note [Resting hooks] in updates.py)."""
        lazy = self.lazy
        own = lazy.own(module)
        if own is None:
            return
        lazy.reached(module)
        if own and self.timeline is not None:
            self.timeline.on_forward(own[0])
        if own and self.recorder is not None:
            self.recorder.on_forward(own)
        if lazy.npending:
            self.stepper.apply_at(own, self.engine.finals)
        if not lazy.npending:
            if not self.records_forward():
                lazy.rest()
            else:  # the hooks go on recording the forward
                lazy.guard.leave_if_idle()
        else:
            lazy.wake_every_hook()  # the leader left some: the apply points take them as the forward reaches them

    def records_forward(self) -> bool:
        """Whether the apply points' hooks record the forward (profiling, the timeline): they stay then."""
        return self.timeline is not None or self.recorder is not None

    def apply_on_read(self, indices) -> None:
        self.stepper.apply_on_read(indices, self.engine.finals)

    def reads_wait(self, writes: bool) -> bool:
        """Whether a read of our gradients (``writes``: or an in-place change) may have to wait for a reduction
        or apply pending updates first (``gradients_read``); False when every gradient of this iteration is
        final already and nothing is to be applied, so that the watch need not list the tensors read."""
        if self.closed:
            return False
        return not self.backward.every_final or self._written_while_pending(writes)

    def _written_while_pending(self, writes: bool) -> bool:
        """An in-place change between a lazy ``step()`` and the next backward, while updates wait."""
        return bool(writes and self.lazy.npending and not self.backward.open)

    def gradients_read(self, indices, writes: bool = False) -> None:
        """Note [Gradient reads] in watched.py: user code reads ``p.grad`` of ``indices``, or (``writes``) may
        change it in place."""
        if self.closed:
            return
        lazy = self.lazy
        if self._written_while_pending(writes) and any(lazy.pending[i] for i in indices):
            # Between a lazy step() and the next backward the slot still holds the reduced gradient that a
            # pending update needs: the updates first, then the change lands where plain torch's would.
            name = self.names[next(i for i in indices if lazy.pending[i])]
            if threading.get_ident() != self._step_thread:
                raise DCreditError(
                    f"p.grad of '{name}' was changed in place, or taken as .data, detach() or NumPy, on another "
                    "thread than the one that called step(), while its update waited for the next forward: applying "
                    "it there would race that forward. Change gradients after step() on the thread that calls "
                    "step() (or clear them with optimizer.zero_grad() there)")
            self.told.tell("written while pending", (
                f"dcredit_opt: p.grad of '{name}' was changed in place after step() while its update waited for the "
                "next forward (model.zero_grad(set_to_none=False) after step() does that), or taken as .data, "
                "detach() or NumPy, which can change it unseen: the pending updates are applied first, so the "
                "change lands on the gradient as in plain torch, but they do not overlap the forward then. "
                "optimizer.zero_grad() before backward keeps the overlap. Said once."))
            self.apply_pending()
        self.backward.gradients_read(indices)

    def scaler_unscales(self, indices) -> None:
        """Note [A scaler's unscale_] in watched.py: a scaler unscales the gradients of ``indices``, waited for."""
        if not self.closed:
            self.backward.mark_unscaled(indices)

    def rows_arrived(self, i: int) -> None:
        self.backward.rows_arrived(i)

    # ---- the backward's calls back ------------------------------------------------------------

    def _opening(self, iteration: int) -> None:
        """An iteration opens: the last one into the timeline and the re-planner's watch; a staged plan in."""
        if self.timeline is not None and iteration:
            self.timeline.record(self.engine.trace(), self.engine.ready_times(), self.names,
                                 self.buffers.layout.block_tensors, iteration)
        if self.replanner is not None and iteration:  # re-planning's watch (replanner.py)
            self.replanner.observe(self.engine, self.buffers.layout.block_bytes)
        if self.staged_plan is not None:
            # Every rank stages the same plan at the same step(), so every
            # rank switches here, in the same iteration. The step() that staged
            # it was eager (profiling), so no update waits in the old slots.
            assert not self.lazy.npending, "a plan switch with updates pending"
            plan, self.staged_plan = self.staged_plan, None
            self._set_plan(plan)

    def _restage(self) -> None:
        """Tensors became rows-only (Note [Embedding rows]): a plan without their blocks, staged now."""
        self.staged_plan = self.staged_plan or self.buffers.plan
        self._replan = True

    # ---- step()'s questions -------------------------------------------------------------------

    def _zero_gradients_only(self) -> bool:
        """No backward since the last ``step()``, and every gradient present is a zero tensor the script put
        there (at least one is).

        ``hvd.broadcast_optimizer_state(opt, root)`` creates the state of a
        fresh optimizer that way: new zero gradients, then ``opt.step()``, on
        every rank. The average of zeros is zero on every rank, so stepping
        locally is exactly the synchronous step. Zeros in our own slots (or
        the zeros ``zero_grad(set_to_none=False)`` put in place of a slot a
        pending update still needs) are what that call left where no backward
        came since: this rank joins the others' reduction (Note [No gradient
        here]), which another rank's backward may have started.
        """
        grads = [(i, p.grad) for i, p in enumerate(self.params) if p.grad is not None]
        spares = self._spares or (None,) * len(self.params)
        if not grads or any(self.buffers.is_ours(i, g) or g is spares[i] for i, g in grads):
            return False
        for _, g in grads:
            values = g.coalesce().values() if g.is_sparse else g
            if bool(values.any()):
                return False
        return True

    # Note [No gradient here]
    # A step() with no backward since the last one, and no gradient at all:
    # an optimizer per part of the model (a head per task) whose part this
    # rank's batch did not use, while another rank's did. Synchronous
    # training (DDP, Horovod) averages that part's gradients with this
    # rank's zeros; the other ranks are already reducing them and wait for
    # this one. So this rank joins the iteration with no gradient: every
    # tensor counts as unused here (Note [Global usage]), its blocks carry
    # zeros, and a parameter some rank used gets the average, one no rank
    # used stays without a gradient and the optimizer skips it, as a plain
    # step() with no gradient does. Said once, since a step() with no
    # backward may also be a forgotten loss.backward().

    # Note [Missed here]
    # A backward on this rank may give gradients to another optimizer of ours
    # and to none of this one's tensors (a branch with an optimizer of its own
    # that this rank's batch skipped), while on another rank it reaches them.
    # The ranks that got a gradient flush at synchronize(); this one must
    # join them there, or the collectives of the optimizers meet in
    # different orders (a timeout) or the Horovod recipe (synchronize(),
    # clip_grad_norm_ over every optimizer's parameters, step()) clips
    # without this optimizer's averaged gradients on this rank alone. So the
    # end of a backward that opened some optimizer's iteration on this rank
    # (the callback of Note [Unused here]) marks every other optimizer of
    # ours whose iteration is not open as having missed it (``missed``, a
    # flag: no collective); where no iteration opened in backward (fewer
    # passes than backward_passes_per_step so far), synchronize() and step()
    # find it so where another optimizer of ours counted passes and this one
    # none (``Backward.note_missed_short``); synchronize() opens a missed
    # iteration and
    # flushes it as step() does with no gradient (Note [No gradient here]).
    # After step() (which clears the flag) synchronize() only applies what
    # is pending, as before. Not covered: code that lists this optimizer's
    # gradients without synchronize(), between backward and step() (its
    # p.grad stay None here, while other ranks show their average): such a
    # branch belongs in the optimizer of the layers every rank reaches
    # (docs/lazy-step.md); the weights check stops a run that differs.

    def _tell_no_gradient(self) -> None:
        self.told.tell("no gradient", (
            f"dcredit_opt: step() found no gradient on this rank since the last step() (none of its "
            f"{len(self.params)} parameters, '{self.names[0]}' the first, has one): this rank joined the "
            "reduction with none, so each parameter gets the other ranks' average, or stays without a gradient "
            "(and unchanged) where no rank computed one (Note [No gradient here]). If a loss.backward() was "
            "meant to come first, call it before optimizer.step(). Said once."))

    def _replaced_gradients(self) -> tuple[list, list]:
        """Note [Replaced gradients]: the tensors whose gradient user code set to ``None`` after
        ``backward()``, and those whose gradient it replaced by another tensor."""
        dropped, replaced = [], []
        buffers, marked = self.buffers, self.backward.marked
        read_while_unused = self.backward.read_while_unused
        for i in self.backward.path.not_watched():  # one C++ pass; nearly always none
            g = self.params[i].grad
            # A tensor handed over (marked) had p.grad set to ours, embedding rows or not (a sparse gradient's
            # hand-over too, and an embedding-only weight is handed over at the flush): anything else is the
            # script's doing.
            if not marked[i]:
                continue
            if g is not None and i in read_while_unused and not buffers.is_ours(i, g):
                # Note [Unused here]: made from the zeros shown for a tensor no rank used, where plain torch
                # had None (and no update): a drop.
                self.params[i].grad = g = None
            if g is None:
                dropped.append(i)
            elif not buffers.is_ours(i, g):
                replaced.append(i)
        return dropped, replaced

    def _tell_python_path(self) -> None:
        """Note [Gradient path]: once per optimizer, say so when gradients of the last iteration went through
        Python (where they must: other layouts, gradients after the blocks were released)."""
        slow = self.backward.take_slow_count()
        if not slow or "python path" in self.told:
            return
        if self.tally.sparse_rows():
            why = "sparse gradients, reduced as rows (Note [Sparse gradients])"
        elif any(self.buffers.sparse):
            why = "sparse gradients, reduced as dense (sparse_as_dense=True)"
        else:
            why = ("gradients whose dtype, shape or device differ from their parameter's, or that came after "
                   "the iteration's blocks were released")
        self.told.tell("python path", f"dcredit_opt: {slow} of {len(self.params)} gradients of the last iteration "
                                      f"were handed over in Python, not in the C++ hook, because of {why}; each "
                                      "costs some microseconds more (Note [Gradient path]). Said once.")

    def _end_learning(self) -> None:
        tracer = self.stepper.end_learning(self.recorder, self.closed)
        if tracer is not None and self.outside is not None and self.params:
            # Note [Parameters outside the optimizer] in checks.py: the model's other parameters, found.
            # Where the forward began, in order: those that hold ours, and those begun after the first of them.
            ours = {id(p) for p in self.params}
            entries = list(dict.fromkeys(m for m in (ref() for ref in tracer.entries) if m is not None))
            holding = [holds_any(m, ours) for m in entries]
            after = holding.index(True) if True in holding else len(entries)
            self.outside.find([m for m, h in zip(entries, holding) if h], ours, self.params[0].device,
                              others=[m for m, h in zip(entries[after:], holding[after:]) if not h])

    # ---- profiling, planning, timeline ---------------------------------------

    def _finish_profiling(self) -> None:
        """Every rank: measure the network; rank 0: plan; everyone: stage rank 0's plan."""
        recorder, self.recorder = self.recorder, None
        device = self.params[0].device
        allreduce, barrier = self.backend.sweep_collectives()
        alpha, beta, _ = profiler.measure_alpha_beta(allreduce, barrier, device)
        ratios = RING_STAGE_RATIOS
        if measures_stages(self.config.policy, self.members.size):  # what a reduce-scatter and an all-gather cost
            ratios = profiler.measure_stage_ratios(self.backend.stage_collectives(), barrier, device,
                                                   self.members.size, alpha, beta)
        host = self.config.collective_host_s
        if host > 0 and device.type == "cpu":  # Note [Measured host cost] in profiler.py
            host = max(host, profiler.measure_host_per_collective(allreduce, barrier))
        buffers = self.buffers
        self.staged_plan, self.profile = profiler.agree_on_plan(recorder, alpha, beta, self.config, self.params,
                                                                buffers.wire_dtypes(),
                                                                buffers.numels(self.tally.rows_only()), ratios,
                                                                self.members, host_s_per_collective=host)

    def use_timeline(self, tl):
        """Record into ``tl`` (or nothing, for None) from the next iteration on: ``dc.start_timeline()`` and
        ``dc.stop_timeline()``. Returns the timeline it replaces."""
        previous, self.timeline = self.timeline, tl
        return previous

    def end_timeline(self) -> None:
        """The last iteration into the timeline (drained: its blocks have finished), then close the file."""
        tl = self.timeline
        if tl is None:
            return
        try:
            if self.backward.iteration:
                tl.record(self.engine.trace(), self.engine.ready_times(), self.names,
                          self.buffers.layout.block_tensors, self.backward.iteration)
            tl.close(self.names)
        except (RuntimeError, OSError) as e:
            log.warning("dcredit_opt: the timeline's last iteration was not written: %s", e)

    # ---- the end ---------------------------------------------------------------------------

    # Note [Interrupted backward]
    # An error raised in a gradient hook (a sparse gradient first seen after
    # the first iteration, a stale read, a backward pass too many) ends the
    # backward there, but not the blocks that the gradients before it
    # released: the dispatch thread (under MPI and Horovod, the driver) goes
    # on launching them. Nothing stops launches but closing the optimizer
    # (close(), dc.shutdown(), a new optimizer taking over, dropping it, the
    # exit), and that used to stop them at once: one rank's launcher could
    # have started a released block that the other's never started, and that
    # collective waited for its peer forever (under MPI the completer stayed
    # in MPI_Wait and the job ended in MPI_Abort at exit; under Gloo it timed
    # out). So before launches stop, drain() finishes exactly the released
    # blocks (Engine.wait_released); the unreleased ones no rank launched.
    #
    # Why every rank finishes the same blocks: the scheduler releases at
    # events taken in plan order (Note [Same order on every rank]), so ranks
    # whose backward stopped at the same gradient (a refusal every rank
    # raises) released the same blocks, in the same launch order. A rank that
    # stopped where a peer went on released a prefix of the peer's sequence,
    # which the peer launches too; if a peer stopped earlier, this rank waits
    # for at most the timeout, and says so.
    #
    # What it leaves: the released blocks hold their averages in p.grad, the
    # rest this rank's gradient; no update is applied (every rank raised).
    # Only closing stops launches: an optimizer used on after the error keeps
    # launching, in the same order on every rank; its next step() refuses
    # what it refused before, or flushes the rest and steps on the gradients
    # it is then given, as synchronous training would.

    def drain(self) -> None:
        """Let this iteration's blocks finish before this process stops talking.

        After a lazy ``step()`` the last blocks are still travelling; a rank
        that exits then would leave its peers waiting on collectives it never
        joins (they would fail with "connection closed by peer"). A backward
        interrupted before its flush leaves only the blocks it released (Note
        [Interrupted backward]). Bounded by the timeout; a failure here is
        only logged, the job is ending anyway.
        """
        timeout_s = float(self.config.timeout_s)
        try:
            if self.backward.open and not self.backward.flushed:
                self.engine.wait_released(timeout_s)  # Note [Interrupted backward]
            elif self.backward.flushed or self.lazy.npending:
                self.engine.wait_all(timeout_s)
        except (RuntimeError, TimeoutError) as e:
            log.warning("dcredit_opt: gradients still in flight at exit did not finish: %s", e)

    def close(self) -> None:
        """Apply what is pending, then detach from the model: hooks removed, engine shut down. Idempotent."""
        if self.closed:
            return
        try:
            self.apply_pending()
        except (RuntimeError, TimeoutError) as e:  # DCreditError included: said once, the job goes on closing
            log.warning("dcredit_opt: the updates pending at shutdown could not be applied: %s", e)
        self.closed = True
        if self.replanner is not None:
            self.replanner.close()
        self.lazy.let_go()
        self._dropped.detach()
        self.drain()
        self.end_timeline()
        self._end_learning()
        self.lazy.remove_hooks()
        self.tally.close()
        self.backward.path.close()
        self.buffers.release()
        self.backend.close()
        self.members.close()  # a process set's control group (Note [Orderly exit] in world/job.py)


def _close_dropped(engine, backend, life, timeout_s: float) -> None:
    """Finalizer of an optimizer dropped without ``close()``: drain what was released (all of it after the
    flush; before it, Note [Interrupted backward]), then close."""
    try:
        if life.released:
            engine.wait_all(timeout_s)
        else:
            engine.wait_released(timeout_s)
    except (RuntimeError, TimeoutError) as e:
        log.warning("dcredit_opt: a dropped optimizer's gradients in flight did not finish: %s", e)
    try:
        backend.close()
    except Exception as e:  # noqa: BLE001 - a finalizer must not raise; said once
        log.warning("dcredit_opt: closing a dropped optimizer's channels failed: %s", e)


def _drain_at_exit(ref) -> None:
    core = ref()
    if core is not None and not core.closed:
        core.drain()
        core.end_timeline()
