"""Which gradients exist where, and the embedding rows agreed on through the same tally.

Note [Global usage]
-------------------
A parameter unused on this rank (its gradient is ``None`` when phase 1
ends) contributes zeros to the all-reduce, as Horovod does: every rank must
launch the same blocks. If no rank used it, synchronous training (one
process, or DDP) leaves its gradient ``None`` and the optimizer skips it:
no momentum, no weight decay, no Adam step. Giving it the reduced zeros
instead would move it (Horovod's behaviour, a silent difference). The
reduced values cannot tell the two apart (a used parameter may have an
exactly zero gradient, and ranks deciding on local evidence would differ),
so each rank also sums, over ranks, a flag per tensor: "had a gradient
here". The tally starts when phase 1 ends, on a channel of its own beside
the blocks, and is waited for only when an update is applied to a tensor
this rank did not use (a tensor used here is used, whatever the others
did). A tensor that no rank used gets ``p.grad = None`` before the wrapped
step, on every rank alike, and keeps it, as under DDP.

Note [Unused here]
------------------
Under DDP, ``p.grad`` after ``backward()`` is set for every parameter some
rank used, this rank's unused ones included (their averaged gradient). Code
that lists the gradients first and reads them after (``clip_grad_norm_``,
``clip_grad_value_``, a GradScaler's ``unscale_``, ``for p in params: if
p.grad is not None: ...``) relies on that: a rank that skipped a branch
must list its parameters too, or its norm, its clipping and its update
differ from the other ranks', silently. Ours are reduced after
``backward()``, and the tally that says who used what comes at the flush.
So at the end of the backward that opened the iteration (an autograd
callback queued at its first gradient), each tensor this rank did not
reach gets ``p.grad``: the watched alias of its slot, zeroed (``stood``).
It is this rank's contribution, zeros, and, as any watched gradient, a
read of it waits for the reduction: it then shows the other ranks' sum. At
the flush it counts as no gradient of this rank's (``used``), unless user
code put another tensor in its place or a later backward pass reached the
tensor (autograd adds that gradient onto the zeros, in place, and the pass
is counted: this rank's gradient then); set to ``None`` since, it is a drop
(no update, as for any gradient set to ``None``). In a world of one there is no other
rank's sum to show: nothing is done there, and an unused ``p.grad`` stays
``None`` as in plain torch.

A tensor that no rank used shows zeros until the flush, where DDP shows
``None``; at a flush that a read starts, those get ``p.grad = None`` at
once (the tally is waited for there), so the rest of a loop over the
gradients skips them, as under DDP. Where the read was of such a tensor
itself (the first in the loop) and user code then put a tensor made from
those zeros in its ``p.grad``, ``step()`` takes that as a drop
(``read_while_unused``): plain torch had ``None`` there and no update. What
is left different from DDP: user code that tests ``p.grad is None``
between ``backward()`` and its first read sees zeros for a tensor no rank
used; where it does more for a gradient than read it (a random draw per
gradient), it does that once more, alike on every rank. And code that
lists the parameters whose ``p.grad`` is not None, then reads each
``p.grad`` in a second loop (old copies of ``clip_grad_norm_``, a flat
vector of the gradients), finds ``None`` after the first read for a listed
tensor no rank used, and fails there (``AttributeError``); listing the
gradients themselves (``[p.grad for p in ps if p.grad is not None]``), or
``synchronize()`` first, works. Keeping the zeros until ``step()`` instead
would make that code run, but every per-gradient loop after the first
read would then see them too, and a random draw per gradient would change
the results without a word: a loud failure was chosen over a silent one.

The same tally carries each rank's proposal of tensors to reduce as
embedding rows (Note [Embedding rows]) its count of updates (Note [Same updates]) and, now and
then, fingerprints of its weights (Note [Same weights]); once every rank proposes the same ones, all take the rows
path together (Note [Embedding rows] in ``rows.py``). :class:`UsageTally`
owns both: the flags, the tally, this rank's proposal and the rows agreed;
and the sparse gradients that take the same path (Note [Sparse gradients] in
``sparse.py``), agreed at the first flush.

Each iteration's turn of the tally (this rank's counts written, the last
tally waited for and its update counts checked, the next one started, the
flags cleared) runs at every ``step()``. On the torch backend it is one
C++ call (``TallyTurns`` in ``backends/base.py``, ``SideSums.turn_tally``)
wherever no fingerprints travel and no rows are being agreed on: about
55 us in all on the GPT-shaped model of ``benchmarks/host_cost.py``, where
the same steps from Python took 90-105 us around the same 45 us c10d start.
The turns that carry fingerprints or agree on rows, and the Python-driven
backends (MPI, Horovod), take the same steps in Python.

Note [Same updates]
-------------------
Synchronous training applies one update per iteration on every rank. A
script that skips ``step()`` on one rank alone (after a check of its own
loss, or an exception caught in its backward, then ``zero_grad()``) while
the others step leaves the ranks with different weights, and nothing later
tells: the next iterations' collectives pair up as before. Each rank's
count of the updates it took (``LazyUpdates.taken``: the ``step()`` calls
that took an iteration's reduced gradients, applied or deferred) travels in
the tally as ``a`` and ``a * a``, ``a`` the count modulo
:data:`UPDATES_MODULO`. The sums equal ``world * a`` and ``world * a * a``
on a rank exactly when every rank's count is that rank's (the sum of
squares exceeds ``world`` times the squared mean unless all are equal), so
where counts differ every rank sees it, at the same flush, and raises. A
count that differs is seen at the first flush after it: one tally later,
long before counts modulo 64 could meet again. A step skipped on every rank
alike (``synchronize()``, a decision from the reduced gradients, then
``zero_grad()``: the iteration ends without an update, as GradScaler's
skipped steps do) changes every rank's count alike.

Note [Same hyperparameters]
---------------------------
Synchronous training steps every rank with the same hyperparameters. A
learning-rate scheduler driven by a rank's own metric (ReduceLROnPlateau
stepped with this rank's validation loss, a warm-up counted from this
rank's batches) or a setting changed under a rank's own condition gives
the ranks different updates of the same reduced gradients: their weights
move apart, and only Note [Same weights] would tell, at its next check.
So each tally also carries a fingerprint of the optimizer's
hyperparameters as they are at the flush (every param group's entries
but its parameters: numbers, flags, strings and tuples of them, a CPU
tensor of one value by that value; other values by their type only),
``zlib.crc32`` of their ``repr`` modulo :data:`UPDATES_MODULO`, agreed
on as the update counts are: a difference is seen at the next flush, on
every rank alike, and each rank's error shows its own values, so the
logs of two ranks show what differs. The first tally is not compared on
them, nor one in flight when ``broadcast_optimizer_state()`` or
``load_state_dict()`` replaces them: a script may take a step from
different ones before it broadcasts the root's (Horovod's own test of its
broadcast does, with Horovod's function, which we do not see). One
difference in 64 falls on the
same fingerprint and is seen at a later flush, as schedulers go on
moving. A device tensor (a capturable learning rate on a GPU) is not
read, so that no flush waits for the device.

Note [Same weights]
-------------------
Synchronous training keeps every rank's weights bit for bit the same: the
same reduced gradients, the same optimizer, the same arithmetic. So the
weights themselves are compared, every ``Config.check_weights_every``
iterations, in the same tally: per parameter an exact fingerprint, the
integer sum of its bytes read as 64-bit words (modulo 2**64), which no
summation order or thread count changes, mixed down to six bits
``f`` (a multiply whose top bits depend on every bit of the sum: a sum's
low bits are all zero for round values such as a fresh layer norm's ones),
sent as ``f`` and ``f * f`` as the update counts are (Note [Same
updates]); a parameter whose sums are not
``world * f`` and ``world * f * f`` differs somewhere, and every rank finds
the same first one. A difference that falls on the same six bits (1 in 64
per parameter per check) is seen at a later check, as the weights go on
moving apart; weights that differ only by a permutation of the same values
have the same sum and are not seen. The fingerprint is taken at the flush, after the last
``step()``'s updates were applied (``release()`` and ``synchronize()``
apply what is pending first), so every rank fingerprints the weights of
the same number of updates, and travels in the next flush's tally: on a
GPU the sums run on the device and reach the host without the training
thread waiting for them; on the CPU one C++ pass over every parameter's
bytes computes the same sums (``_C.word_sums``: 59 us against 563 for
the torch operations on the GPT-shaped model of ``host_cost.py``, 66
against 1171 on the ResNet-50-shaped one, per check). What it catches that nothing else does: a
write to a parameter on some ranks only (a checkpoint loaded on one rank,
an in-place change under a rank's own condition), ranks that started from
different weights (no broadcast of rank 0's), and any fault of ours that
lets ranks drift. The first check comes at iteration ``check_weights_every``,
not the first: a script may run a step or two on purpose from different
weights (Horovod's own test of broadcasting the optimizer's state does)
before it broadcasts them.
"""

