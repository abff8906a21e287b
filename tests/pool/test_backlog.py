"""A backlog of interrupted sessions: it never hides a new session's first message, and
it is spread over recovery's passes, not stranded.

- More than 1,000 sessions with work (interrupted turns of an earlier boot that nobody
  has touched yet) are in the database; a new session's message must still be answered,
  and the backlog must stay where it is (no first touch, no charge).
- Recovery's passes, in this process on a fake clock: 10 picked at the boot scan, 10
  more every 5 s, none before; a tripped breaker holds them all back until it clears.
- A daemon SIGKILLed with 100 turns in flight: the next boot continues every one within
  2 minutes, with the shipped pace (10 a pass, a pass every 5 s), not 10 and the rest at
  the retry timer.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor.contract.background import spawn
from supervisor.contract.config import Config, RecoveryConfig
from supervisor.metrics import Metrics
from supervisor.pool.recoverer import Recoverer
from supervisor.store import Store
from supervisor.store.models import Event, Session
from tests.benchmarks import scale_seed
from tests.clock import FakeClock
from tests.conftest import this_host_id
from tests.daemon import Daemon, daemons, events, turn_ended, wait_until

__all__ = ["daemons"]  # the fixture

pytestmark = pytest.mark.timeout(180)
BACKLOG = 1_500


def seed_interrupted(store: Store, count: int) -> list[str]:
    """`count` open sessions with a turn in flight, leased by a dead boot of this host."""
    owner = f"{this_host_id()}/deadboot/w0.1"
    now = time.time() - 60
    rows = [
        {
            "id": uuid.uuid4().hex,
            "kind": "attached",
            "created_at": now,
            "updated_at": now + i * 1e-3,  # all older than any new session
            "active_turn_id": uuid.uuid4().hex,
            "owner": owner,
            "lease_token": 1,
            "lease_expires_at": now,
        }
        for i in range(count)
    ]
    with store.db.atomic():
        for start in range(0, count, 200):
            Session.insert_many(rows[start : start + 200]).execute()
    return [row["id"] for row in rows]


def test_a_new_session_is_served_while_more_than_1000_interrupted_sessions_wait(
    daemons: Callable[..., Daemon],
) -> None:
    daemon = daemons().start()
    with Store(daemon.url, migrate=False) as store:
        backlog = seed_interrupted(store, BACKLOG)
        assert len(store.sessions.with_work()) == 1_000  # the work query's limit, filled
        with daemon.client() as client:
            created = client.post("/v1/sessions", json={"title": "new"})
            assert created.status_code == 201, created.text
            sid = created.json()["id"]
            sent = client.post(f"/v1/sessions/{sid}/inject", json={"text": "hello"})
            assert sent.status_code == 202, sent.text
        ended = wait_until(lambda: turn_ended(store, sid), 60, "the new session's reply")
        assert ended.payload["outcome"] == "completed"
        # The backlog waits for a first touch: nobody charged or leased any of it.
        touched = (
            Session.select().where(Session.id.in_(backlog) & (Session.attempt_count > 0)).count()
        )
        assert touched == 0


async def until(predicate: Callable[[], Any], what: str, timeout: float = 30.0) -> None:
    """Wait in real time (the scans read the database in threads) until `predicate()`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("tripped", [False, True], ids=["clear", "breaker-tripped"])
