"""Models stream their answers: echo word by word, the openai client as the server sends
its chunks (against a real local server that streams server-sent events). The response
a call returns is the whole answer, as before."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from supervisor.contract.config import ModelConfig
from tests.clock import SteppingClock
from workers.models import (
    EchoModel,
    Message,
    ModelError,
    ModelResponse,
    OpenAIModel,
    ToolCall,
    make_model,
)


@dataclass
class Watcher:
    """A `Stream` that keeps what it is told, in order."""

    told: list[tuple[str, str]] = field(default_factory=list)
    first: asyncio.Event = field(default_factory=asyncio.Event)

    def text(self, text: str) -> None:
        self.told.append(("text", text))
        self.first.set()

    def tool_call(self, name: str) -> None:
        self.told.append(("tool_call", name))
        self.first.set()

    @property
    def texts(self) -> list[str]:
        return [value for kind, value in self.told if kind == "text"]


def user(text: str) -> Message:
    return Message("user", text)


# --- echo -------------------------------------------------------------------------------


def test_echo_streams_its_answer_word_by_word_and_returns_it_whole() -> None:
    watcher = Watcher()
    response = asyncio.run(EchoModel().complete([user("the  quick brown fox ")], [], watcher))
    assert response.text == "echo: the  quick brown fox "
    assert watcher.texts == ["echo:", " the", "  quick", " brown", " fox "]
    assert "".join(watcher.texts) == response.text


def test_echo_spreads_its_delay_over_the_words() -> None:
    clock = SteppingClock()
    model = EchoModel(delay=1.0, clock=clock)
    asyncio.run(model.complete([user("a b c")], [], Watcher()))
    assert clock.slept == [0.25] * 4  # "echo:", " a", " b", " c"


def test_echo_streams_a_tool_call_by_name() -> None:
    watcher = Watcher()
    response = asyncio.run(EchoModel().complete([user('/tool search {"q": "x"}')], [], watcher))
    assert response.finish_reason == "tool_calls"
    assert watcher.told == [("tool_call", "search")]


def test_echo_streams_the_cut_answer_only() -> None:
    watcher = Watcher()
    response = asyncio.run(EchoModel(max_tokens=2).complete([user("a b c d")], [], watcher))
    assert response.finish_reason == "length"
    assert "".join(watcher.texts) == response.text == "echo: a"


# --- openai: a server that streams ------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Server:
    base_url: str
    bodies: list[Any]
    disconnected: asyncio.Event


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[Server]:
    """A local OpenAI-compatible server; `disconnected` is set when a client hangs up on
    a handler still answering (aiohttp cancels the handler then)."""
    bodies: list[Any] = []
    disconnected = asyncio.Event()

    async def record(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        try:
            return await handler(request)
        except asyncio.CancelledError:
            disconnected.set()
            raise

    app = web.Application()
    app.router.add_post("/v1/chat/completions", record)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield Server(f"http://{host}:{port}/v1", bodies, disconnected)
    finally:
        await runner.cleanup()


def chunk(content: str | None = None, finish: str | None = None, **delta: Any) -> dict[str, Any]:
    if content is not None:
        delta["content"] = content
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def streaming(chunks: list[Any], gate: asyncio.Event | None = None, after: int = 0) -> Handler:
    """Send `chunks` as server-sent events; with a `gate`, wait for it after `after` of
    them (a model still generating)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        answer = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await answer.prepare(request)
        for index, data in enumerate(chunks):
            if gate is not None and index == after:
                await gate.wait()
            text = data if isinstance(data, str) else json.dumps(data)
            await answer.write(f"data: {text}\n\n".encode())
        await answer.write(b"data: [DONE]\n\n")
        return answer

    return handler


def model(base_url: str, **options: Any) -> OpenAIModel:
    settings = {"model": "tiny", "api_key": None, "timeout": 10.0, "max_tokens": 64}
    return OpenAIModel(base_url, **(settings | options))


