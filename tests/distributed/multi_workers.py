"""What each rank runs in test_multi_optimizer.py: several DistributedOptimizers in one process.

Each optimizer must reduce on channels of its own (invariant 7 of the design:
process groups, communicators, Horovod names). Two optimizers' blocks are in
flight at the same time, launched by two dispatch threads whose relative
timing differs between ranks; on shared channels the collectives would pair
up by that timing, not by block. To make the timing differ, every rank
sleeps a random 0 to ``max_sleep_ms`` (its own seed) in forward, in backward
and between steps.

The reference is the synchronous one of ``workers.py``: every rank
regenerates every rank's batch, averages the gradients by hand and steps a
plain torch.optim optimizer.
"""

from __future__ import annotations

import copy
import random
import time
import weakref

import torch

import dcredit_opt as dc

from .workers import OPTIMIZERS, Net, _join, batch, loss_of, reference_grads

# Model B trains on other batches than model A: its batches are those of these later steps.
B_STEPS = 1000


class _Skew:
    """Random sleeps of 0 to ``max_ms`` milliseconds, seeded per rank, so that the ranks drift apart."""

    def __init__(self, rank: int, max_ms: float):
        self._rng = random.Random(7 + 1009 * rank)
        self._max_s = max_ms / 1000

    def __call__(self, *_) -> None:
        time.sleep(self._rng.uniform(0, self._max_s))

    def install(self, model: Net) -> None:
        """A sleep before ``mid``'s forward and in backward, when ``mid.weight``'s gradient is computed."""
        model.mid.register_forward_pre_hook(lambda module, args: self())
        model.mid.weight.register_hook(lambda grad: self())


def _net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def _params(model: Net, prefixes: tuple) -> list:
    return [(n, p) for n, p in model.named_parameters() if n.startswith(prefixes)]


def _result(models: list, refs: list, opts: list) -> dict:
    """Each model's parameters, the worst difference from its reference, and who carried the blocks."""
    diff = max(float((p - q).abs().max()) for m, r in zip(models, refs)
               for p, q in zip(m.state_dict().values(), r.state_dict().values()))
    return {"diff": diff, "params": [{k: v.clone() for k, v in m.state_dict().items()} for m in models],
            "backends": [opt._dc.backend.name for opt in opts]}


def two_models(config: dc.Config, skew: _Skew, steps: int) -> dict:
    """(a) Two models, each with its own optimizer (SGD with momentum, Adam), trained in one loop:
    both forwards, both backwards, both steps, so that A's blocks are still in flight while B's go out."""
    world, rank = dc.size(), dc.rank()
    models = [_net(0), _net(1)]
    refs = [copy.deepcopy(m) for m in models]
    for m in models:
        skew.install(m)
    opts = [dc.DistributedOptimizer(OPTIMIZERS[kind](m.parameters()), named_parameters=m.named_parameters(),
                                    config=config) for kind, m in zip(("sgd", "adam"), models)]
    ropts = [OPTIMIZERS[kind](r.parameters()) for kind, r in zip(("sgd", "adam"), refs)]
    offsets = (0, B_STEPS)
    for step in range(steps):
        for opt in opts:
            opt.zero_grad()
        losses = [loss_of(m, batch(step + off, rank)) for m, off in zip(models, offsets)]
        skew()
        for loss in losses:
            loss.backward()
            skew()
        for opt in opts:
            opt.step()
            skew()
        for ref, ropt, off in zip(refs, ropts, offsets):
            reference_grads(ref, step + off, world)
            ropt.step()
    for opt in opts:
        opt.synchronize()
    out = _result(models, refs, opts)
    for opt in opts:
        opt._dc.close()
    return out


