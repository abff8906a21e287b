"""The `echo` model: deterministic, no network, for demos and tests.

It answers the most recent user message T (a framework note is not a user message):

- `T` -> `echo: T`, finish "stop".
- `/tool NAME {json args}` -> one call of NAME with those arguments (default `{}`), finish
  "tool_calls"; once a tool message follows that user message, `echo: <its content>`.
  Arguments that are not a JSON object -> `echo: invalid tool arguments: <error>`.
- `/sleep SECONDS T` -> wait SECONDS, then `echo: T`.
- `/long T` -> the first half of `echo: T`, finish "length".
- `/subagent TASK` (the message's first line; every line of that form counts, other lines
  are left out) -> one `spawn_subagent` call `{"task": TASK}` a line, all in one answer,
  finish "tool_calls"; once tool messages follow that user message, `echo: ` and their
  contents in order, joined by "; ". The worker offers the tool; echo does not check.
- `/task KIND {json args}` -> one `start_task` call `{"kind": KIND, "args": {...}}` (args
  default `{}`), finish "tool_calls"; once a tool message follows, `echo: <its content>`.
  Whether KIND is one of the operator's is the worker's to say, in that tool message.
- `/restart REASON` -> one `request_restart` call `{"reason": REASON}` (the rest of the
  message, its ends stripped), finish "tool_calls"; once a tool message follows,
  `echo: <its content>`. Whether agents may ask is the worker's to say.

- `/big N` -> N words (`t0 t1 ...`), finish "stop" (cut at `max_tokens` like any answer).

The answer streams word by word (a word with the whitespace before it; the last takes the
whitespace after it too), `delay` spread over its words, then its tool calls by name.

With a `window` (`model.context_window`), echo is a server with that context window: a
prompt whose words and `max_tokens` together pass it fails as a real server's does, a
non-transient `ModelError` naming the window (`context_exceeded`).

A malformed command (`/sleep soon`, `/tool` without a name, a `/subagent` line without a
task, `/task` without a kind or with arguments that are not a JSON object, `/restart`
without a reason) is echoed whole. An answer longer than `max_tokens` words is cut there
with finish "length". Tokens are counted as whitespace-separated words (a prompt's: its
messages' and the JSON of the tools on offer).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from supervisor.contract.clock import SYSTEM, Clock
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

_COMMAND = re.compile(r"/(tool|sleep|long|task|restart|big)(?:\s+(.*))?", re.DOTALL)
_SUBAGENT = re.compile(r"/subagent(?:\s+(.*))?")  # one line of a `/subagent` message
SPAWN = "spawn_subagent"
TASK = "start_task"
RESTART = "request_restart"
_WORD = re.compile(r"\S+")
_STREAMED = re.compile(r"\s*\S+\s*$|\s*\S+", re.DOTALL)  # a word and the spaces before it
BIG_MOST = 1_000_000  # words `/big` answers at most
COUNTS_KEPT = 8  # conversations whose word counts are kept: about one per session in use


@dataclass(frozen=True)
class _Answer:
    text: str
    finish_reason: FinishReason = "stop"
    tool_calls: list[ToolCall] = field(default_factory=list)
    sleep: float = 0.0


class EchoModel:
    """The deterministic `echo` provider; `delay` seconds are added to every call."""

    def __init__(
        self, delay: float = 0.0, max_tokens: int = 1024, window: int = 0, clock: Clock = SYSTEM
    ) -> None:
        self.delay = delay
        self.clock = clock
        self.max_tokens = max_tokens
        self.window = window
        # id of a conversation's first message -> (the messages counted, their words)
        self._counted: dict[int, tuple[list[Message], int]] = {}

    async def complete(
        self, messages: list[Message], tools: list[ToolSpec], stream: Stream = SILENT
    ) -> ModelResponse:
        """Answer the most recent user message by the rules in the module docstring,
        streaming the answer word by word with `delay` spread over its words."""
        prompt = self._prompt_tokens(messages) + _tools_words(tools)
        if self.window and prompt + self.max_tokens > self.window:
            if self.delay > 0:
                await self.clock.sleep(self.delay)
            raise ModelError(
                f"echo answered 400: This model's maximum context length is {self.window} "
                f"tokens. However, you requested {prompt + self.max_tokens} tokens "
                f"({prompt} in the messages, {self.max_tokens} in the completion).",
                context_exceeded=True,
                window=self.window,
            )
        answer = _plan(messages)
        if answer.sleep > 0:
            await self.clock.sleep(answer.sleep)
        text, finish = answer.text, answer.finish_reason
        if finish == "stop":
            text, finish = _cut(text, self.max_tokens)
        await self._stream(text, answer.tool_calls, stream)
        usage = {"prompt_tokens": prompt, "completion_tokens": _words(text)}
        return ModelResponse(text, list(answer.tool_calls), finish, usage)

    async def _stream(self, text: str, calls: list[ToolCall], stream: Stream) -> None:
        """Tell `stream` the answer a word at a time (a word with the spaces before it),
        then its tool calls; `delay` is spread evenly over the words (all of it before
        the tool calls when there is no text)."""
        words = _STREAMED.findall(text) or ([text] if text else [])  # blank: one piece
        step = self.delay / max(1, len(words))
        if not words and step > 0:
            await self.clock.sleep(step)
        for word in words:
            if step > 0:
                await self.clock.sleep(step)
            stream.text(word)
        for call in calls:
            stream.tool_call(call.name)

    async def aclose(self) -> None:
        """Nothing to release."""

    def _prompt_tokens(self, messages: list[Message]) -> int:
        """The words of `messages`. A conversation that goes on from one counted before
        costs the words of its new messages only (and a comparison of the old ones)."""
        if not messages:
            return 0
        key = id(messages[0])  # unique while kept: the kept list holds that message
        before, total = self._counted.pop(key, ([], 0))
        if not (len(before) <= len(messages) and messages[: len(before)] == before):
            before, total = [], 0
        total += sum(_words(message.content) for message in messages[len(before) :])
        self._counted[key] = (list(messages), total)
        while len(self._counted) > COUNTS_KEPT:
            del self._counted[next(iter(self._counted))]
        return total


def _plan(messages: list[Message]) -> _Answer:
    """What echo answers to `messages`, before any waiting or cutting."""
    index = _last_user_index(messages)
    if index is None:
        return _Answer("echo: ")
    text = messages[index].content
    if _SUBAGENT.fullmatch(text.split("\n", 1)[0].rstrip()):
        return _subagents(messages, index, text)
    match = _COMMAND.fullmatch(text)
    if match is None:
        return _Answer(f"echo: {text}")
    command, rest = match.group(1), match.group(2) or ""
    if command == "tool":
        return _tool(messages, index, text, rest)
    if command == "sleep":
        return _sleep(text, rest)
    if command == "task":
        return _task(messages, index, text, rest)
    if command == "restart":
        return _restart(messages, index, text, rest)
    if command == "big":
        count = rest.strip()
        if not count.isdigit() or not 0 < int(count) <= BIG_MOST:
            return _Answer(f"echo: {text}")
        return _Answer(" ".join(f"t{i}" for i in range(int(count))))
    full = f"echo: {rest}"
    return _Answer(full[: max(1, len(full) // 2)], "length")


def tool_call_id(index: int, name: str, arguments: dict[str, Any]) -> str:
    """The id echo gives the call asked for by the user message at `index`."""
    key = json.dumps([index, name, arguments], sort_keys=True, separators=(",", ":"))
    return "call_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _last_user_index(messages: list[Message]) -> int | None:
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if message.role == "user" and not message.note:
            return index
    return None


def _tool(messages: list[Message], index: int, text: str, rest: str) -> _Answer:
    parts = rest.split(None, 1)
    if not parts:
        return _Answer(f"echo: {text}")
    name = parts[0]
    arguments: Any = {}
    if len(parts) > 1:
        try:
            arguments = json.loads(parts[1])
        except json.JSONDecodeError as exc:
            return _Answer(f"echo: invalid tool arguments: {exc}")
        if not isinstance(arguments, dict):
            kind = type(arguments).__name__
            return _Answer(f"echo: invalid tool arguments: expected a JSON object, got {kind}")
    call = ToolCall(tool_call_id(index, name, arguments), name, arguments)
    results = [m for m in messages[index + 1 :] if m.role == "tool"]
    if not results:
        return _Answer("", "tool_calls", [call])
    # Prefer the result that names our call; any later tool message still counts, so a
    # history rewritten by another agent does not make echo ask for the tool forever.
    answering = next((m for m in results if m.tool_call_id == call.id), results[0])
    return _Answer(f"echo: {answering.content}")


def _task(messages: list[Message], index: int, text: str, rest: str) -> _Answer:
    """`/task KIND {json}`: the `start_task` call `/tool` would make of it."""
    parts = rest.split(None, 1)
    arguments: Any = None
    if parts:
        try:
            arguments = json.loads(parts[1]) if len(parts) > 1 else {}
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict):
        return _Answer(f"echo: {text}")
    call = json.dumps({"kind": parts[0], "args": arguments})
    return _tool(messages, index, text, f"{TASK} {call}")


def _restart(messages: list[Message], index: int, text: str, rest: str) -> _Answer:
    """`/restart REASON`: the `request_restart` call `/tool` would make of it."""
    reason = rest.strip()
    if not reason:
        return _Answer(f"echo: {text}")
    return _tool(messages, index, text, f"{RESTART} {json.dumps({'reason': reason})}")


def _subagents(messages: list[Message], index: int, text: str) -> _Answer:
    """One `spawn_subagent` call a `/subagent TASK` line; then the results, all of them."""
    calls = []
    for line_number, line in enumerate(text.split("\n")):
        match = _SUBAGENT.fullmatch(line.rstrip())
        if match is None:
            continue
        task = (match.group(1) or "").strip()
        if not task:
            return _Answer(f"echo: {text}")
        # The line number in the id's key: two lines with the same task are two calls.
        key = {"task": task, "line": line_number}
        calls.append(ToolCall(tool_call_id(index, SPAWN, key), SPAWN, {"task": task}))
    results = [m.content for m in messages[index + 1 :] if m.role == "tool"]
    if not results:
        return _Answer("", "tool_calls", calls)
    return _Answer("echo: " + "; ".join(results))


def _sleep(text: str, rest: str) -> _Answer:
    parts = rest.split(None, 1)
    try:
        seconds = float(parts[0]) if parts else math.nan
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        return _Answer(f"echo: {text}")
    return _Answer(f"echo: {parts[1] if len(parts) > 1 else ''}", sleep=seconds)


def _cut(text: str, max_tokens: int) -> tuple[str, FinishReason]:
    words = list(_WORD.finditer(text))
    if len(words) <= max_tokens:
        return text, "stop"
    return text[: words[max_tokens - 1].end()], "length"


def _tools_words(tools: list[ToolSpec]) -> int:
    """The words of the tools on offer, as a server counts them in the prompt."""
    if not tools:
        return 0
    specs = [[t.name, t.description, t.input_schema] for t in tools]
    return _words(json.dumps(specs, separators=(", ", ": ")))


def _words(text: str) -> int:
    return len(text.split())
