"""The C++ credit scheduler, single process, through ``_C.Engine.manual``.

A manual engine holds every launch until the test completes it, so the
tests decide the completion order and the arrival order of gradients, and
read the launches back with ``pending()`` and ``history()``. The expected
launch sequence comes from a reference model written here from the notes in
``dcredit_opt/planner/plan.py`` (Note [Same order on every rank],
Note [Credit window]) and Note [Group window] in ``planner/simulate.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import random
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcredit_opt import _ext
from dcredit_opt.optimizer.layout import build_layout
from dcredit_opt.planner.profile import bytes_of
from dcredit_opt.planner.simulate import simulate
from tests import timing
from tests.unit.planner import strategies as planner_strategies

C = _ext.load()
ALL = C.RELEASE_ALL

# Blocks sit in flight for as long as a test likes; this is the scheduler's
# own collective timeout, far above any step here.
LONG_S = 60.0
# How long the engine may take to make a launch the model predicts. Its
# dispatch thread launches within microseconds of a wake; this only has to
# cover a loaded machine. Kept short because a wrong launch count shows up as
# a wait this long, repeated for every example hypothesis tries while
# shrinking (pytest-timeout's signal is one more failing example to it).
SYNC_S = timing.scaled(3.0)
# Hypothesis runs many engines per test; no per-example deadline, since the
# dispatch thread's wake-ups make an example's time vary.
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclasses.dataclass(frozen=True)
class Spec:
    """A scheduler plan in the engine's own terms (one segment, 1-byte elements)."""

    order: tuple[int, ...]
    block_tensors: tuple[tuple[int, ...], ...]
    block_bytes: tuple[int, ...]
    block_priority: tuple[int, ...]
    phase1: tuple[int, ...]
    phase2: tuple[int, ...] = (1,)
    credit_bytes: int = 0
    channels: int = 1

    @property
    def num_tensors(self) -> int:
        return len(self.order)

    @property
    def num_blocks(self) -> int:
        return len(self.block_bytes)


def one_block_each(sizes, priorities, phase1, **kw) -> Spec:
    """Tensor t is block t, ready order 0..T-1."""
    T = len(sizes)
    return Spec(tuple(range(T)), tuple((t,) for t in range(T)), tuple(sizes), tuple(priorities), tuple(phase1), **kw)


def install(engine, spec: Spec) -> None:
    offsets = list(itertools.accumulate(spec.block_bytes, initial=0))[:-1]
    engine.set_plan(spec.num_tensors, list(spec.order), [0] * spec.num_blocks, offsets, list(spec.block_bytes),
                    list(spec.block_bytes), list(spec.block_priority), [list(t) for t in spec.block_tensors],
                    list(spec.phase1), list(spec.phase2), spec.credit_bytes, spec.channels, [], 1.0)


@contextlib.contextmanager
def manual_engine(spec: Spec | None = None, timeout_s: float = LONG_S):
    engine = C.Engine.manual(timeout_s)
    try:
        if spec is not None:
            install(engine, spec)
        yield engine
    finally:
        engine.shutdown()  # joins the dispatch thread even when a test fails


# ---- the reference model ------------------------------------------------


@dataclasses.dataclass
class Expected:
    sequence: list[int]
    """Block ids in launch order: a function of the plan alone."""
    position: list[int]
    """Per block: its launch number."""
    window: list[int]
    group: list[int]
    released_after: list[int]
    """``released_after[k]``: length of the sequence released once events 0..k-1 are processed."""


def reference(spec: Spec) -> Expected:
    T, B = spec.num_tensors, spec.num_blocks
    covering = [[] for _ in range(T)]
    for b, tensors in enumerate(spec.block_tensors):
        for t in tensors:
            covering[t].append(b)
    missing = [len(tensors) for tensors in spec.block_tensors]
    heap: list[tuple[int, int]] = []  # ready blocks: (priority, id), best first
    out = Expected([], [-1] * B, [0] * B, [-1] * B, [0])
    groups = itertools.count()

    def release(requested: int) -> None:
        take = len(heap) if requested == ALL else min(requested, len(heap))
        if take == 0:
            return
        window = take if requested == ALL else requested  # Note [Group window]
        group = next(groups)
        for _ in range(take):
            _, b = heapq.heappop(heap)
            out.position[b], out.window[b], out.group[b] = len(out.sequence), window, group
            out.sequence.append(b)

    # Events strictly in plan order, whatever order they arrive in.
    for i, t in enumerate(spec.order):
        for b in covering[t]:
            missing[b] -= 1
            if missing[b] == 0:
                heapq.heappush(heap, (spec.block_priority[b], b))
        release(spec.phase1[i])
        out.released_after.append(len(out.sequence))
    # The flush: the rest in groups of phase2[0], phase2[1], ..., the last repeating.
    for g in itertools.count():
        if not heap:
            break
        release(spec.phase2[min(g, len(spec.phase2) - 1)])
    assert sorted(out.sequence) == list(range(B))
    return out


