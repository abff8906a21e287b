"""The `openai` model: any OpenAI-compatible chat-completions server.

Ollama, vLLM and the llama.cpp server all speak it. One POST to
`{base_url}/chat/completions` per call, streamed (`stream: true`, with the usage asked
for in the last chunk): the text and the tool calls are told to the call's `Stream` as
the server sends them, and the whole response is returned at the end as before. A server
that ignores `stream` and answers with one JSON body is read as such; with `model.stream`
off, no stream is asked for (a server that counts no tokens in a stream counts them
then). Either answer is read up to `model.max_response_bytes` and no further. A call
cancelled mid-answer (a release, an interrupt) closes its HTTP request, so the server
stops generating. Every failure becomes a `ModelError` whose one-line message names the
server; the API key is never part of one.

A `user:password@` in `base_url` is taken out of the URL before any request and any
message: the API key is the only credential sent when one is configured (httpx would
otherwise turn the URL's user into a Basic `Authorization` that replaces it), and the
user and password go as Basic auth only when there is no API key.
"""

from __future__ import annotations

import asyncio
import codecs
import email.utils
import json
import re
import uuid
from typing import Any
from urllib.parse import unquote

import httpx

from supervisor.contract.clock import SYSTEM
from workers.models.base import (
    SILENT,
    FinishReason,
    Message,
    ModelError,
    ModelResponse,
    Stream,
    ToolCall,
    ToolSpec,
)

EXCERPT = 200
DEFAULT_MAX_RESPONSE = 4 << 20  # model.max_response_bytes
_AUTHORITY = re.compile(r"(?P<scheme>[^:/?#]+://)(?P<authority>[^/?#]*)(?P<rest>.*)", re.DOTALL)
_FINISH_REASONS: frozenset[str] = frozenset({"stop", "tool_calls", "length"})


