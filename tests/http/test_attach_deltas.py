"""A turn's live output on attach streams, in this process: the real control plane's
frame handling, the real pool's message handler, bus, hub and aiohttp application on a
real SQLite store, and an HTTP client reading the SSE bytes.

A worker's `delta` messages reach the streams of its session as `event: delta` with no
`id:`, in line with the committed events; joined, they are the committed answer; they are
never stored, so neither `GET /events` nor a replay from `Last-Event-ID` holds one. A
delta from a worker that does not own the session reaches no one. A client that does not
read loses deltas past the stream's bound (counted), never a committed event, and the
handler that took them never waited for it. The pool counts the time to first delta and
the deltas lost between a worker and the supervisor (a gap in a turn's indexes).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer

from supervisor.contract import control
from supervisor.contract.config import Config
from supervisor.contract.logs import log
from supervisor.core.slots import Slot
from supervisor.http import attach
from supervisor.http.app import Api
from supervisor.http.attach import DELTA_LIMIT, Hub
from supervisor.http.auth import Tokens, digest
from supervisor.metrics import Metrics
from supervisor.pool import pool as pools
from supervisor.pool.deltas import DeltaIndexes, StreamedText
from supervisor.pool.handle import WorkerHandle
from supervisor.pool.plane import ControlPlane, Said
from supervisor.runtime.bus import Bus, Committed, Delta
from supervisor.store import Store

TOKEN = "admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WAIT_S = 30.0  # a bound on waiting for what must happen, not a measure of speed
TURN = "a" * 32


class Ownership:
    def want(self) -> None:
        pass


class Pool(pools.Pool):
    """The real pool's handling of what workers say, without processes: only the state
    that handling reads is set up here."""

    def __init__(self, bus: Bus, metrics: Metrics) -> None:  # no super()
        self.bus, self.metrics, self.log = bus, metrics, log("pool")
        self.clock = lambda: 0.0
        self.ownership: Any = Ownership()
        self.stopping = False
        self.delta_indexes = DeltaIndexes()
        self.streamed = StreamedText()
        bus.subscribe(Said, self._said)
        bus.subscribe(Committed, self._committed)


class Process:
    pid = 4242
    exitcode = None


def worker(slot: int, plane: ControlPlane, sessions: set[str]) -> WorkerHandle:
    """A worker that said its hello, admitted by the plane, owning `sessions`."""
    handle = WorkerHandle(Slot(slot), f"w{slot}.1", Process(), False, 0.0)
    handle.route, handle.hello, handle.sessions = f"route-{slot}".encode(), True, sessions
    plane.admit(handle)
    return handle


@dataclass
class Daemon:
    """The supervisor's side in this process, and what a worker sends it."""

    store: Store
    plane: ControlPlane
    api: Api
    metrics: Metrics
    bus: Bus

    def say(self, sender: WorkerHandle, type: str, **fields: Any) -> None:
        """A frame from `sender`, as the control plane receives it."""
        frame = control.encode(type, worker=sender.identity, **fields)
        self.plane._on_frames(sender.route, [frame])

    def delta(self, sender: WorkerHandle, session: str, index: int, **fields: Any) -> None:
        self.say(sender, "delta", session=session, turn=TURN, index=index, **fields)

    def commit(self, sender: WorkerHandle, session: str, kind: str, payload: Any) -> int:
        """An event the worker committed, then its signal."""
        seq = self.store.events.append(session, kind, payload, turn_id=TURN, writer="worker")
        self.say(sender, "committed", session=session, seq=seq, event_type=kind)
        return seq

    def sample(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(f"sqlite:///{tmp_path / 'turnkeeper.db'}") as store:
        yield store


def daemon(store: Store) -> Daemon:
    bus, metrics = Bus(), Metrics()
    api = Api(
        Config(), store, Hub(), Tokens({"admin": digest(TOKEN)}), metrics, boot_id="b" * 32, bus=bus
    )
    Pool(bus, metrics)
    return Daemon(store, ControlPlane("ipc:///nowhere", bus), api, metrics, bus)


async def messages(response: ClientResponse) -> AsyncIterator[dict[str, str]]:
    """Each SSE message as its fields (`id`, `event`, `data`), as it arrives."""
    fields: dict[str, str] = {}
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if not line:
            if fields:
                yield fields
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            fields[name] = value.removeprefix(" ")


async def take(stream: AsyncIterator[dict[str, str]], count: int) -> list[dict[str, str]]:
    return await asyncio.wait_for(_take(stream, count), WAIT_S)


async def _take(stream: AsyncIterator[dict[str, str]], count: int) -> list[dict[str, str]]:
    return [await anext(stream) for _ in range(count)]


async def attached(client: TestClient, session: str, after: int = 0) -> ClientResponse:
    response = await client.get(
        f"/v1/sessions/{session}/attach", headers={**AUTH, "Last-Event-ID": str(after)}
    )
    assert response.status == 200
    return response


async def streams_of(api: Api, count: int) -> None:
    """Wait until `count` streams are subscribed (each subscribes before its replay)."""
    while api.hub.streams < count:
        await asyncio.sleep(0.01)


def test_deltas_stream_between_committed_events_and_are_never_stored(store: Store) -> None:
    session = store.sessions.create("admin").id
    side = daemon(store)
    owner = worker(0, side.plane, {session})

    async def scenario() -> None:
        async with TestClient(TestServer(side.api.app())) as client:
            response = await attached(client, session)
            stream = messages(response)
            await asyncio.wait_for(streams_of(side.api, 1), WAIT_S)
            started = side.commit(owner, session, "turn_started", {})
            got = await take(stream, 1)
            side.delta(owner, session, 0, text="Hello, ", elapsed=0.25)
            side.delta(owner, session, 1, tool_call="search")
            side.delta(owner, session, 2, text="wörld\n\u2028!", elapsed=0.5)
            got += await take(stream, 3)
            answer = "Hello, wörld\n\u2028!"
            done = side.commit(owner, session, "model_response", {"text": answer})
            got += await take(stream, 1)
            assert [m.get("event") for m in got] == [
                "turn_started",
                "delta",
                "delta",
                "delta",
                "model_response",
            ]
            assert [m.get("id") for m in got] == [str(started), None, None, None, str(done)]
            deltas = [json.loads(m["data"]) for m in got[1:4]]
            assert deltas == [
                {"turn": TURN, "index": 0, "text": "Hello, ", "tool_call": None},
                {"turn": TURN, "index": 1, "text": "", "tool_call": "search"},
                {"turn": TURN, "index": 2, "text": "wörld\n\u2028!", "tool_call": None},
            ]
            assert (
                "".join(d["text"] for d in deltas) == json.loads(got[4]["data"])["payload"]["text"]
            )
            response.close()

            # Never stored: the history and a replay hold the committed events only.
            history = await client.get(f"/v1/sessions/{session}/events", headers=AUTH)
            assert [e["type"] for e in (await history.json())["events"]] == [
                "turn_started",
                "model_response",
            ]
            replay = await attached(client, session)
            again = await take(messages(replay), 2)
            assert [(m["id"], m["event"]) for m in again] == [
                (str(started), "turn_started"),
                (str(done), "model_response"),
            ]
            replay.close()

    asyncio.run(scenario())
    assert side.sample("turnkeeper_first_delta_seconds_count") == 1
    assert side.sample("turnkeeper_first_delta_seconds_sum") == 0.25
    assert side.sample("turnkeeper_deltas_dropped_total", where="worker") == 0
    assert side.sample("turnkeeper_deltas_dropped_total", where="stream") == 0


def test_a_delta_from_a_worker_that_does_not_own_the_session_reaches_no_one(
    store: Store,
) -> None:
    session = store.sessions.create("admin").id
    side = daemon(store)
    owner = worker(0, side.plane, {session})
    stranger = worker(1, side.plane, set())
    seen: list[Delta] = []
    side.bus.subscribe(Delta, seen.append)

    async def scenario() -> None:
        async with TestClient(TestServer(side.api.app())) as client:
            response = await attached(client, session)
            stream = messages(response)
            await asyncio.wait_for(streams_of(side.api, 1), WAIT_S)
            side.delta(stranger, session, 0, text="not yours")
            side.delta(owner, session, 0, text="mine")
            got = await take(stream, 1)
            assert json.loads(got[0]["data"])["text"] == "mine"
            response.close()

    asyncio.run(scenario())
    assert seen == [Delta(session, TURN, 0, "mine")]
    assert side.sample("turnkeeper_first_delta_seconds_count") == 1


def test_a_client_that_does_not_read_loses_deltas_never_committed_events(store: Store) -> None:
    session = store.sessions.create("admin").id
    side = daemon(store)
    owner = worker(0, side.plane, {session})
    sent = DELTA_LIMIT + 44

    started = side.commit(owner, session, "turn_started", {})

    async def scenario() -> None:
        async with TestClient(TestServer(side.api.app())) as client:
            response = await attached(client, session)
            stream = messages(response)
            # The replay is over once its one event is in (else a slow replay could read
            # the answer committed below, and send it before the deltas queued meanwhile).
            assert [m["id"] for m in await take(stream, 1)] == [str(started)]
            # The stream's loop does not run between these: its client takes nothing.
            for index in range(sent):
                side.delta(owner, session, index, text=f"{index} ")
            done = side.commit(owner, session, "model_response", {"text": "the answer"})
            got = await take(stream, DELTA_LIMIT + 1)
            kept = [json.loads(m["data"])["index"] for m in got[:-1]]
            assert kept == list(range(DELTA_LIMIT))  # the first ones, in order
            assert (got[-1]["id"], got[-1]["event"]) == (str(done), "model_response")
            assert side.api.hub.streams == 1  # still attached: deltas never drop a stream
            response.close()

    asyncio.run(scenario())
    assert side.sample("turnkeeper_deltas_dropped_total", where="stream") == sent - DELTA_LIMIT
    assert side.sample("turnkeeper_deltas_dropped_total", where="worker") == 0


def test_the_hub_drops_a_stream_too_slow_for_committed_events_not_for_deltas() -> None:
    async def scenario() -> None:
        hub = Hub()
        sub = hub.subscribe("s" * 32)
        for index in range(DELTA_LIMIT * 2):
            hub.delta(Delta("s" * 32, TURN, index, "x"))
        for seq in range(1, attach.QUEUE_LIMIT + 1):
            hub.publish("s" * 32, {"seq": seq, "type": "model_response"})
        assert not sub.dropped and hub.streams == 1  # every committed signal has room
        hub.publish("s" * 32, {"seq": attach.QUEUE_LIMIT + 1, "type": "model_response"})
        assert sub.dropped and hub.streams == 0

    asyncio.run(scenario())


def test_the_pool_counts_the_deltas_lost_before_it_had_them(store: Store) -> None:
    session = store.sessions.create("admin").id
    side = daemon(store)
    owner = worker(0, side.plane, {session})
    side.delta(owner, session, 0, text="a")
    side.delta(owner, session, 3, text="d")  # 1 and 2 were lost on the way
    side.delta(owner, session, 4, text="e")
    assert side.sample("turnkeeper_deltas_dropped_total", where="worker") == 2
    side.say(owner, "committed", session=session, seq=1, event_type="turn_ended")
    side.delta(owner, session, 0, text="next turn")
    assert side.sample("turnkeeper_deltas_dropped_total", where="worker") == 2
    assert side.sample("turnkeeper_first_delta_seconds_count") == 2