class Launches:
    """Which blocks are in flight, given the completions so far: the head of
    the released sequence launches while fewer than its window are in flight
    and its bytes fit the credit (or it goes alone)."""

    def __init__(self, spec: Spec, expected: Expected) -> None:
        self.spec, self.expected = spec, expected
        self.released = self.launched = self.bytes = 0
        self.in_flight: list[int] = []  # launch order

    def release_up_to(self, n: int) -> None:
        self.released = max(self.released, n)
        self._advance()

    def complete(self, b: int) -> None:
        self.in_flight.remove(b)
        self.bytes -= self.spec.block_bytes[b]
        self._advance()

    def _advance(self) -> None:
        while self.launched < self.released:
            b = self.expected.sequence[self.launched]
            size = self.spec.block_bytes[b]
            if len(self.in_flight) >= self.expected.window[b]:
                return
            if self.spec.credit_bytes and self.in_flight and self.bytes + size > self.spec.credit_bytes:
                return
            self.in_flight.append(b)
            self.bytes += size
            self.launched += 1


def check_in_flight(spec: Spec, expected: Expected, pending) -> None:
    """One snapshot of ``pending()`` (launch order). Between two completions
    the set only grows, so a snapshot taken after every completion shows each
    block behind exactly the blocks that were in flight when it launched."""
    ahead = 0
    for i, (b, channel) in enumerate(pending):
        assert channel == expected.position[b] % spec.channels, f"block {b} on channel {channel}"
        assert i < expected.window[b], f"block {b} launched with {i} in flight, window {expected.window[b]}"
        if spec.credit_bytes and i:
            assert ahead + spec.block_bytes[b] <= spec.credit_bytes, (
                f"block {b} ({spec.block_bytes[b]} bytes) launched behind {ahead} bytes, credit {spec.credit_bytes}")
        ahead += spec.block_bytes[b]


def sync(engine, spec: Spec, expected: Expected, want: list[int]) -> None:
    """Wait until the engine has launched exactly ``want`` (it launches from
    its own thread), checking every snapshot on the way."""
    deadline = time.monotonic() + SYNC_S
    while True:
        pending = engine.pending()
        check_in_flight(spec, expected, pending)
        blocks = [b for b, _ in pending]
        early = set(blocks) - set(want)
        assert not early, f"blocks {sorted(early)} launched; the model has in flight {want}"
        if blocks == want:
            return
        assert time.monotonic() < deadline, f"in flight {blocks}, the model has {want}"
        time.sleep(0.0002)


def drive(engine, spec: Spec, expected: Expected, arrivals, pick) -> list[tuple[int, int]]:
    """One iteration: gradients in ``arrivals`` become ready in that order
    (the flush supplies the others), interleaved with completions, as
    ``pick(n) -> 0..n-1`` chooses. Returns this iteration's launches."""
    base = len(engine.history())
    engine.start_iteration()
    model = Launches(spec, expected)
    arrived: set[int] = set()
    processed = next_arrival = 0
    flushed = False
    while True:
        sync(engine, spec, expected, model.in_flight)
        options = []
        if next_arrival < len(arrivals):
            options.append("arrive")
        if model.in_flight:
            options.append("complete")
        if next_arrival == len(arrivals) and not flushed:
            options.append("flush")
        if not options:
            break
        action = options[pick(len(options))]
        if action == "arrive":
            t = arrivals[next_arrival]
            next_arrival += 1
            engine.mark_ready(t)
            arrived.add(t)
            while processed < spec.num_tensors and spec.order[processed] in arrived:
                processed += 1
            # Releases happen inside mark_ready; an early event released nothing.
            released = {tr[0] for tr in engine.trace() if tr[3] >= 0}
            assert released == set(expected.sequence[:expected.released_after[processed]])
            model.release_up_to(expected.released_after[processed])
        elif action == "complete":
            b = model.in_flight[pick(len(model.in_flight))]
            assert engine.complete(b)
            model.complete(b)
        else:
            engine.flush()
            flushed = True
            model.release_up_to(spec.num_blocks)
    assert model.launched == spec.num_blocks
    engine.wait_all(10.0)
    for b, channel, window, group, seq, _release, launch_ns, end_ns in engine.trace():
        assert (seq, channel) == (expected.position[b], expected.position[b] % spec.channels)
        assert (window, group) == (expected.window[b], expected.group[b])
        assert 0 < launch_ns <= end_ns
    return engine.history()[base:]


