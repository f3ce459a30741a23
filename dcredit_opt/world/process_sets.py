"""Process sets: an optimizer that reduces over some of the job's ranks (``DistributedOptimizer(process_set=)``).

Note [Process sets]
-------------------
``process_set`` names the ranks whose gradients are averaged: our
``ProcessSet([0, 2])``, a torch.distributed group (``new_group([0, 2])``), or,
under horovodrun, Horovod's ``hvd.ProcessSet`` (``hvd.add_process_set``).
Everything the optimizer does with other ranks then happens among the set's
ranks only, and ranks outside it take no part:

- the channels are the set's: Gloo groups of ours over the set's ranks
  (Note [Private groups] in ``groups.py``), or, on the MPI backend, a
  communicator of those ranks (``MPI_Comm_create_group``, collective over
  them only);
- the control plane (the model and settings checks, the plan, re-plans) is
  a Gloo group of ours over the set, with the set's first rank as its root:
  the set's rank 0;
- the store they meet in: torchrun's (or the script's) default store; under
  mpiexec ours; under horovodrun one made for the set by a Horovod broadcast
  on Horovod's process set, so again only its ranks take part.

So several optimizers on different sets (the 2-D case: each data-parallel
group its own) train each as if its set were alone in the job.

Agreement, before anything is connected (``_meet``): every member counts, in
the store, the optimizers it has built on this set (the k-th one on every
member meets the k-th of the others), says which set it builds now, and
waits, at most ``timeout_s``, until every member has arrived. A member that
says it builds on another set holding both of us (the ranks disagree about
the set, or build in a different order) ends the wait at once with a
``MismatchError`` naming both sets; a member that never arrives ends it with
a ``CollectiveTimeout`` naming it and what it last built. Never a hang.

A rank outside the set it is given: with Horovod's ``hvd.ProcessSet`` the
optimizer is a plain one on that rank, as in Horovod (its gradients are not
reduced; Horovod's own tests rely on it), and we say so once; with ours, a
``DCreditError``: a script that computed the wrong set for a rank would
otherwise train that rank alone in silence. ``ProcessSet([rank])`` says
"alone" explicitly.
"""

from __future__ import annotations

import json
import logging
import time

import torch
import torch.distributed as dist

from ..errors import CollectiveTimeout, DCreditError, LaunchError, MismatchError
from . import channels, control, groups, launchers, runtime
from .peers import at_rank

log = logging.getLogger("dcredit_opt")


class ProcessSet:
    """Some of the job's ranks (global ranks), for ``DistributedOptimizer(process_set=...)``: a list of ranks, or
    a torch.distributed process group (from ``new_group``), whose ranks it takes."""

    def __init__(self, ranks_or_group):
        if isinstance(ranks_or_group, dist.ProcessGroup):
            ranks_or_group = dist.get_process_group_ranks(ranks_or_group)
        try:
            ranks = sorted(set(ranks_or_group))
        except TypeError:
            raise TypeError(f"ProcessSet takes a list of ranks or a torch.distributed process group, got "
                            f"{ranks_or_group!r}") from None
        if not ranks or any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in ranks):
            raise ValueError(f"ProcessSet takes a non-empty list of ranks (ints >= 0), got {ranks_or_group!r}")
        if len(ranks) != len(list(ranks_or_group)):
            raise ValueError(f"ProcessSet: rank listed twice in {ranks_or_group!r}")
        self.ranks = ranks

    def included(self) -> bool:
        """Whether this process is one of the set's ranks."""
        return runtime.rank() in self.ranks

    def rank(self) -> int:
        """This process's rank within the set (its position among the set's ranks)."""
        return self.ranks.index(runtime.rank())

    def size(self) -> int:
        return len(self.ranks)

    def __eq__(self, other) -> bool:
        return isinstance(other, ProcessSet) and other.ranks == self.ranks

    def __hash__(self) -> int:
        return hash(tuple(self.ranks))

    def __repr__(self) -> str:
        return f"dcredit_opt.ProcessSet({self.ranks})"


def check_argument(process_set) -> None:
    """A usable ``process_set=`` before the job is joined (a TypeError otherwise): the ranks are checked later."""
    if process_set is None or _is_global(process_set) or isinstance(process_set, (ProcessSet, dist.ProcessGroup)):
        return
    if process_set is dist.GroupMember.NON_GROUP_MEMBER:
        return  # new_group's answer on a rank outside the group: refused once the rank is known (members())
    if _is_horovod_set(process_set):
        return
    if isinstance(process_set, (list, tuple)):
        ProcessSet(process_set)
        return
    raise TypeError(f"process_set must be a dcredit_opt.ProcessSet, a list of ranks, a torch.distributed process "
                    f"group or Horovod's hvd.ProcessSet, got {type(process_set).__name__}")


