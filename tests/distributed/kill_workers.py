"""What each rank runs in test_kill_anywhere.py: one rank of the job dies (SIGKILL) or stops (SIGSTOP) at a
seeded random point of one phase of training (issue R1, item 1).

The model reads tokens through an ``nn.Embedding`` (so the embedding rows are exchanged at every ``step()``
once the ranks agree, Note [Embedding rows]), then two linear layers; the policy is profiled (D-Credit,
``profile_iters=2``), so the job profiles itself, stages the plan and switches to it. Phases, where the victim
injects its fault:

- ``backward``: from the gradient hook of a random parameter, at a random step;
- ``forward``: from a forward pre-hook of a random module, in the forward after a lazy ``step()`` (where the
  lazy step applies the last step's updates);
- ``profiling``: inside the network sweep that ends profiling, at a random one of its collectives;
- ``staged``: in the iteration between the ``step()`` that staged the profiled plan and the backward that
  switches to it (from a random gradient hook, or after ``step()``);
- ``rows``: inside the exchange of the embedding rows, at a random ``step()`` (before its collectives, or
  after a random delay while the peers are in them);
- ``shutdown``: the others in ``dc.shutdown()``: the victim dies in its last ``step()`` once its rows are
  exchanged and before it releases its last blocks (the others then wait for them in ``dc.shutdown()``), or
  at the start of its own ``dc.shutdown()`` (the others may then have had every block already: a death
  after the last collective, which no survivor needs to know about).

Every rank prints one line per event (``FAULT``, ``RAISED``, ``DONE``) with a wall-clock time, which the test
reads from the output; a survivor re-raises what it caught, so it leaves through the interpreter, as a job
would. A survivor that ends without an error, or whose error says its weights are those of synchronous training,
compares them with synchronous training's (``DONE``, ``CLAIMED``).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import torch
from torch import nn

import dcredit_opt as dc

PHASES = ("backward", "forward", "profiling", "staged", "rows", "shutdown")
SYNC_CLAIM = "so the weights are those of synchronous training"
"""What ``dc.shutdown()``'s error says when a peer was lost after the last collective (Note [Lost peers])."""
STEPS = 10
PROFILE_ITERS = 2
VOCAB, WIDTH, TOKENS = 64, 16, 6


class TokenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.hidden = nn.Linear(WIDTH, 24)
        self.out = nn.Linear(24, 5)

    def forward(self, tokens):
        return self.out(torch.relu(self.hidden(self.embed(tokens).mean(1))))


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randint(0, VOCAB, (8, TOKENS), generator=g), torch.randn(8, 5, generator=g)


def _join(horovod_first: bool, timeout_s: float) -> None:
    if horovod_first:
        import horovod.torch as hvd

        hvd.init()
    dc.init(timeout_s=timeout_s)
    # Every rank here before the first collective with the short timeout: start-up on 2 busy cores (4 ranks,
    # a launcher) can part the ranks by more than timeout_s, and a fault-free start is not what is tested.
    start_barrier(dc.size())


def start_barrier(world: int, timeout_s: float = 240.0) -> None:
    if world == 1:
        return
    if dc.world.runtime.kind() == "horovod":
        import horovod.torch as hvd

        hvd.allreduce(torch.zeros(1), name="kill_workers.start")  # Horovod's own wait: no deadline
        return
    if dc.world.runtime.kind() == "mpi":  # no torch.distributed default group under mpiexec (Note [Private groups])
        from mpi4py import MPI

        MPI.COMM_WORLD.Barrier()  # MPI's own wait: no deadline
        return
    import datetime

    import torch.distributed as dist

    dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))


def _say(text: str) -> None:
    print(f"{text} at={time.time():.3f}", flush=True)