# ---- strategies -----------------------------------------------------------


@st.composite
def specs(draw, max_tensors: int = 6, max_pieces: int = 4) -> Spec:
    """Random plans: sizes, priorities with ties, windows ALL / 0 / counts,
    phase-2 sizes, a credit (sometimes below one block), channels, and merges
    of one-block neighbours in ``order``; block ids in layout order."""
    T = draw(st.integers(1, max_tensors))
    order = tuple(draw(st.permutations(range(T))))
    priority = draw(st.lists(st.integers(0, 3), min_size=T, max_size=T))
    pieces = draw(st.lists(st.integers(1, max_pieces), min_size=T, max_size=T))
    joins = draw(st.lists(st.booleans(), min_size=T, max_size=T))
    block_tensors: list[tuple[int, ...]] = []
    for i, t in enumerate(order):
        prev = order[i - 1] if i else None
        if (joins[i] and prev is not None and pieces[t] == 1 and pieces[prev] == 1
                and block_tensors[-1][-1] == prev):
            block_tensors[-1] = block_tensors[-1] + (t,)  # merge into the previous block
        else:
            block_tensors.extend([(t,)] * pieces[t])
    sizes = draw(st.lists(st.integers(1, 1000), min_size=len(block_tensors), max_size=len(block_tensors)))
    return Spec(
        order=order,
        block_tensors=tuple(block_tensors),
        block_bytes=tuple(sizes),
        block_priority=tuple(min(priority[t] for t in ts) for ts in block_tensors),
        phase1=tuple(draw(st.lists(st.sampled_from([ALL, 0]) | st.integers(1, 4), min_size=T, max_size=T))),
        phase2=tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))),
        credit_bytes=draw(st.just(0) | st.integers(1, 3000)),
        channels=draw(st.integers(1, 4)),
    )


def arrivals_of(data, spec: Spec) -> list[int]:
    """A random arrival order of a random subset of the gradients."""
    perm = data.draw(st.permutations(range(spec.num_tensors)), label="arrivals")
    return perm[:data.draw(st.integers(0, spec.num_tensors), label="arriving")] if data.draw(st.booleans()) else perm


def picker(data):
    return lambda n: data.draw(st.integers(0, n - 1)) if n > 1 else 0


def thread_safe_picker(data):
    """``picker`` for a choice among what another thread has done so far (an engine's pending launches): that
    count depends on when the thread ran, and Hypothesis replays an example's draws expecting the same draws, so
    every call makes one draw of the same range, reduced modulo ``n``."""
    return lambda n: data.draw(st.integers(0, 1 << 16)) % n


# ---- properties -------------------------------------------------------------


@pytest.mark.timeout(60)
@PROPERTY
@given(spec=specs(), data=st.data())
def test_launches_follow_the_reference_model(spec, data):
    expected = reference(spec)
    with manual_engine(spec) as engine:
        history = drive(engine, spec, expected, arrivals_of(data, spec), picker(data))
    assert [b for b, _ in history] == expected.sequence
    assert sorted(b for b, _ in history) == list(range(spec.num_blocks))  # each block exactly once
    assert [c for _, c in history] == [i % spec.channels for i in range(spec.num_blocks)]


