"""The lazy step's half of the optimizer: applying deferred updates where they are first read.

See Note [Lazy step] in ``updates.py`` and Note [First read] in
``reads.py``. :class:`Stepper` runs the wrapped optimizer's step (eagerly in
``step()``, or on the updates an apply point asks for) and the checks that
come before any update; which updates wait, and where each is applied, is
:class:`LazyUpdates`'s (``updates.py``). The model's hooks below reach the
optimizer's core through a :class:`Keeper`.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import weakref
from itertools import compress

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import DCreditError
from ..timeline import profiled
from ..world import runtime
from ..world.peers import at_rank
from . import separable
from .buffers import indices_of

log = logging.getLogger("dcredit_opt")


class Stepper:
    """Runs the wrapped optimizer's ``step()`` on reduced gradients: all of them in ``step()``, or those an
    apply point or an early read asks for, with the hyperparameters of the ``step()`` that deferred them.

    Holds the wrapped optimizer weakly (its class's own ``step`` is ``base.step``), what was wrapped (the
    groups by identity, each tensor's group, the frozen parameters), and the parts it reads: the buffers,
    the lazy updates, the tally, the backward.
    """

    def __init__(self, optimizer, base: type, names, params, frozen, parts, config, notices, horovod_groups):
        self.names = names
        self.params = params
        self._optimizer = weakref.ref(optimizer)
        self._base = base
        self._frozen = frozen
        self._buffers, self._lazy, self._tally, self._backward, self._engine, self._backend = parts
        self._config = config
        self._device_type = params[0].device.type if params else "cpu"  # autocast's, for _step_outside_forward
        self._notices = notices
        self._horovod_groups = horovod_groups  # merged in every plan (grouping.py)
        groups = optimizer.param_groups
        self._group_of = [next(gi for gi, g in enumerate(groups) if any(q is p for q in g["params"]))
                          for p in params]
        self._wrapped_groups = held_params(groups)  # what was wrapped (Note [Replaced gradients])
        # The groups hold exactly our parameters, in order (none frozen): a wrapped step over every update
        # can take them as they are.
        self._whole_groups = same_objects([p for held in self._wrapped_groups for p in held], params)

    # ---- applying updates ------------------------------------------------------

    def apply_pending(self) -> None:
        if self._lazy.npending:
            self.apply(range(len(self.params)))

    def step_now(self) -> None:
        """The eager step, inside ``step()``: the wrapped ``step()`` once, over the real groups, so that its
        hooks run once and see every parameter, and the hyperparameters are the ones in force."""
        params, backward = self.params, self._backward
        everything = range(len(params))
        self._wait(everything)
        backward.add_rows(everything)
        backward.drop_unused_grads(everything)
        # Ours (still p.grad) as plain slots, so that the wrapped step does not go through the watch
        # (Note [Gradient reads]); what user code put in p.grad as it is.
        with self.slots_lent(everything), profiled("dcredit_opt::apply"):
            self._base_step(self._optimizer())
        self._lazy.all_applied()

    @contextlib.contextmanager
    def slots_lent(self, indices, watched_only: bool = True, skip=(), sparse_form: bool = True):
        """Meanwhile ``p.grad`` of ``indices`` (but ``skip``) is the reduced gradient as the wrapped step takes it,
        so that our own work on final gradients (the wrapped step, the scaler's unscaling) does not go through the
        watch, a Python call per operation and per attribute read (Note [Gradient reads]): the plain slot, lent in
        one C++ pass (``GradientPath.lend_slots``), or, for a gradient that came sparse, its sparse form, set by
        hand. ``watched_only``: only where ``p.grad`` is the watched alias now (a tensor user code put there stays);
        else whatever it holds. ``sparse_form=False``: the plain slot for those too, for work that writes the
        gradients in place (a sparse form holds a copy of the slot's rows: a write to it would be lost).
        Afterwards each ``p.grad`` holds what it held before."""
        buffers, params, path = self._buffers, self.params, self._backward.path
        if (buffers.steps_on_slots or not sparse_form) and not skip:  # no Python per tensor
            lent, by_hand = indices, ()
        else:
            special, watched = buffers.not_as_is() if sparse_form else set(), buffers.watched
            lent = [i for i in indices if i not in skip and i not in special]
            by_hand = [i for i in indices if i in special and i not in skip
                       and (not watched_only or params[i].grad is watched[i])]
        saved = [params[i].grad for i in by_hand]
        path.lend_slots(lent, watched_only=watched_only)
        try:
            for i in by_hand:
                params[i].grad = buffers.for_step(i)
            yield
        finally:
            path.return_slots()
            for i, grad in zip(by_hand, saved):
                params[i].grad = grad

    def step_base(self) -> None:
        """The wrapped step as it is, over every parameter, nothing reduced (a fresh optimizer's state made
        from zero gradients: ``Core.step``)."""
        self._base_step(self._optimizer())

    def zero_grad_base(self, set_to_none: bool) -> None:
        self._base.zero_grad(self._optimizer(), set_to_none=set_to_none)

    def _wait(self, todo, on_stream: bool = False) -> None:
        """Until the reduced gradients of ``todo`` are final. ``on_stream``: on a CUDA device, the current stream
        waits for them and the host only until their blocks are enqueued (Note [Stream-ordered waits] in
        csrc/core/final_gate.h), so only kernels on that stream, or what syncs with it, may read them."""
        if self._lazy.reduced:
            return  # a backward that started since has waited for every block
        engine, timeout = self._engine, float(self._config.timeout_s)
        with profiled("dcredit_opt::wait"):
            try:
                if on_stream:
                    engine.wait_tensors_on_stream(list(todo), timeout)
                else:
                    engine.wait_tensors(list(todo), timeout)
            except (RuntimeError, TimeoutError) as e:
                i = next((i for i in todo if not engine.tensor_done(i)), todo[0])
                raise at_rank(e, f"phase 2 (after step()), waiting for the reduced gradient of "
                                 f"'{self.names[i]}' (tensor {i}) to apply its update") from e

    def apply(self, indices, pending_only: bool = False) -> None:
        """Wait for tensors ``indices`` and run the wrapped step on those still pending, with the
        hyperparameters of the ``step()`` that deferred them. ``pending_only``: the caller's ``indices`` hold each
        tensor once, every one pending (``LazyUpdates.done_ahead`` gives them so), and are taken as they are."""
        lazy, path = self._lazy, self._backward.path
        pending = lazy.pending
        if pending_only:
            todo = indices
        else:
            unique = dict.fromkeys(indices)
            todo = list(compress(unique, map(pending.__getitem__, unique)))  # in C: no Python per tensor
        if not todo:
            return
        # The wrapped step reads the parameters it updates: not reads to guard. It reads no other optimizer's
        # (it updates each parameter on its own, or we would not have deferred), unless a step hook came since.
        with lazy.guard.paused(self._others_blind) as paused:
            if lazy.deferred:
                lazy.check_stale(todo, path)
            self._wait(todo, on_stream=True)  # the wrapped step's kernels go on the current stream
            if lazy.first_apply():
                # Every pending slot, so that a write between step() and the next forward stops us before
                # any update.
                self._buffers.check_writes(indices_of(pending), "the lazy step")
            else:
                self._buffers.check_writes(todo, "the lazy step")
            with profiled("dcredit_opt::apply"):
                self._run_wrapped_step(todo)
            if len(todo) == lazy.npending:
                paused.stay_off()  # nothing left to guard (the common case: all at the forward's leader)
        lazy.applied(todo, path)

    def _others_blind(self) -> str:
        """``paused(others)`` for the wrapped step of deferred updates (Note [Several guards] in reads.py): the
        other optimizers' guards whose parameters share no memory with ours see nothing of it, unless a step hook
        (which may read anything) came since the step was deferred."""
        return "" if separable.has_step_hooks(self._optimizer()) else "apart"

    def _run_wrapped_step(self, todo) -> None:
        params = self.params
        optimizer = self._optimizer()
        groups = optimizer.param_groups
        self._backward.add_rows(todo)
        unused = set(self._backward.drop_unused_grads(todo))  # and they stay None, as under DDP
        saved_params = [g["params"] for g in groups]
        snapshot = self._lazy.snapshot
        saved_hyper = [{k: g[k] for k in snap} for g, snap in zip(groups, snapshot)]
        # Every update at once (the common case where communication ends before the next forward): the
        # groups as they are, when they hold exactly our parameters, still (a parameter put in a group since
        # step() is not stepped here; the next step() refuses it).
        whole = (len(todo) == len(params) and self._whole_groups and len(groups) == len(snapshot)
                 and groups_hold(groups, self._wrapped_groups))
        members = None if whole else [[] for _ in groups]
        if not whole:
            for i in todo:
                members[self._group_of[i]].append(params[i])
        try:
            for gi, (g, snap) in enumerate(zip(groups, snapshot)):
                if not whole:
                    g["params"] = members[gi]
                g.update(snap)
            for g in groups[len(snapshot):]:  # added after wrapping: refused at the next step()
                g["params"] = []
            with self.slots_lent(todo, watched_only=False, skip=unused):  # the unused stay None
                self._step_outside_forward(optimizer)
        finally:
            for g, ps in zip(groups, saved_params):
                g["params"] = ps
            for g, hyper in zip(groups, saved_hyper):
                g.update(hyper)

    def _step_outside_forward(self, optimizer) -> None:
        """The wrapped step of deferred updates, in the context ``step()`` gave them, not the forward's where
        they are applied: under autocast the optimizer's own arithmetic would run in low precision (Adafactor's
        ``row_var @ col_var``); under inference mode the state it creates (a parameter's first update) would be
        inference tensors, which its next update outside inference mode may not change; and the forward's
        dispatch modes would take its operations for the forward's (selective activation checkpointing caches
        their outputs, and its recompute would be handed them)."""
        device = self._device_type
        modes = torch._C._len_torch_dispatch_stack()
        if not (modes or torch.is_autocast_enabled(device) or torch.is_inference_mode_enabled()):
            self._base_step(optimizer)
            return
        with contextlib.ExitStack() as outside:
            if modes:
                outside.enter_context(_disable_current_modes())
            outside.enter_context(torch.inference_mode(False))
            outside.enter_context(torch.autocast(device, enabled=False))
            self._base_step(optimizer)

    def _base_step(self, optimizer) -> None:
        """The wrapped class's own ``step()``; meanwhile ``opt.state`` is in place, read as it is (Note [Reading
        the state])."""
        aside = show_state(optimizer)
        try:
            self._base.step(optimizer)
        finally:
            if aside:
                hide_state(optimizer)

    def apply_on_read(self, indices, finals) -> None:
        """A read of pending parameters before the place learned for them (Note [Guarded reads] in reads.py):
        their updates are applied now, before the read, so it sees what a synchronous step gives. ``finals()``:
        the engine's, per tensor (where the leader's hook did not run: Note [Resting hooks])."""
        lazy = self._lazy
        if lazy.leader_missed():
            # Before the leader's hook ran (Note [Resting hooks]): a forward that began elsewhere reads here what
            # the asleep hook of its apply point would have applied, and that is applied (an early read shows
            # again after the next step(), with every hook awake).
            log.debug("dcredit_opt: a pending parameter was read before the module where the first iteration's "
                      "forward began; every apply point's hook wakes at step() from now on")
            self.apply_at(tuple(dict.fromkeys((*indices, *lazy.applied_with(indices[0])))), finals)
            return
        i = indices[0]
        self._notices.tell("early read", f"dcredit_opt: parameter '{self.names[i]}' was read before the place "
                                         f"where the first iteration read it first ({self._lazy.reader_of(i)}), so "
                                         "its update was applied at that read: the result is the same, but that "
                                         "update did not overlap the forward. Said once.")
        self.apply(indices)

    def apply_at(self, own, finals) -> None:
        """At an apply point whose module first reads tensors ``own``: their updates, and those of tensors read
        later whose reduced gradients are final already (``finals()``, per tensor: the engine's; Note [Lazy
        step]). On a GPU, final is enqueued (Note [Stream-ordered waits]).

        Where some of ``own`` are not final yet, they are waited for first, and the others are asked about
        after that wait: the blocks that ended meanwhile are applied in the same call, not in a second one at
        the next apply point (each call costs tens of microseconds of bookkeeping)."""
        lazy = self._lazy
        done = finals()
        if not lazy.reduced:
            pending = lazy.pending
            if own:
                waits = [i for i in own if pending[i] and not done[i]]
            else:  # the leader (Note [Resting hooks]): the first update read, where the forward reads it at once
                first = lazy.first_to_wait_for(self._tally.rows)
                waits = [first] if first is not None and not done[first] else []
            if waits:
                with lazy.guard.paused():
                    self._wait(waits, on_stream=True)
                done = finals()
        ahead = lazy.done_ahead(own, self._tally.rows, done)
        if own:
            self.apply(own + ahead)
        else:  # the leader: what done_ahead found, as it is
            self.apply(ahead, pending_only=True)

    def may_defer(self, plan, replaced, eager_reason) -> bool:
        """Whether this step()'s updates may wait for their first read (Note [Lazy step]). ``eager_reason``:
        why the core needs every update now (a plan switch, profiling, synchronize()), or None."""
        if not (plan.overlap_forward and self._config.overlap_forward and self._lazy.learned):
            return False
        if replaced:
            # The user's tensor may change after step() (it is theirs): the wrapped step uses it now.
            self._notices.tell("replaced", f"dcredit_opt: p.grad of '{self.names[replaced[0]]}' was replaced by "
                                           "another tensor after backward(); a step that uses such gradients "
                                           "applies every update in step(), without overlap "
                                           "(Note [Replaced gradients]). Said once.")
            return False
        if eager_reason:
            return False
        shared, counter = self._backward.path.first_shared()
        if counter:  # Note [Shared version counters]
            self._notices.tell("shared counter", f"dcredit_opt: parameter '{self.names[shared]}' shares its version "
                                                 "counter with another tensor (parameters made as "
                                                 "nn.Parameter(buffer[i:j]) share the buffer's): an update applied "
                                                 "in the forward would move the counter of tensors autograd saved, "
                                                 "so every update is applied in step(), without overlap. Give each "
                                                 "parameter a counter of its own (p.data = buffer[i:j].view_as(p)) "
                                                 "to overlap them (Note [Shared version counters] in lazy.py). "
                                                 "Said once.")
            return False
        if shared >= 0:  # Note [Hidden writes]
            self._notices.tell("hidden writes", f"dcredit_opt: parameter '{self.names[shared]}' shares its memory "
                                                "with another tensor kept past step() (a detached alias, a view, a "
                                                "NumPy array over it, a kept state_dict()): code that is no torch "
                                                "operation may write it unseen, so while that lasts every update "
                                                "is applied in step(), without overlap (Note [Hidden writes] in "
                                                "lazy.py). Said once.")
            return False
        reason = separable.why_eager(self._base, self._optimizer(), self._config.lazy_step)
        if reason is not None:
            self._notices.tell(reason, f"dcredit_opt: updates are applied in step() (no overlap with the next "
                                       f"forward), because {reason}")
            return False
        return True

    # Note [Hidden writes]
    # The read guard (Note [Guarded reads] in reads.py) sees torch operations.
    # A NumPy array over a parameter (``p.detach().numpy()``), or memory handed
    # to another library, is written by code that is none: a clip through the
    # array after step() would land before the deferred update instead of
    # after it, and the update would undo it, silently. Such a writer needs a
    # tensor other than the parameter over the parameter's storage (the
    # array keeps the detached tensor it was made from), and so does any view
    # or alias a script keeps. So step() counts each parameter's storage
    # users (one C++ loop, ``GradientPath.first_shared``): where a tensor
    # other than our parameters holds one (parameters laid out over one
    # buffer hold it once each), the step is eager, and a notice says so
    # once. A kept torch alias, which the guard would have handled, costs the
    # overlap only while it lives; our own machinery keeps none.

    # Note [Shared version counters]
    # Parameters made as nn.Parameter(buffer[i:j]) (not p.data = buffer[i:j],
    # which keeps each parameter's own) share the buffer's version counter.
    # An update applied in the forward, after autograd saved another of them
    # for backward, would move that one's counter too, and autograd would
    # refuse the backward; and a write the guard cannot see would hide among
    # our own (Note [Unseen parameter writes] in gradient_path.cc). So while
    # any parameter's counter is shared, which the same C++ loop tells
    # (``GradientPath.first_shared``), the step is eager, said once. A kept
    # alias shares a counter too, and holds the storage: Note [Hidden writes]
    # says that first.

    # ---- the checks ---------------------------------------------------------------

    def check_groups(self) -> None:
        """Parameters added to (or removed from) the wrapped optimizer after wrapping: their gradients would
        not be reduced, or their updates not made. Refused at the next ``step()``, before anything is applied."""
        groups = self._optimizer().param_groups
        if groups_hold(groups, self._wrapped_groups):
            return
        known = {id(p): name for name, p in zip(self.names, self.params)}
        known.update((id(p), name) for name, p in self._frozen)
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

    def check_frozen(self) -> None:
        """A parameter frozen at wrap time and unfrozen since would be stepped with its local gradient."""
        for name, p in self._frozen:
            if p.grad is not None:
                raise DCreditError(
                    f"parameter '{name}' had requires_grad=False when the optimizer was wrapped, so dcredit_opt "
                    "does not reduce its gradient, but it has one now (it was unfrozen later): its update would "
                    "use this rank's gradient alone. Nothing was applied. Build the DistributedOptimizer after "
                    "unfreezing it (freeze by leaving its gradient None instead), or set its .grad to None")

    def check_finite(self) -> None:
        """Config.check_finite: wait for every block; on NaN or Inf refuse the whole step.

        The check comes before any update, so a refused step changes no
        parameter and no optimizer state (a lazy check at each layer's forward
        would have updated the layers before it). Every rank sees the same
        reduced values, so every rank refuses the same step.
        """
        self._backward.wait_final("step(), waiting for every block (Config.check_finite)")
        bad = self._buffers.first_non_finite(self._tally.rows_only())
        if bad is None:
            return
        self._backward.end()
        raise DCreditError(f"the reduced gradient of '{self.names[bad]}' holds NaN or Inf (Config.check_finite "
                           "is on): step() skipped, no parameter or optimizer state was changed; the reduced "
                           "gradients stay in p.grad")

    def scaled_skip(self, scaler) -> bool:
        """``GradScaler.step(opt)``: unscale the *reduced* gradients; True if the step must be skipped.

        Every rank then sees the same Inf/NaN, so every rank skips the same
        steps and the scaler's scale stays the same everywhere. The scaler
        reads and writes the gradients, so they must be final first.
        """
        from torch.amp.grad_scaler import OptState

        optimizer, backward = self._optimizer(), self._backward
        stage = scaler._per_optimizer_states[id(optimizer)]["stage"]
        if stage is OptState.UNSCALED and not backward.synchronized:
            self._check_unscaled()
        backward.wait_final("step(), waiting for every block before GradScaler unscales them")
        backward.set_synchronized(True)  # final: the scaler's own writes below are expected
        if stage is OptState.READY:
            # Final, and the scaler's writes expected. It unscales in place, so it gets the slots themselves, dense
            # also where the step takes a sparse form (a copy of the slot's rows, whose unscaling would be lost):
            # the step then takes the unscaled rows, and the check for Inf/NaN sees them.
            with self.slots_lent(range(len(self.params)), sparse_form=False):
                scaler.unscale_(optimizer)
        if not sum(float(v.item()) for v in scaler._found_inf_per_device(optimizer).values()):
            return False
        backward.end()
        backward.set_synchronized(False)
        return True

    def _check_unscaled(self) -> None:
        """``scaler.unscale_(optimizer)`` ran before ``step()`` without ``synchronize()``: every gradient of ours
        must have been unscaled then, after its reduction (Note [A scaler's unscale_] in watched.py)."""
        backward, buffers = self._backward, self._buffers
        unscaled = backward.unscaled
        missed = [i for i, p in enumerate(self.params)
                  if i not in unscaled and p.grad is not None and buffers.is_ours(i, p.grad)]
        if missed:  # those no rank used hold zeros, which step() drops (Note [Global usage])
            unused = set(self._tally.unused_everywhere(missed))
            missed = [i for i in missed if i not in unused]
        if missed:
            raise DCreditError(
                f"scaler.unscale_(optimizer) did not unscale the reduced gradient of parameter "
                f"'{self.names[missed[0]]}' (it had none on this rank when the scaler listed the gradients: this "
                "rank's backward reached none of this optimizer's tensors, while another rank's did, "
                "Note [Missed here] in core.py): it would be stepped still scaled here, while the other ranks "
                "unscaled theirs. Nothing was applied. Call optimizer.synchronize() before "
                "scaler.unscale_(optimizer), then `with optimizer.skip_synchronize(): scaler.step(optimizer)`")

    # ---- learning where parameters are first read (Note [First read]) ---------------

    def end_learning(self, recorder, closed: bool):
        """Leave the tracer (on the training thread) and install the apply points it found. Returns the tracer
        where it has just learned them (for what else it saw), else None."""
        tracer = self._lazy.end_learning(recorder, closed)
        if tracer is not None:
            self._refuse_renorm(tracer)
            self._propose_rows(tracer)
        return tracer

    def _refuse_renorm(self, tracer) -> None:
        """An embedding with ``max_norm`` renormalises, in place, in its forward, the rows its batch looks up: under
        data parallelism each rank renormalises the rows of its own batch only, so the ranks' weights drift apart,
        and none is what synchronous training on the global batch gives. Refused at the first ``step()`` with more
        than one rank, before its updates."""
        if runtime.size() < 2 or not tracer.renormed_by:
            return
        i, module = next(iter(sorted(tracer.renormed_by.items())))
        raise DCreditError(
            f"parameter '{self.names[i]}' is looked up by an {module}, which renormalises in place, in every forward, "
            "the rows that this rank's batch looks up: each rank renormalises other rows, so the ranks' weights "
            "would drift apart, unlike synchronous training on the global batch. Nothing was applied. Drop "
            "max_norm, and where the rows must stay bounded, renormalise them after optimizer.step() on every rank "
            "alike (with torch.no_grad(): torch.embedding_renorm_(weight, ids, max_norm, 2.0) with the ids of "
            "every rank's batch, or weight.renorm_(2, 0, max_norm) for all rows)")

    def _propose_rows(self, tracer) -> None:
        """What this rank proposes for Note [Embedding rows] (in rows.py), from what the tracer saw; every
        rank's proposal travels in the tally, and only what all propose is taken."""
        if not (self._config.embedding_rows and runtime.size() > 1 and self._backward.passes == 1
                and self._backend.exchanges_rows):
            return
        self._tally.propose_rows(tracer, {t for g in self._horovod_groups or () for t in g})


PLAIN_HYPER = frozenset({float, int, bool, str, type(None)})  # hyperparameters that cannot change in place


def held_params(groups) -> list[tuple]:
    """The parameters of each group, as they are now."""
    return [tuple(g["params"]) for g in groups]


def groups_hold(groups, held: list[tuple]) -> bool:
    """Whether ``groups`` hold the parameters ``held`` (``held_params``), the same objects in the same order. Run
    at every ``step()`` and apply: it compares the groups' lists of pointers only, touching no parameter."""
    return len(groups) == len(held) and all(same_objects(g["params"], ps) for g, ps in zip(groups, held))


def same_objects(a, b) -> bool:
    """Whether sequences ``a`` and ``b`` hold the same objects in the same order (``is``, never ``==``: a
    tensor's ``==`` is elementwise)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def copy_hyper(group: dict) -> dict:
    """A group's hyperparameters as of now: tensors copied, so an in-place change later does not leak in."""
    plain = PLAIN_HYPER  # numbers and flags as they are, without a call each (every step() copies them)
    return {k: v if type(v) in plain else _detached_copy(v) for k, v in group.items() if k != "params"}


def _detached_copy(v):
    if type(v) in PLAIN_HYPER:
        return v
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if type(v) is tuple and all(type(x) in PLAIN_HYPER for x in v):
        return v  # Adam's betas: nothing in it can change in place
    if isinstance(v, (tuple, list)):
        return type(v)(_detached_copy(x) for x in v)
    return v


def watch_module_hooks_when_compiled() -> None:
    """Note [Compiled models]: make Dynamo recompile a model when module hooks are added or removed.

    The apply points are forward pre-hooks, installed after the first
    iteration, when a compiled model may already have a graph. By default
    Dynamo does not guard on module hooks (``skip_nnmodule_hook_guards``),
    so that graph would go on running without them, and every update would
    be applied too late (the stale-read check would then stop the job). With
    the guard, the model recompiles once when our hooks appear; each hook is
    ``torch.compiler.disable``-d, so it runs eagerly at a graph break before
    the module's compiled code. Set when an optimizer is built, before the
    first forward compiles anything.
    """
    try:
        import torch._dynamo.config as dynamo_config
    except ImportError:  # a torch without Dynamo: nothing is compiled
        return
    if hasattr(dynamo_config, "skip_nnmodule_hook_guards"):
        dynamo_config.skip_nnmodule_hook_guards = False


class Keeper:
    """How the model's hooks reach their optimizer's core: weakly, except while updates wait.

    A script may drop its optimizer right after a lazy ``step()`` (``del
    opt``, or ``opt = DistributedOptimizer(...)`` again): the updates it
    deferred must still be applied where the next forward first reads them.
    So, while any update is pending, the hooks hold the optimizer; once none
    is, only weakly, and a dropped optimizer is then freed (and its finalizer
    drains and closes its channels).
    """

    __slots__ = ("_ref", "strong")

    def __init__(self, optimizer):
        self._ref = weakref.ref(optimizer)
        self.strong = None

    def __call__(self):
        """The optimizer's core (``core.py``), or None once the optimizer is gone."""
        return core_of(self.strong if self.strong is not None else self._ref())

    def hold(self, optimizer) -> None:
        """Updates wait: the hooks keep ``optimizer``, and its ``state`` is behind the wrapper's door (Note
        [Reading the state])."""
        self.strong = optimizer
        hide_state(optimizer)

    def let_go(self) -> None:
        """Nothing waits (or the optimizer closes): its ``state`` is out in the open again, and the hooks hold
        it only weakly."""
        if self.strong is not None:
            show_state(self.strong)
            self.strong = None


# Note [Reading the state]
# ``opt.state`` (momentum, Adam's moments and step) must read as synchronous
# training has it: between a lazy ``step()`` and the forward that applies its
# updates, reading, resetting or clearing it applies what is pending first.
# The wrapped class's own ``step()`` reads ``self.state[p]`` once per
# parameter, and a property would run Python for each of those reads. So
# ``state`` is a non-data descriptor (``PendingState``): while nothing is
# pending the dict sits in the instance's ``__dict__`` and shadows it, and
# a read costs what it costs on any optimizer. While updates wait (``Keeper
# .hold``), the dict is moved aside, so a read reaches the descriptor, which
# applies them (``Keeper.let_go`` puts it back). The wrapped step sees it in
# place (``Stepper._base_step``). ``opt.state = d`` meanwhile applies them
# first too (``_Wrapper.__setattr__``): in plain torch the step that came
# before used the old dict, and so do they.
_HIDDEN_STATE = "_dc_state_while_pending"


class PendingState:
    """The wrapper's ``state`` where the dict is aside: what is pending is applied, then the dict is read
    (Note [Reading the state])."""

    def __get__(self, optimizer, owner=None):
        if optimizer is None:
            return self
        core = core_of(optimizer)  # None while the wrapper is being built
        if core is not None and core.lazy.npending:
            core.apply_pending()
        d = optimizer.__dict__
        if "state" in d:
            return d["state"]
        if _HIDDEN_STATE in d:  # not applied (the optimizer closed): the dict as it is
            return d[_HIDDEN_STATE]
        raise AttributeError(f"'{type(optimizer).__name__}' object has no attribute 'state'")


def hide_state(optimizer) -> bool:
    """``optimizer.state`` aside, so that reads reach ``PendingState``; False where it was aside already."""
    d = optimizer.__dict__
    if "state" not in d:
        return False
    d[_HIDDEN_STATE] = d.pop("state")
    return True


def show_state(optimizer) -> bool:
    """``optimizer.state`` back in place; False where it was not aside. A dict put in place meanwhile (the
    wrapped ``load_state_dict()`` sets ``__dict__`` directly) is the one that stays."""
    d = optimizer.__dict__
    if _HIDDEN_STATE not in d:
        return False
    hidden = d.pop(_HIDDEN_STATE)
    d.setdefault("state", hidden)
    return True


def core_of(optimizer):
    """The core of a ``DistributedOptimizer`` (``core.py``; the wrapper's one field of its own), or None for
    None or any other optimizer."""
    return getattr(optimizer, "_dc", None)


def weak_forward_hook(keeper: Keeper) -> _ForwardHook:
    _ForwardHook.prepare()
    return _ForwardHook(keeper)


def weak_apply_hook(keeper: Keeper) -> _ApplyHook:
    return _ApplyHook(keeper)


# ---- the model's hooks, picklable ----------------------------------------------------------------------------
#
# Note [Pickled hooks]: a model is pickled whole (torch.save(model)) or
# deep-copied (an EMA copy, a frozen teacher made from the student) while it
# carries our hooks, so they are objects of module-level classes, never
# closures. A copy must not carry the optimizer: it is not the model the
# optimizer updates, and a pickle cannot hold the optimizer's channels. Pickle
# has no way for a value of the hook dicts to drop its own key, so each hook
# pickles (and deep-copies, through the same __reduce__) as an inert hook:
# state-dict ones do nothing; a forward one removes itself (and its kind) from
# its module at the copy's first forward run eagerly, so that a copy trained or
# served with plain torch goes back to the hook-free fast path (a compiled
# copy traces it away: no cost either). Inert state-dict
# hooks stay (called only at state_dict()/load_state_dict(), they cost
# nothing per step); a copy wrapped by a new optimizer sheds every inert hook
# where it installs its own (LazyUpdates.end_learning), so save/load/wrap cycles do
# not pile them up. Loading such a pickle imports dcredit_opt (these class
# names are in it), as a whole-module pickle imports every class it holds.
# The values a pickle holds are those after the pending updates: the
# pickler reads each parameter's storage, a read the guard applies first
# (Note [Guarded reads] in reads.py).


_is_compiling = torch.compiler.is_compiling


class _ForwardHook:
    """Forward pre-hook at an apply point (Note [Lazy step]): reaches its optimizer through the keeper."""

    __slots__ = ("keeper",)
    _run = None  # _before_forward, compiler-disabled: set by prepare(), not at import (Dynamo loads slowly)

    def __init__(self, keeper: Keeper):
        self.keeper = keeper

    @classmethod
    def prepare(cls) -> None:
        # Note [Compiled models]: a compiled model runs the hook eagerly, at a graph break.
        if cls._run is None:
            cls._run = staticmethod(torch.compiler.disable(_before_forward))

    def __call__(self, module, args):
        # Note [Guard cost]'s counterpart for the apply points: once nothing is pending, the first module's
        # forward to ask sends the hooks to rest (Note [Resting hooks]); a compiled model still takes the call
        # through the compiler-disabled wrapper, which keeps them for good.
        if _is_compiling():
            self._run(self.keeper, module, True)
            return
        core = self.keeper()
        if core is None:
            return
        lazy = core.lazy
        if not lazy.npending and not core.records_forward():
            lazy.rest()
            return
        self._run(self.keeper, module, False)

    def __reduce__(self):
        return _InertForwardHook, ()


def _before_forward(keeper: Keeper, module, compiled: bool) -> None:
    core = keeper()
    if core is not None:
        if compiled:
            core.lazy.ran_compiled()
        core.before_forward(module)


class _ApplyHook:
    """``state_dict()`` / ``load_state_dict()`` pre-hook: what is pending is applied first."""

    __slots__ = ("keeper",)

    def __init__(self, keeper: Keeper):
        self.keeper = keeper

    def __call__(self, module, *args, **kwargs):
        core = self.keeper()
        if core is not None:
            core.apply_pending()

    def __reduce__(self):
        return _InertApplyHook, ()


class _InertForwardHook:
    """A copy's forward pre-hook (Note [Pickled hooks]): at its first forward, removes itself."""

    __slots__ = ()

    def __call__(self, module, args):
        # Called from a snapshot of the hook dict: removing entries here is safe.
        if not torch.compiler.is_compiling():
            _drop_inert_forward_hooks(module)

    def __reduce__(self):
        return _InertForwardHook, ()


class _InertApplyHook:
    """A copy's state-dict pre-hook (Note [Pickled hooks]): does nothing."""

    __slots__ = ()

    def __call__(self, module, *args, **kwargs):
        return None

    def __reduce__(self):
        return _InertApplyHook, ()


def _is_inert(hook) -> bool:
    hook = getattr(hook, "hook", hook)  # load_state_dict pre-hooks are wrapped (torch's _WrappedHook)
    return isinstance(hook, (_InertForwardHook, _InertApplyHook))


def _drop_inert_forward_hooks(module: torch.nn.Module) -> None:
    hooks = module.__dict__.get("_forward_pre_hooks")
    if not hooks:
        return
    for key in [k for k, h in hooks.items() if _is_inert(h)]:
        del hooks[key]
        for extra in ("_forward_pre_hooks_with_kwargs", "_forward_pre_hooks_always_called"):
            module.__dict__.get(extra, {}).pop(key, None)


def drop_inert_hooks(module: torch.nn.Module) -> None:
    """Remove the inert hooks a copied model carries (Note [Pickled hooks]). Not from inside a state-dict
    hook of ``module`` (those dicts are iterated then): from ``step()``, where apply points are installed."""
    _drop_inert_forward_hooks(module)
    for name in ("_state_dict_pre_hooks", "_load_state_dict_pre_hooks"):
        hooks = module.__dict__.get(name)
        if hooks:
            for key in [k for k, h in hooks.items() if _is_inert(h)]:
                del hooks[key]


def holds_any(module: torch.nn.Module, ours: set) -> bool:
    """Whether ``module`` or a module below it holds a parameter whose id is in ``ours``."""
    return any(p is not None and id(p) in ours for m in module.modules() for p in m._parameters.values())
