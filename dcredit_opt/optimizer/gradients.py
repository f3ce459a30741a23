"""Backward's half of the optimizer: the gradient hooks, handing each gradient over, the flush.

Gradients live in flat buffers that :class:`GradientBuffers` owns
(``buffers.py``: one per dtype, laid out by the plan); after its hook,
``p.grad`` is its slot, so a finished reduction is visible in ``p.grad``
with no copy. Each parameter has two hooks, in C++ (Note [Gradient path] in
``csrc/torch/gradient_path.h``): a pre-hook, which runs before autograd adds
a gradient to ``p.grad`` (so that a refusal changes nothing), and a
post-accumulate hook, which stages the gradient and tells the scheduler it
is ready. The flush at ``step()`` marks what backward did not.
:class:`Backward` owns an iteration's gradient state and the gradient path;
the optimizer's core (``core.py``) composes it with the buffers, the tally
and the lazy updates.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from .. import _ext, timeline
from ..errors import DCreditError
from ..world.peers import at_rank
from .buffers import clear, indices_of, is_slot, per_tensor
from .watched import WatchedGradient

# The advice two refusals share (here and in Core.zero_grad): what an optimizer with passes of its own does, and
# what a backward meant for another model's loss does.
TWO_PASS_OPTIMIZERS = (
    "An optimizer that uses the averaged gradients between passes of its own (SAM: first_step(), a second "
    "forward and backward, second_step()) runs without step(): call optimizer.synchronize() after each "
    "backward, then its own methods (docs/usage.md, 'Two passes per update').")
ANOTHER_MODELS_LOSS = (
    "meant for another model's loss (a GAN's generator loss through the discriminator), keep this model's "
    "parameters out of it: loss.backward(inputs=[...the other model's parameters]), or requires_grad_(False) "
    "on these parameters during that backward.")


_LIVE: weakref.WeakSet = weakref.WeakSet()
"""Every optimizer's :class:`Backward` in this process, for Note [Missed here] in core.py."""