@pytest.mark.timeout(60)
@PROPERTY
@given(spec=specs(), data=st.data())
def test_same_sequence_for_any_arrival_and_completion_order(spec, data):
    # Three iterations of one engine, three orders: one launch sequence
    # (Note [Same order on every rank]).
    expected = reference(spec)
    with manual_engine(spec) as engine:
        runs = [drive(engine, spec, expected, arrivals_of(data, spec), picker(data)) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


@pytest.mark.timeout(60)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(max_tensors=10), seed=st.integers(0, 2**32 - 1))
def test_same_sequence_under_real_concurrency(spec, seed):
    # Marks from this thread with random pauses, completions from another
    # thread in random order and at random times: the timing changes, the
    # sequence does not.
    expected = reference(spec)
    rng = random.Random(seed)
    with manual_engine(spec) as engine:
        engine.start_iteration()
        stop = threading.Event()
        failures: list[BaseException] = []

        def complete_randomly() -> None:
            r = random.Random(seed + 1)
            try:
                while not stop.is_set():
                    pending = engine.pending()
                    check_in_flight(spec, expected, pending)  # sound: we are the only completer
                    if pending:
                        engine.complete(r.choice(pending)[0])
                    time.sleep(r.choice([0, 0, 1e-4, 1e-3]))
            except (AssertionError, RuntimeError) as e:  # reported by the main thread
                failures.append(e)

        completer = threading.Thread(target=complete_randomly)
        completer.start()
        try:
            for t in rng.sample(range(spec.num_tensors), spec.num_tensors):
                engine.mark_ready(t)
                time.sleep(rng.choice([0, 1e-4, 1e-3]))
            engine.flush()
            engine.wait_all(20.0)
        finally:
            stop.set()
            completer.join()
        assert not failures, failures[0]
        assert [b for b, _ in engine.history()] == expected.sequence


# ---- the rules, one at a time -------------------------------------------------


def complete_in_order(engine, blocks, timeout_s: float = 10.0, ok: bool = True, message: str = "") -> None:
    """Complete ``blocks`` one by one, each as soon as it has launched (failed with ``message`` unless ``ok``)."""
    for b in blocks:
        deadline = time.monotonic() + timeout_s
        while not engine.complete(b, ok, message):
            assert time.monotonic() < deadline, f"block {b} never launched; in flight {engine.pending()}"
            time.sleep(0.0002)


@pytest.mark.timeout(60)
def test_priority_order_among_blocks_released_together():
    # Events 0-2 hold (window 0), event 3 releases all four: by priority, ties by id.
    spec = one_block_each([1, 1, 1, 1], [2, 0, 1, 0], [0, 0, 0, ALL])
    with manual_engine(spec) as engine:
        engine.start_iteration()
        for t in range(4):
            engine.mark_ready(t)
        complete_in_order(engine, [1, 3, 2, 0])
        engine.wait_all(10.0)
        assert [b for b, _ in engine.history()] == [1, 3, 2, 0]
        assert {tr[3] for tr in engine.trace()} == {0}  # one group


@pytest.mark.parametrize("first_window", [0, 1])
@pytest.mark.timeout(60)
def test_later_higher_priority_tensor_overtakes_held_blocks(first_window):
    # Tensor 0 (priority 1) has blocks 0-2; event 0 holds all of them (window
    # 0) or releases one. Tensor 1's block 3 (priority 0) comes next and goes
    # before the held ones.
    spec = Spec(order=(0, 1), block_tensors=((0,), (0,), (0,), (1,)), block_bytes=(8, 8, 8, 8),
                block_priority=(1, 1, 1, 0), phase1=(first_window, 1), phase2=(1,))
    with manual_engine(spec) as engine:
        history = drive(engine, spec, reference(spec), [0, 1], lambda n: 0)
    assert [b for b, _ in history] == ([3, 0, 1, 2] if first_window == 0 else [0, 3, 1, 2])


@pytest.mark.timeout(60)
def test_early_event_waits_for_its_turn():
    spec = one_block_each([1, 1, 1], [0, 1, 2], [ALL, ALL, ALL])
    with manual_engine(spec) as engine:
        engine.start_iteration()
        engine.mark_ready(2)  # expected last
        engine.mark_ready(1)
        assert all(tr[3] == -1 for tr in engine.trace()), "an early event released blocks"
        time.sleep(0.02)
        assert engine.pending() == []
        engine.mark_ready(0)  # events 0, 1, 2 now processed in plan order
        assert [tr[3] for tr in engine.trace()] == [0, 1, 2]
        complete_in_order(engine, [0, 1, 2])
        engine.wait_all(10.0)
        assert [b for b, _ in engine.history()] == [0, 1, 2]


