"""The optimizer's state owners alone, without processes: each is built from plain tensors and a fake backend.

``DistributedOptimizer`` composes these objects; here each one is driven directly, as DDP's bucket assignment
is tested without a process group.
"""

from __future__ import annotations

import math
import types
import weakref

import pytest
import torch
from torch import nn

from dcredit_opt import _ext
from dcredit_opt.config import Config
from dcredit_opt.errors import DCreditError
from dcredit_opt.optimizer import checks, rows, usage
from dcredit_opt.optimizer.buffers import per_tensor
from dcredit_opt.optimizer.notices import Notices
from dcredit_opt.optimizer.usage import UsageTally


class _SideChannel:
    """The backend's side channel as the tally uses it: ``start_tally`` sums in place, here with the other
    ranks' counts given up front (every other rank sends ``others``)."""

    def __init__(self, others=None, world=2):
        self.others = others
        self.world = world
        self.started = []
        self.handed = []  # the tensors themselves (the tally's memory is made once and reused)
        self.waits = 0

    def start_tally(self, counts):
        self.handed.append(counts)
        self.started.append(counts.clone())
        if self.others is not None:
            counts += torch.tensor(self.others, dtype=torch.int32) * (self.world - 1)

    def wait_tally(self, timeout_s):
        self.waits += 1


def _tally(params, world=1, backend=None, notices=None, check_weights_every=0, groups=list):
    names = [f"p{i}" for i in range(len(params))]
    return UsageTally(names, params, world, backend or _SideChannel(),
                      Config(check_weights_every=check_weights_every), notices or Notices(), lambda: None,
                      groups=groups)


H = usage.hyperparameters_fingerprint([])
"""The hyperparameters' fingerprint of a tally without param groups (Note [Same hyperparameters])."""


def test_alone_the_tally_says_unused_what_this_rank_did_not_use():
    params = [nn.Parameter(torch.zeros(3)) for _ in range(3)]
    tally = _tally(params)
    tally.used[0] = True
    tally.used[2] = True
    assert tally.start(0) is False
    assert list(tally.used) == [0, 0, 0]  # cleared for the next iteration
    assert tally.unused_everywhere(range(3)) == [1]


def test_a_gradient_the_user_assigned_is_not_dropped():
    params = [nn.Parameter(torch.zeros(2)) for _ in range(2)]
    slots = [torch.zeros(2), torch.zeros(2)]
    watched = list(slots)
    tally = _tally(params)
    tally.start(0)  # nothing used: both unused everywhere
    params[0].grad = slots[0]
    params[1].grad = torch.ones(2)  # the user's
    assert tally.drop_unused_grads(range(2), watched, slots) == [0, 1]
    assert params[0].grad is None
    assert params[1].grad is not None


def test_with_peers_the_tally_waits_only_for_tensors_unused_here():
    params = [nn.Parameter(torch.zeros(2)) for _ in range(3)]
    side = _SideChannel(others=[0, 1, 0, 0, 0, 0, 0, 0, 0, 0, H, 0, H * H])  # the other rank used tensor 1 only
    tally = _tally(params, world=2, backend=side)
    tally.used[0] = True
    tally.start(0)
    assert [c.tolist() for c in side.started] == [[1, 0, 0, 0, 0, 0, 0, 0, 0, 0, H, 0, H * H]]
    waits = side.waits  # the start waits for the last tally, if any
    assert tally.unused_everywhere([0]) == []
    assert side.waits == waits  # used here: used, whatever the others did
    assert tally.unused_everywhere(range(3)) == [2]
    assert side.waits == waits + 1


class _Peers(_SideChannel):
    """Every other rank's update count is ``theirs[k]`` at the k-th tally (nothing used, nothing proposed)."""

    def __init__(self, theirs, world):
        super().__init__(world=world)
        self.theirs = list(theirs)

    def start_tally(self, counts):
        self.started.append(counts.clone())
        a = self.theirs.pop(0) % usage.UPDATES_MODULO
        counts[-4:] += torch.tensor([a, H, a * a, H * H], dtype=torch.int32) * (self.world - 1)


@pytest.mark.parametrize("world", [2, 5])
def test_the_tally_carries_the_update_counts_and_a_rank_that_skipped_a_step_is_told(world):
    params = [nn.Parameter(torch.zeros(2)) for _ in range(2)]
    # the same counts at the first three tallies (64 and 0 are the same modulo 64: no false alarm on the wrap)
    tally = _tally(params, world=world, backend=_Peers([0, 1, 64, 66, 3], world))
    for taken in (0, 1, 64):
        tally.start(taken)  # each checks the tally before it
    assert tally._backend.started[-1][-4:].tolist() == [0, H, 0, H * H]  # 64 modulo 64, and its square
    tally.start(65)  # the others took 66: checked at the next start, on every rank alike
    with pytest.raises(DCreditError, match=r"not all applied the same number of optimizer updates: this rank had "
                                           r"taken 65.*zero_grad\(\) without step\(\) on every rank"):
        tally.start(66)


class _OtherSettings(_SideChannel):
    """Every other rank took as many updates as this one, and had the hyperparameters' fingerprint ``theirs[k]`` at
    the k-th tally."""

    def __init__(self, theirs, world):
        super().__init__(world=world)
        self.theirs = list(theirs)

    def start_tally(self, counts):
        self.started.append(counts.clone())
        h = self.theirs.pop(0)
        counts[-4] *= self.world
        counts[-2] *= self.world
        counts[-3:] += torch.tensor([h, 0, h * h], dtype=torch.int32) * (self.world - 1)


