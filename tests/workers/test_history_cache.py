"""The session logs a worker keeps: built a bit at a time, they give what a rebuild gives.

Pure: events are built by hand, as in test_history.py; no database, no clock.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.store import EventRecord
from workers.cache import EVENT_OVERHEAD, HistoryCache, SessionLog, event_size, log_of
from workers.history import missing_results, read_by, to_messages
from workers.models import EchoModel, Message

TURNS = ["t0", "t1", "t2", "t3"]
CALLS = ["c0", "c1", "c2"]


class Log:
    """Events of session "s1" with contiguous seqs from 1, built like test_history's."""

    def __init__(self) -> None:
        self.events: list[EventRecord] = []

    def ev(self, type: str, payload: dict[str, Any] | None = None, turn: str | None = "t1") -> None:
        seq = len(self.events) + 1
        self.events.append(
            EventRecord("s1", seq, type, turn, payload or {}, 1_700_000_000.0 + seq, "worker")
        )

    def user(self, text: str) -> None:
        self.ev("user_message", {"text": text}, turn=None)

    def turn(self, turn: str, *, calls: tuple[str, ...] = (), answer: str = "done") -> None:
        """A whole turn reading all before it: started, tools asked and run, answer, end."""
        self.ev("turn_started", {"read_to": len(self.events)}, turn)
        if calls:
            asked = [{"id": c, "name": "echo", "arguments": {"c": c}} for c in calls]
            self.ev("model_response", {"text": "", "tool_calls": asked}, turn)
            for call in calls:
                self.ev("tool_call", {"call_id": call, "name": "echo"}, turn)
                self.ev("tool_result", {"call_id": call, "name": "echo", "content": "ok"}, turn)
        self.ev("model_response", {"text": answer, "tool_calls": []}, turn)
        self.ev("turn_ended", {"outcome": "completed"}, turn)


# --- steps for the property test: realistic turns, and any event at any place ---------------

turn_ids = st.sampled_from([*TURNS, None])
call_ids = st.sampled_from(CALLS)
# read_to: all before it, a few events less or more, an early seq, none, not a seq
read_tos = st.one_of(
    st.just("here"), st.integers(-8, 3), st.tuples(st.just("seq"), st.integers(0, 4)),
    st.none(), st.just("x"),
)  # fmt: skip

single = st.one_of(
    st.tuples(st.just("user"), st.sampled_from(["hi", "/tool echo {}", "more"])),
    st.tuples(st.just("turn_started"), turn_ids, read_tos),
    st.tuples(st.just("turn_ended"), turn_ids),
    st.tuples(st.just("asks"), turn_ids, st.lists(call_ids, max_size=3)),
    st.tuples(st.just("answer"), turn_ids, st.sampled_from(["a", "b c"])),
    st.tuples(st.just("started"), turn_ids, call_ids),
    st.tuples(st.just("result"), turn_ids, call_ids),
    st.tuples(st.just("continuation"), turn_ids),
    st.tuples(st.just("notice"), turn_ids),
)
whole_turn = st.tuples(
    st.just("turn"), st.sampled_from(TURNS), st.lists(call_ids, max_size=2, unique=True)
)
steps = st.lists(st.one_of(whole_turn, whole_turn, single), max_size=40)


def build(drawn: list[tuple[Any, ...]]) -> list[EventRecord]:
    log = Log()
    for kind, *rest in drawn:
        if kind == "user":
            log.user(rest[0])
        elif kind == "turn":
            log.user("go")
            log.turn(rest[0], calls=tuple(rest[1]))
        elif kind == "turn_started":
            here, read_to = len(log.events), rest[1]
            if isinstance(read_to, tuple):
                read_to = read_to[1]
            elif isinstance(read_to, int):
                read_to = max(0, here + read_to)
            elif read_to == "here":
                read_to = here
            log.ev("turn_started", {} if read_to is None else {"read_to": read_to}, rest[0])
        elif kind == "turn_ended":
            log.ev("turn_ended", {"outcome": "completed"}, rest[0])
        elif kind == "asks":
            asked = [{"id": c, "name": "echo"} for c in rest[1]]
            log.ev("model_response", {"text": "", "tool_calls": asked}, rest[0])
        elif kind == "answer":
            log.ev("model_response", {"text": rest[1], "tool_calls": []}, rest[0])
        elif kind in ("started", "result"):
            type = "tool_call" if kind == "started" else "tool_result"
            log.ev(type, {"call_id": rest[1], "name": "echo", "content": "r"}, rest[0])
        else:
            log.ev(kind, {"text": f"a {kind}"}, rest[0])
    return log.events