@pytest.mark.timeout(60)
def test_window_bounds_blocks_in_flight():
    spec = Spec(order=(0,), block_tensors=((0,),) * 7, block_bytes=(4,) * 7, block_priority=(0,) * 7,
                phase1=(2,), phase2=(3, 1))
    expected = reference(spec)
    assert expected.window == [2, 2, 3, 3, 3, 1, 1]
    with manual_engine(spec) as engine:
        engine.start_iteration()
        engine.mark_ready(0)
        sync(engine, spec, expected, [0, 1])
        engine.flush()  # releases 2-4 (window 3), then 5 and 6 (window 1 each)
        sync(engine, spec, expected, [0, 1, 2])
        for done, want in [(0, [1, 2, 3]), (1, [2, 3, 4]), (2, [3, 4]), (3, [4]), (4, [5]), (5, [6])]:
            assert engine.complete(done)
            sync(engine, spec, expected, want)
        complete_in_order(engine, [6])
        engine.wait_all(10.0)


@pytest.mark.timeout(60)
def test_credit_bytes_let_an_oversized_block_go_only_alone():
    spec = Spec(order=(0,), block_tensors=((0,),) * 5, block_bytes=(60, 60, 30, 250, 10), block_priority=(0,) * 5,
                phase1=(ALL,), credit_bytes=100)
    expected = reference(spec)
    with manual_engine(spec) as engine:
        engine.start_iteration()
        engine.mark_ready(0)
        sync(engine, spec, expected, [0])  # 60 + 60 > 100
        for done, want in [(0, [1, 2]), (1, [2]), (2, [3]), (3, [4])]:
            assert engine.complete(done)  # 250 waits for an empty pipe, then overdraws alone
            sync(engine, spec, expected, want)
        complete_in_order(engine, [4])
        engine.wait_all(10.0)


@pytest.mark.timeout(60)
def test_channel_is_launch_index_mod_channels():
    spec = dataclasses.replace(one_block_each([1] * 7, [0] * 7, [ALL] * 7), channels=3)
    with manual_engine(spec) as engine:
        for _ in range(2):  # the launch index restarts every iteration
            history = drive(engine, spec, reference(spec), list(range(7)), lambda n: n - 1)
            assert [c for _, c in history] == [0, 1, 2, 0, 1, 2, 0]


# ---- failures -------------------------------------------------------------


TWO_TENSORS = one_block_each([4, 4], [0, 1], [ALL, ALL])


@pytest.mark.timeout(60)
def test_failed_completion_names_the_block_and_its_tensors():
    spec = Spec(order=(0, 1, 2), block_tensors=((0,), (1, 2)), block_bytes=(16, 32), block_priority=(0, 1),
                phase1=(ALL, ALL, ALL))
    with manual_engine(spec) as engine:
        engine.start_iteration()
        engine.flush()
        complete_in_order(engine, [0])
        complete_in_order(engine, [1], ok=False, message="boom")
        with pytest.raises(C.SchedulerError, match=r"block 1 \(tensors 1,2.*boom"):
            engine.wait_all(10.0)
        with pytest.raises(C.SchedulerError, match="boom"):
            engine.wait_tensor(2, 10.0)
        assert "boom" in engine.error()
        with pytest.raises(C.SchedulerError, match="boom"):  # sticky
            engine.start_iteration()


@pytest.mark.timeout(60)
def test_timeout_names_the_block_that_hung():
    with manual_engine(TWO_TENSORS, timeout_s=0.05) as engine:
        engine.start_iteration()
        engine.flush()
        complete_in_order(engine, [0])  # block 1 launches and is never completed
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"block 1 \(tensors 1\b"):
            engine.wait_all(30.0)
        assert time.monotonic() - start < 10, "the engine's 0.05 s timeout, not the wait's 30 s"


