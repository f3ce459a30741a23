"""Loads the C++ extension, refusing one built against another torch."""

from __future__ import annotations

import importlib

import torch

_module = None

# Without --no-build-isolation pip would compile against a torch of its own;
# --no-cache-dir keeps it from reusing a wheel it built against the old torch.
REBUILD = "pip install --no-build-isolation --no-deps --force-reinstall --no-cache-dir SOURCE"
EDITABLE = "pip install --no-build-isolation --no-deps -e ."


def load():
    """The ``dcredit_opt._C`` module; a clear ImportError if missing or stale."""
    global _module
    if _module is not None:
        return _module
    try:
        from . import _build_info
    except ImportError:
        raise ImportError("dcredit_opt's C++ extension is not built: in a source checkout run `make install` "
                          f"(or `{EDITABLE}`); elsewhere reinstall with `{REBUILD}`") from None
    if _build_info.TORCH_VERSION != torch.__version__:
        raise ImportError(f"dcredit_opt._C was built against torch {_build_info.TORCH_VERSION} but torch "
                          f"{torch.__version__} is installed, and a C++ extension only works with the torch it was "
                          f"compiled against: rebuild it against this torch with `{REBUILD}` (SOURCE: the "
                          "dcredit-opt source folder or sdist you installed from; in a source checkout, "
                          "`make install`)")
    _module = importlib.import_module("dcredit_opt._C")
    return _module
