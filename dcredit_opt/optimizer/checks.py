"""Checks at construction: which parameters are reduced, and that every rank agrees.

Everything here runs once, inside ``DistributedOptimizer(...)``, before any
gradient moves. A model or a setting that differs between ranks would
otherwise surface later as a hang, a Gloo abort on a size mismatch, or
silently mixed gradients; here it is a ``ValueError`` that names the
parameter or the setting and the ranks that differ.
"""

from __future__ import annotations

import dataclasses
import hashlib
import weakref

import torch

from ..config import Config
from ..errors import DCreditError, MismatchError
from ..world import runtime


def named_tracked_params(optimizer, named_parameters):
    """Parameters we reduce, in forward (registration) order, with their names; the optimizer's frozen ones
    (``requires_grad=False`` now), as (name, parameter), so that ``step()`` can refuse one that was unfrozen
    later; and the named parameters that are not the optimizer's but require gradients, as (name, parameter),
    whose weights are compared too (Note [Parameters outside the optimizer])."""
    in_optimizer = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            in_optimizer.setdefault(id(p), p)
    if named_parameters is None:
        named = [(f"param_groups.{gi}.{pi}", p) for gi, g in enumerate(optimizer.param_groups)
                 for pi, p in enumerate(g["params"])]
    else:
        named = list(named_parameters)
        for item in named:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                                 "usually produced by model.named_parameters()")
        all_names = [k for k, _ in named]
        dups = sorted({k for k in all_names if all_names.count(k) > 1})
        if dups:
            raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}")
        named_ids = {id(p) for _, p in named}
        unnamed = [p for pid, p in in_optimizer.items() if pid not in named_ids]
        if unnamed:
            shapes = ", ".join(str(tuple(p.shape)) for p in unnamed[:5])
            raise ValueError(f"named_parameters was specified, but {len(unnamed)} model parameter(s) were not "
                             f"named (shapes {shapes}). Python object ids: "
                             f"{', '.join(str(id(p)) for p in unnamed[:5])}")
    names, params, frozen, outside, seen = [], [], [], [], set()
    for name, p in named:
        if id(p) in seen:
            continue  # tied weights once
        seen.add(id(p))
        if id(p) not in in_optimizer:
            if (isinstance(p, torch.Tensor) and p.requires_grad
                    and not isinstance(p, torch.nn.parameter.UninitializedParameter)):
                outside.append((name, p))
            continue
        if isinstance(p, torch.nn.parameter.UninitializedParameter):
            raise ValueError(  # noqa: TRY004 - not yet initialized is a question of value here
                f"parameter '{name}' is not initialized yet (a lazy module's, such as nn.LazyLinear): its "
                "gradient's place is laid out by its shape. Run one forward pass (a dry run on a batch) before "
                "building the DistributedOptimizer")
        if not p.requires_grad:
            frozen.append((name, p))
            continue
        names.append(name)
        params.append(p)
    if params:  # compared on the parameters' device, with theirs (Note [Same weights])
        outside = [(n, p) for n, p in outside if p.device == params[0].device]
    return names, params, frozen, outside


# Note [Parameters outside the optimizer]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A script that trains with two optimizers and wraps only one (a head or an embedding on an optimizer of its own,
# as a DDP user may write, since DDP averages every gradient whatever trains it) updates the other's parameters
# from each rank's own gradient: the ranks drift apart, and nothing in our path sees it. Where named_parameters
# names such parameters (model.named_parameters(), the usual argument), they are known: named, requiring a
# gradient, not in this optimizer. Their weights ride in the weights check with ours (Note [Same weights] in
# usage.py), so a drift stops every rank at the next check with a DCreditError that names the parameter and says
# to wrap every optimizer. Those another live optimizer of ours reduces are sent as 0, unread: that one compares
# them, over its own ranks (a process set's may be fewer). And much earlier, the first step() that finds one
# changed since the last (its version counter moved) with a gradient (an average of the weights kept in the model
# gets none) while no optimizer of ours reduces it logs a warning, once (looked for in the first WATCHED_STEPS
# step() calls: a version read per such parameter each; the weights check covers the later ones).
# Not a refusal there: a script may change such a parameter alike on every rank (a schedule written into it), or
# another library's distributed optimizer may reduce it. Ranks that name different such parameters compare none
# of them (one notice): the tally's length must be the same everywhere.
#
# Where named_parameters does not name them (model.body.named_parameters(), or Horovod's call without
# named_parameters), they are found: the first forward after step() is watched anyway (Note [First read] in
# reads.py), and every module it begins at (no module's forward around it) that holds a parameter of ours is the
# model, or a part of it that holds ours. Its other parameters that need a gradient, on our device, neither ours,
# nor named, nor reduced by another live optimizer of ours then, are *found*: watched for the same warning, and
# compared in the weights check as one pooled fingerprint (the integer sum of their word sums: Note [Same
# weights]), beside a digest of their names, shapes and dtypes.
# The pooled fingerprint is read only where every rank sent the same digest (the same found parameters, in the
# same order): otherwise none are compared (one notice). A difference stops every rank, naming the found
# parameters (the pool cannot say which one of them differs). A module where the forward begins that holds none of
# ours, begun after the first that does (a head called apart from the body whose optimizer is ours, a
# discriminator fed the generator's output), gives only those of its parameters that have a gradient at that
# step(), named after its class: a teacher run without a gradient, a module of each rank's own used under
# no_grad, and what runs between step() and the model's forward (an EMA model's evaluation) are not looked at.

