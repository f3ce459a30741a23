"""What each rank runs in test_random_scenarios.py: seeded random training scenarios (issue C1).

Every case is drawn from one integer seed by :func:`draw_case`, which uses a
``random.Random`` of its own, so every rank draws the same case without any
communication. A case is:

- a small model: an input layer, a sequence of random operations on a hidden
  vector, an output layer. The operations are plain children, a *shared*
  module called at two places, a *tied* pair (two ``nn.Linear`` with one
  weight), *ghost* children never called whose weight and bias the parent
  uses through ``F.linear``, bare ``nn.Parameter`` weights of the parent
  used through ``F.linear``, ``nn.ParameterList`` scales, and nested blocks
  made of the same operations;
- branches: an operation may be guarded by a rule of (rank, step, pass),
  so that a rank takes it or not, possibly changing per step;
- per-rank sleeps of 0-15 ms (seeded by case, rank, step and place) inside
  some modules' forwards and between backward and ``step()``;
- a random ``torch.optim`` optimizer, a random plan (``policy="fixed"`` with
  random blocks, window and channels, or a profiled policy), sometimes
  ``backward_passes_per_step=2``; 6-8 steps.

Most cases are built so that every parameter is always first read in the
same module (the lazy step's assumption, Note [First read]): they must train
exactly like the synchronous reference. Some cases (``stale_prone``) add a
read that moves: a parent reading a child's weight before the child runs,
or the first of a tied pair behind a step-dependent branch. Those may
legitimately raise ``DCreditError`` (a stale read); they must never hang or
differ silently. The rank that sees the stale read first raises it; a peer
then waiting in a collective may instead see that collective fail (its
channel closed), which is as loud.

The reference is the one of ``workers.py``/``pattern_workers.py``: each rank
regenerates every rank's batches, runs a copy of the model with the same
branch decisions (and no sleeps), sums the gradients, divides by the world
size (a parameter no rank used gets zeros, as dcredit_opt and Horovod give
it), and steps a plain optimizer of the same class. It trains first, whole,
so that nothing runs between ``step()`` and the next forward of the
distributed model: the deferred updates race the next forward as in a tight
training loop.

Many cases run in one launch, each on its own model and optimizer (closed
with ``_dc.close()``); after each case the ranks exchange their outcomes over
the default group, and the launch stops at the first case whose ranks
disagree (what comes after such a case is not trustworthy).
"""

from __future__ import annotations

import copy
import math
import random
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn

import dcredit_opt as dc
from dcredit_opt import _ext

from . import pattern_workers as pw

SEED_VAR = "DC_TEST_RANDOM_SEED"
TOL = 2e-5

OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop", "adagrad")
POLICIES = ("dcredit", "bytescheduler", "mgwfbp")
BLOCK_BYTES = (64, 128, 512, 1 << 20)
WINDOWS = (1, 2, -1)
CHANNELS = (1, 2)

# Rules that decide whether rank r takes a branch at (step, pass). "stale_*" rules do not depend on the rank,
# so that a stale read they cause happens on every rank alike.
SAFE_RULES = ("always", "never", "rank0", "rank1", "alternate", "step_mod3", "after2", "pass0", "coin")
STALE_RULES = ("stale_even_steps", "stale_from_step3", "stale_coin")


def make_optimizer(kind: str, params, hyper: dict):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=hyper["lr"], momentum=0.9, weight_decay=hyper["wd"])
    if kind == "adam":
        return torch.optim.Adam(params, lr=hyper["lr"])
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=hyper["lr"], weight_decay=hyper["wd"])
    if kind == "rmsprop":
        return torch.optim.RMSprop(params, lr=hyper["lr"], momentum=0.5)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=hyper["lr"])
    raise ValueError(kind)


# ---- drawing a case -------------------------------------------------------------------------------