def asked_without_result(events: list[EventRecord]) -> list[tuple[str, str, bool]]:
    """The calls asked for with no result anywhere in the log, by its first definition:
    (id, tool, started), in the order first asked."""
    asked: dict[str, str] = {}
    started, answered = set(), set()
    for e in events:
        if e.type == "model_response":
            for call in e.payload.get("tool_calls") or []:
                asked[str(call["id"])] = str(call["name"])
        elif e.type == "tool_call":
            started.add(str(e.payload.get("call_id")))
        elif e.type == "tool_result":
            answered.add(str(e.payload.get("call_id")))
    return [(i, n, i in started) for i, n in asked.items() if i not in answered]


def repairs(events: list[EventRecord]) -> list[EventRecord]:
    """Results for the calls left open, as a turn's start commits them."""
    seq = events[-1].seq if events else 0
    return [
        EventRecord("s1", seq + i, "tool_result", "t9", m.payload(), 0.0, "worker")
        for i, m in enumerate(missing_results(events), 1)
    ]


@settings(max_examples=400, deadline=None)
@given(drawn=steps, chunks=st.lists(st.integers(1, 6), min_size=1, max_size=8))
def test_a_log_read_a_bit_at_a_time_gives_what_a_rebuild_gives(
    drawn: list[tuple[Any, ...]], chunks: list[int]
) -> None:
    events = build(drawn)
    log = SessionLog()
    start, i = 0, 0
    while True:
        end = min(len(events), start + chunks[i % len(chunks)])
        assert log.add(events[start:end])
        start, i = end, i + 1
        so_far = events[:end]
        assert list(log) == so_far and log.last_seq == end
        assert log.messages() == to_messages(so_far)
        missing = [(m.call_id, m.name, m.started) for m in log.missing_results()]
        assert missing == asked_without_result(so_far)
        extra = repairs(so_far)
        assert log.messages(extra) == to_messages([*so_far, *extra])
        for turn in TURNS:
            assert log.messages(extra, turn) == to_messages(read_by(turn, [*so_far, *extra]))
        if end == len(events):
            break


def test_the_cut_follows_the_log_so_a_turn_builds_only_its_own_events() -> None:
    log, cached = Log(), SessionLog()
    for n in range(50):
        log.user(f"message {n}")
        log.turn(f"turn{n}", calls=("c1",) if n % 3 else ())
        assert cached.add(log.events[cached.last_seq :])
    log.user("the next one")  # pending: the next turn reads it
    assert cached.add(log.events[-1:])
    assert cached._conversation.cut == len(log.events)  # every message built already
    assert cached.messages() == to_messages(log.events)


def test_an_event_that_would_change_the_kept_messages_starts_the_build_again() -> None:
    log = Log()
    log.user("one")
    log.turn("t1")
    log.user("two")
    cached = SessionLog(log.events)
    assert cached._conversation.cut == len(log.events)
    # A turn that says it read less than the cut: "two" was not read by it.
    log.ev("turn_started", {"read_to": 1}, "t2")
    log.ev("model_response", {"text": "late", "tool_calls": []}, "t2")
    assert cached.add(log.events[-2:])
    assert cached._conversation.cut < 5  # found again from the start: before "two" now
    assert cached.messages() == to_messages(log.events)
    assert [m.content for m in cached.messages()][-2:] == ["late", "two"]


def read_less_after_the_cut(log: Log) -> None:
    """A turn after the only possible cut read less than another before it."""
    log.ev("turn_started", {"read_to": 0}, "t0")
    log.ev("turn_ended", {}, "t0")
    log.ev("turn_started", {"read_to": 2}, "t1")
    log.ev("model_response", {"text": "a1", "tool_calls": []}, "t1")
    log.ev("turn_ended", {}, "t1")
    log.ev("turn_started", {"read_to": 1}, "t2")  # the message below: t1's read wins
    log.user("u")
    log.ev("model_response", {"text": "a2", "tool_calls": []}, "t2")


def read_ahead_before_the_cut(log: Log) -> None:
    """A turn before the only possible cut says it read past it."""
    log.ev("turn_started", {"read_to": 9}, "t1")
    log.ev("turn_ended", {}, "t1")
    log.ev("turn_started", {"read_to": 2}, "t2")
    for _ in range(6):
        log.ev("notice", {"text": "n"}, "t2")
    log.user("u")  # seq 10: t1 read less than it, and more than t2
    log.ev("model_response", {"text": "a2", "tool_calls": []}, "t2")


def ended_again_after_the_cut(log: Log) -> None:
    """A turn ends before the only possible cut, and again after it."""
    log.user("one")
    log.turn("t1")
    log.user("two")  # before t1's second end: t1 did not read it
    late = [{"id": "c9", "name": "echo"}]  # left open: no cut at the second end either
    log.ev("model_response", {"text": "late", "tool_calls": late}, "t1")
    log.ev("turn_ended", {}, "t1")


