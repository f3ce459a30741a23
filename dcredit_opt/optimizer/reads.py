"""Where each parameter is first read after ``step()``: learned once, from the job itself.

Note [First read]
-----------------
The lazy step (Note [Lazy step] in ``updates.py``) may defer a
parameter's update only until the first read of that parameter after
``step()``, wherever that read happens: in its own module's forward, in a
parent's forward (an ``nn.ParameterList`` entry, ``F.linear(h,
self.mid.weight)`` with ``mid`` never called, a tied weight), or in user code
between ``step()`` and the next forward (an EMA of the weights). Ownership
(``module._parameters``) says nothing about reads, so we watch them.

For one iteration, from the return of the first ``step()`` to the start of
the next backward, a :class:`FirstReadTracer` is active: a
``TorchFunctionMode`` sees every torch operation called from Python, and a
pair of global module hooks keeps the stack of module forwards that are
running (with ``opt.step(closure)`` that iteration's forward runs in the
closure, which ``step()`` calls before it ends the watch). The first
operation that reads a parameter (matched by memory, so ``p``,
``p.detach()``, ``p.data`` and views all count) records the innermost
module whose forward is running, or ``None`` when no forward is. Operations
that only make aliases or look at metadata (``detach``, ``view``,
``.shape``, ``.grad``) are not reads: ``model.state_dict()`` only detaches
(and its own hook applies what is pending).

The optimizer then applies each parameter's update in a forward pre-hook of
the module that read it first, and applies at ``step()`` itself (eagerly)
every parameter read outside any forward or not read at all while we
watched. A later iteration that reads a parameter earlier than we learned
(another branch, other control flow) is handled by the guard below.

Note [Guarded reads]
--------------------
What the first iteration learned is a forecast, not a proof: a later
iteration may read a parameter earlier (another branch, a peek at a weight in
the parent, an EMA or a log line that first runs at step 1000, a read through
``detach()``, ``.data`` or under ``torch.no_grad()``). So from the end of every
lazy ``step()`` until no update is pending any more (through the forward, and
through the backward and up to the next ``step()`` for parameters that
forward skipped), a :class:`PendingReadGuard` (a ``TorchFunctionMode``,
matching parameters by memory like the tracer, a tensor over several of them
touching each) sees every torch operation on the training thread; one whose
arguments include a parameter whose update is still pending applies that
update first, then runs. That covers reads and writes alike (``p.mul_()``
for a manual weight decay, ``p.data = x`` for a roll-back), and
``data_ptr()`` and ``untyped_storage()``, through which custom kernels and
the pickler (``torch.save``) take the values. The read sees exactly what a
synchronous step gives, and a notice says once that the update did not
overlap the forward. The guard sits at the bottom of the mode stack, so a
script's own modes enter and leave above it, and leaves the stack once
nothing is pending, so that torch's C++ fast paths (which step aside while
any mode is active) come back. Under code that Dynamo traces it is a
pass-through: reads inside a compiled graph are not seen.

Two lines stand behind it. A read the guard cannot see (another thread,
code compiled by ``torch.compile``) but that autograd records shows in the
parameter's gradient accumulator (Note [Graph reads] in
``csrc/torch/gradient_path.cc``): every apply, and the start of the backward,
raise a ``DCreditError`` naming the parameter before anything is applied or
launched. A NumPy array kept over a parameter's memory makes the step
eager (Note [Hidden writes] in ``lazy.py``). A read that none of these sees
(another thread or compiled code, without autograd; a collective or C++
extension handed ``p`` directly) is the remaining gap, stated in
``docs/lazy-step.md``.

Note [Guard cost]
-----------------
While armed, the guard sees every torch operation called from Python on the
training thread, which is every operation of the forward: its common case
(no argument lies in a pending parameter's memory) is what it costs. It
checks that it is armed and that the operation is not a metadata one, then
asks each tensor argument for its data pointer, and rejects any tensor that
starts above the highest parameter byte or ends below the lowest one before
any search. Measured on one small operation (``python -m
benchmarks.guard_cost``, 2-core development machine): about 3.5 us per
operation against 11 us when every argument went through generators and a
binary search. That search, and the pending filter after it, now run in one
C++ call (``AddressTable`` in ``csrc/torch/addresses.h``, equal to
``Addresses.read_by`` over every layout the unit tests draw): 2.1 us on an
operation that reads no parameter (3.5 us in Python), 2.4 us on a forward's
usual one, ``F.linear(x, w, b)`` over parameters already updated (5.3 us in
Python), of which about 1 us is any Python mode's own dispatch.

Our own bookkeeping on gradients (staging a gradient into its slot, the
checks in ``zero_grad``) is no read of a parameter, yet, run while updates
are pending, it went through the guard too: on the GPT-like model 470 of
the 560 operations the guard examined per iteration were ours. Around our
own work (that bookkeeping, and the wrapped step applying updates to the
parameters it is given) the guard leaves the mode stack
(``PendingReadGuard.paused``) and returns to its bottom afterwards: a mode
merely present on the stack already sends every call, ``data_ptr()`` and
``p.grad = slot`` included, through Python, which on a 77-parameter
GPT-like model at a world of one was about 1,500 calls per iteration,
3 ms of a 24 ms iteration. A script's own modes above it stay in place and
see every call.

Note [Several guards]
---------------------
A script with two optimizers of ours (a body and a head, decayed and
undecayed groups, a GAN's two) has two guards, each on the mode stack while
its own updates wait. Pausing only its own guard, one optimizer's own work
still went through the other's: measured on a 24-block MLP whose parameters
two optimizers share out, about 350 calls per iteration of the SGD half's
per-tensor step came to the AdamW half's guard, and 200 of each
``zero_grad()``, 1.4x plain torch's iteration against 1.07x for one
optimizer over the same model. Where the work cannot touch what another
guard watches, that guard leaves the stack for it too (``paused(others)``),
and comes back to the bottom after it:

- a ``zero_grad()`` to None by torch's own ``Optimizer.zero_grad`` gets and
  sets ``p.grad`` and nothing else, which no guard takes for a read;
- a wrapped step applying deferred updates reads only the parameters it
  updates (the lazy step defers only optimizers that update each parameter
  on its own, and runs no step hooks; a hook registered since keeps every
  guard), so another guard leaves only where none of its parameters shares a
  byte of memory with ours (two ``nn.Parameter`` over one storage, in two
  optimizers, keep it). Two live optimizers of ours never hold the same
  parameter (the later one takes it over).
"""