def replaced(config: dc.Config, skew: _Skew, steps: int) -> dict:
    """(c) Optimizers replaced mid-training, each right after a step() whose updates may still wait:
    SGD, then ``opt = DistributedOptimizer(Adam)`` over the same parameters (it takes over), then
    ``del opt`` and a fresh SGD (the dropped one applies its updates in the next forward, then drains).
    Ranks reach each replacement at different times (skew)."""
    world, rank = dc.size(), dc.rank()
    model = _net(5)
    ref = copy.deepcopy(model)
    skew.install(model)
    phases = ("sgd", "adam", "sgd")
    opt = None
    step = 0
    for phase, kind in enumerate(phases):
        if phase == 2:
            del opt  # dropped, not closed
            opt = None
        opt = dc.DistributedOptimizer(OPTIMIZERS[kind](model.parameters()), named_parameters=model.named_parameters(),
                                      config=config)
        ropt = OPTIMIZERS[kind](ref.parameters())
        for _ in range(steps // 3):
            opt.zero_grad()
            loss_of(model, batch(step, rank)).backward()
            skew()
            opt.step()
            skew()
            reference_grads(ref, step, world)
            ropt.step()
            step += 1
    opt.synchronize()
    out = _result([model], [ref], [opt])
    opt._dc.close()
    return out


def _split_step(model, ref, opts, ropts, step: int, skew: _Skew, model_zero_grad: bool = False) -> None:
    """One step of a model whose parameters two optimizers share out, and of its synchronous reference: the
    gradients cleared (by the optimizers, or ``model.zero_grad()``), a loss and its backward, each optimizer's
    step, with the rank's sleeps between."""
    for m, os_ in ((model, opts), (ref, ropts)):
        if model_zero_grad:
            m.zero_grad()
        else:
            for o in os_:
                o.zero_grad()
    loss = loss_of(model, batch(step, dc.rank()))
    skew()
    loss.backward()
    skew()
    for opt in opts:
        opt.step()
        skew()
    reference_grads(ref, step, dc.size())
    for ropt in ropts:
        ropt.step()


def split_model(config: dc.Config, skew: _Skew, steps: int) -> dict:
    """(b) One model whose parameters are split between two optimizers: the first layers under SGD
    with momentum, the rest under Adam. One backward makes both optimizers' gradients."""
    model = _net(2)
    ref = copy.deepcopy(model)
    skew.install(model)
    split = (("inp.", "mid."), ("norm.", "out."))
    opts = [dc.DistributedOptimizer(OPTIMIZERS[kind]([p for _, p in _params(model, prefixes)]),
                                    named_parameters=_params(model, prefixes), config=config)
            for kind, prefixes in zip(("sgd", "adam"), split)]
    ropts = [OPTIMIZERS[kind]([p for _, p in _params(ref, prefixes)]) for kind, prefixes in zip(("sgd", "adam"), split)]
    for step in range(steps):
        _split_step(model, ref, opts, ropts, step, skew)
    for opt in opts:
        opt.synchronize()
    out = _result([model], [ref], opts)
    for opt in opts:
        opt._dc.close()
    return out


def interleaved_split(config: dc.Config, skew: _Skew, steps: int) -> dict:
    """(d) One model split between two optimizers by kind, so that their parameters' memory interleaves (each
    layer's weight, then its bias): the weight matrices under SGD with momentum, the biases and the norm under
    Adam, as decayed and undecayed groups are often split. Every other step clears the gradients with
    ``model.zero_grad()`` (every guard stands aside for neither optimizer's zero_grad then), and every third an EMA
    reads the weight matrices after both steps, while both optimizers' updates wait: the read applies SGD's
    updates with Adam's guard lifted, its parameters sharing no byte with SGD's (Note [Several guards])."""
    model = _net(7)
    ref = copy.deepcopy(model)
    skew.install(model)

    def split(m):
        weights = [(n, p) for n, p in m.named_parameters() if p.dim() > 1]
        return weights, [(n, p) for n, p in m.named_parameters() if p.dim() <= 1]

    opts = [dc.DistributedOptimizer(OPTIMIZERS[kind]([p for _, p in named]), named_parameters=named, config=config)
            for kind, named in zip(("sgd", "adam"), split(model))]
    ropts = [OPTIMIZERS[kind]([p for _, p in named]) for kind, named in zip(("sgd", "adam"), split(ref))]
    emas = [[p.detach().clone() for _, p in split(m)[0]] for m in (model, ref)]
    for step in range(steps):
        _split_step(model, ref, opts, ropts, step, skew, model_zero_grad=step % 2 == 1)
        if step % 3 == 2:
            for m, ema in zip((model, ref), emas):
                with torch.no_grad():
                    for e, (_, p) in zip(ema, split(m)[0]):
                        e.mul_(0.9).add_(p, alpha=0.1)
    for opt in opts:
        opt.synchronize()
    out = _result([model], [ref], opts)
    out["diff"] = max(out["diff"], max(float((e - f).abs().max()) for e, f in zip(*emas)))
    for opt in opts:
        opt._dc.close()
    return out


def _alive(group) -> bool:
    import torch.distributed as dist

    try:
        dist.get_backend(group)
    except ValueError:  # not in c10d's map of groups any more: destroyed
        return False
    return True


def channel_lifecycle(config: dc.Config) -> dict:
    """torch backend: each optimizer's process groups are its own, gone when it closes; ``dc.shutdown()``
    closes the rest and ends the job's torch.distributed (dcredit_opt set it up)."""
    import torch.distributed as dist

    models = [_net(3), _net(4)]
    opts = [dc.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                    config=config) for m in models]
    groups = [opt._dc.backend._groups for opt in opts]
    out = {"own_groups": [len(g) for g in groups] == [config.channels] * 2
                         and len({id(g) for gs in groups for g in gs}) == 2 * config.channels,
           "alive_when_built": all(_alive(g) for gs in groups for g in gs)}
    opts[0]._dc.close()
    out["closed_destroys_its_own"] = not any(_alive(g) for g in groups[0]) and all(_alive(g) for g in groups[1])
    dc.shutdown()
    out["shutdown_destroys_the_rest"] = not dist.is_initialized() and not dc.is_initialized()
    return out


