"""What each rank runs in the distributed tests.

Every worker trains a real model with dcredit_opt and, beside it, a
synchronous reference that needs no communication: each rank regenerates
every rank's batch (they are seeded by step and rank), averages the
gradients itself, and steps the same optimizer. Results must agree to float
tolerance.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import dcredit_opt as dc
from dcredit_opt.world import runtime

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=5e-2),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0),
}


class Net(nn.Module):
    """Tensors of awkward sizes: most span several small blocks, some fit in one."""

    def __init__(self, branch: bool = False, frozen: bool = False):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.mid = nn.Linear(32, 61)  # a prime width
        self.norm = nn.LayerNorm(61)
        self.out = nn.Linear(61, 7)
        self.branch = nn.Linear(61, 7) if branch else None
        if frozen:
            self.mid.requires_grad_(False)

    def forward(self, x, use_branch: bool = False):
        h = self.norm(torch.relu(self.mid(torch.relu(self.inp(x)))))
        y = self.out(h)
        if use_branch and self.branch is not None:
            y = y + self.branch(h)
        return y


def error_of(call) -> str:
    """What ``call()`` raised, as ``"Type: message"``, or ``"no error"``: for results a test reads back."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def batch(step: int, rank: int, n: int = 8):
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(n, 16, generator=g), torch.randn(n, 7, generator=g)


def loss_of(model, data, **kw):
    x, y = data
    return nn.functional.mse_loss(model(x, **kw), y)


def reference_grads(ref, step: int, world: int, passes: int = 1, uses_branch=lambda r: False) -> None:
    """Synchronous data parallelism by hand: sum each rank's local gradient, divide by world; a parameter
    no rank used keeps ``None``, and the optimizer skips it."""
    for p in ref.parameters():
        p.grad = None
    for r in range(world):
        for k in range(passes):
            loss_of(ref, batch(step * passes + k, r), use_branch=uses_branch(r)).backward()
    for p in ref.parameters():
        if p.grad is not None:
            p.grad /= world


REDUCE_OPS = {"min": lambda a, b: torch.minimum(a, b), "max": lambda a, b: torch.maximum(a, b),
              "product": lambda a, b: a * b}


def reference_grads_with(ref, step: int, world: int, op: str) -> None:
    """Horovod's op=Min/Max/Product by hand: each rank's local gradient, combined elementwise over ranks."""
    local = []
    for r in range(world):
        ref.zero_grad(set_to_none=True)
        loss_of(ref, batch(step, r)).backward()
        local.append([p.grad.clone() for p in ref.parameters()])
    for k, p in enumerate(ref.parameters()):
        g = local[0][k]
        for r in range(1, world):
            g = REDUCE_OPS[op](g, local[r][k])
        p.grad = g


def step_both(model, ref, opt, ropt, step: int, rank: int, world: int) -> None:
    """One training step through dcredit_opt, and the same step of the synchronous reference."""
    opt.zero_grad()
    loss_of(model, batch(step, rank)).backward()
    opt.step()
    reference_grads(ref, step, world)
    ropt.step()


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def checksum(model: nn.Module) -> float:
    return float(sum(p.double().sum() for p in model.state_dict().values()))


def _make(opt_name, config, **net_kw):
    torch.manual_seed(0)
    model = Net(**net_kw)
    ref = copy.deepcopy(model)
    opt = dc.DistributedOptimizer(OPTIMIZERS[opt_name](model.parameters()),
                                  named_parameters=model.named_parameters(), config=config)
    return model, ref, opt, OPTIMIZERS[opt_name](ref.parameters())


def _join(horovod_first: bool) -> None:
    """``dc.init()``, after ``hvd.init()`` when the test adopts an initialised Horovod."""
    if horovod_first:
        import horovod.torch as hvd

        hvd.init()
    dc.init()


def equivalence(configs: list, steps: int = 20, horovod_first: bool = False) -> dict:
    """For each config: train ``steps`` steps, return (max |param - reference|, checksum).

    A config may name its ``backend`` (default "auto")."""
    _join(horovod_first)
    world, rank = dc.size(), dc.rank()
    out = {}
    for cfg in configs:
        config = dc.Config(block_bytes=cfg["block_bytes"], window=cfg["window"], channels=cfg.get("channels", 2),
                           overlap_forward=cfg["phase2"], policy="fixed", backend=cfg.get("backend", "auto"))
        model, ref, opt, ropt = _make(cfg["opt"], config)
        for step in range(steps):
            step_both(model, ref, opt, ropt, step, rank, world)
        opt.synchronize()
        out[repr(sorted(cfg.items()))] = (max_diff(model, ref), checksum(model))
        opt._dc.close()
    return out


