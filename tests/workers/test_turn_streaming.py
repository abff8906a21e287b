"""A turn's live output, as a session runner sends it, and an interrupt mid-stream.

A runner with a real database file and a real model (echo, or the openai client against
a local server that streams and holds its answer open behind a gate); what it would send
to the supervisor is captured by the `send_delta` it is handed. The worker process's own
sending is in `test_worker_deltas.py`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

from supervisor.contract.clock import SYSTEM
from supervisor.store import EventRecord, Store
from workers.agents.tool_loop import ToolLoopAgent
from workers.models import EchoModel, Model, OpenAIModel
from workers.runner import SessionRunner
from workers.streaming import Piece
from workers.tools import BuiltinTools

GUARD = 60.0  # seconds: only so that a broken runner fails the test instead of hanging it


class Session:
    """One leased session, its runner, and the deltas the runner sent."""

    def __init__(self, store: Store, model: Model) -> None:
        self.store = store
        self.id = store.sessions.create("alice").id
        lease = store.leases.acquire(self.id, "w0", 300.0)
        assert lease is not None
        self.ended = asyncio.Event()
        self.deltas: list[tuple[str, Piece]] = []
        self.first = asyncio.Event()
        self.notified: list[str] = []
        self.runner = SessionRunner(
            self.id,
            lease.token,
            "new",
            store=store,
            make_agent=lambda name: ToolLoopAgent(),
            model=model,
            toolbox=BuiltinTools(),
            notify=self.notify,
            served=self.ended.set,
            send_delta=self.send_delta,
        )
        self.runner.start()

    def send_delta(self, session: str, turn: str, piece: Piece) -> bool:
        assert session == self.id
        self.deltas.append((turn, piece))
        self.first.set()
        return True

    async def notify(self, type: str, **fields: Any) -> None:
        self.notified.append(type)

    async def inject(self, text: str) -> None:
        await asyncio.to_thread(
            self.store.events.append, self.id, "user_message", {"text": text}, writer="intake"
        )
        self.runner.wake()

    async def turn(self, text: str) -> list[EventRecord]:
        """Inject `text` as intake does and wait for the turn to end; the turn's events."""
        self.ended.clear()
        await self.inject(text)
        await asyncio.wait_for(self.ended.wait(), GUARD)
        return self.events()

    def events(self) -> list[EventRecord]:
        return self.store.events.read(self.id, 0, 1000)

    async def stop(self) -> None:
        self.runner.release()
        assert self.runner.task is not None
        await asyncio.wait_for(self.runner.task, GUARD)


def answers(events: list[EventRecord]) -> str:
    return "".join(e.payload["text"] for e in events if e.type == "model_response")


def test_the_deltas_of_a_turn_joined_are_its_committed_answers(store: Store) -> None:
    async def go() -> tuple[list[EventRecord], list[tuple[str, Piece]]]:
        session = Session(store, EchoModel(delay=0.2))
        events = await session.turn("the quick brown fox jumps over the lazy dog")
        await session.stop()
        return events, session.deltas

    events, deltas = asyncio.run(go())
    [turn] = {e.turn_id for e in events if e.type == "turn_started"}
    assert {t for t, _ in deltas} == {turn}
    pieces = [piece for _, piece in deltas]
    assert len(pieces) >= 2
    assert [p.index for p in pieces] == list(range(len(pieces)))
    assert "".join(p.text for p in pieces) == answers(events)
    assert answers(events) == "echo: the quick brown fox jumps over the lazy dog"
    assert all(p.elapsed >= 0 for p in pieces)


def test_a_tool_call_streams_by_name_between_the_texts(store: Store) -> None:
    async def go() -> tuple[list[EventRecord], list[tuple[str, Piece]]]:
        session = Session(store, EchoModel())
        events = await session.turn('/tool echo {"text": "found it"}')
        await session.stop()
        return events, session.deltas

    events, deltas = asyncio.run(go())
    pieces = [piece for _, piece in deltas]
    assert [p.tool_call for p in pieces if p.tool_call] == ["echo"]
    assert pieces[0].tool_call == "echo"  # before the answer that follows the result
    assert "".join(p.text for p in pieces) == answers(events)
    assert [p.index for p in pieces] == list(range(len(pieces)))


