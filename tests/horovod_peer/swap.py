"""The one-line change a Horovod user makes, applied to Horovod's own tests.

A Horovod training script adopts dcredit_opt by changing one line (plus its import)::

    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    optimizer = dc.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

Horovod's tests call ``hvd.DistributedOptimizer`` many times; rather than edit each call, this pytest plugin
(``-p tests.horovod_peer.swap``) makes that name resolve to ``dcredit_opt.DistributedOptimizer`` before any test
runs. Nothing else of Horovod changes: ``hvd.init()``, the broadcasts, ``hvd.allreduce`` and the rest stay Horovod's.
"""

from __future__ import annotations


def pytest_configure(config):
    import horovod.torch as hvd

    import dcredit_opt as dc

    hvd.DistributedOptimizer = dc.DistributedOptimizer
