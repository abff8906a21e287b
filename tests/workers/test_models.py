"""Model providers: the echo rules, and the openai client against a real local fake server."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from supervisor.contract.config import ModelConfig
from workers.models import (
    EchoModel,
    Message,
    Model,
    ModelError,
    ModelResponse,
    OpenAIModel,
    ToolCall,
    ToolSpec,
    make_model,
)
from workers.models.echo import tool_call_id
from workers.models.openai import parse_answer

# --- echo -------------------------------------------------------------------------------


def user(text: str) -> Message:
    return Message("user", text)


def echo(messages: list[Message], model: EchoModel | None = None) -> ModelResponse:
    return asyncio.run((model or EchoModel()).complete(messages, []))


def timed_echo(messages: list[Message], model: EchoModel) -> tuple[ModelResponse, float]:
    start = time.monotonic()
    answer = echo(messages, model)
    return answer, time.monotonic() - start


def test_echo_answers_the_last_user_message() -> None:
    answer = echo([Message("system", "be brief"), user("first"), user("hello  there")])
    assert answer == ModelResponse(
        "echo: hello  there", [], "stop", {"prompt_tokens": 5, "completion_tokens": 3}
    )


def test_echo_without_a_user_message_answers_empty() -> None:
    answer = echo([Message("system", "be brief")])
    assert (answer.text, answer.finish_reason, answer.tool_calls) == ("echo: ", "stop", [])


@pytest.mark.parametrize("role", ["user", "system"])
def test_a_later_note_does_not_change_the_answer(role: Any) -> None:
    note = Message(role, "[continuation] the worker restarted; carry on", note=True)
    assert echo([user("hello"), note]).text == "echo: hello"
    assert echo([note]).text == "echo: "


def test_tool_command_emits_one_call_then_echoes_its_result() -> None:
    history = [Message("system", "tools ahead"), user('/tool read_file {"path": "a.txt"}')]
    first = echo(history)
    call = ToolCall(tool_call_id(1, "read_file", {"path": "a.txt"}), "read_file", {"path": "a.txt"})
    assert (first.text, first.tool_calls, first.finish_reason) == ("", [call], "tool_calls")
    assert call.id.startswith("call_") and len(call.id) == len("call_") + 12

    history += [
        Message("assistant", "", tool_calls=[call]),
        Message("tool", "contents of a", tool_call_id=call.id),
    ]
    done = echo(history)
    assert (done.text, done.tool_calls, done.finish_reason) == ("echo: contents of a", [], "stop")
    # A continuation note after the result (a crash between calls) changes nothing.
    assert echo([*history, Message("user", "continue", note=True)]).text == "echo: contents of a"


def test_tool_command_arguments_default_to_an_empty_object() -> None:
    answer = echo([user("/tool now")])
    assert answer.tool_calls == [ToolCall(tool_call_id(0, "now", {}), "now", {})]


def test_tool_call_ids_are_deterministic_and_tell_calls_apart() -> None:
    history = [user('/tool add {"a": 1, "b": 2}')]
    first, again = echo(history), echo(history, EchoModel(delay=0.01))
    assert first.tool_calls[0].id == again.tool_calls[0].id
    later = echo([user('/tool add {"b": 2, "a": 1}'), *history])
    assert later.tool_calls[0].id != first.tool_calls[0].id  # another user message index
    other = echo([user('/tool add {"a": 1, "b": 3}')])
    assert other.tool_calls[0].id != first.tool_calls[0].id


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ("{not json", "invalid tool arguments: Expecting property name"),
        ("[1, 2]", "invalid tool arguments: expected a JSON object, got list"),
    ],
)
def test_tool_command_with_invalid_arguments_answers_the_error(args: str, error: str) -> None:
    answer = echo([user(f"/tool add {args}")])
    assert answer.text.startswith(f"echo: {error}")
    assert (answer.finish_reason, answer.tool_calls) == ("stop", [])


def test_sleep_command_waits_then_echoes() -> None:
    answer, elapsed = timed_echo([user("/sleep 0.2 wake me")], EchoModel())
    assert (answer.text, answer.finish_reason) == ("echo: wake me", "stop")
    assert 0.2 <= elapsed < 2


@pytest.mark.parametrize("text", ["/sleep soon hi", "/sleep", "/sleep -1 hi", "/sleep nan hi"])
def test_malformed_sleep_is_echoed_whole(text: str) -> None:
    answer, elapsed = timed_echo([user(text)], EchoModel())
    assert (answer.text, answer.finish_reason) == (f"echo: {text}", "stop")
    assert elapsed < 1


def test_sleep_is_cancellable() -> None:
    async def scenario() -> float:
        task = asyncio.create_task(EchoModel().complete([user("/sleep 30 never")], []))
        await asyncio.sleep(0.05)
        start = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - start

    assert asyncio.run(scenario()) < 1


def test_long_command_stops_at_length_with_half_the_answer() -> None:
    answer = echo([user("/long tell me everything")])
    full = "echo: tell me everything"
    assert (answer.text, answer.finish_reason) == (full[: len(full) // 2], "length")


@given(st.text(max_size=200))
def test_long_answer_is_a_nonempty_first_half(text: str) -> None:
    answer = echo([user(f"/long {text}")])
    full = f"echo: {text.lstrip()}"  # the space after the command is not part of T
    assert answer.finish_reason == "length"
    assert 1 <= len(answer.text) <= max(1, len(full) // 2)
    assert full.startswith(answer.text)


@given(st.text(max_size=200).filter(lambda text: not text.startswith("/")))
def test_plain_text_is_echoed_unchanged(text: str) -> None:
    assert echo([user(text)], EchoModel(max_tokens=10_000)).text == f"echo: {text}"


def test_delay_is_added_to_every_call() -> None:
    answer, elapsed = timed_echo([user("hi")], EchoModel(delay=0.2))
    assert answer.text == "echo: hi"
    assert 0.2 <= elapsed < 2


def test_an_answer_past_max_tokens_is_cut() -> None:
    answer = echo([user("one two three four")], EchoModel(max_tokens=3))
    assert (answer.text, answer.finish_reason) == ("echo: one two", "length")
    assert answer.usage["completion_tokens"] == 3


# --- openai, pure parsing ----------------------------------------------------------------


def choice(message: dict[str, Any], finish: Any = "stop") -> dict[str, Any]:
    return {"choices": [{"index": 0, "message": message, "finish_reason": finish}]}


@pytest.mark.parametrize(
    ("finish", "expected"),
    [("stop", "stop"), ("length", "length"), ("content_filter", "stop"), (None, "stop")],
)
def test_finish_reasons_map_to_the_three_known_ones(finish: Any, expected: str) -> None:
    answer = parse_answer(choice({"role": "assistant", "content": None}, finish))
    assert (answer.text, answer.finish_reason, answer.usage) == ("", expected, {})


def test_tool_calls_mean_finish_tool_calls_whatever_the_server_says() -> None:
    raw = {"id": "c1", "type": "function", "function": {"name": "now", "arguments": ""}}
    answer = parse_answer(choice({"content": "", "tool_calls": [raw]}, "stop"))
    assert (answer.tool_calls, answer.finish_reason) == ([ToolCall("c1", "now", {})], "tool_calls")


# --- openai, against a real local server -------------------------------------------------

RELEASE = web.AppKey("release", asyncio.Event)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
HISTORY = [
    Message("system", "You are terse."),
    user("what time is it?"),
    Message("assistant", "", tool_calls=[ToolCall("call_1", "clock", {"tz": "UTC"})]),
    Message("tool", "12:00", tool_call_id="call_1"),
    Message("user", "the worker restarted", note=True),
]
CLOCK = ToolSpec("clock", "The current time.", {"type": "object", "properties": {}}, True, True)


@dataclass
class Seen:
    """One request the fake server received."""

    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class FakeServer:
    base_url: str
    seen: list[Seen]


@asynccontextmanager
async def fake_server(handler: Handler) -> AsyncIterator[FakeServer]:
    """An OpenAI-compatible server on 127.0.0.1 that records requests, then runs `handler`."""
    seen: list[Seen] = []
    release = asyncio.Event()

    async def record(request: web.Request) -> web.StreamResponse:
        seen.append(Seen(request.path, dict(request.headers), await request.json()))
        return await handler(request)

    app = web.Application()
    app[RELEASE] = release
    app.router.add_post("/v1/chat/completions", record)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield FakeServer(f"http://{host}:{port}/v1", seen)
    finally:
        release.set()  # lets a slow handler finish, so cleanup does not wait for it
        await runner.cleanup()


def answering(payload: Any, status: int = 200) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        if isinstance(payload, str):
            return web.Response(status=status, text=payload)
        return web.json_response(payload, status=status)

    return handler


def openai_call(
    handler: Handler,
    messages: list[Message],
    tools: list[ToolSpec] | None = None,
    **options: Any,
) -> tuple[ModelResponse | ModelError, list[Seen], str]:
    """One complete() against a fresh fake server: the answer or error, requests, URL."""

    async def scenario() -> tuple[ModelResponse | ModelError, list[Seen], str]:
        async with fake_server(handler) as server:
            settings = {"model": "llama3", "api_key": None, "timeout": 5.0, "max_tokens": 64}
            model = OpenAIModel(server.base_url, **(settings | options))
            try:
                return await model.complete(messages, tools or []), server.seen, server.base_url
            except ModelError as exc:
                return exc, server.seen, server.base_url
            finally:
                await model.aclose()

    return asyncio.run(scenario())


def openai_error(handler: Handler, **options: Any) -> tuple[ModelError, str]:
    result, _, base_url = openai_call(handler, [user("hi")], **options)
    assert isinstance(result, ModelError)
    assert "\n" not in str(result)
    return result, base_url


def test_text_answer() -> None:
    payload = choice({"role": "assistant", "content": "hello"}) | {
        "usage": {"prompt_tokens": 7, "completion_tokens": 1, "details": {"cached": 0}}
    }
    result, seen, _ = openai_call(answering(payload), [user("hi")])
    assert result == ModelResponse(
        "hello", [], "stop", {"prompt_tokens": 7, "completion_tokens": 1}
    )
    [request] = seen
    assert request.path == "/v1/chat/completions"
    assert request.body == {
        "model": "llama3",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 64,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert "Authorization" not in request.headers


def test_tool_call_answer_and_the_request_it_answers() -> None:
    raw_call = {
        "id": "call_2",
        "type": "function",
        "function": {"name": "clock", "arguments": '{"tz": "CET"}'},
    }
    payload = choice({"role": "assistant", "content": None, "tool_calls": [raw_call]}, "stop")
    result, [request], _ = openai_call(answering(payload), HISTORY, [CLOCK], api_key="sk-test-123")
    assert result == ModelResponse(
        "", [ToolCall("call_2", "clock", {"tz": "CET"})], "tool_calls", {}
    )
    assert request.headers["Authorization"] == "Bearer sk-test-123"
    assert request.body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "clock",
                "description": "The current time.",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    assert request.body["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "what time is it?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "clock", "arguments": '{"tz": "UTC"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        {"role": "user", "content": "[note] the worker restarted"},
    ]


@pytest.mark.parametrize(
    ("status", "transient"), [(500, True), (503, True), (429, True), (400, False), (404, False)]
)
def test_error_status(status: int, transient: bool) -> None:
    body = {"error": {"message": "model 'llama3' is\nbusy " + "x" * 400, "type": "server"}}
    error, base_url = openai_error(answering(body, status))
    assert error.transient is transient
    excerpt = "model 'llama3' is busy " + "x" * 177
    assert str(error) == f"model server {base_url} answered {status}: {excerpt}"


def test_a_server_quoting_the_key_back_does_not_leak_it() -> None:
    error, _ = openai_error(answering("bad key sk-secret-9 rejected", 401), api_key="sk-secret-9")
    assert "sk-secret-9" not in str(error)
    assert "answered 401: bad key *** rejected" in str(error)
    assert not error.transient


@pytest.mark.parametrize(
    ("api_key", "authorization"),
    [("sk-configured", "Bearer sk-configured"), (None, "Basic cHJveHk6cEA1NXdvcmQ=")],
    ids=["with an API key", "without one"],
)
def test_a_password_in_the_base_url_is_never_shown_and_never_replaces_the_key(
    api_key: str | None, authorization: str
) -> None:
    async def scenario() -> tuple[ModelError, list[Seen], str]:
        async with fake_server(answering("proxy:p@55word is refused", 403)) as server:
            with_password = server.base_url.replace("http://", "http://proxy:p%4055word@")
            model = OpenAIModel(with_password, "m", api_key, 5.0, 8)
            try:
                with pytest.raises(ModelError) as caught:
                    await model.complete([user("hi")], [])
            finally:
                await model.aclose()
            return caught.value, server.seen, server.base_url

    error, seen, base_url = asyncio.run(scenario())
    assert [request.headers["Authorization"] for request in seen] == [authorization]
    assert str(error) == f"model server {base_url} answered 403: proxy:*** is refused"
    assert "p@55word" not in repr(error) and "p%4055word" not in repr(error)


@pytest.mark.parametrize(
    "payload",
    ["<html>oops</html>", {"choices": []}, {"object": "error"}, choice({"content": 42})],
)
def test_malformed_answer(payload: Any) -> None:
    error, base_url = openai_error(answering(payload))
    assert str(error).startswith(f"model server {base_url} sent a malformed answer: ")
    assert not error.transient


def test_invalid_tool_call_arguments() -> None:
    raw = {"id": "c", "type": "function", "function": {"name": "clock", "arguments": "{tz: "}}
    error, _ = openai_error(answering(choice({"tool_calls": [raw]}, "tool_calls")))
    assert "invalid JSON in the arguments of tool call 'clock'" in str(error)
    assert not error.transient


def test_slow_answer_times_out() -> None:
    async def slow(request: web.Request) -> web.StreamResponse:
        await request.app[RELEASE].wait()  # set when the test is done with the server
        return web.json_response(choice({"content": "late"}))

    start = time.monotonic()
    error, base_url = openai_error(slow, timeout=0.3)
    assert time.monotonic() - start < 5
    assert error.transient
    assert str(error) == f"model server {base_url} did not answer within 0.3 s (timeout)"


def test_refused_connection() -> None:
    # A bound socket that never listens: connecting to its port is refused, and no other
    # process can take the port meanwhile.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        base_url = f"http://127.0.0.1:{closed.getsockname()[1]}/v1"
        model = OpenAIModel(base_url, "llama3", None, 5.0, 64)
        with pytest.raises(ModelError) as caught:
            asyncio.run(model.complete([user("hi")], []))
    assert caught.value.transient
    assert str(caught.value).startswith(f"model server {base_url} could not be reached: ")


def test_the_client_reopens_after_aclose() -> None:
    async def scenario() -> list[str]:
        async with fake_server(answering(choice({"content": "again"}))) as server:
            model = OpenAIModel(server.base_url, "m", None, 5.0, 8)
            texts = [(await model.complete([user("a")], [])).text]
            await model.aclose()
            texts.append((await model.complete([user("b")], [])).text)
            await model.aclose()
            await model.aclose()
            return texts

    assert asyncio.run(scenario()) == ["again", "again"]


# --- make_model ---------------------------------------------------------------------------


def test_make_model_echo() -> None:
    model = make_model(ModelConfig(provider="echo", delay=0.5, max_tokens=7), environ={})
    assert isinstance(model, EchoModel) and isinstance(model, Model)
    assert (model.delay, model.max_tokens) == (0.5, 7)


def test_make_model_openai_reads_the_key_from_the_environment() -> None:
    async def scenario() -> Seen:
        async with fake_server(answering(choice({"content": "ok"}))) as server:
            cfg = ModelConfig(
                provider="openai", base_url=server.base_url, model="m", api_key_env="TK_KEY"
            )
            model = make_model(cfg, environ={"TK_KEY": "sk-from-env"})
            assert isinstance(model, OpenAIModel) and "sk-from-env" not in repr(model)
            await model.complete([user("hi")], [])
            await model.aclose()
            return server.seen[0]

    assert asyncio.run(scenario()).headers["Authorization"] == "Bearer sk-from-env"


@pytest.mark.parametrize("environ", [{}, {"TK_KEY": ""}])
def test_make_model_with_the_key_variable_missing(environ: dict[str, str]) -> None:
    cfg = ModelConfig(provider="openai", api_key_env="TK_KEY")
    with pytest.raises(ModelError, match="TK_KEY") as caught:
        make_model(cfg, environ=environ)
    assert not caught.value.transient


def test_make_model_openai_without_a_key_variable() -> None:
    model = make_model(ModelConfig(provider="openai", model="m"), environ={"TK_KEY": "unused"})
    assert isinstance(model, OpenAIModel) and model.base_url == "http://127.0.0.1:11434/v1"