from __future__ import annotations

import numbers
import weakref
import zlib

import torch

from .. import _ext, timeline
from ..backends.base import TallyTurns
from ..errors import DCreditError
from ..world.peers import at_rank
from . import rows, sparse
from .buffers import clear, per_tensor
from .lazy import PLAIN_HYPER

UPDATES_MODULO = 64
"""Note [Same updates]: the update counts (and Note [Same weights]'s fingerprints) travel modulo this, so that
``world * a * a`` fits the tally's int32 for a world of up to 2**31 / 64**2 = 524,288 ranks."""


_MIX = 0x9E3779B97F4A7C15
"""An odd 64-bit multiplier (2**64 over the golden ratio): its product's top bits depend on every bit of the
fingerprint's sum, whose low bits alone are all zero for round values (zeros, ones)."""


def _word_sums(params) -> torch.Tensor:
    """Per parameter, the sum of its bytes read as 64-bit integers (modulo 2**64, so exact whatever the order of
    the summation; the last bytes that do not fill a word added one by one), on the parameters' device. On the
    CPU one C++ pass computes the same (no torch operation per parameter); elsewhere, torch operations do."""
    if params and all(p.device.type == "cpu" for p in params):
        try:
            return _ext.load().word_sums(params)
        except ValueError:  # a tensor aligned to neither 8 nor 4 bytes: the torch path says what it says
            pass
    return _torch_word_sums(params)


def _torch_word_sums(params) -> torch.Tensor:
    """:func:`_word_sums` with torch operations, on any device."""
    sums = []
    for p in params:
        raw = p.detach().reshape(-1).contiguous().view(torch.uint8)  # a strided parameter: its values in order
        whole = raw.numel() // 8 * 8
        try:
            total = raw[:whole].view(torch.int64).sum()  # a native integer sum: as fast as a float one
        except RuntimeError:  # storage not aligned to 8 bytes (a view into another tensor): 32-bit words
            whole = raw.numel() // 4 * 4
            total = raw[:whole].view(torch.int32).sum(dtype=torch.int64)
        if whole < raw.numel():
            total = total + raw[whole:].sum(dtype=torch.int64)
        sums.append(total)
    if not sums:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack([t.to(sums[0].device) for t in sums])