from __future__ import annotations

import bisect
import threading
import time
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import _ext

# Operations that make an alias or read metadata only, never values.
_NOT_READS = frozenset({
    "detach", "detach_", "view", "view_as", "size", "dim", "numel", "nelement", "ndimension", "stride",
    "storage_offset", "is_contiguous", "data_ptr", "element_size", "untyped_storage", "is_floating_point",
    "is_complex", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "__len__",
    "__hash__", "__format__", "get_device", "is_shared", "is_pinned", "_is_view",
    "__get__", "__set__", "__delete__",  # attributes: .grad, .data, .shape; a later op on .data is a read
})


def _name(func) -> str:
    return getattr(func, "__name__", "")


class Addresses:
    """Which tracked parameters an operation's tensor arguments lie in, by memory.

    Each parameter's memory as [start, end) byte addresses: a tensor whose
    data pointer falls inside is the parameter or an alias of part of it
    (``p``, ``p.detach()``, ``p.data``, views). Addresses, not
    ``untyped_storage()``: asking every argument for its storage would give
    our gradient buffers' storages Python objects (see ``_slot`` in
    ``wrapper.py``).
    """

    def __init__(self, params, pending=None):
        self._params = [weakref.ref(p) for p in params]
        self._ranges = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), i)
                              for i, p in enumerate(params) if p.numel())
        # The guard's table (``pending``: the optimizer's per-tensor flags): the same search in C++, with the
        # pending filter after it (Note [Guard cost]).
        self._table = None if pending is None else _ext.load().AddressTable(self._ranges, pending)
        self._pending = pending
        self._starts = [r[0] for r in self._ranges]
        # The span of all parameters' memory: most arguments (activations) start above it or end below it,
        # which one or two comparisons show (Note [Guard cost]).
        self._lo = self._ranges[0][0] if self._ranges else 0
        self._hi = max((r[1] for r in self._ranges), default=0)
        self._apart: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # other table -> apart_from()

    def param(self, i: int):
        """Tracked parameter ``i`` itself (None once it is gone)."""
        return self._params[i]()

    def apart_from(self, other: Addresses) -> bool:
        """Whether no parameter here shares a byte with one of ``other``'s (Note [Several guards]). Asked again
        for the same pair of tables (one per memory layout of each optimizer), the answer is remembered."""
        known = self._apart.get(other)
        if known is None:
            known = self._apart[other] = _disjoint(self._ranges, other._ranges)
        return known

    def pending_read_by(self, args, kwargs) -> list[int]:
        """The pending parameters (by the flags given when made) whose memory the arguments touch, each once, in
        the order first touched: :meth:`read_by`, filtered."""
        if self._table is not None:
            return self._table.pending_touched(args, kwargs)
        pending = self._pending
        return [i for i in dict.fromkeys(self.read_by(args, kwargs)) if pending[i]]

    def read_by(self, args, kwargs) -> list[int]:
        """Indices of the parameters whose memory the arguments touch (an index may come more than once); a
        tensor over several parameters (a flat buffer they are views of) touches each of them. Tensors are
        looked for among the arguments and one level into lists and tuples (how torch functions take them)."""
        hits: list[int] = []
        self._scan(args, hits)
        if kwargs:
            self._scan(kwargs.values(), hits)
        return hits

    def _scan(self, values, hits: list[int]) -> None:
        for a in values:
            if isinstance(a, torch.Tensor):
                self._touch(a, hits)
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, torch.Tensor):
                        self._touch(b, hits)

    def _touch(self, t: torch.Tensor, hits: list[int]) -> None:
        try:
            ptr = t.data_ptr()
        except RuntimeError:  # sparse, fake or functional tensors have no address: not a parameter
            return
        if not ptr or ptr >= self._hi:
            return
        end = ptr + _extent_bytes(t)
        if end <= self._lo or end == ptr:  # below every parameter, or empty
            return
        ranges = self._ranges
        k = max(bisect.bisect_right(self._starts, ptr) - 1, 0)
        while k < len(ranges) and ranges[k][0] < end:
            if ranges[k][1] > ptr:
                hits.append(ranges[k][2])
            k += 1


