"""A session's log read and encoded for the wire off the event loop, a page at a time.

Each page is one query (`EventRows.batches`) and one encoding, both on a small pool of
reader threads of its own: the event loop only writes the ready bytes, and the other
requests' database calls (on the loop's default executor) never queue behind replays. The
pool's size bounds how many pages are read at once, whatever the number of attach streams;
a stream waits for its next page in line with the others, so many replays share the
readers page by page.

A reader holds the GIL while it works, and the event loop and the threads serving other
requests need it too; CPython hands it over when its holder blocks, or else only after the
switch interval (5 ms). So a reader pauses briefly (the GIL released) between batches of
rows: a thread waiting for the GIL gets it within one batch's work instead of after a whole
page. That costs replays some throughput, no CPU, and nothing to pages of one batch (a live
stream's new events).

An event is encoded from its row as it was stored: the payload is the stored JSON text,
put into the event's JSON as is (no parse, no second encoding). The result is the API
shape of an event (`schemas.EventOut`): seq, type, turn_id, payload, created_at.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

from supervisor.contract.clock import SYSTEM
from supervisor.store.reading import EventRow

# Pages read and encoded at once, across every stream and request. One: the work holds
# the GIL, so a second reader would add no throughput, only more waits for the GIL.
READERS = 1
SSE_BUDGET = 1 << 20  # payload characters per page of a stream (at least one event)
PAUSE_S = 0.0001  # a reader's pause between batches of rows (`reading.FETCH`)

string = json.JSONEncoder(ensure_ascii=False).encode  # a str as JSON (UTF-8)
_LINE_ENDS = (("\x85", "\\u0085"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))

# (session id, after, limit, budget) -> the rows in batches (`EventRows.batches`)
ReadRows = Callable[[str, int, int, int | None], Iterable[list[EventRow]]]
PageKey = tuple[str, int, int]  # session id, after, limit
SsePage = tuple[bytes, int, bool]  # the SSE bytes, the last seq in them, whether more may follow


def event_json(row: EventRow) -> str:
    """The API shape of an event as JSON text (UTF-8; the payload as stored)."""
    seq, kind, turn_id, payload, created_at = row
    turn = "null" if turn_id is None else string(turn_id)
    return (
        f'{{"seq":{seq},"type":{string(kind)},"turn_id":{turn},'
        f'"payload":{payload},"created_at":{created_at!r}}}'
    )


def sse_text(rows: list[EventRow]) -> str:
    """Events in SSE form, before the escapes of `sse_bytes`: id is the seq, event the
    type, data the JSON event."""
    return "".join(f"id: {row[0]}\nevent: {row[1]}\ndata: {event_json(row)}\n\n" for row in rows)


def sse_bytes(text: str) -> bytes:
    """SSE text as sent. JSON escapes every control character but NEL, LINE SEPARATOR and
    PARAGRAPH SEPARATOR, which clients that split lines the way `str.splitlines` does
    (httpx's `iter_lines`) take for line ends: they are escaped too. They occur only
    inside JSON strings there, so the data is the same JSON."""
    for char, escaped in _LINE_ENDS:
        if char in text:
            text = text.replace(char, escaped)
    return text.encode()


def sse_body(rows: list[EventRow]) -> bytes:
    """Events in SSE form, as sent."""
    return sse_bytes(sse_text(rows))


def json_body(rows: list[EventRow]) -> bytes:
    """`{"events": [...]}` (`schemas.EventList`)."""
    return ('{"events":[' + ",".join(event_json(row) for row in rows) + "]}").encode()


def paced(batches: Iterable[list[EventRow]]) -> Iterator[list[EventRow]]:
    """`batches`, with a pause (`PAUSE_S`, the GIL released) before each one but the first."""
    for i, rows in enumerate(batches):
        if i:
            SYSTEM.sleep_blocking(PAUSE_S)
        yield rows


class Pages:
    """Reads and encodes pages of events on `readers` threads of its own.

    Streams that ask for the same page (session, after, limit) while it waits for a reader
    share one read: the streams of a session woken by one commit, or replaying it from the
    same point. A read that has started is never joined, so what a stream gets is read
    after it asked.
    """

    def __init__(self, read: ReadRows, readers: int = READERS) -> None:
        self._read = read
        self._pool = ThreadPoolExecutor(readers, thread_name_prefix="turnkeeper-pages")
        self._waiting: dict[PageKey, asyncio.Future[SsePage]] = {}  # not started yet
        self._lock = threading.Lock()
        self.reads = 0  # pages read for streams

    async def sse(self, session_id: str, after: int, limit: int) -> SsePage:
        """(the SSE bytes of the next events after `after`, the last seq in them, whether
        more may follow): at most `limit` events, fewer when their payloads are large."""
        key = (session_id, after, limit)
        with self._lock:
            page = self._waiting.get(key)
            if page is None:
                loop = asyncio.get_running_loop()
                page = loop.run_in_executor(self._pool, self._sse_page, key)
                self._waiting[key] = page
        # Shielded: a stream that goes away does not cancel the read for the others.
        return await asyncio.shield(page)

    async def json(self, session_id: str, after: int, limit: int) -> bytes:
        """The events after `after` (at most `limit`) as an `EventList` JSON body."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._json_page, session_id, after, limit)

    def _sse_page(self, key: PageKey) -> SsePage:
        with self._lock:
            del self._waiting[key]  # started: from now on, a stream asking reads anew
            self.reads += 1
        session_id, after, limit = key
        parts: list[str] = []
        last, count, size = after, 0, 0
        for rows in paced(self._read(session_id, after, limit, SSE_BUDGET)):
            parts.append(sse_text(rows))
            last, count = rows[-1][0], count + len(rows)
            size += sum(len(row[3]) for row in rows)
        if not count:
            return b"", after, False
        return sse_bytes("".join(parts)), last, count == limit or size >= SSE_BUDGET

    def _json_page(self, session_id: str, after: int, limit: int) -> bytes:
        batches = paced(self._read(session_id, after, limit, None))
        return json_body([row for rows in batches for row in rows])

    def close(self) -> None:
        """Stop the reader threads once the pages asked for are done."""
        self._pool.shutdown(wait=False)

    async def cleanup(self, app: object) -> None:
        """`close`, as an aiohttp `on_cleanup` callback (the handlers are done by then)."""
        self.close()
