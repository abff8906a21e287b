"""The conversation rebuilt from committed events, and the shape of a turn's tail.

Pure functions: the events are built by hand, no database.
"""

from __future__ import annotations

import pytest

from supervisor.store import EventRecord
from tests.support import ev
from workers.history import (
    INTERRUPTED_RESULT,
    NOT_STARTED_RESULT,
    MissingResult,
    Tail,
    calls_of,
    classify_tail,
    message_of,
    missing_results,
    to_messages,
    turn_events,
)
from workers.models import Message, ToolCall


def user(text: str) -> EventRecord:
    return ev("user_message", {"text": text}, turn_id=None)


def answer(text: str, finish_reason: str = "stop") -> EventRecord:
    return ev("model_response", {"text": text, "tool_calls": [], "finish_reason": finish_reason})


def asks(*calls: tuple[str, str]) -> EventRecord:
    """A model response asking for (call id, tool name) calls."""
    return ev(
        "model_response",
        {
            "text": "",
            "tool_calls": [{"id": i, "name": n, "arguments": {"k": i}} for i, n in calls],
            "finish_reason": "tool_calls",
        },
    )


def started(call_id: str, name: str = "echo") -> EventRecord:
    return ev("tool_call", {"call_id": call_id, "name": name, "arguments": {}})


def result(call_id: str, content: str = "ok", name: str = "echo") -> EventRecord:
    return ev("tool_result", {"call_id": call_id, "name": name, "content": content})


# --- messages ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        (user("hi"), Message("user", "hi")),
        (answer("hello"), Message("assistant", "hello")),
        (
            asks(("c1", "echo"), ("c2", "sleep")),
            Message(
                "assistant",
                "",
                tool_calls=[
                    ToolCall("c1", "echo", {"k": "c1"}),
                    ToolCall("c2", "sleep", {"k": "c2"}),
                ],
            ),
        ),
        (result("c1", "done"), Message("tool", "done", tool_call_id="c1")),
        (
            ev("continuation", {"cause": "worker_crash", "text": "go on"}),
            Message("user", "go on", note=True),
        ),
    ],
    ids=["user", "answer", "tool-calls", "tool-result", "continuation"],
)
def test_message_of_conversation_events(event: EventRecord, expected: Message) -> None:
    assert message_of(event) == expected


@pytest.mark.parametrize(
    "type",
    ["notice", "turn_started", "turn_ended", "checkpoint", "acl", "tool_call", "repair"],
)
def test_message_of_other_events_is_none(type: str) -> None:
    assert message_of(ev(type, {"text": "not for the model", "call_id": "c1"})) is None


def test_calls_of_tolerates_missing_or_null_fields() -> None:
    assert calls_of({}) == []
    assert calls_of({"tool_calls": None}) == []
    assert calls_of({"tool_calls": [{"id": 7, "name": "echo", "arguments": None}]}) == [
        ToolCall("7", "echo", {})
    ]


def test_to_messages_keeps_order_and_drops_non_messages() -> None:
    events = [
        user("/tool echo {}"),
        ev("turn_started"),
        asks(("c1", "echo")),
        started("c1"),
        result("c1", "{}"),
        ev("notice", {"text": "fyi"}),
        answer("echo: {}"),
        ev("turn_ended", {"outcome": "completed"}),
    ]
    assert [(m.role, m.content) for m in to_messages(events)] == [
        ("user", "/tool echo {}"),
        ("assistant", ""),
        ("tool", "{}"),
        ("assistant", "echo: {}"),
    ]


def test_a_user_message_during_a_tool_call_does_not_split_the_call_from_its_result() -> None:
    events = [
        user("/tool sleep {}"),
        ev("turn_started"),
        asks(("c1", "sleep")),
        started("c1", "sleep"),
        user("are you there?"),  # lease-less: intake commits it at any time
        result("c1", "slept", "sleep"),
        answer("echo: slept"),
    ]
    messages = to_messages(events)
    for index, message in enumerate(messages):
        if message.tool_calls:
            following = messages[index + 1 : index + 1 + len(message.tool_calls)]
            assert [m.role for m in following] == ["tool"] * len(message.tool_calls)


# --- missing results --------------------------------------------------------------------


def test_missing_results_started_vs_never_started_in_asked_order() -> None:
    events = [
        asks(("c3", "sleep"), ("c1", "echo"), ("c2", "echo")),
        started("c3", "sleep"),
        result("c3"),
        started("c1"),
    ]
    assert missing_results(events) == [
        MissingResult("c1", "echo", started=True),
        MissingResult("c2", "echo", started=False),
    ]


def test_missing_results_spans_several_model_responses() -> None:
    events = [asks(("a", "echo")), result("a"), asks(("b", "sleep")), started("b", "sleep")]
    assert missing_results(events) == [MissingResult("b", "sleep", started=True)]


@pytest.mark.parametrize(
    "events",
    [
        [],
        [user("hi"), answer("hello")],
        [asks(("c1", "echo")), started("c1"), result("c1")],
        [asks(("c1", "echo")), result("c1")],  # a result without a tool_call still answers
    ],
    ids=["empty", "no-calls", "answered", "answered-unstarted"],
)
def test_missing_results_none(events: list[EventRecord]) -> None:
    assert missing_results(events) == []


@pytest.mark.parametrize(
    ("started_", "content"),
    [(True, INTERRUPTED_RESULT), (False, NOT_STARTED_RESULT)],
    ids=["started", "never-started"],
)
def test_missing_result_payload(started_: bool, content: str) -> None:
    assert MissingResult("c1", "echo", started_).payload() == {
        "call_id": "c1",
        "name": "echo",
        "content": content,
        "is_error": True,
        "repaired": True,
    }


