"""Compaction without I/O (issue 29): where a log may be cut, what a compaction keeps and
commits, the worker's log starting at the newest compaction, a server's context-length
error (compact, then one more call), and how such an error is recognised."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from supervisor.store import EventRecord
from workers.cache import SessionLog
from workers.context import DROPPED_NOTE, SUMMARY_NOTE, Compactor, Settings, Window, estimate
from workers.history import compaction_cuts, to_messages
from workers.models import SILENT, Message, ModelError, ModelResponse, Stream, ToolSpec
from workers.models.openai import OpenAIModel, context_window_of, retry_after
from workers.tools import BuiltinTools
from workers.turns import TurnContext


class Log:
    """A session log made by hand, seq after seq."""

    def __init__(self) -> None:
        self.events: list[EventRecord] = []

    def add(self, type: str, payload: dict[str, Any], turn: str | None = None) -> int:
        seq = len(self.events) + 1
        self.events.append(EventRecord("s", seq, type, turn, payload, time.time(), "worker"))
        return seq

    def turn(self, text: str, answer: str, *, tool: bool = False) -> None:
        """A user message and the turn that answers it (with one tool call, if `tool`)."""
        turn = f"t{len(self.events)}"
        read = self.add("user_message", {"text": text})
        self.add("turn_started", {"read_to": read}, turn)
        if tool:
            call = {"id": f"c{read}", "name": "echo", "arguments": {"text": text}}
            self.add("model_response", {"text": "", "tool_calls": [call]}, turn)
            self.add("tool_call", {"call_id": call["id"], "name": "echo"}, turn)
            self.add("tool_result", {"call_id": call["id"], "content": text}, turn)
        self.add("model_response", {"text": answer, "tool_calls": []}, turn)
        self.add("turn_ended", {"outcome": "completed"}, turn)


def test_cuts_stand_only_after_a_turns_end_and_count_the_messages_before_them() -> None:
    log = Log()
    log.turn("one", "first answer")
    log.turn("two", "second answer", tool=True)
    cuts = compaction_cuts(log.events)
    ends = [e.seq for e in log.events if e.type == "turn_ended"]
    assert [seq for seq, _ in cuts] == ends
    for seq, count in cuts:
        before = [e for e in log.events if e.seq <= seq]
        assert to_messages(before) == to_messages(log.events)[:count]


def test_no_cut_inside_the_turn_in_flight_nor_before_its_unread_input() -> None:
    log = Log()
    log.turn("one", "first")
    # A message lands while the next turn runs: that turn did not read it, so the turn's
    # end is no cut (the message is the next turn's input).
    read = log.add("user_message", {"text": "two"})
    log.add("turn_started", {"read_to": read}, "t2")
    log.add("user_message", {"text": "late"})
    log.add("model_response", {"text": "answer to two", "tool_calls": []}, "t2")
    log.add("turn_ended", {"outcome": "completed"}, "t2")
    read = log.add("turn_started", {"read_to": len(log.events)}, "t3")  # in flight
    log.add("model_response", {"text": "", "tool_calls": [{"id": "c", "name": "x"}]}, "t3")
    assert [seq for seq, _ in compaction_cuts(log.events)] == [4]  # the first turn's end


class Committed:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any], str | None, str | None]] = []

    async def __call__(
        self, type: str, payload: dict[str, Any], turn: str | None, key: str | None
    ) -> int:
        self.events.append((type, payload, turn, key))
        return 100 + len(self.events)


def compactor(
    log: Log, asked: list[list[Message]], window: int = 300, answer: str = "the gist"
) -> tuple[Compactor, Committed]:
    async def ask(messages: list[Message], tools: list[ToolSpec]) -> ModelResponse:
        asked.append(messages)
        return ModelResponse(answer, [], "stop", {})

    committed = Committed()
    made = Compactor(
        events=log.events,
        base=0,
        window=Window(window),
        settings=Settings(max_tokens=50, margin=10, prompt="summarize"),
        ask=ask,
        commit=committed,
        turn_id="now",
    )
    return made, committed


def long_log(turns: int = 12) -> Log:
    log = Log()
    for index in range(turns):
        log.turn(f"question {index} " + "word " * 20, f"answer {index} " + "word " * 20, tool=True)
    return log


def test_a_prompt_that_fits_is_left_alone() -> None:
    log = Log()
    log.turn("hi", "hello")
    asked: list[list[Message]] = []
    made, committed = compactor(log, asked)
    messages = to_messages(log.events)
    assert not asyncio.run(made.fit(messages, []))
    assert asked == [] and committed.events == []


def test_a_prompt_past_the_window_keeps_its_newer_turns_whole_after_a_summary() -> None:
    log = long_log()
    asked: list[list[Message]] = []
    made, committed = compactor(log, asked, window=2000)
    messages = [*to_messages(log.events), Message("user", "the turn in flight")]
    whole = list(messages)
    limit = made.limit()
    assert limit is not None and made.cost(messages, []) > limit
    assert asyncio.run(made.fit(messages, []))
    [(type, payload, turn, key)] = committed.events
    assert (type, turn, key) == ("compaction", "now", f"compaction:{payload['to_seq']}")
    assert payload["method"] == "summary" and payload["summary"] == "the gist"
    assert payload["tokens_after"] <= limit // 2 < payload["tokens_before"]
    # The summary, then the newer messages as they were: a tool call and its result are
    # on the same side, and the message in flight is kept.
    assert messages[0].note and messages[0].content == SUMMARY_NOTE + "the gist"
    assert messages[1:] == whole[payload["messages"] :]
    assert messages[1].role == "user" and messages[-1].content == "the turn in flight"
    # The summarizing call saw the older part and the instruction, and no tools.
    assert asked[0][-1] == Message("user", "summarize")
    assert asked[0][:-1] == whole[: payload["messages"]]


def test_a_summary_call_that_would_not_fit_leaves_out_the_oldest_turns() -> None:
    log = long_log(30)
    asked: list[list[Message]] = []
    made, committed = compactor(log, asked, window=600)
    messages = to_messages(log.events)
    assert asyncio.run(made.fit(messages, []))
    payload = committed.events[0][1]
    assert payload["method"] == "summary" and payload["dropped"] > 0
    limit = made.limit()
    assert limit is not None and made.cost(asked[0], []) <= limit


def test_when_no_summary_can_be_made_the_older_part_is_dropped_with_a_note() -> None:
    log = long_log()
    refused: list[list[Message]] = []

    async def too_long(messages: list[Message], tools: list[ToolSpec]) -> ModelResponse:
        refused.append(messages)
        raise ModelError("answered 400: maximum context length is 300", context_exceeded=True)

    made, committed = compactor(log, [])
    made._ask = too_long  # a server that finds every summarizing call too long
    messages = to_messages(log.events)
    assert asyncio.run(made.fit(messages, [], forced=True))
    payload = committed.events[0][1]
    assert payload["method"] == "dropped" and len(refused) >= 1
    assert messages[0].content == DROPPED_NOTE.format(count=payload["messages"])


def test_the_worker_log_starts_at_the_newest_compaction() -> None:
    log = long_log(4)
    cut = compaction_cuts(log.events)[1][0]
    session = SessionLog(log.events)
    payload = {"summary": "so far", "method": "summary", "to_seq": cut, "tokens": 3}
    compaction = EventRecord("s", len(log.events) + 1, "compaction", None, payload, 0.0, "w")
    assert session.add([compaction])
    assert session[0].seq == cut + 1 and session.summary is not None
    rebuilt = session.messages()
    assert rebuilt[0].content == SUMMARY_NOTE + "so far"
    kept = [e for e in log.events if e.seq > cut]
    assert rebuilt[1:] == to_messages(kept)
    # A log read anew from that compaction on builds the same.
    assert SessionLog([*kept, compaction]).messages() == rebuilt


class ContextModel:
    """A server with a 300-token window that says so, whose count is our estimate."""

    def __init__(self) -> None:
        self.prompts: list[list[Message]] = []

    async def complete(
        self, messages: list[Message], tools: list[ToolSpec], stream: Stream = SILENT
    ) -> ModelResponse:
        self.prompts.append(messages)
        counted = sum(estimate(m.content) + 4 for m in messages)
        if counted + 50 > 300:
            raise ModelError(
                "answered 400: This model's maximum context length is 300 tokens",
                context_exceeded=True,
                window=300,
            )
        return ModelResponse("answer", [], "stop", {"prompt_tokens": counted})

    async def aclose(self) -> None:
        pass


def test_a_context_length_error_learns_the_window_compacts_and_calls_once_more() -> None:
    log = long_log()
    committed: list[tuple[str, dict[str, Any]]] = []

    async def commit(type: str, payload: dict[str, Any], turn: str | None) -> int:
        committed.append((type, payload))
        return len(committed)

    async def keyed(type: str, payload: dict[str, Any], turn: str | None, key: str | None) -> int:
        return await commit(type, payload, turn)

    model = ContextModel()
    window = Window(0)  # unknown: learned from the error

    def make(turn: TurnContext) -> Compactor:
        settings = Settings(max_tokens=50, margin=10, prompt="summarize")
        return Compactor(
            events=log.events, base=0, window=window, settings=settings, ask=turn.ask,
            commit=keyed, turn_id="t",
        )  # fmt: skip

    messages = [*to_messages(log.events), Message("user", "next")]
    turn = TurnContext(
        "s", "t", messages, model, BuiltinTools(), commit, asyncio.Event(), compactor=make
    )
    response = asyncio.run(turn.call_model())
    assert response.text == "answer" and window.size == 300
    assert [t for t, _ in committed] == ["compaction", "model_response"]
    # The refused call, the summary, the call that fit.
    assert len(model.prompts) == 3


@pytest.mark.parametrize(
    ("body", "window"),
    [
        (
            '{"error": {"message": "This model\'s maximum context length is 512 tokens. '
            'However, you requested 1095 tokens", "code": "context_length_exceeded"}}',
            512,
        ),
        ('{"error": {"code": "context_length_exceeded", "message": "too long"}}', 0),
        ("Requested tokens (1095) exceed context window of 512", 512),
        (
            '{"error": {"message": "the request exceeds the available context size, try '
            'increasing it", "type": "exceed_context_size_error", "n_ctx": 1024}}',
            0,
        ),
        ('{"error": "model not found"}', None),
    ],
)
def test_context_length_errors_are_recognised(body: str, window: int | None) -> None:
    assert context_window_of(body) == window


def test_the_openai_client_marks_a_context_error_and_keeps_retry_after() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if b"too long" in request.content:
            body = {"error": {"message": "This model's maximum context length is 512 tokens"}}
            return httpx.Response(400, json=body)
        return httpx.Response(503, headers={"Retry-After": "7"}, text="x" * 10_000)

    model = OpenAIModel(
        "http://127.0.0.1:9/v1", "m", None, 5.0, 16,
        transport=httpx.MockTransport(handler), max_response_bytes=1024,
    )  # fmt: skip
    with pytest.raises(ModelError) as refused:
        asyncio.run(model.complete([Message("user", "too long")], []))
    assert refused.value.context_exceeded and refused.value.window == 512
    assert not refused.value.transient
    # An error page larger than model.max_response_bytes is cut, not refused: it stays
    # the 503 it is.
    with pytest.raises(ModelError) as down:
        asyncio.run(model.complete([Message("user", "hi")], []))
    assert down.value.transient and down.value.retry_after == 7.0
    assert "answered 503" in str(down.value)
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0 and retry_after("soon") is None