class OpenAIModel:
    """A client of one OpenAI-compatible server; the HTTP client is opened on first use.

    `timeout` bounds each whole call, in seconds. `transport` replaces the network, for
    tests and embedding.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None,
        timeout: float,
        max_tokens: int,
        transport: httpx.AsyncBaseTransport | None = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE,
        stream: bool = True,
    ) -> None:
        self.base_url, self._userinfo = without_userinfo(base_url.rstrip("/"))
        self.model = model
        self.timeout = timeout
        self.max_tokens = max_tokens
        self.max_response_bytes = max_response_bytes
        self.stream = stream  # ask for a stream (`model.stream`)
        self._api_key = api_key or None
        self._transport = transport
        self._client: httpx.AsyncClient | None = None

    def __repr__(self) -> str:
        return f"OpenAIModel(base_url={self.base_url!r}, model={self.model!r})"

    async def complete(
        self, messages: list[Message], tools: list[ToolSpec], stream: Stream = SILENT
    ) -> ModelResponse:
        """Send the conversation and the tools; parse the first choice of the answer,
        telling `stream` its text and tool calls as they come."""
        body = request_body(self.model, messages, tools, self.max_tokens, self.stream)
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        try:
            async with asyncio.timeout(self.timeout):
                answer = await self._post(body, headers, stream)
        except (TimeoutError, httpx.TimeoutException):
            raise ModelError(
                f"model server {self.base_url} did not answer within {self.timeout:g} s (timeout)",
                transient=True,
            ) from None
        except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
            raise ModelError(f"model server URL {self.base_url!r} is invalid: {exc}") from None
        except httpx.TransportError as exc:
            raise ModelError(
                f"model server {self.base_url} could not be reached: {_describe(exc)}",
                transient=True,
            ) from None
        except ValueError as exc:  # a malformed chunk of a streamed answer
            raise ModelError(
                f"model server {self.base_url} sent a malformed answer: {_one_line(str(exc))}"
            ) from None
        if isinstance(answer, ModelResponse):
            return answer
        if not answer.is_success:
            status = answer.status_code
            excerpt = self._excerpt(answer)
            window = context_window_of(answer.text) if status in (400, 413) else None
            error = ModelError(
                f"model server {self.base_url} answered {status}: {excerpt}",
                transient=status == 429 or status >= 500,
                context_exceeded=window is not None,
                window=window or None,
            )
            error.retry_after = retry_after(answer.headers.get("retry-after"))
            raise error
        try:
            return parse_answer(answer.json())
        except ValueError as exc:
            raise ModelError(
                f"model server {self.base_url} sent a malformed answer: {_one_line(str(exc))}"
            ) from None

    async def _post(
        self, body: dict[str, Any], headers: dict[str, str], stream: Stream
    ) -> httpx.Response | ModelResponse:
        """The answer: the response a stream of events made (told to `stream` as it came),
        or a body read up to `max_response_bytes` (whatever Content-Length says): a server
        that sends more fails the call, for good, before it is all held."""
        request = self._http().build_request(
            "POST", f"{self.base_url}/chat/completions", json=body, headers=headers
        )
        answer = await self._http().send(request, stream=True)
        try:
            if answer.is_success and is_event_stream(answer.headers.get("content-type", "")):
                return await self._read_events(answer, stream)
            declared = answer.headers.get("content-length", "")
            too_long = declared.isdigit() and int(declared) > self.max_response_bytes
            if too_long and answer.is_success:
                raise self._too_large(int(declared))
            content = bytearray()
            async for chunk in answer.aiter_bytes():  # decoded: a compressed bomb is cut too
                content += chunk
                if len(content) > self.max_response_bytes:
                    if not answer.is_success:  # an error page: its start says enough
                        del content[self.max_response_bytes :]
                        break
                    raise self._too_large(None)
        finally:
            await answer.aclose()
        kept = {
            "content-type": answer.headers.get("content-type", "application/json"),
            "retry-after": answer.headers.get("retry-after", ""),
        }
        return httpx.Response(
            answer.status_code, headers=kept, content=bytes(content), request=request
        )

    async def _read_events(self, answer: httpx.Response, stream: Stream) -> ModelResponse:
        """A streamed answer (server-sent events, `data: {chunk}` lines up to `data:
        [DONE]`), its pieces told to `stream` as they come; ValueError if malformed."""
        chunks = Chunks(stream)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        read, pending = 0, ""
        # Bytes, counted, split into lines here: a line never ends for a server that
        # sends no newline, and must not be held whole past the limit.
        async for data in answer.aiter_bytes():
            read += len(data)
            if read > self.max_response_bytes:
                raise self._too_large(None)
            *lines, pending = (pending + decoder.decode(data)).split("\n")
            for line in lines:
                if _event_data(line, chunks):
                    return chunks.response()
        _event_data(pending + decoder.decode(b"", final=True), chunks)
        return chunks.response()

    def _too_large(self, declared: int | None) -> ModelError:
        size = f"{declared} bytes" if declared is not None else "more"
        return ModelError(
            f"model server {self.base_url} answered {size} than model.max_response_bytes "
            f"({self.max_response_bytes}) allows; the answer was not read"
        )

    async def aclose(self) -> None:
        """Close the HTTP client; the next call opens a new one."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            # trust_env=False: the server is named by base_url; a process-wide proxy or
            # .netrc must not silently reroute the conversation or the API key.
            basic = httpx.BasicAuth(*self._userinfo) if self._userinfo else None
            self._client = httpx.AsyncClient(
                timeout=self.timeout,
                transport=self._transport,
                trust_env=False,
                auth=None if self._api_key else basic,
            )
        return self._client

    def _excerpt(self, answer: httpx.Response) -> str:
        text = answer.text
        try:
            error = json.loads(text).get("error")
            text = (error.get("message") if isinstance(error, dict) else error) or text
        except (ValueError, AttributeError):
            pass
        text = str(text)
        # A server may quote the rejected key back; it must not reach the event log.
        for secret in (self._api_key, self._userinfo[1] if self._userinfo else None):
            if secret:
                text = text.replace(secret, "***")
        return _one_line(text)[:EXCERPT] or "(empty body)"


