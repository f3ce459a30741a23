"""The memory behind every gradient, laid out by the plan, and what ``p.grad`` is while it is reduced.

Gradients live in flat buffers (one per dtype, laid out by the plan); after
its hook, ``p.grad`` is its slot (watched: Note [Gradient reads] in
``watched.py``), so a finished reduction is visible in ``p.grad`` with no
copy. The engine and the backend reduce the buffers' blocks in place; the
hooks that decide when a gradient is handed over are in ``gradients.py``.
"""

from __future__ import annotations

import struct
import weakref
from itertools import compress, count

import torch

from .. import _ext
from ..backends.base import DelayedSums
from ..errors import DCreditError
from ..planner.plan import Plan, validate
from ..world.peers import at_rank
from . import grouping, rows, sparse
from .compression import block_wire_dtype
from .delayed import DelayedGradients
from .layout import build_layout
from .watched import WatchedGradient


class GradientBuffers:
    """Owns the gradients' memory and what the engine reduces in it.

    State: the plan in force and its layout; the flat buffers (``flat``) and
    their wire copies (Note [Wire dtype]); each tensor's slot and the watched
    alias of it that ``p.grad`` holds; each slot's version when its gradient
    was handed over (``versions``, flat memory the C++ gradient path writes
    too: Note [Gradient state]); DeFT's delayed sums (Note [Delayed updates]);
    which gradients came sparse; the scales of an average. It stages a
    rank's gradient into its slot, hands the memory to the engine and the
    backend when the plan changes, and tells when a slot was written while it
    was in flight.
    """

    def __init__(self, names, params, engine, backend, config, keeper, *, prescale: float, postscale: float,
                 wire, groups, sparse_as_dense: bool, dense_only: str | None = None):
        T = len(params)
        self.versions = per_tensor(T, "q")  # each slot's version when its gradient was handed over
        self.sparse = [False] * T  # gradients that came sparse and are reduced dense
        self.prescale = prescale  # before the sum (Horovod's gradient_predivide_factor)
        self.postscale = postscale  # after it: an average is a sum times this
        self.wire = wire  # Note [Wire dtype]: None, or the dtype float blocks travel in
        self.plan: Plan | None = None
        self.layout = None
        self.flat: list[torch.Tensor] = []
        self.slots: list[torch.Tensor] = []
        self.watched: list = []  # what p.grad is after each gradient's hook (Note [Gradient reads])
        self.delayed: DelayedGradients | None = None  # Note [Delayed updates] in planner/deft.py
        self._names = names
        self._params = params
        self._engine = engine
        self._backend = backend
        self._config = config
        self._keeper = keeper  # how a watched gradient reaches its optimizer
        self._groups = groups  # Horovod's groups, merged in every plan (grouping.py)
        self._sparse_as_dense = sparse_as_dense
        self._dense_only = dense_only  # why sparse gradients cannot be reduced as rows here (an op), or None
        self._path = None  # the C++ gradient path over these slots (use_path), for the checks in one pass
        # Note [Sparse gradients] in sparse.py: where a sparse gradient goes instead (``put(i, grad)``, False if
        # it cannot), and the row indices of each reduced gradient handed to the wrapped step sparse.
        self.sparse_sink = None
        self.as_sparse: dict = {}
        # Note [Kept aliases] in watched.py: per tensor, weak references to the `.data` and `detach()` aliases of
        # its slot that user code took (empty in the common case: nothing to look at).
        self.aliases: dict[int, list] = {}

    def _timeout(self) -> float:
        return float(self._config.timeout_s)

    # ---- the plan and the memory it lays out ------------------------------------------

    def sums_delayed(self) -> bool:
        """Whether this job's backend can sum DeFT's delayed gradients in the background (torch only)."""
        return isinstance(self._backend, DelayedSums)

    def take_sparse(self, sink, as_sparse: dict) -> None:
        """Sparse gradients go to ``sink(i, grad)`` (True when it took them: reduced as rows), and are handed to
        the optimizer sparse for the tensors of ``as_sparse`` (Note [Sparse gradients] in sparse.py)."""
        self.sparse_sink, self.as_sparse = sink, as_sparse

    def numels(self, rows_only=()) -> list:
        """Elements per tensor that travel in blocks: a rows-only tensor's none (Note [Embedding rows])."""
        gone = set(rows_only)
        return [0 if i in gone else p.numel() for i, p in enumerate(self._params)]

    def wire_dtypes(self) -> list:
        """Per tensor, the dtype its blocks travel in (Note [Wire dtype])."""
        reducible = self._backend.reducible_dtypes
        return [block_wire_dtype(p.dtype, self.wire, reducible) for p in self._params]

    def set_plan(self, plan: Plan, rows_only=()) -> None:
        """Switch to ``plan`` (with Horovod's groups merged in, without the blocks of ``rows_only``): new
        buffers and slots, handed to the engine and the backend. Only between iterations (nothing in flight)."""
        params = self._params
        plan = grouping.merge_groups(plan, self._groups, [p.dtype for p in params])
        plan = rows.without_tensors(plan, rows_only)
        validate(plan, numels=self.numels(rows_only), max_channels=self._config.channels,
                 dtypes=[p.dtype for p in params])
        if plan.delayed and not (self._config.policy == "deft" and self.sums_delayed()):
            raise DCreditError(f"plan delays the updates of {[self._names[i] for i in plan.delayed]} (DeFT), "
                               "which only Config(policy='deft', accept_delayed_updates=True, backend='torch') "
                               "runs: delayed updates do not train like synchronous data parallelism")
        wire_of = self.wire_dtypes()
        layout = build_layout(plan, [str(p.dtype) for p in params], [w.itemsize for w in wire_of])
        device = params[0].device if params else torch.device("cpu")
        dtype_of = {str(p.dtype): (p.dtype, w) for p, w in zip(params, wire_of)}
        buffers = [torch.zeros(n, dtype=dtype_of[k][0], device=device)
                   for k, n in zip(layout.segment_keys, layout.segment_numels)]
        # Note [Wire dtype]: where a buffer's blocks travel in another dtype, and are reduced.
        wires = [torch.zeros(n, dtype=dtype_of[k][1], device=device) if dtype_of[k][1] != dtype_of[k][0]
                 else torch.zeros(0, dtype=dtype_of[k][0], device=device)
                 for k, n in zip(layout.segment_keys, layout.segment_numels)]
        # A tensor without blocks (Note [Embedding rows]) keeps its gradient in memory of its own.
        slots = [slot_in(buffers[layout.tensor_segment[i]], layout.tensor_offset[i], p) if plan.numels[i] == p.numel()
                 else torch.zeros_like(p, memory_format=torch.contiguous_format) for i, p in enumerate(params)]
        self._engine.set_plan(
            plan.num_tensors, list(plan.order), list(layout.block_segment), list(layout.block_offset),
            list(layout.block_numel), list(layout.block_bytes), list(layout.block_priority),
            [list(t) for t in layout.block_tensors], list(plan.phase1_windows or [-1] * plan.num_tensors),
            list(plan.phase2_windows), plan.credit_bytes, plan.channels,
            **self._backend.buffers_for_engine(buffers, wires), postscale=self.postscale,
            block_ops=list(layout.block_op), block_after=list(layout.block_after),
            block_at_flush=list(layout.block_at_flush))
        self._backend.set_blocks(buffers, wires, layout, self.postscale)
        self.plan, self.layout, self.flat, self.slots = plan, layout, buffers, slots
        self.aliases = {}  # of the old slots, which no gradient goes into any more
        self.watched = [WatchedGradient.of(slot, i, self._keeper) for i, slot in enumerate(slots)]
        if self.delayed is not None:  # the sum in flight was for the old plan's slots: not applied
            self.delayed.drain(self._backend, self._timeout())
        self.delayed = DelayedGradients(plan.delayed, slots) if plan.delayed else None

    # ---- gradients in and out ------------------------------------------------------

    def stage(self, i: int, p: torch.Tensor) -> None:
        """Put this rank's gradient of tensor ``i`` into its slot (pre-scaled) and alias ``p.grad``."""
        slot, watched = self.slots[i], self.watched[i]
        g = p.grad
        if g is None:
            slot.zero_()  # unused on this rank: contribute zeros, as Horovod does
            p.grad = watched
        elif g is watched or is_slot(g, slot):
            if g is not watched:
                p.grad = watched
            if self.prescale != 1.0:
                slot.mul_(self.prescale)
        else:
            if g.is_sparse and not self._sparse_as_dense and self.sparse_sink is not None \
                    and self.sparse_sink(i, g):
                slot.zero_()  # its rows travel apart (Note [Sparse gradients]); the blocks, if any, carry zeros
                p.grad = watched
                self.versions[i] = slot._version
                return
            if g.is_sparse:
                if not self._sparse_as_dense:
                    why = f" ({self._dense_only} reduces dense tensors only)" if self._dense_only else ""
                    raise DCreditError(
                        f"parameter '{self._names[i]}' has a sparse gradient{why}; pass sparse_as_dense=True "
                        "to DistributedOptimizer to reduce it as a dense tensor")
                g = g.to_dense()
                self.sparse[i] = True  # the wrapped step gets it back sparse (Horovod's sparse_as_dense)
            if self.prescale != 1.0:
                torch.mul(g, self.prescale, out=slot)
            else:
                slot.copy_(g)
            p.grad = watched  # Note [Gradient reads]
        self.versions[i] = slot._version  # from here on, only the collectives write the blocks

    def hold(self, i: int) -> None:
        """``p.grad`` of tensor ``i`` becomes its watched alias, over its slot holding what ``p.grad`` held: this
        rank's gradient so far, not pre-scaled (``stage`` scales it) nor handed over (Note [Held gradients] in
        gradients.py)."""
        slot, watched = self.slots[i], self.watched[i]
        p = self._params[i]
        g = p.grad
        if g is not watched:
            if not is_slot(g, slot):
                slot.copy_(g)
            p.grad = watched

    def stand_ready(self, i: int) -> None:
        """``p.grad`` of tensor ``i`` becomes its watched alias, over its slot zeroed: before any gradient of its
        own, which autograd then adds to it (Note [Embedding rows] in rows.py)."""
        self.slots[i].zero_()
        self._params[i].grad = self.watched[i]

    def is_ours(self, i: int, grad) -> bool:
        """``grad`` is tensor ``i``'s watched gradient or its slot: the reduction lands in it."""
        return grad is self.watched[i] or is_slot(grad, self.slots[i])

    @property
    def steps_on_slots(self) -> bool:
        """Whether the wrapped step takes every tensor's slot as it is (``for_step(i)`` is ``slots[i]``: no gradient
        came sparse), so that they can be lent in one C++ pass (``GradientPath.lend_slots``)."""
        return not self.as_sparse and True not in self.sparse

    def not_as_is(self) -> set:
        """The tensors whose slot the wrapped step does not take as it is (``for_step(i)`` is not ``slots[i]``:
        their gradients came sparse)."""
        return {i for i, ids in self.as_sparse.items() if ids is not None} | set(compress(count(), self.sparse))

    def for_step(self, i: int) -> torch.Tensor:
        """The reduced gradient of tensor ``i`` as the wrapped step takes it (sparse if it came sparse)."""
        if self.as_sparse:
            ids = self.as_sparse.get(i)
            if ids is not None:
                return sparse.as_sparse(self.slots[i], ids)
        return self.slots[i].to_sparse() if self.sparse[i] else self.slots[i]

    def release(self) -> None:
        """At close: a ``p.grad`` still watched becomes its plain slot (final now, nothing of ours watches it)."""
        for p, w, slot in zip(self._params, self.watched, self.slots):
            if p.grad is w:
                p.grad = slot

    def swap_delayed(self) -> None:
        """Note [Delayed updates]: the previous step's background sum into the slots, this step's out."""
        try:
            self.delayed.swap(self.slots, self.postscale, self._backend, self._timeout())
        except (RuntimeError, TimeoutError) as e:
            raise at_rank(e, "end of phase 1, waiting for the background sum of the delayed gradients") from e
        for i in self.delayed.indices:
            self.versions[i] = self.slots[i]._version

    def start_delayed(self) -> None:
        """Note [Delayed updates]: this step's delayed gradients start their background sum."""
        try:
            self.delayed.start(self._backend)
        except (RuntimeError, TimeoutError) as e:
            raise at_rank(e, "end of phase 1, starting the background sum of the delayed gradients") from e

    # ---- aliases kept across iterations (Note [Kept aliases] in watched.py) ------------------------

    def keep_alias(self, i: int, alias: torch.Tensor) -> None:
        """User code took ``alias`` (``.data`` or ``detach()``) of tensor ``i``'s watched gradient."""
        self.aliases.setdefault(i, []).append(weakref.ref(alias))

    def live_aliases(self) -> dict[int, list]:
        """Per tensor, the aliases of its slot still alive; the dead ones are forgotten."""
        live, kept = {}, {}
        for i, refs in self.aliases.items():
            pairs = [(r, a) for r, a in ((r, r()) for r in refs) if a is not None]
            if pairs:
                kept[i] = [r for r, _ in pairs]  # the surviving references themselves, not new ones
                live[i] = [a for _, a in pairs]
        self.aliases = kept
        return live

    def aliased(self) -> tuple:
        """The tensors whose slots have an alias still alive (none, at the cost of one check, in the common
        case)."""
        return tuple(self.live_aliases()) if self.aliases else ()

    def let_aliases_go(self, indices=None) -> None:
        """The aliases of the slots of ``indices`` (every slot where None) get memory of their own, holding what
        they hold now: ``p.grad`` is no longer what they alias, as in plain torch once the gradient they were
        taken from has been dropped (``zero_grad()`` to None)."""
        live = self.live_aliases()
        own = _ext.load().give_own_memory
        for i in (list(live) if indices is None else indices):
            for a in live.get(i, ()):
                own(a)
            self.aliases.pop(i, None)

    # ---- the checks --------------------------------------------------------------------

    def accept_writes(self, indices) -> None:
        """Writes to the slots of ``indices`` so far are the user's, after their reduction ended: counted
        from here (Note [Gradient reads])."""
        for i in indices:
            self.versions[i] = self.slots[i]._version

    def use_path(self, path) -> None:
        """The C++ gradient path (Note [Gradient path]) that stages into these slots: the checks below ask it,
        in one pass, instead of looking at every slot from Python."""
        self._path = path

    def check_writes(self, indices, where: str) -> None:
        """Raise if a gradient slot was written since it was handed to the scheduler (Note [Lazy step])."""
        if self._path is not None:
            i = self._path.first_written(list(indices))
        else:  # not joined to a gradient path yet (these buffers on their own)
            i = next((i for i in indices if self.slots[i]._version != self.versions[i]), -1)
        if i >= 0:
            raise DCreditError(
                f"the gradient of '{self._names[i]}' was changed in place while dcredit_opt was still "
                f"reducing it or its update still waited for it (seen in {where}): by code that wrote it "
                "through another tensor than p.grad (a view or .data taken earlier), which dcredit_opt cannot "
                "see coming. No pending update was "
                "applied. Change gradients between loss.backward() and step() through p.grad, or reduce first: "
                "optimizer.synchronize(); <change>; `with optimizer.skip_synchronize(): optimizer.step()` (the "
                "Horovod recipe). To clear gradients use optimizer.zero_grad() or model.zero_grad() with "
                "set_to_none=True. A torch DistributedDataParallel around the model writes its own average into "
                "p.grad this way: dcredit_opt averages the gradients itself, so train the module without DDP")

    def check_casts(self, moved: int) -> None:
        """A model cast or moved after wrapping (``model.to(torch.bfloat16)``, ``.cuda()``): its gradients
        no longer fit the slots laid out for it. Refused at the first gradient, before anything is launched.
        ``moved``: the first parameter whose dtype or device is not its slot's (the gradient path finds it),
        or -1."""
        if moved >= 0:
            i, p, slot = moved, self._params[moved], self.slots[moved]
            raise DCreditError(
                f"parameter '{self._names[i]}' is {p.dtype} on {p.device} now, but was {slot.dtype} on "
                f"{slot.device} when dcredit_opt.DistributedOptimizer was built (model.to(), .cuda(), .half() "
                "after wrapping): its gradient buffers are laid out for the old dtype and device. Nothing was "
                "launched. Cast or move the model first, then build the DistributedOptimizer")

    def first_non_finite(self, rows_only=()) -> int | None:
        """The first tensor whose reduced gradient holds NaN or Inf, or None (the buffers checked whole)."""
        private = [self.slots[i] for i in rows_only]  # not in the buffers (Note [Embedding rows])
        if all(bool(torch.isfinite(b).all()) for b in [*self.flat, *private]):
            return None
        return next(i for i, slot in enumerate(self.slots) if not bool(torch.isfinite(slot).all()))


