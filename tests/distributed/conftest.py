"""Fixtures of the distributed tests."""

from __future__ import annotations

import pytest

from .test_backends import LAUNCHES, _tool


@pytest.fixture(params=list(LAUNCHES))
def launch(request):
    """Each launcher of ``LAUNCHES`` in turn (mpiexec, horovodrun over Gloo and MPI), skipped where missing."""
    spec = LAUNCHES[request.param]
    reason = spec["missing"]()
    if reason:
        pytest.skip(f"{request.param}: {reason}")
    return {**spec, "launcher": [_tool(spec["launcher"][0]), *spec["launcher"][1:]]}