# How servers name a context window in a context-length error: OpenAI and servers that
# copy its wording (vLLM, llama-cpp-python), llama.cpp's server, Ollama.
_WINDOW_PATTERNS = (
    re.compile(r"maximum context length is (\d+)", re.IGNORECASE),
    re.compile(r"context (?:window|length|size) of (\d+)", re.IGNORECASE),
    re.compile(r"exceeds? the available context size.*?n_ctx(?:_slot)?\s*=\s*(\d+)", re.I | re.S),
    re.compile(r"context size \((\d+)", re.IGNORECASE),
)
_CONTEXT_WORDS = re.compile(
    r"context_length_exceeded|context (?:window|length|size)|n_ctx|too many tokens|"
    r"prompt is too long|maximum context",
    re.IGNORECASE,
)


def context_window_of(body: str) -> int | None:
    """For an error answer that says the prompt did not fit the model's context: the
    window it names, or 0 when it names none. None for any other error."""
    if not _CONTEXT_WORDS.search(body):
        return None
    for pattern in _WINDOW_PATTERNS:
        match = pattern.search(body)
        if match is not None:
            return int(match.group(1))
    return 0


def retry_after(value: str | None) -> float | None:
    """A `Retry-After` header's wait in seconds (delay-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - SYSTEM.time())


def without_userinfo(url: str) -> tuple[str, tuple[str, str] | None]:
    """`url` without its `user:password@`, and the (unquoted) user and password if any."""
    match = _AUTHORITY.fullmatch(url)
    if match is None:
        return url, None
    userinfo, at, host = match["authority"].rpartition("@")
    if not at:
        return url, None
    user, _, password = userinfo.partition(":")
    return f"{match['scheme']}{host}{match['rest']}", (unquote(user), unquote(password))


def request_body(
    model: str,
    messages: list[Message],
    tools: list[ToolSpec],
    max_tokens: int,
    stream: bool = True,
) -> dict[str, Any]:
    """The JSON body of a chat-completions request (one asking for a stream: `stream`)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [_message(message) for message in messages],
        "max_tokens": max_tokens,
    }
    if stream:
        # Servers that do not know `stream_options` ignore it, and send no usage then.
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.input_schema,
                },
            }
            for tool in tools
        ]
    return body


def parse_answer(data: Any) -> ModelResponse:
    """The first choice of a chat-completions answer; ValueError if it is malformed."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError("no choices")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise ValueError("choices[0] has no message")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise ValueError(f"message content is {type(content).__name__}, not a string")
    calls = [_tool_call(raw) for raw in message.get("tool_calls") or []]
    reason = choice.get("finish_reason")
    finish: FinishReason = reason if reason in _FINISH_REASONS else "stop"
    if calls:
        finish = "tool_calls"
    raw_usage = data.get("usage")
    usage = {
        key: value
        for key, value in (raw_usage.items() if isinstance(raw_usage, dict) else ())
        if isinstance(value, int) and not isinstance(value, bool)
    }
    return ModelResponse(content or "", calls, finish, usage)


def _event_data(line: str, chunks: Chunks) -> bool:
    """Add a `data:` line's chunk to `chunks`; True at `data: [DONE]`, the end."""
    if not line.startswith("data:"):
        return False  # a blank line between events, a comment, an `event:` name
    data = line[5:].strip()
    if data == "[DONE]":
        return True
    if data:
        chunks.add(json.loads(data))
    return False


def is_event_stream(content_type: str) -> bool:
    """Whether an answer of this Content-Type is a stream of server-sent events."""
    return content_type.split(";", 1)[0].strip().lower() == "text/event-stream"