def test_repair_texts_say_what_is_known() -> None:
    assert "may or may not have taken effect" in INTERRUPTED_RESULT
    assert "not run" in NOT_STARTED_RESULT
    assert INTERRUPTED_RESULT != NOT_STARTED_RESULT


# --- turn events ------------------------------------------------------------------------


def test_turn_events_start_at_the_last_turn_started_of_that_turn() -> None:
    old = [user("one"), ev("turn_started", turn_id="t0"), answer("a0")]
    first_try = [ev("turn_started"), asks(("c1", "echo"))]
    again = ev("turn_started")  # the same turn id started again: only the last one counts
    tail = [
        started("c1"),
        user("meanwhile"),
        ev("notice", {"text": "other turn"}, turn_id="t2"),
        result("c1"),
    ]
    events = [*old, *first_try, again, *tail]
    assert turn_events(events, "t1") == [again, tail[0], tail[1], tail[3]]


def test_turn_events_exclude_lease_less_events_before_the_turn() -> None:
    before = user("hi")
    start = ev("turn_started")
    assert turn_events([before, start, answer("hello")], "t1")[0] is start


def test_turn_events_of_a_turn_never_started_keep_its_events_and_lease_less_ones() -> None:
    events = [user("hi"), answer("x", "stop"), ev("turn_started", turn_id="t0")]
    assert turn_events(events, "t1") == events[:2]


# --- classify tail ----------------------------------------------------------------------


TAILS: list[tuple[str, list[EventRecord], Tail]] = [
    ("final-answer", [ev("turn_started"), answer("done")], Tail.ANSWERED),
    ("truncated", [ev("turn_started"), answer("do", "length")], Tail.TRUNCATED),
    ("calls-pending", [ev("turn_started"), asks(("c1", "echo"))], Tail.RUN),
    ("call-started", [ev("turn_started"), asks(("c1", "echo")), started("c1")], Tail.RUN),
    ("result-last", [ev("turn_started"), asks(("c1", "echo")), result("c1")], Tail.RUN),
    ("no-model-response", [ev("turn_started")], Tail.RUN),
    ("empty", [], Tail.RUN),
    (
        "answer-after-tools",
        [ev("turn_started"), asks(("c1", "echo")), result("c1"), answer("done")],
        Tail.ANSWERED,
    ),
    (
        "user-message-after-answer",
        [ev("turn_started"), answer("done"), user("next")],
        Tail.ANSWERED,
    ),
    (
        "notices-after-answer",
        [ev("turn_started"), answer("done"), ev("notice", {"text": "x"}), ev("checkpoint")],
        Tail.ANSWERED,
    ),
    (
        "notice-after-truncation",
        [ev("turn_started"), answer("do", "length"), ev("notice", {"text": "x"})],
        Tail.TRUNCATED,
    ),
    (
        "continuation-after-results",
        [ev("turn_started"), asks(("c1", "echo")), result("c1"), ev("continuation")],
        Tail.RUN,
    ),
]


@pytest.mark.parametrize(("events", "tail"), [t[1:] for t in TAILS], ids=[t[0] for t in TAILS])
def test_classify_tail(events: list[EventRecord], tail: Tail) -> None:
    assert classify_tail(events) is tail


@pytest.mark.parametrize(
    "before_turn_started",
    # committed after the turn read the log: before its turn_started, or while it ran
    [True, False],
    ids=["between-read-and-turn-started", "while-the-turn-ran"],
)
def test_a_message_the_turn_did_not_read_goes_after_the_turn(before_turn_started: bool) -> None:
    first = user("/tool add 1")
    if before_turn_started:
        order = [late := user("/tool add 2"), ev("turn_started", {"read_to": first.seq})]
    else:
        order = [ev("turn_started", {"read_to": first.seq}), late := user("/tool add 2")]
    assert [e.seq for e in order] == sorted(e.seq for e in order) and late.seq > first.seq
    steps = [asks(("c1", "add")), ev("tool_result", {"call_id": "c1", "content": "3"})]
    done = answer("echo: 3")
    ended = ev("turn_ended", {"outcome": "completed"})
    messages = to_messages([first, *order, *steps, done, ended])
    assert [m.content for m in messages if m.role != "tool"] == [
        "/tool add 1",
        "",
        "echo: 3",
        "/tool add 2",
    ]


def test_a_message_the_turn_read_keeps_its_place() -> None:
    first = user("one")
    second = user("two")  # landed before the turn read the log: it saw both
    started = ev("turn_started", {"read_to": second.seq})
    messages = to_messages([first, second, started, answer("echo: two")])
    assert [m.content for m in messages] == ["one", "two", "echo: two"]


def test_an_unread_message_of_a_turn_in_flight_comes_last() -> None:
    first = user("one")
    started = ev("turn_started", {"read_to": first.seq})
    late = user("two")
    messages = to_messages([first, started, late, answer("echo: one")])
    assert [m.content for m in messages] == ["one", "echo: one", "two"]


def test_a_message_after_a_turn_ended_is_read_by_the_next_one() -> None:
    first = user("one")
    started = ev("turn_started", {"read_to": first.seq})
    done, ended = answer("echo: one"), ev("turn_ended", {"outcome": "completed"})
    second = user("two")
    next_turn = ev("turn_started", {"read_to": second.seq}, turn_id="t2")
    messages = to_messages([first, started, done, ended, second, next_turn])
    assert [m.content for m in messages] == ["one", "echo: one", "two"]
