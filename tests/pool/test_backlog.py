"""A backlog of interrupted sessions never hides a new session's first message.

More than 1,000 sessions with work (interrupted turns of an earlier boot that nobody has
touched yet) are in the database; a new session's message must still be answered, and
the backlog must stay where it is (no first touch, no charge).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest

from supervisor.store import Store
from supervisor.store.models import Session
from tests.conftest import this_host_id
from tests.daemon import Daemon, daemons, turn_ended, wait_until

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