def scenario(name: str, steps: int = 12, horovod_first: bool = False) -> dict:
    """One of the F1 scenarios; returns the worst difference from the reference, a checksum,
    and the backend that carried the blocks."""
    _join(horovod_first)
    world, rank = dc.size(), dc.rank()
    config = dc.Config(block_bytes=128, window=2, channels=2, policy="fixed")
    result = {}
    earlier = 0.0  # the checksums of models trained before the last one (the ranks must agree on them too)
    if name == "backward_passes":
        model, ref, opt, ropt = _make("sgd", config)
        opt = dc.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()), named_parameters=model.named_parameters(),
                                      backward_passes_per_step=2, config=config)
        for step in range(steps):
            opt.zero_grad()
            for k in range(2):
                loss_of(model, batch(step * 2 + k, rank)).backward()
            opt.step()
            reference_grads(ref, step, world, passes=2)
            ropt.step()
    elif name == "clipping":
        model, ref, opt, ropt = _make("sgd", config)
        for step in range(steps):
            opt.zero_grad()
            loss_of(model, batch(step, rank)).backward()
            opt.synchronize()
            nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            with opt.skip_synchronize():
                opt.step()
            reference_grads(ref, step, world)
            nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            ropt.step()
    elif name == "unused_on_one_rank":
        model, ref, opt, ropt = _make("adam", config, branch=True)

        def uses(r):
            return r == 1

        for step in range(steps):
            opt.zero_grad()
            loss_of(model, batch(step, rank), use_branch=uses(rank)).backward()
            opt.step()
            reference_grads(ref, step, world, uses_branch=uses)
            ropt.step()
    elif name == "frozen":
        model, ref, opt, ropt = _make("sgd", config, frozen=True)
        before = model.mid.weight.detach().clone()
        for step in range(steps):
            step_both(model, ref, opt, ropt, step, rank, world)
        opt.synchronize()
        result["frozen_unchanged"] = bool(torch.equal(before, model.mid.weight))
        result["frozen_grad_is_none"] = model.mid.weight.grad is None
    elif name == "eval_after_step":
        model, ref, opt, ropt = _make("sgd", config)
        worst = 0.0
        for step in range(steps):
            step_both(model, ref, opt, ropt, step, rank, world)
            probe = batch(10_000 + step, 0)[0]
            with torch.no_grad():  # the lazy update must land before this forward reads the weights
                worst = max(worst, float((model(probe) - ref(probe)).abs().max()))
        result["eval_diff"] = worst
    elif name == "checkpoint":
        model, ref, opt, ropt = _make("adam", config)
        worst_state = 0.0
        for step in range(steps):
            step_both(model, ref, opt, ropt, step, rank, world)
            # Right after step(): the module state_dict must already hold the update.
            worst_state = max(worst_state, max(float((a - b).abs().max()) for a, b in
                                               zip(model.state_dict().values(), ref.state_dict().values())))
            if step == steps // 2:
                saved_model = copy.deepcopy(model.state_dict())
                saved_opt = copy.deepcopy(opt.state_dict())
                opt._dc.close()
                torch.manual_seed(123)
                model = Net()  # different initial weights, replaced by the checkpoint
                opt = dc.DistributedOptimizer(OPTIMIZERS["adam"](model.parameters()),
                                              named_parameters=model.named_parameters(), config=config)
                model.load_state_dict(saved_model)
                opt.load_state_dict(saved_opt)
        result["state_dict_diff"] = worst_state
    elif name == "lr_scheduler":
        model, ref, opt, ropt = _make("sgd", config)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        rsched = torch.optim.lr_scheduler.StepLR(ropt, step_size=2, gamma=0.5)
        for step in range(steps):
            opt.zero_grad(set_to_none=(step % 2 == 0))
            loss_of(model, batch(step, rank)).backward()
            opt.step()
            sched.step()  # changes lr before the lazy update is applied: it must not apply to it
            reference_grads(ref, step, world)
            ropt.step()
            rsched.step()
    elif name == "reduce_ops":
        # Note [Reduce ops]: Min, Max and Product on every block, and Min over a DeAR plan's decoupled blocks
        # (reduce-scatter, then all-gather; under Horovod the whole block in the first stage).
        cases = [("min", "fixed", "auto"), ("max", "fixed", "auto"), ("product", "fixed", "auto")]
        if runtime.kind() == "horovod":  # and on Horovod's own operations, whose reduce-scatter sums only
            cases.append(("max", "dear", "horovod"))
        cases.append(("min", "dear", "auto"))
        for op, policy, backend in cases:
            cfg = config if policy == "fixed" else dc.Config(block_bytes=128, window=2, channels=2, policy=policy,
                                                              profile_iters=3, backend=backend)
            torch.manual_seed(0)
            model = Net()
            ref = copy.deepcopy(model)
            opt = dc.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()), named_parameters=model.named_parameters(),
                                          op=getattr(dc, op.capitalize()), config=cfg)
            ropt = OPTIMIZERS["sgd"](ref.parameters())
            for step in range(steps):
                opt.zero_grad()
                loss_of(model, batch(step, rank)).backward()
                opt.step()
                reference_grads_with(ref, step, world, op)
                ropt.step()
            opt.synchronize()
            result[f"{op}_{policy}_{backend}_diff"] = max_diff(model, ref)
            if policy == "dear":
                result[f"{backend}_dear_plan_decoupled"] = bool(opt._dc.buffers.plan.decoupled)
            if (op, policy, backend) != cases[-1]:  # the last one is the scenario's model, below
                earlier += checksum(model)
                opt._dc.close()
    elif name.startswith("profiled_"):
        # The job measures itself for 3 iterations, rank 0 plans, all switch.
        policy = name.removeprefix("profiled_")
        config = dc.Config(block_bytes=128, window=2, channels=2, policy=policy, profile_iters=3)
        model, ref, opt, ropt = _make("adam", config)
        plans = []
        for step in range(steps):
            opt.zero_grad()
            loss_of(model, batch(step, rank)).backward()
            plans.append(opt._dc.buffers.plan.to_json())
            opt.step()
            reference_grads(ref, step, world)
            ropt.step()
        result["plans"] = plans
        result["policy"] = opt.plan.policy
    else:
        raise ValueError(name)
    opt.synchronize()
    result["diff"] = max_diff(model, ref)
    result["checksum"] = checksum(model) + earlier
    result["backend"] = opt._dc.backend.name
    return result


