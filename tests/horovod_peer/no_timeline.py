"""Keeps Horovod's timeline writer off in the vendored tests (a pytest plugin, stock and swapped alike).

Horovod's ``test_torch.py`` sets ``HOROVOD_TIMELINE=DYNAMIC`` when it is imported, for its dynamic-timeline test,
which is not in our selection. With that variable set, ``hvd.init()`` starts Horovod 0.28.1's timeline writer
thread, whose loop calls ``std::this_thread::yield()`` without ever sleeping: measured here on 2 ranks, one rank's
writer took 0.93 of a core and the other's 0.26 (the busiest thread is 0.07 of a core without the variable). On a
2-core machine that leaves the other threads, Horovod's background loop among them, waiting for a core: with
``HOROVOD_GLOO_TIMEOUT_SECONDS=5``, ``test_force_allreduce`` with gradient blocks on our own channels failed in 4
of 11 runs ("Timed out waiting 5000ms for recv"), in 7 of 8 with the garbage collector off (more process groups
alive), and in none of 8 with the variable dropped (none of 6 with gc off too). Note [C++ channels under Horovod] in
``dcredit_opt/world/channels.py`` has the whole account.

``-p tests.horovod_peer.no_timeline`` drops the variable once the test modules are imported (after collection),
before any test calls ``hvd.init()``. Nothing else changes.
"""

from __future__ import annotations

import os


def pytest_collection_finish(session):
    os.environ.pop("HOROVOD_TIMELINE", None)
