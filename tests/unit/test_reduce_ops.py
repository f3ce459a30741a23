"""Note [Reduce ops]: the optimizer's op, as ours or Horovod's int, down to the engine's collectives."""

from __future__ import annotations

import pytest
import torch

import dcredit_opt as dc
from dcredit_opt import _ext
from dcredit_opt.optimizer.wrapper import reduce_op
from dcredit_opt.reduce_ops import ReduceOp, block_reduction
from dcredit_opt.world import channels


@pytest.mark.parametrize("op, ours, blocks", [
    (dc.Average, ReduceOp.AVERAGE, "sum"), (dc.Sum, ReduceOp.SUM, "sum"), (0, ReduceOp.AVERAGE, "sum"),
    (1, ReduceOp.SUM, "sum"), (dc.Min, ReduceOp.MIN, "min"), (dc.Max, ReduceOp.MAX, "max"),
    (dc.Product, ReduceOp.PRODUCT, "product"),
])
def test_each_op_reaches_the_blocks_as_their_collective(op, ours, blocks):
    assert reduce_op(op) is ours
    assert block_reduction(ours) == blocks


def test_each_reduction_in_each_library_from_the_one_table():
    """The transports (MPI's, Horovod's) and the collectives read the same table: each name to each library's op.
    mpi4py and Horovod stood in for by their attribute names (the real ones run in tests/distributed)."""
    import types

    import torch.distributed as dist

    from dcredit_opt.reduce_ops import library_op

    mpi = types.SimpleNamespace(SUM="mpi-sum", MIN="mpi-min", MAX="mpi-max", PROD="mpi-prod")
    hvd = types.SimpleNamespace(Sum=1, Min=3, Max=4, Product=5)
    for name, torch_op, mpi_op, hvd_op in [("sum", dist.ReduceOp.SUM, "mpi-sum", 1), ("min", dist.ReduceOp.MIN,
                                           "mpi-min", 3), ("max", dist.ReduceOp.MAX, "mpi-max", 4),
                                           ("product", dist.ReduceOp.PRODUCT, "mpi-prod", 5)]:
        assert library_op(name, "torch.distributed", dist.ReduceOp) == torch_op
        assert library_op(name, "mpi4py", mpi) == mpi_op and library_op(name, "horovod", hvd) == hvd_op
        assert dc.collectives.core._OP_CODES[name] == hvd_op  # our Horovod ints are Horovod's
    with pytest.raises(ValueError, match="no elementwise reduction named 'average'"):
        library_op("average", "torch.distributed", dist.ReduceOp)
    with pytest.raises(ValueError, match="library must be one of"):
        library_op("sum", "nccl", dist.ReduceOp)


def test_the_engine_refuses_an_op_it_does_not_know_before_making_anything():
    dc.init()
    with pytest.raises(ValueError, match=r'reduce must be "sum", "min", "max" or "product", got "mean"'):
        _ext.load().Engine.torch(channels.channel_groups(1), 30.0, "mean")


@pytest.mark.parametrize("reduce", ["min", "max", "product"])
def test_a_world_of_one_reduces_a_block_to_itself_with_any_op(reduce):
    """The op goes to c10d (checked on 2 and 4 ranks in tests/distributed); here it must neither fail nor
    scale: a rank's value is every rank's minimum, maximum and product."""
    dc.init()
    engine = _ext.load().Engine.torch(channels.channel_groups(1), 30.0, reduce)
    try:
        buf = torch.tensor([-2.0, 0.5, 3.0, 7.0])
        engine.set_plan(num_tensors=1, order=[0], segments=[0, 0], offsets=[0, 2], numels=[2, 2], bytes=[8, 8],
                        priorities=[0, 0], block_tensors=[[0], [0]], phase1_windows=[-1], phase2_windows=[2],
                        credit_bytes=0, channels=1, buffers=[buf], postscale=1.0)
        engine.start_iteration()
        engine.mark_ready(0)
        engine.flush()
        engine.wait_all(30.0)
        assert engine.error() is None
        assert torch.equal(buf, torch.tensor([-2.0, 0.5, 3.0, 7.0]))
    finally:
        engine.shutdown()
