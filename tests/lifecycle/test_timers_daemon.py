"""Timers keep their time across a restart: a delivery's next try, a schedule's next time
and a task's lost deadline that fall due a few seconds after a restart (a requested
restart in place, a SIGTERM stop and start, a SIGKILL and start) are acted on within a
second of their time, on the database's clock, not at the next sweep: every sweep here
(`delivery.poll_interval`, `tasks.reconcile_interval`) is far longer than that."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from supervisor.store import EventRecord, Store, TaskInfo
from tests.daemon import Daemon, daemons, inject, wait_until
from tests.deliveries_harness import bound, delivering, receivers, rows
from tests.deliveries_receiver import Receiver
from tests.timers_harness import SLEEPER, WAYS, in_utc, kill_runner, restart

__all__ = ["daemons", "receivers"]  # the fixtures

Daemons = Callable[..., Daemon]
pytestmark = pytest.mark.timeout(180)

LATE = 1.0  # seconds a timer may be acted on after its time
SWEEP = 60.0  # seconds between the sweeps of the loops that have one
BACKOFF = 16.0  # a delivery's first retry is due 8 to 16 s after its first attempt
LOST_GRACE = 12.0  # a task not heard from for this long is lost
SCHEDULE_IN = 12.0  # seconds from a schedule's creation to its one time


@pytest.mark.parametrize("way", WAYS)
def test_a_delivery_s_next_try_is_made_on_time_after_a_restart(
    daemons: Daemons, receivers: Callable[[str], Receiver], way: str
) -> None:
    hook = receivers("hook")
    hook.answer = 503
    delivery = {"backoff": BACKOFF, "backoff_cap": BACKOFF, "poll_interval": SWEEP}
    daemon = delivering(daemons, {"hook": hook}, delivery=delivery).start()
    with Store(daemon.url, migrate=False) as store:
        session = bound(daemon, "hook")
        inject(store, session, "hello")
        wait_until(lambda: hook.records, 30, "the first attempt")
        first = wait_until(
            lambda: [d for d in rows(store, session) if d.attempts == 1], 30, "its verdict"
        )[0]
        ready = restart(daemon, way)
        assert ready < first.next_at - LATE, (ready, first.next_at)  # due after the restart
        wait_until(lambda: len(hook.records) >= 2, BACKOFF + SWEEP, "the second attempt")
        late = hook.records[1].at - first.next_at
        assert 0.0 <= late < LATE, late


@pytest.mark.parametrize("way", WAYS)
def test_a_schedule_s_next_time_fires_on_time_after_a_restart(daemons: Daemons, way: str) -> None:
    daemon = daemons().start()
    with Store(daemon.url, migrate=False) as store:
        session = store.sessions.create("admin").id
        due = float(int(time.time() + SCHEDULE_IN))
        with daemon.client() as http:
            made = http.post(
                "/v1/schedules", json={"cron": in_utc(due), "text": "tick", "session": session}
            )
        assert made.status_code == 201, made.text
        assert made.json()["next_fire_at"] == due
        ready = restart(daemon, way)
        assert ready < due - LATE, (ready, due)
        schedule = made.json()["id"]

        def message() -> list[EventRecord]:
            found = store.events.read(session, limit=1000)
            return [e for e in found if e.payload.get("schedule") == schedule]

        [fired] = wait_until(message, 60, "the fire's message")
        [fire] = store.schedules.fires(schedule)
        assert (fire.scheduled_for, fire.outcome) == (due, "fired")
        late = fired.created_at - due
        assert 0.0 <= late < LATE, late


@pytest.mark.parametrize("way", WAYS)
def test_a_task_s_lost_deadline_is_kept_after_a_restart(daemons: Daemons, way: str) -> None:
    tasks = {"kinds": [SLEEPER], "lost_grace": LOST_GRACE, "reconcile_interval": SWEEP}
    daemon = daemons(tasks=tasks).start()
    with Store(daemon.url, migrate=False) as store:
        session = store.sessions.create("admin").id
        inject(store, session, "/task sleeper {}")

        def running() -> TaskInfo | None:
            found = store.tasks.of_session(session)
            return found[0] if found and found[0].runner_pid and found[0].heartbeat_at else None

        task = wait_until(running, 30, "the task's runner")
        if way == "in place":  # an adopted runner is not lost: this one died before
            kill_runner(task)
        ready = restart(daemon, way)

        def lost() -> TaskInfo | None:
            row = store.tasks.get(task.id)
            return row if row is not None and row.status == "lost" else None

        row = wait_until(lost, LOST_GRACE + SWEEP, "the task to be lost")
        assert row.heartbeat_at is not None and row.ended_at is not None
        due = row.heartbeat_at + LOST_GRACE
        assert ready < due - LATE, (ready, due)
        late = row.ended_at - due
        assert 0.0 <= late < LATE, late
        found = store.events.read(session, limit=1000)
        results = [
            (e.payload["task"], e.payload["status"]) for e in found if e.type == "task_result"
        ]
        assert results == [(task.id, "lost")]
