"""Backward's half of the wrapper: the gradient hooks, handing each gradient over, the flush.

Gradients live in flat buffers that :class:`GradientBuffers` owns
(``buffers.py``: one per dtype, laid out by the plan); after its hook,
``p.grad`` is its slot, so a finished reduction is visible in ``p.grad``
with no copy. Each parameter has two hooks: a tensor hook, which runs before autograd adds a gradient to
``p.grad`` (so that a refusal changes nothing), and a post-accumulate hook,
which stages the gradient and tells the scheduler it is ready. The flush at
``step()`` marks what backward did not. :class:`GradientHooks` holds methods
of the generated optimizer subclass (``optimizer.py``); its state is set up
in ``_DistributedOptimizer._dc_setup``.
"""

from __future__ import annotations

import torch

from . import _ext, timeline
from .buffers import clear
from .errors import DCreditError
from .runtime import at_rank


class GradientHooks:
    def _dc_too_many_passes(self, i: int) -> DCreditError:
        return DCreditError(
            f"gradient of parameter '{self._dc_names[i]}' was computed {self._dc_counts[i] + 1} times before "
            f"step(), but backward_passes_per_step={self._dc_bpps}. Call step() after every "
            f"{self._dc_bpps} backward pass(es), or raise backward_passes_per_step.")

    def _dc_before_accumulate(self, i: int) -> None:
        """Before autograd adds a gradient to ``p.grad``, so that a refusal changes nothing: called by the C++
        pre-hook where the update of tensor ``i`` is pending or its passes are all counted (Note [Gradient
        path])."""
        if self._dc_lazy.pending[i]:
            raise self._dc_lazy.stale_read(i)
        if self._dc_counts[i] >= self._dc_bpps and _will_accumulate(self._dc_params[i]):
            raise self._dc_too_many_passes(i)

    def _dc_hand_over(self, i: int) -> None:
        """The C++ hook's Python path for tensor ``i`` (Note [Gradient path])."""
        self._dc_on_grad(i, self._dc_params[i])

    def _dc_on_grad(self, i: int, p: torch.Tensor) -> None:
        count = self._dc_counts[i] + 1
        if count > self._dc_bpps:
            raise self._dc_too_many_passes(i)
        self._dc_counts[i] = count
        if count < self._dc_bpps:
            return
        if not self._dc_open:
            self._dc_begin()
        elif self._dc_flushed:
            raise DCreditError(
                f"the gradient of parameter '{self._dc_names[i]}' was computed after this iteration's gradients "
                "were already being reduced whole (by optimizer.synchronize(), or by reading a p.grad after a "
                "backward, which waits for its average: Note [Gradient reads]), so it would never be reduced. "
                "Run every backward of an iteration before reading gradients or calling synchronize()")
        with self._dc_lazy.guard.paused():  # our buffers only (Note [Guard cost] in reads.py)
            self._dc_stage(i, p)
        self._dc_marked[i] = True
        try:
            self._dc_engine.mark_ready(i)
        except (RuntimeError, TimeoutError) as e:
            raise at_rank(e, f"phase 1 (backward), at the gradient of '{self._dc_names[i]}' (tensor {i})") from e

    def _dc_begin(self) -> None:
        """The first gradient of an iteration: open the scheduler's iteration.

        Updates still pending here belong to parameters that the forward did not
        read where we learned it would. If the forward's graph read one of them,
        that read was stale: refused here, before this rank launches anything.
        The others stay pending (applying one now, in place, in the middle of a
        backward, would corrupt what autograd saved), their blocks are waited
        for, and ``step()`` applies them before staging new gradients.
        """
        lazy = self._dc_lazy
        lazy.stop_recording()  # possibly on autograd's device thread: closed in step()
        self._dc_buffers.check_casts(self._dc_path.first_moved())
        if lazy.npending and lazy.deferred:
            # Before this rank launches anything of the new iteration, so that every rank
            # whose forward read the same stale parameter stops here, at the same point.
            lazy.check_graph_reads([i for i, waits in enumerate(lazy.pending) if waits], self._dc_path)
        # Updates applied with a stream-ordered wait (Note [Stream-ordered waits]) may leave blocks
        # still running on the device: the new iteration's gradients go into the same slots.
        if (lazy.npending or not self._dc_engine.idle()) and not lazy.reduced:
            self._dc_wait_all("the start of backward, waiting for the last step()'s blocks")
            lazy.reduced = True
        if self._dc_timeline is not None and self._dc_iteration:
            self._dc_timeline.record(self._dc_engine.trace(), self._dc_engine.ready_times(), self._dc_names,
                                     self._dc_buffers.layout.block_tensors, self._dc_iteration)
        if self._dc_replanner is not None and self._dc_iteration:  # re-planning's watch (replanner.py)
            self._dc_replanner.observe(self._dc_engine, self._dc_buffers.layout.block_bytes)
        if self._dc_staged_plan is not None:
            # Every rank stages the same plan at the same step(), so every
            # rank switches here, in the same iteration. The step() that staged
            # it was eager (profiling), so no update waits in the old slots.
            assert not lazy.npending, "a plan switch with updates pending"
            plan, self._dc_staged_plan = self._dc_staged_plan, None
            self._dc_set_plan(plan)
        self._dc_iteration += 1
        try:
            self._dc_engine.start_iteration()
        except (RuntimeError, TimeoutError) as e:
            raise at_rank(e, "phase 1 (start of backward)") from e
        self._dc_set_open(True)
        self._dc_life.flushed = False
        self._dc_synchronized = False
        clear(self._dc_marked)
        self._dc_final = [False] * len(self._dc_params)

    def _dc_stage(self, i: int, p: torch.Tensor) -> None:
        """This rank's gradient of tensor ``i`` into its slot; whether it had one, into the tally."""
        self._dc_tally.used[i] = p.grad is not None  # Note [Global usage]
        self._dc_buffers.stage(i, p)

    def _dc_flush(self) -> None:
        """End of backward: unmarked tensors (unused here) join with what they have."""
        buffers = self._dc_buffers
        for i, p in enumerate(self._dc_params):
            if not self._dc_marked[i]:
                self._dc_stage(i, p)
                self._dc_marked[i] = True
        if self._dc_tally.exchanging:  # before the flush releases the last blocks: less queued ahead of them
            self._dc_tally.exchange_rows(buffers.slots, buffers.versions, buffers.postscale)
        if buffers.delayed is not None:  # Note [Delayed updates]: the previous step's sum in, this step's out
            buffers.swap_delayed()
        try:
            self._dc_engine.flush()
        except (RuntimeError, TimeoutError) as e:
            raise at_rank(e, "end of phase 1 (the flush in step() or synchronize())") from e
        self._dc_set_flushed(True)
        self._dc_life.flushed = True
        if self._dc_tally.start():  # tensors now rows-only (Note [Embedding rows]): a plan without their blocks
            self._dc_staged_plan = self._dc_staged_plan or buffers.plan
            self._dc_replan = True
        if buffers.delayed is not None:
            buffers.start_delayed()  # after the tally: it never waits behind this sum

    def _dc_set_open(self, open_: bool) -> None:
        """An iteration opens at its first gradient and closes at ``step()``; the C++ hooks take the fast path
        only inside an open one that has not been flushed (Note [Gradient path] in csrc/torch/gradient_path.h)."""
        self._dc_open = open_
        self._dc_flushed = False
        self._dc_path.set_open(open_)
        self._dc_path.set_flushed(False)

    def _dc_set_flushed(self, flushed: bool) -> None:
        self._dc_flushed = flushed
        self._dc_path.set_flushed(flushed)

    def _dc_hook_failed(self, i: int, message: str) -> None:
        """The C++ hook's scheduler failure at tensor ``i``, raised as the Python path raises it."""
        error = _ext.load().SchedulerError(message)  # what the Python path's mark_ready raises
        raise at_rank(error, f"phase 1 (backward), at the gradient of '{self._dc_names[i]}' (tensor {i})")

    def _dc_release(self) -> None:
        """End of backward, as ``step()`` and ``synchronize()`` take it: the last step()'s updates still
        pending applied, then every block released."""
        self._dc_apply_pending()
        self._dc_flush()

    def _dc_gradient_read(self, i: int) -> None:
        """Note [Gradient reads]: user code is about to read or change ``p.grad`` of tensor ``i``; if its
        reduction may still run, wait for it, so that the code sees (and changes) the averaged gradient."""
        if self._dc_final[i] or getattr(self, "_dc_closed", False):
            return
        if self._dc_open:
            if not self._dc_marked[i]:
                return  # not handed over in this iteration: the local gradient, still accumulating
            if not self._dc_flushed:
                if torch._C._current_graph_task_id() != -1:
                    raise DCreditError(
                        f"p.grad of parameter '{self._dc_names[i]}' was read during a backward, after dcredit_opt "
                        "had taken it for reduction (a hook that runs after ours): its value is neither this "
                        "rank's gradient nor the average then. Read gradients after loss.backward() returns, or "
                        "in a hook registered before the DistributedOptimizer was built")
                with self._dc_lazy.guard.paused():
                    self._dc_release()
        elif not self._dc_lazy.pending[i]:
            self._dc_final[i] = True  # applied: nothing of ours writes it any more
            return
        where = f"reading p.grad of '{self._dc_names[i]}' (tensor {i}), waiting for its reduction"
        try:
            with timeline.profiled("dcredit_opt::wait"):
                self._dc_engine.wait_tensor(i, float(self._dc_config.timeout_s))
        except (RuntimeError, TimeoutError) as e:
            raise at_rank(e, where) from e
        self._dc_add_rows((i,))
        self._dc_buffers.check_writes((i,), "a read of p.grad")
        self._dc_final[i] = True

    def _dc_accept_final_writes(self) -> None:
        """At ``step()``: a gradient that user code read after its reduction had ended (Note [Gradient
        reads]) may have been changed by it since (``clip_grad_norm_``): that change is what the step uses,
        so its slot's version counts from here."""
        if True not in self._dc_final:
            return
        self._dc_buffers.accept_writes([i for i, final in enumerate(self._dc_final) if final])

    def _dc_wait_final(self, where: str) -> None:
        """Every reduced gradient final: every block done, every embedding row added."""
        self._dc_wait_all(where)
        self._dc_add_rows(range(len(self._dc_params)))

    def _dc_add_rows(self, indices) -> None:
        """Every rank's embedding rows into the reduced gradients of ``indices`` that have them."""
        b = self._dc_buffers
        self._dc_tally.add_rows(indices, b.slots, b.versions, b.prescale * b.postscale)

    def _dc_drop_unused_grads(self, indices) -> list:
        """``p.grad = None`` for the tensors of ``indices`` no rank used (Note [Global usage]); returns them."""
        return self._dc_tally.drop_unused_grads(indices, self._dc_buffers.watched, self._dc_buffers.slots)

    def _dc_wait_all(self, where: str) -> None:
        try:
            with timeline.profiled("dcredit_opt::wait"):
                self._dc_engine.wait_all(float(self._dc_config.timeout_s))
        except (RuntimeError, TimeoutError) as e:
            raise at_rank(e, where) from e


class WeakMethod:
    """A method of a weakly held optimizer, for the C++ hooks to call (Note [Gradient path]): the Python path
    of a gradient (``_dc_hand_over``), the checks before one is added (``_dc_before_accumulate``), a scheduler
    failure raised as Python raises it (``_dc_hook_failed``). Does nothing once the optimizer is gone."""

    __slots__ = ("_name", "_ref")

    def __init__(self, ref, name: str):
        self._ref, self._name = ref, name

    def __call__(self, *args) -> None:
        opt = self._ref()
        if opt is not None:
            getattr(opt, self._name)(*args)


def weak_rows_hook(ref):
    """An embedding's stand-in got its gradient (Note [Embedding rows]): the iteration of a weakly held
    optimizer opens there if no other gradient opened it (its only gradients are embedding rows)."""
    def hook():
        opt = ref()
        if opt is not None and not opt._dc_open:
            opt._dc_begin()
    return hook


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