class Backward:
    """One iteration's gradients, from the first hand-over to ``step()``.

    Owns, per tensor, the backward passes counted since the last ``step()``
    (``counts``), whether its gradient was handed to the scheduler in this
    iteration (``marked``) and whether its reduced value is final (``final``:
    waited for at a read of ``p.grad``, Note [Gradient reads]); the
    iteration's state (``open`` at its first gradient, ``flushed`` once every
    block is released, ``synchronized`` once every gradient is final); and the
    C++ gradient path (``path``) that the hooks run. Public fields are read by
    the core; only these methods write them.

    ``opening``, ``restage`` and ``apply_pending`` are the core's, held
    weakly: what the start of an iteration records and switches, a re-plan
    that the embedding rows ask for, and the last step()'s updates applied
    before every block is released.
    """

    def __init__(self, names, params, passes: int, engine, buffers, tally, lazy, config, notices, *,
                 prescale: float, opening, restage, apply_pending, spare_of=lambda i: None, others: bool = True):
        T = len(params)
        self.names = names
        self.params = params
        self.passes = passes  # backward_passes_per_step
        # Per-tensor state that the hooks write: flat memory, cleared in place (Note [Gradient state]).
        self.counts = per_tensor(T, "i")
        self.marked = per_tensor(T, "B")
        self.final = [False] * T
        self.every_final = not T  # False not in final, kept beside it: the watch asks at every operation
        self.open = False
        self.flushed = False
        self._staging = False  # flush() is handing the unmarked tensors over
        self.synchronized = False
        self.unscaled: set[int] = set()  # tensors a scaler unscaled in this iteration (Note [A scaler's unscale_])
        # Note [Unused here]: tensors given p.grad at the end of this iteration's backward, unused on this rank,
        # and those of them no rank used whose zeros user code read.
        self.stood: set[int] = set()
        self.read_while_unused: set[int] = set()
        self.held: set[int] = set()  # Note [Held gradients]: this rank's gradient, in the slot, not handed over
        # Note [Missed here] in core.py: a backward since the last step() gave gradients to another optimizer of
        # ours on this rank and to none of this one's tensors.
        self.missed = False
        self._others = others  # other ranks reduce with this one: a tensor unused here may have their sum
        self.in_closure = False  # step(closure) is running the closure (Core.step)
        self.iteration = 0  # iterations opened so far
        self.python_handovers = 0  # gradients handed over in Python since wrapping (tests and benchmarks read it)
        self.life = Life()
        self._engine = engine
        self._buffers = buffers
        self._tally = tally
        self._lazy = lazy
        self._config = config
        self._notices = notices
        self._opening = opening
        self._restage = restage
        self._apply_pending = apply_pending
        self._spare_of = spare_of  # Note [Zeroed while pending] in core.py: tensor i's spare, or None
        me = weakref.ref(self)
        # Note [Gradient path]: each gradient's hand-over, in C++; Python where it must.
        self.path = _ext.load().GradientPath(engine, params, self.counts, self.marked, tally.used, lazy.pending,
                                             buffers.versions, WeakMethod(me, "hand_over"),
                                             WeakMethod(me, "before_accumulate"), WeakMethod(me, "hook_failed"),
                                             WeakMethod(me, "open_at"))
        buffers.use_path(self.path)
        self.path.set_passes_per_step(passes)
        self.path.set_prescale(prescale)
        _LIVE.add(self)

    def set_passes_per_step(self, passes: int) -> None:
        if any(self.counts):
            raise DCreditError(f"set_backward_passes_per_step({passes}) after a backward pass: call it right "
                               "after step(), before the next loss.backward()")
        self.passes = passes
        self.path.set_passes_per_step(passes)

    # ---- the hooks' Python side --------------------------------------------------------

    @contextlib.contextmanager
    def running_closure(self):
        """While ``step(closure)`` runs its closure: a backward pass there that is one too many says so
        (:meth:`too_many_passes`)."""
        self.in_closure = True
        try:
            yield
        finally:
            self.in_closure = False

    def too_many_passes(self, i: int) -> DCreditError:
        closure = (
            " This pass is the closure's that step(closure) ran: step(closure) reduces the gradients its "
            f"closure computes, so call it without a backward of your own before it. {TWO_PASS_OPTIMIZERS}"
            if self.in_closure else "")
        return DCreditError(
            f"gradient of parameter '{self.names[i]}' was computed {self.counts[i] + 1} times before "
            f"step(), but backward_passes_per_step={self.passes}.{closure} Call step() after every "
            f"{self.passes} backward pass(es), or raise backward_passes_per_step. If one of those passes was "
            f"{ANOTHER_MODELS_LOSS}")

    # Note [Gradients with a graph]
    # loss.backward(create_graph=True) leaves in p.grad a gradient that autograd can differentiate again (a
    # penalty on the gradients' norm, a Hessian-vector product). We average gradients in our own buffers,
    # where no graph can follow: a penalty built from p.grad afterwards would be a constant, its gradient
    # lost without a word (DDP treats such gradients the same way, with a warning). So the hook refuses such
    # a gradient (the C++ fast path leaves it to this Python path), naming the parameter and the way that
    # works: torch.autograd.grad(..., create_graph=True), whose gradients are the rank's own and are not
    # reduced, then one backward() of the total, whose gradients are.

    def graph_in_gradient(self, i: int) -> DCreditError:
        return DCreditError(
            f"the gradient of parameter '{self.names[i]}' carries an autograd graph (loss.backward("
            "create_graph=True), for a penalty on gradients or a second-order step): dcredit_opt averages "
            "gradients over ranks in its own buffers, where that graph cannot follow, so a penalty built from "
            "p.grad would be a constant and its gradient lost (Note [Gradients with a graph] in gradients.py). "
            "Take the gradients to differentiate with grads = torch.autograd.grad(loss, params, "
            "create_graph=True) (this rank's own, not reduced), build the penalty from them, and call backward() "
            "once on loss + penalty without create_graph: its gradients are reduced as usual")

    def before_accumulate(self, i: int) -> None:
        """Before autograd adds a gradient to ``p.grad``, so that a refusal changes nothing: called by the C++
        pre-hook where the update of tensor ``i`` is pending or its passes are all counted (Note [Gradient
        path])."""
        if self._lazy.pending[i]:
            raise self._lazy.stale_read(i)
        if (self.counts[i] >= self.passes or self.open and self.flushed) and _will_accumulate(self.params[i]):
            raise self.too_many_passes(i) if self.counts[i] >= self.passes else self._after_flush(i)
        self._sparse_onto_ours(i)

    def _sparse_onto_ours(self, i: int) -> None:
        """Note [Sparse gradients] in sparse.py: a sparse gradient of tensor ``i`` is about to be added to a dense
        ``p.grad``. Where that ``p.grad`` is ours (the slot of the reduced gradient, through its watched alias, or
        a spare of zeros: Note [Zeroed while pending] in core.py) and the tensor's gradients travel as rows, plain
        torch holds a sparse ``p.grad`` there (the optimizer got it sparse, and a zero_grad(set_to_none=False)
        zeroes it in place, sparse), so its sum stays sparse, and an optimizer whose state is sparse (SGD's
        momentum) takes it. So ``p.grad`` becomes the row-sparse form of what it holds first, the same values. A
        dense tensor the script put there stays: dense plus sparse is dense, as in plain torch."""
        p = self.params[i]
        grad = p.grad
        if grad is None or grad.is_sparse or not self._tally.travels_sparse(i):
            return
        # Ours: a watched alias (this plan's, or an earlier plan's that p.grad kept: a plan without the tensor's
        # blocks is switched to once its gradients are found to come sparse), its slot, or its spare. Final: the
        # update that read it is applied (else the check above raised), and nothing of ours writes it now.
        if not (isinstance(grad, WatchedGradient) or is_slot(grad, self._buffers.slots[i])
                or grad is self._spare_of(i)) or not _will_accumulate(p):
            return
        with torch._C.DisableTorchFunctionSubclass():  # its values as they are: no read to wait for
            p.grad = grad.to_sparse(sparse_dim=1)

    def hand_over(self, i: int) -> None:
        """The C++ hook's Python path for tensor ``i`` (Note [Gradient path]): where the fast path cannot take
        it (one pass too many, a sparse or otherwise unusual gradient)."""
        grad = self.params[i].grad
        if grad is not None and grad.requires_grad:  # Note [Gradients with a graph]
            raise self.graph_in_gradient(i)
        count = self.counts[i] + 1
        if count > self.passes:
            raise self.too_many_passes(i)
        self.counts[i] = count
        if count < self.passes:
            self.path.note_pass(i)  # Note [Short accumulations] in gradient_path.cc
            return
        if not self.open:
            self.begin()
        elif self.flushed:
            raise self._after_flush(i)
        with self._lazy.guard.paused():  # our buffers only (Note [Guard cost] in reads.py)
            self._stage(i)
        self.marked[i] = True
        try:
            self._engine.mark_ready(i)
        except (RuntimeError, TimeoutError) as e:
            raise at_rank(e, f"phase 1 (backward), at the gradient of '{self.names[i]}' (tensor {i})") from e

    def _after_flush(self, i: int) -> DCreditError:
        return DCreditError(
            f"the gradient of parameter '{self.names[i]}' was computed after this iteration's gradients "
            "were already being reduced whole (by optimizer.synchronize(), or by reading a p.grad after a "
            "backward, which waits for its average: Note [Gradient reads]), so it would never be reduced. "
            "Run every backward of an iteration before reading gradients or calling synchronize(); to "
            "skip the update of an iteration after synchronize(), call optimizer.zero_grad() (the "
            "DistributedOptimizer's, on every rank) before the next backward (Note [Skipped steps])")

    def check_short(self, call: str) -> None:
        """``call`` (step() or synchronize()) opens the iteration after fewer backward passes than
        backward_passes_per_step: refused where user code wrote a counted gradient since its last pass (Note
        [Short accumulations] in csrc/torch/gradient_path.cc). Nothing is changed."""
        i = self.path.first_written_since_pass()
        if i < 0:
            return
        passes = self.counts[i]
        raise DCreditError(
            f"p.grad of '{self.names[i]}' was changed (clip_grad_norm_, clip_grad_value_, a scaler's unscale_, an "
            f"in-place write or a new tensor) after {passes} backward pass(es) of backward_passes_per_step="
            f"{self.passes}, before {call}: that p.grad was still this rank's own, not yet reduced (the iteration's "
            f"gradients are reduced at the last of the {self.passes} passes, or at {call} after fewer), so each "
            "rank would have changed its own and the result would differ from synchronous training. Nothing was "
            "changed. Call optimizer.synchronize() after the last backward pass and before changing gradients "
            "(then step() inside optimizer.skip_synchronize()), as Horovod asks (Note [Short accumulations] in "
            "csrc/torch/gradient_path.cc)")

    def open_at(self, i: int) -> None:
        """The C++ hook at an iteration's first gradient (tensor ``i``'s): open the iteration; the hook then hands
        that gradient over itself, as every other (Note [Gradient path])."""
        if not self.open:
            self.begin()

    def hook_failed(self, i: int, message: str) -> None:
        """The C++ hook's scheduler failure at tensor ``i``, raised as the Python path raises it."""
        error = _ext.load().SchedulerError(message)  # what the Python path's mark_ready raises
        raise at_rank(error, f"phase 1 (backward), at the gradient of '{self.names[i]}' (tensor {i})")

    def rows_arrived(self, i: int) -> None:
        """The stand-in of tensor ``i``'s embeddings got its gradient (Note [Embedding rows]): the iteration opens
        here if no other gradient opened it (its only gradients are embedding rows). A weight only embeddings read
        gets no gradient of its own, so its ``p.grad`` would stay None until ``step()``: it becomes the watched
        alias of its slot now, zeroed (the gradient plain torch would show there is the rows', which a read waits
        for: ``gradients_read``), and a gradient of its own that comes later in this backward adds to it."""
        if not self.open:
            self.begin()
        if self.params[i].grad is None and self._tally.rows_only_at(i) is not None:
            self._buffers.stand_ready(i)

    # ---- the iteration ---------------------------------------------------------------

    def begin(self) -> None:
        """The first gradient of an iteration: open the scheduler's iteration.

        Updates still pending here belong to parameters that the forward did not
        read where we learned it would. If the forward's graph read one of them,
        that read was stale: refused here, before this rank launches anything.
        The others stay pending (applying one now, in place, in the middle of a
        backward, would corrupt what autograd saved), their blocks are waited
        for, and ``step()`` applies them before staging new gradients.
        """
        lazy = self._lazy
        lazy.stop_recording()  # possibly on autograd's device thread: closed in step()
        self._buffers.check_casts(self.path.first_moved())
        if self._buffers.aliases:  # Note [Kept aliases] in watched.py: nothing to do unless user code took one
            self._aliases_kept()
        if lazy.npending and lazy.deferred:
            # Before this rank launches anything of the new iteration, so that every rank
            # whose forward read the same stale parameter stops here, at the same point.
            lazy.check_stale(indices_of(lazy.pending), self.path)
        # Updates applied with a stream-ordered wait (Note [Stream-ordered waits]) may leave blocks
        # still running on the device: the new iteration's gradients go into the same slots.
        if (lazy.npending or not self._engine.idle()) and not lazy.reduced:
            self.wait_all("the start of backward, waiting for the last step()'s blocks")
            lazy.blocks_waited()
        self._opening(self.iteration)  # the last iteration recorded, a staged plan switched to
        self.iteration += 1
        try:
            self._engine.start_iteration()
        except (RuntimeError, TimeoutError) as e:
            raise at_rank(e, "phase 1 (start of backward)") from e
        self._set_open(True)
        self.missed = False
        self.life.released = False
        self.synchronized = False
        self.unscaled.clear()
        self.stood.clear()
        self.read_while_unused.clear()
        self.held.clear()
        clear(self.marked)
        self.final = [False] * len(self.params)
        self.every_final = not self.params
        if self._others and torch._C._current_graph_task_id() != -1:
            torch.autograd.Variable._execution_engine.queue_callback(self._unused_stand_ready)

    def note_missed_short(self) -> None:
        """Note [Missed here] in core.py, where no iteration opened in backward: a backward since the last step()
        counted passes of another optimizer of ours on this rank (fewer than its backward_passes_per_step, so its
        iteration did not open and no callback marked this one) and none of this one's: this one missed it."""
        if (not self.open and not self.missed and len(_LIVE) > 1 and not any(self.counts)
                and any(other is not self and any(other.counts) for other in _LIVE)):
            self.missed = True

    def _unused_stand_ready(self) -> None:
        """Note [Unused here]: the end of the backward that opened this iteration; the tensors it did not reach
        on this rank get ``p.grad``, the watched alias of their slot, zeroed. The other optimizers of ours whose
        iteration this backward did not open are told they missed it (Note [Missed here] in core.py)."""
        if len(_LIVE) > 1:
            for other in _LIVE:
                if not other.open:
                    other.missed = True
        marked = self.marked
        if all(marked) or not self.open or self.flushed:  # in C: every tensor reached (the common case)
            return
        params, rows = self.params, self._tally.rows
        todo, held = [], []  # no gradient here; a gradient of this rank's that was not handed over
        for i in range(len(params)):
            if not marked[i]:
                grad = params[i].grad
                if grad is None:
                    todo.append(i)
                elif i not in rows and not grad.is_sparse:
                    held.append(i)
        pending = self._lazy.pending
        if any(pending[i] for i in (*todo, *held)):
            # The last step()'s update of a tensor this forward did not read still needs its slot: applied
            # first, as the flush would (the end of a backward: autograd no longer needs what it saved).
            with self._lazy.guard.paused():
                self._apply_pending()
        for i in todo:
            self._buffers.stand_ready(i)
        self.stood.update(todo)
        if held:
            self._staging = True  # our own look at a watched p.grad here waits for nothing
            try:
                with self._lazy.guard.paused():
                    for i in held:
                        self._buffers.hold(i)
            finally:
                self._staging = False
            self.held.update(held)

    # Note [Held gradients]
    # A tensor's gradient is handed over when its backward passes are all
    # counted (backward_passes_per_step); until then, and for a tensor no
    # pass reached, p.grad is this rank's own. Two kinds of tensors reach
    # the end of the backward that opened the iteration with such a p.grad:
    # one that came in fewer of the passes than the others (a branch taken in
    # some micro-batches), in a tensor of autograd's; and one that no pass
    # reached but whose p.grad is still there (zeros kept by
    # zero_grad(set_to_none=False), which plain torch and DDP step with as
    # zeros). Code that lists the gradients and then reads them
    # (clip_grad_norm_) would read this rank's own there, not the average:
    # each rank clips its own, and the ranks' average of clipped gradients
    # is not the clip of the average, alike on every rank, so no check of
    # ours would ever see it. So, in the callback of Note [Unused here] (at 2
    # ranks or more: at a world of one this rank's is the average), each gets
    # as p.grad the watched alias of its slot, holding what p.grad held
    # (``GradientBuffers.hold``): not handed over, its count unchanged, so a
    # later backward pass of the same iteration (a loss of its own, a pass
    # Horovod counts per tensor, a reentrant checkpoint's outer backward)
    # adds onto it in place and is counted, as onto the zeros of Note [Unused
    # here]; a read waits for its reduction, which the flush that the read
    # starts hands over with the rest. Not covered: a step() that comes
    # after fewer backward passes than backward_passes_per_step (the last,
    # short accumulation of an epoch), where no iteration opened in
    # backward: its gradients are this rank's until step(), whose flush
    # reduces them, as Horovod's are until its synchronize(); call
    # synchronize() before reading them there (a write before it is
    # refused: Note [Short accumulations] in csrc/torch/gradient_path.cc).

    def _aliases_kept(self) -> None:
        """Note [Kept aliases] in watched.py, at an iteration's first gradient: an alias of a slot whose
        ``p.grad`` was dropped since gets memory of its own; one whose ``p.grad`` is still the slot has its
        reduction waited for at the end of this backward."""
        buffers = self._buffers
        dropped, shared = [], []
        for i in buffers.live_aliases():
            grad = self.params[i].grad
            (shared if grad is not None and buffers.is_ours(i, grad) else dropped).append(i)
        buffers.let_aliases_go(dropped)
        if not shared or torch._C._current_graph_task_id() == -1:  # gradients assigned by hand: step() is next
            return
        self._notices.tell("kept aliases", (
            f"dcredit_opt: p.grad of '{self.names[shared[0]]}' has an alias taken in an earlier iteration "
            "(.data or detach()) that is still alive, so writes through it land where they would in plain torch: "
            "each backward waits for that gradient's reduction before it returns, and step() applies its update "
            "itself, without overlap, while the alias lives. Take the alias anew after each backward, or let it "
            "go (del), to keep the overlap (Note [Kept aliases] in watched.py). Said once."))
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._reduced_before_return(shared))

    def _reduced_before_return(self, indices) -> None:
        """Note [Kept aliases]: the end of a backward, where the slots of ``indices`` have aliases kept: every
        block released, and these waited for; from here on what user code writes into them is what step()
        uses (Note [Gradient reads])."""
        if not self.open:
            return
        if not self.flushed:
            with self._lazy.guard.paused():
                self.release()
        self.gradients_read(indices)

    def end(self) -> None:
        """``step()`` took this iteration's gradients (or refused them all): the next gradient opens a new one."""
        clear(self.counts)
        self._set_open(False)
        self.missed = False

    def set_synchronized(self, synchronized: bool) -> None:
        """Every gradient is final (``synchronize()``, a scaler's unscaling): user writes from here on are what
        the step uses. Until ``step()`` ends (it clears it) or a skipped step leaves it."""
        self.synchronized = synchronized

    def mark_unscaled(self, indices) -> None:
        """A scaler is unscaling the gradients of ``indices`` (Note [A scaler's unscale_] in watched.py)."""
        self.unscaled.update(indices)

    def all_final(self) -> None:
        """``synchronize()`` waited for every gradient: every read from here on is of final values."""
        self.final = [True] * len(self.params)
        self.every_final = True

    def _rows_dropped(self, i: int) -> bool:
        """A weight only embeddings read whose rows came this iteration (``rows_arrived`` made ``p.grad`` ours
        then) and whose ``p.grad`` the script set to None since: dropped, as any other gradient set to None."""
        r = self._tally.rows_only_at(i)
        return (r is not None and self.params[i].grad is None
                and r.stand_in is not None and r.stand_in.grad is not None)

    def _unused_dropped(self, i: int) -> bool:
        """A tensor given its slot at the end of the backward (zeros: Note [Unused here]; this rank's gradient:
        Note [Held gradients]) whose ``p.grad`` the script set to None since: dropped, as any other gradient set
        to None (its slot then holds zeros)."""
        return (i in self.stood or i in self.held) and self.params[i].grad is None

    def _stage(self, i: int) -> None:
        """This rank's gradient of tensor ``i`` into its slot; whether it had one, into the tally."""
        p = self.params[i]
        grad = p.grad
        # Note [Global usage]; the zeros of Note [Unused here], still ours and with no gradient added to them
        # since (a backward pass that reached the tensor after the one that opened the iteration adds in place,
        # and counts it), are no gradient of this rank's
        self._tally.used[i] = grad is not None and not (
            i in self.stood and grad is self._buffers.watched[i] and not self.counts[i])
        self._buffers.stage(i, p)

    def flush(self) -> None:
        """End of backward: unmarked tensors (unused here) join with what they have."""
        buffers, marked = self._buffers, self.marked
        if not all(marked):  # in C: where every gradient was handed over (the common case), no Python per tensor
            self._staging = True  # our own reads of a watched p.grad here (an earlier plan's) wait for nothing
            try:
                for i in range(len(self.params)):
                    if not marked[i]:
                        if self._rows_dropped(i) or self._unused_dropped(i):
                            # No update, as in plain torch (Note [Replaced gradients]); zeros in its blocks.
                            if i in self.held:  # its slot holds this rank's gradient
                                buffers.slots[i].zero_()
                            buffers.versions[i] = buffers.slots[i]._version
                        else:
                            self._stage(i)
                        marked[i] = True
            finally:
                self._staging = False
        if self._tally.exchanging:  # before the flush releases the last blocks: less queued ahead of them
            self._tally.exchange_rows(buffers.slots, buffers.versions, buffers.postscale)
        if buffers.delayed is not None:  # Note [Delayed updates]: the previous step's sum in, this step's out
            buffers.swap_delayed()
        try:
            self._engine.flush()
        except (RuntimeError, TimeoutError) as e:
            raise at_rank(e, "end of phase 1 (the flush in step() or synchronize())") from e
        self.flushed = True
        self.path.set_flushed(True)
        self.life.released = True
        if self._tally.start(self._lazy.taken):  # tensors now rows-only (Note [Embedding rows]): a plan without
            self._restage()  # their blocks
        if buffers.delayed is not None:
            buffers.start_delayed()  # after the tally: it never waits behind this sum

    def release(self) -> None:
        """End of backward, as ``step()`` and ``synchronize()`` take it: the last step()'s updates still
        pending applied, then every block released."""
        self._apply_pending()
        self.flush()

    def _set_open(self, open_: bool) -> None:
        """An iteration opens at its first gradient and closes at ``step()``; the C++ hooks take the fast path
        only inside an open one that has not been flushed (Note [Gradient path] in csrc/torch/gradient_path.h)."""
        self.open = open_
        self.flushed = False
        self.path.set_open(open_)
        self.path.set_flushed(False)

    # ---- waiting for reduced gradients -------------------------------------------------

    def gradients_read(self, indices) -> None:
        """Note [Gradient reads]: user code is about to read or change ``p.grad`` of tensors ``indices`` (one
        operation on them all, as ``clip_grad_norm_``'s foreach calls are); where their reduction may still run,
        wait for it, so that the code sees (and changes) the averaged gradients. One wait and one check for all
        of them, not one per tensor."""
        final = self.final
        todo = [i for i in indices if not final[i]] if True in final else list(indices)  # none read yet: all
        if not todo:
            return
        if self.open:
            marked = self.marked
            if not all(marked):
                # The others: not handed over yet, the local gradient; but an embedding's rows are the tensor's
                # (Note [Embedding rows]): they come at the flush, which a read starts.
                # And so do the zeros of Note [Unused here], which stand for the other ranks' sum.
                rows, stood, held = self._tally.rows, self.stood, self.held
                todo = [i for i in todo if marked[i] or i in rows or i in stood or i in held]
            if not todo or self._staging:
                return
            if not self.flushed:
                if torch._C._current_graph_task_id() != -1:
                    raise DCreditError(
                        f"p.grad of parameter '{self.names[todo[0]]}' was read during a backward, after dcredit_opt "
                        "had taken it for reduction (a hook that runs after ours): its value is neither this "
                        "rank's gradient nor the average then. Read gradients after loss.backward() returns, or "
                        "in a hook registered before the DistributedOptimizer was built")
                with self._lazy.guard.paused():
                    self.release()
                if self.stood:
                    self._unused_everywhere_dropped(todo)
            if self._engine.idle():
                # Every reduction has ended (the flush launched every block; none is in flight): every gradient
                # is final now, read or not, at no wait. Marked so in one go, a script that reads them one by one
                # (clip_grad_norm_(foreach=False), a norm per layer) meets the watch's early return from the second
                # read on, instead of a wait and a check per tensor.
                todo = [i for i, f in enumerate(final) if not f]
        else:
            pending = self._lazy.pending
            for i in todo:
                if not pending[i]:
                    final[i] = True  # applied: nothing of ours writes it any more
            self.every_final = False not in final
            todo = [i for i in todo if pending[i]]
            if not todo:
                return
        try:
            with timeline.profiled("dcredit_opt::wait"):
                self._engine.wait_tensors(todo, float(self._config.timeout_s))
        except (RuntimeError, TimeoutError) as e:
            i = next((i for i in todo if not self._engine.tensor_done(i)), todo[0])
            raise at_rank(e, f"reading p.grad of '{self.names[i]}' (tensor {i}), waiting for its reduction") from e
        self.add_rows(todo)
        self._buffers.check_writes(todo, "a read of p.grad")
        for i in todo:
            final[i] = True
        self.every_final = False not in final

    def _unused_everywhere_dropped(self, read) -> None:
        """Note [Unused here]: at the flush that a read of ``read`` started, the tensors given zeros at the end
        of the backward that no rank used get ``p.grad = None`` now, as plain torch has it; those of them this
        read is of are remembered (``read_while_unused``)."""
        unused = self.drop_unused_grads(sorted(self.stood))
        if unused:
            self.read_while_unused.update(set(unused).intersection(read))

    def accept_final_writes(self) -> None:
        """At ``step()``: a gradient that user code read after its reduction had ended (Note [Gradient
        reads]) may have been changed by it since (``clip_grad_norm_``): that change is what the step uses,
        so its slot's version counts from here."""
        if True not in self.final:
            return
        self._buffers.accept_writes([i for i, final in enumerate(self.final) if final])

    def wait_final(self, where: str) -> None:
        """Every reduced gradient final: every block done, every embedding row added."""
        self.wait_all(where)
        self.add_rows(range(len(self.params)))

    def add_rows(self, indices) -> None:
        """Every rank's embedding rows into the reduced gradients of ``indices`` that have them."""
        b = self._buffers
        self._tally.add_rows(indices, b.slots, b.versions, b.prescale * b.postscale)

    def drop_unused_grads(self, indices) -> list:
        """``p.grad = None`` for the tensors of ``indices`` no rank used (Note [Global usage]); returns them."""
        return self._tally.drop_unused_grads(indices, self._buffers.watched, self._buffers.slots)

    def wait_all(self, where: str) -> None:
        try:
            with timeline.profiled("dcredit_opt::wait"):
                self._engine.wait_all(float(self._config.timeout_s))
        except (RuntimeError, TimeoutError) as e:
            raise at_rank(e, where) from e

    def take_slow_count(self) -> int:
        """Gradients handed over in Python in the last iteration (Note [Gradient path])."""
        slow = self.path.take_slow_count()
        self.python_handovers += slow
        return slow