@pytest.mark.parametrize("world", [2, 3])
def test_the_tally_carries_the_hyperparameters_and_a_rank_whose_differ_is_told(world):
    """Note [Same hyperparameters]: a learning rate changed on this rank alone is seen at the next tally, and the
    error shows this rank's hyperparameters as they were at the tally that differed."""
    params = [nn.Parameter(torch.zeros(2))]
    groups = [{"params": params, "lr": 0.1, "momentum": 0.9, "betas": (0.9, 0.99)}]
    same = usage.hyperparameters_fingerprint(usage.settled_hyperparameters(groups))
    tally = _tally(params, world=world, backend=_OtherSettings([same] * 4, world), groups=lambda: groups)
    tally.start(0)
    tally.start(1)  # checks the first: the same
    groups[0]["lr"] = 0.05  # a scheduler stepped with this rank's own metric
    assert usage.hyperparameters_fingerprint(usage.settled_hyperparameters(groups)) != same
    tally.start(2)  # sends the new fingerprint; checks the last: the same
    with pytest.raises(DCreditError, match=r"hyperparameters differ between ranks .*this rank had group 0: "
                                           r"lr=0\.05, momentum=0\.9, betas=\(0\.9, 0\.99\) at its last reduction.*"
                                           r"average the metric over ranks first"):
        tally.start(3)


def test_the_first_tally_and_one_in_flight_at_a_broadcast_are_not_compared_on_hyperparameters():
    """A first step from this rank's own hyperparameters (Horovod's own test of broadcast_optimizer_state takes one,
    then broadcasts the root's with Horovod's function, which we do not see), and a later one before
    ``broadcast_optimizer_state()`` or ``load_state_dict()`` replaces them: neither tally is compared on them; the
    next ones are."""
    params = [nn.Parameter(torch.zeros(2))]
    groups = [{"params": params, "lr": 0.1}]
    root = usage.hyperparameters_fingerprint(usage.settled_hyperparameters([{"params": params, "lr": 0.2}]))
    tally = _tally(params, world=2, backend=_OtherSettings([root] * 7, 2), groups=lambda: groups)
    tally.start(0)  # this rank's lr 0.1 travels; the root's is 0.2
    groups[0]["lr"] = 0.2  # Horovod's broadcast
    tally.start(1)  # the first tally is not compared on hyperparameters
    groups[0]["lr"] = 0.3
    tally.start(2)  # differs...
    groups[0]["lr"] = 0.2
    tally.hyperparameters_replaced()  # ...then broadcast_optimizer_state()
    tally.start(3)  # that one is not compared
    tally.start(4)  # nor this: the same everywhere
    groups[0]["lr"] = 0.1  # changed here alone
    tally.start(5)
    with pytest.raises(DCreditError, match=r"hyperparameters differ between ranks .*lr=0\.1 at its last reduction"):
        tally.start(6)


def test_the_hyperparameters_fingerprint_reads_values_not_addresses_nor_devices():
    """What every rank fingerprints alike: numbers, flags, strings and tuples by value; a CPU tensor of one value
    by that value; any other object by its type (its address differs between processes); a tensor on another
    device is not read (on a GPU that read would wait for the device)."""
    def fingerprint(**hyper):
        return usage.hyperparameters_fingerprint(usage.settled_hyperparameters([{"params": [], **hyper}]))

    assert fingerprint(lr=0.1, betas=(0.9, 0.99)) == fingerprint(lr=0.1, betas=[0.9, 0.99])
    assert fingerprint(lr=torch.tensor(0.5)) == fingerprint(lr=0.5)
    assert fingerprint(lr=torch.tensor(0.5)) != fingerprint(lr=torch.tensor(0.25))
    assert fingerprint(fn=object()) == fingerprint(fn=object())
    assert fingerprint(lr=torch.tensor(0.5, device="meta")) == fingerprint(lr=torch.tensor(0.25, device="meta"))
    assert usage.settled_hyperparameters([{"params": [], "lr": torch.tensor(0.5, device="meta")}]) == [
        [("lr", "tensor()")]]
    np = pytest.importorskip("numpy")
    assert fingerprint(lr=np.float64(0.5), n=np.int64(3)) == fingerprint(lr=0.5, n=3)
    assert fingerprint(lr=np.float32(0.5)) != fingerprint(lr=np.float32(0.25))


