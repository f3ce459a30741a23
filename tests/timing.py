"""How long a test may wait: one place, one factor.

Every limit in these tests guards against a hang; none measures speed. The
values written in the tests are meant for a busy machine (other jobs on the
two cores, everything about 4x slower than when idle), so ``make test``
passes there as it is. For a machine slower still (sanitizer builds, an
emulator, a heavily shared runner) set ``DC_TEST_TIME_SCALE``: every limit
below is multiplied by it, so the limits keep their order (a rank's wait
inside a spawn's wait inside pytest-timeout's).

What it scales, and where:

- every ``pytest.mark.timeout`` (``tests/conftest.py``, at collection);
- the ``timeout_s`` of ``spawn.run`` / ``spawn.run_launched`` (in ``spawn``);
- other waits on subprocesses and launches, through :func:`scaled`;
- the short collective timeouts of the tests that make a peer stall on
  purpose, and their margins, so that a healthy peer that is merely slow is
  never taken for a dead one.

Not ``DCREDIT_TIME_SCALE`` or ``DCREDIT_TEST_...``: ``dcredit_opt`` reads
``DCREDIT_*`` variables as configuration and warns about every unknown one,
and the ranks inherit the test's environment.
"""

from __future__ import annotations

import math
import os

ENV_VAR = "DC_TEST_TIME_SCALE"


def _read_scale() -> float:
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_VAR}={raw!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{ENV_VAR}={raw!r} must be a positive number")
    return value


TIME_SCALE = _read_scale()


def scaled(seconds: float) -> float:
    """``seconds`` (a limit written for a busy machine) times ``DC_TEST_TIME_SCALE``."""
    return seconds * TIME_SCALE


# dcredit_opt's collective timeout (Config.timeout_s) in the tests where a
# peer stalls, dies or stops reducing on purpose: short, since every such
# test waits it out, but long enough that a healthy rank held up by other
# jobs on the machine (the ranks share two cores with them) is never taken
# for a stalled one: 10 s on a busy machine is 2.5 s of an idle one.
STALL_TIMEOUT_S = scaled(10.0)
