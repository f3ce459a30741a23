"""Loads the C++ extension, refusing one built against another torch."""

from __future__ import annotations

import importlib

import torch

_module = None


def load():
    """The ``dcredit_opt._C`` module; a clear ImportError if missing or stale."""
    global _module
    if _module is not None:
        return _module
    try:
        from . import _build_info
    except ImportError:
        raise ImportError("dcredit_opt's C++ extension is not built: run `make install` "
                          "(pip install --no-build-isolation -e .)") from None
    if _build_info.TORCH_VERSION != torch.__version__:
        raise ImportError(f"dcredit_opt._C was built against torch {_build_info.TORCH_VERSION} but torch "
                          f"{torch.__version__} is installed: rebuild with `make install`")
    _module = importlib.import_module("dcredit_opt._C")
    return _module
