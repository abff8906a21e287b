"""The tail of a turn: how far it got, read from its committed events.

One classifier for both sides, so that they agree on when a turn is answered: recovery
(in the supervisor) asks `classify_tail` whether and how an interrupted turn may go on;
the worker, continuing a turn it was handed, asks `resume_from` whether to call the model
again, ask it to go on from a cut answer, or only end the turn.

Pure code over events: no database, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any, Protocol

from supervisor.core.vocabulary import EventType, TurnOutcome


class TailClass(Enum):
    """How the tail of an interrupted turn stands; decides how, or whether, to go on."""

    # Continued:
    UNANSWERED_USER_MESSAGE = "unanswered_user_message"  # no model call answered it yet
    TOOL_RESULT_NOT_CONSUMED = "tool_result_not_consumed"  # the model has not seen it yet
    TOOL_CALL_WITHOUT_RESULT = "tool_call_without_result"  # repaired first, then continued
    CUT_BY_MAX_TOKENS = "cut_by_max_tokens"  # the model's output stopped at its token limit
    ANSWERED = "answered"  # the final answer is committed; only `turn_ended` is missing
    # Never continued; the user is asked to resend:
    LAST_IS_CONTINUATION_NOTE = "last_is_continuation_note"  # a note would follow a note
    # Never continued; nothing to say:
    OPERATOR_INTERRUPT = "operator_interrupt"  # `POST /interrupt` ended it
    ENDED_IN_ERROR = "ended_in_error"  # the turn ended in an error

    @property
    def continuable(self) -> bool:
        """True for a tail that a continuation may go on from."""
        return self in CONTINUABLE_TAILS


CONTINUABLE_TAILS = frozenset(
    {
        TailClass.UNANSWERED_USER_MESSAGE,
        TailClass.TOOL_RESULT_NOT_CONSUMED,
        TailClass.TOOL_CALL_WITHOUT_RESULT,
        TailClass.CUT_BY_MAX_TOKENS,
        TailClass.ANSWERED,
    }
)
UNSAFE_TAILS = frozenset({TailClass.LAST_IS_CONTINUATION_NOTE})
ENDED_TAILS = frozenset({TailClass.OPERATOR_INTERRUPT, TailClass.ENDED_IN_ERROR})
TERMINAL_TAILS = UNSAFE_TAILS | ENDED_TAILS
STEP_EVENTS = (EventType.MODEL_RESPONSE, EventType.TOOL_RESULT, EventType.CONTINUATION)


class Resume(Enum):
    """How a continuation goes on from its tail (the worker's reading of a `TailClass`)."""

    ANSWERED = "answered"  # its final answer is committed; only `turn_ended` is missing
    TRUNCATED = "truncated"  # its last answer was cut by the token limit
    RUN = "run"  # the model must be called again to go on


class TailEvent(Protocol):
    """What the classifier reads of an event (a `supervisor.store.EventRecord`)."""

    @property
    def type(self) -> str: ...
    @property
    def turn_id(self) -> str | None: ...
    @property
    def payload(self) -> dict[str, Any]: ...


def classify_tail(events: Sequence[TailEvent], turn_id: str | None = None) -> TailClass:
    """How the interrupted turn `turn_id` stands, from the session's latest events.

    `events` oldest first, from at least the turn's `turn_started` (earlier ones are
    ignored). With `turn_id` None, every event given is the turn's. User messages that
    arrived during the turn are not its tail: a queued message is its own fact
    (`Interruption.queued_user_message`).

    | the turn's events, latest last                      | tail                     |
    |-----------------------------------------------------|--------------------------|
    | a `turn_ended`, interrupted_by_operator             | OPERATOR_INTERRUPT       |
    | a `turn_ended`, any other outcome                   | ENDED_IN_ERROR           |
    | the last is a `continuation` note                   | LAST_IS_CONTINUATION_NOTE|
    | a call the model asked for has no result            | TOOL_CALL_WITHOUT_RESULT |
    | the last step is a `tool_result`                    | TOOL_RESULT_NOT_CONSUMED |
    | the last step is an answer cut at the token limit   | CUT_BY_MAX_TOKENS        |
    | the last step is a final answer                     | ANSWERED                 |
    | no model or tool step yet                           | UNANSWERED_USER_MESSAGE  |
    """
    own: Sequence[TailEvent] = events
    if turn_id is not None:
        start = 0
        for index, event in enumerate(events):
            if event.type == EventType.TURN_STARTED and event.turn_id == turn_id:
                start = index
        own = [e for e in events[start:] if e.turn_id == turn_id]
    for event in own:
        if event.type == EventType.TURN_ENDED:
            if event.payload.get("outcome") == TurnOutcome.INTERRUPTED_BY_OPERATOR:
                return TailClass.OPERATOR_INTERRUPT
            return TailClass.ENDED_IN_ERROR
    steps = [e for e in own if e.type in STEP_EVENTS]
    if not steps:
        return TailClass.UNANSWERED_USER_MESSAGE
    if steps[-1].type == EventType.CONTINUATION:
        return TailClass.LAST_IS_CONTINUATION_NOTE
    asked = {
        str(call.get("id"))
        for e in own
        if e.type == EventType.MODEL_RESPONSE
        for call in e.payload.get("tool_calls") or []
    }
    answered = {str(e.payload.get("call_id")) for e in own if e.type == EventType.TOOL_RESULT}
    if asked - answered:
        return TailClass.TOOL_CALL_WITHOUT_RESULT
    last = steps[-1]
    if last.type == EventType.TOOL_RESULT:
        return TailClass.TOOL_RESULT_NOT_CONSUMED
    if last.payload.get("finish_reason") == "length":
        return TailClass.CUT_BY_MAX_TOKENS
    return TailClass.ANSWERED


def resume_from(turn_events: Sequence[TailEvent]) -> Resume:
    """How the worker goes on with a turn it continues, from the turn's events.

    The same classifier as recovery's, with the notes of earlier attempts left out:
    recovery already decided that this turn goes on, and a note is not a step of it.
    """
    steps = [e for e in turn_events if e.type != EventType.CONTINUATION]
    tail = classify_tail(steps)
    if tail is TailClass.ANSWERED:
        return Resume.ANSWERED
    if tail is TailClass.CUT_BY_MAX_TOKENS:
        return Resume.TRUNCATED
    return Resume.RUN
