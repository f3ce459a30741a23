"""What ``p.grad`` is while its reduction may still run: the slot, seen through a subclass that waits at a read.

Note [Gradient reads]
---------------------
After ``backward()``, ``p.grad`` means what DDP gives: the averaged gradient
(DESIGN invariant 10). Ours is still being reduced then: blocks travel until
``step()`` and, with the lazy step, into the next forward. So after its
hook ``p.grad`` is not the slot itself but a :class:`WatchedGradient`: an
alias of the slot's memory (same storage, same version counter) whose class
is a ``torch.Tensor`` subclass. Its ``__torch_function__`` sees every torch
operation that user code applies to it, on any thread, with no mode on any
stack. An operation that reads values or makes an alias (anything but
metadata: ``.shape``, ``.dtype``, ``size()``, ``.grad``...) first waits for
that gradient's reduction, releasing the rest of the iteration's blocks
first as ``step()`` would (``Backward.gradients_read`` in ``gradients.py``;
once no block is in flight, a read makes every gradient of the iteration
final at once, and the reads after it pass without a wait or a check);
then it runs on the plain tensor and returns plain tensors. So
``p.grad.norm()``, ``clip_grad_norm_``, ``scaler.unscale_`` and
``p.grad = p.grad * 0.5`` see the averaged gradient, and an in-place
change lands on it and is what ``step()`` uses. An in-place change between a
lazy ``step()`` and the next backward (``model.zero_grad(set_to_none=False)``
after ``step()``, as older scripts do) lands on a gradient whose update still
waits for it: the pending updates are applied first (``Core.gradients_read``
with ``writes``), so the change lands on the gradient as plain torch has it
after ``step()``; on another thread than the one that called ``step()`` it
is refused (applying there would race the next forward).

Note [A scaler's unscale_]
--------------------------
The recipe for clipping under AMP (``scaler.unscale_(opt)``, clip,
``scaler.step(opt)``) works as under DDP. ``unscale_`` lists every
``p.grad`` that is not None, then unscales them in place with one operation
per device and dtype, which the watch sees: it waits for their reductions,
so the scaler unscales and checks the averaged gradients, alike on every
rank. The list must hold the same tensors on every rank: a tensor this
rank did not reach, which another rank used, has ``p.grad`` when the scaler
lists it (the zeros that stand for the other ranks' sum, Note [Unused
here] in ``usage.py``); left out here and unscaled there, its average would
be clipped and stepped 65536 times too large on this rank alone. So each
optimizer notes the gradients the operation unscales
(``Core.scaler_unscales``), and ``step()`` checks that every gradient of
ours was unscaled (``Stepper.scaled_skip``), refusing, with the gradient's
name, where one was not: an optimizer whose tensors this rank's backward
did not reach at all (Note [Missed here] in ``core.py``), whose ``p.grad``
stay None until its flush.

Note [Unseen writes]
--------------------
``p.grad.data`` is an alias of the slot with a version counter of its own
(so is a NumPy array over it): ``p.grad.data.zero_()`` after a lazy
``step()`` would zero the reduced gradient that a pending update still
needs, and neither the watch (the write is an operation on a plain tensor)
nor the slot's version counter would see it: the update would be applied
with zeros, silently. So taking such an alias (``.data``, ``detach()``,
``numpy()``) counts as a write: between ``step()`` and the next backward the
pending updates are applied first. ``p.grad.data`` taken while the iteration
is open waits for the reduction, as any read does, and a write through it
lands on the averaged gradient that ``step()`` uses. An alias taken earlier
and kept is Note [Kept aliases].

Note [Kept aliases]
-------------------
A ``.data`` or ``detach()`` alias taken once and kept (``g = p.grad.data``,
written every iteration; a loop variable that simply stays alive) aliases
the slot, which every later iteration's gradient goes into, while in plain
torch it aliases one gradient tensor: ``p.grad`` itself as long as nothing
drops it (``zero_grad(set_to_none=False)``), a tensor nothing uses any more
once ``zero_grad()`` sets ``p.grad`` to None. A write through it would land
in the slot whatever its reduction is doing, unseen (through ``.data`` not
even the version counter moves). So each such alias is held weakly
(``GradientBuffers.keep_alias``), and while it is alive:

- where ``p.grad`` was dropped (our ``zero_grad()`` to None, or found not
  ours at the next iteration's first gradient), the alias gets memory of
  its own with what it held: the old gradient, as in plain torch;
- where ``p.grad`` is still the slot at the next iteration's first gradient,
  that backward ends by releasing every block and waiting for the tensor's
  reduction (a final callback of autograd's), so that a write through the
  alias after ``backward()`` lands on the averaged gradient that ``step()``
  uses, as with DDP, whose reduction ends inside backward;
- ``step()`` applies that tensor's update itself rather than at the next
  forward, so that a write after ``step()`` (``g.zero_()``) comes after the
  update, as in plain torch.

Nothing of this runs while no alias was taken. A NumPy array over a
gradient cannot be given other memory, and a view taken of such an alias
(``p.grad.data[0]``) is not seen: either kept across iterations is beyond
this note.

A ``p.grad`` replaced after
``backward()`` (a new tensor, or ``None``) is what ``step()`` uses for that
parameter (Note [Replaced gradients] in ``wrapper.py``).

Our own code hands the plain slot to the collectives and to the wrapped
optimizer's step, so neither pays for the subclass; a watched gradient's
only cost is one Python call per operation that user code applies to it,
and one per foreach operation over many (``clip_grad_norm_`` takes torch's
foreach path with them, as with plain tensors: ``_take_foreach_paths``),
whose tensors wait together. Once every gradient of the iteration is final
(the first read waited for them all) and nothing is pending that a write
must come after, the watch returns without listing the tensors
(``Core.reads_wait``): the clip's second foreach call costs the subclass's
dispatch alone.
Inside a backward (a user's hook that runs after ours), a read of a
gradient already handed to the scheduler cannot wait (the rest of the
iteration's blocks are not released yet): it raises a ``DCreditError``.
Assigning ``p.grad.data`` (``model.to()`` after wrapping does) would
detach the alias from its slot: refused too, unless the new data is the
gradient itself (``model.to()`` to the device and dtype it already has).
"""

