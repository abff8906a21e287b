"""A revoked principal stops acting (issue 28): when it is taken out of the tokens file and
the daemon reloads, its request already past the headers is refused and writes nothing,
its schedules are paused (listed, never fired) until it is back, its running tasks are
cancelled, and `turnkeeper reload` and `POST /v1/reload` say whom they revoked."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.store import Store
from tests.daemon import (
    Daemon,
    daemons,
    events,
    tokens_file,
    turn_ended,
    turnkeeper,
    wait_until,
)

__all__ = ["daemons"]

Daemons = Callable[..., Daemon]
pytestmark = pytest.mark.timeout(240)

TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789"}
GATED = ["sh", "-c", 'while [ ! -e "$1" ]; do sleep 0.05; done', "sh", "{gate}"]
TASKS = {
    "kinds": [{"name": "gated", "command": GATED, "args": {"gate": "^/[A-Za-z0-9/_.-]+$"}}],
    "reconcile_interval": 0.5,
}
EVERY_2S = "*/2 * * * * *"


def as_bob(daemon: Daemon) -> httpx.Client:
    client = daemon.client()
    client.headers["Authorization"] = f"Bearer {TOKENS['bob']}"
    return client


def schedule_of(daemon: Daemon, schedule_id: str) -> dict[str, Any]:
    with daemon.client() as admin:
        found = admin.get("/v1/schedules").json()["schedules"]
    return next(s for s in found if s["id"] == schedule_id)


def fired(daemon: Daemon, schedule_id: str) -> float | None:
    last = schedule_of(daemon, schedule_id)["last_fire"]
    return None if last is None else float(last["scheduled_for"])


def test_revoking_a_principal_stops_what_it_set_in_motion(daemons: Daemons, tmp_path: Path) -> None:
    tokens = tokens_file(tmp_path / "tokens", TOKENS)
    daemon = daemons(
        auth={"tokens_file": str(tokens)},
        schedules={"min_interval": 2},
        tasks=TASKS,
        http={"listen": f"unix:{tmp_path}/api.sock"},
    ).start()
    gate = tmp_path / "gate"
    with as_bob(daemon) as bob, Store(daemon.url, migrate=False) as store:
        session = bob.post("/v1/sessions", json={"title": "bob's"}).json()["id"]
        # The task first: a tick's turn ending first must not be taken for the task's.
        seq = bob.post(
            f"/v1/sessions/{session}/inject",
            json={"text": f'/task gated {{"gate": "{gate}"}}'},
        ).json()["seq"]
        wait_until(lambda: turn_ended(store, session, seq), 60, "the turn that starts a task")
        [task] = store.tasks.of_session(session)
        wait_until(lambda: store.tasks.get(task.id).status == "running", 30, "the task to run")
        made = bob.post(
            "/v1/schedules", json={"cron": EVERY_2S, "text": "tick", "session": session}
        )
        assert made.status_code == 201, made.text
        schedule = made.json()["id"]
        wait_until(lambda: fired(daemon, schedule), 30, "the schedule to fire once")

        # Bob's request past its headers: the body is on its way when the token goes.
        late = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        late.settimeout(30)
        late.connect(str(tmp_path / "api.sock"))
        body = json.dumps({"text": "sent while revoked"}).encode()
        late.sendall(
            f"POST /v1/sessions/{session}/inject HTTP/1.1\r\nHost: turnkeeper\r\n"
            f"Authorization: Bearer {TOKENS['bob']}\r\nContent-Type: application/json\r\n"
            f"Expect: 100-continue\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body[:10]
        )
        with contextlib.closing(late):
            # The daemon took the head and went on to the body, which waits for the test.
            assert late.recv(65536).startswith(b"HTTP/1.1 100 Continue")
            tokens_file(tokens, {"alice": TOKENS["alice"]})
            revoked = turnkeeper(daemon, "reload")
            assert revoked.returncode == 0, revoked.stderr
            assert "revoked: bob" in revoked.stdout
            late.sendall(body[10:])
            answer = late.recv(65536)
        assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
        assert not any(
            e.payload.get("text") == "sent while revoked" for e in events(store, session)
        )
        assert bob.get("/v1/sessions").status_code == 401

        # Its schedule is paused (listed, not fired); its task was cancelled.
        assert schedule_of(daemon, schedule)["status"] == "paused"
        wait_until(lambda: store.tasks.get(task.id).status == "cancelled", 30, "the task cancelled")
        last = fired(daemon, schedule)
        time.sleep(5)  # two of its times pass
        assert fired(daemon, schedule) == last
        assert schedule_of(daemon, schedule)["next_fire_at"] is None
        with daemon.client() as admin:  # not even the admin resumes it for a revoked owner
            refused = admin.post(f"/v1/schedules/{schedule}/resume")
        assert refused.status_code == 409, refused.text
        assert "'bob' is not in the tokens file" in refused.json()["error"]["message"]
        assert schedule_of(daemon, schedule)["status"] == "paused"

        # Bob back: his schedule resumes; taken out again through the API, which says so.
        tokens_file(tokens, TOKENS)
        assert turnkeeper(daemon, "reload").returncode == 0
        assert schedule_of(daemon, schedule)["status"] == "active"
        tokens_file(tokens, {"alice": TOKENS["alice"]})
        with daemon.client() as admin:
            answer_json = admin.post("/v1/reload", json={}).json()
        assert answer_json["revoked"] == ["bob"]
        assert schedule_of(daemon, schedule)["status"] == "paused"