class _Replicas(_SideChannel):
    """The other ranks' weights are ``theirs``: their fingerprints are summed in where this rank's are sent."""

    def __init__(self, theirs, world):
        super().__init__(world=world)
        self.theirs = theirs

    def start_tally(self, counts):
        self.started.append(counts.clone())
        T = len(self.theirs)
        counts[3 * T:3 * T + 4] *= self.world  # the same update counts and hyperparameters everywhere
        if len(counts) > 3 * T + 4:  # then no pool of parameters found outside the optimizer, a digest of zeros
            f = torch.tensor([*usage.fingerprints(self.theirs), 0, 0, 0], dtype=torch.int32)
            counts[3 * T + 4:] += torch.cat([f, f * f]) * (self.world - 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_tally_compares_the_weights_every_few_iterations_and_names_the_parameter_that_differs(dtype):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4, 3, dtype=dtype)), nn.Parameter(torch.randn(5, dtype=dtype))]
    theirs = [p.detach().clone() for p in params]
    side = _Replicas(theirs, world=3)
    tally = _tally(params, world=3, backend=side, check_weights_every=2)
    plain, carrying = 3 * 2 + 4, 3 * 2 + 4 + 2 * (2 + 3)  # fingerprints, a pool found outside, its digest
    tally.start(0)
    tally.start(0)  # iteration 2 takes the fingerprints of its weights...
    assert len(side.started[-1]) == plain
    tally.start(0)  # ...and iteration 3's tally carries them
    assert len(side.started[-1]) == carrying
    with torch.no_grad():
        theirs[1][2] += 1  # the other ranks' second parameter moves by one step; this rank's does not
    tally.start(0)  # checks iteration 2's: the same weights; takes iteration 4's
    tally.start(0)  # carries them
    with pytest.raises(DCreditError, match=r"parameter 'p1' differs between ranks at iteration 4, after the same "
                                           r"updates on every rank .*equal at iteration 2.*on some ranks only"):
        tally.start(0)


def test_ranks_that_start_from_different_weights_are_told_to_broadcast_them():
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.ones(2))]
    theirs = [torch.zeros(3), torch.full((2,), 2.0)]
    tally = _tally(params, world=2, backend=_Replicas(theirs, world=2), check_weights_every=1)
    tally.start(0)
    tally.start(0)
    with pytest.raises(DCreditError, match=r"'p1' differs between ranks at iteration 1, at the first comparison; "
                                           r"the ranks may have started from different weights.*broadcast_parameters"):
        tally.start(0)


def test_a_fingerprint_is_exact_whatever_the_summation_order():
    torch.manual_seed(1)
    w = torch.randn(1000)
    assert usage.fingerprints([w]) == usage.fingerprints([w.flip(0).flip(0).clone()])
    nudged = w.clone()
    nudged[500] = torch.nextafter(nudged[500], torch.tensor(math.inf))  # the smallest change there is
    assert usage.fingerprints([nudged]) != usage.fingerprints([w])
    assert usage.fingerprints([w[::2]]) == usage.fingerprints([w[::2].contiguous()])  # a strided view reads alike


def test_word_sums_on_the_cpu_equal_the_torch_path():
    """Note [Same weights]: a CPU rank fingerprints in one C++ pass, a GPU rank with torch operations; both give
    the same sums, or ranks of different devices would be refused for equal weights."""
    torch.manual_seed(2)
    store = torch.randn(64)  # views into one storage at offsets aligned to 8 bytes, to 4 only, and to neither
    half = torch.randn(40).to(torch.float16)
    tensors = [
        torch.randn(7, 5), torch.randn(3, 4).t(), torch.randn(9)[::2], torch.tensor(3.5), torch.zeros(0),
        store[2:11], store[1:10], store[1:2], store[3:4].view(torch.int32),
        torch.randn(5, dtype=torch.float64), torch.randn(3, dtype=torch.complex64), torch.randn(13).to(torch.bfloat16),
        half[4:11], torch.tensor([True, False, True]), torch.randint(-2**31, 2**31 - 1, (6,), dtype=torch.int64),
        torch.full((5,), -1, dtype=torch.int32), torch.empty(0, dtype=torch.uint8), torch.randn(2, 3, 4)[:, 1],
        torch.randn(4, 1).expand(4, 3), nn.Parameter(torch.randn(6)),
    ]
    fast = _ext.load().word_sums(tensors)
    assert fast.dtype == torch.int64
    assert fast.tolist() == usage._torch_word_sums(tensors).tolist()
    assert usage._word_sums(tensors).tolist() == fast.tolist()
    odd = half[1:6]  # begins 2 bytes in: aligned to neither, where torch's view refuses too
    with pytest.raises(ValueError, match="aligned to neither"):
        _ext.load().word_sums([odd])
    with pytest.raises(RuntimeError):
        usage._word_sums([torch.randn(3), odd])  # the torch path's own error, as before


def test_alone_the_tally_is_summed_as_in_any_world():
    """A world of one runs the path every world runs (and pays for it where its cost is measured): each flush
    sums its tally, with the update count and the hyperparameters' fingerprint in it (Note [Same updates])."""
    tally = _tally([nn.Parameter(torch.zeros(2))])
    side = tally._backend
    tally.start(3)
    tally.start(7)
    T = 1
    assert [c[3 * T:3 * T + 4].tolist() for c in side.started] == [[3, H, 9, H * H], [7, H, 49, H * H]]
    assert side.waits == 2


