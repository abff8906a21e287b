"""A turn its own worker continues, with the daemon as a real process and a real model
server: an OpenAI-compatible fake on loopback that cuts answers at the token limit or
answers 429, 503 or 400, as its script for the conversation says.

The session row's attempt count is watched by an SQLite trigger that records every value
it takes, so "never past the last attempt" is checked on every write, not sampled.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sqlite3
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from supervisor.store import EventRecord, Store
from tests.daemon import (
    Daemon,
    answer_json,
    daemons,
    events,
    inject,
    outcome_of,
    turn_ended,
    wait_until,
)

__all__ = ["daemons"]  # the fixture

Daemons = Callable[..., Daemon]
Step = int | tuple[str, str]  # an HTTP error status, or (text, finish_reason)
pytestmark = pytest.mark.timeout(240)
MAX = 3  # continuation attempts: the length of the attempt schedules below


class FakeModel:
    """A chat-completions server on 127.0.0.1 that answers from scripts.

    The conversation's last user message (notes are sent as "[note] ...") names its
    script; each call takes the script's next step, and the last step repeats.
    """

    def __init__(self, scripts: dict[str, list[Step]]) -> None:
        self.scripts = scripts
        self.calls: Counter[str] = Counter()
        lock = threading.Lock()
        model = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                users = [
                    m["content"]
                    for m in body["messages"]
                    if m["role"] == "user" and not m["content"].startswith("[note] ")
                ]
                text = users[-1] if users else ""
                with lock:
                    script = model.scripts.get(text, [(f"echo: {text}", "stop")])
                    step = script[min(model.calls[text], len(script) - 1)]
                    model.calls[text] += 1
                if isinstance(step, int):
                    answer_json(self, step, {"error": {"message": f"scripted {step}"}})
                    return
                answer, finish = step
                message = {"role": "assistant", "content": answer}
                answer_json(self, 200, {"choices": [{"message": message, "finish_reason": finish}]})

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def config(self) -> dict[str, Any]:
        """The daemon's `[model]` section for this server."""
        port = self.server.server_address[1]
        # With no outage budget a 429 or 503 is not waited out in the turn (workers.outage)
        # but ends the run of it, to be continued on the attempt schedule: that is tested here.
        return {
            "provider": "openai",
            "base_url": f"http://127.0.0.1:{port}/v1",
            "model": "fake",
            "outage_budget": 0,
        }

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@pytest.fixture
def fake_model() -> Iterator[Callable[[dict[str, list[Step]]], FakeModel]]:
    made: list[FakeModel] = []

    def make(scripts: dict[str, list[Step]]) -> FakeModel:
        made.append(FakeModel(scripts))
        return made[-1]

    yield make
    for model in made:
        model.close()


def watch_attempts(daemon: Daemon) -> None:
    """Record every value each session row's attempt count takes (an SQLite trigger)."""
    with contextlib.closing(sqlite3.connect(daemon.state / "turnkeeper.db", timeout=30)) as db:
        db.executescript(
            """
            CREATE TABLE attempt_seen (session TEXT, attempt_count INTEGER);
            CREATE TRIGGER attempt_seen AFTER UPDATE OF attempt_count ON session
            WHEN NEW.attempt_count IS NOT OLD.attempt_count
            BEGIN INSERT INTO attempt_seen VALUES (NEW.id, NEW.attempt_count); END;
            """
        )


def attempts_seen(daemon: Daemon, session_id: str) -> list[int]:
    with contextlib.closing(sqlite3.connect(daemon.state / "turnkeeper.db", timeout=30)) as db:
        rows = db.execute(
            "SELECT attempt_count FROM attempt_seen WHERE session = ? ORDER BY rowid",
            (session_id,),
        )
        return [count for (count,) in rows]


def charged(store: Store, session_id: str, count: int) -> bool:
    return store.sessions.get(session_id).attempt_count == count


def notes(store: Store, session_id: str) -> list[dict[str, Any]]:
    return [e.payload for e in events(store, session_id) if e.type == "continuation"]


def ended(store: Store, session_id: str) -> EventRecord:
    found = wait_until(lambda: turn_ended(store, session_id), 60, "the turn to end")
    assert isinstance(found, EventRecord)
    return found


