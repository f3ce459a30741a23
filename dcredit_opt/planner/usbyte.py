"""US-Byte: unequal-sized blocks, each sized to fill the link's idle time, in a searched order.

US-Byte (Zhou et al., IEEE TPDS 2024) keeps ByteScheduler's unit of
partition ``S`` but drops its fixed credit: the message sent is as large as
the idle time before the next gradient allows, so blocks are of unequal
size, and messages go one at a time rather than a fixed number in parallel.
Its order is not plain forward order either: a tensor whose message would
be overtaken by gradients that become ready while it is on the link is
promoted ahead of them when that shortens the iteration. Written here from
the paper's description; the algorithm, as we use it:

Phase 1 (during backward)
-------------------------
Events ``e_0 <= e_1 <= ...`` (``simulate.py``); the link is free from
``free``. At event ``i``, while ``start = max(e_i, free)`` is before
``e_{i+1}`` and a ready tensor has bytes left: take the ready tensor of
best priority, with ``r`` bytes left, and with ``gap = e_{i+1} - start``
send one message of

* one unit ``S`` when ``gap < alpha`` (the link would idle otherwise),
* ``ceil((gap - alpha) / (beta * S))`` units when ``gap < alpha + beta*r``
  (exactly fills the gap),
* all ``r`` bytes otherwise,

(never more than ``r``), and advance ``free`` by ``alpha + beta * bytes``.
A message carries one tensor's bytes only. The last event sends nothing.

Phase 2 (after backward)
------------------------
What is left of each tensor goes as one message, in priority order, one at
a time; each layer's forward waits for its own last message (the paper's
optimal phase-2 rule: remainders whole, forward order).

Order (the paper's priority adjustment)
---------------------------------------
Starting from forward order, tensors are visited in ready order; tensor
``l`` sends its first message at ``s_l`` and would be done at
``tau = s_l + alpha + beta * bytes(l)`` if sent whole. Every tensor whose
gradient becomes ready after ``l``'s and before ``tau`` would preempt it.
``l`` is moved just ahead of the first of them in the order, and the move
is kept when the model's iteration time gets shorter.

In plan terms (``plan.py``): each tensor's ``partition`` is its messages,
in the order it sends them; ``priority`` is the searched order; event
``i`` releases as many blocks as the model sends in the gap after it; the
flush releases one block per group (``phase2_windows = (1,)``). The heap
pops what the model picks (best priority first, a tensor's messages by
offset), so the runtime sends the same messages. Deviations, forced by the
runtime's single per-tensor priority and group window: messages released at
one event may overlap on the link (the model sends them one after
another), and phase 2 follows the searched order rather than forward order
(the search evaluates exactly that, so a promotion that hurts phase 2 is
not kept).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from .plan import Plan
from .profile import Profile, bytes_of
from .sharing import pause
from .simulate import event_times


class _Model:
    """US-Byte's analytic model of one iteration for a given order; cheap, run many times by the search."""

    def __init__(self, profile: Profile, block_bytes: int, update_s: float = 0.0) -> None:
        self.profile = profile
        self.alpha, self.beta = profile.alpha_s, profile.beta_s_per_byte
        self.order = profile.order()
        self.events = event_times(profile)
        self.itemsize = [bytes_of(t.dtype) for t in profile.tensors]
        # One unit of partition, in elements of each tensor (at least one element).
        self.unit = [max(1, block_bytes // s) for s in self.itemsize]
        self.numel = list(profile.numels)
        total = sum(profile.nbytes)
        T = profile.num_tensors
        self.fwd = [t.fwd_s + (update_s * t.nbytes / total if total else update_s / max(T, 1))
                    for t in profile.tensors]

    def run(self, rank: Sequence[int]) -> tuple[float, list[list[int]], list[int], list[float]]:
        """(iteration, messages per tensor in elements, messages per event, first-send time per tensor)."""
        pause()  # Note [Planning beside training]
        alpha, beta, events, order = self.alpha, self.beta, self.events, self.order
        n = len(order)
        left = list(self.numel)
        messages: list[list[int]] = [[] for _ in left]
        per_event = [0] * n
        first_send = [math.nan] * len(left)
        done = [0.0] * len(left)
        heap: list[tuple[int, int]] = []
        free = 0.0
        for i, t in enumerate(order):
            if left[t]:
                heapq.heappush(heap, (rank[t], t))
            if i + 1 == n:
                break
            nxt = events[i + 1]
            start = max(events[i], free)
            while heap and start < nxt:
                u = heap[0][1]
                size = self.itemsize[u]
                rest = left[u] * size
                gap = nxt - start
                if gap < alpha:
                    elems = self.unit[u]
                elif gap < alpha + beta * rest:
                    elems = max(1, math.ceil((gap - alpha) / (beta * self.unit[u] * size))) * self.unit[u]
                else:
                    elems = left[u]
                elems = min(elems, left[u])
                if not messages[u]:
                    first_send[u] = start
                messages[u].append(elems)
                left[u] -= elems
                per_event[i] += 1
                start += alpha + beta * elems * size
                done[u] = start
                if not left[u]:
                    heapq.heappop(heap)
            if per_event[i]:
                free = start
        # Phase 2: remainders whole, best priority first, one after another.
        backward_end = events[-1] if events else 0.0
        start = max(backward_end, free)
        for _, u in sorted(heap):
            if not messages[u]:
                first_send[u] = start
            messages[u].append(left[u])
            start += alpha + beta * left[u] * self.itemsize[u]
            done[u] = start
        # Forward: each layer waits for its own last message.
        end = backward_end
        for t in range(len(left)):
            end = max(end, done[t] if self.numel[t] else 0.0) + self.fwd[t]
        return end, messages, per_event, first_send


def _promoted(rank: list[int], l: int, ahead_of: set[int]) -> list[int] | None:
    """``rank`` with tensor ``l`` moved just before the best-ranked tensor of ``ahead_of``; None if no move."""
    target = min(rank[u] for u in ahead_of)
    if rank[l] < target:
        return None
    new = list(rank)
    for u, r in enumerate(rank):
        if target <= r < rank[l]:
            new[u] = r + 1
    new[l] = target
    return new


def search_order(model: _Model) -> list[int]:
    """The paper's priority adjustment (module docstring), from forward order, evaluated by the model."""
    profile = model.profile
    rank = list(range(profile.num_tensors))
    best, _, _, first_send = model.run(rank)
    events, order = model.events, model.order
    position = {t: i for i, t in enumerate(order)}
    for l in order:
        if not profile.tensors[l].numel or math.isnan(first_send[l]):
            continue
        tau = first_send[l] + model.alpha + model.beta * profile.tensors[l].nbytes
        ahead_of = set()
        for j in range(position[l] + 1, len(order)):
            if events[j] >= tau:
                break
            ahead_of.add(order[j])
        if not ahead_of:
            continue  # nothing becomes ready while l is on the link
        candidate = _promoted(rank, l, ahead_of)
        if candidate is None:
            continue
        cost, _, _, sends = model.run(candidate)
        if cost < best * (1 - 1e-12):  # a real gain, not rounding
            best, rank, first_send = cost, candidate, sends
    return rank


def usbyte(profile: Profile, *, block_bytes: int = 4 << 20, search: bool = True, channels: int = 1,
           update_s: float = 0.0) -> Plan:
    """The US-Byte plan for unit ``block_bytes`` (module docstring); ``search=False`` keeps forward order."""
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    model = _Model(profile, block_bytes, update_s)
    rank = search_order(model) if search else list(range(profile.num_tensors))
    _, messages, per_event, _ = model.run(rank)
    return Plan(
        numels=profile.numels,
        order=profile.order(),
        partition=tuple(tuple(m) for m in messages),
        priority=tuple(rank),
        phase1_windows=tuple(per_event),
        phase2_windows=(1,),
        channels=channels,
        overlap_forward=True,
        policy="usbyte",
    )


def unit_grid(block_sizes: Sequence[int], per_octave: int) -> list[int]:
    """``per_octave`` sizes per factor of two from the smallest of ``block_sizes``, as many as
    ``per_octave * len(block_sizes)``: the same count of candidates over the same range as a grid of
    ``block_sizes`` times ``per_octave`` credits."""
    if not block_sizes:
        return []
    low = min(block_sizes)
    return sorted({max(1, round(low * 2 ** (k / per_octave))) for k in range(per_octave * len(block_sizes))})
