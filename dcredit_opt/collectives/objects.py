"""Python objects as bytes for ``broadcast_object`` / ``allgather_object``, without pickle.

Horovod's helpers pickle the object and unpickle whatever a peer sent, which
runs any code the sender chose. We never unpickle peer data (the package's
rule, checked by ``tests/unit/test_hygiene.py``), so objects travel as JSON
of tagged nodes, and decoding only ever builds plain values from a fixed
list of types:

- ``None``, ``bool``, ``int``, ``float`` (NaN and infinities included), ``str``;
- ``list``, ``tuple``, ``dict`` (keys of any of these types; a subclass
  such as ``OrderedDict`` arrives as a ``dict``, in its order), ``set``,
  ``frozenset``, ``bytes``, ``bytearray``;
- ``torch.Tensor`` (dense; its values, dtype and shape: it arrives on the
  CPU, or on the current CUDA device if it was on a GPU and this rank has
  one; ``requires_grad`` is not kept);
- ``numpy.ndarray`` and numpy scalars of boolean, integer, float or complex
  dtype.

Anything else is a ``TypeError`` naming its type and where it sits in the
object, on the sending rank, before any of the object is sent; the
collectives then send that error's text in its place, so that the other
ranks raise too instead of waiting (Note [Objects that cannot be sent] in
``collectives/gather.py``). Every Python
container is a one-key JSON object (its tag), and plain values are JSON's
own, so a JSON object is always a tag (bodies are lists) and decoding is
unambiguous.
"""

from __future__ import annotations

import base64
import json
import math

import numpy as np
import torch

# The only dtypes a tensor may arrive as: peer data never reaches getattr(torch, ...).
TENSOR_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64, torch.complex64, torch.complex128)}
_NUMPY_KINDS = "biufc"  # bool, signed, unsigned, float, complex: no objects, strings or records
_MAX_DEPTH = 200


def encode(obj) -> bytes:
    """``obj`` as UTF-8 JSON bytes; ``TypeError`` for a type that cannot travel."""
    return json.dumps(_to_json(obj, "obj", 0), separators=(",", ":"), allow_nan=True).encode()


def decode(data: bytes):
    """The object ``encode`` made ``data`` from; ``ValueError`` for bytes it could not have made."""
    try:
        return json.loads(data.decode(), object_hook=_from_tag, parse_constant=_constant)
    except (UnicodeDecodeError, KeyError, TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"received object bytes that do not decode ({type(e).__name__}: {e})") from None


def _to_json(obj, where: str, depth: int):
    if depth > _MAX_DEPTH:
        raise TypeError(f"{where} is nested more than {_MAX_DEPTH} levels deep")
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)  # an IntEnum travels as its value
    if isinstance(obj, float):
        return float(obj) if math.isfinite(obj) else {"float": repr(float(obj))}
    if isinstance(obj, (list, tuple, set, frozenset)):
        tag = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}.get(type(obj))
        if tag is None:  # a namedtuple or another subclass: its own type would not arrive
            raise _unsupported(obj, where)
        items = [_to_json(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(obj)]
        return items if tag == "list" else {tag: items}
    if isinstance(obj, dict):  # an OrderedDict (a state_dict) arrives as a dict, in its order
        return {"dict": [[_to_json(k, f"{where} key {k!r}", depth + 1), _to_json(v, f"{where}[{k!r}]", depth + 1)]
                         for k, v in obj.items()]}
    if isinstance(obj, (bytes, bytearray)):
        return {"bytes" if isinstance(obj, bytes) else "bytearray": base64.b64encode(bytes(obj)).decode()}
    if isinstance(obj, torch.Tensor):
        return {"tensor": _tensor_to_json(obj, where)}
    if isinstance(obj, (np.ndarray, np.generic)):
        array = np.asarray(obj)
        if array.dtype.kind not in _NUMPY_KINDS:
            raise TypeError(f"{where} is a numpy {array.dtype} array: only boolean, integer, float and complex "
                            "arrays travel (objects and strings would need pickle)")
        body = [array.dtype.str, list(array.shape), base64.b64encode(np.ascontiguousarray(array).tobytes()).decode()]
        return {"ndarray" if isinstance(obj, np.ndarray) else "npscalar": body}
    raise _unsupported(obj, where)


def _unsupported(obj, where: str) -> TypeError:
    return TypeError(
        f"{where} has type {type(obj).__module__}.{type(obj).__qualname__}, which cannot be sent: objects travel "
        "as JSON, never pickled (unpickling a peer's bytes runs the peer's code), so they may hold None, bool, int, "
        "float, str, bytes, list, tuple, dict, set, torch tensors and numpy arrays; convert it to those "
        "(e.g. a dataclass with dataclasses.asdict, a state_dict's tensors as they are)")


def _tensor_to_json(t: torch.Tensor, where: str) -> dict:
    if t.layout != torch.strided:
        raise TypeError(f"{where} is a {t.layout} tensor: only dense tensors travel (call .to_dense())")
    name = str(t.dtype).replace("torch.", "")
    if name not in TENSOR_DTYPES:
        raise TypeError(f"{where} is a {t.dtype} tensor, which cannot be sent")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return [name, list(t.shape), t.is_cuda, base64.b64encode(raw).decode()]


def _tensor_from_json(body: list) -> torch.Tensor:
    name, shape, cuda, data = body
    dtype = TENSOR_DTYPES[name]
    shape = [int(n) for n in shape]
    raw = base64.b64decode(data, validate=True)
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(raw) != numel * itemsize:
        raise ValueError(f"tensor of shape {shape} and dtype {dtype} with {len(raw)} bytes")
    if numel == 0:
        t = torch.empty(shape, dtype=dtype)
    else:
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    if cuda and torch.cuda.is_available():
        t = t.to(torch.device("cuda", torch.cuda.current_device()))
    return t


def _array_from_json(body: list) -> np.ndarray:
    name, shape, data = body
    dtype = np.dtype(str(name))
    if dtype.kind not in _NUMPY_KINDS:
        raise ValueError(f"numpy dtype {dtype} is not one that travels")
    shape = tuple(int(n) for n in shape)
    raw = base64.b64decode(data, validate=True)
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"array of shape {shape} and dtype {dtype} with {len(raw)} bytes")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def _constant(name: str) -> float:
    raise ValueError(f"bare {name} (floats that are not finite travel tagged)")


def _from_tag(node: dict):
    if len(node) != 1:
        raise ValueError(f"an untagged JSON object with keys {sorted(node)}")
    (tag, body), = node.items()
    if tag == "tuple":
        return tuple(body)
    if tag == "set":
        return set(body)
    if tag == "frozenset":
        return frozenset(body)
    if tag == "dict":
        return {_hashable(k): v for k, v in body}
    if tag == "float":
        if body not in ("nan", "inf", "-inf"):
            raise ValueError(f"float {body!r}")
        return float(body)
    if tag in ("bytes", "bytearray"):
        raw = base64.b64decode(body, validate=True)
        return raw if tag == "bytes" else bytearray(raw)
    if tag == "tensor":
        return _tensor_from_json(body)
    if tag == "ndarray":
        return _array_from_json(body)
    if tag == "npscalar":
        return _array_from_json(body)[()]
    raise ValueError(f"unknown tag {tag!r}")


def _hashable(key):
    if isinstance(key, list):
        raise TypeError("a dict key that is a list")
    return key
