"""The pool's parts on a reload, in this process. The pool resized, with stand-in workers
and a fake clock: slots added start their workers; the slots that serve least are
retired first (a FATAL one, one waiting to restart, an idle spare) and the slots that
gave up start again; a slot retired releases its sessions before its worker is asked to
stop, and the worker has `shutdown.kill_grace` to exit after that; a slot added again
later goes on counting generations; spares follow `pool.spare`; the rolling restart
leaves the slots it is not given alone, gives a new worker its own time to be ready, and
stops, the old worker kept, when one cannot start; workers are judged by the heartbeat
interval and hang timeout they were started with."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from supervisor.contract.config import Config
from supervisor.contract.logs import log
from supervisor.core.engine import HEARTBEATS_MISSED, takes_sessions
from supervisor.core.slots import Slot, SlotState, all_fatal
from supervisor.pool import pool as pools
from supervisor.pool.handle import WorkerHandle
from supervisor.pool.processes import check_hangs
from tests.clock import FakeClock


class Process:
    """A worker process that never runs: it exits when told to (or at `exit_at`)."""

    def __init__(self, pid: int, clock: FakeClock) -> None:
        self.pid, self.clock = pid, clock
        self.code: int | None = None
        self.exit_at: float | None = None

    @property
    def exitcode(self) -> int | None:
        if (
            self.code is None
            and self.exit_at is not None
            and self.clock.monotonic() >= self.exit_at
        ):
            self.code = 0
        return self.code


class Plane:
    """Records what the pool sends, and when; a worker obeys at once unless it is
    `stubborn` (it ignores everything), `holding` (its sessions reach no event boundary)
    or `slow` (it exits that many seconds after a stop)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.sent: list[tuple[str, str]] = []
        self.at: dict[tuple[str, str], float] = {}
        self.stubborn: set[str] = set()
        self.holding: set[str] = set()
        self.slow: dict[str, float] = {}

    def send(self, worker: WorkerHandle, type: str, **fields: Any) -> bool:
        what = (worker.identity, type if type != "release" else fields["session"])
        self.sent.append(what)
        self.at[what] = self.clock.monotonic()
        if worker.identity in self.stubborn:
            return True
        if type == "release" and worker.identity not in self.holding:
            worker.sessions.discard(fields["session"])
        elif type == "stop" and worker.identity in self.slow:
            worker.process.exit_at = self.clock.monotonic() + self.slow[worker.identity]
        elif type == "stop":
            worker.process.code = 0
        return True


class Tending:
    def stir(self) -> None:
        pass


class Pool(pools.Pool):
    """The real pool's resizing and rolling restart, over workers that never run: its
    own state is set up here, and `_spawn` makes a stand-in."""

    def __init__(self, clock: FakeClock, workers: int, spare: int) -> None:  # no super()
        self.config = Config.model_validate({"pool": {"workers": workers, "spare": spare}})
        self.log = log("pool")
        self.slots = [Slot(i) for i in range(workers + spare)]
        self.held: list[Slot] = []
        self.retired: dict[int, int] = {}
        self.current: dict[int, WorkerHandle] = {}
        self.workers: dict[str, WorkerHandle] = {}
        self.stopping = False
        self.timer, self.clock = clock, clock.monotonic
        self.plane: Any = Plane(clock)
        self.tending: Any = Tending()
        self.pids = iter(range(10_000, 20_000))
        self.starting: Callable[[WorkerHandle], None] = lambda worker: None  # a test's say
        for slot in self.slots:
            self._spawn(slot, spare=slot.index >= workers)

    def _spawn(self, slot: Slot, spare: bool = True) -> None:
        slot.start(self.clock())
        spares = sum(1 for w in self.current.values() if w.spare and w.alive)
        spare = spare and spares < self.config.pool.spare
        process = Process(next(self.pids), self.timer)  # type: ignore[arg-type]
        worker = WorkerHandle(slot, slot.identity, process, spare, 0.0)
        worker.ready = True
        self.starting(worker)
        if worker.ready:
            slot.ready(self.clock())
        self.current[slot.index] = worker
        self.workers[worker.identity] = worker

    def resize(self, workers: int, spare: int) -> None:
        self.config = Config.model_validate({"pool": {"workers": workers, "spare": spare}})


def run(
    clock: FakeClock,
    work: Callable[[], Awaitable[Any]],
    step: float = 0.05,
    at: dict[float, Callable[[], None]] | None = None,
) -> Any:
    """Run `work`, moving the fake clock on while it waits (and doing what `at` says
    once the clock reaches each time)."""
    due = dict(at or {})

    async def go() -> Any:
        task = asyncio.ensure_future(work())
        while not task.done():
            await asyncio.sleep(0)  # the work runs up to its next wait
            await clock.advance(step)
            for when in [t for t in due if t <= clock.monotonic()]:
                due.pop(when)()
        return task.result()

    return asyncio.run(go())


