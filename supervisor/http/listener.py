"""The HTTP listener: aiohttp's server with the limits a daemon facing untrusted clients needs.

- A connection that has not sent a whole request head within `http.read_timeout` (from
  its start, or from its previous response) is closed; a body gets the same time
  (`Api._body`), and so does what is left of a body after an early answer. A client
  trickling bytes cannot hold a connection for long.
- At most `http.max_connections` connections are open. A connection over that evicts the
  one idle longest: no request in flight (an attach stream is a request in flight), by
  the time of the last bytes it sent. Only when every connection has a request in flight
  is the new one closed instead. An idle client cannot lock the admin or `/healthz` out.
- A client that reads nothing of what it is sent for `http.write_timeout` (the transport's
  buffer stays full: asyncio paused the writing) is disconnected; the handler writing to
  it ends with the connection.
- A request aiohttp's parser rejects (oversized headers, bad framing) is answered with
  the API's JSON error body, and logged as one line, at most `LOG_BURST` lines per
  `LOG_WINDOW` seconds: these clients are not authenticated, and must not fill the log.
"""

from __future__ import annotations

import asyncio
import json
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


class _Limits:
    def __init__(self, config: HttpConfig, evicted: Callable[[], None]) -> None:
        self.max_connections = config.max_connections
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
    """The API's aiohttp application served on `http.listen`, with the limits above."""

    def __init__(
        self,
        app: web.Application,
        config: HttpConfig,
        shutdown_timeout: float,
        evicted: Callable[[], None] = lambda: None,
    ):
        self.config = config
        self.evicted = evicted
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
        self._server: asyncio.AbstractServer | None = None
        self._socket_path: Path | None = None

    async def start(self, where: tuple[str, int] | Path) -> None:
        """Listen on (host, port) or a unix socket path (made 0600). Raises OSError."""
        await self.runner.setup()
        manager = self.runner.server
        assert manager is not None
        loop = asyncio.get_running_loop()
        limits = _Limits(self.config, self.evicted)

        def protocol() -> _Handler:
            return _Handler(manager, limits, loop=loop, **self._handler_options)

        try:
            if isinstance(where, Path):
                where.unlink(missing_ok=True)
                self._server = await loop.create_unix_server(protocol, str(where), backlog=128)
                self._socket_path = where
                where.chmod(0o600)
            else:
                self._server = await loop.create_server(
                    protocol, where[0], where[1], backlog=128, reuse_address=True
                )
        except OSError:
            await self.runner.cleanup()
            raise

    async def cleanup(self) -> None:
        """Stop listening, end the streams, close the connections gracefully."""
        if self._server is not None:
            self._server.close()
        await self.runner.cleanup()
        if self._socket_path is not None:
            self._socket_path.unlink(missing_ok=True)