ENTRIES_KEPT = 1024
"""Modules where a forward began at the top, kept by the first-read tracer while it watches (once per learning,
never on the steady path): a script that calls its blocks one by one at the top level (no module around them),
and a head after them, has them all looked at (Note [Parameters outside the optimizer] in ``checks.py``)."""


class FirstReadTracer(TorchFunctionMode):
    """Records, per tracked parameter, the module whose forward first reads it (Note [First read])."""

    def __init__(self, params, owner):
        super().__init__()
        self._owner = weakref.ref(owner)  # an optimizer dropped mid-watch leaves us inert, not recording
        self._addresses = Addresses(params)
        self._stack: list = []
        self.readers: dict[int, weakref.ref | None] = {}
        """Tensor index -> weak reference to the module whose forward read it first, or None (outside any forward)."""
        self.first_read_ns: dict[int, int] = {}
        self.modules: weakref.WeakSet = weakref.WeakSet()
        """Every module whose forward ran while we watched."""
        self.embedded_by: dict[int, list] = {}
        """Tensor index -> weak references to the ``nn.Embedding`` modules whose own forward looked rows of it
        up (``F.embedding`` with the module's own weight; Note [Embedding rows] in ``rows.py``)."""
        self.read_otherwise: set[int] = set()
        """Tensors read by any other operation while we watched (a tied output layer, a regulariser)."""
        self.renormed_by: dict[int, str] = {}
        """Tensor index -> the embedding module (its class and ``max_norm``) whose forward renormalises, in place,
        the rows of it that the batch looks up (``nn.Embedding(max_norm=...)``, ``nn.EmbeddingBag``'s too)."""
        self.entries: list[weakref.ref] = []
        """The modules whose forward began at the top (no module's forward around it) on the watching thread,
        in order, the first :data:`ENTRIES_KEPT`: where the next forward is expected to begin (Note [Resting
        hooks] in ``updates.py``), and which modules the model is made of, and which were called apart after it
        (Note [Parameters outside the optimizer] in ``checks.py``)."""
        self.ops_to_first_read: int | None = None
        self.first_read_in: weakref.ref | None = None
        """The first read of a tracked parameter: how many torch operations the forward it came in (begun at the
        top by module ``first_read_in``) had run before it; None where it came outside any forward (Note [Resting
        hooks] in ``updates.py``)."""
        self._ops: int | None = None  # counting them, from the beginning of each forward while nothing is read
        self._thread = threading.get_ident()
        self.active = False
        self._hooks: list = []

    # ---- lifetime ------------------------------------------------------------

    def start(self) -> None:
        # Tracers of optimizers that were dropped while watching are still on
        # the stack (only their own thread could pop them): pop those on top.
        while True:
            stack = torch.overrides._get_current_function_mode_stack()
            if not (stack and isinstance(stack[-1], FirstReadTracer) and stack[-1]._owner() is None):
                break
            stack[-1].close()
        self.active = True
        # Dynamo must not trace our hooks (a compiled model runs them inside
        # its frame): disabled, they run eagerly, at a graph break.
        self._hooks = [
            torch.nn.modules.module.register_module_forward_pre_hook(torch.compiler.disable(self._enter_module)),
            torch.nn.modules.module.register_module_forward_hook(torch.compiler.disable(self._leave_module),
                                                                 always_call=True),
        ]
        self.__enter__()

    def stop_recording(self) -> None:
        """No more records (safe from any thread, e.g. a backward hook); the mode stays pushed until :meth:`close`."""
        self.active = False

    def close(self) -> bool:
        """Leave the mode and drop the hooks, on the thread that started it. False if another mode sits on top
        of ours (then we stay inert and the caller retries later)."""
        self.active = False
        for h in self._hooks:
            h.remove()
        self._hooks = []
        stack = torch.overrides._get_current_function_mode_stack()
        if self in stack:
            if stack[-1] is not self:
                return False
            self.__exit__(None, None, None)
        return True

    # ---- recording -----------------------------------------------------------

    def _enter_module(self, module, args) -> None:
        if self.active:
            if not self._stack and len(self.entries) < ENTRIES_KEPT and threading.get_ident() == self._thread:
                self.entries.append(weakref.ref(module))
            if not self._stack and not self.readers:
                self._ops = 0
            self._stack.append(module)
            self.modules.add(module)

    def _leave_module(self, module, args, output) -> None:
        if self._stack and self._stack[-1] is module:
            self._stack.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.active and _name(func) not in _NOT_READS:
            if self._owner() is None:
                self.active = False
            elif self._record(func, args, kwargs) and self._ops is not None:
                if self._stack:
                    self.ops_to_first_read, self.first_read_in = self._ops, weakref.ref(self._stack[0])
                self._ops = None
            elif self._ops is not None:
                self._ops += 1
        return func(*args, **kwargs)

    def _record(self, func, args, kwargs) -> bool:
        """Note what ``func`` reads of the tracked parameters; True if it reads any."""
        module = self._stack[-1] if self._stack else None
        lookup = None  # the parameter this call looks rows up in, as its module's own embedding
        if func is F.embedding and isinstance(module, torch.nn.Embedding):
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if weight is module.weight:
                lookup = weight
        read = False
        renorm = (getattr(module, "max_norm", None) is not None
                  and isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)))
        for i in self._addresses.read_by(args, kwargs):
            read = True
            if renorm and self._is_param(i, module.weight):
                self.renormed_by.setdefault(i, f"{type(module).__name__}(max_norm={module.max_norm})")
            if i not in self.readers:
                self.readers[i] = weakref.ref(module) if module is not None else None
                self.first_read_ns[i] = time.perf_counter_ns()
            if lookup is not None and self._is_param(i, lookup):
                refs = self.embedded_by.setdefault(i, [])
                if not any(r() is module for r in refs):
                    refs.append(weakref.ref(module))
            else:
                self.read_otherwise.add(i)
        return read

    def _is_param(self, i: int, t: torch.Tensor) -> bool:
        return self._addresses.param(i) is t