def multi_optimizer(backend: str = "auto", block_bytes: int = 128, horovod_first: bool = False, steps: int = 12,
                    max_sleep_ms: float = 20.0) -> dict:
    """Both cases with a fixed plan; (a) again with both optimizers profiling themselves, so that
    each one's alpha/beta sweep runs while the other's blocks are in flight."""
    _join(horovod_first)
    skew = _Skew(dc.rank(), max_sleep_ms)
    fixed = dc.Config(policy="fixed", block_bytes=block_bytes, window=2, channels=2, backend=backend)
    profiled = dc.Config(policy="dcredit", profile_iters=2, block_bytes=block_bytes, window=2, channels=2,
                         backend=backend)
    out = {"two_models": two_models(fixed, skew, steps),
           "split_model": split_model(fixed, skew, steps),
           "interleaved_split": interleaved_split(fixed, skew, steps),
           "replaced": replaced(fixed, skew, steps),
           "two_models_profiled": two_models(profiled, skew, steps)}
    if backend == "torch":
        out["lifecycle"] = channel_lifecycle(fixed)
    return out


def close_before_peer_tally(backend: str, steps: int = 1, delay_s: float = 2.0) -> dict:
    """An optimizer closed (``_dc.close()``) and another dropped (``del``) while the peer's last tally (Note
    [Global usage]) has not started: rank 1 starts each of its tallies ``delay_s`` late. The closing rank must
    not free the tally's buffer while the peer can still complete the sum into it (MPI writes into it then:
    heap corruption), nor destroy the channel the peer's tally is about to use: each close waits for it
    (``close_s`` on rank 0 covers the delay). Then heap churn, and a third optimizer that must still train like
    the reference. One step per optimizer (3 before: CI time; each step waits out the peer's ``delay_s``): the close
    that must wait follows the optimizer's last step either way, and the third optimizer still trains after two
    closes."""
    import gc

    from dcredit_opt.backends import mpi

    dc.init()
    world, rank = dc.size(), dc.rank()
    config = dc.Config(policy="fixed", block_bytes=512, window=2, channels=2, backend=backend)
    model = _net(6)
    ref = copy.deepcopy(model)
    out, step = {}, 0
    for case in ("closed", "dropped", "after"):
        opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      named_parameters=model.named_parameters(), config=config)
        ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        chan = opt._dc.backend
        if rank == 1:  # late at both ways a tally starts: the Python turn, and the C++ one (TallyTurns)
            start = chan.start_tally
            chan.start_tally = lambda counts, start=start: (time.sleep(delay_s), start(counts))
            if hasattr(chan, "turn_tally"):
                turn = chan.turn_tally
                chan.turn_tally = lambda *args, turn=turn: (time.sleep(delay_s), turn(*args))[1]
        for _ in range(steps):
            opt.zero_grad()
            loss_of(model, batch(step, rank)).backward()
            opt.step()
            reference_grads(ref, step, world)
            ropt.step()
            step += 1
        began = time.monotonic()
        if case == "closed":
            opt._dc.close()
        elif case == "dropped":
            alive = weakref.ref(opt)
            del opt
            with torch.no_grad():
                model(batch(step, rank)[0])  # applies the dropped optimizer's updates; then it is freed
            gc.collect()
            out["dropped_freed"] = alive() is None
        else:
            opt.synchronize()
            opt._dc.close()
        out[case] = {"tally_left": len(mpi._IN_FLIGHT_AT_CLOSE) if backend == "mpi" else int(chan._tally.in_flight),
                     "close_s": time.monotonic() - began}
        del chan
        junk = [torch.randn(1000 + 37 * i) for i in range(2000)]  # reuse whatever the closes freed
        del junk
    out["diff"] = max(float((p - q).abs().max()) for p, q in zip(model.state_dict().values(),
                                                                  ref.state_dict().values()))
    return out
