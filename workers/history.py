"""A session's conversation rebuilt from its event log, and the shape of a turn's tail.

Pure functions over committed events: no database, no clock. The worker calls them when
it (re)builds a session on first touch and before it continues an interrupted turn.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from supervisor.store import EventRecord
from workers.models import Message, ToolCall

# The synthetic result of a call that started but has no recorded result.
INTERRUPTED_RESULT = "interrupted before a result was recorded; it may or may not have taken effect"
# The synthetic result of a call the model asked for but that never started.
NOT_STARTED_RESULT = "not run: the turn was interrupted before this call started"


def message_of(event: EventRecord) -> Message | None:
    """The conversation message an event stands for, if any."""
    payload = event.payload
    if event.type == "user_message":
        return Message("user", str(payload.get("text", "")))
    if event.type == "model_response":
        return Message("assistant", str(payload.get("text", "")), tool_calls=calls_of(payload))
    if event.type == "tool_result":
        return Message("tool", str(payload.get("content", "")), tool_call_id=payload.get("call_id"))
    if event.type == "continuation":
        return Message("user", str(payload.get("text", "")), note=True)
    return None


def calls_of(payload: dict[str, Any]) -> list[ToolCall]:
    """The tool calls of a `model_response` payload."""
    return [
        ToolCall(str(c["id"]), str(c["name"]), dict(c.get("arguments") or {}))
        for c in payload.get("tool_calls") or []
    ]


def to_messages(events: Iterable[EventRecord]) -> list[Message]:
    """The conversation, oldest first, in an order chat models accept.

    A user message can be committed while a turn runs (intake needs no lease). One that
    the turn did not read (after its `turn_started`'s `read_to`) is placed after the
    turn's end, as the model saw it: the turn answered what came before, and the message
    drives the next turn. Any user message is placed after the results of the calls still
    open then, so that an assistant message asking for tools is always followed by their
    results.
    """
    messages: list[Message] = []
    open_calls: set[str] = set()
    held: list[Message] = []  # waiting for open calls' results
    unseen: list[Message] = []  # waiting for the end of the turn that did not read them
    read_to: int | None = None  # of the turn in the log, until its turn_ended

    def place(message: Message) -> None:
        nonlocal open_calls, held
        if message.role == "user" and open_calls:
            held.append(message)
            return
        messages.append(message)
        if message.role == "assistant":
            open_calls = {call.id for call in message.tool_calls}
        elif message.role == "tool":
            open_calls.discard(message.tool_call_id or "")
        if not open_calls and held:
            messages.extend(held)
            held = []

    for event in events:
        if event.type in ("turn_started", "turn_ended"):
            for message in unseen:
                place(message)
            unseen = []
            value = event.payload.get("read_to") if event.type == "turn_started" else None
            read_to = value if isinstance(value, int) else None
            continue
        found = message_of(event)
        if found is None:
            continue
        if event.type == "user_message" and read_to is not None and event.seq > read_to:
            unseen.append(found)
            continue
        place(found)
    return messages + held + unseen


@dataclass(frozen=True)
class MissingResult:
    """A tool call the model asked for that has no `tool_result`."""

    call_id: str
    name: str
    started: bool  # a `tool_call` event says it began running

    def payload(self) -> dict[str, Any]:
        """The synthetic error result that repairs the history."""
        return {
            "call_id": self.call_id,
            "name": self.name,
            "content": INTERRUPTED_RESULT if self.started else NOT_STARTED_RESULT,
            "is_error": True,
            "repaired": True,
        }


def missing_results(events: Sequence[EventRecord]) -> list[MissingResult]:
    """Tool calls asked for in `events` that never got a result, in the order asked."""
    asked: dict[str, str] = {}
    started: set[str] = set()
    answered: set[str] = set()
    for event in events:
        if event.type == "model_response":
            for call in calls_of(event.payload):
                asked[call.id] = call.name
        elif event.type == "tool_call":
            started.add(str(event.payload.get("call_id")))
        elif event.type == "tool_result":
            answered.add(str(event.payload.get("call_id")))
    return [
        MissingResult(call_id, name, call_id in started)
        for call_id, name in asked.items()
        if call_id not in answered
    ]


class Tail(Enum):
    """How an interrupted turn stands."""

    ANSWERED = "answered"  # its final answer is committed; only `turn_ended` is missing
    TRUNCATED = "truncated"  # its last answer was cut by the token limit
    RUN = "run"  # the model must be called again to go on


def turn_events(events: Sequence[EventRecord], turn_id: str) -> list[EventRecord]:
    """The events of one turn, from its `turn_started` on."""
    start = 0
    for index, event in enumerate(events):
        if event.type == "turn_started" and event.turn_id == turn_id:
            start = index
    return [e for e in events[start:] if e.turn_id in (turn_id, None)]


def classify_tail(events: Sequence[EventRecord]) -> Tail:
    """Decide how to go on with a turn, from its events (after any repair)."""
    # A user message that arrived during the turn drives the next turn, not this one.
    for event in reversed(events):
        if event.type == "tool_result":
            return Tail.RUN
        if event.type == "model_response":
            if calls_of(event.payload):
                return Tail.RUN
            if event.payload.get("finish_reason") == "length":
                return Tail.TRUNCATED
            return Tail.ANSWERED
    return Tail.RUN
