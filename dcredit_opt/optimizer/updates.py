"""Which updates wait for their first read, and where each is applied.

:class:`LazyUpdates` owns that state; the optimizer runs the wrapped step on
what it says (``lazy.py``), and the model's hooks reach the optimizer through
its keeper.

Note [Lazy step]
----------------
With phase 2 on, ``step()`` flushes the scheduler and returns at once: the
remaining blocks are still travelling, highest priority (nearest the input)
first. The update of each parameter is applied later, on the main thread,
just before the first read of that parameter in the next iteration, by
running the wrapped optimizer's own ``step()`` on that parameter with the
hyperparameters that were in force when ``step()`` was called (copied:
a tensor learning rate that a scheduler changes in place does not leak in),
and outside the autocast, inference mode and dispatch modes of the forward
it is applied in (``Stepper._step_outside_forward`` in ``lazy.py``).
Where the first read happens is learned once (Note [First read] in
``reads.py``): the update is applied in a forward pre-hook of the module
whose forward reads the parameter first, and in ``step()`` itself for a
parameter read outside any forward (an EMA right after ``step()``) or not
read while we watched. Each module applies the updates it reads first, and
with them, in the same wrapped step, the updates of parameters read later
whose reduced gradients are already final (in first-read order, up to the
first that is not): where communication has finished by the time the next
forward starts (one GPU, a fast network, a compute-bound model) one wrapped
step then applies nearly everything, instead of one per module, each with
the optimizer's Python and kernel launches. Applying an update earlier than
its first read changes nothing the training sees: the update is the one
synchronous training makes (same gradient, same hyperparameters), the
parameter is not read in between, and the stale-read checks below run on
it at that apply as they would have at its own. Optimizer state therefore
stays exactly what a synchronous step would have made. ``synchronize()``,
``state_dict()``/``load_state_dict()`` of the optimizer and of every module
the forward ran, a read of the optimizer's ``state`` (its momentum logged,
reset or cleared), and ``step()`` apply what is pending first.

The lazy step defers only what it can prove safe, and checks the rest:

- Only optimizers whose update is per parameter (``separable.py``), with no
  step hooks; any other steps eagerly, with one notice saying why.
- An early read: a read of a pending parameter before the module we
  learned (another branch, a peek in the parent, code between ``step()`` and
  the next forward) applies its update first (Note [Guarded reads] in
  ``reads.py``). Behind that, a graph read the guard could not see (another
  thread, compiled code) shows in the parameter's gradient accumulator (Note
  [Graph reads] in ``csrc/torch/gradient_path.cc``): every apply checks that
  first, and so does the start of the backward, for updates still pending
  then, before the rank launches anything: a ``DCreditError`` naming the
  parameter. Last line: a pending parameter's tensor hook raises before
  autograd touches the gradient slot.
- A write to a pending parameter that the guard cannot see first
  (``p.set_(...)``, an in-place op in compiled code or on another thread)
  moves its version counter: the same checks raise, naming it, before the
  update would land on the changed value (Note [Unseen parameter writes] in
  ``csrc/torch/gradient_path.cc``).
- A gradient written while it is being reduced (``clip_grad_norm_``,
  ``model.zero_grad(set_to_none=False)``, user code between ``backward()``
  and ``step()`` or between ``step()`` and the next forward) moves its slot's
  version counter; ``step()`` and every apply compare it with the version
  taken when the gradient was handed to the scheduler, and raise before
  applying anything. Each slot is a tensor of its own over the buffer's
  storage (not a view), so it has its own counter, and the collectives,
  which write the blocks through other tensors, never move it.
- ``GradScaler.step(opt)`` passes the scaler to ``step()``
  (``_step_supports_amp_scaling``): the gradients are reduced first, then
  unscaled and checked for Inf/NaN, so every rank skips the same steps.
  ``scaler.unscale_(opt)`` before it unscales the reduced gradients (Note
  [A scaler's unscale_] in ``watched.py``).

Note [Resting hooks]
--------------------
A module with a forward pre-hook leaves torch's fast call path: each of its
forwards then costs a few microseconds more, hook or no hook (3.5 us per
module measured on the GPT-shaped model, before our hook's own work). So
the apply points' hooks are in their modules only while they may have work,
and ``step()`` wakes as few as it can:

- The leader. While learning the apply points we also note the module
  whose forward began first, at the top (the model itself, usually): the
  forward's entry. Its hook applies, before the forward's first operation,
  every pending update whose reduced gradient is final already, in
  first-read order up to the first that is not (as every apply point does
  for the updates ahead of its own). ``step()`` wakes only this hook. Where
  communication has ended by then (one GPU, a fast network, a
  compute-bound model), it applies everything, the read guard leaves the
  stack before the forward's first operation, and no other module is
  touched; else it wakes every apply point's hook (first among the
  module's pre-hooks, where they were registered) and the forward goes on
  as below. Where the first forward read its first update within a few
  operations of its beginning (``LEADER_WAITS_WITHIN``: positions made with
  ``torch.arange``, an embedding or a stem layer first), the forward would
  wait for that update at once anyway: the leader waits for it itself and
  applies, in the same call, what has ended meanwhile (usually everything:
  the last blocks, released at the flush, hold the input side's
  gradients), so the other hooks wake only where something is still in
  flight after that. A forward that runs a while before its first update
  (a frozen stem first) goes on overlapping the blocks: there the leader
  waits for nothing. Waking every hook and taking them out again cost
  40-50 us per iteration on a 2-core machine, in most iterations of some
  runs (the last blocks not done when the forward began).
- Every apply point. Its module applies what it reads first, and the first
  hook to run once nothing is pending takes them all out again, and the
  read guard off the mode stack (``rest``).

A forward that does not begin at the leader (a submodule called on its own,
another model first) meets the guard at its first read of a pending
parameter: the guard applies what that parameter's apply point would have,
and every apply point's hook wakes for the rest of that forward. After two
such forwards in a row, ``step()`` wakes them all from then on. The
hooks stay while anything records the forward (profiling, the timeline),
and for good once a hook ran inside compiled code: Dynamo guards on module
hooks (Note [Compiled models] in ``lazy.py``), and hooks that come and go
within a forward would recompile it.
"""