def scenarios(names: list, horovod_first: bool = False) -> dict:
    """Several scenarios in one job (a launcher costs seconds per start)."""
    return {name: scenario(name, horovod_first=horovod_first) for name in names}


def launch_error(case: str) -> str:
    """Bad input under a 2-rank torchrun-style job: the LaunchError's message ("" if none was raised)."""
    import torch.distributed as dist

    try:
        if case == "horovod_beside_torch":
            # torch.distributed joins the 2-rank job; Horovod, not launched by
            # horovodrun, is a world of one: the two disagree.
            dist.init_process_group("gloo")
            import horovod.torch as hvd

            hvd.init()
            dc.init()
        elif case == "mpi_backend_under_torchrun":
            dc.init()
            model = Net()
            dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(),
                                    config=dc.Config(backend="mpi", policy="fixed"))
        else:
            raise ValueError(case)
    except dc.LaunchError as e:
        return str(e)
    return ""


def stalled_peer(horovod_first: bool = False, timeout_s: float = 5.0) -> dict:
    """Rank 1 stops itself (SIGSTOP) in the middle of training; rank 0 must raise within the timeout.

    Rank 0 prints what it raised and re-raises, so the job ends with an error:
    the launcher then has to bring every rank down (nothing may hang)."""
    import os
    import signal
    import sys

    _join(horovod_first)
    config = dc.Config(block_bytes=128, window=2, channels=2, policy="fixed", timeout_s=timeout_s)
    model, _, opt, _ = _make("sgd", config)
    try:
        for step in range(10):
            if step == 3 and dc.rank() == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
            opt.zero_grad()
            loss_of(model, batch(step, dc.rank())).backward()
            opt.step()
        opt.synchronize()
    except Exception as e:
        sys.stdout.write(f"STALL-DETECTED rank {dc.rank()}: {type(e).__name__}: {e}\n")
        sys.stdout.flush()
        raise
    return {}


# ---- Horovod's DistributedOptimizer arguments: compression, op, groups; 16-bit gradients ----------------


def _pair(**net_kw):
    torch.manual_seed(0)
    model = Net(**net_kw)
    return model, copy.deepcopy(model)


def _fp16(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32).to(torch.float16).to(torch.float32))