def _is_global(process_set) -> bool:
    """Horovod's ``hvd.global_process_set``, or ours (``dcredit_opt.global_process_set``): every rank."""
    return getattr(process_set, "process_set_id", None) == 0


def _is_horovod_set(process_set) -> bool:
    return type(process_set).__name__ == "ProcessSet" and hasattr(process_set, "process_set_id")


def members(process_set, timeout_s: float, device: torch.device | None = None):
    """The ranks an optimizer (of parameters on ``device``) reduces over, for ``process_set`` (see
    ``check_argument``): every rank's control plane and channels, or a ``_Subset`` that joined the set with its
    other members (Note [Process sets]). Call after ``dc.init()``."""
    size = runtime.size()
    if process_set is None or _is_global(process_set):
        return everyone()
    if process_set is dist.GroupMember.NON_GROUP_MEMBER:
        raise DCreditError(f"rank {runtime.rank()} builds a DistributedOptimizer on a torch.distributed group that "
                           "does not hold it (new_group() returned GroupMember.NON_GROUP_MEMBER here): give each rank "
                           "the group it belongs to")
    horovod_set = _is_horovod_set(process_set)
    if horovod_set:
        if process_set.process_set_id is None or process_set.ranks is None:
            raise DCreditError(f"process_set={process_set}: Horovod has not registered this process set; pass it to "
                               "hvd.init(process_sets=[...]) or hvd.add_process_set() first")
        if runtime.kind() != "horovod":
            raise DCreditError(f"process_set={process_set} is Horovod's, but this is a {runtime.kind()} job: pass "
                               "dcredit_opt.ProcessSet(ranks) instead")
        ranks = sorted(process_set.ranks)
    elif isinstance(process_set, dist.ProcessGroup):
        ranks = ProcessSet(process_set).ranks
    else:
        ranks = (process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)).ranks
    outside = [r for r in ranks if r >= size]
    if outside:
        raise DCreditError(f"process_set={ranks}: rank(s) {outside} are not in this job of {size} ranks (0..{size - 1})")
    me = runtime.rank()
    if me not in ranks:
        if horovod_set:  # Horovod's meaning: a plain optimizer here (Note [Process sets])
            log.warning("dcredit_opt: rank %d is not in process_set %s: as with Horovod, this rank's optimizer "
                        "steps with its own gradients, unreduced", me, ranks)
            return _Subset([me], dist.HashStore(), timeout_s)
        raise DCreditError(f"rank {me} builds a DistributedOptimizer on process_set {ranks}, which does not hold it: "
                           f"give each rank the set it belongs to (e.g. its data-parallel group), or "
                           f"dcredit_opt.ProcessSet([{me}]) for a rank that trains alone")
    if ranks == list(range(size)):
        return everyone()
    if device is not None and device.type == "cuda":
        raise DCreditError(f"process_set={ranks}: the channels of a process set are Gloo groups, on CPUs; for "
                           "parameters on CUDA they are not built yet: reduce over every rank, or train on CPUs")
    if runtime.kind() == "horovod" and not horovod_set:
        raise DCreditError(f"process_set={ranks}: in a Horovod job pass Horovod's process set "
                           f"(hvd.add_process_set({ranks}), or hvd.init(process_sets=...)), so that Horovod knows it too")
    return _Subset(ranks, _store_for(ranks, process_set if horovod_set else None, timeout_s), timeout_s)


class _Plane:
    """The text helpers of a control plane, on its ``all_gather`` and ``broadcast_`` (``world/control.py``'s for every rank)."""

    def broadcast_text(self, text: str | None, root: int) -> str:
        return control.broadcast_text(text, root, plane=self)

    def all_gather_text(self, text: str, name: str) -> list[str]:
        return control.all_gather_text(text, name, plane=self)


class _Everyone(_Plane):
    """Every rank of the job: the runtime's own control plane and channels, as before process sets."""

    everyone = True

    @property
    def rank(self) -> int:
        return runtime.rank()

    @property
    def size(self) -> int:
        return runtime.size()

    @property
    def ranks(self) -> list:
        return list(range(runtime.size()))

    def all_gather(self, tensor, name):
        return control.all_gather(tensor, name)

    def broadcast_(self, tensor, root, name):
        control.broadcast_(tensor, root, name)

    def control_device(self):
        return control.control_device()

    def on_cpu(self) -> bool:
        return channels.horovod_on_cpu()

    def channel_groups(self, count: int, backend: str | None = None) -> list:
        return channels.channel_groups(count, backend)

    def destroy_channel_groups(self, groups_) -> None:
        channels.destroy_channel_groups(groups_)

    def close(self) -> None:
        """Nothing of its own: the runtime's groups go at ``shutdown()``."""

    def mpi_comm(self):
        return launchers.import_mpi().COMM_WORLD