def test_each_tally_is_written_whole_into_memory_made_once():
    """Every start sends exactly this iteration's values (flags, rows proposal, update count and its square, the
    fingerprints where due), written in one pass into tensors made once and taken in turn: the tally being
    written is never the last one, which is still being read."""
    emb = nn.Embedding(5, 2)
    params = [emb.weight, nn.Parameter(torch.zeros(2))]
    side = _SideChannel(world=1)  # a world of one: what this rank wrote is what it sent, and the sum
    tally = _tally(params, world=1, backend=side, check_weights_every=2)
    tally.propose_rows(types.SimpleNamespace(embedded_by={0: [weakref.ref(emb)]}, read_otherwise=set()), set())
    tally.used[1] = True
    tally.start(1)
    tally.used[0] = True
    tally.start(2)  # the weights are fingerprinted here, and travel in the next tally
    tally.start(3)
    tally.start(4)
    f = usage.fingerprints(params)
    assert [c.tolist() for c in side.started] == [
        [0, 1, 1, 0, 1, 0, 1, H, 1, H * H],
        [1, 0, 1, 0, 1, 0, 2, H, 4, H * H],
        [0, 0, 1, 0, 1, 0, 3, H, 9, H * H, *f, 0, 0, 0, *(v * v for v in f), 0, 0, 0],  # no pool, a digest of 0s
        [0, 0, 1, 0, 1, 0, 4, H, 16, H * H],
    ]
    assert side.handed[1] is not side.handed[0] and side.handed[3] is side.handed[0]
    assert list(tally.rows) == [0]  # alone, this rank's proposal is every rank's: taken at the second tally
    tally.close()


def test_the_tally_is_written_only_into_memory_of_its_size():
    fill = _ext.load().fill_tally
    with pytest.raises(ValueError, match="out must be a contiguous int32 CPU tensor of 5 values"):
        fill(torch.zeros(4, dtype=torch.int32), bytes(2), per_tensor(2, "i"), [1])
    with pytest.raises(ValueError, match="tail must be contiguous 32-bit integers"):
        fill(torch.zeros(5, dtype=torch.int32), bytes(2), bytes(2), [1])
    out = torch.full((5,), 7, dtype=torch.int32)
    fill(out, bytes([1, 0]), per_tensor(2, "i"), [3])
    assert out.tolist() == [1, 0, 0, 0, 3]


def test_the_ranks_agree_on_embedding_rows_through_the_tally():
    emb = nn.Embedding(5, 2)
    params = [emb.weight, nn.Parameter(torch.zeros(2, 2))]
    side = _SideChannel(others=[1, 0, 1, 0, 1, 0, 0, H, 0, H * H])  # the other rank proposes tensor 0, rows only
    notices = Notices()
    tally = _tally(params, world=2, backend=side, notices=notices)
    tracer = types.SimpleNamespace(embedded_by={0: [weakref.ref(emb)]}, read_otherwise=set())
    tally.propose_rows(tracer, grouped=set())
    tally.used[0] = True
    assert tally.start(0) is False  # the first tally is in flight: nothing agreed yet
    assert tally.rows == {}
    assert tally.start(0) is True  # the last tally's sums: both ranks propose tensor 0, rows only
    assert list(tally.rows) == [0] and tally.rows[0].kind == rows.ROWS_ONLY
    assert tally.rows_only() == [0]
    assert "rows" in notices
    tally.close()
    assert tally.rows[0].hooks == []


def test_a_proposal_of_one_rank_alone_is_not_taken():
    emb = nn.Embedding(5, 2)
    side = _SideChannel(others=[0, 0, 0, 0, H, 0, H * H])  # the other rank proposes nothing
    tally = _tally([emb.weight], world=2, backend=side)
    tally.propose_rows(types.SimpleNamespace(embedded_by={0: [weakref.ref(emb)]}, read_otherwise={0}), set())
    tally.start(0)
    assert tally.start(0) is False
    assert tally.rows == {}


# ---- GradientBuffers ---------------------------------------------------------------------------------------------


class _Engine:
    """What the buffers tell the engine: the plan's blocks over their memory."""

    def __init__(self):
        self.plans = []

    def set_plan(self, *args, **kwargs):
        self.plans.append((args, kwargs))


class _Backend:
    name = "fake"
    reducible_dtypes = None

    def buffers_for_engine(self, buffers, wires):
        return {"buffers": buffers, "wire_buffers": wires}

    def set_blocks(self, buffers, wires, layout, postscale):
        self.blocks = (buffers, wires, layout, postscale)


def _buffers(params, block_bytes=16, prescale=1.0, postscale=0.5, sparse_as_dense=False):
    from dcredit_opt.optimizer.buffers import GradientBuffers
    from dcredit_opt.optimizer.layout import fixed_plan

    names = [f"p{i}" for i in range(len(params))]
    engine, backend = _Engine(), _Backend()
    buffers = GradientBuffers(names, params, engine, backend, Config(), lambda: None, prescale=prescale,
                              postscale=postscale, wire=None, groups=None, sparse_as_dense=sparse_as_dense)
    buffers.set_plan(fixed_plan([p.numel() for p in params], [p.element_size() for p in params], block_bytes, 2, 1))
    return buffers, engine


