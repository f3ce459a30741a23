"""Note [Embedding rows]: the plan without a rows-only tensor's blocks, and the rows a stand-in collects."""

from __future__ import annotations

import torch
from torch import nn

from dcredit_opt.backends.packed_rows import pack, unpack
from dcredit_opt.optimizer.rows import ROWS_ONLY, EmbeddingRows, without_tensors
from dcredit_opt.planner.plan import Plan, blocks_of, validate


def _plan(**kw) -> Plan:
    base = {"numels": (4, 3, 5, 2, 6), "order": (4, 3, 2, 1, 0), "partition": ((4,), (3,), (5,), (2,), (3, 3)),
            "merges": ((3, 2, 1, 0),), "phase1_windows": (1, 1, 1, 1, 1), "phase2_windows": (2,), "channels": 2,
            "policy": "dcredit"}
    base.update(kw)
    return Plan(**base)


def test_a_removed_tensor_has_no_blocks_and_cuts_its_merge():
    plan = _plan()
    validate(plan)
    cut = without_tensors(plan, [2])
    validate(cut, numels=[4, 3, 0, 2, 6])
    assert cut.numels == (4, 3, 0, 2, 6)
    assert cut.partition[2] == ()
    assert cut.merges == ((1, 0),)  # (3) alone is no merge; (1, 0) stays one
    blocks = blocks_of(cut)
    assert all(2 not in tensors for tensors, *_ in blocks)
    assert sum(numel for _, _, numel, _ in blocks) == 4 + 3 + 2 + 6
    # Everything else is the plan it was.
    assert (cut.order, cut.phase1_windows, cut.phase2_windows, cut.channels) == (
        plan.order, plan.phase1_windows, plan.phase2_windows, plan.channels)


def test_removing_nothing_is_the_same_plan_and_a_cut_tensor_can_go_whole():
    plan = _plan()
    assert without_tensors(plan, []) is plan
    cut = without_tensors(plan, [4])  # a tensor of two blocks
    validate(cut, numels=[4, 3, 5, 2, 0])
    assert cut.merges == plan.merges
    assert len(blocks_of(cut)) == 1


def test_the_stand_in_collects_the_looked_up_rows_only():
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3)
    opened = []
    rows = EmbeddingRows(0, emb.weight, "emb.weight", [emb], ROWS_ONLY, opened.append)
    ids = torch.tensor([[1, 4], [4, 7]])
    emb(ids).pow(2).sum().backward()
    assert emb.weight.grad is None, "the lookup's gradient must go to the stand-in, not to the weight"
    assert opened == [0], "the stand-in's gradient is told with the weight's index"
    assert emb.weight is emb._parameters["weight"], "the weight is swapped back after the forward"
    got_ids, got_rows = rows.take()
    assert got_ids.tolist() == [1, 4, 7]
    expected = torch.zeros(10, 3)
    expected.index_add_(0, ids.reshape(-1), 2 * emb.weight.detach()[ids.reshape(-1)])
    torch.testing.assert_close(got_rows, expected[[1, 4, 7]])
    # Every rank's rows, scaled, land in the slot; the next iteration starts empty.
    slot = torch.zeros(10, 3)
    rows.gathered = [(got_ids, got_rows), (torch.tensor([7]), torch.ones(1, 3))]
    rows.add_to(slot, 0.5)
    torch.testing.assert_close(slot[7], 0.5 * (expected[7] + 1))
    assert rows.take()[0].numel() == 0
    with torch.no_grad():
        emb(ids)  # evaluation: the weight itself is read, no stand-in
    assert rows.stand_in is None
    rows.remove()
    emb(ids).sum().backward()
    assert emb.weight.grad is not None


def test_packed_rows_come_back_from_any_offset_and_padding():
    values = torch.arange(14, dtype=torch.float32).reshape(2, 7)  # 28-byte rows: offsets not multiples of 8
    ids = torch.tensor([3, 9])
    one = pack(ids, values, 2)
    padded = pack(ids, values, 5)
    assert one.numel() == 2 * (8 + 28) and padded.numel() == 5 * (8 + 28)
    joined = torch.cat([torch.zeros(36, dtype=torch.uint8), one])  # as in an all-gather's concatenation
    for buf, capacity in ((joined[36:], 2), (padded, 5)):
        got_ids, got_rows = unpack(buf, 2, capacity, values)
        assert got_ids.tolist() == [3, 9]
        assert torch.equal(got_rows, values)
    empty_ids, empty_rows = unpack(pack(ids[:0], values[:0], 1), 0, 1, values)
    assert empty_ids.numel() == 0 and empty_rows.shape == (0, 7)


def test_sparse_rows_sum_every_ranks_rows_at_the_union_of_their_indices():
    """Note [Sparse gradients]: the rows of each rank added, times the scale, into the slot; the indices handed to
    the optimizer are the sorted union, with one rank's rows alone (a world of one) as with several."""
    from dcredit_opt.optimizer.sparse import SparseRows, as_sparse, row_sparse

    w = nn.Parameter(torch.zeros(6, 2))

    def grad(ids, values):
        return torch.sparse_coo_tensor(torch.tensor([ids]), torch.tensor(values), (6, 2), check_invariants=True)

    mine = row_sparse("w", grad([4, 1, 4], [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]))  # repeated: coalesced to 1, 4
    theirs = row_sparse("w", grad([0, 4], [[5.0, 5.0], [6.0, 6.0]]))
    empty = (torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2))
    for gathered, want_ids, want in (
            ([mine], [1, 4], {1: 1.0, 4: 2.0}),
            ([empty, mine], [1, 4], {1: 1.0, 4: 2.0}),
            ([mine, theirs], [0, 1, 4], {0: 2.5, 1: 1.0, 4: 5.0})):
        rows = SparseRows(0, w, "w")
        rows.gathered = gathered
        slot = torch.zeros(6, 2)
        ids = rows.add_to(slot, 0.5)
        assert ids.tolist() == want_ids and ids.dtype == torch.int64
        assert slot[:, 0].tolist() == [want.get(r, 0.0) for r in range(6)]
        assert torch.equal(as_sparse(slot, ids).to_dense(), slot)