# Note [Gradient state]
# ~~~~~~~~~~~~~~~~~~~~~
# What the gradient hooks record per tensor and iteration (backward passes
# counted, handed to the scheduler, had a gradient on this rank, the slot's
# version at the hand-over) lives in flat memory, not in Python lists: arrays
# that are indexed like lists, never resized and cleared in place, so that
# their memory stays where it is for the whole life of the optimizer and code
# outside Python (a hook in the extension) can write it directly.
def per_tensor(n: int, fmt: str) -> memoryview:
    """``n`` zeros of struct format ``fmt`` in flat memory: indexed like a list, never resized, cleared in place."""
    return memoryview(bytearray(n * struct.calcsize(fmt))).cast(fmt)


def indices_of(values: memoryview) -> list[int]:
    """The indices of the nonzero values of a :func:`per_tensor` array, in order (one C pass)."""
    return list(compress(range(len(values)), values))


def clear(values: memoryview) -> None:
    """Every value of a :func:`per_tensor` array back to zero, in place."""
    values.cast("B")[:] = bytes(values.nbytes)


def fill(values: memoryview, value: int) -> None:
    """Every value of a one-byte :func:`per_tensor` array set to ``value``, in place."""
    values.cast("B")[:] = bytes([value]) * values.nbytes


def slot_in(buffer: torch.Tensor, offset: int, p: torch.Tensor) -> torch.Tensor:
    """Tensor ``p``'s gradient slot in ``buffer``: the same memory as the buffer, but a tensor of its own
    (not a view), so that its version counter moves only when the slot itself is written (Note [Lazy step]).

    Made from the buffer tensor, never from ``buffer.untyped_storage()``: a storage that Python has seen
    keeps a Python object, and the last reference to the buffer's storage may be dropped on a Gloo
    worker thread (the last collective's work), which would then need the GIL while the training thread,
    holding it, destroys that process group and joins the worker.
    """
    slot = torch.empty(0, dtype=buffer.dtype, device=buffer.device)
    return slot.set_(buffer, buffer.storage_offset() + offset, p.shape, _contiguous_strides(p.shape))


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(tuple(shape)):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def is_slot(grad, slot) -> bool:
    """``grad`` is ``slot`` (our buffer), so the reduction already lands in it. Our own question: a watched
    gradient (an earlier plan's, kept in p.grad) is asked past its watch, which would take it for a read."""
    if grad is None or grad.is_sparse or slot.numel() == 0:
        return False
    with torch._C.DisableTorchFunctionSubclass():
        return grad.data_ptr() == slot.data_ptr() and grad.shape == slot.shape