def draw_case(seed: int) -> dict:
    """The case of ``seed``: plain data (JSON-like), the same on every rank."""
    rng = random.Random(seed)
    stale_prone = rng.random() < 0.2
    hidden = rng.choice((5, 8, 13, 24))
    bpps = 2 if rng.random() < 0.25 else 1
    steps = rng.randint(6, 8)
    names = _Names()
    ops = _draw_ops(rng, names, depth=0, hidden=hidden)
    if stale_prone:
        _add_stale_op(rng, names, ops, hidden, steps)
    # Sleeps inside forwards: some linear-like children sleep (0-15 ms, per rank and step).
    if rng.random() < 0.8:
        sleepy = [op for op in _walk(ops) if op["kind"] in ("lin", "shared", "tied_a", "tied_b")]
        for op in rng.sample(sleepy, k=min(len(sleepy), rng.randint(1, 2))):
            op["sleepy"] = True
    opt = rng.choice(OPTIMIZERS)
    hyper = {"lr": {"sgd": 0.05, "adam": 1e-2, "adamw": 1e-2, "rmsprop": 1e-3, "adagrad": 5e-2}[opt]
             * rng.choice((0.5, 1.0, 2.0))}
    wd = rng.choice((0.0, 1e-4, 0.1))
    if opt in ("sgd", "adamw"):
        hyper["wd"] = wd
    if rng.random() < 0.25:
        plan = {"policy": rng.choice(POLICIES), "profile_iters": 2}
    else:
        plan = {"policy": "fixed"}
    plan.update(block_bytes=rng.choice(BLOCK_BYTES), window=rng.choice(WINDOWS), channels=rng.choice(CHANNELS))
    case = {"seed": seed, "hidden": hidden, "d_in": rng.choice((6, 16)), "d_out": rng.choice((3, 7)),
            "ops": ops, "opt": opt, "hyper": hyper, "plan": plan, "bpps": bpps, "steps": steps,
            "stale_prone": stale_prone, "step_sleep": rng.random() < 0.8}
    # Drawn last, so that the fields above stay what they were for every seed: an input embedding (tokens
    # in, Note [Embedding rows]), untied or tied to the output layer (whose width is then the vocabulary).
    case["embed"] = rng.choice((None, None, "untied", "tied"))
    # And what the script does between backward and step() (Note [Gradient reads], Note [Held gradients]), and
    # how it clears gradients: to None, or to zeros that plain torch steps with once a tensor had a gradient.
    case["between"] = rng.choice((None, None, "clip_norm", "clip_value"))
    case["zero_to_none"] = rng.random() < 0.75
    return case


def between(case: dict, params) -> None:
    """What ``case`` does to the gradients between backward and ``step()``."""
    if case.get("between") == "clip_norm":
        nn.utils.clip_grad_norm_(params, 0.5)
    elif case.get("between") == "clip_value":
        nn.utils.clip_grad_value_(params, 0.05)