def test_recoverys_passes_pick_10_every_5_s_and_the_breaker_holds_them(
    tmp_path: Path, tripped: bool
) -> None:
    url = f"sqlite:///{tmp_path / 'state' / 'turnkeeper.db'}"
    backlog = scale_seed.seed(tmp_path / "state" / "turnkeeper.db", url, 1, 25)
    clock = FakeClock(wall=time.time())  # the events' times are the machine's
    with Store(url, migrate=False) as store:
        host = this_host_id()
        for _ in range(3 if tripped else 0):  # boots that died: the breaker trips
            store.boots.begin(host, os.getpid(), "test")
        boot = store.boots.begin(host, os.getpid(), "test")
        recovery = Recoverer(Config(), store, boot, host, Metrics(), clock=clock)

        def picked() -> int:
            return len(recovery.attempted)

        async def at_rest() -> None:
            await until(lambda: clock.sleepers >= 2, "the breaker loop and the passes at rest")

        async def next_pass(count: int) -> None:
            """No pass before the pace says, one pass then."""
            await at_rest()
            wait = recovery.pacer.due_in(clock.monotonic())
            assert 0.0 < wait <= 5.0
            before = picked()
            await clock.advance(wait - 0.05)
            await at_rest()
            assert picked() == before
            await clock.advance(0.1)
            await until(lambda: picked() == count, f"{count} picked")

        async def main() -> None:
            await recovery.start()
            assert recovery.breaker.tripped is tripped
            loops = [spawn(c, name=n) for n, c in recovery.passes().items()]
            try:
                if tripped:
                    await until(lambda: recovery.pacer.held, "the held-back boot scan")
                    await at_rest()
                    await clock.advance(60.0)  # the breaker is read on; nothing moves
                    await at_rest()
                    assert picked() == 0
                    store.boots.reset_breaker(host)  # `turnkeeper breaker reset`
                    await clock.advance(2.1)  # the breaker loop's next reading
                await until(lambda: picked() == 10, "the first pass")
                await next_pass(20)
                await next_pass(25)
                await at_rest()
                assert recovery.pacer.due_in(clock.monotonic()) > 290.0  # the retry timer's
            finally:
                for loop in loops:
                    loop.cancel()
                await asyncio.gather(*loops, return_exceptions=True)

        asyncio.run(main())
        assert sorted(recovery.attempted) == sorted(backlog["interrupted_ids"])
        assert store.boots.recent(1)[0].attempted == recovery.attempted  # written first


@pytest.mark.slow
def test_a_crash_with_100_turns_in_flight_has_every_one_continued_within_2_minutes(
    daemons: Callable[..., Daemon],
) -> None:
    pace = RecoveryConfig()
    assert (pace.max_per_pass, pace.pass_interval) == (10, 5.0)  # the shipped pace
    daemon = daemons().start()
    daemon.signal(signal.SIGKILL)  # no stop, no drain: its boot never ends
    daemon.wait(10)
    with Store(daemon.url, migrate=False) as store:
        killed = store.boots.recent(1)[0].boot_id
        # 100 turns in flight when it died: a user message and its `turn_started` each,
        # leased to a worker of the killed boot; copies of one written through the store.
        _, template = scale_seed.templates(daemon.url)
        backlog = [template, *scale_seed.sessions(daemon.state / "turnkeeper.db", template, 99)]
        owner = f"{this_host_id()}/{killed[:8]}/w0.1"
        Session.update(owner=owner).where(Session.id.in_(backlog)).execute()

        booted = time.monotonic()
        daemon.start()

        def ended() -> bool:
            done = Event.select().where(
                Event.session_id.in_(backlog) & (Event.type == "turn_ended")
            )
            return bool(done.count() == len(backlog))

        wait_until(ended, 120 - (time.monotonic() - booted), "every turn to be continued", 0.5)
        assert time.monotonic() - booted <= 120
        for sid in backlog:
            found = events(store, sid)
            notes = [e for e in found if e.type == "continuation"]
            assert [n.payload["cause"] for n in notes] == ["daemon_restart"], sid
            assert found[-1].type == "turn_ended" and found[-1].payload["outcome"] == "completed"
            assert [e.payload["text"] for e in found if e.type == "model_response"] == [
                "echo: hello"
            ]
        # 10 a pass, oldest first, a pass every 5 s; each written to the boot row first.
        log = daemon.log().rsplit("--- run 2 ---", 1)[1]
        passes = re.findall(r"boot_scan: (\d+) interrupted sessions, (\d+) to continue", log)
        assert passes == [(str(n), "10") for n in range(100, 0, -10)], passes
        assert sorted(store.boots.recent(1)[0].attempted) == sorted(backlog)