WATCHED_STEPS = 100
"""Note [Parameters outside the optimizer]: the warning looks at the first this many ``step()`` calls (a version
read per parameter outside the optimizer each); the weights check covers every later one."""


class Outside:
    """Note [Parameters outside the optimizer]: the parameters of the model that this optimizer does not train,
    named (``names``, ``params``) or found later in the model the forward runs (``found_names``,
    ``found_params``), watched for changes between ``step()`` calls. ``reduced_elsewhere(p)``: whether another
    live DistributedOptimizer of ours reduces ``p``'s gradient."""

    def __init__(self, names, params, reduced_elsewhere):
        self.names = names
        self.params = params
        self.found_names: list[str] = []
        self.found_params: list = []
        self._reduced_elsewhere = reduced_elsewhere
        self._versions = None  # from the first step(): a broadcast of the weights before it changes them once
        self.watching = bool(params)  # step() asks changed_unreduced(): where there is any, until it warned
        self._watched = 0  # step() calls that asked (WATCHED_STEPS once it warned): then the weights check alone

    def reduced_elsewhere(self) -> list[int]:
        """Positions of the parameters another live optimizer of ours reduces (and compares, over its ranks)."""
        return [i for i, p in enumerate(self.params) if self._reduced_elsewhere(p)]

    def find(self, roots, ours, device, others=()) -> None:
        """The parameters of modules ``roots`` (where the forward began, each holding some of ``ours``, a set of
        ids) that need a gradient, lie on ``device`` and are neither ours, nor named, nor reduced by another
        optimizer of ours; and of modules ``others`` (where the forward began too, holding none of ours) those that
        have a gradient now, from the same backward as ours, named after their module's class. Each found once, in
        the order of the modules' ``named_parameters()``."""
        seen = set(ours) | {id(p) for p in (*self.params, *self.found_params)}
        for root, prefix, graded in [*((r, "", False) for r in roots), *((r, f"{type(r).__name__}.", True)
                                                                          for r in others)]:
            for name, p in root.named_parameters():
                if (id(p) not in seen and p.requires_grad and p.device == device and not (graded and p.grad is None)
                        and not self._reduced_elsewhere(p)):
                    seen.add(id(p))
                    self.found_names.append(prefix + name)
                    self.found_params.append(p)
        if self.found_params:
            self.watching = self._watched < WATCHED_STEPS  # not again after the warning, said once for all
            self._versions = None  # the next step() takes every version afresh

    def pooled(self) -> tuple[list[str], list, list[int]]:
        """The found parameters compared now (those no other optimizer of ours reduces), their names, and the
        digest of their names, shapes and dtypes as two numbers below 64, which every rank must send alike before
        the pool is read (no found parameter: none, and a digest of zeros)."""
        kept = [(n, p) for n, p in zip(self.found_names, self.found_params) if not self._reduced_elsewhere(p)]
        if not kept:
            return [], [], [0, 0]
        d = digest("/".join(f"{n}|{tuple(p.shape)}|{p.dtype}" for n, p in kept))
        return [n for n, _ in kept], [p for _, p in kept], [d & 63, (d >> 6) & 63]

    def changed_unreduced(self) -> tuple[str, bool] | None:
        """At a ``step()``: the first parameter changed since the last ``step()`` that has a gradient and that no
        optimizer of ours reduces, as (its name, whether named_parameters names it), once (None after, and where
        there is none)."""
        self._watched += 1
        if self._watched >= WATCHED_STEPS:
            self.watching = False
        named = len(self.params)
        watched = [*self.params, *self.found_params]
        versions = [p._version for p in watched]
        last, self._versions = self._versions, versions
        if last is None:
            return None
        changed = [i for i, (a, b) in enumerate(zip(versions, last)) if a != b]
        for i in changed:
            p = watched[i]
            # Trained: a gradient too (an average kept in the model, updated from the weights, gets none).
            if p.grad is not None and not self._reduced_elsewhere(p):
                self.watching, self._watched = False, WATCHED_STEPS
                return (self.names[i], True) if i < named else (self.found_names[i - named], False)
        return None


