"""The pool's parts on a reload, in this process. The pool resized, with stand-in workers
and a fake clock: slots added start their workers; a slot retired releases its sessions
before its worker is asked to stop, is killed if it outlives the timeout, and a slot
added again later goes on counting generations; spares follow `pool.spare`; the rolling
restart leaves the slots it is not given alone. The deliveries, on a real store: a target
whose events changed has its sessions synced again, and the HTTP client of a changed
target is closed only once the attempt it carries ended."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.contract.clock import FakeClock
from supervisor.contract.config import Config
from supervisor.contract.delivery_targets import DeliveryTarget
from supervisor.contract.logs import log
from supervisor.core.slots import Slot, SlotState
from supervisor.http.metrics import Metrics
from supervisor.pool import resizing
from supervisor.pool.courier import Courier
from supervisor.pool.handle import WorkerHandle
from supervisor.pool.poster import Poster
from supervisor.pool.resizing import Resizing
from supervisor.pool.rolling import RollingRestart
from supervisor.store import Store


class Process:
    """A worker process that never runs: it exits when told to."""

    def __init__(self, pid: int) -> None:
        self.pid, self.exitcode = pid, None


class Plane:
    """Records what the pool sends; a worker obeys at once unless it is `stubborn`."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []
        self.stubborn: set[str] = set()

    def send(self, worker: WorkerHandle, type: str, **fields: Any) -> bool:
        self.sent.append((worker.identity, type if type != "release" else fields["session"]))
        if worker.identity in self.stubborn:
            return True
        if type == "release":
            worker.sessions.discard(fields["session"])
        elif type == "stop":
            worker.process.exitcode = 0
        return True


class Housekeeper:
    def stir(self) -> None:
        pass


class Pool(Resizing, RollingRestart):
    def __init__(self, clock: FakeClock, workers: int, spare: int) -> None:
        self.config = Config.model_validate({"pool": {"workers": workers, "spare": spare}})
        self.log = log("pool")
        self.slots = [Slot(i) for i in range(workers + spare)]
        self.held: list[Slot] = []
        self.retired: dict[int, int] = {}
        self.current: dict[int, WorkerHandle] = {}
        self.stopping = False
        self.timer, self.clock = clock, clock.monotonic
        self.plane: Any = Plane()
        self.housekeeper: Any = Housekeeper()
        self.pids = iter(range(10_000, 20_000))
        for slot in self.slots:
            self._spawn(slot, spare=slot.index >= workers)

    def _spawn(self, slot: Slot, spare: bool = True) -> None:
        slot.start(self.clock())
        spares = sum(1 for w in self.current.values() if w.spare and w.alive)
        spare = spare and spares < self.config.pool.spare
        worker = WorkerHandle(slot, slot.identity, Process(next(self.pids)), spare, 0.0)
        worker.ready = True
        slot.ready(self.clock())
        self.current[slot.index] = worker

    def resize(self, workers: int, spare: int) -> None:
        self.config = Config.model_validate({"pool": {"workers": workers, "spare": spare}})


def run(clock: FakeClock, work: Callable[[], Awaitable[Any]], step: float = 0.05) -> Any:
    """Run `work`, moving the fake clock on while it waits."""

    async def go() -> Any:
        task = asyncio.ensure_future(work())
        while not task.done():
            await asyncio.sleep(0)  # the work runs up to its next wait
            await clock.advance(step)
        return task.result()

    return asyncio.run(go())


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


def test_shrinking_releases_the_sessions_before_the_worker_stops() -> None:
    clock = FakeClock()
    pool = Pool(clock, workers=3, spare=0)
    busy = pool.current[2]
    busy.sessions = {"s1", "s2"}
    pool.resize(workers=1, spare=0)
    assert run(clock, pool.shrink) == [1, 2]
    assert [s.index for s in pool.slots] == [0]
    sent = pool.plane.sent  # the highest first; each worker's sessions before its stop
    assert set(sent[:2]) == {("w2.1", "s1"), ("w2.1", "s2")}
    assert sent[2:] == [("w2.1", "stop"), ("w1.1", "stop")]
    assert busy.retiring and busy.stop_requested and not busy.alive
    assert pool.retired == {1: 1, 2: 1}
    pool.resize(workers=2, spare=0)
    assert pool.grow() == [1]
    assert pool.current[1].identity == "w1.2"  # not w1.1 again: names stay unique