# --- an interrupt mid-stream -----------------------------------------------------------


@asynccontextmanager
async def held_server(gate: asyncio.Event, hung_up: asyncio.Event) -> AsyncIterator[str]:
    """A model server that streams "The answer so far" and then holds its answer open
    until `gate` (a model still generating); `hung_up` is set when the client hangs up."""

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        answer = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await answer.prepare(request)
        try:
            for text in ("The answer", " so far"):
                data = {"choices": [{"index": 0, "delta": {"content": text}}]}
                await answer.write(f"data: {json.dumps(data)}\n\n".encode())
            await gate.wait()
            await answer.write(b"data: [DONE]\n\n")
        except asyncio.CancelledError:
            hung_up.set()
            raise
        return answer

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}/v1"
    finally:
        gate.set()
        await runner.cleanup()


def openai(base_url: str) -> OpenAIModel:
    return OpenAIModel(base_url, "tiny", None, timeout=GUARD, max_tokens=64)


def test_an_interrupt_mid_stream_commits_the_text_so_far_then_ends_the_turn(
    store: Store,
) -> None:
    async def go() -> tuple[Session, bool, float, float]:
        gate, hung_up = asyncio.Event(), asyncio.Event()
        async with held_server(gate, hung_up) as base_url:
            model = openai(base_url)
            session = Session(store, model)
            await session.inject("tell me")
            while "".join(p.text for _, p in session.deltas) != "The answer so far":
                session.first.clear()
                await asyncio.wait_for(session.first.wait(), GUARD)
            await session.inject("and another thing")  # waits for the next owner
            interrupted_at = SYSTEM.time()  # the clock the runner stamps events with
            session.runner.interrupt()
            assert session.runner.task is not None
            await asyncio.wait_for(session.runner.task, GUARD)
            closed = hung_up.is_set() or await _hangs_up(hung_up)
            await model.aclose()
            ended = [e for e in session.events() if e.type == "turn_ended"]
            return session, closed, interrupted_at, ended[-1].created_at if ended else 0.0

    session, closed, interrupted_at, ended_at = asyncio.run(go())
    events = session.events()
    tail = [(e.type, e.payload) for e in events[-2:]]
    assert tail[0][0] == "model_response"
    assert tail[0][1]["text"] == "The answer so far"
    assert tail[0][1]["finish_reason"] == "interrupted"
    assert tail[1][0] == "turn_ended"
    assert tail[1][1]["outcome"] == "interrupted_by_operator"
    assert closed  # the HTTP request to the model server was closed
    assert session.runner.task is not None and session.runner.task.exception() is None
    assert [e.type for e in events].count("turn_started") == 1  # the runner started no more
    print(f"interrupt to turn_ended: {(ended_at - interrupted_at) * 1000:.1f} ms")


async def _hangs_up(hung_up: asyncio.Event) -> bool:
    await asyncio.wait_for(hung_up.wait(), GUARD)
    return True


def test_an_interrupt_the_operator_ended_first_stops_the_runner_quietly(store: Store) -> None:
    """Today's order: the interrupt route ends the turn in the database and revokes the
    lease before it tells the worker; the cut then has no lease to commit with."""

    async def go() -> tuple[Session, bool]:
        gate, hung_up = asyncio.Event(), asyncio.Event()
        async with held_server(gate, hung_up) as base_url:
            model = openai(base_url)
            session = Session(store, model)
            await session.inject("tell me")
            await asyncio.wait_for(session.first.wait(), GUARD)
            await asyncio.to_thread(store.sessions.interrupt, session.id, "alice")
            session.runner.interrupt()
            assert session.runner.task is not None
            await asyncio.wait_for(session.runner.task, GUARD)
            closed = await _hangs_up(hung_up)
            await model.aclose()
            return session, closed

    session, closed = asyncio.run(go())
    events = session.events()
    assert events[-1].type == "turn_ended"
    assert events[-1].payload["outcome"] == "interrupted_by_operator"
    assert [e.type for e in events].count("model_response") == 0
    assert closed
    assert "lease_lost" not in session.notified
