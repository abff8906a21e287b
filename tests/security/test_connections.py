"""One client cannot hold the daemon's connections (issue 28): at `http.max_connections` a
new connection evicts the one idle longest (an attach stream is not idle), a client that
reads nothing is disconnected after `http.write_timeout`, and a body declared over
`http.max_body` is refused at once. Each test drives a real daemon on a unix socket."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.daemon import Daemon, daemons, wait_until
from tests.security.test_http import _closed_by_peer, _connect, _daemon

__all__ = ["daemons"]

Daemons = Callable[..., Daemon]
pytestmark = pytest.mark.timeout(120)


def hold(tmp_path: Path, held: list[socket.socket]) -> bool:
    """Open a connection the daemon serves and keep it alive, idle."""
    conn = _connect(tmp_path)
    try:
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: turnkeeper\r\n\r\n")
        if b"200 OK" in conn.recv(65536):
            held.append(conn)
            return True
    except OSError:
        pass
    conn.close()
    return False


def evicted(daemon: Daemon) -> float:
    with daemon.client() as client:
        text = client.get("/metrics").text
    lines = [line for line in text.splitlines() if line.startswith("turnkeeper_http_conn")]
    return sum(float(line.split()[-1]) for line in lines if "_total " in line)


def test_idle_connections_at_the_cap_never_lock_out_the_admin(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = _daemon(daemons, tmp_path, max_connections=4).start()
    held: list[socket.socket] = []
    try:
        for _ in range(4):
            wait_until(lambda: hold(tmp_path, held), 10, "a connection under the cap")
        # The cap is full of idle clients: the admin and the health check are served.
        for _ in range(3):
            with daemon.client() as client:
                assert client.get("/healthz").status_code == 200
                assert client.get("/v1/status").status_code == 200
        # The oldest idle one went first.
        assert _closed_by_peer(held[0], 5.0)
        assert evicted(daemon) >= 1
        assert "evicted the connection idle longest" in daemon.log()
    finally:
        for conn in held:
            conn.close()


def test_an_attach_stream_is_not_idle_and_is_never_evicted(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = _daemon(daemons, tmp_path, max_connections=3).start()
    with daemon.client() as client:
        sid = client.post("/v1/sessions", json={}).json()["id"]
    token = (daemon.state / "admin.token").read_text().strip()
    streams = []
    try:
        for _ in range(3):
            conn = _connect(tmp_path)
            conn.sendall(
                f"GET /v1/sessions/{sid}/attach HTTP/1.1\r\nHost: turnkeeper\r\n"
                f"Authorization: Bearer {token}\r\n\r\n".encode()
            )
            assert b"200 OK" in conn.recv(65536)
            streams.append(conn)
        with contextlib.closing(_connect(tmp_path)) as extra:
            assert _closed_by_peer(extra, 5.0), "a connection past a cap of streams was kept"
        for conn in streams:  # every stream is still open
            conn.settimeout(0.2)
            with pytest.raises(TimeoutError):
                conn.recv(1)
        assert "each with a request in flight" in daemon.log()
    finally:
        for conn in streams:
            conn.close()

    def serves() -> bool:
        with contextlib.suppress(httpx.HTTPError), daemon.client() as client:
            return client.get("/healthz").status_code == 200
        return False

    wait_until(serves, 10, "the daemon to serve again")


def test_a_client_that_reads_nothing_is_disconnected_after_the_write_timeout(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = _daemon(daemons, tmp_path, write_timeout=1.0).start()
    token = (daemon.state / "admin.token").read_text().strip()
    with daemon.client() as client:
        sid = client.post("/v1/sessions", json={}).json()["id"]
    reader = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    reader.connect(str(tmp_path / "api.sock"))
    with contextlib.closing(reader):
        reader.sendall(
            f"GET /v1/sessions/{sid}/attach HTTP/1.1\r\nHost: turnkeeper\r\n"
            f"Authorization: Bearer {token}\r\n\r\n".encode()
        )
        text = "x" * 60_000
        with daemon.client() as client:
            # The stream's events pile up in buffers the client never empties.
            for _ in range(40):
                answer = client.post(f"/v1/sessions/{sid}/inject", json={"text": text})
                assert answer.status_code == 202
                if "read nothing for http.write_timeout" in daemon.log():
                    break
                time.sleep(0.2)
        wait_until(
            lambda: "read nothing for http.write_timeout" in daemon.log(),
            30,
            "the stalled client to be disconnected",
        )
        with daemon.client() as client:
            assert client.get("/healthz").status_code == 200
            wait_until(
                lambda: client.get("/v1/status").json()["attach_streams"] == 0, 10, "no stream"
            )


def test_a_body_declared_over_the_limit_is_refused_before_it_is_sent(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = _daemon(daemons, tmp_path, max_body=1024).start()
    token = (daemon.state / "admin.token").read_text().strip()
    with contextlib.closing(_connect(tmp_path)) as conn:
        conn.sendall(
            b"POST /v1/sessions HTTP/1.1\r\nHost: turnkeeper\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {token}\r\nContent-Length: 1000000000\r\n\r\n".encode()
        )
        conn.settimeout(5.0)
        head = conn.recv(65536)  # no body sent: the answer comes from the header alone
    assert head.startswith(b"HTTP/1.1 413"), head[:100]
    assert b"http.max_body" in head
    with daemon.client() as client:
        assert client.get("/v1/sessions").json()["sessions"] == []
