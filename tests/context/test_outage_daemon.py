"""A model outage against a real daemon (issue 29): a server that answers 503 for good.
The turn waits it out with one notice; its worker SIGKILLed during the wait leaves the
rest of `model.outage_budget` to the turn's continuation, which fails it with the last
error once the budget is spent, never a fresh budget."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler

import pytest

from supervisor.store import Store
from tests.daemon import (
    Daemon,
    LoopbackServer,
    answer_json,
    daemons,
    events,
    turn_ended,
    wait_until,
)

__all__ = ["daemons"]

Daemons = Callable[..., Daemon]
BUDGET = 20.0


class Down(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        answer_json(self, 503, {"error": {"message": "overloaded, try later"}})

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def down() -> Iterator[LoopbackServer]:
    server = LoopbackServer(Down)
    try:
        yield server
    finally:
        server.close()


@pytest.mark.timeout(180)
def test_a_worker_killed_during_an_outage_leaves_the_rest_of_the_budget(
    daemons: Daemons, down: LoopbackServer
) -> None:
    model = {"provider": "openai", "base_url": down.url("/v1"), "model": "m"}
    daemon = daemons(model={**model, "outage_budget": BUDGET}).start()
    with daemon.client() as api, Store(daemon.url, migrate=False) as store:
        session = api.post("/v1/sessions", json={"title": "down"}).json()["id"]
        seq = api.post(f"/v1/sessions/{session}/inject", json={"text": "hi"}).json()["seq"]

        def notices() -> list[float]:
            found = events(store, session)
            return [e.payload["outage_since"] for e in found if e.type == "notice"]

        wait_until(notices, 60, "the outage's notice")
        worker = daemon.owner_pid(store, session)
        assert worker is not None
        killed = time.time()
        os.kill(worker, signal.SIGKILL)
        ended = wait_until(lambda: turn_ended(store, session, seq), 120, "the turn's end")
        assert ended.payload["outcome"] == "failed"
        assert "answered 503" in ended.payload["error"]
        assert "model.outage_budget" in ended.payload["error"]
        # One outage, one notice; the continuation after the kill went on with its start.
        assert len(notices()) == 1
        log = events(store, session)
        assert any(e.type == "continuation" and e.seq > seq for e in log)
        # A fresh budget would have run to at least `killed + BUDGET`.
        assert ended.created_at < killed + BUDGET
        assert ended.created_at >= notices()[0] + BUDGET - 1