def _mix(total: int) -> int:
    """A word sum mixed down to a number below :data:`UPDATES_MODULO` (its top bits after :data:`_MIX`)."""
    bits = UPDATES_MODULO.bit_length() - 1
    return ((total & 0xFFFFFFFFFFFFFFFF) * _MIX & 0xFFFFFFFFFFFFFFFF) >> (64 - bits)


def fingerprints(params) -> list[int]:
    """Note [Same weights]: per parameter, its exact fingerprint, below :data:`UPDATES_MODULO` (the host waits
    for the sums: :class:`_Fingerprinting` does not)."""
    return [_mix(t) for t in _word_sums(params).cpu().tolist()]


AGREED = 2
"""Values each tally agrees on, each sent with its square after the per-tensor part: the update count (Note [Same
updates]) and the hyperparameters' fingerprint (Note [Same hyperparameters]); the weights' fingerprints follow."""


def settled_hyperparameters(groups) -> list:
    """Note [Same hyperparameters]: ``groups``' hyperparameters as the fingerprint sees them, per group."""
    return [[(k, _settled(v)) for k, v in g.items() if k != "params"] for g in groups]


def hyperparameters_fingerprint(settled: list) -> int:
    """Note [Same hyperparameters]: ``settled_hyperparameters`` as one value below :data:`UPDATES_MODULO`."""
    return zlib.crc32(repr(settled).encode()) % UPDATES_MODULO


def _settled(v):
    if type(v) in PLAIN_HYPER:
        return v
    if isinstance(v, numbers.Integral):  # NumPy's integers and floats (a schedule computed with NumPy) by value
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v)
    if isinstance(v, (tuple, list)):
        return tuple(_settled(x) for x in v)
    if isinstance(v, torch.Tensor):
        if v.device.type == "cpu" and v.numel() == 1 and not v.is_sparse:
            return v.item()
        return f"tensor{tuple(v.shape)}"
    return type(v).__name__


def _described(settled: list) -> str:
    return "; ".join(f"group {j}: " + ", ".join(f"{k}={v!r}" for k, v in g) for j, g in enumerate(settled))


def _agreement(values) -> list[int]:
    """What a rank adds to the tally so that every rank can tell whether all sent the same ``values`` (each below
    :data:`UPDATES_MODULO`): the values, then their squares (Note [Same updates])."""
    return [*values, *(v * v for v in values)]


def _disagreeing(summed: torch.Tensor, mine, world: int) -> list[int]:
    """Where ``summed`` (every rank's :func:`_agreement`, summed) shows some rank sent another value than ``mine``:
    the same positions on every rank (Note [Same updates]). In Python over one ``tolist()``: a few values, every
    iteration, where each torch operation would cost more than the whole."""
    got, k = summed.tolist(), len(mine)
    return [j for j, v in enumerate(mine) if got[j] != world * v or got[k + j] != world * v * v]