from __future__ import annotations

import weakref
from itertools import compress

from ..errors import DCreditError
from .buffers import clear, fill, indices_of, per_tensor
from .lazy import Keeper, copy_hyper, drop_inert_hooks, holds_any, weak_apply_hook, weak_forward_hook
from .reads import FirstReadTracer, PendingReadGuard


class LazyUpdates:
    """Owns the lazy step's state (Note [Lazy step]).

    ``pending`` (per tensor) and ``npending``: updates that a lazy ``step()``
    deferred, with the hyperparameters of that step (``snapshot``); the apply
    points the first iteration learned (Note [First read] in ``reads.py``):
    which module's forward applies which updates, in first-read order, and the
    tensors applied in ``step()`` itself (``eager``); the read guard (Note
    [Guarded reads]) and the keeper through which the model's hooks reach the
    optimizer, strongly only while updates wait.
    """

    def __init__(self, optimizer, names, params, notices):
        T = len(params)
        self.keeper = Keeper(optimizer)
        self.guard = PendingReadGuard(self.keeper)  # Note [Guarded reads] in reads.py
        # Flat memory (Note [Gradient state]): the C++ pre-hook reads it (Note [Gradient path]).
        self.pending = per_tensor(T, "B")
        self.npending = 0
        self.snapshot = None  # the hyperparameters of the step() that deferred the pending updates
        self.versions_checked = True  # the first apply after a lazy step() checks every pending slot
        self.reduced = False  # pending updates whose blocks a new iteration has already waited for
        self.deferred = False  # pending updates are lazy: a graph read of them before their apply is stale
        self.learned = False  # the apply points are known
        self.taken = 0  # step()s that took an iteration's reduced gradients to an update (Note [Same updates])
        self.eager = tuple(range(T))  # tensors applied in step() even when lazy
        self._everything = list(range(T))
        self._names = names
        self._params = params
        self._notices = notices
        self._tracer = None  # Note [First read]: watching the first iteration after the first step()
        self._apply_at = weakref.WeakKeyDictionary()  # module -> tensors whose update its forward applies
        self._read_order: tuple[int, ...] = ()  # lazily applied tensors in first-read order (Note [Lazy step])
        self._ahead = 0  # where the next pre-hook's look for finished updates starts in _read_order
        self._hooks = []
        # Note [Resting hooks]: the apply points' forward pre-hooks as (module's hook dict, key, hook), the
        # leader's among them (or None), and which are in their dicts now; a compiled model keeps them in for
        # good (Note [Compiled models]).
        self._apply_hooks: list = []
        self._leader = None
        self._leader_waits = False  # the leader waits for the first update read (Note [Resting hooks])
        self._missed = 0  # forwards in a row that did not begin at the leader
        self._awake = _ASLEEP
        self.compiled = False

    # ---- a step's updates, from step() to their apply -------------------------------------

    def take(self, groups, every_hook: bool) -> None:
        """``step()``: every tensor's update waits, with the hyperparameters in force now (copied). ``every_hook``:
        every apply point's hook wakes, not the leader's alone (something records the forward)."""
        self.taken += 1
        self.snapshot = [copy_hyper(g) for g in groups]
        self.wake(every_hook)
        fill(self.pending, 1)
        self.npending = len(self._params)
        self.reduced = False
        self.deferred = False

    def skip(self, indices) -> None:
        """No update for tensors ``indices`` this step (``p.grad = None`` after backward, as in plain torch);
        the first apply after this lazy step checks every pending slot."""
        for i in indices:
            self.pending[i] = False
        self.npending -= len(indices)
        self.versions_checked = False

    def defer(self, optimizer, path) -> None:
        """End of a lazy ``step()``: from here on, a graph that reads a pending parameter before its update is
        applied shows in that parameter's gradient accumulator (Note [Graph reads] in csrc/torch/gradient_path.cc);
        while updates wait, the model's hooks hold ``optimizer``. ``path``: the gradient path, which does that
        in C++ and tells the parameters' addresses (the guard's table is rebuilt when one moved)."""
        pending = self._everything if self.npending == len(self._params) else indices_of(self.pending)
        if pending:
            path.forget_graph_reads(pending)
            self.guard.arm(self._params, path.addresses(), self.pending)
        self.deferred = True
        self._ahead = 0
        if self.npending:
            self.keeper.hold(optimizer)  # the model's hooks keep it until the updates are applied

    def applied(self, todo, path) -> None:
        """The updates of ``todo`` were applied; their accumulators were dropped if they were deferred (Note
        [Graph reads]): ``path`` hooks the new ones."""
        if len(todo) == self.npending:
            clear(self.pending)
        else:
            for i in todo:
                self.pending[i] = False
        self.npending -= len(todo)
        if self.deferred:
            path.refresh(todo)
        if not self.npending:
            self.guard.remove()  # inside the guard's own handler it only disarms; it leaves at the next chance
            self.keeper.let_go()  # nothing waits: a dropped optimizer may go

    def all_applied(self) -> None:
        """An eager step applied every update."""
        clear(self.pending)
        self.npending = 0
        self.keeper.let_go()

    def apply_points(self) -> dict:
        """Module -> the tensors whose update its forward applies, as learned (Note [First read]); the leader
        alone applies none of its own (Note [Resting hooks]) and is not among them."""
        return {module: own for module, own in self._apply_at.items() if own}

    def own(self, module) -> tuple | None:
        """The tensors whose update ``module``'s forward applies (Note [Lazy step]); None where it is no apply
        point, () for the leader alone (Note [Resting hooks])."""
        return self._apply_at.get(module)

    def done_ahead(self, own, rows_of, done: bytes) -> tuple[int, ...]:
        """Pending tensors read later in the forward whose reduced gradients are final already (``done[i]``),
        in first-read order up to the first that is not: applied together with ``own`` (Note [Lazy step]).
        Tensors with embedding rows (``rows_of``) wait for their own module (their rows are gathered apart
        from the blocks). Each tensor once, none of ``own``, every one pending."""
        order, pending = self._read_order, self.pending
        k = self._ahead
        if not own and not rows_of and 0 not in done:
            # Every reduced gradient final (communication ended before this forward: the common case at the
            # leader): every pending tensor from here on; with every update pending, the order as it is.
            rest = order[k:]
            self._ahead = len(order)
            if self.npending == len(self._params):
                return rest
            return tuple(compress(rest, map(pending.__getitem__, rest)))
        found = []
        own = own if len(own) < 16 else frozenset(own)  # a module that reads hundreds: no scan per tensor
        while k < len(order):
            i = order[k]
            if pending[i] and i not in own and i not in rows_of:
                if not done[i]:
                    break
                found.append(i)
            k += 1
        self._ahead = k
        return tuple(found)

    # ---- reads that came too early ------------------------------------------------------------

    def check_stale(self, todo, path) -> None:
        """Before the apply of ``todo``: raise if, since the lazy ``step()``, autograd read one of them (that read
        saw the old value: Note [Graph reads]), or something the read guard could not see changed one in place
        (Note [Unseen parameter writes]); ``path``: the gradient path, which looks in C++."""
        i, written = path.first_stale(todo)
        if i >= 0:
            raise self.written_before_update(i) if written else self.read_before_update(i)

    def written_before_update(self, i: int) -> DCreditError:
        return DCreditError(
            f"parameter '{self._names[i]}' was changed in place after step() while its update from that step() still "
            "waited to be applied (Note [Lazy step]), by an operation dcredit_opt cannot see before it runs: "
            "p.set_(...), or an in-place torch operation in code compiled by torch.compile or run on another thread. "
            "Applied now, the update would land on the changed value, where "
            "synchronous training changes the updated one; it was not applied (nor any update applied with it). "
            "Change parameters between step() and the next forward in eager code on the training thread "
            "(with torch.no_grad(): p.copy_(x), p.mul_(...), or p.data = x), which applies the pending update "
            "first; or call optimizer.synchronize() after step() before such a change; or pass "
            "Config(lazy_step='off') to apply every update in step()")

    def stale_read(self, i: int) -> DCreditError:
        return self._read_too_early(
            i, "by this forward before its update from the last step() was applied (its gradient is being computed "
               "while the update still waits; dcredit_opt learned in the first iteration that it is first read "
               "{learned}, but this iteration read it earlier or elsewhere, e.g. another branch or a functional use). "
               "Nothing of this gradient was used.")

    def read_before_update(self, i: int) -> DCreditError:
        return self._read_too_early(
            i, "(by an op that autograd records) before its update from the last step() was applied, so that read "
               "used the old value. dcredit_opt learned in the first iteration that it is first read {learned}, and "
               "applies its update there, but this iteration read it earlier or elsewhere (another branch, a "
               "functional use, a read outside the model). It was not updated (nor any parameter of a module this "
               "forward has not reached yet).")

    def _read_too_early(self, i: int, what: str) -> DCreditError:
        """A pending parameter read before its update (``what`` says how, with ``{learned}`` for where it was
        learned), and the user's two ways out."""
        return DCreditError(
            f"parameter '{self._names[i]}' was read " + what.format(learned=self.reader_of(i)) + " Call "
            "optimizer.synchronize() after step() before such a forward, or pass Config(lazy_step='off') to apply "
            "every update in step()")

    def applied_with(self, i: int) -> tuple:
        """The tensors whose updates tensor ``i``'s apply point applies (``i`` among them), or () where it has none."""
        return self._apply_point_of(i)[1]

    def reader_of(self, i: int) -> str:
        module = self._apply_point_of(i)[0]
        return "outside any module's forward" if module is None else f"by the forward of a {type(module).__name__}"

    def _apply_point_of(self, i: int) -> tuple:
        """(module, the tensors it applies) for tensor ``i``'s apply point, or (None, ())."""
        return next(((module, own) for module, own in self._apply_at.items() if i in own), (None, ()))

    # ---- learning where parameters are first read (Note [First read]) ---------------------------

    def start_learning(self, optimizer) -> None:
        """Watch the next iteration's reads (until ``end_learning``), unless the apply points are known."""
        if self.learned or self._tracer is not None:
            return
        self._tracer = FirstReadTracer(self._params, optimizer)
        self._tracer.start()

    def stop_recording(self) -> None:
        """The first gradient of an iteration: the forward being watched has ended (possibly on autograd's
        device thread: the tracer is left in ``end_learning``)."""
        if self._tracer is not None:
            self._tracer.stop_recording()

    def end_learning(self, recorder, closed: bool):
        """Leave the tracer (on the training thread) and install the apply points it found. Returns the
        tracer when it has just learned them (for what else it saw), else None."""
        tracer = self._tracer
        if tracer is None or not tracer.close():
            return None
        self._tracer = None
        if self.learned or closed:
            return None
        self.learned = True
        if recorder is not None:
            for i, ns in tracer.first_read_ns.items():
                if tracer.readers[i] is not None:
                    recorder.on_forward((i,), ns)
        by_module: dict = {}
        eager = []
        for i in range(len(self._params)):
            ref = tracer.readers.get(i)
            module = ref() if ref is not None else None
            if module is None:
                eager.append(i)
            else:
                by_module.setdefault(module, []).append(i)
        me = self.keeper
        ours = {id(p) for p in self._params}
        # The leader (Note [Resting hooks]): the first module at the top of the forward that holds any of ours.
        entry = next((m for m in (ref() for ref in tracer.entries) if m is not None and holds_any(m, ours)), None)
        if entry is not None and by_module and entry not in by_module:
            by_module = {entry: [], **by_module}  # the leader applies no update of its own
        for module, own in by_module.items():
            self._apply_at[module] = tuple(own)
            drop_inert_hooks(module)
            hook = weak_forward_hook(me)
            # First among the module's pre-hooks, so that a user's pre-hook that reads the parameters (weight
            # normalisation's) sees them updated; and the place it goes back to when it wakes (Note [Resting hooks]).
            handle = module.register_forward_pre_hook(hook, prepend=True)
            self._hooks.append(handle)
            self._apply_hooks.append((module._forward_pre_hooks, handle.id, hook))
            if module is entry:
                self._leader = self._apply_hooks[-1]
        self._awake = _EVERY
        # model.state_dict()/load_state_dict() of any module the forward ran, or
        # below it, must see applied updates: of those, the ones that hold any
        # of our parameters (a teacher's forward ran too; its modules are not
        # ours to hook; a parent of both covers ours in its state_dict).
        hooked = set()
        for top in list(tracer.modules):
            for module in top.modules():
                if id(module) not in hooked:
                    hooked.add(id(module))
                    if holds_any(module, ours):
                        drop_inert_hooks(module)
                        self._hooks.append(module.register_state_dict_pre_hook(weak_apply_hook(me)))
                        self._hooks.append(module.register_load_state_dict_pre_hook(weak_apply_hook(me)))
        self.eager = tuple(eager)
        # Each tensor once (done_ahead hands slices of it to the apply as they are).
        self._read_order = tuple(dict.fromkeys(sorted((i for own in by_module.values() for i in own),
                                                      key=lambda i: tracer.first_read_ns.get(i, 0))))
        began = tracer.first_read_in() if tracer.first_read_in is not None else None
        self._leader_waits = (entry is not None and began is entry
                              and tracer.ops_to_first_read <= LEADER_WAITS_WITHIN)
        if eager:
            unread = [self._names[i] for i in eager if i not in tracer.readers]
            outside = [self._names[i] for i in eager if i in tracer.readers]
            parts = []
            if outside:
                parts.append(f"{len(outside)} read outside any module's forward (e.g. '{outside[0]}')")
            if unread:
                parts.append(f"{len(unread)} not read by the first forward after step() (e.g. '{unread[0]}')")
            self._notices.tell("eager", f"dcredit_opt: of {len(self._params)} parameters, {' and '.join(parts)}: "
                                        "their updates are applied in step(), without overlap (Note [First read])")
        return tracer

    def rest(self) -> None:
        """Nothing is pending and nothing records the forward: the guard leaves the mode stack and the apply
        points' hooks leave their modules until the next ``step()`` (Note [Resting hooks])."""
        self.guard.leave_if_idle()
        if self._awake == _ASLEEP or self.compiled:
            return
        for hooks, key, _ in (self._apply_hooks if self._awake == _EVERY else (self._leader,)):
            hooks.pop(key, None)
        self._awake = _ASLEEP

    def wake(self, every_hook: bool) -> None:
        """``step()``: the leader's hook back in its module, first, as it was registered; every apply point's
        where ``every_hook``, or where the last forward did not begin at the leader."""
        if self._awake == _EVERY:
            return
        if every_hook or self._leader is None or self.compiled:  # compiled: the hook set Dynamo guards on stays
            self.wake_every_hook()
            return
        if self._awake == _ASLEEP:
            _put_back(*self._leader)
            self._awake = _LEADER

    def wake_every_hook(self) -> None:
        """Every apply point's hook back in its module: the leader left updates pending, or the forward did not
        begin there."""
        if self._awake == _EVERY:
            return
        for hooks, key, hook in self._apply_hooks:
            _put_back(hooks, key, hook)
        self._awake = _EVERY

    def first_to_wait_for(self, rows_of) -> int | None:
        """At the leader, with nothing of its own (Note [Resting hooks]): the pending tensor read first, where the
        forward reads it at once (so waiting for it here loses no overlap) and it is no embedding's rows
        (``rows_of``: those wait for their own module); else None."""
        if not self._leader_waits:
            return None
        order, pending = self._read_order, self.pending
        k = self._ahead
        while k < len(order) and not pending[order[k]]:
            k += 1
        if k == len(order) or order[k] in rows_of:
            return None
        return order[k]

    def leader_missed(self) -> bool:
        """A read of a pending parameter came before the leader's hook ran (Note [Resting hooks]). True where
        only the leader was awake: every apply point's hook wakes now, and at every ``step()`` from here on
        once two forwards in a row did not begin at the leader; False where they all were (an early read, Note
        [Guarded reads] in ``reads.py``)."""
        if self._awake != _LEADER:
            return False
        self._missed += 1
        if self._missed >= 2:
            self._leader = None
        self.wake_every_hook()
        return True

    def reached(self, module) -> None:
        """``module``'s forward begins with its apply point's hook: the leader's, the forward began there."""
        if self._leader is not None and self._leader[0] is module._forward_pre_hooks:
            self._missed = 0

    def blocks_waited(self) -> None:
        """A new iteration waited for every block: the pending updates' gradients are final, no wait needed."""
        self.reduced = True

    def first_apply(self) -> bool:
        """Whether this is the first apply since a lazy ``step()`` (it checks every pending slot's version,
        so that a write between ``step()`` and the next forward stops us before any update)."""
        first, self.versions_checked = not self.versions_checked, True
        return first

    def ran_compiled(self) -> None:
        """An apply point's hook ran inside compiled code: the hooks stay for good (Note [Resting hooks])."""
        self.compiled = True

    def let_go(self) -> None:
        """At close: the model's hooks no longer keep the optimizer."""
        self.keeper.let_go()

    def watch_checkpoints(self, optimizer) -> None:
        """The optimizer object the script wrapped shares its hook dicts with the wrapper: a checkpoint saved or
        loaded through either (``state_dict()``, ``load_state_dict()``) applies what is pending first."""
        self._hooks += [optimizer.register_state_dict_pre_hook(weak_apply_hook(self.keeper)),
                        optimizer.register_load_state_dict_pre_hook(weak_apply_hook(self.keeper))]

    def remove_hooks(self) -> None:
        """At close: the guard and the apply points go."""
        self.guard.remove()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._apply_hooks = []
        self._leader = None
        self._awake = _ASLEEP


# Which apply points' hooks are in their modules (Note [Resting hooks]).
_ASLEEP, _LEADER, _EVERY = 0, 1, 2
LEADER_WAITS_WITHIN = 4
"""Note [Resting hooks]: the leader waits for the first update read where the first forward read it within this
many torch operations of its beginning (``torch.arange`` for positions, a reshape of the input)."""


def _put_back(hooks, key, hook) -> None:
    """A forward pre-hook back in its module's dict, first, where it was registered."""
    hooks[key] = hook
    if len(hooks) > 1:  # after the module's own pre-hooks (registered since): ours goes first again
        hooks.move_to_end(key, last=False)