def test_the_buffers_lay_out_one_flat_buffer_per_dtype_with_a_slot_per_tensor():
    params = [nn.Parameter(torch.zeros(3, 2)), nn.Parameter(torch.zeros(5, dtype=torch.float64)),
              nn.Parameter(torch.zeros(4))]
    buffers, engine = _buffers(params)
    assert {b.dtype for b in buffers.flat} == {torch.float32, torch.float64}
    assert [s.shape for s in buffers.slots] == [p.shape for p in params]
    flat32 = next(b for b in buffers.flat if b.dtype == torch.float32)
    buffers.slots[2].fill_(7.0)  # a slot is the buffer's memory
    assert flat32.eq(7.0).sum() == 4
    assert len(engine.plans) == 1 and engine.plans[0][1]["postscale"] == 0.5
    assert buffers.layout.num_blocks == sum(-(-p.numel() * p.element_size() // 16) for p in params)


def test_staging_aliases_p_grad_and_a_later_write_is_refused():
    params = [nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(2))]
    buffers, _ = _buffers(params, prescale=0.5)
    params[0].grad = torch.full((4,), 2.0)
    buffers.stage(0, params[0])
    buffers.stage(1, params[1])  # no gradient here: zeros travel
    assert params[0].grad is buffers.watched[0] and buffers.is_ours(0, params[0].grad)
    assert buffers.slots[0].tolist() == [1.0] * 4  # pre-scaled
    assert params[1].grad is buffers.watched[1] and buffers.slots[1].tolist() == [0.0, 0.0]
    buffers.check_writes(range(2), "a test")
    buffers.slots[0].add_(1.0)  # written in flight
    with pytest.raises(DCreditError, match="'p0' was changed in place"):
        buffers.check_writes(range(2), "a test")
    buffers.accept_writes([0])  # the user's change after the reduction ended: what the step uses
    buffers.check_writes(range(2), "a test")
    buffers.release()
    assert params[0].grad is buffers.slots[0] and type(params[0].grad) is torch.Tensor


def test_a_sparse_gradient_is_reduced_dense_only_when_asked():
    params = [nn.Parameter(torch.zeros(3, 2))]
    buffers, _ = _buffers(params)
    params[0].grad = torch.eye(3, 2).to_sparse()
    with pytest.raises(DCreditError, match="sparse_as_dense=True"):
        buffers.stage(0, params[0])
    buffers, _ = _buffers(params, sparse_as_dense=True)
    buffers.stage(0, params[0])
    assert buffers.sparse == [True] and buffers.for_step(0).is_sparse


def test_the_buffers_find_a_non_finite_gradient_and_a_cast_model():
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))]
    buffers, _ = _buffers(params)
    assert buffers.first_non_finite() is None
    buffers.slots[1][0] = float("nan")
    assert buffers.first_non_finite() == 1
    buffers.check_casts(-1)  # the gradient path found nothing moved (test_gradient_path.py finds it)
    params[0].data = params[0].data.double()
    with pytest.raises(DCreditError, match="'p0' is torch.float64 on cpu now, but was torch.float32"):
        buffers.check_casts(0)


# ---- LazyUpdates -------------------------------------------------------------------------------------------------


class _Path:
    def __init__(self, params=(), slots=()):
        self.refreshed = []
        self.forgotten = []
        self._params = params
        self._slots = slots
        self._lent = []

    def lend_slots(self, indices, watched_only=False):  # the C++ pass, as Python would write it
        assert not self._lent, "slots lent twice"
        assert not watched_only, "the wrapped step takes every slot, whatever p.grad holds"
        self._lent = [(i, self._params[i].grad) for i in indices]
        self.lent_once = [i for i, _ in self._lent]
        for i in indices:
            self._params[i].grad = self._slots[i]

    def return_slots(self):
        for i, grad in self._lent:
            self._params[i].grad = grad
        self._lent = []

    def refresh(self, todo):
        self.refreshed.append(list(todo))

    def forget_graph_reads(self, indices):
        self.forgotten.append(list(indices))

    def addresses(self):
        return [p.data_ptr() for p in self._params]

    def first_stale(self, indices):
        return -1, False  # no graph read a pending parameter, nothing changed one unseen


def test_a_lazy_step_keeps_the_optimizer_while_updates_wait():
    from dcredit_opt.optimizer.updates import LazyUpdates

    class Owner:  # what the keeper holds: the optimizer, weakly unless updates wait; it gives the core
        _dc = types.SimpleNamespace()

    owner = Owner()
    params = [nn.Parameter(torch.zeros(2)) for _ in range(3)]
    groups = [{"params": params, "lr": torch.tensor(0.1)}]
    updates = LazyUpdates(owner, ["a", "b", "c"], params, Notices())
    updates.take(groups, every_hook=False)
    groups[0]["lr"].fill_(0.5)  # a scheduler's in-place change after step(): not the step's
    assert updates.snapshot[0]["lr"].item() == pytest.approx(0.1)
    assert list(updates.pending) == [1] * 3 and updates.npending == 3
    updates.skip([1])  # p.grad = None: no update
    assert list(updates.pending) == [1, 0, 1] and updates.npending == 2
    path = _Path(params)
    updates.defer(owner, path)
    assert updates.deferred and updates.keeper() is owner._dc and updates.keeper.strong is owner
    assert path.forgotten == [[0, 2]]  # the pending ones (Note [Graph reads])
    updates.applied([0], path)
    assert updates.npending == 1 and path.refreshed == [[0]] and updates.keeper.strong is owner
    updates.applied([2], path)
    assert updates.npending == 0 and updates.keeper.strong is None  # nothing waits: a dropped optimizer may go
    updates.remove_hooks()


