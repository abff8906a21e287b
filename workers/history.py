"""A session's conversation rebuilt from its event log, and the shape of a turn's tail.

Pure functions over committed events: no database, no clock. The worker calls them when
it (re)builds a session on first touch and before it continues an interrupted turn.
How a turn's tail stands is read by `supervisor.core.tail`, shared with recovery.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from supervisor.core.tail import Resume as Tail
from supervisor.core.tail import resume_from
from supervisor.core.vocabulary import EventType
from supervisor.store import EventRecord
from workers.models import Message, ToolCall

# The synthetic result of a call that started but has no recorded result.
INTERRUPTED_RESULT = "interrupted before a result was recorded; it may or may not have taken effect"
# The synthetic result of a call the model asked for but that never started.
NOT_STARTED_RESULT = "not run: the turn was interrupted before this call started"


def message_of(event: EventRecord) -> Message | None:
    """The conversation message an event stands for, if any."""
    payload = event.payload
    if event.type == EventType.USER_MESSAGE:
        return Message("user", str(payload.get("text", "")))
    if event.type == EventType.MODEL_RESPONSE:
        return Message("assistant", str(payload.get("text", "")), tool_calls=calls_of(payload))
    if event.type == EventType.TOOL_RESULT:
        return Message("tool", str(payload.get("content", "")), tool_call_id=payload.get("call_id"))
    if event.type == EventType.CONTINUATION:
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
    a turn did not read (after its `turn_started`'s `read_to`, and before its end; it may
    even precede the `turn_started`, if it landed between the read and that commit) is
    placed after the turn's end, as the model saw it: the turn answered what came
    before, and the message drives the next turn. Any user message is placed after the
    results of the calls still open then, so that an assistant message asking for tools
    is always followed by their results.
    """
    events = list(events)
    unread = _unread_by(events)
    messages: list[Message] = []
    open_calls: set[str] = set()
    held: list[Message] = []  # waiting for open calls' results
    waiting: dict[str, list[Message]] = {}  # turn id -> messages it did not read

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
        if event.type == EventType.TURN_ENDED and event.turn_id in waiting:
            for message in waiting.pop(event.turn_id):
                place(message)
            continue
        found = message_of(event)
        if found is None:
            continue
        turn = unread.get(event.seq) if event.type == EventType.USER_MESSAGE else None
        if turn is not None:
            waiting.setdefault(turn, []).append(found)
            continue
        place(found)
    return messages + held + [m for later in waiting.values() for m in later]


def read_by(turn_id: str, events: Sequence[EventRecord]) -> list[EventRecord]:
    """`events` without the user messages turn `turn_id` did not read (after its
    `read_to`): what a continuation of the turn may show the model. Those messages drive
    the next turn; shown to the continuation too, they would be answered twice."""
    read_to = next(
        (
            e.payload.get("read_to")
            for e in events
            if e.type == EventType.TURN_STARTED and e.turn_id == turn_id
        ),
        None,
    )
    if not isinstance(read_to, int):
        return list(events)
    return [e for e in events if not (e.type == EventType.USER_MESSAGE and e.seq > read_to)]


def _unread_by(events: Sequence[EventRecord]) -> dict[int, str]:
    """User messages a turn did not read although they came before its end: seq -> turn."""
    spans: list[tuple[int, float, str]] = []  # (read_to, end seq, turn id)
    ends = {e.turn_id: e.seq for e in events if e.type == EventType.TURN_ENDED and e.turn_id}
    for event in events:
        read_to = event.payload.get("read_to") if event.type == EventType.TURN_STARTED else None
        if isinstance(read_to, int) and event.turn_id:
            spans.append((read_to, ends.get(event.turn_id, float("inf")), event.turn_id))
    # Turns follow each other, so the one that could have missed a message is the last to
    # read before it.
    spans.sort()
    reads = [read_to for read_to, _, _ in spans]
    unread: dict[int, str] = {}
    for event in events:
        if event.type == EventType.USER_MESSAGE and (i := bisect_left(reads, event.seq)):
            _, end, turn = spans[i - 1]
            if event.seq < end:
                unread[event.seq] = turn
    return unread


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
        if event.type == EventType.MODEL_RESPONSE:
            for call in calls_of(event.payload):
                asked[call.id] = call.name
        elif event.type == EventType.TOOL_CALL:
            started.add(str(event.payload.get("call_id")))
        elif event.type == EventType.TOOL_RESULT:
            answered.add(str(event.payload.get("call_id")))
    return [
        MissingResult(call_id, name, call_id in started)
        for call_id, name in asked.items()
        if call_id not in answered
    ]


def turn_events(events: Sequence[EventRecord], turn_id: str) -> list[EventRecord]:
    """The events of one turn, from its `turn_started` on."""
    start = 0
    for index, event in enumerate(events):
        if event.type == EventType.TURN_STARTED and event.turn_id == turn_id:
            start = index
    return [e for e in events[start:] if e.turn_id in (turn_id, None)]


def classify_tail(events: Sequence[EventRecord]) -> Tail:
    """Decide how to go on with a turn, from its events (after any repair).

    The supervisor's recovery reads the same tail with the same classifier.
    """
    return resume_from(events)