_SET_DATA = torch.Tensor.data.__set__
_dynamo_compiling = torch.compiler.is_dynamo_compiling
# What the guard lets pass. data_ptr() and untyped_storage() are reads to it: custom kernels and the pickler
# (torch.save) take the values from there. The tracer does not count them: a checkpoint saved after every
# step() (state_dict() applies what is pending first) must not turn the lazy step off.
# Nor are aliases that autograd records (``p.view(-1)`` in ``parameters_to_vector``, ``p.T``): the graph made
# from the old value would show as a stale read at the apply (Note [Graph reads]), though no value was read;
# the update is applied before the alias is made instead.
_GUARD_NOT_READS = _NOT_READS - {"data_ptr", "untyped_storage", "view", "view_as"}
GRAPH_ALIAS_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "real", "imag"})
_GET = "__get__"


def attribute_of(func) -> str:
    """For a torch function that gets or sets a tensor attribute (``__get__``/``__set__`` of a descriptor),
    the attribute's name; "" otherwise."""
    return getattr(getattr(func, "__self__", None), "__name__", "")


def _guard_reads(func) -> bool:
    """Whether the guard takes ``func`` for a read of its tensor arguments."""
    name = getattr(func, "__name__", "")
    if name == _GET:
        return attribute_of(func) in GRAPH_ALIAS_ATTRIBUTES
    return name not in _GUARD_NOT_READS or func == _SET_DATA


