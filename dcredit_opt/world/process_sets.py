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
  them only), or, on the Horovod backend, Horovod's own operations on
  Horovod's set (``process_set=``, names counted per set:
  ``backends/horovod.py``);
- the control plane (the model and settings checks, the plan, re-plans) is
  a Gloo group of ours over the set, with the set's first rank as its root:
  the set's rank 0;
- the store they meet in: torchrun's (or the script's) default store; under
  mpiexec ours; under horovodrun one made for the set by a Horovod broadcast
  on Horovod's process set, so again only its ranks take part.

So several optimizers on different sets (the 2-D case: each data-parallel
group its own) train each as if its set were alone in the job.

The collectives' ``process_set=`` (``hvd.allreduce(..., process_set=)``,
``for_collectives``) runs on the same footing: under horovodrun Horovod's
own operation on its set; elsewhere a plane of the set's ranks (a Gloo
group of ours, made as an optimizer's control group is, after the same
meeting with purpose "collectives"), made at the set's first collective in
this world and kept in it until ``shutdown()``. A rank outside the set gets
a ``DCreditError``, as in Horovod.

Agreement, before anything is connected (``_meet``): every member counts, in
the store, the optimizers it has built on this set (the k-th one on every
member meets the k-th of the others; the collectives' planes are counted
apart), says which set it builds on now and for what, and waits, at most
``timeout_s``, until every member has arrived. A member that says it builds
on another set holding both of us, or for the other purpose on this one (the
ranks disagree about the set, or build and call in a different order), ends
the wait at once with a ``MismatchError`` naming both; a member that never
arrives ends it with a ``CollectiveTimeout`` naming it and what it was doing.
Never a hang.

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


def check_argument(process_set, what: str = "") -> None:
    """A usable ``process_set=`` before the job is joined (a TypeError otherwise, naming ``what``, the caller): the
    ranks are checked later."""
    if process_set is None or _is_global(process_set) or isinstance(process_set, (ProcessSet, dist.ProcessGroup)):
        return
    if process_set is dist.GroupMember.NON_GROUP_MEMBER:
        return  # new_group's answer on a rank outside the group: refused once the rank is known (members())
    if _is_horovod_set(process_set):
        return
    if isinstance(process_set, (list, tuple)):
        ProcessSet(process_set)
        return
    prefix = f"{what}: " if what else ""
    raise TypeError(f"{prefix}process_set must be a dcredit_opt.ProcessSet, a list of ranks, a torch.distributed "
                    f"process group or Horovod's hvd.ProcessSet, got {type(process_set).__name__}")


def _is_global(process_set) -> bool:
    """Horovod's ``hvd.global_process_set``, or ours (``dcredit_opt.global_process_set``): every rank."""
    return getattr(process_set, "process_set_id", None) == 0


def _is_horovod_set(process_set) -> bool:
    return type(process_set).__name__ == "ProcessSet" and hasattr(process_set, "process_set_id")


def resolve(process_set, what: str) -> tuple[list, object]:
    """The global ranks of ``process_set`` (anything ``check_argument`` takes but every rank's) and Horovod's set
    object where it is Horovod's (else None), for ``what`` (the caller, in messages). A ``DCreditError`` naming the
    argument for a set this job cannot use: one Horovod has not registered, Horovod's outside a Horovod job, ours
    inside one, ranks beyond the job, ``new_group``'s answer to a rank outside it."""
    size = runtime.size()
    if process_set is dist.GroupMember.NON_GROUP_MEMBER:
        raise DCreditError(f"{what}: rank {runtime.rank()} passes process_set=GroupMember.NON_GROUP_MEMBER, "
                           "new_group()'s answer on a rank outside the group: the group does not hold it; give each "
                           "rank the group it belongs to")
    horovod_set = _is_horovod_set(process_set)
    if horovod_set:
        if process_set.process_set_id is None or process_set.ranks is None:
            raise DCreditError(f"{what}: process_set={process_set}: Horovod has not registered this process set; "
                               "pass it to hvd.init(process_sets=[...]) or hvd.add_process_set() first")
        if runtime.kind() != "horovod":
            raise DCreditError(f"{what}: process_set={process_set} is Horovod's, but this is a {runtime.kind()} job: "
                               "pass dcredit_opt.ProcessSet(ranks) instead")
        ranks = sorted(process_set.ranks)
    elif isinstance(process_set, dist.ProcessGroup):
        ranks = ProcessSet(process_set).ranks
    else:
        ranks = (process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)).ranks
    outside = [r for r in ranks if r >= size]
    if outside:
        raise DCreditError(f"{what}: process_set={ranks}: rank(s) {outside} are not in this job of {size} ranks "
                           f"(0..{size - 1})")
    if runtime.kind() == "horovod" and not horovod_set and ranks != list(range(size)):
        raise DCreditError(f"{what}: process_set={ranks}: in a Horovod job pass Horovod's process set "
                           f"(hvd.add_process_set({ranks}), or hvd.init(process_sets=...)), so that Horovod knows it "
                           "too")
    return ranks, (process_set if horovod_set else None)


