"""A delivery target for tests and benchmarks: a real HTTP server on loopback.

`Receiver(secret)` listens on 127.0.0.1 in a thread of its own (`ThreadingHTTPServer`,
HTTP/1.0: one connection per request, so nothing outlives a stop). What it does with a
POST is switched while it runs:

    receiver.answer = 200 | 500 | 400 | ...   the status every request is answered with
    receiver.hold()                           requests are recorded, then wait (unanswered)
    receiver.release()                        until this; a held request is then answered
    receiver.stop()                           the socket is closed: connections are refused
    receiver.start()                          serving again, on the same port

While stopped its port stays bound without listening (Linux refuses a connection to such a
socket), so nobody else takes it and a restart gets it back.

Every request is recorded as a `Received`: the raw body, the headers, the parsed document
and whether its signature verifies (`supervisor.deliveries.rules.verify`). `first_seen()`
is the deduplicated view a real receiver keeps by `Idempotency-Key`, in first-receipt
order; `duplicates` counts each key's repeats, `accepted` its 2xx answers. A request
whose body ends before its Content-Length (its sender was killed mid-send) is dropped as
a real server drops it, and only counted (`torn`).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from supervisor.deliveries.rules import SIGNATURE_HEADER, TIMESTAMP_HEADER, verify

SKEW = 300.0  # seconds a signature's timestamp may be off this machine's clock
HOLD_LIMIT = 120.0  # seconds a held request waits at most (a test that forgot to release)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # a held request never blocks a stop
    # The listen backlog (socketserver's default is 5): a sender's burst of connections
    # past it would have its SYNs dropped and retried a second later.
    request_queue_size = 128


@dataclass(frozen=True)
class Received:
    """One request as it arrived."""

    key: str  # its Idempotency-Key ("" if it had none)
    raw: bytes
    headers: dict[str, str]
    document: dict[str, Any]  # the JSON body ({} if it was not a JSON object)
    verified: bool  # the signature matches the body and the timestamp is fresh
    at: float  # time.time() of its receipt
    path: str = "/"

    @property
    def session(self) -> str:
        return str(self.document.get("session", ""))

    @property
    def seq(self) -> int:
        return int(self.document.get("seq", 0))


@dataclass
class _State:
    answer: int = 200
    held: threading.Event = field(default_factory=threading.Event)  # set: answer at once
    waiting: int = 0  # requests held now
    records: list[Received] = field(default_factory=list)
    first: dict[str, Received] = field(default_factory=dict)
    duplicates: Counter[str] = field(default_factory=Counter)
    accepted: Counter[str] = field(default_factory=Counter)  # 2xx answers given, per key
    first_accepted: dict[str, float] = field(default_factory=dict)  # key: time of its first 2xx
    torn: int = 0  # requests whose body ended before its Content-Length (a killed sender)


class Receiver:
    """A target that records what it is sent (see the module's docstring)."""

    def __init__(self, secret: bytes | str, port: int = 0) -> None:
        self.secret = secret.encode() if isinstance(secret, str) else secret
        self._lock = threading.Lock()
        self._state = _State()
        self._state.held.set()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._placeholder: socket.socket | None = None
        self.port = port

    # --- running ----------------------------------------------------------------------

    def start(self) -> Receiver:
        """Serve (again, on the same port once it had one)."""
        if self._server is not None:
            return self
        if self._placeholder is not None:
            self._placeholder.close()
            self._placeholder = None
        server = _Server(("127.0.0.1", self.port), self._handler())
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the socket: connections are refused until `start()`. The port is kept."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(10)
        placeholder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        placeholder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        placeholder.bind(("127.0.0.1", self.port))  # bound, not listening: refused
        self._placeholder = placeholder

    def close(self) -> None:
        """Stop for good: held requests are let go, the port is given back."""
        self.release()
        self.stop()
        if self._placeholder is not None:
            self._placeholder.close()
            self._placeholder = None

    def __enter__(self) -> Receiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    # --- what it answers ------------------------------------------------------------

    @property
    def answer(self) -> int:
        return self._state.answer

    @answer.setter
    def answer(self, status: int) -> None:
        self._state.answer = status

    def hold(self) -> None:
        """Record each request, then keep it waiting for `release()` (or HOLD_LIMIT)."""
        self._state.held.clear()

    def release(self) -> None:
        self._state.held.set()

    @property
    def waiting(self) -> int:
        """Requests held unanswered now."""
        with self._lock:
            return self._state.waiting

    # --- what it was sent -----------------------------------------------------------

    @property
    def records(self) -> list[Received]:
        """Every request, in order of receipt (duplicates included)."""
        with self._lock:
            return list(self._state.records)

    def first_seen(self) -> list[Received]:
        """One request per Idempotency-Key, the first of each, in order of receipt."""
        with self._lock:
            return list(self._state.first.values())

    @property
    def duplicates(self) -> Counter[str]:
        """Each key's requests after its first."""
        with self._lock:
            return Counter(self._state.duplicates)

    @property
    def accepted(self) -> Counter[str]:
        """Each key's requests answered 2xx (more than one: the sender did not hear it)."""
        with self._lock:
            return Counter(self._state.accepted)

    def accepted_at(self, key: str) -> float | None:
        """When `key` was first answered 2xx (before the answer was sent), None if never."""
        with self._lock:
            return self._state.first_accepted.get(key)

    @property
    def torn(self) -> int:
        """Requests cut off before their whole body came: dropped, neither recorded nor
        answered, as a real server drops a broken request."""
        with self._lock:
            return self._state.torn

    def keys(self) -> set[str]:
        with self._lock:
            return set(self._state.first)

    def _record(self, path: str, headers: dict[str, str], raw: bytes) -> Received:
        lowered = {k.lower(): v for k, v in headers.items()}
        try:
            document = json.loads(raw)
        except ValueError:
            document = None
        try:
            stamp = int(lowered.get(TIMESTAMP_HEADER.lower(), ""))
        except ValueError:
            stamp = 0
        given = lowered.get(SIGNATURE_HEADER.lower(), "")
        received = Received(
            key=lowered.get("idempotency-key", ""),
            raw=raw,
            headers=headers,
            document=document if isinstance(document, dict) else {},
            verified=bool(given) and verify(self.secret, stamp, raw, given, time.time(), SKEW),
            at=time.time(),
            path=path,
        )
        with self._lock:
            self._state.records.append(received)
            if received.key in self._state.first:
                self._state.duplicates[received.key] += 1
            else:
                self._state.first[received.key] = received
        return received

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                if len(raw) < length:  # the sender died mid-request
                    with receiver._lock:
                        receiver._state.torn += 1
                    self.close_connection = True
                    return
                received = receiver._record(self.path, dict(self.headers.items()), raw)
                state = receiver._state
                if not state.held.is_set():
                    with receiver._lock:
                        state.waiting += 1
                    try:
                        state.held.wait(HOLD_LIMIT)
                    finally:
                        with receiver._lock:
                            state.waiting -= 1
                status = state.answer
                if 200 <= status < 300:
                    with receiver._lock:
                        state.accepted[received.key] += 1
                        state.first_accepted.setdefault(received.key, time.time())
                with contextlib.suppress(OSError):  # the sender may have gone (killed)
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"{}")

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet: the records are the log

        return Handler
