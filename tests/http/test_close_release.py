"""Closing a session and releasing a quarantine, through the HTTP API of a real daemon.

A closed session runs no turn again: not the one it had in flight, not after a restart of
the daemon (boot scan, retry timer), and it takes no message. A quarantined session is
released by a principal with write access: its poisoned turn is over for good, and the
next message is answered by a new turn.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from supervisor.store import EventRecord, Store
from tests.daemon import daemons, events, turn_ended, wait_until
from tests.http.test_api import Api, assert_error, create_session, grant, inject, start

__all__ = ["daemons", "start"]  # the fixtures

RETRY_INTERVAL = 0.5  # recovery's retry timer, so that a few of its rounds pass quickly


def started(store: Store, session_id: str, after: int = 0) -> str:
    """The turn id of the first `turn_started` after `after`, once there is one."""
    found = wait_until(
        lambda: next(
            (e for e in store.events.read(session_id, after=after) if e.type == "turn_started"),
            None,
        ),
        20,
        "the turn to start",
    )
    turn_id: str = found.turn_id
    return turn_id


def runs_of(found: list[EventRecord]) -> list[str]:
    """What ran a turn: its start or a continuation of it."""
    return [e.type for e in found if e.type in ("turn_started", "continuation")]


def test_a_closed_session_ends_its_turn_takes_nothing_and_stays_closed_after_a_restart(
    start: Callable[..., Api], tmp_path: Path
) -> None:
    api = start(recovery={"retry_interval": RETRY_INTERVAL})
    alice, bob = api.client("alice"), api.client("bob")
    closed, control = create_session(alice), create_session(alice)
    grant(alice, closed, "bob", "write")
    held, kept = tmp_path / "held", tmp_path / "kept"  # gates: both turns stay in flight
    with api.store() as store:
        inject(alice, closed, f"/gate {held} x")
        inject(alice, control, f"/gate {kept} y")
        turn_id = started(store, closed)
        started(store, control)

        assert_error(bob.delete(f"/v1/sessions/{control}"), 404, "not_found")  # no access
        assert_error(bob.post(f"/v1/sessions/{control}/release"), 404, "not_found")
        answer = bob.delete(f"/v1/sessions/{closed}")  # write access is not enough
        assert_error(answer, 403, "forbidden")
        answer = alice.delete(f"/v1/sessions/{closed}")
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"id": closed, "status": "closed"}
        *_, ended, notice = events(store, closed)
        assert (ended.type, ended.turn_id) == ("turn_ended", turn_id)
        assert ended.payload == {"outcome": "interrupted_by_operator", "by": "alice"}
        assert (notice.type, notice.payload["reason"]) == ("notice", "closed")
        last = store.sessions.get(closed).last_seq

        error = assert_error(bob.post(f"/v1/sessions/{closed}/inject", json={"text": "hi"}), 409)
        assert error["code"] == "closed"
        assert "closed" in error["message"] and "create a new session" in error["message"]
        assert_error(alice.post(f"/v1/sessions/{closed}/wake"), 409, "closed")
        for again in (alice, api.client("admin")):  # idempotent, the operator included
            answer = again.delete(f"/v1/sessions/{closed}")
            assert (answer.status_code, answer.json()) == (200, {"id": closed, "status": "closed"})
        assert alice.get(f"/v1/sessions/{closed}").json()["status"] == "closed"
        listed = {s["id"]: s["status"] for s in alice.get("/v1/sessions").json()["sessions"]}
        assert listed == {closed: "closed", control: "open"}

        held.touch()  # a worker still running the closed session's turn would go on now
        kept.touch()
        wait_until(lambda: turn_ended(store, control), 20, "the control turn to end")
        assert store.sessions.get(closed).last_seq == last

        # A crash of the daemon with the control turn in flight: after the restart, recovery
        # continues that one (boot scan, retry timer) and never the closed session.
        kept.unlink()
        sent = inject(alice, control, f"/gate {kept} z")
        cut = started(store, control, after=sent)
        api.daemon.kill_everything()
        kept.touch()
        api.daemon.start()
        wait_until(
            lambda: any(
                e.type == "continuation" and e.turn_id == cut
                for e in store.events.read(control, after=sent)
            ),
            30,
            "the control turn to be continued after the restart",
        )
        resumed = wait_until(lambda: turn_ended(store, control, sent), 30, "the continued turn")
        assert resumed.payload["outcome"] == "completed"
        time.sleep(4 * RETRY_INTERVAL)  # rounds of the retry timer
        info = store.sessions.get(closed)
        assert (info.status, info.last_seq, info.active_turn_id) == ("closed", last, None)
        assert runs_of(events(store, closed)) == ["turn_started"]  # only the first turn
    admin = api.client("admin")
    assert_error(admin.post(f"/v1/sessions/{closed}/inject", json={"text": "hi"}), 409, "closed")


def quarantined(store: Store, session_id: str) -> EventRecord:
    """Wait for the session to be quarantined; the `turn_ended` of its poisoned turn."""
    wait_until(
        lambda: store.sessions.get(session_id).status == "quarantined",
        60,
        "the poisoned session to be quarantined",
    )
    ended = events(store, session_id)[-1]
    assert (ended.type, ended.payload["reason"]) == ("turn_ended", "quarantined")
    return ended


def test_a_principal_with_write_access_releases_a_quarantine_and_the_next_message_runs(
    start: Callable[..., Api],
) -> None:
    api = start()
    alice, bob = api.client("alice"), api.client("bob")
    sid = create_session(alice)
    grant(alice, sid, "bob", "read")
    with api.store() as store:
        inject(alice, sid, "/crash")  # kills its worker on every run
        poisoned = quarantined(store, sid)

        error = assert_error(alice.post(f"/v1/sessions/{sid}/inject", json={"text": "hi"}), 409)
        assert error["code"] == "quarantined"
        assert f"POST /v1/sessions/{sid}/release" in error["message"]
        assert f"turnkeeper sessions release {sid}" in error["message"]
        assert "write access" in error["message"] and "send the message again" in error["message"]

        assert_error(bob.post(f"/v1/sessions/{sid}/release"), 403, "forbidden")
        grant(alice, sid, "bob", "write")  # bob is not the operator, nor the session's admin
        answer = bob.post(f"/v1/sessions/{sid}/release")
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"id": sid, "released": True, "status": "open"}
        notice = events(store, sid)[-1]
        assert (notice.type, notice.turn_id) == ("notice", poisoned.turn_id)
        assert notice.payload["reason"] == "released" and "bob" in notice.payload["text"]
        info = store.sessions.get(sid)
        assert (info.status, info.active_turn_id, info.attempt_count) == ("open", None, 0)
        again = bob.post(f"/v1/sessions/{sid}/release")
        assert again.json() == {"id": sid, "released": False, "status": "open"}

        asked = inject(bob, sid, "hello again")
        ended = wait_until(lambda: turn_ended(store, sid, asked), 20, "the new turn")
        assert ended.payload["outcome"] == "completed"
        assert ended.turn_id != poisoned.turn_id
        after = events(store, sid)[notice.seq :]
        assert runs_of(after) == ["turn_started"]  # a new turn; the poisoned one never again
        assert all(e.turn_id != poisoned.turn_id for e in after)
        answers = [e.payload["text"] for e in after if e.type == "model_response"]
        assert answers == ["echo: hello again"]
        assert store.sessions.get(sid).status == "open"
