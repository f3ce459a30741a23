"""How gradients are combined across ranks: ``dcredit_opt.Average`` or ``dcredit_opt.Sum``, or
elementwise minimum, maximum or product (``dcredit_opt.Min``, ``Max``, ``Product``: Horovod's ints), or
``dcredit_opt.Adasum``, which the optimizer applies to steps, not gradients (Note [Adasum optimizer]).

Below both the optimizer, which reduces gradients with them, and the
collectives, which take them as Horovod's ``op`` argument.

Note [Reduce ops]
-----------------
``DistributedOptimizer(op=...)`` takes what Horovod's does (Adasum: Note [Adasum optimizer]):
``Average`` and ``Sum`` all-reduce each block as a sum (an average scales it
before and after, ``gradient_predivide_factor``); ``Min``, ``Max`` and
``Product`` all-reduce each block with that op instead, elementwise, on
every backend (c10d's, MPI's and Horovod's own ops), so a gradient element
becomes the minimum, maximum or product of the ranks' values, as under
Horovod. A decoupled block (Note [Two-stage blocks]) reduce-scatters with
the op too, then all-gathers; Horovod's reduce-scatter sums only, so under
Horovod such a block is all-reduced whole in its first stage and its second
moves nothing. What sums by its nature stays off for those ops: embeddings
are reduced as dense tensors, not as the rows each rank touched (Note
[Embedding rows]: a rank's untouched rows are zeros that a minimum must
see), a sparse gradient needs ``sparse_as_dense=True`` (else a
``DCreditError`` naming it), and ``Config(policy="deft")``, which adds a
delayed gradient into the next one, is refused. A parameter unused on a
rank contributes zeros, as under Horovod (Note [Global usage]).
"""

from __future__ import annotations

import enum


class ReduceOp(enum.Enum):
    AVERAGE = "average"
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    ADASUM = "adasum"  # Note [Adasum] in adasum.py


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM


HOROVOD_OP_CODES = {0: "average", 1: "sum", 2: "adasum", 3: "min", 4: "max", 5: "product"}
"""Horovod's reduce ops are ints (``horovod.torch.mpi_ops``: ``hvd.Average`` is 0, ...): their names, the one
table both the optimizer and the collectives read (both take them all; the optimizer's Adasum is a path of
its own, optimizer/adasum.py)."""


_IN_LIBRARIES = {
    "torch.distributed": {"sum": "SUM", "min": "MIN", "max": "MAX", "product": "PRODUCT"},  # its ReduceOp
    "mpi4py": {"sum": "SUM", "min": "MIN", "max": "MAX", "product": "PROD"},  # its MPI
    "horovod": {"sum": "Sum", "min": "Min", "max": "Max", "product": "Product"},  # horovod.torch
}
"""Each elementwise reduction by name, as each library names it: the one table the backends' transports and the
collectives read (an average is a sum, scaled)."""


def library_op(name: str, library: str, ops):
    """The reduction ``name`` ("sum", "min", "max", "product") of ``library`` (a key of the table above), found on
    ``ops``: ``torch.distributed.ReduceOp``, mpi4py's ``MPI`` or ``horovod.torch``. A ValueError for another name
    or library."""
    if library not in _IN_LIBRARIES:
        raise ValueError(f"library must be one of {sorted(_IN_LIBRARIES)}, got {library!r}")
    names = _IN_LIBRARIES[library]
    if name not in names:
        raise ValueError(f"no elementwise reduction named {name!r}; expected one of {sorted(names)}")
    return getattr(ops, names[name])


def block_reduction(op: ReduceOp) -> str:
    """What the optimizer's block collectives do for ``op``: an average is a sum, scaled before and after."""
    return "sum" if op in (ReduceOp.AVERAGE, ReduceOp.SUM) else op.value