_EVERYONE = _Everyone()


def everyone() -> _Everyone:
    return _EVERYONE


class _Subset(_Plane):
    """Some of the ranks (Note [Process sets]): a control group and channels of ours over them, on ``store``."""

    everyone = False

    def __init__(self, ranks: list, store, timeout_s: float):
        self.ranks, self.size = ranks, len(ranks)
        self.rank = ranks.index(runtime.rank())
        self.timeout_s = float(timeout_s)
        self._store = store
        self._made = 0
        self._tag = f"set/{','.join(map(str, ranks))}/{_meet(store, ranks, runtime.rank(), self.timeout_s)}"
        self._control = self._group("control") if self.size > 1 else None

    def __repr__(self) -> str:
        return f"<process set {self.ranks}, this rank {self.rank} of them>"

    def _group(self, name: str):
        try:
            return groups.private_group(self._store, f"{self._tag}/{name}", self.rank, self.size, self.timeout_s)
        except RuntimeError as e:
            raise at_rank(e, f"connecting process set {self.ranks}'s group {name!r}") from e

    def all_gather(self, tensor, name):
        if self.size == 1:
            return [tensor.clone()]
        gathered = [torch.empty_like(tensor) for _ in range(self.size)]
        try:
            dist.all_gather(gathered, tensor, group=self._control_group())
        except RuntimeError as e:
            raise at_rank(e, f"process set {self.ranks}, control-plane all_gather {name!r}") from e
        return gathered

    def broadcast_(self, tensor, root, name):
        if self.size == 1:
            return
        try:
            groups.broadcast(tensor, root, self._control_group())
        except RuntimeError as e:
            raise at_rank(e, f"process set {self.ranks}, control-plane broadcast {name!r}") from e

    def _control_group(self):
        """The set's control group; never None, which would name torch.distributed's default group."""
        if self._control is None:
            raise DCreditError(f"process set {self.ranks}: this optimizer is closed, and with it its channels")
        return self._control

    def control_device(self):
        return torch.device("cpu")  # a Gloo group of ours

    def on_cpu(self) -> bool:
        mine = torch.tensor([0 if torch.cuda.is_available() else 1], dtype=torch.int32)
        return any(int(t) for t in self.all_gather(mine, "cpu"))

    def channel_groups(self, count: int, backend: str | None = None) -> list:
        """``count`` Gloo groups over the set (``backend`` other than Gloo: refused; the set's channels are ours)."""
        if backend not in (None, "gloo"):
            raise DCreditError(f"process_set={self.ranks}: channels of backend {backend!r} are not built for process "
                               "sets (only Gloo, on CPUs)")
        made = []
        for _ in range(count):
            made.append(self._group(f"ch{self._made}"))
            self._made += 1
            if self.size > 1:
                dist.all_reduce(torch.zeros(1), group=made[-1])  # connected everywhere before the first block
        return made

    def destroy_channel_groups(self, groups_) -> None:
        """Nothing to do: ours end with their last reference (Note [Private groups])."""

    def close(self) -> None:
        """Let go of the control group and the store (the optimizer closes): their threads end now, not in the
        interpreter's teardown (Note [Orderly exit] in world/job.py)."""
        self._control, self._store = None, None

    def mpi_comm(self):
        """A communicator of the set's ranks, made by them alone (``MPI_Comm_create_group``)."""
        MPI = launchers.import_mpi()
        world = MPI.COMM_WORLD
        if self.size == 1:
            return MPI.COMM_SELF
        group = world.Get_group().Incl(self.ranks)
        try:
            return world.Create_group(group, tag=_mpi_tag(self._tag))
        finally:
            group.Free()


def _mpi_tag(tag: str) -> int:
    """A tag for ``Create_group``, the same on every member (from the set and its count), within MPI's bounds."""
    import zlib

    return zlib.crc32(tag.encode()) % 32768


_BUILT = "dcredit_opt/sets/built/{}/{}"
_ARRIVED = "dcredit_opt/sets/arrived/{}/{}"
_BUILDING = "dcredit_opt/sets/building/{}"


