"""D-Credit: equal blocks, a greedy window per event in backward, optimal windows after it.

Notation as in DESIGN.md section 4: tensors ``0 .. L-1`` in forward order,
block size ``S`` bytes, ``T(k) = alpha + beta * (bytes of the k blocks)``
for a window of blocks sent together, forward time ``f_l`` (plus the
tensor's share ``u_l`` of the optimizer update, 0 by default).

Blocks
------
Tensors larger than ``S`` are cut into blocks of ``S`` bytes (the last
shorter); runs of small neighbours in ready order are packed into blocks of
at most ``S`` (:func:`packing_merges`), so that a model of many small
tensors does not pay a collective per bias: the plan for the ResNet-like
benchmark profile at 10 Gbit/s has 31 collectives per iteration instead of
69. Each collective also costs the host a hand-over, a wake-up of the
launching thread, the backend's work and a completion, which the link model
does not charge; the simulator does (``Profile.host_s_per_collective``), and the
search (search.py) weighs it against what smaller blocks hide.

Phase 1 (during backward): greedy
---------------------------------
Events are processed at ``e_0 <= e_1 <= ...`` (simulate.py). The planner
keeps ``free``, the time the link finishes what was released so far, each
group costing ``T`` after ``max(e_i, free)``. At event ``i`` let
``idle = e_{i+1} - max(e_i, free)`` be the link's idle time until the next
gradient is ready and ``dt = idle - alpha``. When ``idle > 0``, release,
highest priority first, the fewest blocks whose bytes reach
``max(dt / beta, S)``; otherwise none. With full-size blocks this is the
design's rule exactly: ``ceil(dt / (beta * S))`` blocks when ``dt > 0``, one
when ``-alpha < dt <= 0``, none when ``dt <= -alpha``. Counting bytes rather
than blocks matters for small tensors (each one short block): a "block"
of a 400-byte bias would otherwise pay a whole start-up. Blocks kept in
the heap can still be overtaken by higher-priority gradients, while the
link is kept busy until the next decision. One addition: blocks that no
later gradient can overtake (their priority beats every block still to
come) are released too, since holding them back serves no purpose; with
gradients ready in reverse forward order this never happens. The last
event releases nothing: the flush follows at once and phase 2 decides.

Phase 2 (after backward, overlapping the next forward): derivation
------------------------------------------------------------------
At the flush ``tau`` (end of backward) the heap holds blocks ``1 .. N`` in
release order (forward order, since priority is the forward index), of
``s_i`` bytes, with prefix sums ``P(i)``; the link is idle from ``t0 >= tau``.
Let ``F_l = sum_{j >= l} (u_j + f_j)`` and ``g_i = F`` of block ``i``'s
tensor; ``g`` is non-increasing in ``i``.

1. *Objective.* Unrolling ``fwd_end[l] = max(fwd_end[l-1], done(l)) + u_l + f_l``
   from ``fwd_end[-1] = tau`` gives
   ``fwd_end[L-1] = max(tau + F_0, max_l (done(l) + F_l))``. The first term,
   and the terms of tensors finished before the flush, do not depend on
   the phase-2 windows, so we minimise ``Phi = max_i (c_i + g_i)``, ``c_i``
   the completion of block ``i``.
2. *Batches.* Equal blocks launched together on an idle link finish
   together (processor sharing), so the in-flight count falls from ``k`` to
   0 at one instant and whatever launches next launches together: every
   phase-2 schedule is a sequence of batches of consecutive blocks, batch
   ``j`` ending at block ``E_j`` and finishing at
   ``C_j = t0 + j*alpha + beta*P(E_j)``. ``g`` is largest at a batch's first
   block ``h_j``, so ``Phi = t0 + max_j (j*alpha + beta*P(E_j) + g(h_j))``.
3. *Cut only between tensors.* Call a maximal run of blocks with equal
   ``g`` a unit. If batch ``j`` ends inside a unit: when batch ``j`` lies in
   that unit, merging it into batch ``j+1`` lowers that term by ``alpha`` and
   every later one too; otherwise moving batch ``j``'s blocks of that unit
   into batch ``j+1`` lowers batch ``j``'s term and keeps batch ``j+1``'s
   (same head ``g``, same end). So some optimal schedule cuts only between
   units.
4. *Greedy feasibility.* ``Phi <= t0 + W`` is achievable iff making each
   batch as long as ``j*alpha + beta*P(E_j) + g(h_j) <= W`` allows covers all
   units. (Induction: if the greedy's batch ``j-1`` ends no earlier than
   that of any feasible schedule, its batch ``j`` starts no earlier, so its
   head ``g`` is no larger and its batch ``j`` can end no earlier; and its
   first unit fits because in the other schedule that unit sits in a batch
   of index ``>= j`` with a head ``g`` no smaller.)
5. *Optimum.* Feasibility is monotone in ``W``, so the optimal ``W*`` is
   the least ``W`` for which the greedy succeeds, and the windows are, for
   ``j = 1, 2, ...``::

       E_j = max { e : beta * P(e) <= W* - j*alpha - g(h_j) },  h_{j+1} = E_j + 1

   i.e. each window carries every block that can still arrive before the
   forward, running without a stall from then on, would need them. ``W*``
   lies between ``max(alpha + beta*P(first unit) + g_1, alpha + beta*P(N) + g_N)``
   and the one-batch cost ``alpha + beta*P(N) + g_1``; the greedy changes
   its choices at finitely many ``W``, so bisection to a relative 1e-12 and
   the greedy at the upper end give the batches of ``W*`` itself.
6. *Windows that make those batches* (Note [Group window] in simulate.py).
   Non-increasing batch sizes ``b_1 >= b_2 >= ...`` are the windows
   themselves: group ``j+1`` cannot start while ``b_j >= b_{j+1}`` blocks are
   in flight. Otherwise use ``(1, b_1, ..., b_m)``: the first group (window
   1) starts when the link is idle; whenever a batch ends, one block of the
   current group is left and the next group's window ``b`` lets ``b - 1`` of
   its blocks join it, so the batch has ``b`` blocks and again one is left;
   the heap runs out one block into the last group, which keeps window
   ``b_m``.

This is exact (the simulator's optimum over every window sequence; tested
by exhaustive search) when the blocks are of equal size and the link is
idle at the flush. Shorter tail blocks finish early and let the next batch
start early, and phase-1 blocks may still be in flight at the flush; there
it is the model's optimum. For the second case :func:`dcredit` (with
``refine=True``) also tries the same batches with the first window enlarged
by the ``k`` blocks still pending, so that the first batch launches at once
beside them and overlaps its latency with their transfer, and keeps
whichever the simulator finds faster. The analytic windows are always a
candidate, so refinement never makes a plan slower in the simulator.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
from collections.abc import Sequence

from .plan import ALL, Plan, split_evenly
from .profile import Profile, bytes_of
from .simulate import BlockTable, FlushSnapshot, block_table, ready_times

DEFAULT_BLOCK_BYTES = 4 << 20
"""4 MiB (also ``Config.block_bytes``'s default): large enough that one collective's launch overhead (tens of
microseconds of CPU) and startup cost (alpha) are small beside its transfer on 1-100 Gbit/s links, small enough
that a ResNet or BERT layer is cut into several blocks that windows can regroup, and that a high-priority
gradient waits at most a few milliseconds behind one."""


def packing_merges(profile: Profile, block_bytes: int) -> list[list[int]]:
    """Runs of small neighbouring gradients packed into one block of at most ``block_bytes``.

    D-Credit's blocks are of about one size. Cutting makes large tensors
    fit; packing does the same for small ones (biases, norms, early
    convolutions), which would otherwise each pay a collective's start-up
    and its launch, completion and update on the ranks' own cores. A run
    grows along the ready order while the next tensor is neither empty (no
    block) nor larger than a block (cut into several), is of the same dtype,
    keeps the run within ``block_bytes``, and is ready within ``alpha + beta
    * block_bytes`` of the run's first event: a packed block
    waits for its last gradient no longer than one full block takes to send.
    """
    alpha, beta = profile.alpha_s, profile.beta_s_per_byte
    patience = alpha + beta * block_bytes
    ready = ready_times(profile)
    runs: list[list[int]] = []
    run: list[int] = []
    run_bytes, first_event, latest = 0, 0.0, 0.0
    for t in profile.order():
        latest = max(latest, ready[t])  # the event at which t enters the heap
        tensor = profile.tensors[t]
        packable = 0 < tensor.nbytes <= block_bytes
        fits = (bool(run) and packable and tensor.dtype == profile.tensors[run[0]].dtype
                and run_bytes + tensor.nbytes <= block_bytes and latest - first_event <= patience)
        if not fits:
            if len(run) > 1:
                runs.append(run)
            run, run_bytes, first_event = [], 0, latest
            if not packable:
                continue  # ends the run, joins none
        run.append(t)
        run_bytes += tensor.nbytes
    if len(run) > 1:
        runs.append(run)
    return runs


def partition_by_bytes(profile: Profile, block_bytes: int | Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Each tensor cut into blocks of ``block_bytes`` (one size, or one per tensor), the last shorter."""
    sizes = [block_bytes] * profile.num_tensors if isinstance(block_bytes, int) else list(block_bytes)
    if len(sizes) != profile.num_tensors or any(s <= 0 for s in sizes):
        raise ValueError(f"block_bytes must be positive, one value or one per tensor; got {block_bytes!r}")
    return tuple(split_evenly(t.numel, max(1, s // bytes_of(t.dtype)))
                 for t, s in zip(profile.tensors, sizes))


@dataclasses.dataclass(frozen=True)
class FlushState:
    """What the flush finds, as the planner models phase 1."""

    remaining: tuple[int, ...]
    """Block ids left in the heap, in the order the flush releases them."""
    flush_s: float
    """End of backward."""
    link_free_s: float
    """When the link finishes the phase-1 groups (each group sent after the previous)."""
    phase1_windows: tuple[int, ...]


def replay_phase1(plan: Plan, profile: Profile, *, greedy: bool = False, block_bytes: int = DEFAULT_BLOCK_BYTES,
                  table: BlockTable | None = None) -> FlushState:
    """Walk phase 1 with the plan's windows, or choose them by the greedy (module docstring).

    Which blocks each event releases depends on the windows only (Note
    [Same order on every rank]), so ``remaining`` is exact; ``link_free_s``
    is the model's. A decoupled block's all-gather is held for the flush
    (Note [Two-stage blocks in the simulator]) and is in ``remaining``; each
    block costs the link its own start-up and transfer (``table.latency_s``,
    ``table.wire``).
    """
    table = table or block_table(plan, profile)
    alpha, beta = profile.alpha_s, profile.beta_s_per_byte
    events, layout, latency_s, nbytes = table.event_s, table.layout, table.latency_s, table.wire
    T = len(events)
    # best_after[i]: the best priority among blocks that enter after event i.
    best_after = [float("inf")] * T
    for i in range(T - 2, -1, -1):
        best_after[i] = min([best_after[i + 1], *(layout[b][3] for b in table.enters_at[i + 1])])
    heap: list[tuple[int, int]] = []
    held: list[tuple[int, int]] = []
    free = 0.0
    windows = []
    for i in range(T):
        for b in table.enters_at[i]:
            heapq.heappush(held if table.at_flush[b] else heap, (layout[b][3], b))
        start = max(events[i], free)
        sent = taken = 0
        latency = 0.0
        if greedy:
            if i + 1 < T:
                idle = events[i + 1] - start
                # Bytes to send: ceil(dt / (beta*S)) blocks of S, at least one;
                # counted in bytes so that small tensors (one short block each)
                # share a start-up instead of paying alpha apiece.
                head_alpha = latency_s[heap[0][1]] if heap else alpha
                target = max((idle - head_alpha) / beta, block_bytes) if beta > 0 else float("inf")
                while heap and ((idle > 0 and sent < target) or heap[0][0] < best_after[i]):
                    b = heapq.heappop(heap)[1]
                    sent += nbytes[b]
                    latency = max(latency, latency_s[b])
                    taken += 1
            windows.append(taken)
        else:
            w = plan.window_at(i)
            taken = len(heap) if w == ALL else min(w, len(heap))
            for _ in range(taken):
                b = heapq.heappop(heap)[1]
                sent += nbytes[b]
                latency = max(latency, latency_s[b])
            windows.append(w)
        if taken:
            free = start + latency + beta * sent
    remaining = tuple(b for _, b in sorted(heap + held))
    return FlushState(remaining, table.backward_end_s, free, tuple(windows))


def optimal_phase2_batches(alpha: float, beta: float, sizes: Sequence[int], heads: Sequence[float]) -> list[int]:
    """Batch sizes (in blocks) minimising ``max_j (j*alpha + beta*P(E_j) + g(h_j))`` (steps 3-5).

    ``sizes[i]`` is block ``i``'s bytes, ``heads[i]`` its ``g`` (non-increasing
    for the optimality proof; a larger later ``g`` is lifted onto the blocks
    before it, which keeps the cost an upper bound).
    """
    N = len(sizes)
    if N == 0:
        return []
    g = list(heads)
    for i in range(N - 2, -1, -1):
        g[i] = max(g[i], g[i + 1])
    unit_count, unit_g, prefix = [], [], []
    total = 0
    for i in range(N):
        total += sizes[i]
        if unit_g and g[i] == unit_g[-1]:
            unit_count[-1] += 1
            prefix[-1] = total
        else:
            unit_count.append(1)
            unit_g.append(g[i])
            prefix.append(total)
    U = len(unit_count)

    def greedy(W: float) -> list[int] | None:
        ends, u, j = [], 0, 1
        while u < U:
            cap = W - j * alpha - unit_g[u]
            if cap < 0:
                return None
            e = bisect.bisect_right(prefix, cap / beta) - 1 if beta > 0 else U - 1
            if e < u:
                return None
            ends.append(e)
            u, j = e + 1, j + 1
        return ends

    lo = max(alpha + beta * prefix[0] + unit_g[0], alpha + beta * prefix[-1] + unit_g[-1])
    hi = alpha + beta * prefix[-1] + unit_g[0]
    ends = greedy(lo)
    if ends is None:
        for _ in range(200):
            if hi - lo <= 1e-12 * max(abs(hi), 1e-30):
                break
            mid = 0.5 * (lo + hi)
            if greedy(mid) is None:
                lo = mid
            else:
                hi = mid
        ends = greedy(hi)
        if ends is None:  # unreachable: the one-batch cost is feasible
            ends = [U - 1]
    batches, start = [], 0
    for e in ends:
        batches.append(sum(unit_count[start:e + 1]))
        start = e + 1
    return batches


def windows_for_batches(batches: Sequence[int]) -> tuple[int, ...]:
    """``phase2_windows`` that launch exactly these batches on an idle link (step 6)."""
    if not batches:
        return (1,)
    if all(a >= b for a, b in itertools.pairwise(batches)):
        windows = list(batches)
    else:
        windows = [1, *batches]
    while len(windows) > 1 and windows[-1] == windows[-2]:
        windows.pop()  # the last size repeats anyway
    return tuple(windows)


def _forward_tails(profile: Profile, update_s: float) -> list[float]:
    """``F_l``: forward (and update share) from tensor ``l`` to the end, as the simulator counts it."""
    T = profile.num_tensors
    nbytes = profile.nbytes
    total = sum(nbytes)
    tail, F = 0.0, [0.0] * T
    for t in range(T - 1, -1, -1):
        tail += profile.tensors[t].fwd_s + (update_s * nbytes[t] / total if total else update_s / T)
        F[t] = tail
    return F


def _phase2_batches(table: BlockTable, state: FlushState, profile: Profile, update_s: float) -> list[int]:
    F = _forward_tails(profile, update_s)
    layout = table.layout
    # Costs as the link sees them: a decoupled block's all-gather has its own start-up and transfer.
    sizes = [table.wire[b] for b in state.remaining]
    heads = [max(F[t] for t in layout[b][0]) for b in state.remaining]
    alpha = max((table.latency_s[b] for b in state.remaining), default=profile.alpha_s)
    return optimal_phase2_batches(alpha, profile.beta_s_per_byte, sizes, heads)


def optimal_phase2_windows(plan: Plan, profile: Profile, *, update_s: float = 0.0) -> tuple[int, ...]:
    """The analytic phase-2 windows (module docstring) for ``plan``'s partition and phase-1 windows."""
    table = block_table(plan, profile)
    state = replay_phase1(plan, profile, table=table)
    return windows_for_batches(_phase2_batches(table, state, profile, update_s))


def dcredit(profile: Profile, *, block_bytes: int = DEFAULT_BLOCK_BYTES, channels: int = 1,
            update_s: float = 0.0, refine: bool = True, pack: bool = True) -> Plan:
    """The D-Credit plan: blocks of ``block_bytes``, greedy phase-1 windows, optimal phase-2 windows.

    Large tensors are cut into blocks of ``block_bytes`` and, with ``pack``,
    runs of small ones packed into blocks of at most that size
    (:func:`packing_merges`).

    ``refine`` lets the simulator choose between the analytic phase-2
    windows and their variants for blocks still pending at the flush
    (module docstring); without it the plan is the model's alone.
    """
    base = Plan(
        numels=profile.numels,
        order=profile.order(),
        partition=partition_by_bytes(profile, block_bytes),
        merges=tuple(tuple(run) for run in packing_merges(profile, block_bytes)) if pack else (),
        channels=channels,
        overlap_forward=True,
        policy="dcredit",
    )
    return dcredit_windows(base, profile, block_bytes=block_bytes, update_s=update_s, refine=refine)


def dcredit_windows(base: Plan, profile: Profile, *, block_bytes: int = DEFAULT_BLOCK_BYTES, update_s: float = 0.0,
                    refine: bool = True, table: BlockTable | None = None, channel_fifo: bool = False) -> Plan:
    """``base`` (its blocks, merges and priority kept) with D-Credit's windows: greedy in phase 1, optimal after.

    ``block_bytes`` is the ``S`` of the greedy's rule (module docstring).
    ``table``, if given, must be ``block_table(base, profile)``; ``channel_fifo`` is the
    simulator's network model for the refinement.
    """
    table = table or block_table(base, profile)
    state = replay_phase1(base, profile, greedy=True, block_bytes=block_bytes, table=table)
    plan = dataclasses.replace(base, phase1_windows=state.phase1_windows)
    batches = _phase2_batches(table, state, profile, update_s)
    windows = windows_for_batches(batches)
    if refine and batches:
        # Phase-1 windows do not change the layout; the plan is ours, valid by construction
        # when ``base`` is (the callers validate what they return).
        snapshot = FlushSnapshot(plan, profile, table=table, checked=False, channel_fifo=channel_fifo)
        k = snapshot.pending
        if k:
            candidates = list(dict.fromkeys([windows, (windows[0] + k, *windows[1:]), (batches[0] + k, *batches[1:])]))
            costs = [snapshot.iteration_s(c, update_s=update_s) for c in candidates]
            windows = candidates[costs.index(min(costs))]
    return dataclasses.replace(plan, phase2_windows=windows)
