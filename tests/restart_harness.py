"""Rounds of requested restarts against a real daemon, however it is run (in the
foreground, under supervisord): one session asks for a restart while another session's turn
is held in flight; after each round the asking session has one more notice and one more
continuation reply, the other turn finished once, and the boot log has one more boot, the
one before it ended clean."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.store import EventRecord, Store

Client = Callable[[], httpx.Client]
# No drain: the other session's turn, held by a gate, is cut by each restart and continued.
RESTART_CONFIG = {
    "agent_may_request": True,
    "min_interval": 1.0,
    "turn_wait": 30.0,
    "drain_budget": 0.0,
}


def wait_for(
    predicate: Callable[[], Any], timeout: float, what: str, logs: Callable[[], str]
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except (httpx.HTTPError, OSError):
            value = None  # the daemon is between two boots
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}\n{logs()[-6000:]}")
        time.sleep(0.1)


def status(client: Client) -> dict[str, Any] | None:
    """/v1/status of a ready daemon; None while it is not."""
    with client() as http:
        if http.get("/readyz").status_code != 200:
            return None
        answer = http.get("/v1/status")
        return dict(answer.json()) if answer.status_code == 200 else None


def new_session(client: Client, title: str) -> str:
    with client() as http:
        answer = http.post("/v1/sessions", json={"title": title})
    answer.raise_for_status()
    return str(answer.json()["id"])


def inject(client: Client, session_id: str, text: str) -> int:
    with client() as http:
        answer = http.post(f"/v1/sessions/{session_id}/inject", json={"text": text})
    assert answer.status_code == 202, answer.text
    return int(answer.json()["seq"])


def read(store: Store, session_id: str) -> list[EventRecord]:
    return store.events.read(session_id, limit=100_000)


def started_after(store: Store, session_id: str, seq: int) -> str | None:
    """The id of the first turn started after seq `seq`."""
    for event in read(store, session_id):
        if event.seq > seq and event.type == "turn_started":
            return event.turn_id
    return None


def ended(store: Store, session_id: str, turn_id: str) -> list[EventRecord]:
    return [e for e in read(store, session_id) if e.type == "turn_ended" and e.turn_id == turn_id]


@dataclass
class Rounds:
    """The two sessions and what each round of restarts must leave behind."""

    client: Client
    store: Store
    gates: Path
    logs: Callable[[], str]
    pid: Callable[[], int]
    asker: str = ""
    other: str = ""
    restarts: list[str] = field(default_factory=list)

    def open(self) -> None:
        self.asker = new_session(self.client, "asks for restarts")
        self.other = new_session(self.client, "runs a turn across them")

    def round(self, number: int) -> None:
        """One agent-requested restart with the other session's turn held in flight."""
        before = wait_for(lambda: status(self.client), 60, "the daemon to be ready", self.logs)
        boot, pid = before["boot"]["id"], self.pid()
        gate = self.gates / f"gate-{number}"
        held = inject(self.client, self.other, f"/gate {gate} round {number}")
        turn = wait_for(
            lambda: started_after(self.store, self.other, held), 30, "the held turn", self.logs
        )
        asked = inject(self.client, self.asker, f"/restart round {number}")
        after = wait_for(
            lambda: (s := status(self.client)) is not None and s["boot"]["id"] != boot and s,
            90,
            f"round {number}: a new boot",
            self.logs,
        )
        assert self.pid() == pid, "the restart was not in place: the pid changed"
        assert after["breaker"]["tripped"] is False, after["breaker"]
        assert after["breaker"]["unclean_boots"] == 0, after["breaker"]
        previous = next(b for b in self.store.boots.recent(5) if b.boot_id == boot)
        assert previous.outcome == "clean", previous
        assert previous.breaker is not None and previous.breaker.get("restart"), previous
        self.restarts.append(str(previous.breaker["restart"]))
        # The asking session: its request's notice and one continuation reply.
        reply = wait_for(
            lambda: self._answered_after(asked), 60, f"round {number}: the reply", self.logs
        )
        assert "[restart result]" in reply, reply
        # The other turn was interrupted by the stop; it goes on once its gate opens.
        gate.touch()
        wait_for(
            lambda: ended(self.store, self.other, turn),
            60,
            f"round {number}: the held turn",
            self.logs,
        )
        self.check(number)

    def _answered_after(self, seq: int) -> str | None:
        """The text of the answer to the `restart_result` after seq `seq`, once its turn ended."""
        events = read(self.store, self.asker)
        results = [e for e in events if e.seq > seq and e.type == "restart_result"]
        if not results:
            return None
        turn = started_after(self.store, self.asker, results[0].seq)
        if turn is None or not ended(self.store, self.asker, turn):
            return None
        answers = [
            e.payload.get("text", "")
            for e in events
            if e.turn_id == turn and e.type == "model_response" and not e.payload.get("tool_calls")
        ]
        return str(answers[-1]) if answers else None

    def check(self, rounds: int) -> None:
        """Every round so far left exactly one of each, and nothing twice."""
        events = read(self.store, self.asker)
        notices = [e for e in events if e.type == "notice" and e.payload.get("restart")]
        results = [e for e in events if e.type == "restart_result"]
        requests = [e for e in events if e.type == "restart_requested"]
        assert len(requests) == rounds, [e.payload for e in requests]
        assert len(notices) == rounds, [e.payload for e in notices]
        assert len(results) == rounds, [e.payload for e in results]
        counted = Counter(e.payload["restart"] for e in notices)
        assert all(n == 1 for n in counted.values()), counted
        assert sorted(counted) == sorted(self.restarts), (counted, self.restarts)
        assert all(e.payload.get("outcome") == "ok" for e in notices), [e.payload for e in notices]
        # One turn per input: the question, and the restart's result.
        inputs = [e for e in events if e.type in ("user_message", "restart_result")]
        turns = [e for e in events if e.type == "turn_started"]
        assert len(turns) == len(inputs) == 2 * rounds, (len(turns), len(inputs))
        other = read(self.store, self.other)
        started = Counter(e.turn_id for e in other if e.type == "turn_started")
        endings = Counter(e.turn_id for e in other if e.type == "turn_ended")
        assert len(started) == rounds and all(n == 1 for n in started.values()), started
        assert endings == started, (endings, started)
        outcomes = [e.payload["outcome"] for e in other if e.type == "turn_ended"]
        assert outcomes == ["completed"] * rounds, outcomes
