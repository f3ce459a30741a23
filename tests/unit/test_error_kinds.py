"""Every error about the running job is a ``DCreditError`` (issue 29, item 9), and keeps its old base.

The engine's own errors (``_C.SchedulerError``, ``_C.Timeout``) derive from
``CollectiveError`` and ``CollectiveTimeout`` (``csrc/torch/bindings.cc``);
``peers.at_rank``, through which the optimizer re-raises them naming the
rank and the phase, keeps their type and turns torch.distributed's errors
into ours. The uneven last step on 2 ranks is in
``tests/distributed/test_exit.py``.
"""

from __future__ import annotations

import pytest

import dcredit_opt as dc
from dcredit_opt import _ext, errors
from dcredit_opt.world import peers, runtime
from tests.unit.test_scheduler import TWO_TENSORS, complete_in_order, manual_engine

C = _ext.load()


def test_the_hierarchy_keeps_the_old_bases():
    for cls in (errors.CollectiveError, errors.CollectiveTimeout, errors.MismatchError, errors.LaunchError):
        assert issubclass(cls, dc.DCreditError) and issubclass(cls, RuntimeError), cls
    assert issubclass(errors.CollectiveTimeout, TimeoutError)
    assert issubclass(errors.MismatchError, ValueError)
    assert issubclass(C.SchedulerError, errors.CollectiveError) and not issubclass(C.SchedulerError, TimeoutError)
    assert issubclass(C.Timeout, errors.CollectiveTimeout) and issubclass(C.Timeout, TimeoutError)
    assert dc.CollectiveError is errors.CollectiveError and dc.LaunchError is errors.LaunchError


@pytest.mark.timeout(60)
def test_an_engine_timeout_is_a_dcredit_error():
    with manual_engine(TWO_TENSORS, timeout_s=0.05) as engine:
        engine.start_iteration()
        engine.flush()
        complete_in_order(engine, [0])  # block 1 launches and is never completed
        with pytest.raises(dc.DCreditError) as info:
            engine.wait_all(30.0)
    e = info.value
    assert isinstance(e, C.Timeout) and isinstance(e, dc.CollectiveTimeout) and isinstance(e, TimeoutError)
    again = peers.at_rank(e, "phase 1 (backward)")
    assert type(again) is C.Timeout
    assert "phase 1 (backward)" in str(again) and "block 1" in str(again)


@pytest.mark.timeout(60)
def test_a_failed_collective_is_a_dcredit_error():
    with manual_engine(TWO_TENSORS) as engine:
        engine.start_iteration()
        engine.flush()
        complete_in_order(engine, [0])
        complete_in_order(engine, [1], ok=False, message="Connection closed by peer")
        with pytest.raises(dc.DCreditError) as info:
            engine.wait_all(10.0)
    e = info.value
    assert isinstance(e, C.SchedulerError) and isinstance(e, dc.CollectiveError) and not isinstance(e, TimeoutError)
    assert type(peers.at_rank(e, "end of phase 1")) is C.SchedulerError


@pytest.mark.timeout(60)
def test_an_engine_shut_down_raises_a_dcredit_error():
    with manual_engine(TWO_TENSORS) as engine:
        engine.shutdown()
        with pytest.raises(dc.CollectiveError, match="shut down"):
            engine.start_iteration()


class DistBackendError(RuntimeError):
    """Stands in for torch.distributed's (a RuntimeError subclass)."""


@pytest.mark.parametrize(("error", "kind"), [
    (DistBackendError("Connection closed by peer [127.0.0.1]:1234"), dc.CollectiveError),
    (DistBackendError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms for recv"),
     dc.CollectiveTimeout),
    (TimeoutError("mpi: block 3 did not arrive within 10 s"), dc.CollectiveTimeout),
    (RuntimeError("the work failed"), dc.CollectiveError),
])
def test_at_rank_turns_other_errors_into_dcredit_errors(error, kind):
    again = peers.at_rank(error, "end of phase 1, summing which gradients each rank computed")
    assert type(again) is kind and isinstance(again, dc.DCreditError)
    assert str(error) in str(again) and "summing which gradients" in str(again)
    if kind is dc.CollectiveTimeout:
        assert isinstance(again, TimeoutError)


def test_a_mistake_of_ours_keeps_its_type():
    e = dc.DCreditError("'w' was read before its update")
    again = peers.at_rank(e, "phase 2")
    assert type(again) is dc.DCreditError and "phase 2" in str(again)


def test_uninitialised_use_is_a_dcredit_error():
    if runtime.is_initialized():
        pytest.skip("another test of this process initialised dcredit_opt")
    with pytest.raises(dc.DCreditError, match="not initialised"):
        runtime.rank()


def test_a_delayed_sum_that_cannot_start_names_the_rank_and_the_phase(monkeypatch):
    """DeFT's background sum (Note [Delayed updates]) starts at the flush; a failure to start it says where, as
    the wait for it does."""
    import dataclasses

    import torch
    from torch import nn

    from dcredit_opt.optimizer.layout import fixed_plan

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    params = list(model.parameters())
    opt = dc.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), named_parameters=model.named_parameters(),
                                  config=dc.Config(policy="deft", accept_delayed_updates=True, profile_iters=0,
                                                   backend="torch"))
    base = fixed_plan([p.numel() for p in params], [p.element_size() for p in params], 256, 2, 1)
    partition = tuple(() if t == 0 else sizes for t, sizes in enumerate(base.partition))
    opt._dc.staged_plan = dataclasses.replace(base, partition=partition, delayed=(0,), policy="deft")
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))

    def broken(flat):
        raise RuntimeError("the side group broke")

    try:
        nn.functional.cross_entropy(model(x), y).backward()
        monkeypatch.setattr(opt._dc.backend, "start_delayed", broken)
        with pytest.raises(errors.CollectiveError,
                           match=r"rank 0 of 1, .*starting the background sum of the delayed gradients: the side "
                                 r"group broke"):
            opt.step()
    finally:
        opt._dc.close()