def copied_fields(optimizer) -> dict:
    """The user's optimizer's instance fields that its wrapper takes over (so the two share state and groups).
    Not ``step``: an LR scheduler built before wrapping replaced ``optimizer.step`` on the instance (to note
    that it is called), and copied, it would shadow the wrapper's own ``step()``, which then never reduces."""
    return {k: v for k, v in optimizer.__dict__.items() if k != "step"}


class StepNoted:
    """An LR scheduler built on the script's optimizer before wrapping watches that object's ``step()`` (torch
    replaces it on the instance to note each call), and warns at its first ``step()`` that it was called before
    ``optimizer.step()`` if none was noted. The wrapper's ``step()`` is its own method, which never calls that
    one: so it notes its calls on the script's object too, as the scheduler would have. Only where such a
    scheduler was built (a scheduler built on the wrapper notes its calls itself)."""

    def __init__(self, optimizer):
        self._watched = weakref.ref(optimizer)

    @classmethod
    def of(cls, optimizer):
        """A noter for ``optimizer`` where an LR scheduler watches its ``step()``, else None."""
        return cls(optimizer) if hasattr(optimizer.__dict__.get("step"), "_wrapped_by_lr_sched") else None

    def __call__(self) -> None:
        watched = self._watched()
        if watched is not None:
            watched._opt_called = True


# Note [The wrapped object's own step]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A script that keeps the optimizer it wrapped under a name of its own and calls that object's step()
# (scaler.step(inner), or the old name after opt = DistributedOptimizer(inner, ...)) would update the parameters
# from this rank's own gradient, still being reduced, and the ranks would part. The two objects share their hook
# dicts (copied_fields), so a step pre-hook sees every step() of either: one on the object that was wrapped, while
# an iteration's gradients are being reduced (after a backward, before our step() or synchronize()), is refused
# before it changes anything, saying which object to step. Our own steps run the wrapped class's step() on the
# wrapper; a step of the wrapped object with nothing being reduced (Horovod's broadcast_optimizer_state() making
# the state from zero gradients, a step after synchronize()) goes on as it would.

class InnerStep:
    """Note [The wrapped object's own step]: the step pre-hook that refuses a ``step()`` of the object that was
    wrapped while gradients are being reduced."""

    def __init__(self, wrapped, core):
        self._wrapped = weakref.ref(wrapped)
        self._core = weakref.ref(core)

    @classmethod
    def install(cls, wrapped, core) -> None:
        """On ``wrapped`` (the DistributedOptimizer), whose hook dicts are those of the object it wraps, and whose
        ``core`` says whether gradients are being reduced."""
        wrapped.register_step_pre_hook(cls(wrapped, core))

    def __call__(self, optimizer, args, kwargs) -> None:
        core = self._core()
        if optimizer is self._wrapped() or core is None:
            return
        backward = core.backward
        if core.closed or not backward.open or backward.synchronized:
            return
        first = next((f" (that of '{core.names[i]}' among them)" for i, m in enumerate(backward.marked) if m), "")
        raise DCreditError(
            f"step() was called on the {core.kind} that was wrapped, not on the DistributedOptimizer that wraps it, "
            f"while this iteration's gradients are being reduced{first}: it would update the parameters from this "
            "rank's own gradients, not their average. Nothing was changed. Call step() (and zero_grad()) on the "
            "object dc.DistributedOptimizer returned: rebind the name, optimizer = dc.DistributedOptimizer("
            "optimizer, ...); with a GradScaler, scaler.step(that object) (Note [The wrapped object's own step] "
            "in checks.py)")


class LoadInPlace:
    """The wrapper and the optimizer it wraps share one state dict, one group list and its group dicts (an LR
    scheduler built on either changes both). torch's ``load_state_dict()`` replaces all three with new objects
    on the optimizer it is called on, which would part the two: the other then keeps training (and saving) the
    state before the load, and a scheduler built on the other stops reaching the one that steps. So what is
    loaded into either is copied into the shared objects, which stay. Pre- and post-hooks of
    ``load_state_dict``, registered once in the hook dicts the two share."""

    def __init__(self):
        self._kept = None

    @classmethod
    def install(cls, optimizer) -> None:
        if not any(isinstance(getattr(h, "__self__", None), cls)
                   for h in optimizer._optimizer_load_state_dict_post_hooks.values()):
            loader = cls()
            optimizer.register_load_state_dict_pre_hook(loader.before)
            optimizer.register_load_state_dict_post_hook(loader.after)

    def before(self, optimizer, state_dict) -> None:
        groups = optimizer.__dict__["param_groups"]
        self._kept = (optimizer.__dict__["state"], groups, list(groups))

    def after(self, optimizer) -> None:
        state, groups, dicts = self._kept
        self._kept = None
        loaded_state, loaded_groups = optimizer.__dict__["state"], optimizer.__dict__["param_groups"]
        if loaded_state is not state:
            state.clear()
            state.update(loaded_state)
            optimizer.__dict__["state"] = state
        if loaded_groups is not groups:
            for kept, loaded in zip(dicts, loaded_groups):
                kept.clear()
                kept.update(loaded)
            groups[:] = dicts
            optimizer.__dict__["param_groups"] = groups


