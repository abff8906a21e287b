"""Replaying a session's log over HTTP: page by page, every event once, in order.

The attach stream and the events route read the log a page at a time (one keyset query
each) and encode the rows as stored. Against a real daemon: a log longer than a page is
replayed whole, resumed from a Last-Event-ID in the middle of a page and at a page's edge,
then goes live; events too large for one page's budget are split over more pages. On
each backend: the pages the store reads, and their encoding, are the API shape of the
events that were committed.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from supervisor.http import attach
from supervisor.http.pages import SSE_BUDGET, Pages, event_json, json_body, sse_body
from supervisor.store import Store
from supervisor.store.reading import EventRow, EventRows
from tests.conftest import BACKENDS
from tests.daemon import daemons, events
from tests.http.test_api import (
    Api,
    Attach,
    check_stream_events,
    contiguous,
    create_session,
    inject,
    parse_sse,
    start,
)

__all__ = ["daemons", "start"]  # the fixtures

LONG = 2 * attach.PAGE + 234  # three pages, the last one short


def fill(store: Store, session_id: str, count: int, size: int = 0) -> None:
    """Append `count` events that ask for no turn: model responses, tool calls, results.

    Their text holds what SSE framing must survive: newlines, a `data:` line, non-ASCII.
    """
    futures = []
    for i in range(count):
        kind = ("model_response", "tool_call", "tool_result")[i % 3]
        text = f"{i}: line\n\ndata: {{not an event}}\r\n é ✓ \u2028\x85 " + "x" * size
        futures.append(
            store.events.submit(
                session_id,
                kind,
                {"text": text, "n": i, "nested": {"ok": i % 2 == 0, "v": [1.5, None]}},
                turn_id=None if i % 5 == 0 else f"{i // 3:032x}",
                writer="cli",
            )
        )
    for future in futures:
        future.result()


def stored(api: Api, session_id: str) -> list[dict[str, Any]]:
    with api.store() as store:
        return [e.to_dict() for e in events(store, session_id)]


def history(client: httpx.Client, session_id: str, after: int, limit: int) -> list[Any]:
    answer = client.get(
        f"/v1/sessions/{session_id}/events", params={"after": after, "limit": limit}
    )
    assert answer.status_code == 200, answer.text
    assert answer.headers["Content-Type"].startswith("application/json")
    found: list[Any] = answer.json()["events"]
    return found


def test_a_log_longer_than_a_page_replays_once_in_order_resumes_mid_page_and_goes_live(
    start: Callable[..., Api],
) -> None:
    api = start()
    alice = api.client("alice")
    sid = create_session(alice, title="long")
    with api.store() as store:
        fill(store, sid, LONG)
    expected = stored(api, sid)
    assert len(expected) == LONG

    # From the start: three pages, every event once, in order, as stored.
    stream = Attach(api, "alice", sid, **{"Last-Event-ID": "0"})
    got = stream.take(LONG)
    check_stream_events(got)
    assert [e.data for e in got] == expected
    assert stream.quiet(1.0) == [], "the replay sent an event twice"

    # Then live on the same stream: the turn of a new message, after the replayed log.
    assert inject(alice, sid, "live") == LONG + 1
    live = stream.until("turn_ended")
    assert contiguous(live, LONG + 1), [e.id for e in live]
    stream.close()
    expected = stored(api, sid)
    assert [e.data for e in live] == expected[LONG:]

    # Resumed in the middle of a page, at a page's edge, and at the end.
    for last in (attach.PAGE + 230, attach.PAGE, 2 * attach.PAGE - 1):
        again = Attach(api, "alice", sid, **{"Last-Event-ID": str(last)})
        replayed = again.take(len(expected) - last)
        assert [e.data for e in replayed] == expected[last:], last
        assert again.quiet(0.5) == [], last
        again.close()
    caught_up = Attach(api, "alice", sid, **{"Last-Event-ID": str(len(expected))})
    assert caught_up.quiet(0.5) == []
    seq = inject(alice, sid, "after the end")
    assert seq == len(expected) + 1
    assert caught_up.take(1)[0].id == seq
    caught_up.until("turn_ended")  # its turn ends before the log is read twice below
    caught_up.close()

    # The events route: keyset pages, the same events as the stream.
    assert history(alice, sid, 0, 1000) + history(alice, sid, 1000, 1000) == stored(api, sid)
    assert [e["seq"] for e in history(alice, sid, attach.PAGE + 230, 7)] == list(
        range(attach.PAGE + 231, attach.PAGE + 238)
    )
    assert history(alice, sid, 10**9, 5) == []


def test_events_larger_than_a_page_budget_are_split_over_pages_and_all_arrive(
    start: Callable[..., Api],
) -> None:
    api = start()
    admin = api.client("admin")
    sid = create_session(admin, title="large")
    per_event = SSE_BUDGET // 3 + 1000  # three of them are over a page's budget
    count = 10
    with api.store() as store:
        fill(store, sid, count, size=per_event)
    expected = stored(api, sid)
    stream = Attach(api, "admin", sid)
    got = stream.take(count)
    assert [e.data for e in got] == expected
    assert stream.quiet(0.5) == []
    stream.close()
    again = Attach(api, "admin", sid, **{"Last-Event-ID": "4"})
    assert [e.data for e in again.take(count - 4)] == expected[4:]
    again.close()


def test_a_page_says_whether_more_may_follow() -> None:
    small = [(seq, "notice", None, f'{{"n": {seq}}}', 1.5) for seq in range(1, 8)]
    large = [(seq, "notice", None, "[" + " " * SSE_BUDGET + "]", 1.5) for seq in (8, 9)]
    log = small + large

    def read(session_id: str, after: int, limit: int, budget: int | None) -> list[list[EventRow]]:
        found: list[EventRow] = []
        for row in [row for row in log if row[0] > after][:limit]:
            found.append(row)
            if budget is not None and sum(len(r[3]) for r in found) >= budget:
                break
        return [batch for batch in (found[:1], found[1:]) if batch]  # in two batches

    async def pages_after(pages: Pages, *afters: int) -> list[tuple[int, bool]]:
        try:
            return [(last, more) for _, last, more in [await pages.sse("s", a, 3) for a in afters]]
        finally:
            pages.close()

    # A full page, a page cut short by its budget: more may follow. A short page: the end.
    got = asyncio.run(pages_after(Pages(read), 0, 3, 6, 8, 9))
    assert got == [(3, True), (6, True), (8, True), (9, True), (9, False)]
    log = small
    assert asyncio.run(pages_after(Pages(read), 6, 7)) == [(7, False), (7, False)]


def test_streams_asking_for_a_waiting_page_share_one_read() -> None:
    release = threading.Event()
    asked: list[tuple[str, int]] = []

    def read(session_id: str, after: int, limit: int, budget: int | None) -> list[list[EventRow]]:
        asked.append((session_id, after))
        if session_id == "busy":
            release.wait(30)  # holds the only reader: the pages asked for next wait
        return [[(after + 1, "notice", None, "{}", 1.5)]]

    async def go() -> None:
        pages = Pages(read, readers=1)
        try:
            busy = asyncio.ensure_future(pages.sse("busy", 0, 10))
            while not asked:
                await asyncio.sleep(0.01)
            same = [asyncio.ensure_future(pages.sse("s", 5, 10)) for _ in range(3)]
            different = asyncio.ensure_future(pages.sse("s", 6, 10))
            await asyncio.sleep(0)
            same[0].cancel()  # a stream that left does not cancel the others' read
            release.set()
            await busy
            got = await asyncio.gather(*same[1:], different)
            assert [last for _, last, _ in got] == [6, 6, 7]
            assert got[0] == got[1]
            assert same[0].cancelled()
            assert asked == [("busy", 0), ("s", 5), ("s", 6)]
            await pages.sse("s", 5, 10)  # the read is over: asking again reads again
            assert asked[-1] == ("s", 5) and pages.reads == 4
        finally:
            release.set()
            pages.close()

    asyncio.run(go())


# --- the store's pages and their encoding, on every backend ------------------------------


@pytest.mark.parametrize("db_url", BACKENDS, indirect=True)
def test_pages_are_keyset_slices_of_the_log_and_encode_to_the_api_shape(store: Store) -> None:
    sid = store.sessions.create("alice").id
    other = store.sessions.create("bob").id
    fill(store, sid, 25)
    fill(store, other, 3)
    records = store.events.read(sid, 0, 100)
    rows = EventRows(store.db)

    pages = [rows.page(sid, after, 10) for after in (0, 10, 20, 25)]
    assert [[r[0] for r in page] for page in pages] == [
        list(range(1, 11)),
        list(range(11, 21)),
        list(range(21, 26)),
        [],
    ]
    whole = rows.page(sid, 0, 100)
    assert [r[0] for r in rows.page(sid, 7, 3)] == [8, 9, 10]  # resumed mid-page
    for row, record in zip(whole, records, strict=True):
        seq, kind, turn_id, payload, created_at = row
        assert (type(seq), type(created_at)) == (int, float)
        assert (seq, kind, turn_id, created_at) == (
            record.seq,
            record.type,
            record.turn_id,
            record.created_at,
        )
        assert json.loads(payload) == record.payload
        assert json.loads(event_json(row)) == record.to_dict()

    # A budget stops a page early, never before its first row.
    assert [r[0] for r in rows.page(sid, 0, 100, budget=1)] == [1]
    size = len(whole[0][3]) + len(whole[1][3])
    assert [r[0] for r in rows.page(sid, 0, 100, budget=size)] == [1, 2]
    assert [r[0] for r in rows.page(sid, 0, 100, budget=10**9)] == list(range(1, 26))

    # The bodies: `{"events": [...]}` and SSE, each the API shape of every event.
    assert json.loads(json_body(whole)) == {"events": [r.to_dict() for r in records]}
    assert json.loads(json_body([])) == {"events": []}
    text = sse_body(whole).decode()
    assert text.endswith("\n\n")
    sse = list(parse_sse(text.split("\n")))
    assert [(e.id, e.event, e.data) for e in sse] == [(r.seq, r.type, r.to_dict()) for r in records]
