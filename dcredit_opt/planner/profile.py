"""What the planner knows about one job: per-tensor timings and the network.

A profile is measured on the live job (``dcredit_opt.profiler``) or written
by hand, and is the only input of every policy. It is plain data and
round-trips through JSON; loading validates every field, so that a bad file
fails at load time with the field named rather than deep inside a policy.

Units are in the names: seconds (``_s``), bytes, elements (``numel``).
``alpha_s`` and ``beta_s_per_byte`` describe one all-reduce *at this
``world_size``* (``T(n) = alpha_s + beta_s_per_byte * n``), as fitted by
:func:`dcredit_opt.planner.cost.fit_alpha_beta`; they are not per-link
parameters (see :func:`dcredit_opt.planner.cost.ring_allreduce` for those).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Sequence
from typing import Any

from ..files import write_whole

PROFILE_VERSION = 1

RING_STAGE_RATIOS = (0.5, 0.5, 0.5, 0.5)
"""A ring (or halving-doubling) all-reduce *is* a reduce-scatter followed by an all-gather, each ``(p - 1)``
steps of ``n / p`` bytes (``cost.ring_allreduce``): each costs half of it in start-up and in transfer."""
"""Written into every saved profile; loading refuses other versions."""


class ProfileError(ValueError):
    """A profile that cannot be planned for; the message names the field."""


# Bytes per element. Names are torch's (``str(torch.float32)`` without the
# ``torch.`` prefix), so that a profile can be written without importing torch.
_DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
}
_DTYPE_ALIASES = {"double": "float64", "float": "float32", "half": "float16", "long": "int64",
                  "int": "int32", "short": "int16", "cdouble": "complex128", "cfloat": "complex64"}


@functools.lru_cache(maxsize=64)  # a model has a handful of dtypes; planners ask per block
def canonical_dtype(dtype: object) -> str:
    """``dtype`` (a name, ``"torch.float32"`` or a torch dtype) as a canonical name.

    Raises :class:`ProfileError` for a dtype whose size is unknown.
    """
    name = str(dtype)
    name = name.removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in _DTYPE_BYTES:
        raise ProfileError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(_DTYPE_BYTES))}")
    return name


def bytes_of(dtype: object) -> int:
    """Bytes per element of ``dtype`` (a name such as ``"float32"``, or a torch dtype)."""
    return _DTYPE_BYTES[canonical_dtype(dtype)]


@dataclasses.dataclass(frozen=True)
class TensorProfile:
    """One parameter's gradient: its size and the compute time that touches it."""

    name: str
    """The parameter's name (``model.named_parameters()``), for messages and timelines."""
    numel: int
    """Elements of the gradient."""
    dtype: str
    """Element type name, e.g. ``"float32"`` (see :func:`bytes_of`)."""
    forward_index: int
    """Position in forward order; 0 is nearest the input. Equals its place in ``Profile.tensors``."""
    fwd_s: float
    """Forward time of the computation that uses this parameter, in seconds."""
    bwd_s: float
    """Backward time until this gradient is final, counted from the previous gradient, in seconds."""

    @functools.cached_property  # a profile is immutable; planners ask for these per candidate
    def nbytes(self) -> int:
        return self.numel * bytes_of(self.dtype)