@pytest.fixture
def signals(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The signals the pool sends (no stand-in's pid is a process's)."""
    sent: list[tuple[int, int]] = []

    def sent_by(pid: int, sig: int) -> None:
        sent.append((pid, sig))

    monkeypatch.setattr(pools, "send_signal", sent_by)
    return sent


def test_growing_adds_slots_and_starts_their_workers() -> None:
    clock = FakeClock()
    pool = Pool(clock, workers=2, spare=0)
    pool.resize(workers=3, spare=1)
    assert pool.grow() == [2, 3]
    assert [s.index for s in pool.slots] == [0, 1, 2, 3]
    assert [w.identity for w in pool.current.values()] == ["w0.1", "w1.1", "w2.1", "w3.1"]
    assert [w.identity for w in pool.current.values() if w.spare] == ["w2.1"]  # a new one
    assert pool.grow() == []  # nothing more to add
    assert run(clock, lambda: pool.settled([2, 3], timeout=1.0)) is True


def test_shrinking_releases_the_sessions_before_the_worker_stops(signals: list[Any]) -> None:
    clock = FakeClock()
    pool = Pool(clock, workers=3, spare=0)
    pool.current[0].sessions = {"a", "b", "c"}
    busy = pool.current[1]
    busy.sessions = {"s1", "s2"}
    pool.resize(workers=1, spare=0)
    assert run(clock, pool.shrink) == [2, 1]  # the idle one first, then the least busy
    assert [s.index for s in pool.slots] == [0]
    sent = pool.plane.sent  # each worker's sessions before its stop
    assert sent[0] == ("w2.1", "stop")
    assert set(sent[1:3]) == {("w1.1", "s1"), ("w1.1", "s2")} and sent[3] == ("w1.1", "stop")
    assert busy.retiring and busy.stop_requested and not busy.alive
    assert pool.retired == {1: 1, 2: 1} and signals == []
    pool.resize(workers=2, spare=0)
    assert pool.grow() == [1]
    assert pool.current[1].identity == "w1.2"  # not w1.1 again: names stay unique


def test_shrinking_retires_a_slot_that_gave_up_before_a_healthy_one() -> None:
    clock = FakeClock()
    pool = Pool(clock, workers=1, spare=1)
    broken = pool.current.pop(0)  # slot 0's worker cannot start: the slot gave up
    broken.slot.state, broken.slot.restart_at = SlotState.FATAL, None
    pool.resize(workers=1, spare=0)
    assert run(clock, pool.shrink) == [0]
    assert [(s.index, s.state) for s in pool.slots] == [(1, SlotState.RUNNING)]
    assert not all_fatal(pool.slots) and pool.current[1].alive  # the daemon goes on


def test_shrinking_prefers_a_slot_waiting_to_restart_then_an_idle_spare() -> None:
    clock = FakeClock()
    pool = Pool(clock, workers=3, spare=1)
    gone = pool.current.pop(0)
    gone.slot.exited(clock.monotonic(), requested=False)  # crashed: in backoff
    for index in (1, 2):
        pool.current[index].sessions = {f"s{index}"}
    assert pool.current[3].spare
    pool.resize(workers=2, spare=0)
    assert run(clock, pool.shrink) == [0, 3]
    assert [s.index for s in pool.slots] == [1, 2]
    assert [w.identity for w in pool.current.values() if w.alive] == ["w1.1", "w2.1"]


def test_a_retired_worker_has_its_own_grace_to_stop_after_its_sessions(
    signals: list[Any],
) -> None:
    clock = FakeClock()
    pool = Pool(clock, workers=2, spare=0)
    grace = pool.config.shutdown.kill_grace
    slow = pool.current[1]
    slow.sessions = {"long-turn"}
    pool.current[0].sessions = {"a", "b"}  # busier: kept
    pool.plane.holding.add("w1.1")  # its turn reaches no event boundary in time
    pool.plane.slow["w1.1"] = grace / 2  # and, asked to stop, takes a while
    pool.resize(workers=1, spare=0)
    assert run(clock, lambda: pool.shrink(timeout=2.0)) == [1]
    assert pool.plane.at["w1.1", "stop"] >= 1_000.0 + 2.0  # asked once the timeout passed
    assert signals == [] and not slow.alive  # it stopped within its grace: no SIGKILL


def test_a_worker_that_will_not_stop_is_killed_after_its_grace(signals: list[Any]) -> None:
    clock = FakeClock()
    pool = Pool(clock, workers=2, spare=0)
    stubborn = pool.current[1]
    stubborn.sessions = {"held"}
    pool.current[0].sessions = {"a", "b"}  # busier: kept
    pool.plane.stubborn.add("w1.1")
    pool.resize(workers=1, spare=0)
    assert run(clock, lambda: pool.shrink(timeout=2.0)) == [1]
    assert signals == [(stubborn.pid, signal.SIGKILL)]
    stop = pool.plane.at["w1.1", "stop"]
    assert clock.monotonic() - stop >= pool.config.shutdown.kill_grace
    assert [s.index for s in pool.slots] == [0]


def test_a_slot_retired_during_a_stop_or_without_a_worker_just_goes() -> None:
    clock = FakeClock()
    pool = Pool(clock, workers=2, spare=0)
    gone = pool.current.pop(1)
    gone.slot.exited(clock.monotonic(), requested=False)  # crashed: in backoff
    pool.resize(workers=1, spare=0)
    assert run(clock, pool.shrink) == [1]
    assert gone.slot.state is SlotState.STOPPED and [s.index for s in pool.slots] == [0]


def test_slots_that_gave_up_start_again_afresh() -> None:
    clock = FakeClock()
    pool = Pool(clock, workers=2, spare=0)
    broken = pool.current.pop(1)
    broken.slot.state, broken.slot.restart_at = SlotState.FATAL, None
    assert pool.revive() == [1]
    assert pool.slots[1] is not broken.slot and pool.slots[1].state is SlotState.RUNNING
    assert pool.current[1].identity == "w1.2" and pool.revive() == []


def test_spares_follow_the_configuration() -> None:
    clock = FakeClock()
    pool = Pool(clock, workers=2, spare=1)
    assert [w.spare for w in pool.current.values()] == [False, False, True]
    pool.resize(workers=3, spare=0)  # as many slots: none added, the spare is a worker now
    assert pool.grow() == []
    assert not any(w.spare for w in pool.current.values())
    pool.current[0].sessions = {"s"}
    pool.resize(workers=1, spare=2)
    pool.settle_spares()
    assert [w.spare for w in pool.current.values()] == [False, True, True]  # the idle ones


def test_the_rolling_restart_replaces_only_the_slots_it_is_given() -> None:
    clock = FakeClock()
    pool = Pool(clock, workers=3, spare=0)
    assert run(clock, lambda: pool.rolling_restart(timeout=1.0, only=[0, 2])) is None
    assert [w.identity for w in pool.current.values()] == ["w0.2", "w1.1", "w2.2"]


def test_a_new_worker_s_readiness_and_the_old_one_s_sessions_have_a_timeout_each(
    signals: list[Any],
) -> None:
    clock = FakeClock()
    pool = Pool(clock, workers=1, spare=0)
    old = pool.current[0]
    old.sessions = {"turn"}
    pool.plane.holding.add("w0.1")  # its turn reaches an event boundary at 1.5 s
    pool.starting = lambda worker: setattr(worker, "ready", False)  # ready at 0.9 s

    def ready() -> None:
        pool.current[0].ready = True

    at = {1_000.0 + 0.9: ready, 1_000.0 + 1.5: old.sessions.clear}
    assert run(clock, lambda: pool.rolling_restart(timeout=1.0), at=at) is None
    assert signals == [] and not old.alive and pool.current[0].identity == "w0.2"
    assert pool.plane.at["w0.1", "stop"] >= 1_000.0 + 1.5  # asked once its turn let go


def test_a_new_worker_that_cannot_start_stops_the_rolling_restart(signals: list[Any]) -> None:
    clock = FakeClock()
    pool = Pool(clock, workers=2, spare=0)
    first, second = pool.current[0], pool.current[1]
    first.sessions = {"s"}

    def broken(worker: WorkerHandle) -> None:  # dies before it is ready
        worker.ready, worker.process.code = False, 1

    pool.starting = broken
    why = run(clock, lambda: pool.rolling_restart(timeout=5.0))
    assert why is not None and "w0.2, replacing w0.1, died before it was ready" in why
    assert pool.current[0] is first and first.sessions == {"s"} and not first.retiring
    assert pool.slots[0] is first.slot and first.slot.state is SlotState.RUNNING
    assert pool.current[1] is second and second.alive  # not tried: the others go on
    assert ("w0.1", "stop") not in pool.plane.sent and signals == []


def test_workers_are_judged_by_the_timing_they_were_started_with() -> None:
    clock = FakeClock()
    pool = Pool(clock, workers=2, spare=0)
    old, kept = pool.current[0], pool.current[1]
    kept.heartbeat_interval = 0.2  # started after a reload to the interval below
    faster = {"pool": {"heartbeat_interval": 0.2, "hang_timeout": 1.0}}
    pool.reconfigure(Config.model_validate(faster))
    assert (old.heartbeat_interval, old.hang_timeout) == (1.0, 5.0)  # until it is replaced
    assert kept.hang_timeout == 1.0  # the new timeout applies to what beats at its interval
    now = 100.0
    old.last_heartbeat = kept.last_heartbeat = now - 2.0  # two of its own intervals
    assert takes_sessions(old.view(0.2), now - HEARTBEATS_MISSED * 0.2)
    assert not takes_sessions(kept.view(0.2), now - HEARTBEATS_MISSED * 0.2)
    check_hangs([old, kept], now)
    assert old.suspected_at is None and kept.suspected_at == now
