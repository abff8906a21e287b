"""The HTTP listener: aiohttp's server with the limits a daemon facing untrusted clients needs.

- A connection that has not sent a whole request head within `http.read_timeout` (from
  its start, or from its previous response) is closed; a body gets the same time
  (`Api._body`), and so does what is left of a body after an early answer. A client
  trickling bytes cannot hold a connection for long.
- At most `http.max_connections` connections are open (fewer when the file descriptor
  limit cannot hold that many: `supervisor.core.descriptors`). A connection over that
  evicts the one idle longest: no request in flight (an attach stream is a request in
  flight), by the time of the last bytes it sent. Only when every connection has a
  request in flight is the new one closed instead. An idle client cannot lock the admin
  or `/healthz` out.
- Out of file descriptors at `accept` all the same (EMFILE, ENFILE: a limit lowered under
  the running daemon, a host's table full), the listener stops accepting for a second
  (asyncio's `ACCEPT_RETRY_DELAY`) and tries again, and says so in one line at once and
  then at most one a minute, with how often it happened since (`_ListeningSocket`,
  `Starvation`). The clients waiting meanwhile stay in the kernel's backlog.
- A client that reads nothing of what it is sent for `http.write_timeout` (the transport's
  buffer stays full: asyncio paused the writing) is disconnected; the handler writing to
  it ends with the connection.
- A request aiohttp's parser rejects (oversized headers, bad framing) is answered with
  the API's JSON error body, and logged as one line, at most `LOG_BURST` lines per
  `LOG_WINDOW` seconds: these clients are not authenticated, and must not fill the log.
"""

from __future__ import annotations

import asyncio
import errno
import json
import socket
from collections.abc import Callable
from http import HTTPStatus
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from supervisor.contract.clock import SYSTEM
from supervisor.contract.config import HttpConfig
from supervisor.contract.logs import log
from supervisor.core.descriptors import Tally

LOG_BURST = 10  # refused-request lines logged per window...
LOG_WINDOW = 60.0  # ...of this many seconds; the rest are counted and summed up


class RateLimitedLog:
    """At most `burst` lines per `window` seconds; the next line after says how many were not.

    Pure apart from the `emit` callable; the clock is passed in.
    """

    def __init__(
        self, emit: Callable[[str], None], burst: int = LOG_BURST, window: float = LOG_WINDOW
    ) -> None:
        self.emit, self.burst, self.window = emit, burst, window
        self._window_start = float("-inf")
        self._lines = 0
        self.suppressed = 0

    def __call__(self, line: str, now: float) -> bool:
        """Log `line` unless the window's lines are spent; True if it was logged."""
        if now - self._window_start >= self.window:
            if self.suppressed:
                self.emit(f"{self.suppressed} more refused requests were not logged")
            self._window_start, self._lines, self.suppressed = now, 0, 0
        if self._lines >= self.burst:
            self.suppressed += 1
            return False
        self._lines += 1
        self.emit(line)
        return True


ExceptionHandler = Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object]

# What asyncio's accept treats as "out of resources": stop accepting for a while.
STARVED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
STARVED_MESSAGE = "socket.accept() out of system resource"  # asyncio's context message


class _ListeningSocket(socket.socket):
    """A listening socket whose `accept`, out of descriptors, fails once per wake-up.

    asyncio's selector loop (CPython 3.11, `BaseSelectorEventLoop._accept_connection`)
    accepts up to `backlog` connections each time the socket is readable. On EMFILE it
    reports the error to the loop's exception handler, stops watching the socket and
    schedules a retry in `ACCEPT_RETRY_DELAY` (1 s), but goes on with the rest of the
    backlog: each further accept fails the same way, is reported (with a traceback, by
    default) and schedules one more retry, 128 reports a second and retries that pile up.
    After one failure this socket answers "nothing to accept" until the loop's next turn,
    so each wake-up ends with one report and one retry.
    """

    _resting = False

    def accept(self) -> tuple[socket.socket, Any]:
        if self._resting:
            raise BlockingIOError(errno.EAGAIN, "not accepting until the retry")
        try:
            return super().accept()
        except OSError as exc:
            if exc.errno in STARVED:
                self._resting = True
                asyncio.get_running_loop().call_soon(self._wake)
            raise

    def _wake(self) -> None:
        self._resting = False


