"""Live attach streams: Server-Sent Events replayed from the database, then live.

The hub signals committed events (their seq and type) to subscribers as they arrive
(from workers over the control plane, and from intake). A stream subscribes first, then
replays the log after the client's `Last-Event-ID`, then, at each signal past what it
sent, reads the new events from the database: a client gets every event once, in order,
and only ever what was stored, whoever sent the signal. A client too slow to keep up is
dropped (it reconnects with Last-Event-ID) instead of being buffered without bound.

The log is read a page at a time (keyset paging on seq), each page read and encoded on a
reader thread (`pages.Pages`); the loop writes each page's bytes in one write, and awaits
the client draining them before it asks for the next page.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

QUEUE_LIMIT = 1000  # live events buffered per stream before the client counts as too slow
KEEPALIVE = 15.0  # seconds between keep-alive comments on an idle stream
IDLE_CHECK = 2.0  # seconds between database checks on an idle stream (writes by others)
PAGE = 500  # events per page of a replay

# (session id, after, limit) -> (the SSE bytes of the next events after `after`, at most
# `limit`, the last seq in them, whether more may follow) (`pages.Pages.sse`)
ReadPage = Callable[[str, int, int], Awaitable[tuple[bytes, int, bool]]]

_CLOSE: dict[str, Any] = {}


@dataclass(eq=False)
class Subscription:
    session_id: str
    principal: str = ""
    queue: asyncio.Queue[dict[str, Any]] = field(default_factory=lambda: asyncio.Queue(QUEUE_LIMIT))
    dropped: bool = False


class Hub:
    """Committed events by session, for the streams attached to them."""

    def __init__(self) -> None:
        self._subs: dict[str, set[Subscription]] = {}
        self._by_principal: dict[str, int] = {}

    def subscribe(self, session_id: str, principal: str = "") -> Subscription:
        sub = Subscription(session_id, principal)
        self._subs.setdefault(session_id, set()).add(sub)
        self._by_principal[principal] = self._by_principal.get(principal, 0) + 1
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.session_id)
        if subs is not None and sub in subs:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.session_id]
            left = self._by_principal.get(sub.principal, 0) - 1
            if left > 0:
                self._by_principal[sub.principal] = left
            else:
                self._by_principal.pop(sub.principal, None)

    def streams_of(self, principal: str) -> int:
        """The attach streams `principal` holds open."""
        return self._by_principal.get(principal, 0)

    def publish(self, session_id: str, event: dict[str, Any]) -> None:
        """Hand a committed event (API shape) to every stream on its session."""
        for sub in list(self._subs.get(session_id, ())):
            try:
                sub.queue.put_nowait(event)
            except asyncio.QueueFull:
                sub.dropped = True
                self.unsubscribe(sub)

    def close_all(self) -> None:
        """End every stream (shutdown)."""
        for subs in list(self._subs.values()):
            for sub in list(subs):
                sub.dropped = True
                with_room(sub.queue)
                sub.queue.put_nowait(_CLOSE)
        self._subs.clear()
        self._by_principal.clear()

    @property
    def streams(self) -> int:
        return sum(len(s) for s in self._subs.values())


def with_room(queue: asyncio.Queue[dict[str, Any]]) -> None:
    """Make room for one more item by dropping the oldest."""
    if queue.full():
        queue.get_nowait()


async def stream(
    request: web.Request,
    session_id: str,
    after: int,
    hub: Hub,
    read: ReadPage,
    *,
    principal: str = "",
) -> web.StreamResponse:
    """Serve one attach stream until the client leaves, is too slow, or we shut down."""
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    sub = hub.subscribe(session_id, principal)  # before the replay: nothing falls between
    try:
        await response.prepare(request)
        last = await _replay(response, session_id, after, read)
        quiet_since = time.monotonic()
        while True:
            try:
                event = await asyncio.wait_for(sub.queue.get(), IDLE_CHECK)
            except TimeoutError:
                if request.transport is None or request.transport.is_closing():
                    break  # the client left; do not wait for a failed write to notice
                sent = await _replay(response, session_id, last, read)
                if sent != last:
                    last, quiet_since = sent, time.monotonic()
                elif time.monotonic() - quiet_since >= KEEPALIVE:
                    await response.write(b": keep-alive\n\n")
                    quiet_since = time.monotonic()
                continue
            if event is _CLOSE or sub.dropped:
                break
            if int(event["seq"]) <= last:
                continue  # already read with an earlier signal
            last = await _replay(response, session_id, last, read)
            quiet_since = time.monotonic()
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        hub.unsubscribe(sub)
    return response


async def _replay(response: web.StreamResponse, session_id: str, after: int, read: ReadPage) -> int:
    """Send every stored event after `after`, page by page; returns the last seq sent."""
    while True:
        body, last, more = await read(session_id, after, PAGE)
        if body:
            await response.write(body)  # waits while the client has not drained it
            after = last
        if not more:
            return after
