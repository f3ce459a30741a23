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
