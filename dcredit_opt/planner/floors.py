"""What no plan can beat under the simulator's model (``simulate.py``): the bounds a simulated or measured
iteration is held against."""

from __future__ import annotations

from .profile import Profile


def lower_bound(profile: Profile) -> float:
    """``max(compute, communication)``: no plan's ``iteration_s`` is below it under this model.

    Compute is all forward and backward, which run one after another on the
    compute resource. Communication is :func:`link_floor` of every byte.
    """
    compute = sum(t.fwd_s + t.bwd_s for t in profile.tensors)
    return max(compute, link_floor(profile, profile.total_bytes))


def link_floor(profile: Profile, nbytes: int) -> float:
    """The least link time to reduce ``nbytes`` (0 for none): every byte goes through an all-reduce or through
    a reduce-scatter and then an all-gather, whichever costs the link less per byte, and the first transfer
    waits for the start-up of the first collective (an all-reduce or a reduce-scatter). No plan pays less."""
    if nbytes <= 0:
        return 0.0
    rs_alpha, rs_beta = profile.stage_cost(1)
    ag_beta = profile.stage_cost(2)[1]
    return min(profile.alpha_s, rs_alpha) + min(profile.beta_s_per_byte, rs_beta + ag_beta) * nbytes


def synchronous_floor(profile: Profile) -> float:
    """The shortest iteration any schedule of synchronous data parallelism can reach on one link.

    Above :func:`lower_bound` by two chains that no order of blocks hides:

    - The gradient ready last (usually the input side's, at the end of
      backward) must be reduced before the next forward reaches it, and that
      forward then runs to the end: ``backward + link_floor(bytes(last
      ready)) + forward from it on`` (``compute + alpha + beta * bytes`` when it
      is the first layer's and all-reduced). Its link floor, not the time of
      one block of that size: cut into blocks on several channels, the
      tensor's start-ups overlap one another's transfers. A tied input embedding,
      ready last and large, makes this one long.
    - Whatever block arrives last, the forward of its layer and of every
      later one leaves the link with nothing to send (at best that block is
      the last layer's: ``fwd(last layer)``), and then no gradient can go
      before backward has produced it: every tail of the ready order waits
      for its first gradient, then needs the link for all its bytes. So
      ``fwd(last layer) + max over t of (ready(t) + link_floor(bytes of t
      and every gradient ready after it))``; for the first gradient that is
      ``bwd(first) + comm``, ``comm`` being :func:`link_floor` of every byte.
      A small last layer ahead of a large one (VGG's classifier, a language
      model's head) makes the large one's term the longest: the link idles
      through its backward, whatever the order of blocks.
    """
    if not profile.num_tensors:
        return lower_bound(profile)
    compute = sum(t.fwd_s + t.bwd_s for t in profile.tensors)
    total = profile.total_bytes
    comm = link_floor(profile, total)
    order = profile.order()
    last = order[-1]
    transfer = link_floor(profile, profile.tensors[last].nbytes)
    input_side = (sum(t.bwd_s for t in profile.tensors) + transfer
                  + sum(t.fwd_s for t in profile.tensors[last:]))
    output_side = 0.0
    if total > 0:
        ready, tail_bytes = 0.0, total
        for t in order:
            ready += profile.tensors[t].bwd_s
            output_side = max(output_side, ready + link_floor(profile, tail_bytes))
            tail_bytes -= profile.tensors[t].nbytes
        output_side += profile.tensors[-1].fwd_s
    return max(compute, comm, input_side, output_side)