class PendingReadGuard(TorchFunctionMode):
    """Applies a pending update at any read of its parameter that comes first (Note [Guarded reads]).

    One per optimizer. Armed at the end of a lazy ``step()``, at the bottom of
    the mode stack (so that a script's own modes and ``with
    torch.device(...)`` blocks enter and leave above it undisturbed); it
    disarms once nothing is pending and then leaves the stack at the first
    chance (outside its own handler), so that no torch operation pays for it
    and torch's C++ fast paths, which step aside while any mode is active,
    come back.
    """

    def __init__(self, keeper):
        super().__init__()
        self._keeper = keeper  # the optimizer: strongly while updates wait (lazy.Keeper)
        self._addresses = None
        self._where = None  # the parameters' data pointers the address table was built from
        self.armed = False

    def arm(self, params, where, pending) -> None:
        """From here on, a read of a pending parameter applies its update first (on the training thread).
        ``where``: the parameters' data addresses now (one C++ call, not one per parameter); ``pending``: the
        optimizer's per-tensor flags, read at each operation."""
        # Rebuilt only when some parameter's memory moved (a script may replace a parameter's .data):
        # comparing the addresses costs far less than sorting them again at every step().
        if self._addresses is None or where != self._where or self._addresses._pending is not pending:
            self._addresses, self._where = Addresses(params, pending), where
        if not _stack_len():  # the common case: nothing else on the stack, no other guard to look at
            torch._C._push_on_torch_function_stack(self)
        elif not _on_stack(self):
            _drop_inert_guards()
            _insert_at_bottom(self)
        self.armed = True

    def remove(self) -> None:
        """Disarm and leave the mode stack (on the training thread; elsewhere, or inside this guard's own
        handler, where torch has taken it off the stack for the call, it stays inert until the next chance)."""
        self.armed = False
        _remove_from_stack(self)

    def paused(self, others=""):
        """Our own work (gradients and slots, the wrapped step on the parameters it updates): the guard
        leaves this thread's mode stack for it, so those calls do not come to it at all, and returns to the
        bottom afterwards if it was there (user modes and tensor subclasses still see every call). Inside
        the guard's own handler, where torch has lifted it already, it only disarms.

        ``others`` (Note [Several guards]): the guards of our other optimizers on this stack leave it too,
        where they could see nothing of the work inside: ``"all"`` for work that touches no tensor's values
        (``p.grad = None``), ``"apart"`` for work that touches only this optimizer's parameters (a wrapped
        step that updates each parameter on its own), each guard then only if no parameter of its
        shares memory with one of ours. A callable for ``others`` is asked for that string only where another
        mode is on the stack (the common case has none: the question costs nothing then)."""
        return _Paused(self, others)

    def leave_if_idle(self) -> None:
        if not self.armed:
            _remove_from_stack(self)

    def inert(self) -> bool:
        core = self._keeper()
        return core is None or core.closed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Inside code that Dynamo traces the guard is a plain pass-through (no guard on our attributes, so
        # arming and disarming never recompile anything). Every torch operation of the forward comes here:
        # the common case (no parameter among the arguments) must cost little (Note [Guard cost]).
        # `p.data = x` replaces what it reads; `==`, not `is`: every lookup of a slot wrapper's __set__ makes a
        # new (equal) method object.
        if self.armed and not _dynamo_compiling() and _guard_reads(func):
            core = self._keeper()
            lazy = None if core is None else core.lazy
            if lazy is None or not lazy.npending:
                self.armed = False
            else:
                read = self._addresses.pending_read_by(args, kwargs)
                if read:
                    core.apply_on_read(read)
        return func(*args, **kwargs) if kwargs else func(*args)


class _Paused:
    """``PendingReadGuard.paused()``: a class, not a generator, since it runs once per gradient; with no
    mode on this thread's stack (the common case in backward) it costs one C call and two attribute swaps."""

    __slots__ = ("_armed", "_guard", "_lifted", "_lifted_others", "_others")

    def __init__(self, guard: PendingReadGuard, others=""):
        self._guard = guard
        self._others = others

    def __enter__(self):  # the pause itself, for stay_off()
        guard = self._guard
        self._armed, guard.armed = guard.armed, False
        self._lifted = _remove_from_stack(guard)
        others = self._others
        if others and _stack_len():
            self._lifted_others = _lift_other_guards(guard, others() if callable(others) else others)
        else:
            self._lifted_others = ()
        return self

    def stay_off(self) -> None:
        """The work inside applies every update still pending: the guard stays off the stack and disarmed
        at the end, rather than going back to the bottom only to leave again (the caller then marks the
        updates applied, whose ``remove()`` finds nothing to do)."""
        self._armed = self._lifted = False

    def __exit__(self, *exc) -> None:
        for other in reversed(self._lifted_others):  # back under everything, in the order they were in
            _insert_at_bottom(other)
        if self._lifted:
            _insert_at_bottom(self._guard)
        self._guard.armed = self._armed


def _lift_other_guards(guard: PendingReadGuard, others: str) -> list:
    """``paused(others)``: the armed guards of our other optimizers that may leave this thread's stack,
    taken off it, bottom first."""
    ours = guard._addresses
    lifted = []
    if not others:
        return lifted
    for m in [_stack_at(k) for k in range(_stack_len())]:
        if (isinstance(m, PendingReadGuard) and m is not guard and m.armed
                and (others == "all" or (ours is not None and m._addresses is not None
                                         and ours.apart_from(m._addresses)))):
            _remove_from_stack(m)
            lifted.append(m)
    return lifted


def _insert_at_bottom(mode: TorchFunctionMode) -> None:
    """Push ``mode`` under every mode now on this thread's stack (torch's stack functions, as
    ``TorchFunctionMode.__enter__``/``__exit__`` use them)."""
    above = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    torch._C._push_on_torch_function_stack(mode)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)


