"""HTTP limits and errors (issue: hardening, item 4): slow clients, too many connections or
streams, requests aiohttp's parser rejects, JSON Python will not convert, and idempotency
keys scoped to their principal. Each test drives a real daemon on a unix socket."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.daemon import Daemon, daemons, tokens_file, wait_until

__all__ = ["daemons"]

Daemons = Callable[..., Daemon]


def _daemon(daemons: Daemons, tmp_path: Path, **http: Any) -> Daemon:
    return daemons(http={"listen": f"unix:{tmp_path}/api.sock", **http})


def _connect(tmp_path: Path) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(15)
    conn.connect(str(tmp_path / "api.sock"))
    return conn


def _closed_by_peer(conn: socket.socket, within: float) -> bool:
    """True if the daemon closes `conn` within `within` seconds (reading what it sends)."""
    conn.settimeout(within)
    try:
        while conn.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return True


def _exchange(tmp_path: Path, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes as one request; the status, headers and body of the answer."""
    with contextlib.closing(_connect(tmp_path)) as conn:
        conn.sendall(raw)
        data = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := conn.recv(65536):
                data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, body


def test_a_client_that_sends_no_whole_request_in_time_is_disconnected(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = _daemon(daemons, tmp_path, read_timeout=1.0).start()
    with contextlib.closing(_connect(tmp_path)) as slow_head:
        slow_head.sendall(b"GET /healthz HTTP/1.1\r\nHost: turnkeeper\r\nX-Slow: ")
        started = time.monotonic()
        assert _closed_by_peer(slow_head, 10.0), "a trickled request head kept its connection"
        assert time.monotonic() - started < 8.0
    token = (daemon.state / "admin.token").read_text().strip()
    with contextlib.closing(_connect(tmp_path)) as slow_body:
        slow_body.sendall(
            b"POST /v1/sessions HTTP/1.1\r\nHost: turnkeeper\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {token}\r\nContent-Length: 100\r\n\r\n".encode()
            + b'{"title": '
        )
        assert _closed_by_peer(slow_body, 10.0), "a trickled body kept its connection"
    with daemon.client() as client:  # and nothing was half-written
        assert client.get("/v1/sessions").json()["sessions"] == []
        assert client.get("/readyz").status_code == 200


def test_attach_streams_over_the_per_principal_limit_get_429(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = _daemon(daemons, tmp_path, max_streams_per_principal=2).start()
    with daemon.client() as client, contextlib.ExitStack() as streams:
        sid = client.post("/v1/sessions", json={}).json()["id"]
        opened = []
        for _ in range(2):
            stream = streams.enter_context(client.stream("GET", f"/v1/sessions/{sid}/attach"))
            assert stream.status_code == 200
            opened.append(stream)
        wait_until(lambda: client.get("/v1/status").json()["attach_streams"] == 2, 10, "2 streams")
        refused = client.get(f"/v1/sessions/{sid}/attach")
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "5"
        assert refused.json()["error"]["code"] == "too_many_streams"
        opened[0].close()
        wait_until(lambda: client.get("/v1/status").json()["attach_streams"] == 1, 10, "1 stream")
        with client.stream("GET", f"/v1/sessions/{sid}/attach") as again:
            assert again.status_code == 200


@pytest.fixture
def api(daemons: Daemons, tmp_path: Path) -> Iterator[tuple[Daemon, str]]:
    daemon = _daemon(daemons, tmp_path).start()
    yield daemon, (daemon.state / "admin.token").read_text().strip()


def _request(method: str, path: str, token: str, body: bytes, *headers: str) -> bytes:
    head = [
        f"{method} {path} HTTP/1.1",
        "Host: turnkeeper",
        f"Authorization: Bearer {token}",
        "Content-Type: application/json",
        *headers,
    ]
    if not any(h.lower().startswith(("content-length", "transfer-encoding")) for h in headers):
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


@pytest.mark.parametrize(
    "case",
    ["oversized-header", "bad-framing", "bad-content-encoding", "long-integer", "bad-method"],
)
def test_every_refused_request_gets_a_json_error_body_and_no_traceback(
    api: tuple[Daemon, str], tmp_path: Path, case: str
) -> None:
    daemon, token = api
    raw = {
        "oversized-header": _request("GET", "/v1/sessions", token, b"", "X-Big: " + "a" * 20000),
        "bad-framing": _request(
            "POST", "/v1/sessions", token, b"zz\r\nnot a chunk\r\n", "Transfer-Encoding: chunked"
        ),
        "bad-content-encoding": _request(
            "POST", "/v1/sessions", token, b"this is not gzip", "Content-Encoding: gzip"
        ),
        "long-integer": _request("POST", "/v1/sessions", token, b'{"title": ' + b"7" * 5000 + b"}"),
        "bad-method": b"G\x01T / HTTP/1.1\r\nHost: turnkeeper\r\n\r\n",
    }[case]
    status, headers, body = _exchange(tmp_path, raw)
    assert status == 400, body
    assert headers["content-type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert error["code"] and error["message"]
    with daemon.client() as client:
        assert client.get("/v1/sessions").json()["sessions"] == []  # nothing half-written
        assert client.get("/readyz").status_code == 200
    log = daemon.log()
    assert "Traceback" not in log and "Error handling request" not in log


def test_refused_requests_are_logged_one_line_each_at_most_and_rate_limited(
    api: tuple[Daemon, str], tmp_path: Path
) -> None:
    daemon, _ = api
    for _ in range(40):
        _exchange(tmp_path, b"GET / HTTP/1.1\r\nHost: turnkeeper\r\nBad Header\r\n\r\n")
    with daemon.client() as client:
        assert client.get("/healthz").status_code == 200
    lines = [line for line in daemon.log().splitlines() if "refused a malformed request" in line]
    assert 1 <= len(lines) <= 10


def test_an_idempotency_key_is_scoped_to_its_principal_and_bound_to_its_body(
    daemons: Daemons, tmp_path: Path
) -> None:
    tokens = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789"}
    daemon = daemons(
        http={"listen": f"unix:{tmp_path}/api.sock"},
        auth={"tokens_file": str(tokens_file(tmp_path / "tokens", tokens))},
    ).start()
    with daemon.client() as admin:
        sid = admin.post("/v1/sessions", json={}).json()["id"]
        for who in tokens:
            admin.put(f"/v1/sessions/{sid}/acl", json={"principal": who, "permission": "write"})

        def inject(who: str, text: str) -> httpx.Response:
            return admin.post(
                f"/v1/sessions/{sid}/inject",
                json={"text": text},
                headers={"Authorization": f"Bearer {tokens[who]}", "Idempotency-Key": "k-1"},
            )

        first = inject("alice", "hello")
        assert first.status_code == 202 and "Idempotent-Replayed" not in first.headers
        replay = inject("alice", "hello")
        assert replay.status_code == 202
        assert replay.json() == first.json()
        assert replay.headers["Idempotent-Replayed"] == "true"
        conflict = inject("alice", "something else")
        assert conflict.status_code == 409
        assert conflict.json()["error"]["code"] == "idempotency_conflict"
        other = inject("bob", "hello")  # the same key, another principal: its own message
        assert other.status_code == 202 and "Idempotent-Replayed" not in other.headers
        assert other.json()["seq"] != first.json()["seq"]
        found = admin.get(f"/v1/sessions/{sid}/events").json()["events"]
        messages = [
            (e["payload"]["by"], e["payload"]["text"]) for e in found if e["type"] == "user_message"
        ]
        assert messages == [("alice", "hello"), ("bob", "hello")]
