"""The one configuration object, and the only place that reads the environment."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import logging
import os
from collections.abc import Mapping

from .planner.dcredit import DEFAULT_BLOCK_BYTES
from .planner.plan import POLICY_NAMES

log = logging.getLogger("dcredit_opt")

MiB = 1024 * 1024

BACKENDS = ("torch", "horovod", "mpi")
"""The backends' names (``backends.create``); ``Config.backend`` also takes "auto"."""


@dataclasses.dataclass
class Config:
    """How dcredit-opt schedules one optimizer's gradients.

    Every field can be overridden by an environment variable ``DCREDIT_<FIELD>``
    (upper case), read once by :meth:`from_env`.
    """

    policy: str = "dcredit"
    """Planner policy used once the job has profiled itself (``profile_iters``). One of "dcredit" (D-Credit's
    search: its own windows and every baseline's plan, the fastest in the calibrated simulator),
    "bytescheduler" (tuned block size x credit), "usbyte" (US-Byte: gap-filling unequal messages, searched
    order, tuned with ByteScheduler's budget), "oasr" (OASR-WFBP: overlap-aware optimal merges), "mgwfbp",
    "dear" (DeAR: each fusion group reduce-scattered in backward and all-gathered during the next forward,
    its fusion threshold tuned), "ddp", "wfbp", or "fixed" to keep the fixed plan below for the whole job;
    or "deft", which trains differently from synchronous data parallelism (some updates one iteration late,
    Note [Delayed updates] in planner/deft.py) and therefore also needs ``accept_delayed_updates=True``."""

    backend: str = "auto"
    """Who carries the collectives: "torch" (torch.distributed: Gloo, NCCL), "horovod",
    "mpi" (mpi4py), or "auto": whoever set up the job (mpi4py under mpirun/mpiexec,
    torch.distributed under torchrun; in a Horovod job, process groups of our own beside
    Horovod on CPUs and Horovod's operations on GPUs: ``backends.detect()``)."""

    block_bytes: int = DEFAULT_BLOCK_BYTES
    """Block size of the fixed plan (used before profiling, and for the whole job with ``policy="fixed"`` or
    ``profile_iters=0``), in bytes."""

    window: int = 2
    """Fixed plan: blocks released per gradient-ready event and per phase-2 group
    (the credit window, in blocks). -1 releases every ready block at once."""

    credit_bytes: int = 0
    """Fixed plan: bytes allowed in flight at once; 0 means the window (in blocks) is the only limit."""

    channels: int = 2
    """Process groups (communicators) that blocks rotate over, so that a window of
    k blocks really runs k collectives at once."""

    overlap_forward: bool = True
    """Phase 2, the lazy step (docs/lazy-step.md): ``step()`` returns before every gradient is reduced,
    and each layer's next forward waits only for its own parameters. Off: ``step()`` waits (WFBP-style)."""

    device_windows: bool = False
    """CUDA blocks on the torch backend (Note [Device windows] in csrc/core/scheduler.cc): keep the credit
    window on the device. A block whose window is full is launched at once, its collective waiting on the
    GPU for the results of the blocks whose slots it takes, so the host never waits for the device to launch
    a block, and a lazy update waits only until its blocks are enqueued. The launch sequence and the windows
    are the same as without it. Off until measured on GPUs (``benchmarks/gpu_machine.sh``); no effect on CPU
    blocks or other backends."""

    lazy_step: str = "auto"
    """When phase 2 is on, who may have their update deferred to the first read in the next
    forward (Note [Lazy step]): "auto" (torch.optim classes known to update each parameter on
    its own, while no step hooks are registered), "on" (any optimizer: you vouch that its
    step() treats each parameter on its own) or "off" (every update applied in step())."""

    profile_iters: int = 5
    """Iterations measured at the start of the job before rank 0 plans and every rank switches to
    the plan; 0 keeps the fixed plan."""

    collective_host_s: float = 20e-6
    """Host time one collective costs an iteration whatever the link, in seconds: its hand-over to the
    scheduler, the launching thread's wake-up, the backend's own work and its completion, on cores the
    training thread shares. The planner charges it per collective (``Profile.host_s_per_collective``), so
    that where the link is cheap (one machine, NVLink, a world of one) the plan has few, larger blocks.
    Measured on the 2-core development machine at a world of one (GPT-shaped model): the iteration grew by
    10 us per collective between fixed plans of 77 and 403 collectives, and by 15-40 us between D-Credit
    plans of 8, 14 and 77. Where the blocks are reduced on the CPU, profiling also measures what one small
    collective costs this process's CPU, and the planner charges the larger of the two (Note [Measured host
    cost] in profiling/profiler.py). 0 plans for the link alone, and measures nothing."""

    replan_every: int = 10
    """Adaptive re-planning (how: planner/adaptive.py): every this many steps of a
    plan, the ranks compare what the blocks' timings and the backward say about the link and the compute with
    what they said when the plan started; once an estimate has moved by more than ``replan_threshold`` at two
    checks in a row, rank 0 plans again for the new estimates and every rank switches at the same step (only
    if the new plan is predicted faster, by more than ``replan_threshold``). Each re-plan is logged (INFO),
    marked in the timeline and listed in ``opt.replans``. 0 turns it off; also off with ``policy="fixed"``,
    ``policy="deft"``, ``profile_iters=0`` or one rank."""

    replan_threshold: float = 0.1
    """How far an estimate must move (as a share: 0.1 = 10 %, a ratio either way) before re-planning is
    considered, and how much faster the fresh plan must be predicted than the plan in force to be switched
    to (``replan_every``)."""

    timeout_s: float = 30.0
    """Longest wait for any collective or gradient before raising, in seconds: a dead or stalled peer
    makes every other rank raise, naming itself, the block (and its tensors) and the phase."""

    timeline_path: str | None = None
    """Write a Chrome/Perfetto trace of blocks and windows here, one file per rank: a ``{rank}`` in the
    path is replaced by the rank, otherwise (with more than one rank) ``.rank<r>.json`` is appended
    (docs/usage.md, "Timeline"). Empty in ``DCREDIT_TIMELINE_PATH`` means None."""

    embedding_rows: bool = True
    """Reduce the gradient of a weight that ``nn.Embedding`` modules look rows up in as the rows each batch
    touched (all-gathered), plus a dense all-reduce of any other part (a tied output layer), instead of one
    dense all-reduce at the end of the backward (Note [Embedding rows]). Every backend, 2+ ranks."""

    accept_delayed_updates: bool = False
    """Required with ``policy="deft"``, and only there: you accept that the parameters DeFT delays are
    updated with the previous iteration's gradients, so training no longer equals synchronous data
    parallelism (docs/usage.md, "DeFT", says what that trades)."""

    check_finite: bool = False
    """Raise DCreditError from ``step()``, naming the parameter, if a reduced gradient holds NaN or Inf,
    before any update (the step is skipped). Costs one pass over the gradients, and that ``step()``
    waits for every block instead of overlapping them with the next forward."""

    check_weights_every: int = 100
    """Every this many iterations (the first check at iteration ``check_weights_every``), every rank's weights
    are compared with every other rank's, exactly, through the tally the iteration sends anyway; a parameter
    that differs between ranks (a write to it on some ranks only, ranks that started from different weights,
    or a fault of ours) stops every rank with DCreditError naming it, at the next iteration's end of backward
    (Note [Same weights]). Costs one read of the weights on the training thread per check (an integer sum per
    parameter) and two integers per parameter in that iteration's tally. 0 turns it off (do so where ranks
    run on different kinds of device, whose kernels may round the same update differently). With 2+ ranks."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field.

        Always ValueError, a wrong type included, so that one ``except`` catches
        every bad setting, from the constructor and from ``DCREDIT_*`` alike.
        """
        for name in ("block_bytes", "window", "credit_bytes", "channels", "profile_iters", "replan_every",
                     "check_weights_every"):
            if isinstance(getattr(self, name), bool):  # bool is an int subclass; never a count
                raise ValueError(  # noqa: TRY004
                    f"Config.{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("overlap_forward", "device_windows", "check_finite", "embedding_rows",
                     "accept_delayed_updates"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(  # noqa: TRY004
                    f"Config.{name} must be True or False, got {getattr(self, name)!r}")
        if self.timeline_path is not None and not isinstance(self.timeline_path, str):
            raise ValueError(f"Config.timeline_path must be a path string or None, got {self.timeline_path!r}")
        if isinstance(self.timeout_s, bool):
            raise ValueError(  # noqa: TRY004
                f"Config.timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        if not isinstance(self.block_bytes, int) or self.block_bytes <= 0:
            raise ValueError(f"Config.block_bytes must be a positive number of bytes, got {self.block_bytes!r}")
        if not isinstance(self.window, int) or (self.window <= 0 and self.window != -1):
            raise ValueError(f"Config.window must be a positive number of blocks or -1 (all), got {self.window!r}")
        if not isinstance(self.credit_bytes, int) or self.credit_bytes < 0:
            raise ValueError(f"Config.credit_bytes must be >= 0 (0 = no byte limit), got {self.credit_bytes!r}")
        if not isinstance(self.channels, int) or not 1 <= self.channels <= 64:
            raise ValueError(f"Config.channels must be an integer in 1..64, got {self.channels!r}")
        if not isinstance(self.profile_iters, int) or self.profile_iters < 0:
            raise ValueError(f"Config.profile_iters must be >= 0, got {self.profile_iters!r}")
        host = self.collective_host_s
        if isinstance(host, bool) or not isinstance(host, (int, float)) or not 0 <= host < 1:
            raise ValueError(f"Config.collective_host_s must be a number of seconds in [0, 1), got {host!r}")
        if not isinstance(self.replan_every, int) or self.replan_every < 0 or self.replan_every == 1:
            raise ValueError(f"Config.replan_every must be 0 (off) or >= 2 steps, got {self.replan_every!r}")
        if not isinstance(self.check_weights_every, int) or self.check_weights_every < 0:
            raise ValueError(f"Config.check_weights_every must be 0 (off) or a number of iterations >= 1, got "
                             f"{self.check_weights_every!r}")
        if (isinstance(self.replan_threshold, bool) or not isinstance(self.replan_threshold, (int, float))
                or not 0 <= self.replan_threshold < 10):
            raise ValueError(f"Config.replan_threshold must be a share in [0, 10) (0.1 = 10 %), got "
                             f"{self.replan_threshold!r}")
        if not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"Config.timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        if self.lazy_step not in ("auto", "on", "off"):
            raise ValueError(f"Config.lazy_step {self.lazy_step!r} is unknown; known: auto, on, off")
        if self.backend not in ("auto", *BACKENDS):
            raise ValueError(f"Config.backend {self.backend!r} is unknown; known: auto, {', '.join(BACKENDS)}")
        known = ("fixed", *POLICY_NAMES)
        if self.policy not in known:
            raise ValueError(f"Config.policy {self.policy!r} is unknown; known policies: {', '.join(known)}")
        if self.policy == "deft" and not self.accept_delayed_updates:
            raise ValueError("Config.policy 'deft' updates some parameters with the previous iteration's gradients, "
                             "so training no longer equals synchronous data parallelism; set "
                             "Config(accept_delayed_updates=True) to accept that, or pick another policy")
        if self.accept_delayed_updates and self.policy != "deft":
            raise ValueError(f"Config.accept_delayed_updates=True is only for policy 'deft'; policy "
                             f"{self.policy!r} keeps training synchronous (set it back to False)")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> Config:
        """Defaults, then ``DCREDIT_*`` variables, then ``overrides``."""
        process = environ is None
        environ = os.environ if process else environ
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict = {}
        known_vars = {f"DCREDIT_{name.upper()}": name for name in fields}
        source = {}
        for var, raw in environ.items():
            if not var.startswith("DCREDIT_"):
                continue
            name = known_vars.get(var)
            if name is None:
                # dc.init() and each DistributedOptimizer(config=None) read the
                # process environment: say it once per process, not per read.
                if not (process and var in _WARNED):
                    log.warning("ignoring unknown environment variable %s; known: %s", var,
                                ", ".join(sorted(known_vars)))
                    if process:
                        _WARNED.add(var)
                continue
            values[name] = _parse(var, raw, fields[name].type)
            source[name] = f"{var}={raw!r}"
        values.update(overrides)
        try:
            return cls(**values)
        except ValueError as e:
            culprit = next((v for k, v in source.items() if k not in overrides and f"Config.{k} " in str(e)), None)
            if culprit is None:
                raise
            raise ValueError(f"{e} (from the environment: {culprit})") from None


# Unknown DCREDIT_* variables of this process already warned about.
_WARNED: set = set()

# How a DCREDIT_* variable spells a bool field's True and False (any case).
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def _parse(var: str, raw: str, annotation: str):
    text = raw.strip()
    try:
        if annotation == "bool":
            if text.lower() in TRUE_WORDS:
                return True
            if text.lower() in FALSE_WORDS:
                return False
            raise ValueError
        if annotation == "int":
            return int(text)
        if annotation == "float":
            return float(text)
        if annotation.startswith("str | None"):
            return text or None
        return text
    except ValueError:
        raise ValueError(f"environment variable {var}={raw!r} is not a valid {annotation}") from None


# ---- the reference: docs/configuration.md ---------------------------------------------------------------------


def field_docs() -> dict[str, str]:
    """Each field's docstring (the string right after its annotation, STYLE's one per field), read from the source."""
    body = ast.parse(inspect.getsource(Config)).body[0].body
    return {stmt.target.id: inspect.cleandoc(after.value.value) for stmt, after in itertools.pairwise(body)
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)}


def _default(value) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= MiB and value % MiB == 0:
        return f"`{value}` ({value // MiB} MiB)"
    return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"


def reference_markdown() -> str:
    """Every field of ``Config`` as Markdown: its type, default, environment variable and docstring.

    ``docs/configuration.md`` is this text (``python -m dcredit_opt config > docs/configuration.md``), and a
    unit test keeps it so: change a field's docstring here, then regenerate.
    """
    docs = field_docs()
    fields = dataclasses.fields(Config)
    lines = [
        "# Configuration",
        "",
        "<!-- Generated from dcredit_opt/config.py by `python -m dcredit_opt config > docs/configuration.md`;",
        "     edit the docstrings there, then regenerate (tests/unit/test_config.py checks this file is current). -->",
        "",
        "`dcredit_opt.Config` holds every setting of one optimizer: `dc.DistributedOptimizer(...,",
        "config=dc.Config(policy=\"fixed\", channels=4))`. Each field can also be set with an environment",
        "variable `DCREDIT_<FIELD>` (upper case), read in one place, `Config.from_env()` (defaults, then the",
        "environment, then its keyword arguments): by each `DistributedOptimizer` built without `config=`, and",
        "for `backend` by `dc.init()`; a `Config` you pass is used as it is.",
        f"A bool reads {', '.join(TRUE_WORDS)} or {', '.join(FALSE_WORDS)} (any case). An unknown `DCREDIT_*`",
        "variable is reported once per process, naming the known ones; a bad value raises `ValueError` naming",
        "its variable, as a bad argument names its field.",
        "",
        "| field | type | default | environment variable |",
        "|---|---|---|---|",
    ]
    for f in fields:
        cell = f.type.replace("|", "\\|")  # a pipe inside a table cell is escaped
        lines.append(f"| [`{f.name}`](#{f.name}) | `{cell}` | {_default(f.default)} | `DCREDIT_{f.name.upper()}` |")
    for f in fields:
        summary = f"`{f.type}`, default {_default(f.default)}, environment `DCREDIT_{f.name.upper()}`."
        lines += ["", f"## {f.name}", "", summary, "", docs[f.name]]
    return "\n".join(lines) + "\n"