def members(process_set, timeout_s: float, device: torch.device | None = None, backend: str = "auto"):
    """The ranks an optimizer (of parameters on ``device``, its blocks on ``backend``, ``Config.backend``) reduces
    over, for ``process_set`` (see ``check_argument``): every rank's control plane and channels, or a ``_Subset``
    that joined the set with its other members (Note [Process sets]). Call after ``dc.init()``."""
    if process_set is None or _is_global(process_set):
        return everyone()
    ranks, horovod_set = resolve(process_set, "DistributedOptimizer")
    me = runtime.rank()
    if me not in ranks:
        if horovod_set is not None:  # Horovod's meaning: a plain optimizer here (Note [Process sets])
            log.warning("dcredit_opt: rank %d is not in process_set %s: as with Horovod, this rank's optimizer "
                        "steps with its own gradients, unreduced", me, ranks)
            return _Subset([me], dist.HashStore(), timeout_s)
        raise DCreditError(f"rank {me} builds a DistributedOptimizer on process_set {ranks}, which does not hold it: "
                           f"give each rank the set it belongs to (e.g. its data-parallel group), or "
                           f"dcredit_opt.ProcessSet([{me}]) for a rank that trains alone")
    if ranks == list(range(runtime.size())):
        return everyone()
    on_horovod = horovod_set is not None and (backend == "horovod" or (backend == "auto" and device is not None
                                                                        and device.type == "cuda"))
    if device is not None and device.type == "cuda" and not on_horovod:
        raise DCreditError(f"process_set={ranks}: the channels of a process set are Gloo groups, on CPUs; for "
                           "parameters on CUDA they are built only on Horovod's process-set operations (a Horovod "
                           "job with Horovod's process set): reduce over every rank, or train on CPUs")
    return _Subset(ranks, _store_for(ranks, horovod_set, timeout_s), timeout_s, horovod_set=horovod_set)


def for_collectives(process_set, fn: str):
    """The plane a collective ``fn`` runs on over ``process_set`` (Horovod's ``process_set=`` argument): every
    rank's (``everyone()``) for None or the global set; else the set's, made at the set's first collective in this
    world and kept until ``shutdown()`` (Note [Process sets]). A ``DCreditError`` naming ``process_set`` where this
    rank is not in the set, as in Horovod."""
    if process_set is None or _is_global(process_set):
        return everyone()
    check_argument(process_set, fn)
    ranks, horovod_set = resolve(process_set, fn)
    me = runtime.rank()
    if me not in ranks:
        raise DCreditError(f"{fn}: rank {me} is not in process_set {ranks}: a collective on a process set is "
                           "called by the set's ranks only (as in Horovod)")
    if ranks == list(range(runtime.size())):
        return everyone()
    world = runtime.current()
    key = tuple(ranks)
    plane = world.set_planes.get(key)
    if plane is None:
        if world.kind == "horovod":
            plane = _HorovodSet(ranks, horovod_set)  # Horovod's own operations on its set: nothing to connect
        else:
            plane = _Subset(ranks, _store_for(ranks, None, world.timeout_s), world.timeout_s, purpose="collectives")
        world.set_planes[key] = plane
    elif horovod_set is not None:
        plane.horovod_set = horovod_set  # the object the script holds now (one set may be removed and added again)
    return plane


