"""US-Byte: message sizes by hand, the runtime releasing exactly the model's messages, the order
search, and tuning with ByteScheduler's budget."""

from __future__ import annotations

import collections

from hypothesis import given, settings
from hypothesis import strategies as st

from dcredit_opt.planner import policies
from dcredit_opt.planner.plan import Plan, validate
from dcredit_opt.planner.profile import Profile, TensorProfile
from dcredit_opt.planner.simulate import simulate
from dcredit_opt.planner.usbyte import _Model, search_order, unit_grid, usbyte

from .strategies import profiles, random_profile

# test_planner_policies.P4: ready at 0.4 (t3, 512 elements), 0.7 (t2, 64), 0.9 (t1, 1024),
# 1.0 (t0, 256); float32; alpha 0.15 s, beta 1e-4 s/B.
P4 = Profile(
    tensors=tuple(TensorProfile(f"t{i}", n, "float32", i, 0.1, b)
                  for i, (n, b) in enumerate(zip((256, 1024, 64, 512), (0.1, 0.2, 0.3, 0.4)))),
    alpha_s=0.15, beta_s_per_byte=1e-4, world_size=2)


def test_usbyte_by_hand():
    # Unit 256 B = 64 elements. Event 0 (0.4, t3): 0.3 s until t2, less than t3 whole (0.3548):
    #   ceil((0.3 - 0.15) / 0.0256) = 6 units = 384 elements, link busy until 0.7036.
    # Event 1 (0.7036, t2 and t3's rest): 0.1964 s until t1. t2 (best priority) fits whole (0.1756),
    #   busy until 0.8792; 0.0208 s left < alpha: one unit of t3 (64), busy until 1.0548.
    # Event 2 (t1 ready at 0.9): the link is busy past the next event (1.0): nothing. Last event: nothing.
    # Phase 2: t0, t1, t3's last 64 elements, one message each, one at a time.
    plan = usbyte(P4, block_bytes=256, search=False)
    assert plan == Plan(numels=P4.numels, order=(3, 2, 1, 0), partition=((256,), (1024,), (64,), (384, 64, 64)),
                        priority=(0, 1, 2, 3), phase1_windows=(1, 2, 0, 0), phase2_windows=(1,),
                        overlap_forward=True, policy="usbyte")


@settings(max_examples=120, deadline=None)
@given(profiles(max_tensors=7, max_numel=120, dtypes=("float32", "float16")), st.sampled_from([4, 16, 64, 1 << 20]),
       st.booleans())
def test_the_runtime_releases_the_models_messages(p, block_bytes, search):
    plan = usbyte(p, block_bytes=block_bytes, search=search)
    validate(plan, numels=p.numels, dtypes=p.dtypes)
    assert Plan.from_json(plan.to_json()) == plan
    result = simulate(plan, p)
    released = collections.Counter(b.event for b in result.blocks)
    T = p.num_tensors
    # Every event released exactly the messages the model sent after it (the heap never ran short) ...
    assert [released[i] for i in range(T)] == list(plan.phase1_windows)
    # ... and the flush finds one message per tensor with bytes left, sent in priority order.
    flushed = [b for b in result.blocks if b.event == T]
    assert len({b.tensors for b in flushed}) == len(flushed)
    rank = plan.priority
    assert [b.tensors[0] for b in sorted(flushed, key=lambda b: b.launch_index)] == sorted(
        (b.tensors[0] for b in flushed), key=lambda t: rank[t])
    # Messages other than a tensor's last are whole units (unit = block_bytes in elements).
    for t, sizes in enumerate(plan.partition):
        unit = max(1, block_bytes // (p.tensors[t].nbytes // max(1, p.tensors[t].numel) or 1))
        assert sum(sizes) == p.tensors[t].numel
        assert all(size % unit == 0 for size in sizes[:-1])


@settings(max_examples=80, deadline=None)
@given(profiles(max_tensors=7, max_numel=120), st.sampled_from([4, 16, 64]))
def test_order_search_never_hurts_in_the_model(p, block_bytes):
    model = _Model(p, block_bytes)
    forward = model.run(list(range(p.num_tensors)))[0]
    rank = search_order(model)
    assert sorted(rank) == list(range(p.num_tensors))
    assert model.run(rank)[0] <= forward


def test_order_search_promotes_a_tensor_that_would_be_overtaken():
    # Found by search over random_profile seeds: tensor 2 is promoted ahead of tensor 1, which
    # becomes ready while tensor 2 is on the link; the model's iteration drops from 7.23 to 6.83 s,
    # and the simulator agrees that the searched order is faster.
    p = random_profile(8, 5, max_numel=64)
    model = _Model(p, 16)
    rank = search_order(model)
    assert rank == [0, 2, 1, 3, 4]
    assert model.run(rank)[0] < 0.95 * model.run(list(range(5)))[0]
    assert simulate(usbyte(p, block_bytes=16), p).iteration_s < simulate(usbyte(p, block_bytes=16, search=False),
                                                                         p).iteration_s


def test_tune_usbyte_uses_byteschedulers_budget():
    sizes = [256, 1024, 4096]
    units = unit_grid(sizes, 5)
    assert len(units) == 5 * len(sizes) and units[0] == 256 and units[-1] < 2 * 4096
    best = policies.tune_usbyte(P4, block_sizes=sizes)
    grid = [usbyte(P4, block_bytes=u) for u in units]
    assert best in grid
    assert simulate(best, P4).iteration_s == min(simulate(g, P4).iteration_s for g in grid)
    assert best.policy == "usbyte"