def call(handler: Handler, **options: Any) -> tuple[ModelResponse | ModelError, Watcher, Any]:
    async def scenario() -> tuple[ModelResponse | ModelError, Watcher, Any]:
        watcher = Watcher()
        async with server(handler) as running:
            client = model(running.base_url, **options)
            try:
                return await client.complete([user("hi")], [], watcher), watcher, running.bodies
            except ModelError as exc:
                return exc, watcher, running.bodies
            finally:
                await client.aclose()

    return asyncio.run(scenario())


def test_the_text_is_told_chunk_by_chunk_and_returned_whole_with_the_usage() -> None:
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    chunks = [
        chunk("", role="assistant"),
        chunk("Hel"),
        chunk("lo"),
        chunk(" there", finish="stop"),
        {"choices": [], "usage": usage},
    ]
    response, watcher, [body] = call(streaming(chunks))
    assert response == ModelResponse("Hello there", [], "stop", usage)
    assert watcher.texts == ["Hel", "lo", " there"]
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_tool_calls_are_told_by_name_and_their_arguments_put_together() -> None:
    first = {"index": 0, "id": "call_1", "type": "function"}
    chunks = [
        chunk(tool_calls=[first | {"function": {"name": "search", "arguments": ""}}]),
        chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"q": '}}]),
        chunk(tool_calls=[{"index": 0, "function": {"arguments": '"fox"}'}}]),
        chunk(tool_calls=[{"index": 1, "id": "call_2", "function": {"name": "clock"}}]),
        chunk(finish="tool_calls"),
    ]
    response, watcher, _ = call(streaming(chunks))
    assert isinstance(response, ModelResponse)
    assert response.tool_calls == [
        ToolCall("call_1", "search", {"q": "fox"}),
        ToolCall("call_2", "clock", {}),
    ]
    assert response.finish_reason == "tool_calls"
    assert response.usage == {}  # a server that sends none
    assert watcher.told == [("tool_call", "search"), ("tool_call", "clock")]


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("{not json", "malformed answer"),
        ('{"error": {"message": "out of memory"}}', "out of memory"),
        ('{"choices": [{"delta": {"content": 5}}]}', "not a string"),
    ],
)
def test_a_bad_chunk_fails_the_call_in_one_line(bad: str, says: str) -> None:
    error, _, _ = call(streaming([chunk("partial"), bad]))
    assert isinstance(error, ModelError)
    assert says in str(error)
    assert "\n" not in str(error)
    assert not error.transient


def test_a_streamed_answer_past_max_response_bytes_is_not_read() -> None:
    error, _, _ = call(streaming([chunk("x" * 500)] * 10), max_response_bytes=2000)
    assert isinstance(error, ModelError)
    assert "max_response_bytes" in str(error)


def test_cancelling_a_streamed_call_closes_its_request() -> None:
    async def scenario() -> tuple[bool, Watcher]:
        gate = asyncio.Event()  # never set: the model is still generating
        watcher = Watcher()
        async with server(streaming([chunk("so far"), chunk(" more")], gate, 1)) as running:
            client = model(running.base_url)
            task = asyncio.ensure_future(client.complete([user("hi")], [], watcher))
            await asyncio.wait_for(watcher.first.wait(), 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(running.disconnected.wait(), 10)
            await client.aclose()
            return running.disconnected.is_set(), watcher

    disconnected, watcher = asyncio.run(scenario())
    assert disconnected
    assert watcher.texts == ["so far"]


def test_with_stream_off_no_stream_is_asked_for_and_the_whole_answer_is_read() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        usage = {"prompt_tokens": 4, "completion_tokens": 1}
        message = {"role": "assistant", "content": "whole"}
        return web.json_response({"choices": [{"message": message}], "usage": usage})

    response, watcher, [body] = call(handler, stream=False)
    assert response == ModelResponse(
        "whole", [], "stop", {"prompt_tokens": 4, "completion_tokens": 1}
    )
    assert "stream" not in body and "stream_options" not in body
    assert watcher.told == []


@pytest.mark.parametrize("stream", [True, False])
def test_model_stream_is_the_clients(stream: bool) -> None:
    config = ModelConfig(provider="openai", model="m", stream=stream)
    client = make_model(config)
    assert isinstance(client, OpenAIModel) and client.stream is stream