def test_updates_read_later_join_an_apply_only_up_to_the_first_not_final():
    from dcredit_opt.optimizer.updates import LazyUpdates

    params = [nn.Parameter(torch.zeros(2)) for _ in range(4)]
    updates = LazyUpdates(object.__new__(type("O", (), {})), list("abcd"), params, Notices())
    updates._read_order = (0, 1, 2, 3)  # as end_learning sets it: first-read order
    updates.take([{"params": params}], every_hook=False)
    assert updates.done_ahead((0,), rows_of={}, done=bytes([0, 1, 0, 1])) == (1,)  # 2 is not final: stop there
    assert updates.done_ahead((2,), rows_of={3: None}, done=bytes([0, 1, 1, 1])) == ()  # 3 waits for its rows
    assert "outside any module's forward" in str(updates.stale_read(0))


def test_updates_read_later_beside_a_module_that_reads_many():
    """A module that first reads many tensors (a ParameterList's owner): the same answer as for a few, the
    tensors it reads itself left out, up to the first that is not final."""
    from dcredit_opt.optimizer.updates import LazyUpdates

    params = [nn.Parameter(torch.zeros(2)) for _ in range(40)]
    updates = LazyUpdates(object.__new__(type("O", (), {})), [f"p{i}" for i in range(40)], params, Notices())
    updates._read_order = tuple(range(40))
    updates.take([{"params": params}], every_hook=False)
    own = tuple(range(0, 40, 2))  # 20 tensors: its own, applied by the caller
    done = bytes(0 if i == 25 else 1 for i in range(40))
    assert updates.done_ahead(own, rows_of={5: None}, done=done) == (1, 3) + tuple(range(7, 25, 2))


class _StepperParts:
    """What a :class:`Stepper` reads, without processes: reduced gradients in plain slots, an engine whose
    blocks are all done, a tally with no embedding rows, a backward that adds nothing."""

    def __init__(self, params, reduced):
        self.slots = reduced
        self.watched = list(reduced)
        self.steps_on_slots = True  # no gradient came sparse
        self.checked = []
        self.rows = {}
        self.path = _Path(params, reduced)
        self.waited = []

    # the buffers
    def for_step(self, i):
        return self.slots[i]

    def check_writes(self, indices, where):
        self.checked.append((list(indices), where))

    # the backward
    def add_rows(self, indices):
        pass

    def drop_unused_grads(self, indices):
        return []

    # the engine
    def wait_tensors_on_stream(self, todo, timeout_s):
        self.waited.append(list(todo))


def test_the_stepper_applies_what_waits_with_the_deferring_steps_hyperparameters():
    from dcredit_opt.optimizer.lazy import Stepper
    from dcredit_opt.optimizer.updates import LazyUpdates

    params = [nn.Parameter(torch.full((2,), float(k))) for k in range(3)]
    names = ["a", "b", "c"]
    sgd = torch.optim.SGD([{"params": params[:2], "lr": 0.1}, {"params": params[2:], "lr": 0.2}])
    reduced = [torch.full((2,), 10.0 * (k + 1)) for k in range(3)]
    parts = _StepperParts(params, reduced)
    lazy = LazyUpdates(sgd, names, params, Notices())
    stepper = Stepper(sgd, torch.optim.SGD, names, params, [], (parts, lazy, parts, parts, parts, None), Config(),
                      Notices(), None)
    lazy.take(sgd.param_groups, every_hook=False)  # a lazy step(): every update waits, with lr 0.1 and 0.2
    lazy.skip([])  # no p.grad set to None
    lazy.defer(sgd, parts.path)
    sgd.param_groups[0]["lr"] = 5.0  # a scheduler after step(): the next step's, not this one's
    stepper.apply([2, 0])
    assert parts.waited == [[2, 0]] and parts.checked == [([0, 1, 2], "the lazy step")]  # first apply: all
    assert torch.equal(params[0].detach(), torch.full((2,), 0.0 - 0.1 * 10))
    assert torch.equal(params[1].detach(), torch.full((2,), 1.0))  # still pending: untouched
    assert torch.equal(params[2].detach(), torch.full((2,), 2.0 - 0.2 * 30))
    assert list(lazy.pending) == [0, 1, 0] and lazy.npending == 1
    # The groups are the optimizer's again, with the scheduler's value; p.grad as it was.
    assert sgd.param_groups[0]["params"] == params[:2] and sgd.param_groups[0]["lr"] == 5.0
    assert all(p.grad is None for p in params)
    stepper.apply_pending()
    assert torch.equal(params[1].detach(), torch.full((2,), 1.0 - 0.1 * 20)) and lazy.npending == 0
    assert parts.checked[-1] == ([1], "the lazy step") and parts.path.refreshed == [[2, 0], [1]]
    lazy.remove_hooks()


def test_the_stepper_lends_dense_slots_and_gives_a_sparse_gradient_its_sparse_form():
    """The wrapped step of deferred updates where one gradient came sparse and one went unused: the dense slot
    lent as it is, the sparse one's rows handed over sparse, the unused one's p.grad left None (no update, as
    under DDP); afterwards every p.grad holds what it held."""
    from dcredit_opt.optimizer.lazy import Stepper
    from dcredit_opt.optimizer.updates import LazyUpdates

    params = [nn.Parameter(torch.full((2,), float(k))) for k in range(3)]
    names = ["a", "b", "c"]
    sgd = torch.optim.SGD(params, lr=0.1)
    parts = _StepperParts(params, [torch.full((2,), 10.0 * (k + 1)) for k in range(3)])
    parts.steps_on_slots = False
    parts.not_as_is = lambda: {1}
    given = {}
    parts.for_step = lambda i: given.setdefault(i, parts.slots[i].to_sparse())
    parts.drop_unused_grads = lambda todo: [2]
    lazy = LazyUpdates(sgd, names, params, Notices())
    stepper = Stepper(sgd, torch.optim.SGD, names, params, [], (parts, lazy, parts, parts, parts, None), Config(),
                      Notices(), None)
    lazy.take(sgd.param_groups, every_hook=False)
    lazy.skip([])
    lazy.defer(sgd, parts.path)
    stepper.apply([0, 1, 2])
    assert list(given) == [1] and given[1].is_sparse  # by hand: the sparse one alone
    assert parts.path.lent_once == [0]  # in the C++ pass: the dense one alone
    assert [float(p.detach()[0]) for p in params] == pytest.approx([0.0 - 1.0, 1.0 - 2.0, 2.0])
    assert all(p.grad is None for p in params)
    lazy.remove_hooks()


