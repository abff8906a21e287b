"""What others wrote never acts on the operator's terminal (issue 28): titles, messages,
task arguments, schedule text and a webhook's reason phrase are shown with their control
characters escaped in every CLI table and line, and in the daemon's log. A real daemon,
the real command line and a real webhook on loopback."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import psutil
import pytest

from supervisor.contract.printable import escape, is_safe
from supervisor.store import Store
from tests.daemon import (
    Daemon,
    LoopbackServer,
    daemons,
    inject,
    turn_ended,
    turnkeeper,
    wait_until,
)

__all__ = ["daemons"]

Daemons = Callable[..., Daemon]
pytestmark = pytest.mark.timeout(180)

# Clear the screen, set the terminal's title, ring, return, reverse what follows, C1 CSI.
HOSTILE = "\x1b[2J\x1b]0;pwned\x07\r\u202eevil\x9b31m"
GATED = ["sh", "-c", "exit 0", "sh", "{word}"]
TASKS = {"kinds": [{"name": "note", "command": GATED, "args": {"word": "^.{1,200}$"}}]}


def test_escape_shows_every_unsafe_character_and_keeps_json_valid() -> None:
    shown = escape(HOSTILE + "\n\tok", keep="\n\t")
    assert is_safe(shown, keep="\n\t") and shown.endswith("\n\tok")
    assert "\\u001b[2J" in shown and "\\u202e" in shown and "\\u009b" in shown
    # Inside a JSON string the escape is the same character again.
    text = json.dumps(HOSTILE, ensure_ascii=False)
    assert json.loads(escape(text)) == HOSTILE


class Hostile(BaseHTTPRequestHandler):
    """A delivery target that answers 500 with a hostile reason phrase."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(500, "broken \x1b[2J\x07\x9b31m")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def webhook() -> Iterator[LoopbackServer]:
    hook = LoopbackServer(Hostile)
    yield hook
    hook.close()


def unsafe(text: str) -> list[str]:
    return sorted({hex(ord(c)) for c in text if not is_safe(c, keep="\n")})


def test_hostile_text_is_escaped_in_every_table_and_line(
    daemons: Daemons, webhook: LoopbackServer
) -> None:
    target = {"name": "hook", "url": webhook.url("/hook"), "secret_env": "TK_TEST_SECRET"}
    daemon = daemons(
        tasks=TASKS,
        schedules={"min_interval": 0},
        delivery={"targets": [target], "backoff": 60.0},
    )
    daemon.env = {"TK_TEST_SECRET": "a-secret-of-the-operator"}
    daemon.start()
    with daemon.client() as admin, Store(daemon.url, migrate=False) as store:
        made = admin.post("/v1/sessions", json={"title": HOSTILE, "deliver_to": "hook"})
        assert made.status_code == 201, made.text
        session = made.json()["id"]
        seq = inject(store, session, f"{HOSTILE} /task")
        wait_until(lambda: turn_ended(store, session, seq), 60, "the answer")
        seq = inject(store, session, f"/task note {json.dumps({'word': HOSTILE})}")
        wait_until(lambda: turn_ended(store, session, seq), 60, "the task's turn")
        schedule = {"cron": "0 0 1 1 *", "text": HOSTILE, "session": session}
        assert admin.post("/v1/schedules", json=schedule).status_code == 201
        wait_until(lambda: "HTTP 500 broken" in daemon.log(), 60, "a delivery attempt to be logged")
    for args in (
        ("sessions", "list"),
        ("sessions", "show", session),
        ("tasks",),
        ("tasks", session),
        ("schedules", "list"),
        ("deliveries", "list"),
        ("status",),
    ):
        result = turnkeeper(daemon, *args)
        assert result.returncode == 0, (args, result.stderr)
        assert unsafe(result.stdout + result.stderr) == [], (args, result.stdout)
    shown = turnkeeper(daemon, "sessions", "show", session).stdout
    assert "\\u001b[2J" in shown and "\\u202eevil" in shown  # shown, escaped, not dropped
    log = daemon.log()
    assert unsafe(log) == []
    assert "HTTP 500 broken \\u001b[2J\\u0007" in log


def test_the_resource_tracker_starts_without_the_daemons_secrets(daemons: Daemons) -> None:
    target = {"name": "hook", "url": "http://127.0.0.1:9/hook", "secret_env": "TK_TEST_SECRET"}
    daemon = daemons(delivery={"targets": [target]})
    daemon.env = {"TK_TEST_SECRET": "a-secret-of-the-operator", "TURNKEEPER_TOKEN": "a-token"}
    daemon.start()

    def tracker() -> psutil.Process | None:
        for child in psutil.Process(daemon.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "resource_tracker" in " ".join(child.cmdline()):
                    return child
        return None

    found = wait_until(tracker, 30, "multiprocess's resource tracker")
    environ = Path(f"/proc/{found.pid}/environ").read_bytes()
    assert b"a-secret-of-the-operator" not in environ
    assert b"a-token" not in environ
    assert b"PATH=" in environ  # it has what it needs to run
