"""Schedules on SQLite, PostgreSQL and MariaDB: their rows and who may read them, the limits
on making them, fire rows written once per (schedule, time) even by racing daemons, owed
fires, the sessions a fire makes. The scheduler itself, in-process on these rows, is
tests/schedules/test_schedules_scheduler.py's."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest

from supervisor.schedules.rules import idempotency_key
from supervisor.store import (
    EventRecord,
    ScheduleInfo,
    ScheduleRefused,
    SessionClosed,
    SessionNotFound,
    Store,
)
from supervisor.store import schedules as schedule_rows
from supervisor.store.models import Schedule, ScheduleFire
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
        "per_owner": 1000,
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
    # The principals other than the admin share 90 % of the limit: the rest is the admin's.
    with pytest.raises(ScheduleRefused, match=r"kept for the admin") as share:
        make(store, limit=2)
    assert share.value.code == "too_many_schedules"
    make(store, limit=2, owner="admin")
    with pytest.raises(ScheduleRefused, match=r"there are 2 schedules already") as full:
        make(store, limit=2, owner="admin")
    assert full.value.code == "too_many_schedules"
    with pytest.raises(ScheduleRefused, match=r"turned off") as off:
        make(store, limit=0)
    assert off.value.code == "schedules_off"
    assert len(store.schedules.visible()) == 2
    # Per owner: alice's two are her limit, not bob's.
    make(store)
    with pytest.raises(ScheduleRefused, match=r"alice has made 2 schedules already") as mine:
        make(store, per_owner=2)
    assert mine.value.code == "too_many_own_schedules"
    assert "schedules.max_per_owner" in str(mine.value)
    make(store, owner="bob", per_owner=2)
    assert len(store.schedules.visible()) == 4


def test_a_schedule_ends_with_its_session_and_counts_no_more(store: Store) -> None:
    session = store.sessions.create("alice").id
    made = make(store, session, limit=2, owner="admin")
    make(store, limit=2, owner="admin")
    store.sessions.close(session, "alice")
    assert store.schedules.get(made.id).status == "ended"
    assert made.id not in {s.id for s in store.schedules.active()}
    make(store, limit=2, owner="admin")  # the ended one left room


def test_a_revoked_owners_schedules_pause_and_resume(store: Store) -> None:
    mine, theirs = make(store), make(store, owner="bob")
    assert store.schedules.pause_owned_by(["alice"]) == 1
    assert [s.id for s in store.schedules.active()] == [theirs.id]
    assert store.schedules.get(mine.id).status == "paused"
    assert store.schedules.pause_owned_by(["alice"]) == 0  # once
    assert store.schedules.resume_owned_by(["alice"]) == 1
    resumed = store.schedules.get(mine.id)
    assert resumed.status == "active" and resumed.armed_from > mine.armed_from


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


def test_owed_fires_by_age_on_the_database_clock(store: Store) -> None:
    schedule = make(store)
    old, new = store.schedules.record(schedule.id, [(W, "fired", ""), (W + 2, "fired", "")], "h")
    now = store.now()
    assert now - 5 <= new.fired_at <= now  # the database's clock, not the fake one
    ScheduleFire.update(fired_at=now - 30).where(ScheduleFire.id == old.id).execute()
    assert [f.id for f in store.schedules.owed(age=10)] == [old.id]
    assert [f.id for f in store.schedules.owed()] == [old.id, new.id]


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


def test_a_fire_makes_no_session_past_its_owners_open_sessions(store: Store) -> None:
    schedule = make(store, None)
    store.sessions.create("alice")  # alice's one open session: her limit below
    (fire,) = store.schedules.record(schedule.id, [(W, "fired", "")], "h/b")
    payload = {"text": "report", "schedule": schedule.id, "scheduled_for": int(W)}
    key = idempotency_key(schedule.id, W)
    assert store.schedules.inject_new(fire.id, "alice", "r", payload, key, max_open=1) is None
    (dropped,) = store.schedules.fires(schedule.id)
    assert dropped.seq is None and "auth.max_open_sessions_per_principal" in dropped.reason
    assert len(store.sessions.list()) == 1  # none was made
    assert store.schedules.owed() == []  # dropped for good, not owed


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