def _deferred_three(read_order, leader_waits=False):
    """Three parameters whose updates a lazy step() deferred (SGD, lr 0.1; reduced gradients 10, 20, 30), read
    first in ``read_order``: (params, parts, lazy, stepper)."""
    from dcredit_opt.optimizer.lazy import Stepper
    from dcredit_opt.optimizer.updates import LazyUpdates

    params = [nn.Parameter(torch.full((2,), float(k))) for k in range(3)]
    names = ["a", "b", "c"]
    sgd = torch.optim.SGD(params, lr=0.1)
    parts = _StepperParts(params, [torch.full((2,), 10.0 * (k + 1)) for k in range(3)])
    lazy = LazyUpdates(sgd, names, params, Notices())
    lazy._read_order = read_order  # as end_learning sets it: first-read order
    lazy._leader_waits = leader_waits
    stepper = Stepper(sgd, torch.optim.SGD, names, params, [], (parts, lazy, parts, parts, parts, None), Config(),
                      Notices(), None)
    lazy.take(sgd.param_groups, every_hook=False)
    lazy.skip([])
    lazy.defer(sgd, parts.path)
    return params, parts, lazy, stepper


@pytest.mark.parametrize("ended_meanwhile", [(1, 1, 1), (1, 0, 1)])
def test_an_apply_point_that_waits_for_its_own_blocks_takes_what_ended_meanwhile_in_the_same_apply(ended_meanwhile):
    params, parts, lazy, stepper = _deferred_three(read_order=(0, 1, 2))
    finals = [bytes(3)]  # no block has ended when the apply point is reached; these have once it waited
    waits = parts.wait_tensors_on_stream

    def wait(todo, timeout_s):
        waits(todo, timeout_s)
        finals[0] = bytes(ended_meanwhile)

    parts.wait_tensors_on_stream = wait
    stepper.apply_at((0,), lambda: finals[0])
    taken = [0] if ended_meanwhile == (1, 0, 1) else [0, 1, 2]  # up to the first that is not final, in read order
    assert parts.waited == [[0], taken]  # its own first, then every update it applies, in one apply
    assert parts.path.refreshed == [taken]
    expected = [k - 0.1 * 10 * (k + 1) if k in taken else float(k) for k in range(3)]
    assert [float(p.detach()[0]) for p in params] == pytest.approx(expected)
    assert lazy.npending == 3 - len(taken)
    lazy.remove_hooks()


@pytest.mark.parametrize("leader_waits", [True, False])
def test_the_leader_waits_for_the_first_update_read_where_the_forward_reads_it_at_once(leader_waits):
    """Note [Resting hooks]: where the first forward read its first update within a few operations of its
    beginning, the leader (an apply point with none of its own) waits for that update itself and applies
    everything that ended meanwhile, so no other hook needs to wake; elsewhere it waits for nothing (the forward
    may run a long way before that read, overlapping the blocks) and applies only what is final."""
    params, parts, lazy, stepper = _deferred_three(read_order=(1, 0, 2), leader_waits=leader_waits)
    finals = [bytes(3)]  # nothing has ended when the forward begins; everything has once the leader waited
    waits = parts.wait_tensors_on_stream

    def wait(todo, timeout_s):
        waits(todo, timeout_s)
        finals[0] = bytes([1, 1, 1])

    parts.wait_tensors_on_stream = wait
    stepper.apply_at((), lambda: finals[0])
    if leader_waits:
        assert parts.waited == [[1], [1, 0, 2]]  # the first read, then every update in one apply
        assert lazy.npending == 0
        assert [float(p.detach()[0]) for p in params] == pytest.approx([k - 0.1 * 10 * (k + 1) for k in range(3)])
    else:
        assert parts.waited == [] and lazy.npending == 3  # the apply points take them as the forward reaches them
    lazy.remove_hooks()


def test_the_leader_does_not_wait_for_an_embeddings_rows():
    from dcredit_opt.optimizer.updates import LazyUpdates

    params = [nn.Parameter(torch.zeros(2)) for _ in range(3)]
    lazy = LazyUpdates(object.__new__(type("O", (), {})), list("abc"), params, Notices())
    lazy._read_order, lazy._leader_waits = (2, 0, 1), True
    lazy.take([{"params": params}], every_hook=False)
    assert lazy.first_to_wait_for(rows_of={}) == 2
    assert lazy.first_to_wait_for(rows_of={2: None}) is None  # its rows are gathered apart: its own module waits
    lazy.pending[2] = False
    assert lazy.first_to_wait_for(rows_of={2: None}) == 0  # applied already: the next one read
    lazy._leader_waits = False
    assert lazy.first_to_wait_for(rows_of={}) is None


