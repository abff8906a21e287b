"""The model interface the agents call: messages in, one response out.

Plain data and two protocols, no I/O. A provider (`echo`, `openai`) turns a conversation
and the tools on offer into a `ModelResponse`, or raises `ModelError` with a one-line
message fit for a human and the event log. While it answers, it tells a `Stream` what it
has so far (text as it comes, each tool call by name as the model makes it): the live
output of the turn. The response is still the whole answer; a stream only watches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "tool_calls", "length"]


@dataclass(frozen=True)
class ToolCall:
    """One call of a tool the model asked for; `arguments` is already decoded."""

    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolSpec:
    """A tool offered to the model; the hints are kept for recovery, not sent."""

    name: str
    description: str
    input_schema: dict[str, Any]
    read_only: bool = False
    idempotent: bool = False


@dataclass(frozen=True)
class Message:
    """One message of a conversation.

    `tool_calls` is set on assistant messages that asked for tools; `tool_call_id` on
    tool messages, naming the call they answer. `note=True` marks a framework note (a
    continuation note after a crash, say): it is never a user message, whatever its role.
    """

    role: Role
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    note: bool = False
    tokens: int | None = None  # what its event counted, if it kept a count


@dataclass(frozen=True)
class ModelResponse:
    """What one model call produced.

    `finish_reason` is "stop" (a final answer), "tool_calls" (run the tools, then call
    again) or "length" (cut by the token limit). `usage` holds token counts such as
    `prompt_tokens` and `completion_tokens`, when the provider reports them.
    """

    text: str
    tool_calls: list[ToolCall]
    finish_reason: FinishReason
    usage: dict[str, int]


class ModelError(Exception):
    """A model call failed: timeout, connection, HTTP error status or malformed answer.

    The message is one line naming the server and what went wrong. `transient` says
    whether the same call may succeed if tried again later (timeouts, refused
    connections, 429 and 5xx) or not (other 4xx, malformed answers, missing settings).
    `retry_after` is the wait a 429 or 503 asked for, in seconds, when it named one.
    """

    def __init__(
        self,
        message: str,
        *,
        transient: bool = False,
        context_exceeded: bool = False,
        window: int | None = None,
    ) -> None:
        super().__init__(message)
        self.transient = transient
        # The prompt did not fit the model's context window (`window` tokens, when the
        # server said): compacting the conversation may make the same call succeed.
        self.context_exceeded = context_exceeded
        self.window = window
        self.retry_after: float | None = None


class Stream(Protocol):
    """What a model call tells as it goes; both methods return at once, never raise."""

    def text(self, text: str) -> None:
        """The answer's next `text` (its pieces, joined, are the response's text)."""
        ...

    def tool_call(self, name: str) -> None:
        """The model calls the tool `name` (its arguments may still be coming)."""
        ...


class Silent:
    """The stream of a call nobody watches."""

    def text(self, text: str) -> None:
        """Nothing: nobody watches."""

    def tool_call(self, name: str) -> None:
        """Nothing: nobody watches."""


SILENT = Silent()


@runtime_checkable
class Model(Protocol):
    """A model provider, as the agents see it."""

    async def complete(
        self, messages: list[Message], tools: list[ToolSpec], stream: Stream = SILENT
    ) -> ModelResponse:
        """Answer the conversation `messages`, offering `tools`, telling `stream` the answer
        as it comes; raise `ModelError`."""
        ...

    async def aclose(self) -> None:
        """Release connections; the model may be used again afterwards."""
        ...