@pytest.mark.timeout(60)
def test_shutdown_with_pending_blocks_fails_the_waits():
    caught: list[BaseException] = []

    def wait(call) -> None:
        try:
            call()
        except RuntimeError as e:  # anything else fails the count below
            caught.append(e)

    with manual_engine(TWO_TENSORS) as engine:
        engine.start_iteration()
        engine.flush()
        sync(engine, TWO_TENSORS, reference(TWO_TENSORS), [0])  # block 1 waits behind block 0
        # Daemon threads: a regression that hangs them must not hang pytest's exit.
        waiters = [threading.Thread(target=wait, args=(lambda: engine.wait_all(LONG_S),), daemon=True),
                   threading.Thread(target=wait, args=(lambda: engine.wait_tensor(1, LONG_S),), daemon=True)]
        for w in waiters:
            w.start()
        time.sleep(0.05)  # let them block
        start = time.monotonic()
        engine.shutdown()
        for w in waiters:
            w.join(timeout=10)
        assert time.monotonic() - start < 10 and not any(w.is_alive() for w in waiters)
        assert len(caught) == 2
        for e in caught:
            assert isinstance(e, C.SchedulerError) and isinstance(e, RuntimeError) and not isinstance(e, TimeoutError)
            assert "shut down" in str(e)
        with pytest.raises(C.SchedulerError, match="shut down"):
            engine.wait_all(1.0)
        with pytest.raises(C.SchedulerError, match="shut down"):
            engine.start_iteration()
        engine.shutdown()  # idempotent
        assert engine.complete(0)  # a collective that ends after the shutdown


@pytest.mark.timeout(60)
def test_wait_released_finishes_what_an_interrupted_backward_released():
    """Note [Interrupted backward]: a backward stopped before its flush leaves the blocks it released in flight;
    ``wait_released`` waits for them (launched one at a time here) and not for the block never released."""
    spec = one_block_each([4, 4, 4], [0, 1, 2], [1, 1, 1])
    with manual_engine(spec) as engine:
        engine.wait_released(1.0)  # no iteration yet: nothing in flight
        engine.start_iteration()
        engine.mark_ready(1)  # before its turn: buffered, nothing released
        engine.wait_released(1.0)
        engine.mark_ready(0)  # blocks 0 and 1 released, block 1 queued behind block 0; tensor 2 never comes
        with pytest.raises(TimeoutError, match=r"released blocks .*1 queued, 1 in flight.*block 0 \(tensors 0\b"):
            engine.wait_released(0.2)
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (engine.wait_released(LONG_S), done.set()), daemon=True)
        waiter.start()
        complete_in_order(engine, [0])
        assert not done.wait(0.1), "returned with block 1 still to launch"
        complete_in_order(engine, [1])
        assert done.wait(10), "block 1 is done, but wait_released still waits"
        assert not engine.tensor_done(2) and engine.pending() == [] and [b for b, _ in engine.history()] == [0, 1]
        with pytest.raises(TimeoutError, match="iteration not reduced"):
            engine.wait_all(0.2)  # the unreleased block is what a wait for everything would wait on
        engine.shutdown()
        engine.wait_released(1.0)  # nothing in flight: returns even after the shutdown


@pytest.mark.timeout(60)
def test_misuse_raises():
    with manual_engine(TWO_TENSORS) as engine:
        with pytest.raises(RuntimeError, match="before StartIteration"):
            engine.mark_ready(0)
        engine.start_iteration()
        engine.mark_ready(0)
        with pytest.raises(RuntimeError, match="tensor 0 marked ready twice"):
            engine.mark_ready(0)
        with pytest.raises(IndexError, match="tensor 2"):
            engine.mark_ready(2)
        with pytest.raises(RuntimeError, match="pending"):
            engine.start_iteration()
        engine.flush()
        engine.flush()  # idempotent
        complete_in_order(engine, [0, 1])
        engine.wait_all(10.0)
        engine.start_iteration()  # fine once everything is done
        assert engine.error() is None


