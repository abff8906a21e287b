"""The API answers while replays are held between pages.

The aiohttp application runs in this process on a real SQLite store, with its page reader
wrapped in a gate: every replay gets its first page, then its next read waits at the gate,
on a reader thread. Meanwhile another session is written, read and listed, and the status
counts the streams. Then the gate opens and every stream gets the whole log once, in
order, and goes live. Held: one stream on the shipped reader pool, and ten streams on ten
readers, more than the threads of the loop's default executor (which the other requests
use for their database calls): replays never take those.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer

from supervisor.contract.config import Config
from supervisor.http import attach
from supervisor.http.app import Api
from supervisor.http.attach import Hub
from supervisor.http.auth import Tokens, digest
from supervisor.http.pages import READERS, Pages
from supervisor.metrics import Metrics
from supervisor.store import Store
from supervisor.store.reading import EventRow, EventRows
from tests.http.test_replay import fill

TOKEN = "admin-token"
LONG = attach.PAGE + 200
WAIT_S = 30.0  # a bound on waiting for what must happen, not a measure of speed


class Gate:
    """Lets each first page of the held session through, holds every later read."""

    def __init__(self, rows: EventRows, held: str) -> None:
        self.rows = rows
        self.held = held
        self.opened = threading.Event()
        self.waiting = threading.Semaphore(0)  # a release per read that reached the gate

    def batches(
        self, session_id: str, after: int, limit: int, budget: int | None
    ) -> Iterator[list[EventRow]]:
        if session_id == self.held and after >= attach.PAGE:
            self.waiting.release()
            if not self.opened.wait(WAIT_S):
                raise TimeoutError("the gate was never opened")
        return self.rows.batches(session_id, after, limit, budget)


async def sse_events(response: ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The `data` of each event of an SSE body, as it arrives."""
    fields: dict[str, str] = {}
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if not line:
            if "data" in fields:
                yield json.loads(fields["data"])
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            fields[name] = value.removeprefix(" ")


async def take(events: AsyncIterator[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    return [await anext(events) for _ in range(count)]


async def scenario(store: Store, held: str, other: str, streams: int, readers: int) -> None:
    api = Api(Config(), store, Hub(), Tokens({"admin": digest(TOKEN)}), Metrics(), boot_id="b" * 32)
    gate = Gate(EventRows(store.db), held)
    api.pages = Pages(gate.batches, readers)
    expected = [e.to_dict() for e in store.events.read(held, 0, 10_000)]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with TestClient(TestServer(api.app())) as client:
        # Stream i replays after seq i: no two streams ask for the same page.
        url = f"/v1/sessions/{held}/attach"
        responses = [
            await client.get(url, headers={**auth, "Last-Event-ID": str(i)}) for i in range(streams)
        ]
        bodies = [sse_events(r) for r in responses]
        try:
            # Each stream's first page arrived; then its next read is held at the gate.
            firsts = [await asyncio.wait_for(take(b, attach.PAGE), WAIT_S) for b in bodies]
            assert firsts == [expected[i : i + attach.PAGE] for i in range(streams)]
            for _ in range(streams):
                assert await asyncio.to_thread(gate.waiting.acquire, timeout=WAIT_S)

            # Meanwhile the API answers: another session is read, written and listed.
            base = f"/v1/sessions/{other}"
            answered = await asyncio.wait_for(
                asyncio.gather(
                    client.post(f"{base}/inject", json={"text": "still here"}, headers=auth),
                    client.get(base, headers=auth),
                    client.get("/v1/sessions", headers=auth),
                    client.get("/v1/status", headers=auth),
                ),
                WAIT_S,
            )
            assert [a.status for a in answered] == [202, 200, 200, 200]
            assert (await answered[0].json())["seq"] > 0
            assert (await answered[3].json())["attach_streams"] == streams
        finally:
            gate.opened.set()

        # The rest of the log, once each, in order; then a new event, live.
        rests = await asyncio.wait_for(
            asyncio.gather(*(take(b, LONG - i - attach.PAGE) for i, b in enumerate(bodies))),
            WAIT_S,
        )
        assert rests == [expected[i + attach.PAGE :] for i in range(streams)]
        answer = await client.post(
            f"/v1/sessions/{held}/inject", json={"text": "live"}, headers=auth
        )
        assert (await answer.json())["seq"] == LONG + 1
        lives = await asyncio.wait_for(asyncio.gather(*(anext(b) for b in bodies)), WAIT_S)
        assert [e["seq"] for e in lives] == [LONG + 1] * streams
        assert all(e["payload"]["text"] == "live" for e in lives)
        for response in responses:
            response.close()


@pytest.mark.parametrize(("streams", "readers"), [(1, READERS), (10, 10)])
def test_the_api_answers_while_replays_wait_between_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, streams: int, readers: int
) -> None:
    # No idle re-read: the log must come whole from the replay, the new event from its signal.
    monkeypatch.setattr(attach, "IDLE_CHECK", 3600.0)
    with Store(f"sqlite:///{tmp_path / 'turnkeeper.db'}") as store:
        held = store.sessions.create("admin").id
        other = store.sessions.create("admin").id
        fill(store, held, LONG)
        asyncio.run(scenario(store, held, other, streams, readers))
