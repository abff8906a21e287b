"""A session's conversation rebuilt from its event log, and the shape of a turn's tail.

Pure code over committed events: no database, no clock. The worker calls it when a turn
starts and before it continues an interrupted turn. `Conversation` and `Calls` keep what
`to_messages` and `missing_results` give for a log that grows at its end, so a turn costs
what its new events cost, not the whole history. How a turn's tail stands is read by
`supervisor.core.tail`, shared with recovery.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from supervisor.core.tail import Resume as Tail
from supervisor.core.tail import resume_from
from supervisor.core.vocabulary import INPUT_EVENTS, EventType
from supervisor.restarts import rules as restarts
from supervisor.store import EventRecord
from supervisor.subagents.rules import result_text
from workers import restarting, spawning, tasking
from workers.models import Message, ToolCall

# The event types read here, as module names: looking up an enum member costs more than
# comparing it, and these comparisons run for every event of a log.
_USER, _MODEL = EventType.USER_MESSAGE, EventType.MODEL_RESPONSE
_SUBAGENT, _SPAWNED = EventType.SUBAGENT_RESULT, EventType.SUBAGENT_SPAWNED
_TASK, _TASK_STARTED = EventType.TASK_RESULT, EventType.TASK_STARTED
_RESTART = EventType.RESTART_RESULT
_INPUT = INPUT_EVENTS  # what a turn answers: a user message, or a result (subagent, task, restart)
_CALL, _RESULT = EventType.TOOL_CALL, EventType.TOOL_RESULT
_CONTINUATION = EventType.CONTINUATION
_STARTED, _ENDED = EventType.TURN_STARTED, EventType.TURN_ENDED
_TURN_MARKS = frozenset((_STARTED, _ENDED))

# The synthetic result of a call that started but has no recorded result.
INTERRUPTED_RESULT = "interrupted before a result was recorded; it may or may not have taken effect"
# The synthetic result of a call the model asked for but that never started.
NOT_STARTED_RESULT = "not run: the turn was interrupted before this call started"


def message_of(event: EventRecord) -> Message | None:
    """The conversation message an event stands for, if any."""
    payload = event.payload
    if event.type == _USER:
        return Message("user", str(payload.get("text", "")))
    if event.type == _MODEL:
        text, calls = str(payload.get("text", "")), calls_of(payload)
        return Message("assistant", text, tool_calls=calls, tokens=_count(payload))
    if event.type == _RESULT:
        content, call_id = str(payload.get("content", "")), payload.get("call_id")
        return Message("tool", content, tool_call_id=call_id, tokens=_count(payload))
    if event.type == _CONTINUATION:
        return Message("user", str(payload.get("text", "")), note=True)
    if event.type == _SUBAGENT:
        return Message("user", result_text(payload))
    if event.type == _TASK:
        return Message("user", tasking.result_message(payload))
    if event.type == _RESTART:
        return Message("user", restarts.result_text(payload))
    return None


def _count(payload: dict[str, Any]) -> int | None:
    """The token count an event kept (`workers.context`), if it kept one."""
    tokens = payload.get("tokens")
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None


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
    placement = _Placement(_unread_by(events))
    for event in events:
        placement.add(event)
    return placement.result()


class _Placement:
    """`to_messages` under way: the messages placed, and those waiting for their place."""

    def __init__(self, unread: dict[int, str]) -> None:
        self.unread = unread  # seq of a user message -> the turn that did not read it
        self.messages: list[Message] = []
        self.open_calls: set[str] = set()
        self.held: list[Message] = []  # waiting for open calls' results
        self.waiting: dict[str, list[Message]] = {}  # turn id -> messages it did not read

    @property
    def settled(self) -> bool:
        """No call open and no message held or waiting: what follows starts afresh."""
        return not (self.open_calls or self.held or self.waiting)

    def add(self, event: EventRecord) -> None:
        """Place the message `event` stands for, or the ones its turn's end releases."""
        if event.type == _ENDED and event.turn_id in self.waiting:
            for message in self.waiting.pop(event.turn_id):
                self._place(message)
            return
        found = message_of(event)
        if found is None:
            return
        turn = self.unread.get(event.seq) if event.type in _INPUT else None
        if turn is not None:
            self.waiting.setdefault(turn, []).append(found)
            return
        self._place(found)

    def _place(self, message: Message) -> None:
        if message.role == "user" and self.open_calls:
            self.held.append(message)
            return
        self.messages.append(message)
        if message.role == "assistant":
            self.open_calls = {call.id for call in message.tool_calls}
        elif message.role == "tool":
            self.open_calls.discard(message.tool_call_id or "")
        if not self.open_calls and self.held:
            self.messages.extend(self.held)
            self.held = []

    def result(self) -> list[Message]:
        """The messages, with those still held or waiting at the end."""
        return self.messages + self.held + [m for later in self.waiting.values() for m in later]


