"""OASR-WFBP: start-up sharing merges chosen by an overlap-aware model of the whole backward.

MG-WFBP (``policies.startup_sharing_merges``) decides greedily, one
neighbour at a time: join the next gradient when waiting for it costs less
than a start-up. OASR-WFBP's point (Song et al., JPDC 2025) is that this
greedy choice ignores how the merge changes the overlap of *later*
communication with the rest of backward: a merge that saves a start-up
now may push every later collective past the gradients it could have
hidden behind, and a merge the greedy rejects may be what lets the link
catch up. OASR models the whole backward analytically and merges where the
model says the iteration gets shorter. The paper's text is not at hand
(only its abstract); what follows is the exact optimum of the model the
abstract describes, derived here.

Model
-----
WFBP's runtime: gradients in ready order ``0 .. n-1`` (positions), event
times ``e_0 <= e_1 <= ...``, bytes ``s_j``, prefix sums ``P``. A *group* is a
run ``i..j`` of neighbours (one dtype, no empty tensor inside) sent as one
collective; collectives run one after another (each event releases one
block with window 1: Note [Group window]), so group ``i..j`` starts at
``max(e_j, F(i-1))`` and ends at ``F(j) = max(e_j, F(i-1)) + alpha + beta *
(P(j) - P(i-1))``, where ``F(i-1)`` is the end of the group before it.
``step()`` waits, so the iteration is ``max(backward end, F(n-1))`` plus the
forward: minimise ``F(n-1)``.

Dynamic programme
-----------------
Let ``F(j)`` be the least end of the groups covering ``0..j``. It is
non-decreasing in ``j`` (drop ``j`` from its group: the rest ends no later),
and the cost of the last group is non-decreasing in the end of the groups
before it, so ``F(j) = min_i max(e_j, F(i-1)) + alpha + beta*(P(j) - P(i-1))``
over the allowed ``i``. Split the candidates at ``k``, the largest ``i`` with
``F(i-1) <= e_j`` (a prefix, since ``F`` is non-decreasing):

* ``i <= k``: the group waits for its own last gradient; cost
  ``e_j + alpha + beta*(P(j) - P(i-1))`` is least at ``i = k`` (fewest bytes);
* ``i > k``: the link is the bottleneck; cost
  ``(F(i-1) - beta*P(i-1)) + alpha + beta*P(j)``, least where
  ``F(i-1) - beta*P(i-1)`` is least over ``k < i <= j``.

``k`` and the lower bound of ``i`` only move forward with ``j``, so a
monotone deque gives the second minimum in amortised O(1): the whole plan
costs O(n). It is never worse than MG-WFBP, WFBP or DDP's buckets under
this model (each of those is one grouping of the same runs), and the
simulator executes the model exactly for these plans.
"""

from __future__ import annotations

import collections
import math

from .profile import Profile
from .simulate import event_times


def overlap_aware_merges(profile: Profile) -> list[list[int]]:
    """The groups (runs in ready order, one collective each) minimising the end of communication.

    Tensors without elements have no block and end a run; dtypes are not
    mixed. Ties keep the group with the later start (fewer bytes waiting).
    """
    alpha, beta = profile.alpha_s, profile.beta_s_per_byte
    order = profile.order()
    events = event_times(profile)
    n = len(order)
    prefix = [0.0] * (n + 1)
    for j, t in enumerate(order):
        prefix[j + 1] = prefix[j] + profile.tensors[t].nbytes
    # F[j + 1]: least end of the groups covering positions 0..j (F[0] = no group, -inf).
    F = [-math.inf] * (n + 1)
    first = [0] * n  # first position of the last group ending at j; -1 for an empty tensor
    lo = 0  # first position of the current run of groupable tensors
    k = 0  # candidates i < k wait for their own gradient (F[i] <= e_j)
    deque: collections.deque[int] = collections.deque()  # candidate i > k, increasing key
    for j, t in enumerate(order):
        tensor = profile.tensors[t]
        if tensor.numel == 0:  # no block: ends the run, joins no group
            F[j + 1], first[j] = F[j], -1
            lo = k = j + 1
            deque.clear()
            continue
        if j > lo and tensor.dtype != profile.tensors[order[j - 1]].dtype:
            lo = k = j
            deque.clear()
        # Candidate i = j (a group of j alone) joins the deque keyed by F[i] - beta*P(i).
        key_j = F[j] - beta * prefix[j]
        while deque and F[deque[-1]] - beta * prefix[deque[-1]] >= key_j:
            deque.pop()
        deque.append(j)
        while k <= j and F[k] <= events[j]:
            k += 1
        # Now candidates lo..k-1 wait for e_j; k..j wait for the link.
        while deque and deque[0] < k:
            deque.popleft()
        best, best_i = math.inf, j
        if k > lo:
            best, best_i = events[j] + alpha + beta * (prefix[j + 1] - prefix[k - 1]), k - 1
        if deque:
            i = deque[0]
            cost = F[i] + alpha + beta * (prefix[j + 1] - prefix[i])
            if cost < best:
                best, best_i = cost, i
        F[j + 1] = best
        first[j] = best_i
    groups: list[list[int]] = []
    j = n - 1
    while j >= 0:
        i = first[j]
        if i < 0:
            j -= 1
            continue
        groups.append([order[p] for p in range(i, j + 1)])
        j = i - 1
    groups.reverse()
    return groups