def test_cut_answers_and_passing_model_errors_are_continued_within_the_attempts(
    daemons: Daemons, fake_model: Callable[[dict[str, list[Step]]], FakeModel]
) -> None:
    model = fake_model(
        {
            "cut once": [("echo: cut", "length"), ("once", "stop")],
            "cut always": [("echo: cut", "length")],
            "busy twice": [429, 503, ("at last", "stop")],
            "busy always": [503],
            "refused": [400, ("never asked again", "stop")],
        }
    )
    daemon = daemons(model=model.config, recovery={"attempt_delays": [0.0, 0.3, 0.3]}).start()
    watch_attempts(daemon)
    with Store(daemon.url, migrate=False) as store:
        sids = {}
        for text in model.scripts:
            sids[text] = store.sessions.create("admin").id
            inject(store, sids[text], text)

        # A cut answer is continued: the note says why and which attempt, the attempt
        # was charged in the row (1: the turn's own run, 2: the continuation, 0: ended).
        sid = sids["cut once"]
        assert outcome_of(ended(store, sid).payload) == {"outcome": "completed"}
        assert [(n["cause"], n["attempt"]) for n in notes(store, sid)] == [("max_tokens", 1)]
        assert [e.type for e in events(store, sid)] == [
            "user_message",
            "turn_started",
            "model_response",
            "continuation",
            "model_response",
            "turn_ended",
        ]
        assert attempts_seen(daemon, sid) == [1, 2, 0]

        # A model that keeps cutting: three attempts, then the turn ends truncated.
        sid = sids["cut always"]
        assert outcome_of(ended(store, sid).payload) == {"outcome": "truncated", "attempts": MAX}
        assert [(n["cause"], n["attempt"]) for n in notes(store, sid)] == [
            ("max_tokens", 1),
            ("max_tokens", 2),
            ("max_tokens", 3),
        ]
        assert attempts_seen(daemon, sid) == [1, 2, 3, 4, 0]
        assert model.calls["cut always"] == 1 + MAX

        # 429 and 503 may pass: continued on the schedule, and the turn completes.
        sid = sids["busy twice"]
        assert outcome_of(ended(store, sid).payload) == {"outcome": "completed"}
        busy = notes(store, sid)
        assert [(n["cause"], n["attempt"]) for n in busy] == [
            ("model_error", 1),
            ("model_error", 2),
        ]
        assert "answered 429" in busy[0]["error"] and "answered 503" in busy[1]["error"]
        replies = [e.payload["text"] for e in events(store, sid) if e.type == "model_response"]
        assert replies == ["at last"]
        assert attempts_seen(daemon, sid) == [1, 2, 3, 0]

        # An error that keeps coming back: failed after the last attempt, with the error.
        sid = sids["busy always"]
        payload = ended(store, sid).payload
        assert payload["outcome"] == "failed" and "answered 503" in payload["error"]
        assert (payload["transient"], payload["attempts"]) == (True, MAX)
        assert [n["attempt"] for n in notes(store, sid)] == [1, 2, 3]
        assert max(attempts_seen(daemon, sid)) == 1 + MAX
        assert model.calls["busy always"] == 1 + MAX

        # An error that will not pass fails the turn at once, as before.
        sid = sids["refused"]
        payload = ended(store, sid).payload
        assert payload["outcome"] == "failed" and "answered 400" in payload["error"]
        assert payload["transient"] is False and "attempts" not in payload
        assert notes(store, sid) == [] and attempts_seen(daemon, sid) == [1, 0]
        assert model.calls["refused"] == 1


def test_a_worker_killed_while_it_waits_leaves_the_turn_the_attempts_that_are_left(
    daemons: Daemons, fake_model: Callable[[dict[str, list[Step]]], FakeModel]
) -> None:
    model = fake_model(
        {
            "cut always": [("echo: cut", "length")],
            "busy twice": [503, 503, ("at last", "stop")],
        }
    )
    # Attempt 2 waits 600 s: that wait is where the worker is killed (the gate). Attempt 3
    # is due at once, so recovery goes on as soon as it takes the turn over.
    daemon = daemons(model=model.config, recovery={"attempt_delays": [0.0, 600.0, 0.0]}).start()
    watch_attempts(daemon)
    with Store(daemon.url, migrate=False) as store:
        cut = store.sessions.create("admin").id
        busy = store.sessions.create("admin").id
        inject(store, cut, "cut always")
        inject(store, busy, "busy twice")
        owners = set()
        for sid in (cut, busy):
            # Attempt 2 charged and nothing else to commit: its worker is in the wait.
            waiting = functools.partial(charged, store, sid, 3)
            wait_until(waiting, 60, "attempt 2")
            assert [n["attempt"] for n in notes(store, sid)] == [1]
            owners.add(wait_until(functools.partial(daemon.owner_pid, store, sid), 10, "owner"))
        for pid in owners:
            os.kill(pid, signal.SIGKILL)

        # The cut turn goes on with attempt 3 (recovery's), and then its attempts are spent.
        assert outcome_of(ended(store, cut).payload) == {"outcome": "truncated", "attempts": MAX}
        assert [(n["cause"], n["attempt"]) for n in notes(store, cut)] == [
            ("max_tokens", 1),
            ("max_tokens", 3),  # attempt 2 was charged, and died in its wait
        ]
        assert model.calls["cut always"] == 3

        # The failed one: its last step was the note of attempt 1, yet it is continued (no
        # resend notice): attempt 2 was charged after that note, so the note did not die.
        assert outcome_of(ended(store, busy).payload) == {"outcome": "completed"}
        assert [(n["cause"], n["attempt"]) for n in notes(store, busy)] == [
            ("model_error", 1),
            ("worker_crash", 3),
        ]
        assert "notice" not in [e.type for e in events(store, busy)]
        assert model.calls["busy twice"] == 3

        for sid in (cut, busy):
            seen = attempts_seen(daemon, sid)
            assert max(seen) == 1 + MAX and seen[-1] == 0, seen
            assert store.sessions.get(sid).status == "open"