from __future__ import annotations

import operator

import torch
import torch.utils._foreach_utils

from ..errors import DCreditError
from .reads import GRAPH_ALIAS_ATTRIBUTES, attribute_of

# Functions that read metadata only, never values, and make no alias.
_METADATA = frozenset({
    "size", "dim", "numel", "nelement", "ndimension", "stride", "storage_offset", "is_contiguous",
    "element_size", "is_floating_point", "is_complex", "requires_grad_", "register_hook", "__len__", "__hash__",
    "get_device", "is_shared", "is_pinned", "_is_view", "__sizeof__",
})
# Attributes whose getter reads values or makes an alias; every other attribute (shape, dtype, device,
# grad, is_sparse, _version...) is metadata.
_ALIAS_ATTRIBUTES = GRAPH_ALIAS_ATTRIBUTES | {"data"}
# In-place operators that do not end with an underscore (``p.grad += x``, ``p.grad[k] = 0``).
_INPLACE_OPERATORS = frozenset({
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__", "__imatmul__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__setitem__",
})
# Note [Unseen writes]: aliases that older scripts write gradients through (``p.grad.data.zero_()``,
# ``p.grad.detach().mul_(s)``, NumPy): the write itself is an operation on a plain tensor, which we never see,
# and through ``.data`` or NumPy not even the slot's version counter moves. So taking the alias counts as a write.
_WRITABLE_ALIASES = frozenset({"detach", "numpy", "__array__"})
# Copies and pickles of a watched gradient are plain tensors: what they carry is values, not our watch.
_PLAIN_COPIES = frozenset({"__deepcopy__", "__reduce_ex__", "__reduce__", "__getstate__"})


class _Fixed:
    """An attribute of a watched gradient that no operation changes (Note [Metadata reads]): where the gradient was
    made by ``WatchedGradient.of``, its value as it was then, without the watch's call; else torch's own getter."""

    __slots__ = ("_getter", "_key", "_name")

    def __init__(self, name: str):
        self._name, self._key, self._getter = name, "_dc_" + name, getattr(torch._C.TensorBase, name).__get__

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = obj.__dict__.get(self._key, _NOT_KEPT)
        if value is _NOT_KEPT:
            with torch._C.DisableTorchFunctionSubclass():
                return self._getter(obj)
        return value

    def __set__(self, obj, value):
        raise AttributeError(f"attribute '{self._name}' of a tensor is not writable")

    def keep(self, obj) -> None:
        with torch._C.DisableTorchFunctionSubclass():
            obj.__dict__[self._key] = self._getter(obj)