@dataclasses.dataclass(frozen=True)
class Profile:
    """Everything a policy needs: tensors in forward order and the all-reduce cost model."""

    tensors: tuple[TensorProfile, ...]
    """Tensors in forward order (``tensors[i].forward_index == i``)."""
    alpha_s: float
    """Start-up latency of one all-reduce at ``world_size`` ranks, in seconds."""
    beta_s_per_byte: float
    """Transfer time of one all-reduce per byte of the message at ``world_size`` ranks."""
    world_size: int
    """Ranks the cost model was measured (or scaled) for."""
    ready_order: tuple[int, ...] | None = None
    """Forward indices in the order their gradients became ready; ``None`` means reverse forward order."""
    stage_ratios: tuple[float, float, float, float] = RING_STAGE_RATIOS
    """A reduce-scatter's and an all-gather's start-up and per-byte time as shares of the all-reduce's
    ``(alpha, beta)``: ``(rs_alpha, rs_beta, ag_alpha, ag_beta)``. The ring formula's halves unless measured
    (the profiler fits them on the live job: Gloo's reduce-scatter, for one, costs more than its all-reduce).
    Ratios rather than times, so that a profile scaled to another world size keeps them."""
    host_s_per_collective: float = 0.0
    """Host time one collective costs an iteration, whatever the link: handing its block to the scheduler,
    waking the thread that launches it, the backend's own work and its completion, on cores the training
    thread shares. The simulator adds it per collective to the iteration; where the link is cheap (one machine,
    NVLink, a world of one) it is what tells a plan of a few large blocks from one of many small ones, which
    the link alone finds equally fast. 0 in a hand-written profile unless given."""

    def __post_init__(self) -> None:
        # Lists are accepted (they come from JSON or from hand-written code)
        # but stored as tuples so that a profile is hashable and immutable.
        object.__setattr__(self, "tensors", tuple(self.tensors))
        if isinstance(self.stage_ratios, (list, tuple)):
            object.__setattr__(self, "stage_ratios", tuple(self.stage_ratios))
        if self.ready_order is not None:
            if isinstance(self.ready_order, (str, bytes)) or not isinstance(self.ready_order, Sequence):
                raise ProfileError(f"ready_order is {self.ready_order!r}; expected a list of tensor indices or null")
            object.__setattr__(self, "ready_order", tuple(self.ready_order))
        _check(self)

    # -- derived views -------------------------------------------------------

    @property
    def num_tensors(self) -> int:
        return len(self.tensors)

    @functools.cached_property  # a profile is immutable; planners ask for these per candidate
    def numels(self) -> tuple[int, ...]:
        return tuple(t.numel for t in self.tensors)

    @functools.cached_property  # a profile is immutable; planners ask for these per candidate
    def dtypes(self) -> tuple[str, ...]:
        return tuple(canonical_dtype(t.dtype) for t in self.tensors)

    @functools.cached_property  # a profile is immutable; planners ask for these per candidate
    def nbytes(self) -> tuple[int, ...]:
        return tuple(t.nbytes for t in self.tensors)

    @functools.cached_property  # a profile is immutable; planners ask for these per candidate
    def total_bytes(self) -> int:
        return sum(self.nbytes)

    def stage_cost(self, op: int) -> tuple[float, float]:
        """``(alpha_s, beta_s_per_byte)`` of one collective: ``op`` is ``blockops.ALL_REDUCE`` (0),
        ``REDUCE_SCATTER`` (1) or ``ALL_GATHER`` (2)."""
        if op == 0:
            return self.alpha_s, self.beta_s_per_byte
        ra, rb = self.stage_ratios[2 * (op - 1): 2 * op]
        return self.alpha_s * ra, self.beta_s_per_byte * rb

    def order(self) -> tuple[int, ...]:
        """The ready order: measured if known, else reverse forward order (backward)."""
        if self.ready_order is not None:
            return self.ready_order
        return tuple(reversed(range(self.num_tensors)))

    # -- JSON ----------------------------------------------------------------

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["tensors"] = [dict(t) for t in data["tensors"]]
        data["ready_order"] = None if self.ready_order is None else list(self.ready_order)
        data["stage_ratios"] = list(self.stage_ratios)
        data["version"] = PROFILE_VERSION
        return data

    @classmethod
    def from_dict(cls, data: Any) -> Profile:
        if not isinstance(data, dict):
            raise ProfileError(f"a profile must be a JSON object, got {type(data).__name__}")
        version = data.get("version", PROFILE_VERSION)
        if version != PROFILE_VERSION:
            raise ProfileError(f"version is {version!r}; this planner reads version {PROFILE_VERSION}")
        body = {k: v for k, v in data.items() if k != "version"}
        _check_keys(body, {f.name for f in dataclasses.fields(cls)}, {"ready_order", "stage_ratios", "host_s_per_collective"},
                    where="")
        tensors = body["tensors"]
        if not isinstance(tensors, list):
            raise ProfileError(f"tensors is {_show(tensors)}; expected a list of tensor objects")
        tensor_fields = {f.name for f in dataclasses.fields(TensorProfile)}
        parsed = []
        for i, item in enumerate(tensors):
            where = f"tensors[{i}]"
            if not isinstance(item, dict):
                raise ProfileError(f"{where} is {_show(item)}; expected an object")
            _check_keys(item, tensor_fields, set(), where=where + ".")
            parsed.append(TensorProfile(**item))
        body["tensors"] = tuple(parsed)
        return cls(**body)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileError(f"not valid JSON: {e}") from None
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike) -> None:
        write_whole(path, self.to_json())  # Note [Whole files]

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())