class _Plane:
    """The text helpers of a control plane, on its ``all_gather`` and ``broadcast_`` (``world/control.py``'s for every rank)."""

    def broadcast_text(self, text: str | None, root: int) -> str:
        return control.broadcast_text(text, root, plane=self)

    def all_gather_text(self, text: str, name: str) -> list[str]:
        return control.all_gather_text(text, name, plane=self)

    def all_gather(self, tensor, name) -> list:
        """Every member's ``tensor``, in the plane's rank order (its ``all_gather_async``, waited for)."""
        return self.all_gather_async(tensor, name).wait()


class _Everyone(_Plane):
    """Every rank of the job: the runtime's own control plane and channels, as before process sets."""

    everyone = True
    horovod_set = None  # Horovod's operations run on its global set

    @property
    def rank(self) -> int:
        return runtime.rank()

    @property
    def size(self) -> int:
        return runtime.size()

    @property
    def ranks(self) -> list:
        return list(range(runtime.size()))

    def all_gather_async(self, tensor, name):
        return control.all_gather_async(tensor, name)

    def broadcast_(self, tensor, root, name):
        control.broadcast_(tensor, root, name)

    def control_device(self):
        return control.control_device()

    def collective_group(self):
        """The group the collectives run on (None: torch.distributed's default group)."""
        return control.control_group()

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
    """Some of the ranks (Note [Process sets]): a control group and channels of ours over them, on ``store``, for
    an optimizer (``purpose`` "optimizer") or for the collectives' ``process_set=`` ("collectives"). Its blocks
    may go on Horovod's operations on ``horovod_set`` instead (Horovod's set object, else None)."""

    everyone = False

    def __init__(self, ranks: list, store, timeout_s: float, purpose: str = "optimizer", horovod_set=None):
        self.ranks, self.size = ranks, len(ranks)
        self.rank = ranks.index(runtime.rank())
        self.timeout_s = float(timeout_s)
        self.horovod_set = horovod_set
        self._store = store
        self._made = 0
        self.count = _meet(store, ranks, runtime.rank(), self.timeout_s, purpose)
        """The optimizers (or collective planes) this rank made on the set before this one: the same on every
        member, so that names derived from it meet."""
        infix = "" if purpose == "optimizer" else f"{purpose}/"
        self._tag = f"set/{','.join(map(str, ranks))}/{infix}{self.count}"
        self._control = self._group("control") if self.size > 1 else None

    def __repr__(self) -> str:
        return f"<process set {self.ranks}, this rank {self.rank} of them>"

    def _group(self, name: str):
        try:
            return groups.private_group(self._store, f"{self._tag}/{name}", self.rank, self.size, self.timeout_s)
        except RuntimeError as e:
            raise at_rank(e, f"connecting process set {self.ranks}'s group {name!r}") from e

    def all_gather_async(self, tensor, name):
        if self.size == 1:
            return control.Gathering.done([tensor.clone()])
        return control.torch_all_gather_async(tensor, self._control_group(), self.size,
                                              f"process set {self.ranks}, control-plane all_gather {name!r}")

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

    def collective_group(self):
        return self._control_group()

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


class _HorovodSet:
    """Horovod's process set, for the collectives' ``process_set=`` in a Horovod job: Horovod's own operations on
    it, so nothing of ours is connected."""

    everyone = False

    def __init__(self, ranks: list, horovod_set):
        self.ranks, self.size = ranks, len(ranks)
        self.rank = ranks.index(runtime.rank())
        self.horovod_set = horovod_set

    def __repr__(self) -> str:
        return f"<Horovod's process set {self.ranks}, this rank {self.rank} of them>"

    def close(self) -> None:
        """Nothing of ours: the set is Horovod's."""