_NOT_KEPT = object()


class WatchedGradient(torch.Tensor):
    """``p.grad`` after its hook: the slot's memory; any read first waits for its reduction (Note [Gradient
    reads]). ``_dc_index`` is the tensor's index in its optimizer, ``_dc_keeper`` reaches that optimizer's core."""

    _dc_keeper = None  # one made outside our hooks (torch may make one) belongs to no optimizer
    _dc_index = -1
    # Note [Metadata reads]
    # Every attribute read of a tensor subclass goes through its __torch_function__, a Python call of 2-3 us,
    # metadata included: GradScaler.unscale_ reads .dtype twice, .is_sparse and .device of each gradient, 4 calls
    # per tensor (740 us per iteration over 98 tensors, 4.6x its own time). A tensor's dtype, device and layout
    # never change (an in-place set_() may move it: those are read again after one), so a watched gradient
    # keeps them when made, and these descriptors, found on the class before torch's getters, answer from
    # there. Nothing else changes: shape, strides, grad_fn and the values still go through the watch.
    dtype = _Fixed("dtype")
    device = _Fixed("device")
    layout = _Fixed("layout")
    is_sparse = _Fixed("is_sparse")
    is_cuda = _Fixed("is_cuda")
    _FIXED = (dtype, device, layout, is_sparse, is_cuda)

    @staticmethod
    def of(slot: torch.Tensor, index: int, keeper) -> WatchedGradient:
        watched = slot.as_subclass(WatchedGradient)  # an alias: same memory and version counter as the slot
        watched._dc_index = index
        watched._dc_keeper = keeper
        for fixed in WatchedGradient._FIXED:
            fixed.keep(watched)
        return watched

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        name = getattr(func, "__name__", "")
        if name == "__get__":
            attribute = attribute_of(func)
            reads = attribute in _ALIAS_ATTRIBUTES
            writes = attribute == "data"  # Note [Unseen writes]
        elif name == "__set__":
            if attribute_of(func) == "data":
                _refuse_data_assignment(args)
            reads = writes = False
        else:
            kind = _KINDS.get(name)
            if kind is None:
                kind = _KINDS[name] = (name not in _METADATA, _writes_in_place(name))
            reads, in_place = kind
            writes = (in_place and bool(args) and _has_watched(args[0])) or (
                "out" in kwargs and _has_watched(kwargs["out"]))
        if reads:
            _wait_for(args, kwargs, writes)
            if name == "_amp_foreach_non_finite_check_and_unscale_":
                _mark_unscaled(args, kwargs)
        if name in _PLAIN_COPIES and args and isinstance(args[0], WatchedGradient):
            args = (plain(args[0]), *args[1:])
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if writes and (name == "detach" or name == "__get__") and isinstance(result, torch.Tensor):
            _keep(args[0], result)  # Note [Kept aliases]
        elif name == "set_" and args and isinstance(args[0], WatchedGradient):  # Note [Metadata reads]
            for fixed in WatchedGradient._FIXED:
                fixed.keep(args[0])
        return result


def _take_foreach_paths() -> None:
    """torch's own foreach paths (``clip_grad_norm_``, ``clip_grad_value_``...) take only tensors of the types in
    this list, and run one operation per tensor otherwise, each through our ``__torch_function__``. A watched
    gradient is a dense tensor, and one foreach operation over many of them waits for them all in one call
    (``_wait_for``), so it joins the list. Where a torch has no such list, those paths stay per tensor: slower,
    the same result."""
    supported = getattr(torch.utils._foreach_utils, "_foreach_supported_types", None)
    if isinstance(supported, list) and WatchedGradient not in supported:
        supported.append(WatchedGradient)


_take_foreach_paths()


def plain(t: torch.Tensor) -> torch.Tensor:
    """A plain ``torch.Tensor`` alias of ``t`` (``t`` itself when it is one)."""
    if type(t) is torch.Tensor:
        return t
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor)


# An operation may change a watched gradient in place where it is ``zero_``, ``mul_``, ``_foreach_mul_``, ``+=`` or
# ``[k] =`` on one (its first argument), ``out=`` one, or makes an alias of one to write through (Note [Unseen
# writes]); ``buf.copy_(p.grad)`` reads the gradient only. Per operation name, whether it reads values and whether
# it writes its first argument, worked out once (the watch sees every operation on a gradient).
_KINDS: dict[str, tuple[bool, bool]] = {}