class _Names:
    def __init__(self):
        self.n = 0

    def __call__(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"


def _draw_rule(rng: random.Random) -> str:
    # Mostly unguarded; a guard is mostly a rule that changes with rank or step.
    if rng.random() < 0.6:
        return "always"
    return rng.choice(SAFE_RULES)


def _draw_ops(rng: random.Random, names: _Names, depth: int, hidden: int) -> list:
    """Operations that keep every parameter's first read in one place, whatever the branches do."""
    ops: list = []
    count = rng.randint(2, 5) if depth == 0 else rng.randint(1, 3)
    shared = None
    for _ in range(count):
        kinds = ["lin", "ghost", "bare", "plist", "tied"]
        if depth == 0:
            kinds += ["shared", "block"]
        kind = rng.choice(kinds)
        rule = _draw_rule(rng)
        if kind == "shared" and shared is None:
            shared = names("shared")
            # Called here and again later; either call may be guarded, the reader is always the module itself.
            ops.append({"kind": "shared", "name": shared, "rule": rule, "first": True})
        elif kind == "shared":
            ops.append({"kind": "shared", "name": shared, "rule": rule, "first": False})
        elif kind == "tied":
            # The first user of the tied weight runs unguarded; the second may be guarded.
            a, b = names("tied_a"), names("tied_b")
            ops.append({"kind": "tied_a", "name": a, "rule": "always"})
            ops.append({"kind": "tied_b", "name": b, "tied_to": a, "rule": rule})
        elif kind == "block":
            ops.append({"kind": "block", "name": names("block"), "rule": rule,
                        "ops": _draw_ops(rng, names, depth + 1, hidden)})
        elif kind == "plist":
            ops.append({"kind": "plist", "name": names("plist"), "rule": rule, "len": rng.randint(1, 3)})
        else:
            ops.append({"kind": kind, "name": names(kind), "rule": rule})
    if shared is not None and sum(op.get("name") == shared for op in ops) == 1:
        ops.append({"kind": "shared", "name": shared, "rule": _draw_rule(rng), "first": False})
    return ops


def _add_stale_op(rng: random.Random, names: _Names, ops: list, hidden: int, steps: int) -> None:
    """A read that moves with the step, the same on every rank (Note [First read]: such a case may raise)."""
    rule = rng.choice(STALE_RULES)
    kind = rng.choice(("peek_sum", "peek_linear", "tied_first_guarded"))
    if kind == "tied_first_guarded":
        a, b = names("tied_a"), names("tied_b")
        pos = rng.randint(0, len(ops))
        ops[pos:pos] = [{"kind": "tied_a", "name": a, "rule": rule},
                        {"kind": "tied_b", "name": b, "tied_to": a, "rule": "always"}]
        return
    # The parent reads a child's weight (guarded) before the child itself runs: always, or exactly when the
    # parent does not read it (then a stale read is still pending when the backward reaches it).
    target, peek = names("lin"), names("peek")
    pos = rng.randint(0, len(ops))
    ops[pos:pos] = [{"kind": kind, "name": peek, "target": target, "rule": rule, "salt": peek},
                    {"kind": "lin", "name": target, "rule": rng.choice(("always", "not_" + rule)), "salt": peek}]


def _walk(ops: list):
    for op in ops:
        yield op
        if op["kind"] == "block":
            yield from _walk(op["ops"])


def describe(case: dict) -> str:
    """One line that says what the case is (for failure reports)."""
    def ops_text(ops):
        parts = []
        for op in ops:
            text = f"{op['kind']}:{op['name']}"
            if op["kind"] == "block":
                text += "[" + ", ".join(ops_text(op["ops"])) + "]"
            elif op["kind"] in ("peek_sum", "peek_linear"):
                text += f"(reads {op['target']}.weight)"
            elif op["kind"] == "plist":
                text += f"x{op['len']}"
            if op.get("sleepy"):
                text += "+sleep"
            if op["rule"] != "always":
                text += f"?{op['rule']}"
            parts.append(text)
        return parts

    plan = case["plan"]
    plan_text = ", ".join(f"{k}={v}" for k, v in plan.items())
    return (f"seed={case['seed']} {'STALE-PRONE ' if case['stale_prone'] else ''}hidden={case['hidden']} "
            f"ops=[{', '.join(ops_text(case['ops']))}] opt={case['opt']}{case['hyper']} plan=({plan_text}) "
            f"bpps={case['bpps']} steps={case['steps']} step_sleep={case['step_sleep']} embed={case.get('embed')} "
            f"between={case.get('between')} zero_to_none={case.get('zero_to_none', True)}")


# ---- the model -----------------------------------------------------------------------------------


class Ctx:
    """Who is running the forward: which rank's batch, at which step and pass; whether to sleep."""

    def __init__(self, seed: int):
        self.seed = seed
        self.rank = self.step = self.k = 0
        self.sleepy = False

    def set(self, rank: int, step: int, k: int, sleepy: bool) -> None:
        self.rank, self.step, self.k, self.sleepy = rank, step, k, sleepy


def takes(rule: str, ctx: Ctx, salt: str) -> bool:
    """Whether the forward of ``ctx`` takes a branch guarded by ``rule``."""
    r, s, k = ctx.rank, ctx.step, ctx.k
    if rule.startswith("not_"):
        return not takes(rule[4:], ctx, salt)
    if rule == "always":
        return True
    if rule == "never":
        return False
    if rule == "rank0":
        return r == 0
    if rule == "rank1":
        return r == 1
    if rule == "alternate":
        return (s + r) % 2 == 0
    if rule == "step_mod3":
        return s % 3 == r
    if rule == "after2":
        return s >= 2 + r
    if rule == "pass0":
        return k == 0
    if rule == "coin":
        return random.Random(f"{ctx.seed}/{salt}/{r}/{s}/{k}").random() < 0.5
    if rule == "stale_even_steps":
        return s % 2 == 0
    if rule == "stale_from_step3":
        return s >= 3
    if rule == "stale_coin":
        return random.Random(f"{ctx.seed}/{salt}/{s}/{k}").random() < 0.5
    raise ValueError(rule)


def nap(ctx: Ctx, place: str) -> None:
    """0-15 ms, seeded by case, rank, step, pass and place; only in the distributed model."""
    if ctx.sleepy:
        time.sleep(random.Random(f"{ctx.seed}/{place}/{ctx.rank}/{ctx.step}/{ctx.k}").randint(0, 15) / 1000)


class SleepyLinear(nn.Linear):
    """An ``nn.Linear`` that sleeps inside its own forward."""

    def __init__(self, ctx: Ctx, place: str, *args):
        super().__init__(*args)
        self.place = place
        object.__setattr__(self, "ctx", ctx)  # not a module attribute worth registering

    def forward(self, x):
        nap(self.ctx, self.place)
        return super().forward(x)


class Body(nn.Module):
    """A sequence of random operations on a hidden vector (the model's middle, or a nested block)."""

    def __init__(self, ctx: Ctx, ops: list, hidden: int, shared: dict):
        super().__init__()
        object.__setattr__(self, "ctx", ctx)
        self.ops = ops
        self.mods = nn.ModuleDict()
        self.ghosts = nn.ModuleDict()  # never called: their weights are used by this forward, through F.linear
        self.plists = nn.ModuleDict()
        for op in ops:
            kind, name = op["kind"], op["name"]
            if kind in ("lin", "tied_a", "tied_b"):
                self.mods[name] = self._linear(op, hidden)
                if kind == "tied_b":
                    self.mods[name].weight = self.mods[op["tied_to"]].weight
            elif kind == "shared":
                if name not in shared:
                    shared[name] = self._linear(op, hidden)
                if name not in self.mods:
                    self.mods[name] = shared[name]
                elif op.get("sleepy") and not isinstance(self.mods[name], SleepyLinear):
                    pass  # the module exists already; where it sleeps was decided at its first op
            elif kind == "ghost":
                self.ghosts[name] = nn.Linear(hidden, hidden)
            elif kind == "bare":
                self.register_parameter(name + "_w", nn.Parameter(torch.randn(hidden, hidden) / hidden ** 0.5))
                self.register_parameter(name + "_b", nn.Parameter(torch.randn(hidden) * 0.1))
            elif kind == "plist":
                self.plists[name] = nn.ParameterList(
                    [nn.Parameter(1 + 0.2 * torch.randn(hidden)) for _ in range(op["len"])])
            elif kind == "block":
                self.mods[name] = Body(ctx, op["ops"], hidden, shared)
            elif kind in ("peek_sum", "peek_linear"):
                pass  # reads self.mods[op["target"]], made by the op that follows
            else:
                raise ValueError(kind)

    def _linear(self, op: dict, hidden: int) -> nn.Linear:
        if op.get("sleepy"):
            return SleepyLinear(self.ctx, op["name"], hidden, hidden)
        return nn.Linear(hidden, hidden)

    def forward(self, h):
        ctx = self.ctx
        for i, op in enumerate(self.ops):
            # "salt": ops that share one coin (a read and its complement); else each place tosses its own.
            if not takes(op["rule"], ctx, op.get("salt", f"{op['name']}@{i}")):
                continue
            kind, name = op["kind"], op["name"]
            if kind in ("lin", "tied_a", "tied_b", "shared"):
                h = torch.tanh(self.mods[name](h))
            elif kind == "ghost":
                g = self.ghosts[name]
                h = torch.tanh(F.linear(h, g.weight, g.bias))
            elif kind == "bare":
                h = torch.tanh(F.linear(h, getattr(self, name + "_w"), getattr(self, name + "_b")))
            elif kind == "plist":
                for scale in self.plists[name]:
                    h = h * scale
            elif kind == "block":
                h = h + self.mods[name](h)
            elif kind == "peek_sum":
                h = h + self.mods[op["target"]].weight.sum()
            elif kind == "peek_linear":
                t = self.mods[op["target"]]
                h = torch.tanh(F.linear(h, t.weight, t.bias))
        return h


class RandNet(nn.Module):
    def __init__(self, case: dict):
        super().__init__()
        self.ctx = Ctx(case["seed"])
        hidden = case["hidden"]
        self.embed = case.get("embed")
        if self.embed is None:
            self.inp = nn.Linear(case["d_in"], hidden)
        else:
            self.emb = nn.Embedding(vocab(case), hidden)
        self.body = Body(self.ctx, case["ops"], hidden, {})
        self.out = nn.Linear(hidden, case["d_out"])
        if self.embed == "tied":
            self.out.weight = self.emb.weight

    def forward(self, x):
        h = torch.tanh(self.inp(x)) if self.embed is None else self.emb(x).mean(1)
        return self.out(self.body(h))


def vocab(case: dict) -> int:
    return case["d_out"] if case.get("embed") == "tied" else 11


def batch(case: dict, micro: int, rank: int, n: int = 6):
    g = torch.Generator().manual_seed(case["seed"] * 1_000_003 + 7919 * micro + rank)
    if case.get("embed") is not None:
        return torch.randint(0, vocab(case), (n, 4), generator=g), torch.randn(n, case["d_out"], generator=g)
    return torch.randn(n, case["d_in"], generator=g), torch.randn(n, case["d_out"], generator=g)


def loss_of(model: RandNet, case: dict, step: int, k: int, rank: int, sleepy: bool):
    model.ctx.set(rank, step, k, sleepy)
    x, y = batch(case, step * case["bpps"] + k, rank)
    return F.mse_loss(model(x), y)


# ---- one case ------------------------------------------------------------------------------------


def _reference_step(ref: RandNet, ropt, case: dict, step: int, world: int) -> None:
    had = ref.__dict__.setdefault("had_gradient", set())  # the parameters that had one (keep_zeros_where_had)
    for p in ref.parameters():
        p.grad = None
    for r in range(world):
        for k in range(case["bpps"]):
            loss_of(ref, case, step, k, r, sleepy=False).backward()
    pw.finish_reference_grads(ref, world)  # one no rank used keeps None, and the optimizer skips it
    if not case.get("zero_to_none", True):
        pw.keep_zeros_where_had(ref, had)
    between(case, list(ref.parameters()))
    ropt.step()


DIVERGED = 1e3
"""A reference whose weights grew beyond this diverged: float32 roundoff (the order of a sum differs between a
world's average and the reference's) grows with it, by orders of magnitude a step (seed 12090087: 1e-6 at step 3,
244 at step 5 with weights of 5e4), so such a case is compared between ranks only."""


SPREAD_FACTOR = 10.0
"""A trained case may differ from the reference by up to this many times the reference's own ``ref_spread``."""


def _roundoff_spread(model: RandNet, ref: RandNet, case: dict, world: int) -> float:
    """How far float32 roundoff alone carries this case: the reference trained again from weights one ulp apart
    (``model`` untrained), its largest difference from ``ref``. Most cases stay within a few ulps; a chaotic one
    (seed 12110103, a tied embedding whose weights grow to 5) turns a 1-ulp difference of a sum's order at step 4
    into 1.7e-4 by step 8, tenfold a step, with the lazy step on or off alike."""
    nudged = copy.deepcopy(model)
    with torch.no_grad():
        for p in nudged.parameters():
            p.copy_(torch.nextafter(p, torch.full_like(p, math.inf)))
    nopt = make_optimizer(case["opt"], nudged.parameters(), case["hyper"])
    for step in range(case["steps"]):
        _reference_step(nudged, nopt, case, step, world)
    return max((gap(p.detach(), q.detach()) for p, q in zip(nudged.parameters(), ref.parameters())), default=0.0)


def gap(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference between ``ours`` and the reference ``ref``: 0 where they are equal, infinite where
    only one of them is not finite. A NaN in both at the same place (a drawn case whose own arithmetic made one,
    in synchronous training too) is the same result, not a difference."""
    same = (ours == ref) | (torch.isnan(ours) & torch.isnan(ref))
    d = torch.where(same, torch.zeros_like(ours), (ours - ref).abs())
    return float(torch.nan_to_num(d, nan=math.inf, posinf=math.inf).max()) if d.numel() else 0.0


def run_case(case: dict, rank: int, world: int) -> dict:
    """Train ``case`` through dcredit_opt and the reference; the outcome on this rank."""
    torch.manual_seed(case["seed"])
    model = RandNet(case)
    ref = copy.deepcopy(model)
    names = [n for n, _ in model.named_parameters()]
    out = {"seed": case["seed"], "names": names, "status": None, "where": None}
    config = dc.Config(**case["plan"])
    # The reference trains first, so that nothing of ours runs between step() and the next forward: the
    # lazy step's updates then race the next forward as they would in a tight training loop.
    ropt = make_optimizer(case["opt"], ref.parameters(), case["hyper"])
    for step in range(case["steps"]):
        _reference_step(ref, ropt, case, step, world)
    out["ref_spread"] = _roundoff_spread(model, ref, case, world)
    finite = [q.detach()[torch.isfinite(q.detach())] for q in ref.parameters()]
    out["ref_absmax"] = max((float(f.abs().max()) for f in finite if f.numel()), default=0.0)
    opt = None
    where = "building the DistributedOptimizer"
    try:
        opt = dc.DistributedOptimizer(make_optimizer(case["opt"], model.parameters(), case["hyper"]),
                                      named_parameters=model.named_parameters(),
                                      backward_passes_per_step=case["bpps"], config=config)
        lazy_steps = 0
        for step in range(case["steps"]):
            opt.zero_grad(set_to_none=case.get("zero_to_none", True))
            for k in range(case["bpps"]):
                where = f"forward of step {step} pass {k}"
                loss = loss_of(model, case, step, k, rank, sleepy=True)
                where = f"backward of step {step} pass {k}"
                loss.backward()
            if case["step_sleep"]:
                nap(model.ctx, "before_step")
            where = f"between backward and step() of step {step}"
            between(case, list(model.parameters()))
            where = f"step() of step {step}"
            opt.step()
            lazy_steps += bool(opt._dc.lazy.npending)  # this step() left updates for the next forward to apply
        where = "synchronize() after the last step"
        opt.synchronize()
        where = "comparing"
        out["status"] = "trained"
        diffs = [gap(p.detach(), q.detach()) for p, q in zip(model.parameters(), ref.parameters())]
        out["diff"] = max(diffs)
        out["worst"] = names[diffs.index(out["diff"])]
        out["lazy_steps"] = lazy_steps
        out["flat"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
        out["plan_policy"] = opt.plan.policy
        out["rows"] = len(opt._dc.tally.rows)  # tensors on the embedding rows path (Note [Embedding rows])
    except dc.DCreditError as e:
        out.update(status="dcredit_error", message=str(e))
    except (_ext.load().SchedulerError, TimeoutError) as e:
        # A collective that failed: after a peer stopped (its own error says why), or a real failure.
        out.update(status="collective_error", message=f"{type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 - anything else is a failure the test reports with its traceback
        out.update(status="other_error", message=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
    out["where"] = where
    if opt is not None:
        try:
            opt._dc.close()
        except Exception as e:  # noqa: BLE001
            out["close_error"] = f"{type(e).__name__}: {e}"
    return out


def _say(rank: int, text: str) -> None:
    sys.stdout.write(f"[random rank {rank}] {text}\n")
    sys.stdout.flush()


def random_cases(seeds: list) -> dict:
    """Every case of ``seeds`` in turn on this rank; stops after the first case whose ranks disagree."""
    import torch.distributed as dist

    dc.init()
    rank, world = dc.rank(), dc.size()
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)  # torch's first optimizer imports dynamo: not a case's
    results, stopped = [], None
    for i, seed in enumerate(seeds):
        case = draw_case(seed)
        _say(rank, f"case {i}: {describe(case)}")
        start = time.monotonic()
        out = run_case(case, rank, world)
        out["seconds"] = time.monotonic() - start
        out["description"] = describe(case)
        out["stale_prone"] = case["stale_prone"]
        _say(rank, f"case {i}: {out['status']} in {out['seconds']:.2f} s at {out['where']}"
                   + (f": {out['message'][:300]}" if "message" in out else f", diff {out.get('diff')}"))
        results.append(out)
        # The ranks compare outcomes. A case that stopped every rank closed every rank's optimizer and its
        # channels: the next case starts clean. After a case that trained on one rank and failed on
        # another, channels and timing are not to be trusted.
        mine = (out["status"], out["where"] if out["status"] != "trained" else None)
        theirs = [None] * world
        dist.all_gather_object(theirs, mine)
        trained = [t[0] == "trained" for t in theirs]
        if any(trained) and not all(trained):
            stopped = i
            _say(rank, f"case {i}: ranks disagree ({theirs}); the launch stops here")
            break
    return {"cases": results, "stopped_at": stopped}
