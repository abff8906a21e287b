"""The scheduler in-process on a fake clock, on SQLite, PostgreSQL and MariaDB: two of them
on one database, a boot after a crash between a fire row and its message, a fire another
daemon committed and never injected, one fire injected by two at once, catch-up and skip
after a stop, a boot just after a time another daemon was up for, an interrupted
scheduled turn ended with a notice, and the expressions it keeps."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

import pytest

from supervisor.contract.config import Config
from supervisor.metrics import Metrics
from supervisor.schedules.rules import NOT_CONTINUED, OWED_AGE, idempotency_key
from supervisor.schedules.service import OWED_EVERY, Scheduler
from supervisor.store import FireInfo, Me, Store
from supervisor.store.models import Host, ScheduleFire
from tests.clock import FakeClock
from tests.conftest import BACKENDS
from tests.schedules.test_schedules_store import W, armed, make, messages

pytestmark = pytest.mark.parametrize("db_url", BACKENDS, indirect=True)


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
    # A closed session's schedule ended with it: it is not fired at all.
    assert store.schedules.fires(first.id) == []
    assert store.schedules.get(first.id).status == "ended"
    (read_only,) = store.schedules.fires(second.id)
    assert read_only.seq is None and "no longer has write access" in read_only.reason
    assert messages(store, closed) == [] and messages(store, taken) == []
    assert store.schedules.owed() == []


async def until(ready: Callable[[], bool], what: str) -> None:
    """Wait (real time) until `ready()`."""
    deadline = time.monotonic() + 30
    while not ready():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)


def aged(fire: FireInfo, store: Store) -> None:
    """Make the fire row older than OWED_AGE on the database clock."""
    old = store.now() - OWED_AGE - 1
    ScheduleFire.update(fired_at=old).where(ScheduleFire.id == fire.id).execute()


def test_a_fire_a_dead_daemon_committed_is_finished_by_a_live_one_once_old(store: Store) -> None:
    clock = FakeClock(wall=W + 0.5)
    session = store.sessions.create("alice").id
    on_session, own = make(store, session), make(store, None)
    for made in (on_session, own):
        armed(store, made, W + 1000)  # nothing is due: only owed fires run
    run = Run(store, clock, "h2/bbbbbbbb")

    async def body() -> None:
        # After this daemon's boot pass, h1 commits fires and dies before injecting them.
        (left,) = store.schedules.record(on_session.id, [(W - 4, "fired", "")], "h1/aaaaaaaa")
        (other,) = store.schedules.record(own.id, [(W - 4, "fired", "")], "h1/aaaaaaaa")
        for fire in (left, other):
            aged(fire, store)
        (fresh,) = store.schedules.record(on_session.id, [(W - 2, "fired", "")], "h1/aaaaaaaa")
        await clock.advance(OWED_EVERY + 1)
        await idle(clock, 1)
        assert [m.payload["scheduled_for"] for m in messages(store, session)] == [int(W - 4)]
        (ran,) = store.schedules.fires(own.id)
        assert ran.session is not None and len(messages(store, ran.session)) == 1
        # The fresh one may be its daemon's, injecting it now: left to it, for a while.
        assert [f.id for f in store.schedules.owed()] == [fresh.id]
        aged(fresh, store)
        await clock.advance(OWED_EVERY + 1)
        await idle(clock, 1)
        found = [m.payload["scheduled_for"] for m in messages(store, session)]
        assert found == [int(W - 4), int(W - 2)] and store.schedules.owed() == []

    scenario(clock, [run], body)


def test_one_fire_injected_by_two_daemons_at_once_is_one_message(store: Store) -> None:
    clock = FakeClock(wall=W + 0.5)
    session = store.sessions.create("alice").id
    schedules = (make(store, session), make(store, None))
    fires = [(s, store.schedules.record(s.id, [(W, "fired", "")], "h1/a")[0]) for s in schedules]
    runs = [Run(store, clock, "h1/aaaaaaaa"), Run(store, clock, "h2/bbbbbbbb")]

    async def both() -> None:  # each store call in a thread: a connection each
        await asyncio.gather(*(r.scheduler.inject(s, f) for s, f in fires for r in runs))

    for _ in range(3):  # at once, and again
        asyncio.run(both())
    assert [m.payload["scheduled_for"] for m in messages(store, session)] == [int(W)]
    (made,) = [s.id for s in store.sessions.list() if s.kind == "scheduled"]
    assert [m.payload["scheduled_for"] for m in messages(store, made)] == [int(W)]
    assert store.schedules.owed() == []


def up(store: Store, host_id: str, started: float, last_seen: float, expires: float) -> None:
    """A host row of another daemon, on the fake clock's times."""
    me = Me(host_id, host_id * 8, "elsewhere", "m", 1, 0.0, "test")
    store.hosts.register(me, 60.0, lambda _: False)
    Host.update(started_at=started, last_seen=last_seen, expires_at=expires).where(
        Host.host_id == host_id
    ).execute()


def test_a_boot_just_after_a_time_another_daemon_was_up_for_fires_it_on_time(
    store: Store,
) -> None:
    clock = FakeClock(wall=W + 0.5)  # this daemon boots half a second after W
    session = store.sessions.create("alice").id
    schedule = make(store, session, misfire="skip")
    armed(store, schedule, W - 1)  # W is its only due time
    up(store, "h1", started=W - 100, last_seen=W - 0.5, expires=W + 1000)  # live, renewing
    run = Run(store, clock, "h2/bbbbbbbb")

    async def body() -> None:
        await clock.advance(2.0)
        await idle(clock, 1)

    scenario(clock, [run], body)
    fires = store.schedules.fires(schedule.id)
    assert [(f.scheduled_for, f.outcome) for f in fires] == [(W, "fired"), (W + 2, "fired")]
    assert [m.payload["outcome"] for m in messages(store, session)] == ["fired", "fired"]
    assert not run.count("skipped") and run.count("fired") == 2


def test_a_daemons_own_host_row_is_not_a_daemon_that_was_up_before_it(store: Store) -> None:
    clock = FakeClock(wall=W + 0.5)  # it registered before W, and started after it
    session = store.sessions.create("alice").id
    schedule = make(store, session, misfire="skip")
    armed(store, schedule, W - 1)
    up(store, "h2", started=W - 3, last_seen=W + 0.4, expires=W + 1000)  # its own row
    run = Run(store, clock, "h2/bbbbbbbb")

    async def body() -> None:
        await clock.advance(2.0)
        await idle(clock, 1)

    scenario(clock, [run], body)
    fires = store.schedules.fires(schedule.id)
    assert [(f.scheduled_for, f.outcome) for f in fires] == [(W, "skipped"), (W + 2, "fired")]


def test_the_scheduler_forgets_the_expressions_of_deleted_schedules(store: Store) -> None:
    clock = FakeClock(wall=W + 0.5)
    made = [make(store, None, cron=f"{minute} 3 * * *") for minute in range(5)]
    run = Run(store, clock)

    async def body() -> None:
        assert len(run.scheduler._crons) == 5
        kept = run.scheduler._crons[("0 3 * * *", "UTC")]
        for schedule in made[1:]:
            passes = run.scheduler.passes
            assert store.schedules.delete(schedule.id)  # stirs it
            await until(lambda p=passes: run.scheduler.passes > p, "a pass after a delete")
        await idle(clock, 1)
        assert run.scheduler._crons == {("0 3 * * *", "UTC"): kept}  # kept, not parsed again

    scenario(clock, [run], body)