def kill_worker(victim: int, mode: str, phase: str, seed: int, collective_timeout_s: float, horovod_first: bool = False,
                trace: bool = False, tag: str = "") -> dict:
    """Train STEPS steps; the victim injects its fault in ``phase``; every other rank must raise. ``tag`` only
    marks the command line, so that the test can look for processes left behind."""
    rng = random.Random(seed)
    _join(horovod_first, collective_timeout_s)
    rank, world = dc.rank(), dc.size()
    torch.manual_seed(0)
    model = TokenNet()
    params = list(model.parameters())
    config = dc.Config(policy="dcredit", profile_iters=PROFILE_ITERS, block_bytes=128, channels=2,
                       timeout_s=collective_timeout_s)
    opt = dc.DistributedOptimizer(torch.optim.SGD(params, lr=0.05, momentum=0.9),
                                  named_parameters=model.named_parameters(), config=config)
    state = {"step": -1, "where": "start", "rows_calls": 0, "sweep_calls": 0}
    me = rank == victim

    def inject(where: str) -> None:
        _say(f"FAULT {mode} rank={rank} phase={phase} step={state['step']} where={where}")
        os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
        time.sleep(600)  # not reached: SIGKILL ends us; a stopped rank is killed by the harness

    fault_step = rng.randrange(4, STEPS - 1)  # after profiling and the switch; rows flow by then
    # Not the embedding's weight (params[0]): its gradient goes to a stand-in (Note [Embedding rows]).
    trigger = rng.randrange(1, len(params))
    modules = [model.embed, model.hidden, model.out]
    delay_s = rng.uniform(0.0, 0.03)

    if me and phase == "backward":
        def grad_hook(p):
            if state["step"] == fault_step:
                inject(f"backward, after the gradient of parameter {trigger}")
        params[trigger].register_post_accumulate_grad_hook(grad_hook)
    staged_in_forward = rng.random() < 0.5
    if me and (phase == "forward" or (phase == "staged" and staged_in_forward)):
        module = modules[rng.randrange(len(modules))]

        def forward_hook(mod, args):
            if phase == "forward" and state["step"] == fault_step:
                time.sleep(delay_s)
                inject(f"the forward after a lazy step(), before {type(mod).__name__}")
            if phase == "staged" and opt._dc.staged_plan is not None:
                inject(f"the forward while a profiled plan is staged, before {type(mod).__name__}")
        module.register_forward_pre_hook(forward_hook)
    if me and phase == "profiling":
        sweep = opt._dc.backend.sweep_collectives
        nth = rng.randrange(1, 6)

        def faulty_sweep():
            allreduce, barrier = sweep()

            def dying(buf):
                state["sweep_calls"] += 1
                if state["sweep_calls"] == nth:
                    inject(f"profiling, before collective {nth} of the network sweep")
                return allreduce(buf)
            return dying, barrier
        opt._dc.backend.sweep_collectives = faulty_sweep
    if me and phase == "rows":
        exchange = opt._dc.backend.exchange_rows
        before = rng.random() < 0.5

        def dying_exchange(*args, **kwargs):
            state["rows_calls"] += 1
            if state["step"] >= fault_step:
                if before:
                    inject("exchanging the embedding rows, before its collectives")
                threading.Timer(delay_s, inject, args=("exchanging the embedding rows, during its collectives",)
                                ).start()
            return exchange(*args, **kwargs)
        opt._dc.backend.exchange_rows = dying_exchange
    shutdown_inside = rng.random() < 0.5
    if me and phase == "shutdown" and not shutdown_inside:
        # The last step(): its rows exchanged, the victim dies before releasing its last blocks, so every
        # survivor is in dc.shutdown(), waiting for them, when it learns.
        exchange = opt._dc.backend.exchange_rows

        def exchange_then_die(*args, **kwargs):
            got = exchange(*args, **kwargs)
            if state["step"] == STEPS - 1:
                inject("the last step(), its rows exchanged and its last blocks not released; the others "
                       "in dc.shutdown()")
            return got
        opt._dc.backend.exchange_rows = exchange_then_die
    if me and phase == "shutdown" and shutdown_inside:
        def dying_close():
            time.sleep(delay_s / 10)
            inject("dc.shutdown(), before closing the optimizer, blocks of the last step() perhaps in flight")
        opt._dc.close = dying_close

    log = []
    try:
        for step in range(STEPS):
            state["step"] = step
            opt.zero_grad()
            tokens, target = batch(step, rank)
            nn.functional.mse_loss(model(tokens), target).backward()
            opt.step()
            log.append((step, opt._dc.staged_plan is not None, state["rows_calls"]))
            if me and phase == "staged" and opt._dc.staged_plan is not None and not staged_in_forward:
                time.sleep(delay_s)
                inject("after the step() that staged the profiled plan")
        if phase == "shutdown":
            state["where"] = "shutdown"
            dc.shutdown()
        else:
            opt.synchronize()
    except Exception as e:
        message = str(e).replace("\n", " ")
        _say(f"RAISED rank={rank} {type(e).__module__}.{type(e).__name__}: {message} |")
        if SYNC_CLAIM in message:  # a peer lost after the last collective: check what the error claims
            diff = max_diff_to_reference(model, world)
            _say(f"CLAIMED rank={rank} sync={diff < 1e-5} max_diff={diff:.3g}")
        raise
    if trace:
        _say(f"TRACE rank={rank} {log}")
    # A survivor that ends without an error claims the weights of synchronous training: check them.
    diff = max_diff_to_reference(model, world)
    _say(f"DONE rank={rank} sync={diff < 1e-5} max_diff={diff:.3g}")
    return {"log": log}


def max_diff_to_reference(model: nn.Module, world: int) -> float:
    """How far ``model`` is from synchronous data parallelism over ``world`` ranks (every rank's batches
    regenerated here, gradients averaged, the same SGD)."""
    torch.manual_seed(0)
    ref = TokenNet()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        for r in range(world):
            tokens, target = batch(step, r)
            (nn.functional.mse_loss(ref(tokens), target) / world).backward()
        opt.step()
    return max((a.detach() - b.detach()).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