class Starvation:
    """The loop's exception handler while the listener serves: asyncio's report of an
    accept out of descriptors becomes one line a minute (`Tally`) with no traceback, every
    other report goes where it went before."""

    def __init__(self, previous: ExceptionHandler | None) -> None:
        self.previous = previous
        self.tally = Tally()

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if (
            context.get("message") == STARVED_MESSAGE
            and isinstance(exc, OSError)
            and exc.errno in STARVED
        ):
            self.note(exc, SYSTEM.monotonic())
        elif self.previous is not None:
            self.previous(loop, context)
        else:
            loop.default_exception_handler(context)

    def note(self, exc: OSError, now: float) -> None:
        """Count one failed accept; log a line if one is due."""
        count = self.tally.note(now)
        if count is None:
            return
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        short = "file descriptors" if exc.errno in (errno.EMFILE, errno.ENFILE) else "memory"
        log("http").warning(
            "out of {} accepting connections ({}: {}){}: accept pauses a second each time "
            "and the clients wait in the backlog; told at most once a minute (see "
            "`turnkeeper doctor`)",
            short,
            name,
            exc.strerror or exc,
            "" if count == 1 else f", {count} times since the last line",
        )


class _Limits:
    def __init__(
        self, config: HttpConfig, evicted: Callable[[], None], max_connections: int
    ) -> None:
        self.max_connections = max_connections
        self.write_timeout = config.write_timeout
        self.evicted = evicted  # counts an eviction (the metric)
        self.refused = RateLimitedLog(log("http").warning)