@pytest.mark.parametrize(("field", "change"), [
    ("order", {"order": [0, 0]}),
    ("phase1_windows", {"phase1_windows": [ALL]}),
    ("phase1_windows", {"phase1_windows": [-2, ALL]}),
    ("phase2_windows", {"phase2_windows": []}),
    ("phase2_windows", {"phase2_windows": [0]}),
    ("credit_bytes", {"credit_bytes": -1}),
    ("channels", {"channels": 0}),
    ("block 1", {"numels": [4, 0]}),
    ("block 0 covers no tensor", {"block_tensors": [[], [1]]}),
    ("block 1 covers a tensor out of range", {"block_tensors": [[0], [2]]}),
])
@pytest.mark.timeout(60)
def test_set_plan_rejects_a_bad_field_by_name(field, change):
    args = {"num_tensors": 2, "order": [0, 1], "segments": [0, 0], "offsets": [0, 4], "numels": [4, 4],
            "bytes": [4, 4], "priorities": [0, 1], "block_tensors": [[0], [1]], "phase1_windows": [ALL, ALL],
            "phase2_windows": [1], "credit_bytes": 0, "channels": 1, "buffers": [], "postscale": 1.0}
    with manual_engine() as engine:
        engine.set_plan(**args)
        with pytest.raises(ValueError, match=field):
            engine.set_plan(**{**args, **change})


# ---- the simulator's replay is the engine's ------------------------------------


@pytest.mark.timeout(120)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pp=planner_strategies.profile_and_plan(), data=st.data())
def test_engine_launches_what_the_simulator_replays(pp, data):
    """``plan.stages_of`` is the one layout of the runtime and the simulator (Note [Two-stage blocks]): for any
    plan, decoupled tensors included, the engine launches the simulator's sequence, on its channels, in its
    groups and windows, whatever the arrival and completion orders."""
    profile, plan = pp
    layout = build_layout(plan, list(profile.dtypes), [bytes_of(d) for d in profile.dtypes])
    expected = simulate(plan, profile)
    pick = thread_safe_picker(data)
    with manual_engine() as engine:
        engine.set_plan(plan.num_tensors, list(plan.order), list(layout.block_segment), list(layout.block_offset),
                        list(layout.block_numel), list(layout.block_bytes), list(layout.block_priority),
                        [list(t) for t in layout.block_tensors],
                        list(plan.phase1_windows or [ALL] * plan.num_tensors), list(plan.phase2_windows),
                        plan.credit_bytes, plan.channels, [], 1.0, block_ops=list(layout.block_op),
                        block_after=list(layout.block_after), block_at_flush=list(layout.block_at_flush))
        engine.start_iteration()
        for t in data.draw(st.permutations(range(plan.num_tensors)), label="arrivals"):
            engine.mark_ready(t)
        engine.flush()
        deadline = time.monotonic() + SYNC_S
        while len(engine.history()) < layout.num_blocks or engine.pending():
            pending = engine.pending()
            if pending:
                assert engine.complete(pending[pick(len(pending))][0])
                deadline = time.monotonic() + SYNC_S
            else:
                assert time.monotonic() < deadline, f"launched {engine.history()}, nothing in flight"
                time.sleep(0.0002)
        engine.wait_all(10.0)
        history = engine.history()
        trace = {tr[0]: tr for tr in engine.trace()}
    assert [b for b, _ in history] == list(expected.launch_sequence)
    for b in expected.blocks:
        _, channel, window, group, seq = trace[b.block_id][:5]
        assert (seq, channel, window, group) == (b.launch_index, b.channel, b.window, b.group), b


# ---- Note [Device windows] ---------------------------------------------------


def launched(engine, count: int) -> list[int]:
    """Wait until the engine has made ``count`` launches in all; the blocks, in launch order."""
    deadline = time.monotonic() + SYNC_S
    while len(engine.history()) < count:
        assert time.monotonic() < deadline, f"launched {engine.history()}, waiting for {count} launches"
        time.sleep(0.0002)
    return [b for b, _ in engine.history()]