class Conversation:
    """`to_messages` of a log that grows at its end, built once up to a cut.

    The messages of the events before the cut are kept; a call builds only the events
    after it. The cut stands where the two sides cannot change each other's messages:
    the conversation is settled there (no call open, no message held or waiting), every
    turn started before it also ended before it and read no further than it, no turn
    after it read less than it, and no turn id is on both sides. Only an appended event
    that breaks this (`follows` is False) could change the kept messages; the log then
    starts a new Conversation.
    """

    def __init__(self) -> None:
        self.cut = 0  # the index of the first event after the cut
        self._before: list[Message] = []  # the messages of the events before the cut
        self._cut_seq = 0  # the seq of the last event before the cut
        self._turns: set[str] = set()  # turns started or ended before the cut

    def follows(self, event: EventRecord) -> bool:
        """Whether `event`, appended to the log, leaves the kept messages as they are."""
        if event.type not in _TURN_MARKS:
            return True
        if event.turn_id in self._turns:
            return False
        read_to = event.payload.get("read_to") if event.type == _STARTED else None
        return not (isinstance(read_to, int) and read_to < self._cut_seq)

    def messages(
        self, events: Sequence[EventRecord], extra: Sequence[EventRecord] = (), turn: str = ""
    ) -> list[Message]:
        """`to_messages(events + extra)`, or of `read_by(turn, events + extra)` with a turn.

        `events` is the log the cut was found in, grown since only at its end.
        """
        if turn in self._turns:  # the turn started before the cut: read it all
            return to_messages(read_by(turn, [*events, *extra]))
        after = [*events[self.cut :], *extra]
        return self._before + to_messages(read_by(turn, after) if turn else after)

    def advance(self, events: Sequence[EventRecord]) -> None:
        """Move the cut as far along `events` as it may go."""
        after = events[self.cut :]
        if not after or after[0].seq <= self._cut_seq:
            return
        found = _cut_in(after)
        if found is None:
            return
        index, messages = found
        self._before.extend(messages)
        self._cut_seq = after[index - 1].seq
        self._turns.update(_turn_ids(after[:index]))
        self.cut += index


def _cut_in(events: Sequence[EventRecord]) -> tuple[int, list[Message]] | None:
    """The last cut in `events` (see Conversation) and the messages before it, if any.

    One pass: the unread messages are found over all `events`, which at a cut gives the
    same as over the events before it (nothing after it reads less, no turn straddles it).
    """
    if any(a.seq >= b.seq for a, b in pairwise(events)):
        return None  # cuts are found in a log ordered by seq only
    lowest = [math.inf] * (len(events) + 1)  # the least read_to at or after each index
    last: dict[str, int] = {}  # turn id -> the index of its last turn_started or turn_ended
    for index in range(len(events) - 1, -1, -1):
        event = events[index]
        lowest[index] = lowest[index + 1]
        if _is_turn_mark(event):
            last.setdefault(str(event.turn_id), index)
            lowest[index] = min(lowest[index], _read_to(event))
    placement = _Placement(_unread_by(events))
    seen: set[str] = set()
    unended: set[str] = set()  # turns whose first mark before the cut is a start, not ended
    straddling = 0  # turns seen before the cut that show up again after it
    read_most = -math.inf  # the greatest read_to before the cut
    found: tuple[int, int] | None = None  # (cut index, messages before it)
    for index, event in enumerate(events):
        placement.add(event)
        if _is_turn_mark(event):
            turn = str(event.turn_id)
            first = turn not in seen
            if first and last[turn] > index:
                straddling += 1
            elif not first and last[turn] == index:
                straddling -= 1
            seen.add(turn)
            if event.type == _STARTED:
                read_most = max(read_most, _read_to(event, -math.inf))
                if first:
                    unended.add(turn)
            else:
                unended.discard(turn)
        if (
            placement.settled
            and not (straddling or unended)
            and read_most <= event.seq <= lowest[index + 1]
        ):
            found = (index + 1, len(placement.messages))
    if found is None:
        return None
    return found[0], placement.messages[: found[1]]


def compaction_cuts(events: Sequence[EventRecord]) -> list[tuple[int, int]]:
    """Where the older part of `events` may be replaced by a summary: (the seq of the
    last event before the cut, the number of `to_messages(events)` before it), oldest first.

    A cut stands right after a `turn_ended`, where no tool call is open and no message is
    held or waiting for its place: the messages before it are those of the events before
    it, and every message after it, the input of the turn in flight included, is after
    it. A turn in flight is never cut.
    """
    placement = _Placement(_unread_by(events))
    cuts: list[tuple[int, int]] = []
    for event in events:
        released = event.type == _ENDED and event.turn_id in placement.waiting
        placement.add(event)
        if event.type == _ENDED and not released and placement.settled:
            cuts.append((event.seq, len(placement.messages)))
    return cuts


def _is_turn_mark(event: EventRecord) -> bool:
    return bool(event.turn_id) and event.type in _TURN_MARKS


def _read_to(event: EventRecord, otherwise: float = math.inf) -> float:
    """The `read_to` of a turn's start, or `otherwise`."""
    if event.type == _STARTED and event.turn_id:
        value = event.payload.get("read_to")
        if isinstance(value, int):
            return value
    return otherwise