def check_same_model_on_all_ranks(names, params, plane=None, outside=()) -> bool:
    """Compare names, shapes and dtypes across ranks before any gradient moves.

    A mismatch would otherwise surface as a hang or as silently mixed
    gradients. Only fixed-size integer tensors cross the network. ``plane``:
    a process set's ranks (``process_sets``), every rank by default.
    ``outside``: the named parameters not in the optimizer, as (name,
    parameter); whether every rank has the same ones is returned (Note
    [Parameters outside the optimizer]), not raised.
    """
    plane = plane or _everyone()
    world = plane.size
    if world == 1:
        return True
    device = plane.control_device()
    digests = [digest(f"{n}|{tuple(p.shape)}|{p.dtype}") for n, p in zip(names, params)]
    total = digest("/".join(str(d) for d in digests))
    others = digest("/".join(f"{n}|{tuple(p.shape)}|{p.dtype}" for n, p in outside))
    mine = torch.tensor([len(params), total, len(outside), others], dtype=torch.int64, device=device)
    gathered = plane.all_gather(mine, name="model.summary")
    if all(bool(torch.equal(g[:2], gathered[0][:2])) for g in gathered):
        return all(bool(torch.equal(g[2:], gathered[0][2:])) for g in gathered)
    longest = max(int(g[0]) for g in gathered)
    padded = torch.full((longest + 1,), -1, dtype=torch.int64, device=device)
    padded[: len(digests)] = torch.tensor(digests, dtype=torch.int64)
    per_rank = plane.all_gather(padded, name="model.digests")
    table = torch.stack(per_rank).cpu()
    first = int((table != table[0]).any(dim=0).nonzero()[0])
    differing = [r for r in range(world) if table[r, first] != table[0, first]]
    here = (f"'{names[first]}' with shape {tuple(params[first].shape)} and dtype {params[first].dtype}"
            if first < len(names) else "no parameter")
    counts = [int(g[0]) for g in gathered]
    raise MismatchError(f"the model differs between ranks: at parameter position {first}, rank {runtime.rank()} has "
                     f"{here}; ranks {differing} differ from rank 0 there (parameter counts per rank: {counts})")


# Config fields that may differ between ranks: they shape neither the block
# sequence nor the result.
PER_RANK_FIELDS = ("timeline_path", "timeout_s")


def check_same_setup_on_all_ranks(config: Config, plane=None, **arguments) -> None:
    """Compare the settings that shape the block sequence or the result across ranks.

    Ranks with different settings (a ``DCREDIT_*`` variable set on some
    ranks only, say) would cut or window their gradients differently and
    launch mismatched collectives: Gloo aborts the process on a size
    mismatch, other engines hang. One small all-gather at construction.
    """
    plane = plane or _everyone()
    world = plane.size
    if world == 1:
        return
    settings = {f"Config.{f.name}": getattr(config, f.name) for f in dataclasses.fields(config)
                if f.name not in PER_RANK_FIELDS}
    settings.update(arguments)
    keys = sorted(settings)
    mine = torch.tensor([digest(f"{k}={settings[k]!r}") for k in keys], dtype=torch.int64,
                        device=plane.control_device())
    table = torch.stack(plane.all_gather(mine, name="setup.digests")).cpu()
    differ = [j for j in range(len(keys)) if bool((table[:, j] != table[0, j]).any())]
    if differ:
        described = "; ".join(f"{keys[j]} (ranks {[r for r in range(world) if table[r, j] != table[0, j]]} "
                              f"differ from rank 0)" for j in differ)
        raise MismatchError(f"the DistributedOptimizer settings differ between ranks: {described}. Rank "
                         f"{runtime.rank()} has {', '.join(f'{keys[j]}={settings[keys[j]]!r}' for j in differ)}")


def _everyone():
    from ..world.process_sets import everyone

    return everyone()


def digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)