def test_a_worker_that_will_not_stop_is_killed_at_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(resizing, "send_signal", lambda pid, signum: killed.append((pid, signum)))
    clock = FakeClock()
    pool = Pool(clock, workers=2, spare=0)
    stubborn = pool.current[1]
    stubborn.sessions = {"held"}
    pool.plane.stubborn.add("w1.1")
    pool.resize(workers=1, spare=0)
    started = clock.monotonic()
    assert run(clock, lambda: pool.shrink(timeout=2.0)) == [1]
    assert killed == [(stubborn.pid, signal.SIGKILL)]
    assert clock.monotonic() - started >= 2.0
    assert [s.index for s in pool.slots] == [0]


def test_a_slot_retired_during_a_stop_or_without_a_worker_just_goes() -> None:
    clock = FakeClock()
    pool = Pool(clock, workers=2, spare=0)
    gone = pool.current.pop(1)
    gone.slot.exited(clock.monotonic(), requested=False)  # crashed: in backoff
    pool.resize(workers=1, spare=0)
    assert run(clock, pool.shrink) == [1]
    assert gone.slot.state is SlotState.STOPPED and [s.index for s in pool.slots] == [0]


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
    run(clock, lambda: pool.rolling_restart(timeout=1.0, only=[0, 2]))
    assert [w.identity for w in pool.current.values()] == ["w0.2", "w1.1", "w2.2"]


HOOK = {"name": "hook", "url": "http://hook.test/in", "secret_env": "TK_TEST_RELOAD_SECRET"}


def test_a_changed_target_s_client_is_closed_once_its_attempt_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TK_TEST_RELOAD_SECRET", "s")

    async def scenario() -> None:
        opened, gate = asyncio.Event(), asyncio.Event()

        async def answer(request: httpx.Request) -> httpx.Response:
            opened.set()
            await gate.wait()
            return httpx.Response(200)

        poster = Poster(httpx.MockTransport(answer))
        target = DeliveryTarget.model_validate(HOOK)
        first = asyncio.create_task(poster.post(target, 4, "d1", b"{}"))
        await opened.wait()
        (old,) = poster._clients.values()
        await poster.retire(["hook"])
        assert not poster._clients and not old.is_closed  # its attempt goes on
        gate.set()
        second = await poster.post(target, 4, "d2", b"{}")  # a client of its own
        assert await first == (200, "") and second == (200, "")
        assert old.is_closed and not next(iter(poster._clients.values())).is_closed
        await poster.aclose()

    asyncio.run(scenario())


def test_sessions_get_what_their_target_sends_after_a_reload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TK_TEST_RELOAD_SECRET", "s")
    both = Config.model_validate({"delivery": {"targets": [HOOK]}})
    notices = Config.model_validate({"delivery": {"targets": [HOOK | {"events": ["notice"]}]}})

    async def scenario(store: Store, session_id: str) -> None:
        courier = Courier(both, store, "host/boot0001", Metrics(), transport=httpx.MockTransport(
            lambda request: httpx.Response(200)
        ))  # fmt: skip
        await courier._pass()
        assert kinds(store, session_id) == "answer notice"
        await courier.reconfigure(notices)
        await courier._pass()
        assert kinds(store, session_id) == "notice"
        await courier.poster.aclose()

    with Store(f"sqlite:///{tmp_path / 'turnkeeper.db'}") as store:
        session_id = store.sessions.create("alice").id
        store.deliveries.bind(session_id, "hook", ["answer", "notice"])
        asyncio.run(scenario(store, session_id))


def kinds(store: Store, session_id: str) -> str:
    cursor = store.db.execute_sql("SELECT deliver_kinds FROM session WHERE id = ?", (session_id,))
    return str(cursor.fetchone()[0])
