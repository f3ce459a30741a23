"""The planner beside a training thread (re-planning while training: profiling/replanner.py).

Note [Planning beside training]
-------------------------------
Python runs one thread at a time, and a thread that waits for the interpreter
gets it only when the running thread lets go: at a blocking call, or when the
interpreter's switch interval (5 ms) asks it to. The planner is Python that
never blocks, and the training thread lets go at every torch operation; so
beside a running planner each operation of the training thread waited up to
5 ms for the interpreter to come back: measured, 200 small matrix products
163 times slower. Where it runs beside training, the planner lets go between
two steps of its search (each candidate it replays in the simulator, a few
tenths of a millisecond): the same products were about 3 times slower while
it ran, and the planner nearly as fast as alone (95 ms a plan against 74). :func:`beside_training` marks the
thread that plans so; elsewhere (the first plan, the command line) a pause
costs one attribute read.
"""

from __future__ import annotations

import contextlib
import threading
import time

_local = threading.local()


@contextlib.contextmanager
def beside_training():
    """This thread's planning runs beside a training thread: :func:`pause` lets it have the interpreter."""
    _local.beside = True
    try:
        yield
    finally:
        _local.beside = False


def pause() -> None:
    """Between two steps of a search: let a waiting training thread have the interpreter (Note [Planning beside
    training]); nothing outside :func:`beside_training`."""
    if getattr(_local, "beside", False):
        time.sleep(0)