class Life:
    """What a dropped optimizer's finalizer needs to know: whether this iteration's blocks were all released."""

    released = False


class WeakMethod:
    """A method of a weakly held object, for the C++ hooks and the parts of the optimizer that call back into
    the one that owns them (Note [Gradient path]): the Python path of a gradient (``hand_over``), the checks
    before one is added (``before_accumulate``), a scheduler failure raised as Python raises it
    (``hook_failed``), the opening of an iteration at its first gradient (``open_at``). Does nothing once the
    object is gone, so no part keeps another alive."""

    __slots__ = ("_name", "_ref")

    def __init__(self, ref, name: str):
        self._ref, self._name = ref, name

    def __call__(self, *args):
        obj = self._ref()
        if obj is not None:
            return getattr(obj, self._name)(*args)
        return None


def _will_accumulate(p: torch.Tensor) -> bool:
    """Whether the running backward adds to ``p.grad`` (``torch.autograd.grad()`` does not)."""
    with torch.enable_grad():  # the graph being run holds p's accumulator: this finds that one
        accumulator = p.view_as(p).grad_fn.next_functions[0][0]
    try:
        return bool(torch._C._will_engine_execute_node(accumulator))
    except RuntimeError:
        return False  # torch.autograd.grad(): the gradient is returned, p.grad is left alone
    except AttributeError:
        return True  # a torch without this query: assume backward()
