"""No answer is too large to hold (issue 28): a model server's answer is read up to
`model.max_response_bytes` and no further (declared or not), a tool's result past
`tools.max_result_bytes` is cut with a note, and no event past `store.max_event_bytes` is
stored. Real daemons, a real HTTP server on loopback, a real MCP server."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from supervisor.store import EventTooLarge, Store
from supervisor.store.events import limits, make_request
from tests.daemon import Daemon, LoopbackServer, daemons, events, inject, turn_ended, wait_until

__all__ = ["daemons"]

Daemons = Callable[..., Daemon]
pytestmark = pytest.mark.timeout(180)

HUGE = 8 << 20  # bytes a hostile model server sends


class Flood(BaseHTTPRequestHandler):
    """An OpenAI-compatible server whose answer is `HUGE` bytes of one JSON string, with
    its Content-Length (a path with `declared`) or chunked without one."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        declared = "declared" in self.path
        head = b'{"choices": [{"finish_reason": "stop", "message": {"content": "'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if declared:
            self.send_header("Content-Length", str(len(head) + HUGE + 4))
        else:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for part in [head, *[b"z" * (1 << 20)] * (HUGE >> 20), b'"}}]}']:
                if declared:
                    self.wfile.write(part)
                else:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            if not declared:
                self.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass  # the daemon hung up past its cap: as it should

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def flood() -> Iterator[LoopbackServer]:
    server = LoopbackServer(Flood)
    yield server
    server.close()


def model_of(server: LoopbackServer, how: str) -> dict[str, Any]:
    return {
        "provider": "openai",
        "base_url": server.url(f"/{how}/v1"),
        "model": "flood",
        "max_response_bytes": 65536,
    }


@pytest.mark.parametrize("how", ["declared", "chunked"])
def test_a_model_answer_past_max_response_bytes_fails_the_turn_unread(
    daemons: Daemons, flood: LoopbackServer, how: str
) -> None:
    daemon = daemons(model=model_of(flood, how)).start()
    with Store(daemon.url, migrate=False) as store:
        session = store.sessions.create("admin").id
        seq = inject(store, session, "hello")
        ended = wait_until(lambda: turn_ended(store, session, seq), 60, "the turn to end")
        assert ended.payload["outcome"] == "failed"
        assert "model.max_response_bytes" in ended.payload["error"]
        assert ended.payload.get("transient") is False  # not retried: it would only fail again
        stored = sum(len(json.dumps(e.payload)) for e in events(store, session))
        assert stored < 65536
    with daemon.client() as client:
        assert client.get("/healthz").status_code == 200


def test_a_tool_result_past_max_result_bytes_is_cut_with_a_note(daemons: Daemons) -> None:
    server = {
        "name": "calc",
        "command": [sys.executable, "-m", "tests.mcp_servers.basic"],
        "start_timeout": 60.0,
    }
    daemon = daemons(mcp={"servers": [server]}).start()
    with Store(daemon.url, migrate=False) as store:
        session = store.sessions.create("admin").id
        seq = inject(store, session, '/tool big {"size": 1000000}')
        wait_until(lambda: turn_ended(store, session, seq), 90, "the turn to end")
        [result] = [e for e in events(store, session) if e.type == "tool_result"]
        content = result.payload["content"]
        assert content.startswith("y" * 1000)
        kept = 256 * 1024
        assert len(content.encode()) < kept + 200
        assert f"[cut: {1_000_000 - kept:,} of 1,000,000 bytes not kept" in content
        assert "tools.max_result_bytes" in content


def test_no_event_past_max_event_bytes_is_stored() -> None:
    before = limits.max_event_bytes
    limits.max_event_bytes = 65536
    try:
        make_request("s", "notice", {"text": "x" * 60_000})
        with pytest.raises(EventTooLarge, match=r"store\.max_event_bytes"):
            make_request("s", "notice", {"text": "x" * 70_000})
        with pytest.raises(EventTooLarge):  # bytes, not characters
            make_request("s", "notice", {"text": "\u00e9" * 40_000})
    finally:
        limits.max_event_bytes = before


def test_max_event_bytes_below_what_intake_admits_is_a_configuration_error(
    daemons: Daemons,
) -> None:
    daemon = daemons(store={"max_event_bytes": 1 << 20}, http={"max_body": 2 << 20})
    daemon.start(wait=False)
    assert daemon.wait(60) == 78
    assert "store.max_event_bytes: 1048576 is not above http.max_body" in daemon.log()
