"""Horovod's explicit gradient groups (``groups=``, ``num_groups=``) as merges in the plan.

In Horovod, the gradients of one group are reduced together, by one grouped
all-reduce, once every one of them is ready. Here a group becomes a *merge*
(Note [Credit window] and ``Plan.merges`` in ``planner/plan.py``): its
tensors are moved next to each other in the plan's event order, at the place
of the member expected last, each kept whole, and laid out as one block.
The result is what it would be anyway (an all-reduce is element-wise); only
the launch sequence changes, the same way on every rank.
"""

from __future__ import annotations

import dataclasses

import torch

from ..planner.plan import Plan


def tensor_groups(groups, names, params) -> tuple[tuple[int, ...], ...]:
    """Horovod's ``groups`` as tuples of tensor indices (groups of one tensor are left out)."""
    if groups is None:
        return ()
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups <= 0:
            raise ValueError(f"groups must be a positive number of groups or a list of lists of parameters, got "
                             f"{groups!r}")
        return tuple(tuple(g) for g in _split(list(range(len(params))), groups) if len(g) > 1)
    if not isinstance(groups, (list, tuple)):
        raise ValueError(  # noqa: TRY004 - Horovod's error type for bad groups, which scripts may catch
            f"groups must be a positive number of groups or a list of lists of parameters, got "
            f"{type(groups).__name__}")
    index = {id(p): i for i, p in enumerate(params)}
    seen: dict[int, int] = {}
    out = []
    for g, group in enumerate(groups):
        if isinstance(group, torch.Tensor) or not isinstance(group, (list, tuple)):
            raise ValueError(f"groups[{g}] must be a list of parameters, got {type(group).__name__}")  # noqa: TRY004
        members = []
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise ValueError(  # noqa: TRY004
                    f"groups[{g}] holds a {type(p).__name__}: groups must consist of torch.Tensor")
            if id(p) not in index:
                raise ValueError(f"groups[{g}] holds a tensor of shape {tuple(p.shape)} that is not a parameter "
                                 "of the optimizer (or is frozen)")
            i = index[id(p)]
            if i in seen:
                raise ValueError(f"parameter '{names[i]}' appears in groups[{seen[i]}] and groups[{g}]: a "
                                 "parameter can only appear once in groups")
            seen[i] = g
            members.append(i)
        if len(members) > 1:
            out.append(tuple(members))
    return tuple(out)


def _split(items: list, n: int) -> list[list]:
    """``items`` in ``n`` contiguous parts whose sizes differ by at most one, the larger first."""
    size, extra = divmod(len(items), n)
    parts, start = [], 0
    for k in range(n):
        end = start + size + (1 if k < extra else 0)
        parts.append(items[start:end])
        start = end
    return parts


def merge_groups(plan: Plan, groups, dtype_names) -> Plan:
    """``plan`` with each group (split by dtype: one buffer per dtype) merged into one block."""
    if not groups:
        return plan
    order = list(plan.order)
    partition = list(plan.partition)
    grouped = {t for g in groups for t in g}
    merges = [m for m in plan.merges if not grouped.intersection(m)]
    for group in groups:
        by_dtype: dict[str, list[int]] = {}
        for t in group:
            by_dtype.setdefault(str(dtype_names[t]), []).append(t)
        for members in by_dtype.values():
            if len(members) < 2:
                continue
            member = set(members)
            run = [t for t in order if t in member]  # in event order
            last = run[-1]
            order = [u for t in order if t not in member or t == last for u in (run if t == last else (t,))]
            for t in run:
                partition[t] = (plan.numels[t],)
            merges.append(tuple(run))
    return dataclasses.replace(plan, order=tuple(order), partition=tuple(partition), merges=tuple(merges))