def _meet(store, ranks: list, me: int, timeout_s: float) -> int:
    """Join the set's other members in ``store`` (Note [Process sets]): the count of optimizers this rank built on
    the set before, the same on every member; a ``MismatchError`` or ``CollectiveTimeout`` instead of a hang."""
    if len(ranks) == 1:
        return 0
    key = ",".join(map(str, ranks))
    building = _BUILDING.format(me)
    try:
        k = store.add(_BUILT.format(key, me), 1) - 1
        store.set(building, json.dumps([ranks, k]))
        arrived = _ARRIVED.format(key, k)
        store.add(arrived, 1)
        deadline = time.monotonic() + timeout_s
        delay = 1e-3
        try:
            while store.add(arrived, 0) < len(ranks):
                _check_peers(store, ranks, k, me)
                if time.monotonic() > deadline:
                    _late(store, ranks, me, timeout_s)
                time.sleep(delay)
                delay = min(2 * delay, 0.05)
        except BaseException as e:
            # Not built: counted out again, so that the ranks' counts still agree if the script goes on. After a
            # mismatch the word stays: the peer it disagrees with learns of it too, at once.
            store.add(arrived, -1)
            store.add(_BUILT.format(key, me), -1)
            if not isinstance(e, MismatchError):
                store.set(building, "null")
            raise
        # What this rank builds is said only while it waits: a stale word would mislead a peer. Not deleted: a
        # peer's get() of a key that went would wait.
        store.set(building, "null")
    except DCreditError:
        raise
    except RuntimeError as e:  # the store: its host is gone
        raise at_rank(e, f"joining process_set {ranks} in the rendezvous store") from e
    return k


def _check_peers(store, ranks: list, k: int, me: int) -> None:
    """A ``MismatchError`` if a member waits for another set holding both of us, or for another count of this
    one: the two of us would each wait for the other forever."""
    for peer in ranks:
        other = _building(store, peer) if peer != me else None
        if other is None or me not in other[0] or peer not in other[0] or other == [ranks, k]:
            continue
        if other[0] == ranks:
            raise MismatchError(
                f"rank {me} builds its DistributedOptimizer number {k} on process_set {ranks}, while rank {peer} "
                f"builds its number {other[1]} on that set: every rank of a set must build the same optimizers on "
                "it, in the same order")
        raise MismatchError(
            f"rank {me} builds a DistributedOptimizer on process_set {ranks}, while rank {peer} builds one on "
            f"process_set {other[0]}: the ranks of a set must pass the same set, and build their optimizers on "
            "shared sets in the same order")


def _late(store, ranks: list, me: int, timeout_s: float) -> None:
    """The ``CollectiveTimeout`` for members that did not arrive within ``timeout_s``."""
    late = [p for p in ranks if p != me and (_building(store, p) or [None])[0] != ranks]
    now = "; ".join(f"rank {p} is {'building on ' + str(b[0]) if b else 'not building one'}"
                    for p, b in ((p, _building(store, p)) for p in late))
    raise CollectiveTimeout(
        f"rank {me}: the other ranks of process_set {ranks} did not build their DistributedOptimizer on it within "
        f"{timeout_s:g} s ({now or 'they were late'}): every rank of a set must build it, with the same set, in the "
        "same order (Config.timeout_s)")


def _building(store, rank: int):
    """What ``rank`` waits to build now, ``[ranks, k]``, or None. The key, once set, is never deleted."""
    key = _BUILDING.format(rank)
    if not store.check([key]):
        return None
    return json.loads(store.get(key).decode())


def _store_for(ranks: list, horovod_set, timeout_s: float):
    """Where the set's ranks meet (Note [Process sets])."""
    if len(ranks) == 1:
        return dist.HashStore()  # nobody to meet
    if horovod_set is not None:
        hvd = runtime.horovod()
        position = ranks.index(runtime.rank())

        def broadcast(message) -> None:  # in place, into the numpy array
            handle = hvd.broadcast_async_(torch.from_numpy(message), ranks[0], process_set=horovod_set,
                                          name=f"dc.set.{horovod_set.process_set_id}")
            control.horovod_wait(hvd, handle, f"the rendezvous of process set {ranks}", timeout_s)

        return launchers.rendezvous_store(position, len(ranks), timeout_s, broadcast, f"Horovod's process set {ranks}",
                                          "or pass Config(backend='horovod')")
    store = control.shared_store()
    if store is None:
        raise LaunchError("process sets need a rendezvous store: launch with torchrun, mpiexec or horovodrun")
    return store

