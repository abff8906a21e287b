"""Schedules on SQLite, PostgreSQL and MariaDB: their rows and who may read them, fire rows
written once per (schedule, time) even by racing daemons, owed fires, the sessions a fire
makes; and the scheduler itself in-process on a fake clock (two of them on one database,
a boot after a crash between a fire row and its message, catch-up and skip after a stop,
an interrupted scheduled turn ended with a notice)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from supervisor.contract.clock import FakeClock
from supervisor.contract.config import Config
from supervisor.core.schedules import NOT_CONTINUED, idempotency_key
from supervisor.http.metrics import Metrics
from supervisor.pool.scheduler import Scheduler
from supervisor.store import (
    EventRecord,
    ScheduleInfo,
    ScheduleRefused,
    SessionClosed,
    SessionNotFound,
    Store,
)
from supervisor.store import schedules as schedule_rows
from supervisor.store.models import Schedule
from tests.conftest import BACKENDS

pytestmark = pytest.mark.parametrize("db_url", BACKENDS, indirect=True)

W = 1_800_000_000.0  # the fake wall clock's start: an even second
EVERY_2S = "*/2 * * * * *"


def make(store: Store, session: str | None = None, **fields: Any) -> ScheduleInfo:
    values: dict[str, Any] = {
        "cron": EVERY_2S,
        "timezone": "UTC",
        "text": "report",
        "session": session,
        "owner": "alice",
        "misfire": "run_once",
        "limit": 1000,
    }
    values.update(fields)
    return store.schedules.create(**values)


def armed(store: Store, schedule: ScheduleInfo, at: float) -> None:
    """Arm the schedule from `at` on the fake clock (it was made on the real one)."""
    Schedule.update(armed_from=at).where(Schedule.id == schedule.id).execute()


def messages(store: Store, session_id: str) -> list[EventRecord]:
    found = store.events.read(session_id, limit=10_000)
    return [e for e in found if e.type == "user_message"]


# --- rows ---------------------------------------------------------------------------------


def test_schedules_are_made_listed_by_acl_and_deleted_with_their_fires(store: Store) -> None:
    changes: list[int] = []
    store.schedules.on_change.append(lambda: changes.append(1))
    mine = store.sessions.create("alice").id
    on_session = make(store, mine)
    own = make(store, None, misfire="skip")
    assert on_session.id.startswith("s") and len(on_session.id) == 33
    assert (own.session, own.owner, own.misfire) == (None, "alice", "skip")
    assert on_session.armed_from == on_session.created_at and changes == [1, 1]
    assert store.schedules.get(on_session.id) == on_session
    assert [s.id for s in store.schedules.visible()] == [on_session.id, own.id]
    assert [s.id for s in store.schedules.visible("alice")] == [on_session.id, own.id]
    assert store.schedules.visible("bob") == []
    store.acl.grant(mine, "bob", "read")
    assert [s.id for s in store.schedules.visible("bob")] == [on_session.id]  # not alice's own
    store.schedules.record(on_session.id, [(W, "fired", "")], "h/b")
    assert store.schedules.delete(on_session.id) and changes == [1, 1, 1]
    assert not store.schedules.delete(on_session.id) and changes == [1, 1, 1]
    assert store.schedules.get(on_session.id) is None
    assert store.schedules.fires(on_session.id) == []


def test_a_schedule_needs_an_open_session_and_room(store: Store) -> None:
    with pytest.raises(SessionNotFound):
        make(store, uuid.uuid4().hex)
    closed = store.sessions.create("alice").id
    store.sessions.close(closed, "alice")
    with pytest.raises(SessionClosed):
        make(store, closed)
    make(store, limit=2)
    make(store, limit=2)
    with pytest.raises(ScheduleRefused, match=r"there are 2 schedules already") as full:
        make(store, limit=2)
    assert full.value.code == "too_many_schedules"
    with pytest.raises(ScheduleRefused, match=r"turned off") as off:
        make(store, limit=0)
    assert off.value.code == "schedules_off"
    assert len(store.schedules.visible()) == 2


def test_a_time_is_recorded_once_and_only_after_the_newest(store: Store) -> None:
    schedule = make(store)
    written = store.schedules.record(
        schedule.id, [(W, "caught_up", ""), (W + 2, "fired", "")], "h1/aaaaaaaa"
    )
    assert [(f.scheduled_for, f.outcome, f.fired_by) for f in written] == [
        (W, "caught_up", "h1/aaaaaaaa"),
        (W + 2, "fired", "h1/aaaaaaaa"),
    ]
    # Again, or an older time: decided already. A newer one after them is written.
    assert store.schedules.record(schedule.id, [(W + 2, "fired", "")], "h2/b") == []
    assert store.schedules.record(schedule.id, [(W - 2, "fired", "")], "h2/b") == []
    (later,) = store.schedules.record(
        schedule.id, [(W + 2, "fired", ""), (W + 4, "skipped", "why")], "h2/b"
    )
    assert (later.scheduled_for, later.outcome, later.reason) == (W + 4, "skipped", "why")
    assert store.schedules.newest([schedule.id])[schedule.id] == later
    assert store.schedules.record("s" + "0" * 32, [(W, "fired", "")], "h") == []  # gone
    # Owed: the two that run, not the skipped one; settled once injected or dropped.
    assert [f.scheduled_for for f in store.schedules.owed()] == [W, W + 2]
    session = store.sessions.create("alice").id
    store.schedules.injected(written[0].id, session, 7)
    store.schedules.dropped(written[1].id, "its session is closed")
    assert store.schedules.owed() == []
    first, second, _ = store.schedules.fires(schedule.id)
    assert (first.session, first.seq, first.reason) == (session, 7, "")
    assert second.reason == "its session is closed" and second.to_dict()["seq"] is None
    store.schedules.dropped(first.id, "late")  # injected already: stays so
    assert store.schedules.fires(schedule.id)[0].reason == ""


def test_daemons_racing_for_the_same_times_record_each_once(store: Store) -> None:
    # Threads on one Store: each thread has a connection, and a transaction, of its own
    # (peewee binds the models to one database per process), as daemons would.
    schedule = make(store)
    times = [(W + 2 * i, "fired", "") for i in range(20)]
    racers = 4
    won: list[list[float]] = [[] for _ in range(racers)]
    start = threading.Barrier(racers)

    def race(index: int) -> None:
        start.wait()
        for step in range(0, len(times), 2):  # passes of two times each
            written = store.schedules.record(schedule.id, times[step : step + 2], f"h{index}/b")
            won[index] += [f.scheduled_for for f in written]
        store.db.close()

    threads = [threading.Thread(target=race, args=(i,)) for i in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    recorded = [f.scheduled_for for f in store.schedules.fires(schedule.id)]
    assert sorted(t for mine in won for t in mine) == recorded
    assert recorded == [time for time, _, _ in times]  # each once, none left out


def test_a_fire_without_a_session_makes_one_for_its_owner_once(store: Store) -> None:
    schedule = make(store, None)
    (fire,) = store.schedules.record(schedule.id, [(W, "fired", "")], "h/b")
    payload = {"text": "report", "schedule": schedule.id, "scheduled_for": int(W)}
    key = idempotency_key(schedule.id, W)
    made = store.schedules.inject_new(fire.id, "alice", "report", payload, key)
    assert made is not None
    session_id, seq = made
    info = store.sessions.get(session_id)
    assert (info.kind, info.title, info.pending, seq) == ("scheduled", "report", True, 1)
    assert store.acl.entries(session_id) == {"alice": "admin"}
    assert [m.payload for m in messages(store, session_id)] == [payload]
    # Again (a restart, another daemon): the same session and message, nothing new.
    assert store.schedules.inject_new(fire.id, "alice", "report", payload, key) == made
    assert [s.id for s in store.sessions.list()] == [session_id]
    assert store.schedules.fires(schedule.id)[0].session == session_id


def test_old_settled_fires_are_pruned_and_owed_ones_kept(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(schedule_rows, "KEEP_FIRES", 3)
    monkeypatch.setattr(schedule_rows, "PRUNE_EVERY", 1)
    schedule = make(store)
    owed = store.schedules.record(schedule.id, [(W, "fired", "")], "h/b")
    for i in range(1, 8):
        (fire,) = store.schedules.record(schedule.id, [(W + 2 * i, "fired", "")], "h/b")
        store.schedules.injected(fire.id, "x" * 32, i)
    left = [f.scheduled_for for f in store.schedules.fires(schedule.id)]
    assert left == [owed[0].scheduled_for, W + 10, W + 12, W + 14]


# --- the scheduler, in-process on a fake clock -----------------------------------------


class Run:
    """One scheduler (a daemon's) on `store`, recording what it tells the pool."""

    def __init__(self, store: Store, clock: FakeClock, owner: str = "h1/aaaaaaaa") -> None:
        self.committed: list[tuple[str, int, str]] = []
        self.stopped: list[str] = []
        self.metrics = Metrics()
        self.scheduler = Scheduler(
            Config(),
            store,
            owner,
            lambda s, q, t: self.committed.append((s, q, t)),
            self.stopped.append,
            self.metrics,
            clock=clock,
        )

    def count(self, outcome: str) -> float | None:
        sample = {"outcome": outcome}
        return self.metrics.registry.get_sample_value("turnkeeper_schedule_fires_total", sample)


async def idle(clock: FakeClock, sleepers: int) -> None:
    """Wait (real time) until `sleepers` schedulers sleep on the clock again."""
    deadline = time.monotonic() + 30
    while clock.sleepers < sleepers:
        assert time.monotonic() < deadline, "a scheduler did not go back to sleep"
        await asyncio.sleep(0.01)


def scenario(clock: FakeClock, runs: list[Run], body: Callable[[], Awaitable[None]]) -> None:
    """Run the schedulers while `body` drives the clock; stop them after."""

    async def main() -> None:
        tasks = [asyncio.create_task(r.scheduler.run()) for r in runs]
        try:
            await idle(clock, len(runs))
            await body()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def test_two_schedulers_on_one_database_fire_every_time_once(store: Store) -> None:
    # Two daemons' schedulers: their work runs in threads, each with its own connection.
    clock = FakeClock(wall=W + 0.5)
    session = store.sessions.create("alice").id
    schedule = make(store, session)
    armed(store, schedule, W)
    runs = [Run(store, clock, "h1/aaaaaaaa"), Run(store, clock, "h2/bbbbbbbb")]

    async def body() -> None:
        for _ in range(20):
            await clock.advance(1.0)
            await idle(clock, 2)

    scenario(clock, runs, body)
    fires = store.schedules.fires(schedule.id)
    assert [f.scheduled_for for f in fires] == [W + 2 * i for i in range(1, 11)]
    assert {f.outcome for f in fires} == {"fired"}
    found = messages(store, session)
    assert [m.payload["scheduled_for"] for m in found] == [int(f.scheduled_for) for f in fires]
    assert [f.seq for f in fires] == [m.seq for m in found]
    assert found[0].payload == {
        "text": "report",
        "by": "alice",
        "schedule": schedule.id,
        "scheduled_for": int(W + 2),
        "outcome": "fired",
    }
    told = sorted(runs[0].committed + runs[1].committed)
    assert told == [(session, m.seq, "user_message") for m in found]
    assert (runs[0].count("fired") or 0) + (runs[1].count("fired") or 0) == 10


def test_a_boot_finishes_fires_committed_before_a_crash_once(store: Store) -> None:
    clock = FakeClock(wall=W + 0.5)
    session = store.sessions.create("alice").id
    schedule = make(store, session)
    own = make(store, None)
    for made in (schedule, own):
        armed(store, made, W + 10)  # nothing is due: only the owed fires run
    # Crashes: after the fire row, before its message (twice); after the message, before
    # the fire row was marked.
    (bare,) = store.schedules.record(schedule.id, [(W - 4, "fired", "")], "h1/old")
    (sent,) = store.schedules.record(schedule.id, [(W - 2, "caught_up", "")], "h1/old")
    store.schedules.record(own.id, [(W - 2, "fired", "")], "h1/old")
    key = idempotency_key(schedule.id, W - 2)
    early = store.events.append(
        session, "user_message", {"text": "report"}, writer="intake", idempotency_key=key
    )
    first = Run(store, clock)
    scenario(clock, [first], lambda: asyncio.sleep(0))
    assert store.schedules.owed() == []
    found = messages(store, session)
    assert [(m.seq, m.payload.get("scheduled_for")) for m in found] == [
        (early, None),
        (early + 1, int(W - 4)),
    ]
    fires = {f.id: f for f in store.schedules.fires(schedule.id)}
    assert (fires[bare.id].seq, fires[sent.id].seq) == (early + 1, early)
    (run,) = store.schedules.fires(own.id)
    assert run.session is not None and len(messages(store, run.session)) == 1
    # Another boot: nothing owed, nothing new.
    scenario(clock, [Run(store, clock, "h1/bbbbbbbb")], lambda: asyncio.sleep(0))
    assert len(messages(store, session)) == 2
    assert len([s for s in store.sessions.list() if s.kind == "scheduled"]) == 1


def test_after_a_stop_run_once_catches_up_once_and_skip_runs_none(store: Store) -> None:
    clock = FakeClock(wall=W + 0.5)  # the boot: W - 8 to W were missed
    session = store.sessions.create("alice").id
    once = make(store, session)
    skip = make(store, None, misfire="skip")
    for made in (once, skip):
        armed(store, made, W - 100)
        (before,) = store.schedules.record(made.id, [(W - 10, "fired", "")], "h1/old")
        store.schedules.dropped(before.id, "not this test's")
    run = Run(store, clock)

    async def body() -> None:
        for _ in range(4):
            await clock.advance(1.0)
            await idle(clock, 1)

    scenario(clock, [run], body)
    caught = [(f.scheduled_for, f.outcome) for f in store.schedules.fires(once.id)]
    assert caught == [(W - 10, "fired"), (W, "caught_up"), (W + 2, "fired"), (W + 4, "fired")]
    skipped = store.schedules.fires(skip.id)
    assert [(f.scheduled_for, f.outcome) for f in skipped] == [
        (W - 10, "fired"),
        (W, "skipped"),
        (W + 2, "fired"),
        (W + 4, "fired"),
    ]
    assert "misfire skip: none runs" in skipped[1].reason and skipped[1].seq is None
    assert [m.payload["outcome"] for m in messages(store, session)] == [
        "caught_up",
        "fired",
        "fired",
    ]
    runs = [s for s in store.sessions.list() if s.kind == "scheduled"]
    assert len(runs) == 2  # W + 2 and W + 4; none for the skipped time
    assert (run.count("caught_up"), run.count("skipped"), run.count("fired")) == (1, 4 + 5, 4)


def test_an_interrupted_scheduled_turn_ends_with_a_notice(store: Store) -> None:
    clock = FakeClock(wall=W + 0.5)
    schedule = make(store, None)
    turns = {}
    for name, owner in (("lost", "h1/oldboot0/w1.1"), ("live", "h1/aaaaaaaa/w1.1")):
        (fire,) = store.schedules.record(
            schedule.id, [(W - (4 if name == "lost" else 2), "fired", "")], "h"
        )
        made = store.schedules.inject_new(fire.id, "alice", name, {"text": name}, name)
        assert made is not None
        lease = store.leases.acquire(made[0], owner, 30.0)
        assert lease is not None
        turn = uuid.uuid4().hex
        store.events.append(
            made[0], "turn_started", {"read_to": 1}, token=lease.token, turn_id=turn
        )
        turns[name] = (made[0], turn)
    armed(store, schedule, W + 100)
    run = Run(store, clock)
    scenario(clock, [run], lambda: asyncio.sleep(0))
    lost, turn = turns["lost"]
    notice, ended = store.events.read(lost, after=2)
    assert (notice.type, ended.type) == ("notice", "turn_ended")
    assert notice.payload["reason"] == NOT_CONTINUED and "never continued" in notice.payload["text"]
    assert "restarted" in notice.payload["text"]
    assert ended.turn_id == turn and ended.payload == {"outcome": "failed", "reason": NOT_CONTINUED}
    info = store.sessions.get(lost)
    assert info.active_turn_id is None and info.owner is None
    assert run.stopped == [lost]
    live, live_turn = turns["live"]
    assert store.sessions.get(live).active_turn_id == live_turn  # still running: left be


def test_a_fire_into_a_session_that_takes_none_is_dropped_with_why(store: Store) -> None:
    clock = FakeClock(wall=W + 0.5)
    closed, taken = store.sessions.create("alice").id, store.sessions.create("alice").id
    first, second = make(store, closed), make(store, taken)
    for made in (first, second):
        armed(store, made, W - 1)  # W is due, on time
    store.sessions.close(closed, "alice")
    store.acl.grant(taken, "alice", "read")
    run = Run(store, clock)
    scenario(clock, [run], lambda: asyncio.sleep(0))
    (gone,) = store.schedules.fires(first.id)
    (read_only,) = store.schedules.fires(second.id)
    assert gone.seq is None and gone.reason == "its session is closed"
    assert read_only.seq is None and "no longer has write access" in read_only.reason
    assert messages(store, closed) == [] and messages(store, taken) == []
    assert store.schedules.owed() == []