def test_the_stepper_refuses_a_parameter_added_to_the_groups_after_wrapping():
    from dcredit_opt.optimizer.lazy import Stepper

    params = [nn.Parameter(torch.zeros(2)) for _ in range(2)]
    sgd = torch.optim.SGD(params, lr=0.1)
    parts = _StepperParts(params, [torch.zeros(2)] * 2)
    stepper = Stepper(sgd, torch.optim.SGD, ["a", "b"], params, [], (parts,) * 6, Config(), Notices(), None)
    stepper.check_groups()  # as wrapped
    sgd.param_groups[0]["params"].append(nn.Parameter(torch.zeros(3)))
    with pytest.raises(DCreditError, match=r"param_groups\[0\].*shape \(3,\).*Nothing was applied"):
        stepper.check_groups()


class _Frozen(nn.Module):
    """A frozen stem ahead of the trained layers (``frozen_ops`` of its operations before their first read), or
    positions made with one operation (``frozen_ops=0``)."""

    def __init__(self, frozen_ops):
        super().__init__()
        self.stem = nn.Sequential(*[nn.Linear(4, 4) for _ in range(frozen_ops)]).requires_grad_(False)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = x + torch.arange(4, dtype=x.dtype)
        return self.head(self.stem(x))


@pytest.mark.parametrize("frozen_ops, waits", [(0, True), (8, False)])
def test_the_leader_waits_only_where_the_first_forward_read_an_update_at_once(frozen_ops, waits):
    """Note [Resting hooks]: the first forward after step() is watched; where it read the first trained
    parameter within a few operations of its beginning the leader waits for it, and where a frozen stem ran
    first (a forward that overlaps the blocks) it does not. Either way training equals plain torch."""
    import dcredit_opt as dc

    torch.manual_seed(0)
    model, ref = _Frozen(frozen_ops), _Frozen(frozen_ops)
    ref.load_state_dict(model.state_dict())
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = dc.DistributedOptimizer(torch.optim.SGD(trained, lr=0.1, momentum=0.9),
                                  named_parameters=[(n, p) for n, p in model.named_parameters() if p.requires_grad],
                                  config=dc.Config(lazy_step="on"))
    ropt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    try:
        for s in range(6):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(s))
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                m(x).pow(2).mean().backward()
                o.step()
        assert opt._dc.lazy.learned and opt._dc.lazy._leader_waits is waits
        opt.synchronize()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(p.detach(), q.detach(), atol=1e-6)
    finally:
        opt._dc.close()


class _FoundElsewhere(_SideChannel):
    """Every other rank has our weights, and found outside the optimizer the parameters ``found`` (their pool's
    fingerprint is summed in), with ``digest`` for their digest."""

    def __init__(self, T, found, digest, world):
        super().__init__(world=world)
        self.T, self.found, self.digest = T, found, digest

    def start_tally(self, counts):
        self.started.append(counts.clone())
        at, w = 3 * self.T + 2 * usage.AGREED, self.world
        counts[at - 2 * usage.AGREED:at] *= w  # the same update counts and hyperparameters everywhere
        if len(counts) > at:
            k = (len(counts) - at) // 2  # the values, then their squares
            mine = counts[at:at + k].clone()
            theirs = mine.clone()
            theirs[self.T] = usage._mix(int(usage._word_sums(self.found).sum()))
            theirs[self.T + 1:self.T + 3] = torch.tensor(self.digest, dtype=torch.int32)
            counts[at:] = torch.cat([mine + theirs * (w - 1), mine * mine + theirs * theirs * (w - 1)])


@pytest.mark.parametrize("same_found", [True, False], ids=["same_found", "other_found"])
def test_the_pool_of_parameters_found_outside_is_compared_only_where_every_rank_found_the_same(same_found):
    """Note [Parameters outside the optimizer] in checks.py: the found parameters travel as one pooled fingerprint
    beside their digest. Where the digests agree, a pool that differs stops every rank, naming the found
    parameters; where the ranks found other parameters (the digests differ), the pool is not read: one notice."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    params = list(model[0].parameters())
    outside = checks.Outside([], [], lambda p: False)
    outside.find([model], {id(p) for p in params}, params[0].device)
    assert outside.found_names == ["1.weight", "1.bias"]
    theirs = [p.detach().clone() for p in outside.found_params]
    with torch.no_grad():
        theirs[1][0] += 1  # the other ranks' found bias moved apart
    digest = outside.pooled()[2] if same_found else [(outside.pooled()[2][0] + 1) % 64, 0]
    notices = Notices()
    tally = UsageTally(["a", "b"], params, 3, _FoundElsewhere(2, theirs, digest, 3),
                       Config(check_weights_every=1), notices, lambda: None, outside=outside)
    tally.start(0)  # takes the fingerprints...
    tally.start(0)  # ...carries them
    if same_found:
        with pytest.raises(DCreditError, match=r"parameters '1.weight', '1.bias' differ \(one of them at least.*"
                                               r"neither in it nor named.*Wrap every optimizer"):
            tally.start(0)
    else:
        tally.start(0)
        tally.start(0)
        assert "found differ" in notices
    tally.close()