def _writes_in_place(name: str) -> bool:
    return ((name.endswith("_") and not name.endswith("__")) or name in _INPLACE_OPERATORS
            or name in _WRITABLE_ALIASES)


def _has_watched(t) -> bool:
    """``t`` is a watched gradient, or a list or tuple holding one."""
    if isinstance(t, WatchedGradient):
        return True
    return isinstance(t, (list, tuple)) and any(isinstance(x, WatchedGradient) for x in t)


def _wait_for(args, kwargs, writes: bool) -> None:
    """Every watched gradient among the operation's arguments (in lists too: foreach calls) waits, one call per
    optimizer for all of its own; ``writes``: the operation may change them in place."""
    if not kwargs and 0 < len(args) <= 2 and type(args[0]) is WatchedGradient and (
            len(args) == 1 or not isinstance(args[1], _MAY_HOLD_TENSORS)):
        # One gradient, and a number or none (g.mul_(s), g.norm(), torch.linalg.vector_norm(g, 2.0): a script that
        # reads or scales its gradients one by one), as the loop below finds it, without the lists.
        keeper = args[0]._dc_keeper
        core = None if keeper is None else keeper()
        if core is not None and core.reads_wait(writes):
            core.gradients_read([args[0]._dc_index], writes)
        return
    watched = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, WatchedGradient):
            watched.append(a)
        elif isinstance(a, (list, tuple)):
            watched += [b for b in a if isinstance(b, WatchedGradient)]
    if not watched:
        return
    keepers = set(map(_keeper_of, watched))  # None: made outside our hooks
    if len(keepers) == 1 and None not in keepers:  # one optimizer's gradients (the common case)
        core = keepers.pop()()
        if core is not None and core.reads_wait(writes):  # after the first read of an iteration, seldom
            core.gradients_read(list(map(_index_of, watched)), writes)
        return
    for keeper, indices in _indices_by_keeper(watched).items():
        core = keeper()
        if core is not None:
            core.gradients_read(indices, writes)


def _indices_by_keeper(tensors) -> dict:
    """The watched gradients among ``tensors``, as each optimizer's (its weak reference) indices."""
    out: dict = {}
    for t in tensors:
        if isinstance(t, WatchedGradient) and t._dc_keeper is not None:
            out.setdefault(t._dc_keeper, []).append(t._dc_index)
    return out


_MAY_HOLD_TENSORS = (torch.Tensor, list, tuple)
_keeper_of = operator.attrgetter("_dc_keeper")
_index_of = operator.attrgetter("_dc_index")


def _mark_unscaled(args, kwargs) -> None:
    """Note [A scaler's unscale_]: ``torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf,
    inv_scale)``, by which ``GradScaler.unscale_(optimizer)`` unscales its list of ``p.grad``, waited for: each
    optimizer notes which of its gradients it unscales."""
    grads = args[0] if args else kwargs.get("self")
    for keeper, indices in _indices_by_keeper(grads if isinstance(grads, (list, tuple)) else ()).items():
        core = keeper()
        if core is not None:
            core.scaler_unscales(indices)


def _keep(watched, alias: torch.Tensor) -> None:
    """Note [Kept aliases]: ``alias`` (``.data`` or ``detach()``) of ``watched`` may outlive this iteration."""
    keeper = getattr(watched, "_dc_keeper", None)
    core = keeper() if keeper is not None else None
    if core is not None and not core.closed:
        core.buffers.keep_alias(watched._dc_index, alias)


def _refuse_data_assignment(args) -> None:
    target = args[0] if args else None
    keeper = getattr(target, "_dc_keeper", None)
    core = keeper() if keeper is not None else None
    if core is None or core.closed:
        return
    if len(args) > 1 and args[1] is target:
        return  # `g.data = g`: model.to() or .float() to the device and dtype it already has changes nothing
    name = core.names[target._dc_index]
    raise DCreditError(
        f"p.grad.data of parameter '{name}' was assigned (model.to(), .cuda(), .half() after wrapping do that): "
        "dcredit_opt keeps that gradient in its own buffer, laid out for the parameter's dtype and device when "
        "the optimizer was wrapped. Cast or move the model first, then build the DistributedOptimizer "
        "(or call optimizer.zero_grad() before casting, so that no gradient exists)")
