"""How gradients are combined across ranks: ``dcredit_opt.Average`` or ``dcredit_opt.Sum``.

Below both the optimizer, which reduces gradients with them, and the
collectives, which take them as Horovod's ``op`` argument.
"""

from __future__ import annotations

import enum


class ReduceOp(enum.Enum):
    AVERAGE = "average"
    SUM = "sum"


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM


HOROVOD_OP_CODES = {0: "average", 1: "sum", 2: "adasum", 3: "min", 4: "max", 5: "product"}
"""Horovod's reduce ops are ints (``horovod.torch.mpi_ops``: ``hvd.Average`` is 0, ...): their names, the one
table both the optimizer (which takes average and sum) and the collectives (which take all but adasum) read."""