class _Handler(RequestHandler):
    """aiohttp's connection handler, with a connection cap that evicts the idlest, a write
    timeout and JSON error bodies."""

    __slots__ = ("_heard_at", "_limits", "_stalled")

    def __init__(self, manager: web.Server, limits: _Limits, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._limits = limits
        self._heard_at = 0.0  # the loop's time of the last bytes the client sent
        self._stalled: asyncio.TimerHandle | None = None  # the write timeout, while paused

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        now = SYSTEM.monotonic()
        self._heard_at = now
        manager = self._manager
        if manager is None or len(manager.connections) <= self._limits.max_connections:
            return
        idle = [
            other
            for other in manager.connections
            if isinstance(other, _Handler) and other is not self and other.idle
        ]
        limit = self._limits.max_connections
        if idle:
            victim = min(idle, key=lambda other: other._heard_at)
            victim.force_close()
            self._limits.evicted()
            self._limits.refused(
                f"evicted the connection idle longest ({now - victim._heard_at:.0f} s): "
                f"http.max_connections ({limit}) were open",
                now,
            )
            return
        self._limits.refused(
            f"refused a connection: http.max_connections ({limit}) are open, each with a "
            "request in flight",
            now,
        )
        self.force_close()

    @property
    def idle(self) -> bool:
        """No request in flight: waiting for a request head (or the rest of one)."""
        return not self._request_in_progress and self.transport is not None

    def data_received(self, data: bytes) -> None:
        self._heard_at = SYSTEM.monotonic()
        super().data_received(data)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stalled is None:
            loop = asyncio.get_running_loop()
            self._stalled = loop.call_later(self._limits.write_timeout, self._write_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None
        super().connection_lost(exc)

    def _write_timed_out(self) -> None:
        self._stalled = None
        self._limits.refused(
            f"disconnected a client that read nothing for http.write_timeout "
            f"({self._limits.write_timeout:g} s)",
            SYSTEM.monotonic(),
        )
        if self.transport is not None:
            self.transport.abort()  # its buffer would never drain: no graceful close

    def log_exception(self, *args: Any, **kw: Any) -> None:
        """aiohttp's own failures (a body that broke while it was drained, say): one line."""
        exc = kw.get("exc_info")
        text = " ".join(str(exc or (args[0] if args else "")).split())[:200]
        self._limits.refused(
            f"a connection failed: {type(exc).__name__ if exc else 'error'}: {text}",
            SYSTEM.monotonic(),
        )

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """The API's error body for a request that never reached a handler."""
        if request.writer.output_size > 0:
            raise ConnectionError("the response was already started")
        if status >= 500:
            log("http").opt(exception=exc).error("{} {} failed", request.method, request.path)
            code, text = "internal", "internal error; see the daemon's log"
        else:
            reason = " ".join((message or HTTPStatus(status).phrase).split())[:200]
            self._limits.refused(
                f"refused a malformed request ({status}): {reason}",
                SYSTEM.monotonic(),
            )
            code, text = "bad_request", f"the request cannot be read: {reason}"
        body = json.dumps({"error": {"code": code, "message": text}})
        response = web.Response(status=status, text=body, content_type="application/json")
        response.force_close()
        return response


class Listener:
    """The API's aiohttp application served on `http.listen`, with the limits above.

    `max_connections`: the cap in force, `http.max_connections` unless the file descriptor
    limit holds fewer (`supervisor.core.descriptors.cap`); `set_max_connections` moves it.
    """

    def __init__(
        self,
        app: web.Application,
        config: HttpConfig,
        shutdown_timeout: float,
        evicted: Callable[[], None] = lambda: None,
        max_connections: int | None = None,
    ):
        self.config = config
        self.limits = _Limits(config, evicted, max_connections or config.max_connections)
        # aiohttp's keep-alive timer closes a connection that is waiting for a request
        # head; armed at the connection's start and after each response, it is the
        # read timeout for request heads.
        # After an answer sent before the body was read (413, 408), aiohttp reads what is
        # left for `lingering_time` so the client sees the answer; no longer than a read.
        self._handler_options: dict[str, Any] = {
            "keepalive_timeout": config.read_timeout,
            "lingering_time": min(10.0, config.read_timeout),
            "access_log": None,
        }
        self.runner = web.AppRunner(
            app, shutdown_timeout=shutdown_timeout, handle_signals=False, **self._handler_options
        )
        self._servers: list[asyncio.AbstractServer] = []
        self._socket_path: Path | None = None
        self._starvation: Starvation | None = None

    @property
    def max_connections(self) -> int:
        """The connections served at most now."""
        return self.limits.max_connections

    def set_max_connections(self, count: int) -> None:
        """Serve at most `count` connections from now on (those open above it stay)."""
        self.limits.max_connections = count

    async def start(self, where: tuple[str, int] | Path) -> None:
        """Listen on (host, port) or a unix socket path (made 0600). Raises OSError."""
        await self.runner.setup()
        manager = self.runner.server
        assert manager is not None
        loop = asyncio.get_running_loop()
        limits = self.limits

        def protocol() -> _Handler:
            return _Handler(manager, limits, loop=loop, **self._handler_options)

        try:
            if isinstance(where, Path):
                sockets = [_bind_unix(where)]
                self._socket_path = where
            else:
                sockets = await _bind_tcp(loop, *where)
            for sock in sockets:
                self._servers.append(await loop.create_server(protocol, sock=sock, backlog=128))
        except OSError:
            for server in self._servers:
                server.close()
            await self.runner.cleanup()
            raise
        self._starvation = Starvation(loop.get_exception_handler())
        loop.set_exception_handler(self._starvation)

    async def cleanup(self) -> None:
        """Stop listening, end the streams, close the connections gracefully."""
        for server in self._servers:
            server.close()
        await self.runner.cleanup()
        if self._socket_path is not None:
            self._socket_path.unlink(missing_ok=True)
        loop = asyncio.get_running_loop()
        if self._starvation is not None and loop.get_exception_handler() is self._starvation:
            loop.set_exception_handler(self._starvation.previous)


def _bind_unix(path: Path) -> socket.socket:
    """A listening socket at `path` (0600), replacing a stale one. Raises OSError."""
    path.unlink(missing_ok=True)
    sock = _ListeningSocket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        path.chmod(0o600)
    except OSError:
        sock.close()
        raise
    return sock


async def _bind_tcp(loop: asyncio.AbstractEventLoop, host: str, port: int) -> list[socket.socket]:
    """A listening socket on every address `host` resolves to, as asyncio's create_server
    binds them (SO_REUSEADDR; an IPv6 one for IPv6 only). Raises OSError naming the
    address."""
    found = await loop.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(found):
            sock = _ListeningSocket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                reason = (exc.strerror or str(exc)).lower()
                raise OSError(
                    exc.errno, f"error while attempting to bind on address {address!r}: {reason}"
                ) from None
    except BaseException:
        for made in sockets:
            made.close()
        raise
    return sockets