class _Fingerprinting:
    """The fingerprints of the weights as they are at one flush, read at the next (Note [Same weights]): on a
    GPU the sums run on the device and come back with a copy the host does not wait for at the flush that
    starts them."""

    def __init__(self, params, iteration: int, skipped=(), pooled=(), digest=(0, 0), pooled_names=()):
        self.iteration = iteration  # the flush (tally) whose weights these are, counted from 1
        self.pooled_names = list(pooled_names)  # the found parameters in the pool, as they were when fingerprinted
        if skipped:  # positions sent as 0, unread: weights another optimizer of ours compares
            params = list(params)
            for i in skipped:  # no operation on the parameter: its optimizer's read guard would apply its update
                params[i] = torch.empty(0, dtype=torch.uint8, device=params[i].device)
        # Then the found parameters' pool (one sum of their sums, modulo 2**64; Note [Parameters outside the
        # optimizer] in checks.py), and the digest that says which they are.
        sums = _word_sums(params)
        pool = _word_sums(pooled).sum().view(1) if pooled else torch.zeros(1, dtype=torch.int64)
        sums = torch.cat([sums, pool.to(sums.device)])
        self._digest = list(digest)
        self._event = None
        if sums.is_cuda:
            self._host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
            self._host.copy_(sums, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = sums

    def values(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()  # recorded a whole iteration ago: long done
        return [*(_mix(t) for t in self._host.tolist()), *self._digest]


class UsageTally:
    """Owns Note [Global usage] and Note [Embedding rows]'s agreement.

    ``used`` (per tensor, this iteration: had a gradient on this rank; the C++
    gradient path writes it too) is summed over ranks at the end of phase 1
    (:meth:`start`), with this rank's proposal of embedding rows; ``rows``
    (tensor -> :class:`rows.EmbeddingRows`) holds the tensors every rank agreed
    to reduce as rows. The gradient memory (slots, versions, scales) belongs
    to the caller and is passed in.
    """

    def __init__(self, names, params, world: int, backend, config, notices, on_rows_grad, *, rows: bool = True,
                 outside=None, groups=list):
        T = len(params)
        self._groups = groups  # () -> the optimizer's param groups (Note [Same hyperparameters]); none in tests
        self._world_size = world  # ranks in the job
        self._rows_allowed = rows  # False where blocks are not summed (Note [Reduce ops] in reduce_ops.py)
        self.used = per_tensor(T, "B")
        self.rows: dict[int, rows.EmbeddingRows] = {}  # once agreed, in tensor order on every rank
        self._names = names
        self._params = params
        self._backend = backend
        self._turns = backend if isinstance(backend, TallyTurns) else None  # the steady tally in one call
        self._config = config
        self._notices = notices
        self._on_rows_grad = on_rows_grad  # (i): tensor i's rows came; opens an iteration whose only gradients are rows
        self._usage = None  # the last flushed iteration's _Usage
        self._proposal = [0] * T  # what this rank learned: 0, rows.TIED or rows.ROWS_ONLY per tensor
        self._tail = per_tensor(2 * T, "i")  # the proposal's part of the tally (rows wanted, rows only)
        self._proposing = False  # whether this rank proposes any tensor for rows
        self._counts_made = _TallyCounts()
        self._fill = _ext.load().fill_tally
        self._modules: dict[int, list] = {}  # tensor -> weak references to the embeddings that read it
        self._agreed = False
        self._starts = 0  # tallies started: the same on every rank (each is a collective)
        # Note [Same weights]: every this many tallies carries the weights' fingerprints
        self._check_weights = int(config.check_weights_every)
        self._weights_matched = 0  # the last iteration (tally) whose weights matched on every rank, 0: none yet
        # The weights compared: ours, then the named parameters outside the optimizer, then (added by
        # _Fingerprinting) the pool of those found in the model and its digest (checks.Outside; Note [Parameters
        # outside the optimizer] in checks.py).
        self._compared_params = [*params, *(() if outside is None else outside.params)]
        self._compared_names = [*names, *(() if outside is None else outside.names)]
        self._outside = outside
        self._fingerprinting: _Fingerprinting | None = None  # taken at the last flush, sent at the next
        # Note [Sparse gradients]: this rank's sparse gradients of the first iteration, until the first flush
        # agrees which tensors are sparse (None after it, or when sparse gradients are reduced dense).
        self._first_sparse: dict | None = None
        self._sparse_agreed = False  # the first flush has agreed which tensors are sparse
        self._sparse_replan = False  # the first flush made tensors sparse: the plan must drop their blocks
        self.as_sparse: dict = {}  # tensor -> row indices of its reduced sparse gradient (GradientBuffers reads it)

    def take_sparse_gradients(self) -> None:
        """Note [Sparse gradients]: reduce sparse gradients as rows (``sparse_as_dense=False``), where the
        backend exchanges rows (every backend does) or the job has one rank."""
        if self._world_size == 1 or getattr(self._backend, "exchanges_rows", False):
            self._first_sparse = {}

    @property
    def exchanging(self) -> bool:
        """Whether the flush exchanges anything: rows agreed, or the first flush's agreement on sparse tensors."""
        return bool(self.rows) or self._first_sparse is not None

    def put_sparse(self, i: int, grad) -> bool:
        """This rank's sparse gradient of tensor ``i``, kept for the exchange (Note [Sparse gradients]); False
        when sparse gradients are reduced dense here (the caller refuses or densifies)."""
        r = self.rows.get(i)
        if isinstance(r, sparse.SparseRows):
            r.put(grad)
            return True
        if self._first_sparse is None:
            if self._sparse_agreed:  # and this one was not among them
                raise DCreditError(
                    f"parameter '{self._names[i]}' has a sparse gradient, but no rank's gradient of it was sparse in "
                    "the first iteration, where dcredit_opt agrees which parameters are reduced as sparse rows (Note "
                    "[Sparse gradients]). Nothing was reduced. Give it its sparse gradient in the first iteration "
                    "(on any rank), or pass sparse_as_dense=True to DistributedOptimizer to reduce it as a dense "
                    "tensor")
            return False
        self._first_sparse[i] = sparse.row_sparse(self._names[i], grad)
        return True

    def travels_sparse(self, i: int) -> bool:
        """Whether tensor ``i``'s gradients come sparse and travel as rows (Note [Sparse gradients])."""
        return isinstance(self.rows.get(i), sparse.SparseRows)

    def rows_only_at(self, i: int):
        """Tensor ``i``'s rows (Note [Embedding rows]) where it is reduced as embedding rows alone, else None."""
        r = self.rows.get(i)
        return r if r is not None and r.kind == rows.ROWS_ONLY else None

    def sparse_rows(self) -> list:
        """Tensors whose gradients are reduced as sparse rows."""
        return [i for i, r in self.rows.items() if isinstance(r, sparse.SparseRows)]

    def _agree_on_sparse(self) -> None:
        """Note [Sparse gradients], at the first flush: the tensors whose gradient came sparse on some rank take
        the rows path from now on, on every rank; this iteration's rows are exchanged with the others'."""
        mine, self._first_sparse = self._first_sparse, None
        self._sparse_agreed = True
        T = len(self._params)
        if self._world_size == 1:
            agreed = sorted(mine)
        else:
            flags = torch.zeros(T, dtype=torch.float32)
            if mine:
                flags[list(mine)] = 1.0
            try:
                self._backend.allreduce_side(flags, self._timeout())
            except (RuntimeError, TimeoutError) as e:
                raise at_rank(e, "end of phase 1, agreeing which parameters have sparse gradients") from e
            agreed = flags.nonzero().reshape(-1).tolist()
        if not agreed:
            return
        for i in agreed:
            self.rows[i] = sparse.SparseRows(i, self._params[i], self._names[i], mine.get(i), in_blocks=True)
        self.rows = dict(sorted(self.rows.items()))  # tensor order on every rank
        self._sparse_replan = True
        names = ", ".join(f"'{self._names[i]}'" for i in agreed)
        self._notices.tell("sparse", f"dcredit_opt: {names} reduced as the rows of their sparse gradients, handed "
                                     "to the optimizer sparse (Note [Sparse gradients]; sparse_as_dense=True "
                                     "reduces them dense)")

    def _timeout(self) -> float:
        return float(self._config.timeout_s)

    def rows_only(self) -> list:
        """Tensors reduced as embedding rows alone: they have no blocks."""
        return [i for i, r in self.rows.items() if r.kind == rows.ROWS_ONLY]

    def rows_captured(self) -> bool:
        """Whether some embedding's rows (or sparse gradient) have a gradient this iteration."""
        return bool(self._first_sparse) or any(
            r.captured() if isinstance(r, sparse.SparseRows) else r.stand_in is not None and r.stand_in.grad is not None
            for r in self.rows.values())

    def exchange_rows(self, slots, versions, postscale: float) -> None:
        """Note [Embedding rows]: every rank's embedding rows to every rank; a rows-only tensor's other
        gradient (if any rank has one this iteration) all-reduced densely."""
        if self._first_sparse is not None:
            self._agree_on_sparse()
        timeout = self._timeout()
        for i, r in self.rows.items():  # built in tensor order on every rank
            if isinstance(r, sparse.SparseRows):
                self._exchange_sparse(i, r, slots, versions, postscale)
                continue
            ids, values = r.take()
            slot = slots[i]
            # W's own gradient, which has no blocks; all zeros (zero_grad(set_to_none=False)) adds nothing.
            rest = r.kind == rows.ROWS_ONLY and self.used[i] and bool(slot.any())
            try:
                r.gathered, rest_anywhere = self._backend.exchange_rows(ids, values, rest, timeout)
                if rest_anywhere:
                    self._notices.tell(f"rows rest {i}", f"dcredit_opt: parameter '{self._names[i]}', reduced as "
                                       "the rows its embeddings looked up, was also read otherwise in this "
                                       "iteration; that part of its gradient is all-reduced whole in step(), "
                                       "without overlap (Note [Embedding rows]). Said once.")
                    self._backend.allreduce_side(slot, timeout)
                    if postscale != 1.0:
                        slot.mul_(postscale)
            except (RuntimeError, TimeoutError) as e:
                raise at_rank(e, f"end of phase 1, exchanging the embedding rows of '{self._names[i]}'") from e
            versions[i] = slot._version
            if ids.numel():
                self.used[i] = True

    def _exchange_sparse(self, i, r, slots, versions, postscale: float) -> None:
        """Note [Sparse gradients]: every rank's rows of tensor ``i`` to every rank, and whether any rank's
        gradient came dense (then that dense part is all-reduced whole, unless the blocks carry it)."""
        ids, values, had_rows = r.take()
        slot = slots[i]
        dense_here = bool(self.used[i]) and not had_rows  # a gradient, not sparse: dense
        try:
            if self._world_size == 1:
                r.gathered, r.dense = [(ids, values)], dense_here
            else:
                r.gathered, r.dense = self._backend.exchange_rows(ids, values, dense_here, self._timeout())
            if r.dense and not r.in_blocks:
                self._notices.tell(f"sparse rest {i}", f"dcredit_opt: parameter '{self._names[i]}', reduced as the "
                                   "rows of its sparse gradient, got a dense gradient on some rank in this "
                                   "iteration; it is all-reduced whole in step(), without overlap, and the "
                                   "optimizer gets the dense sum, as in plain torch (Note [Sparse gradients]). "
                                   "Said once.")
                if self._world_size > 1:
                    self._backend.allreduce_side(slot, self._timeout())
                if postscale != 1.0:
                    slot.mul_(postscale)
        except (RuntimeError, TimeoutError) as e:
            raise at_rank(e, f"end of phase 1, exchanging the sparse gradient of '{self._names[i]}'") from e
        r.in_blocks = False
        versions[i] = slot._version

    def add_rows(self, indices, slots, versions, scale: float) -> None:
        """Every rank's embedding rows, times ``scale``, into the reduced gradients of ``indices`` that have them
        (a sparse gradient's indices into ``as_sparse``)."""
        if not self.rows:
            return
        for i in indices:
            r = self.rows.get(i)
            if r is not None and r.gathered is not None:
                slot = slots[i]
                ids = r.add_to(slot, scale)
                if ids is not None:
                    self.as_sparse[i] = ids
                else:
                    self.as_sparse.pop(i, None)
                versions[i] = slot._version

    def start(self, taken: int) -> bool:
        """Note [Global usage]: start summing over ranks which tensors had a gradient on each, with this rank's
        count of updates ``taken`` (Note [Same updates]) and its hyperparameters' fingerprint (Note [Same
        hyperparameters]). True when the last tally made tensors rows-only: the plan must be rebuilt without their
        blocks."""
        here = bytes(self.used)
        settled = settled_hyperparameters(self._groups() or ())
        hyper = (hyperparameters_fingerprint(settled), settled)
        replan = False
        # A world of one sums its tally too: the path every world runs, so that what it costs is measured there.
        self._starts += 1
        # Note [Same weights]: fingerprints taken at one check's flush travel in the next flush's tally
        taken_at, self._fingerprinting = self._fingerprinting, None
        weights = None if taken_at is None else taken_at.values()
        if self._check_weights and not self._starts % self._check_weights:
            # Those another optimizer of ours reduces, it compares, over its own ranks (a process set's).
            outside = self._outside
            skipped = () if outside is None else [len(self._params) + i for i in outside.reduced_elsewhere()]
            pooled_names, pooled, digest = ([], [], (0, 0)) if outside is None else outside.pooled()
            self._fingerprinting = _Fingerprinting(self._compared_params, self._starts, skipped, pooled, digest,
                                                   pooled_names)
        last = self._usage
        if self._starts == 2:
            self.hyperparameters_replaced()  # the first tally is not compared on them (Note [Same hyperparameters])
        if self._turns is not None and weights is None and (last is None or last.weights is None and (
                self._agreed or not self._proposing) and last.hyper is not None):
            return self._turn(here, taken, hyper, last)  # the steady iteration: neither fingerprints nor rows agreed on
        counts, values = self._counts(here, [taken % UPDATES_MODULO, hyper[0]], weights)
        usage = _Usage(here, counts, values, taken, hyper, weights, 0 if taken_at is None else taken_at.iteration,
                       () if taken_at is None else taken_at.pooled_names)
        try:
            self._backend.wait_tally(self._timeout())  # the last one, if nothing needed it
        except (RuntimeError, TimeoutError) as e:
            raise at_rank(e, "end of phase 1, summing which gradients each rank computed") from e
        if last is not None:
            self._check_updates(last)
            self._check_weights_of(last)
        try:
            # Rows are taken where every rank proposes them: nothing to agree on while this rank proposes none.
            if last is not None and not self._agreed and self._proposing:
                replan = self._agree_on_rows(last.values.tolist())
            self._backend.start_tally(usage.counts)
        except (RuntimeError, TimeoutError) as e:
            raise at_rank(e, "end of phase 1, summing which gradients each rank computed") from e
        self._usage = usage
        clear(self.used)
        replan, self._sparse_replan = replan or self._sparse_replan, False
        return replan

    def _turn(self, here: bytes, taken: int, hyper: tuple, last: _Usage | None) -> bool:
        """What ``start`` does, in one C++ call of the backend's (``TallyTurns``), where no fingerprints travel
        and no rows are agreed on: this rank's counts written, the last tally waited for and its agreed values
        checked (Note [Same updates], Note [Same hyperparameters]), this one started, ``used`` cleared."""
        T = len(self._params)
        agreed = [taken % UPDATES_MODULO, hyper[0]]
        counts, values = self._counts_made.next(len(here) + len(self._tail) + 2 * AGREED)
        mine = [] if last is None else last.agreed()
        try:
            started = self._turns.turn_tally(counts, self.used, self._tail, _agreement(agreed),
                                             None if last is None else last.counts, 3 * T, mine, self._world_size,
                                             self._timeout())
        except (RuntimeError, TimeoutError) as e:
            raise at_rank(e, "end of phase 1, summing which gradients each rank computed") from e
        if not started:
            self._check_updates(last)
            raise AssertionError("the tally's agreement broke in C++ and not in Python")
        self._usage = _Usage(here, counts, values, taken, hyper)
        replan, self._sparse_replan = self._sparse_replan, False
        return replan

    def _check_updates(self, last: _Usage) -> None:
        """Note [Same updates]: the summed tally ``last`` says every rank had taken as many updates as this
        one when it started, and had the same hyperparameters (Note [Same hyperparameters]), or this raises (on
        every rank alike)."""
        T = len(self._params)
        differ = _disagreeing(last.values[3 * T:3 * T + 2 * AGREED], last.agreed(), self._world_size)
        if last.hyper is None:  # started before broadcast_optimizer_state(): not compared on hyperparameters
            differ = [j for j in differ if j != 1]
        if 0 in differ:
            raise self._updates_differ(last)
        if differ:
            raise DCreditError(
                "the optimizer's hyperparameters differ between ranks (Note [Same hyperparameters] in usage.py): "
                f"this rank had {_described(last.hyper[1])} at its last reduction. Each rank's error "
                "shows its own. Synchronous training steps every rank alike, so the weights would move apart. A "
                "learning-rate scheduler stepped with this rank's own metric (ReduceLROnPlateau.step(val_loss)) "
                "or a setting changed under a rank's own condition does this: average the metric over ranks first "
                "(dc.allreduce(torch.tensor(val_loss), op=dc.Average)), and change hyperparameters on every rank "
                "alike")

    def hyperparameters_replaced(self) -> None:
        """The hyperparameters were replaced whole (``broadcast_optimizer_state()`` gave every rank the root's, or
        ``load_state_dict()`` a checkpoint's): the tally in flight, started before, is not compared on them (Note
        [Same hyperparameters])."""
        if self._usage is not None:
            self._usage.hyper = None

    def _updates_differ(self, last: _Usage) -> DCreditError:
        """Note [Same updates]: the error every rank raises where the summed tally ``last`` shows a rank that had
        taken another number of updates."""
        return DCreditError(
            f"the ranks have not all applied the same number of optimizer updates: this rank had taken {last.taken} "
            "when the last iteration's gradients were reduced, and some rank had taken another number "
            "(Note [Same updates]). A step() was skipped on some ranks but not on others (for example after a "
            "check of the rank's own loss, or an exception caught in its backward, followed by zero_grad()), so "
            "the weights now differ between ranks. Skip a step on every rank alike: decide from values every rank "
            "shares (the gradients after optimizer.synchronize(), or a flag you all-reduce), then call "
            "optimizer.zero_grad() without step() on every rank")

    def _check_weights_of(self, last: _Usage) -> None:
        """Note [Same weights]: where the summed tally ``last`` carried fingerprints, every parameter's must be
        this rank's on every rank, or this raises (on every rank alike, naming the same parameter)."""
        if last.weights is None:
            return
        differ = _disagreeing(last.values[3 * len(self._params) + 2 * AGREED:], last.weights, self._world_size)
        n = len(self._compared_params)  # then the found parameters' pool, then its digest (two numbers)
        found_differ = bool({n + 1, n + 2} & set(differ))  # the ranks found other parameters: pool not read
        pool_differs = n in differ and not found_differ
        if found_differ:
            self._notices.tell("found differ", "dcredit_opt: the ranks' models hold different parameters outside "
                                               "this optimizer, so those are not compared between ranks (Note "
                                               "[Parameters outside the optimizer] in checks.py)")
        differ = [i for i in differ if i < n]
        if not differ and pool_differs:
            raise self._found_differ(last.weights_at, last.pooled_names)
        if not differ:
            self._weights_matched = last.weights_at
            return
        i = differ[0]
        if i >= len(self._params):  # Note [Parameters outside the optimizer] in checks.py
            raise DCreditError(
                f"parameter '{self._compared_names[i]}' differs between ranks at iteration {last.weights_at}. It is "
                "named in named_parameters but is not in this optimizer, so its gradient is not averaged here: "
                "another optimizer that is not wrapped trains it from each rank's own gradient, or a write changed "
                "it on some ranks only. Wrap every optimizer that trains the model with dc.DistributedOptimizer "
                "(each its own), and broadcast the weights from one rank once (dc.broadcast_parameters("
                "model.state_dict(), root_rank=0)). A parameter meant to differ between ranks belongs in a module that "
                "the model's forward does not call, whose own optimizer steps and clears its gradient before this "
                "optimizer's step(), or on an optimizer of ours over a process set of its own. "
                "Config(check_weights_every=...) sets how often this is checked (Note [Same weights])")
        if self._weights_matched:
            since = (f"after the same updates on every rank (Note [Same updates]), and they were equal at iteration "
                     f"{self._weights_matched} (the check before)")
        else:
            since = ("at the first comparison; the ranks may have started from different weights (give every rank "
                     "rank 0's before training: dc.broadcast_parameters(model.state_dict(), root_rank=0), as Horovod "
                     "scripts do, or the same seed)")
        others = f" ({len(differ) - 1} more parameters differ too)" if len(differ) > 1 else ""
        raise DCreditError(
            f"parameter '{self._names[i]}' differs between ranks{others} at iteration {last.weights_at}, {since}. "
            "Something changed it on some ranks only (a checkpoint loaded on one rank, an in-place write under a "
            "rank's own condition): change parameters on every rank alike, or broadcast them from one rank "
            "after the change. The weights no longer equal synchronous training's; "
            "Config(check_weights_every=...) sets how often this is checked (Note [Same weights])")

    def _found_differ(self, iteration: int, names: list) -> DCreditError:
        """Note [Parameters outside the optimizer] in checks.py: the error every rank raises where the pooled
        fingerprint of the found parameters ``names`` (as they were when fingerprinted) differs between ranks."""
        shown = ", ".join(f"'{n}'" for n in names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        which = (f"parameter {shown} differs" if len(names) == 1 else
                 f"parameters {shown} differ (one of them at least: they are compared together)")
        return DCreditError(
            f"{which} between ranks at iteration {iteration}. They belong to the model whose forward runs this "
            "optimizer's parameters but are neither in it nor named in its named_parameters, so their gradients "
            "are not averaged here: another optimizer that is not wrapped trains them from each rank's own "
            "gradient, or a write changed them on some ranks only. Wrap every optimizer that trains the model "
            "with dc.DistributedOptimizer (each its own, with named_parameters=model.named_parameters()), and "
            "broadcast the weights from one rank once (dc.broadcast_parameters(model.state_dict(), root_rank=0)). "
            "Parameters meant to differ between ranks (a head per rank, trained alone) belong in a module that "
            "the model's forward does not call, whose own optimizer steps and clears their gradients (its step(), "
            "then its zero_grad()) before this optimizer's step(), or on an optimizer of ours over a process set "
            "of their own; Config(check_weights_every=...) sets how often this is checked, 0 never "
            "(Note [Parameters outside the optimizer] in checks.py)")

    def _counts(self, here: bytes, agreed: list[int], weights: list | None = None):
        """What this rank adds to the tally, as a tensor and a memoryview over it: per tensor, whether it had a
        gradient here; then this rank's proposal for Note [Embedding rows] (rows wanted, rows only); then the
        :data:`AGREED` values (its count of updates modulo :data:`UPDATES_MODULO`, its hyperparameters'
        fingerprint) and their squares (Note [Same updates]); and, where given, the fingerprints of its weights
        and their squares (Note [Same weights]). Written in one C++ pass into memory made once
        (:class:`_TallyCounts`): this runs every iteration."""
        rest = _agreement(agreed) + ([] if weights is None else _agreement(weights))
        counts, values = self._counts_made.next(len(here) + len(self._tail) + len(rest))
        self._fill(counts, here, self._tail, rest)
        return counts, values

    def unused_everywhere(self, indices) -> list:
        """Of tensors ``indices``, those no rank computed a gradient for in the iteration being applied."""
        usage = self._usage
        if usage is None or 0 not in usage.here:  # this rank had every gradient (the common case): one C pass
            return []
        maybe = [i for i in indices if not usage.here[i]]
        if not maybe:
            return []
        if usage.everywhere is None:
            try:
                with timeline.profiled("dcredit_opt::wait"):
                    self._backend.wait_tally(self._timeout())
            except (RuntimeError, TimeoutError) as e:
                raise at_rank(e, f"phase 2, waiting to learn whether any rank computed a gradient of "
                                 f"'{self._names[maybe[0]]}' (tensor {maybe[0]})") from e
            usage.everywhere = [bool(c) for c in usage.values[:len(usage.here)].tolist()]
        return [i for i in maybe if not usage.everywhere[i]]

    def drop_unused_grads(self, indices, watched, slots) -> list:
        """``p.grad = None`` for the tensors of ``indices`` no rank used (Note [Global usage]), where
        ``p.grad`` is still ours (``watched[i]`` or ``slots[i]``); returns them."""
        unused = self.unused_everywhere(indices)
        for i in unused:
            p = self._params[i]
            if p.grad is watched[i] or p.grad is slots[i]:  # not one the user assigned
                p.grad = None
        return unused

    def propose_rows(self, tracer, grouped) -> None:
        """What this rank proposes for Note [Embedding rows], from what the first-read tracer saw (tensors
        of Horovod's ``grouped`` excepted); every rank's proposal travels in the tally, and only what all
        propose is taken. Nothing where blocks are not summed: rows are."""
        if not self._rows_allowed:
            return
        for i, refs in tracer.embedded_by.items():
            modules = [m for m in (ref() for ref in refs) if m is not None]
            # A sparse embedding's rows come in p.grad (Note [Sparse gradients]): no stand-in for its weight.
            if (modules and i not in grouped and self._params[i].dim() >= 2
                    and not any(getattr(m, "sparse", False) for m in modules)):
                self._proposal[i] = rows.TIED if i in tracer.read_otherwise else rows.ROWS_ONLY
                self._modules[i] = [weakref.ref(m) for m in modules]
        T = len(self._params)
        for i, k in enumerate(self._proposal):
            self._tail[i], self._tail[T + i] = int(k > 0), int(k == rows.ROWS_ONLY)
        self._proposing = any(self._proposal)

    def _agree_on_rows(self, sums: list) -> bool:
        """Note [Embedding rows]: once the last tally shows every rank proposing the same tensors, they
        take the rows path from the next iteration on, on every rank (all saw the same sums). True when
        some are rows-only."""
        T, world = len(self._params), self._world_size
        agreed = [i for i in range(T) if sums[T + i] == world and i not in self.rows]
        if not agreed:
            return False
        self._agreed = True
        for i in agreed:
            kind = rows.ROWS_ONLY if sums[2 * T + i] == world else rows.TIED
            modules = [m for m in (ref() for ref in self._modules.get(i, ())) if m is not None]
            self.rows[i] = rows.EmbeddingRows(i, self._params[i], self._names[i], modules, kind,
                                              self._on_rows_grad)
        self.rows = dict(sorted(self.rows.items()))  # tensor order on every rank (sparse ones may be there)
        names = ", ".join(f"'{self._names[i]}'" for i in agreed)
        self._notices.tell("rows", f"dcredit_opt: {names} reduced as the embedding rows each batch looks up, not "
                                   "as a dense tensor (Note [Embedding rows]; Config(embedding_rows=False) turns it "
                                   "off)")
        return bool(self.rows_only())

    def close(self) -> None:
        """Remove the embeddings' hooks."""
        for r in self.rows.values():
            r.remove()


class _Usage:
    """One iteration's Note [Global usage]: per tensor, whether it had a gradient here, the counts being
    summed over ranks, and, once that sum is known, whether it had one anywhere; and the updates this rank had
    taken (Note [Same updates])."""

    __slots__ = ("counts", "everywhere", "here", "hyper", "pooled_names", "taken", "values", "weights",
                 "weights_at")

    def __init__(self, here: bytes, counts: torch.Tensor | None, values, taken: int = 0, hyper: tuple = (0, []),
                 weights: list | None = None, weights_at: int = 0, pooled_names=()):
        self.here = here
        self.counts = counts
        self.values = values  # a memoryview over ``counts``: read without a torch operation per read
        self.everywhere = None
        self.taken = taken
        # This rank's hyperparameters, (fingerprint, settled), or None: not compared (Note [Same hyperparameters])
        self.hyper = hyper
        self.weights = weights  # this rank's fingerprints (Note [Same weights]), where this tally carries them
        self.weights_at = weights_at  # where it carries fingerprints, the iteration (flush) whose weights they are
        self.pooled_names = pooled_names  # and the found parameters in its pool then (checks.Outside.pooled)

    def agreed(self) -> list[int]:
        """The :data:`AGREED` values this rank sent."""
        return [self.taken % UPDATES_MODULO, 0 if self.hyper is None else self.hyper[0]]


class _TallyCounts:
    """The tensors a tally is written into, made once per length (the length grows where fingerprints ride
    along, Note [Same weights]) and taken in turn: two per length, because a tally is written while the last
    one, summed, is still read (``UsageTally.start``); no third is alive by then."""

    def __init__(self) -> None:
        self._made: dict[int, list] = {}

    def next(self, n: int):
        """An int32 tensor of ``n`` values (zeros, or a tally two turns old) and a memoryview over it; the
        caller writes every value."""
        pair = self._made.get(n)
        if pair is None:
            made = [torch.zeros(n, dtype=torch.int32) for _ in range(2)]
            # Read through a memoryview: indexing it runs no NumPy or torch code, which is cold after a backward.
            pair = self._made[n] = [(t, memoryview(t.numpy()).cast("B").cast("i")) for t in made]
        pair.reverse()
        return pair[0]