def horovod_arguments(horovod_first: bool = False, steps: int = 6, backend: str = "auto") -> dict:
    """Horovod's optimizer arguments on this job's backend; the checks are in test_horovod_api.py.

    - "wire_fp16": with ``compression=Compression.fp16`` the reduced gradient is what float16 arithmetic
      gives (each rank's value rounded to float16, summed, halved), which float32 would not; under
      ``compression=none`` it is the float32 average. Values chosen so that the two differ.
    - "fp16_training": a few steps with fp16 compression against the float32 reference (close, not equal),
      and the bytes the scheduler counts.
    - "groups": Horovod's ``groups`` (a list and a number) and ``op=hvd.Sum``-style ints train exactly like
      the reference; the plan merges each group into one block.
    - "bf16": bfloat16 parameters train (on backends without bfloat16 their blocks travel as float32).
    """
    _join(horovod_first)
    world, rank = dc.size(), dc.rank()
    config = dc.Config(block_bytes=256, window=2, channels=2, policy="fixed", backend=backend)
    out: dict = {"backend": None}

    # The reduced gradient itself, read after synchronize().
    values = (1.0 + 2.0 ** -12, 1.0 / 3.0)  # rank r's gradient is values[r % 2] everywhere
    for name, compression in (("wire_none", dc.Compression.none), ("wire_fp16", dc.Compression.fp16)):
        p = nn.Parameter(torch.zeros(1000))
        opt = dc.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), [("p", p)], compression, config=config)
        (p * values[rank % 2]).sum().backward()
        opt.synchronize()
        out[name] = p.grad[:3].tolist()
        out["backend"] = opt._dc.backend.name
        out[name + "_bytes"] = sum(opt._dc.buffers.layout.block_bytes)
        with opt.skip_synchronize():
            opt.step()
        opt._dc.close()
    f32 = [torch.tensor(v, dtype=torch.float32) for v in values[:world]] if world <= 2 else None
    out["expect_none"] = float(sum(f32) / world) if f32 is not None else None
    out["expect_fp16"] = (_fp16(sum(_fp16(v) for v in values[:world])) / world) if world <= 2 else None

    # Training with fp16 on the wire, against the float32 reference.
    model, ref = _pair()
    ropt = OPTIMIZERS["sgd"](ref.parameters())
    opt = dc.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()), model.named_parameters(),
                                  dc.Compression.fp16, config=config)
    for step in range(steps):
        step_both(model, ref, opt, ropt, step, rank, world)
    opt.synchronize()
    out["fp16_training"] = {"diff": max_diff(model, ref), "checksum": checksum(model),
                            "bytes": sum(opt._dc.buffers.layout.block_bytes),
                            "f32_bytes": sum(p.numel() * 4 for p in model.parameters())}
    opt._dc.close()

    # groups, as a list and as a number; op as Horovod's ints (0: Average, 1: Sum).
    results = {}
    for label, groups_of in (("list", lambda m: [[m.inp.weight, m.out.bias, m.mid.bias], [m.norm.weight, m.inp.bias]]),
                             ("number", lambda m: 3)):
        model, ref = _pair()
        ropt = OPTIMIZERS["adam"](ref.parameters())
        opt = dc.DistributedOptimizer(OPTIMIZERS["adam"](model.parameters()), model.named_parameters(),
                                      op=0, groups=groups_of(model), config=config)
        for step in range(steps):
            step_both(model, ref, opt, ropt, step, rank, world)
        opt.synchronize()
        names = opt._dc.names
        results[label] = {"diff": max_diff(model, ref), "checksum": checksum(model),
                          "merges": [[names[t] for t in m] for m in opt.plan.merges],
                          "blocks": [[names[t] for t in b] for b in opt._dc.buffers.layout.block_tensors]}
        opt._dc.close()
    # op=1 (Horovod's Sum): the sum of the gradients, with the learning rate divided by the world size.
    model, ref = _pair()
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05 / world), model.named_parameters(),
                                  op=1, config=config)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(steps):
        step_both(model, ref, opt, ropt, step, rank, world)
    opt.synchronize()
    results["sum"] = {"diff": max_diff(model, ref), "checksum": checksum(model)}
    opt._dc.close()
    out["groups"] = results

    # bfloat16 parameters: the reference sums the ranks' bfloat16 gradients in float32, as the wire does.
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    ref = copy.deepcopy(model)
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                                  config=config)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step, rank)
        nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
        opt.step()
        total = [torch.zeros(p.shape) for p in ref.parameters()]
        for r in range(world):
            ref.zero_grad()
            x, y = batch(step, r)
            nn.functional.mse_loss(ref(x.bfloat16()).float(), y).backward()
            for t, p in zip(total, ref.parameters()):
                t += p.grad.float()
        for t, p in zip(total, ref.parameters()):
            p.grad = (t / world).to(torch.bfloat16)
        ropt.step()
    opt.synchronize()
    out["bf16"] = {"diff": max(float((a.float() - b.float()).abs().max()) for a, b in
                               zip(model.parameters(), ref.parameters())),
                   "checksum": checksum(model), "wire": [str(d) for d in opt._dc.buffers.wire_dtypes()[:1]]}
    opt._dc.close()
    return out