# -- validation ----------------------------------------------------------------

def _show(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def _check_keys(data: dict, known: set[str], optional: set[str], where: str) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise ProfileError(f"unknown field {where}{unknown[0]}; known fields: {', '.join(sorted(known))}")
    for name in sorted(known - optional):
        if name not in data:
            raise ProfileError(f"{where}{name} is missing")


def _check_int(value: object, where: str, minimum: int) -> None:
    # bool is an int subclass; True as an element count is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProfileError(f"{where} is {_show(value)}; expected an integer")
    if value < minimum:
        raise ProfileError(f"{where} is {value}; it must be >= {minimum}")


def _check_time(value: object, where: str, what: str = "times") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"{where} is {_show(value)}; expected a number")
    if not math.isfinite(value):
        raise ProfileError(f"{where} is {value}; {what} must be finite")
    if value < 0:
        raise ProfileError(f"{where} is {value}; {what} must be >= 0")


def _check(p: Profile) -> None:
    for i, t in enumerate(p.tensors):
        where = f"tensors[{i}]"
        if not isinstance(t, TensorProfile):
            raise ProfileError(f"{where} is {_show(t)}; expected a TensorProfile")
        if not isinstance(t.name, str):
            raise ProfileError(f"{where}.name is {_show(t.name)}; expected a string")
        _check_int(t.numel, f"{where}.numel", 0)
        if not isinstance(t.dtype, str):
            raise ProfileError(f"{where}.dtype is {_show(t.dtype)}; expected a dtype name such as 'float32'")
        try:
            canonical_dtype(t.dtype)
        except ProfileError as e:
            raise ProfileError(f"{where}.dtype: {e}") from None
        _check_int(t.forward_index, f"{where}.forward_index", 0)
        if t.forward_index != i:
            raise ProfileError(f"{where}.forward_index is {t.forward_index}; tensors must be listed in forward "
                               f"order, so it must be {i}")
        _check_time(t.fwd_s, f"{where}.fwd_s")
        _check_time(t.bwd_s, f"{where}.bwd_s")
    _check_time(p.alpha_s, "alpha_s")
    _check_time(p.beta_s_per_byte, "beta_s_per_byte")
    _check_int(p.world_size, "world_size", 1)
    _check_time(p.host_s_per_collective, "host_s_per_collective")
    ratios = p.stage_ratios
    if not isinstance(ratios, tuple) or len(ratios) != 4:
        raise ProfileError(f"stage_ratios is {_show(ratios)}; expected 4 numbers (rs_alpha, rs_beta, ag_alpha, "
                           "ag_beta)")
    for j, r in enumerate(ratios):
        _check_time(r, f"stage_ratios[{j}]", "ratios")
    if p.ready_order is not None:
        for j, t in enumerate(p.ready_order):
            _check_int(t, f"ready_order[{j}]", 0)
        if sorted(p.ready_order) != list(range(p.num_tensors)):
            raise ProfileError(f"ready_order must be a permutation of 0..{p.num_tensors - 1} "
                               f"(each tensor once), got {list(p.ready_order)}")
