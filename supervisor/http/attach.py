"""Live attach streams: Server-Sent Events replayed from the database, then live.

The hub signals committed events (their seq and type) to subscribers as they arrive
(from workers over the control plane, and from intake), and the heads of attached
sessions it reads from the database, for what other hosts commit (`follow.py`: one query
every `IDLE_CHECK` seconds for all of them, on a thread, and none while nobody is
attached). A stream subscribes first, then replays the log after the client's
`Last-Event-ID`, then, at each signal past what it sent, reads the new events from the
database: a client gets every event once, in order, and only ever what was stored,
whoever sent the signal. A read that fails (the database is down) leaves the stream
open and behind: it reads again every `IDLE_CHECK` seconds until it has caught up. A
client too slow to keep up is dropped (it reconnects with Last-Event-ID) instead of
being buffered without bound.

A turn's live output (`bus.Delta`: text the model streams, the name of a tool it calls)
goes to the streams of its session as it comes, in line with the signals, as
`event: delta` with no `id:`: a delta is not an event. It is never stored, so a replay
(`Last-Event-ID`) never holds one, and the committed `model_response` that follows carries
the whole text. A stream holds at most `DELTA_LIMIT` deltas its client has not taken yet;
more are dropped (and counted) rather than buffered, so a slow client never holds up the
turn, the supervisor's loop, or the committed events, which are never dropped for a delta.

The log is read a page at a time (keyset paging on seq), each page read and encoded on a
reader thread (`pages.Pages`); the loop writes each page's bytes in one write, and awaits
the client draining them before it asks for the next page.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from supervisor.contract.background import spawn
from supervisor.contract.clock import SYSTEM, Clock
from supervisor.contract.logs import log
from supervisor.http.follow import READ_ERRORS, Follow, ReadHeads
from supervisor.http.pages import sse_bytes, string
from supervisor.runtime.bus import Delta

QUEUE_LIMIT = 1000  # live events buffered per stream before the client counts as too slow
DELTA_LIMIT = 256  # deltas buffered per stream; more are dropped until the client reads
KEEPALIVE = 15.0  # seconds between keep-alive comments on an idle stream
# Seconds between database reads for writes by others (other hosts): of the heads of the
# attached sessions, and of a stream's log while a read failed. The pool's PROBE.
IDLE_CHECK = 0.25
CLIENT_CHECK = 2.0  # seconds between checks that the client of an idle stream is still there
PAGE = 500  # events per page of a replay

# (session id, after, limit) -> (the SSE bytes of the next events after `after`, at most
# `limit`, the last seq in them, whether more may follow) (`pages.Pages.sse`)
ReadPage = Callable[[str, int, int], Awaitable[tuple[bytes, int, bool]]]

_CLOSE: dict[str, Any] = {}


def _queue() -> asyncio.Queue[dict[str, Any] | Delta]:
    return asyncio.Queue(QUEUE_LIMIT + DELTA_LIMIT)


@dataclass(eq=False)
class Subscription:
    """One stream's place in the hub: the signals and deltas it has yet to send, in the
    order they came; `deltas` of them are deltas."""

    session_id: str
    principal: str = ""
    queue: asyncio.Queue[dict[str, Any] | Delta] = field(default_factory=_queue)
    deltas: int = 0
    dropped: bool = False


class Hub:
    """Committed events by session, for the streams attached to them."""

    def __init__(self, clock: Clock = SYSTEM) -> None:
        self._subs: dict[str, set[Subscription]] = {}
        self._by_principal: dict[str, int] = {}
        self._clock = clock
        self._follow = Follow()
        self._heads: ReadHeads | None = None
        self._follower: asyncio.Task[None] | None = None
        self._failing = False  # the last read of the database failed
        self.log = log("attach")

    @property
    def following(self) -> bool:
        """Whether the hub reads the heads of attached sessions (`follow`)."""
        return self._heads is not None

    def follow(self, heads: ReadHeads) -> None:
        """From now on, read the heads of attached sessions with `heads`, on a thread."""
        self._heads = heads
        self._start()

    def subscribe(self, session_id: str, principal: str = "") -> Subscription:
        sub = Subscription(session_id, principal)
        self._subs.setdefault(session_id, set()).add(sub)
        self._by_principal[principal] = self._by_principal.get(principal, 0) + 1
        self._follow.attach(session_id)
        self._start()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.session_id)
        if subs is not None and sub in subs:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.session_id]
                self._follow.detach(sub.session_id)
                if not self._subs:
                    self._stop()
            left = self._by_principal.get(sub.principal, 0) - 1
            if left > 0:
                self._by_principal[sub.principal] = left
            else:
                self._by_principal.pop(sub.principal, None)

    def streams_of(self, principal: str) -> int:
        """The attach streams `principal` holds open."""
        return self._by_principal.get(principal, 0)

    def publish(self, session_id: str, event: dict[str, Any]) -> None:
        """Signal a committed event (its seq and type) to every stream on its session."""
        self._follow.published(session_id, int(event["seq"]))
        self._signal(session_id, event)

    def _signal(self, session_id: str, event: dict[str, Any]) -> None:
        for sub in list(self._subs.get(session_id, ())):
            if sub.queue.qsize() - sub.deltas >= QUEUE_LIMIT:
                sub.dropped = True  # too slow for the committed events: it resumes later
                self.unsubscribe(sub)
            else:
                sub.queue.put_nowait(event)  # room: at most DELTA_LIMIT of it are deltas

    def delta(self, delta: Delta) -> int:
        """Pass a turn's live output to every stream on its session; returns how many
        streams dropped it (they hold `DELTA_LIMIT` their clients have not taken yet)."""
        dropped = 0
        for sub in self._subs.get(delta.session, ()):
            if sub.deltas >= DELTA_LIMIT:
                dropped += 1
            else:
                sub.deltas += 1
                sub.queue.put_nowait(delta)
        return dropped

    def close_all(self) -> None:
        """End every stream (shutdown)."""
        for subs in list(self._subs.values()):
            for sub in list(subs):
                sub.dropped = True
                with_room(sub.queue)
                sub.queue.put_nowait(_CLOSE)
        self._subs.clear()
        self._by_principal.clear()
        self._follow = Follow()
        self._stop()

    def hang_up(self, principals: Collection[str]) -> int:
        """End the streams of `principals` (a reload revoked or replaced their tokens: a
        stream opened with one must not outlive it); how many there were."""
        ended = [s for subs in self._subs.values() for s in subs if s.principal in principals]
        for sub in ended:
            sub.dropped = True
            with_room(sub.queue)
            sub.queue.put_nowait(_CLOSE)
            self.unsubscribe(sub)
        return len(ended)

    @property
    def streams(self) -> int:
        return sum(len(s) for s in self._subs.values())

    def read_failed(self, exc: BaseException) -> None:
        """A read of the database failed: logged once until a read succeeds."""
        if not self._failing:
            self._failing = True
            self.log.warning(
                "attach streams cannot read the database ({}); trying again every {} s",
                exc,
                IDLE_CHECK,
            )

    def read_ok(self) -> None:
        """A read of the database succeeded."""
        if self._failing:
            self._failing = False
            self.log.info("attach streams read the database again")

    def _start(self) -> None:
        if self._heads is not None and self._follower is None and self._subs:
            self._follower = spawn(self._run(self._heads), name="attach-follow")

    def _stop(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            self._follower = None

    async def _run(self, heads: ReadHeads) -> None:
        """Every `IDLE_CHECK` s, read the heads of the attached sessions due and signal news."""
        while True:
            await self._clock.sleep(IDLE_CHECK)
            due = self._follow.due()
            if not due:
                continue
            try:
                found = await asyncio.to_thread(heads, due)
            except Exception as exc:  # whatever it was, the next tick tries again
                self.read_failed(exc)
                continue
            self.read_ok()
            for session_id, head in self._follow.heads(found):
                self._signal(session_id, {"seq": head, "type": ""})


def with_room(queue: asyncio.Queue[dict[str, Any] | Delta]) -> None:
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
        last, behind = await _replay(response, session_id, after, read, hub)
        quiet_since = SYSTEM.monotonic()
        while True:
            try:
                wait = IDLE_CHECK if behind else CLIENT_CHECK
                event = await asyncio.wait_for(sub.queue.get(), wait)
            except TimeoutError:
                if request.transport is None or request.transport.is_closing():
                    break  # the client left; do not wait for a failed write to notice
                if behind:  # the last read failed: no signal will come for what it missed
                    sent, behind = await _replay(response, session_id, last, read, hub)
                    if sent != last:
                        last, quiet_since = sent, SYSTEM.monotonic()
                if SYSTEM.monotonic() - quiet_since >= KEEPALIVE:
                    await response.write(b": keep-alive\n\n")
                    quiet_since = SYSTEM.monotonic()
                continue
            if event is _CLOSE or sub.dropped:
                break
            if isinstance(event, Delta):
                sub.deltas -= 1
                await response.write(delta_sse(event))  # waits while the client is behind
                quiet_since = SYSTEM.monotonic()
                continue
            if int(event["seq"]) <= last:
                continue  # already read with an earlier signal
            last, behind = await _replay(response, session_id, last, read, hub)
            quiet_since = SYSTEM.monotonic()
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        hub.unsubscribe(sub)
    return response


def delta_sse(delta: Delta) -> bytes:
    """A delta as sent: `event: delta` and its JSON, with no `id:` (it is not an event:
    a client's Last-Event-ID stays the seq of the last committed event it got)."""
    data = (
        f'{{"turn":{string(delta.turn)},"index":{delta.index},"text":{string(delta.text)},'
        f'"tool_call":{"null" if delta.tool_call is None else string(delta.tool_call)}}}'
    )
    return sse_bytes(f"event: delta\ndata: {data}\n\n")


async def _replay(
    response: web.StreamResponse, session_id: str, after: int, read: ReadPage, hub: Hub
) -> tuple[int, bool]:
    """Send every stored event after `after`, page by page: (the last seq sent, whether a
    read failed before the end of the log)."""
    while True:
        try:
            body, last, more = await read(session_id, after, PAGE)
        except READ_ERRORS as exc:
            hub.read_failed(exc)
            return after, True
        hub.read_ok()
        if body:
            await response.write(body)  # waits while the client has not drained it
            after = last
        if not more:
            return after, False