class Chunks:
    """The chunks of a streamed answer, put together into the answer `parse_answer`
    reads; each chunk's text and each new tool call are told to `stream` at once.

    A chunk holds `choices[0].delta` (`content`, and `tool_calls` pieces: a call's `id`
    and `function.name` in its first piece, its `arguments` string in pieces after,
    every piece with the call's `index`), `finish_reason` in the last, and `usage` in a
    last chunk of its own when asked for (`choices` empty then). An `error` chunk is a
    failure the server reports mid-answer.
    """

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.text: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}  # by index, in order of arrival
        self.finish: Any = None
        self.usage: Any = None

    def add(self, chunk: Any) -> None:
        """One chunk; ValueError if it is not one."""
        if not isinstance(chunk, dict):
            raise ValueError(f"expected a JSON object in each chunk, got {type(chunk).__name__}")
        if "error" in chunk:
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise ValueError(f"an error mid-answer: {message}")
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices:
            return
        choice = choices[0]
        if not isinstance(choice, dict):
            raise ValueError("choices[0] is not an object")
        if choice.get("finish_reason") is not None:
            self.finish = choice["finish_reason"]
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return
        content = delta.get("content")
        if content is not None:
            if not isinstance(content, str):
                raise ValueError(f"delta content is {type(content).__name__}, not a string")
            if content:
                self.text.append(content)
                self.stream.text(content)
        for piece in delta.get("tool_calls") or []:
            self._call_piece(piece)

    def _call_piece(self, piece: Any) -> None:
        if not isinstance(piece, dict):
            raise ValueError("a tool call piece is not an object")
        index = piece.get("index", len(self.calls))
        if not isinstance(index, int):
            raise ValueError("a tool call piece has no index")
        call = self.calls.setdefault(index, {"id": None, "name": None, "arguments": ""})
        if isinstance(piece.get("id"), str) and piece["id"]:
            call["id"] = piece["id"]
        function = piece.get("function")
        if not isinstance(function, dict):
            return
        name = function.get("name")
        if isinstance(name, str) and name and call["name"] is None:
            call["name"] = name
            self.stream.tool_call(name)
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            call["arguments"] += arguments
        elif isinstance(arguments, dict):  # a whole object, as some servers send it
            call["arguments"] = arguments

    def response(self) -> ModelResponse:
        """The whole answer; ValueError if it is malformed."""
        calls = [
            {"id": call["id"], "function": {"name": call["name"], "arguments": call["arguments"]}}
            for _, call in sorted(self.calls.items())
        ]
        message = {"content": "".join(self.text), "tool_calls": calls}
        answer = {"choices": [{"message": message, "finish_reason": self.finish}]}
        return parse_answer(answer | {"usage": self.usage})


def _message(message: Message) -> dict[str, Any]:
    if message.note:
        # A note goes as a user message marked "[note] ": many local chat templates
        # reject or drop a system message in mid-conversation, where notes land.
        return {"role": "user", "content": f"[note] {message.content}"}
    if message.role == "tool":
        return {
            "role": "tool",
            "tool_call_id": message.tool_call_id or "",
            "content": message.content,
        }
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.role == "assistant" and message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
            }
            for call in message.tool_calls
        ]
    return out


def _tool_call(raw: Any) -> ToolCall:
    function = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError("a tool call has no function name")
    name = function["name"]
    arguments = function.get("arguments")
    # Some servers (older Ollama) send the arguments as an object, not a JSON string.
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"invalid JSON in the arguments of tool call {name!r}: {exc}"
            ) from None
    elif arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ValueError(f"the arguments of tool call {name!r} are not a JSON object")
    call_id = raw.get("id")
    if not isinstance(call_id, str) or not call_id:
        # Some servers omit ids; the tool result must still name its call.
        call_id = "call_" + uuid.uuid4().hex[:12]
    return ToolCall(call_id, name, arguments)


def _describe(exc: Exception) -> str:
    return _one_line(str(exc)) or type(exc).__name__


def _one_line(text: str) -> str:
    return " ".join(text.split())
