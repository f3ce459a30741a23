"""Suite-wide: every pytest-timeout limit times ``DC_TEST_TIME_SCALE`` (see ``tests/timing.py``)."""

from __future__ import annotations

import pytest

from tests import timing

# For a test that sets no limit of its own (pure computations, all well under
# a few seconds): still bounded, so that a hang fails that test instead of
# stalling the suite until CI's limit.
DEFAULT_TIMEOUT_S = 300


def pytest_report_header(config):
    return f"test time scale ({timing.ENV_VAR}): {timing.TIME_SCALE:g}"


def pytest_collection_modifyitems(config, items):
    """Give each test its timeout marker with the limit scaled (a default one where it has none).

    The new marker goes first on the item, so it is the closest one, the one
    pytest-timeout reads; a module's ``pytestmark`` is scaled per test.
    """
    # A --timeout (or PYTEST_TIMEOUT, or the ini's) that someone set applies to those tests instead.
    default = None if getattr(config, "_env_timeout", None) else timing.scaled(DEFAULT_TIMEOUT_S)
    for item in items:
        marker = item.get_closest_marker("timeout")
        if marker is None:
            if default is not None:
                item.add_marker(pytest.mark.timeout(default), append=False)
            continue
        if timing.TIME_SCALE == 1.0:
            continue
        args, kwargs = list(marker.args), dict(marker.kwargs)
        if args and args[0] is not None:
            args[0] = timing.scaled(float(args[0]))
        elif kwargs.get("timeout") is not None:
            kwargs["timeout"] = timing.scaled(float(kwargs["timeout"]))
        item.add_marker(pytest.mark.timeout(*args, **kwargs), append=False)