@pytest.mark.timeout(60)
def test_device_windows_launch_at_once_each_block_behind_the_slots_it_takes():
    """Where the device can keep the window (a launch waits there for earlier blocks' results), the host
    launches every released block at once, in the same sequence, each behind the oldest blocks holding the
    slots it needs: the window holds on the device instead of on the host."""
    spec = Spec(order=(0,), block_tensors=((0,),) * 7, block_bytes=(4,) * 7, block_priority=(0,) * 7,
                phase1=(2,), phase2=(3, 1))
    expected = reference(spec)
    with manual_engine(spec) as engine:
        engine.orders_on_device(True)
        engine.set_device_windows(True)
        for it in range(2):  # the slots are the iteration's own: the second starts as the first did
            base = 7 * it
            engine.start_iteration()
            engine.mark_ready(0)
            assert launched(engine, base + 2)[base:] == [0, 1]  # a window of 2 before the flush, nothing done
            time.sleep(0.05)
            assert len(engine.history()) == base + 2  # nothing releases block 2 before the flush
            engine.flush()
            assert launched(engine, base + 7)[base:] == expected.sequence == [0, 1, 2, 3, 4, 5, 6]
            # Windows 2, 2, 3, 3, 3, 1, 1: block 3 takes block 0's slot, 4 block 1's, 5 (window 1) needs the
            # three slots of 2-4, and 6 the one of 5.
            assert engine.ordered_behind()[base:] == [[], [], [], [0], [1], [2, 3, 4], [5]]
            assert not engine.tensor_done(0)
            complete_in_order(engine, [6, 5, 4, 3, 2, 1, 0])  # the device may finish them in any order
            engine.wait_all(10.0)


@pytest.mark.timeout(60)
def test_device_windows_wait_on_the_host_where_the_backend_cannot_order():
    """A backend that cannot order a launch behind a block (a CPU one, or a block whose result is not yet
    enqueued) keeps the host's window: the launches and their timing are the scheduler's usual ones."""
    spec = Spec(order=(0,), block_tensors=((0,),) * 4, block_bytes=(4,) * 4, block_priority=(0,) * 4,
                phase1=(ALL,), phase2=(1,))
    with manual_engine(spec) as engine:
        engine.set_device_windows(True)  # the manual backend does not order on the device unless told to
        engine.start_iteration()
        engine.mark_ready(0)
        assert launched(engine, 4) == [0, 1, 2, 3]  # a window of ALL: four slots
        engine.flush()
        assert engine.ordered_behind() == [[], [], [], []]
        complete_in_order(engine, [0, 1, 2, 3])
        engine.wait_all(10.0)

    spec = dataclasses.replace(spec, phase1=(1,))
    expected = reference(spec)
    with manual_engine(spec) as engine:
        engine.set_device_windows(True)
        engine.start_iteration()
        engine.mark_ready(0)
        sync(engine, spec, expected, [0])
        engine.flush()
        time.sleep(0.05)
        sync(engine, spec, expected, [0])  # window 1: the host waits for block 0
        for done, want in [(0, [1]), (1, [2]), (2, [3])]:
            assert engine.complete(done)
            sync(engine, spec, expected, want)
        complete_in_order(engine, [3])
        engine.wait_all(10.0)
        assert engine.ordered_behind() == [[], [], [], []]


@pytest.mark.timeout(60)
def test_device_windows_keep_the_sequence_and_only_order_behind_earlier_launches():
    """Random plans, arrivals and completions with device windows: the launch sequence is the reference
    model's (the same on every rank), every launch waits only for blocks launched before it, each block's
    slot is taken over at most once, and every block still completes."""
    rng = random.Random(7)
    for _ in range(25):
        T = rng.randint(1, 6)
        B = rng.randint(1, 8)
        cover = [tuple(sorted(rng.sample(range(T), rng.randint(1, min(2, T))))) for _ in range(B)]
        spec = Spec(order=tuple(rng.sample(range(T), T)), block_tensors=tuple(cover),
                    block_bytes=tuple(rng.randint(1, 9) for _ in range(B)),
                    block_priority=tuple(rng.randint(0, 3) for _ in range(B)),
                    phase1=tuple(rng.choice([0, 1, 2, ALL]) for _ in range(T)),
                    phase2=tuple(rng.randint(1, 3) for _ in range(rng.randint(1, 3))), channels=rng.randint(1, 3))
        expected = reference(spec)
        with manual_engine(spec) as engine:
            engine.orders_on_device(True)
            engine.set_device_windows(True)
            engine.start_iteration()
            for t in rng.sample(range(T), T):
                engine.mark_ready(t)
            engine.flush()
            seq = launched(engine, B)
            assert seq == expected.sequence
            behind = engine.ordered_behind()
            taken = [b for bs in behind for b in bs]
            assert len(taken) == len(set(taken)), f"a slot taken over twice: {behind}"
            for k, bs in enumerate(behind):
                assert all(seq.index(b) < k for b in bs), f"launch {k} ordered behind a later one: {behind}"
            complete_in_order(engine, rng.sample(range(B), B))
            engine.wait_all(10.0)