def never_ended_before_the_cut(log: Log) -> None:
    """A turn starts before the only possible cut and never ends."""
    log.user("one")
    log.ev("turn_started", {"read_to": 1}, "t1")
    log.ev("model_response", {"text": "a1", "tool_calls": []}, "t1")
    log.user("two")  # after t1's read, before its end (none): the next turn's to answer
    log.ev("model_response", {"text": "a2", "tool_calls": []}, "t2")


CROSSING = [
    read_less_after_the_cut,
    read_ahead_before_the_cut,
    ended_again_after_the_cut,
    never_ended_before_the_cut,
]


@pytest.mark.parametrize("make", CROSSING)
def test_no_cut_where_a_read_to_reaches_across_it(make: Any) -> None:
    log = Log()
    make(log)
    assert SessionLog(log.events).messages() == to_messages(log.events)


@pytest.mark.parametrize("first_seq", [1, 3], ids=["repeated", "skipped"])
def test_events_that_do_not_follow_on_are_refused_whole(first_seq: int) -> None:
    log = Log()
    for text in ("a", "b", "c", "d"):
        log.user(text)
    cached = SessionLog(log.events[:1])
    assert not cached.add(log.events[first_seq - 1 :])
    assert list(cached) == log.events[:1] and cached.last_seq == 1
    assert cached.add(log.events[1:]) and cached.last_seq == 4


def test_log_of_keeps_a_log_and_builds_one_of_a_list() -> None:
    log = Log()
    log.user("hi")
    cached = SessionLog(log.events)
    assert log_of(cached) is cached
    built = log_of(log.events)
    assert isinstance(built, SessionLog) and list(built) == log.events


def test_event_size_is_a_fixed_part_and_the_payload_as_text() -> None:
    log = Log()
    log.user("é" * 100)
    call = {"id": "c1", "name": "write", "arguments": {"text": "x" * 1000}}
    log.ev("model_response", {"text": "", "tool_calls": [call], "usage": {}, "done": True})
    short, long = log.events
    assert event_size(short) == EVENT_OVERHEAD + 100
    # "" is 0, [call] is its JSON (over 1000), {} and True are 8 each
    assert event_size(long) == EVENT_OVERHEAD + len(json.dumps([call])) + 8 + 8
    assert SessionLog(log.events).size == event_size(short) + event_size(long)


# --- the cache: tokens, least recently used eviction, sessions in a turn -----------------------


def sized(size: int, token: int = 1) -> SessionLog:
    log = SessionLog(token=token)
    log.size = size
    return log


def test_a_log_read_under_another_token_is_dropped() -> None:
    cache = HistoryCache()
    cache.put("a", sized(10, token=1))
    assert cache.get("a", 2) is None
    assert "a" not in cache
    assert cache.get("a", 1) is None


def test_over_the_budget_idle_sessions_are_evicted_least_recently_used_first() -> None:
    cache = HistoryCache(budget=250)
    for name in "abcd":
        cache.put(name, sized(100))
    assert cache.get("a", 1) is not None  # now the most recently used
    cache.hold("b", True)  # in a turn
    assert cache.trim(keep="d") == ["c", "a"]  # b is in a turn, d was just read
    assert cache.size == 200 and "b" in cache and "d" in cache
    cache.put("e", sized(100))
    cache.hold("b", False)
    assert cache.trim(keep="e") == ["b"]
    assert cache.trim(keep="e") == []


def test_within_the_budget_nothing_is_evicted() -> None:
    cache = HistoryCache(budget=300)
    for name in "abc":
        cache.put(name, sized(100))
    assert cache.trim() == []
    assert cache.size == 300


def test_a_tiny_budget_keeps_only_the_log_just_read_and_those_in_a_turn() -> None:
    cache = HistoryCache(budget=0)
    cache.put("busy", sized(1))
    cache.hold("busy", True)
    cache.put("idle", sized(1))
    cache.put("read", sized(1))
    assert cache.trim(keep="read") == ["idle"]
    assert "busy" in cache and "read" in cache


# --- echo: prompt tokens counted once per message ------------------------------------------


def test_echo_prompt_tokens_are_the_words_of_every_message_however_the_list_changed() -> None:
    async def tokens(model: EchoModel, messages: list[Message]) -> int:
        return (await model.complete(messages, [])).usage["prompt_tokens"]

    model = EchoModel()
    first = Message("user", "one two three")
    convo = [first]
    counts = []
    for text in ("four", "five six", "", "seven"):
        counts.append(asyncio.run(tokens(model, convo)))
        convo = [*convo, Message("assistant", text)]
    assert counts == [3, 4, 6, 6]
    # The same first message, a different middle: counted again, not taken from before.
    changed = [first, Message("assistant", "a b c d e"), *(Message("user", w) for w in "xyz")]
    assert asyncio.run(tokens(model, changed)) == 11
    assert asyncio.run(tokens(model, [])) == 0
