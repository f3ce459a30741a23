"""Which optimizers the lazy step may run on a subset of their parameters.

The lazy step (Note [Lazy step] in ``updates.py``) applies one parameter's
update by running the wrapped optimizer's ``step()`` with only that
parameter in its groups. That equals the synchronous step only when the
update of each parameter depends on nothing but that parameter, its
gradient, its own state and the group's hyperparameters. The classes below
are known to be so (their ``foreach`` and ``fused`` forms included: those
batch the same per-parameter arithmetic). A subclass may override ``step()``,
and a custom optimizer may look at all its parameters together (a global
gradient-norm clip, LARS-style trust ratios over a group, Shampoo-style
blocks); those get the eager step, with one notice saying why.
``Config(lazy_step="on")`` vouches for a class we do not know;
``lazy_step="off"`` never defers.

Step hooks are another reason to step eagerly: ``register_step_pre_hook``
and ``register_step_post_hook`` (and their global forms) run once per call of
the wrapped ``step()``, so a deferred update would run them once per module,
each time seeing a few parameters, where plain PyTorch runs them once per
``step()`` over every parameter. Our own pre-hook (Note [The wrapped
object's own step] in ``checks.py``) is not one of them.
"""

from __future__ import annotations

import torch
from torch.optim import optimizer as _optimizer_module

from .checks import InnerStep

PER_PARAMETER: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in (
        "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "Adagrad", "Adadelta", "ASGD",
        "SparseAdam", "Adafactor")
    if hasattr(torch.optim, name))


def why_eager(base: type, optimizer, lazy_step: str) -> str | None:
    """Why the lazy step must not defer updates of ``optimizer`` (of class ``base``) now; None if it may."""
    if lazy_step == "off":
        return "Config.lazy_step='off'"
    if has_step_hooks(optimizer):
        return ("optimizer step hooks are registered (register_step_pre_hook/register_step_post_hook): they run "
                "once per step(), over every parameter")
    if lazy_step == "on" or base in PER_PARAMETER:
        return None
    return (f"{base.__module__}.{base.__qualname__} is not a torch.optim class known to update each parameter "
            "on its own (its step() may look at all parameters together); pass Config(lazy_step='on') if it does")


def has_step_hooks(optimizer) -> bool:
    """The script's step hooks: not our own (Note [The wrapped object's own step] in checks.py)."""
    pre = getattr(optimizer, "_optimizer_step_pre_hooks", None)
    return bool(pre and any(not isinstance(h, InnerStep) for h in pre.values())
                or getattr(optimizer, "_optimizer_step_post_hooks", None)
                or getattr(_optimizer_module, "_global_optimizer_pre_hooks", None)
                or getattr(_optimizer_module, "_global_optimizer_post_hooks", None))