def _turn_ids(events: Iterable[EventRecord]) -> set[str]:
    return {str(e.turn_id) for e in events if _is_turn_mark(e)}


def read_by(turn_id: str, events: Sequence[EventRecord]) -> list[EventRecord]:
    """`events` without the user messages turn `turn_id` did not read (after its
    `read_to`): what a continuation of the turn may show the model. Those messages drive
    the next turn; shown to the continuation too, they would be answered twice."""
    read_to = next(
        (e.payload.get("read_to") for e in events if e.type == _STARTED and e.turn_id == turn_id),
        None,
    )
    if not isinstance(read_to, int):
        return list(events)
    return [e for e in events if not (e.type in _INPUT and e.seq > read_to)]


def _unread_by(events: Sequence[EventRecord]) -> dict[int, str]:
    """User messages a turn did not read although they came before its end: seq -> turn."""
    spans: list[tuple[int, float, str]] = []  # (read_to, end seq, turn id)
    ends = {e.turn_id: e.seq for e in events if e.type == _ENDED and e.turn_id}
    for event in events:
        read_to = event.payload.get("read_to") if event.type == _STARTED else None
        if isinstance(read_to, int) and event.turn_id:
            spans.append((read_to, ends.get(event.turn_id, float("inf")), event.turn_id))
    # Turns follow each other, so the one that could have missed a message is the last to
    # read before it.
    spans.sort()
    reads = [read_to for read_to, _, _ in spans]
    unread: dict[int, str] = {}
    for event in events:
        if event.type in _INPUT and (i := bisect_left(reads, event.seq)):
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
    # What the call did, when the log says: a spawn (`subagent_spawned`) or a task's start
    # (`task_started`) is committed whole, with the call's id.
    done: str | None = None

    def payload(self) -> dict[str, Any]:
        """The synthetic result that repairs the history: an error, or what the call did
        when the log says."""
        if self.done is not None:
            return {
                "call_id": self.call_id,
                "name": self.name,
                "content": self.done,
                "is_error": False,
                "repaired": True,
            }
        return {
            "call_id": self.call_id,
            "name": self.name,
            "content": INTERRUPTED_RESULT if self.started else NOT_STARTED_RESULT,
            "is_error": True,
            "repaired": True,
        }


def missing_results(events: Iterable[EventRecord]) -> list[MissingResult]:
    """Tool calls asked for in `events` that never got a result, in the order asked."""
    calls = Calls()
    for event in events:
        calls.add(event)
    return calls.missing()


class Calls:
    """`missing_results` of a log that grows at its end, kept event by event."""

    def __init__(self) -> None:
        self._open: dict[str, str] = {}  # call id -> tool name, in the order first asked
        self._started: set[str] = set()
        self._answered: set[str] = set()
        self._done: dict[str, str] = {}  # call id -> what it did (see MissingResult.done)
        self._asking: str | None = None  # a `request_restart` call started, not answered

    def add(self, event: EventRecord) -> None:
        """Take in the next event of the log."""
        if event.type == _MODEL:
            for call in calls_of(event.payload):
                if call.id not in self._answered:
                    self._open[call.id] = call.name
        elif event.type == _CALL:
            call_id = str(event.payload.get("call_id"))
            self._started.add(call_id)
            self._asking = call_id if event.payload.get("name") == restarting.TOOL else None
        elif event.type == _SPAWNED and event.payload.get("call_id"):
            child = str(event.payload.get("subagent"))
            self._done[str(event.payload["call_id"])] = spawning.started(child)
        elif event.type == _TASK_STARTED and event.payload.get("call_id"):
            task, kind = str(event.payload.get("task")), str(event.payload.get("kind"))
            self._done[str(event.payload["call_id"])] = tasking.started(task, kind)
        elif event.type == _RESULT:
            call_id = str(event.payload.get("call_id"))
            # An answered call is never missing again, whatever comes later.
            self._answered.add(call_id)
            self._open.pop(call_id, None)
            self._started.discard(call_id)
            self._asking = None if self._asking == call_id else self._asking
        elif self._asking is not None and event.type == EventType.RESTART_REQUESTED:
            # Committed inside the call that asked, after its `tool_call`, before its result.
            self._done[self._asking] = restarting.repaired(event.payload)

    def missing(self) -> list[MissingResult]:
        """The calls asked for so far that have no result, in the order asked."""
        return [
            MissingResult(call_id, name, call_id in self._started, self._done.get(call_id))
            for call_id, name in self._open.items()
        ]


def turn_events(events: Sequence[EventRecord], turn_id: str) -> list[EventRecord]:
    """The events of one turn, from its (last) `turn_started` on."""
    start = 0
    for index in range(len(events) - 1, -1, -1):  # from the end: the turn is usually last
        event = events[index]
        if event.type == _STARTED and event.turn_id == turn_id:
            start = index
            break
    return [e for e in events[start:] if e.turn_id in (turn_id, None)]


def classify_tail(events: Sequence[EventRecord]) -> Tail:
    """Decide how to go on with a turn, from its events (after any repair).

    The supervisor's recovery reads the same tail with the same classifier.
    """
    return resume_from(events)
