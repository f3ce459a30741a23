"""One Horovod initialisation per launch, for stock and swapped runs alike.

Horovod's tests call ``hvd.init()`` at their start and ``hvd.shutdown()`` in
``tearDown``, so one pytest session initialises Horovod fifteen times. Under
``horovodrun --gloo`` on this 2-core machine, stock Horovod 0.28.1 aborts
intermittently inside such a re-initialisation (``Fatal Python error:
Aborted`` in ``horovod.common.basics.init``; one launch in three without
dcredit-opt, more under load), which would make the suite's outcome a matter
of luck. This pytest plugin (``-p tests.horovod_peer.one_init``) makes the
tests' ``hvd.shutdown()`` a no-op and shuts Horovod down once, when the session
ends; ``hvd.init()`` on an initialised Horovod does nothing, as Horovod
documents. The tests themselves are unchanged.
"""

from __future__ import annotations

_real_shutdown = None


def pytest_configure(config):
    global _real_shutdown
    import horovod.torch as hvd

    _real_shutdown = hvd.shutdown
    hvd.shutdown = lambda: None


def pytest_unconfigure(config):
    if _real_shutdown is not None:
        _real_shutdown()