_stack_len = torch._C._len_torch_function_stack
_stack_at = torch._C._get_function_stack_at


def _on_stack(mode: TorchFunctionMode) -> bool:
    """Whether ``mode`` is on this thread's stack (without building torch's list of the stack)."""
    return any(_stack_at(k) is mode for k in range(_stack_len()))


def _remove_from_stack(mode: TorchFunctionMode) -> bool:
    """Take ``mode`` off this thread's stack, the modes above it staying in order; False if it was not there."""
    n = _stack_len()
    if not n:
        return False  # the common case once nothing is pending: every module's forward asks
    if _stack_at(n - 1) is mode:  # on top: the guard alone, the common case while updates wait
        torch._C._pop_torch_function_stack()
        return True
    if not _on_stack(mode):
        return False
    above = []
    while True:
        m = torch._C._pop_torch_function_stack()
        if m is mode:
            break
        above.append(m)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)
    return True


def _drop_inert_guards() -> None:
    """Guards of optimizers closed or dropped elsewhere (another thread, a finalizer) leave this stack."""
    for m in [_stack_at(k) for k in range(_stack_len())]:
        if isinstance(m, PendingReadGuard) and m.inert():
            _remove_from_stack(m)


def _disjoint(a: list[tuple], b: list[tuple]) -> bool:
    """Whether two lists of [start, end) byte ranges, each sorted by start, share no byte."""
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][1] <= b[j][0]:
            i += 1
        elif b[j][1] <= a[i][0]:
            j += 1
        else:
            return False
    return True


def _extent_bytes(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to just past its last, strides included."""
    if t.is_contiguous():
        return t.numel() * t.element_size()
    return (sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0) + 1) * t.element_size()