def _mpi_tag(tag: str) -> int:
    """A tag for ``Create_group``, the same on every member (from the set and its count), within MPI's bounds."""
    import zlib

    return zlib.crc32(tag.encode()) % 32768


_BUILT = "dcredit_opt/sets/built/{}/{}/{}"
_ARRIVED = "dcredit_opt/sets/arrived/{}/{}/{}"
_BUILDING = "dcredit_opt/sets/building/{}"
_WHAT = {"optimizer": "a DistributedOptimizer", "collectives": "the set's first collective"}


def _meet(store, ranks: list, me: int, timeout_s: float, purpose: str = "optimizer") -> int:
    """Join the set's other members in ``store`` (Note [Process sets]): the count of optimizers (``purpose``
    "optimizer") or collective planes ("collectives") this rank made on the set before, the same on every member;
    a ``MismatchError`` or ``CollectiveTimeout`` instead of a hang."""
    if len(ranks) == 1:
        return 0
    key = ",".join(map(str, ranks))
    building = _BUILDING.format(me)
    built = _BUILT.format(purpose, key, me)
    try:
        k = store.add(built, 1) - 1
        store.set(building, json.dumps([ranks, k, purpose]))
        arrived = _ARRIVED.format(purpose, key, k)
        store.add(arrived, 1)
        deadline = time.monotonic() + timeout_s
        delay = 1e-3
        try:
            while store.add(arrived, 0) < len(ranks):
                _check_peers(store, ranks, k, me, purpose)
                if time.monotonic() > deadline:
                    _late(store, ranks, me, timeout_s, purpose)
                time.sleep(delay)
                delay = min(2 * delay, 0.05)
        except BaseException as e:
            # Not built: counted out again, so that the ranks' counts still agree if the script goes on. After a
            # mismatch the word stays: the peer it disagrees with learns of it too, at once.
            store.add(arrived, -1)
            store.add(built, -1)
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


def _check_peers(store, ranks: list, k: int, me: int, purpose: str) -> None:
    """A ``MismatchError`` if a member waits for another set holding both of us, for another count of this one,
    or for the other purpose on it: the two of us would each wait for the other forever."""
    for peer in ranks:
        other = _building(store, peer) if peer != me else None
        if other is None or me not in other[0] or peer not in other[0] or other == [ranks, k, purpose]:
            continue
        mine, theirs = _WHAT[purpose], _WHAT.get(other[2], other[2])
        if other[0] == ranks and other[2] == purpose:
            raise MismatchError(
                f"rank {me} makes {mine} number {k} on process_set {ranks}, while rank {peer} makes its number "
                f"{other[1]} on that set: every rank of a set must build the same optimizers, and call the same "
                "collectives, on it, in the same order")
        if other[0] == ranks:
            raise MismatchError(
                f"rank {me} makes {mine} on process_set {ranks}, while rank {peer} makes {theirs} on that set: "
                "every rank of a set must build its optimizers and call its collectives on it in the same order")
        raise MismatchError(
            f"rank {me} makes {mine} on process_set {ranks}, while rank {peer} makes {theirs} on process_set "
            f"{other[0]}: the ranks of a set must pass the same set, and use shared sets in the same order")


def _late(store, ranks: list, me: int, timeout_s: float, purpose: str) -> None:
    """The ``CollectiveTimeout`` for members that did not arrive within ``timeout_s``."""
    late = [p for p in ranks if p != me and (_building(store, p) or [None])[0] != ranks]
    now = "; ".join(f"rank {p} is {'making ' + _WHAT.get(b[2], b[2]) + ' on ' + str(b[0]) if b else 'not at it'}"
                    for p, b in ((p, _building(store, p)) for p in late))
    raise CollectiveTimeout(
        f"rank {me}: the other ranks of process_set {ranks} did not come to make {_WHAT[purpose]} within "
        f"{timeout_s:g} s ({now or 'they were late'}): every rank of a set must build its optimizers and call its "
        "collectives on it, with the same set, in the same order (Config.timeout_s)")


def _building(store, rank: int):
    """What ``rank`` waits to make now, ``[ranks, k, purpose]``, or None. The key, once set, is never deleted."""
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

