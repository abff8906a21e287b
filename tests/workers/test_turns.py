"""Running a turn: the context agents are handed, starting and resuming a turn, loading agents.

No database and no processes: `commit` is a fake that keeps what it is given, and the
events a resumed turn reads are built by hand.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from supervisor.store import EventRecord, LeaseLost
from tests.support import ev
from workers.agent import AgentLoadError, Turn, load_agent_class
from workers.agents.tool_loop import MAX_STEPS, ToolLoopAgent
from workers.history import INTERRUPTED_RESULT, NOT_STARTED_RESULT, to_messages
from workers.models import (
    SILENT,
    EchoModel,
    Message,
    Model,
    ModelError,
    ModelResponse,
    Stream,
    ToolCall,
    ToolSpec,
)
from workers.tools import BuiltinTools, Toolbox, ToolOutcome
from workers.turns import (
    CONTINUATION_NOTES,
    TurnContext,
    TurnReleased,
    resume_turn,
    run_agent,
    start_turn,
)

T0 = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC
T0_TEXT = "2023-11-14 22:13:20 UTC"


@dataclass
class Log:
    """A fake event log: `commit` keeps (type, payload, turn id) and returns the next seq."""

    entries: list[tuple[str, dict[str, Any], str | None]] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)  # commits, reads and runs, in order
    released: asyncio.Event | None = None
    released_at: list[bool] = field(default_factory=list)  # was `released` set at each commit
    on_commit: Callable[[str], None] | None = None

    async def commit(self, type: str, payload: dict[str, Any], turn_id: str | None) -> int:
        self.entries.append((type, payload, turn_id))
        self.calls.append(f"commit {type}")
        self.released_at.append(self.released is not None and self.released.is_set())
        if self.on_commit is not None:
            self.on_commit(type)
        return len(self.entries)

    @property
    def types(self) -> list[str]:
        return [entry[0] for entry in self.entries]

    def payloads(self, type: str) -> list[dict[str, Any]]:
        return [payload for t, payload, _ in self.entries if t == type]


def user(text: str, created_at: float = T0) -> EventRecord:
    return ev("user_message", {"text": text}, turn_id=None, created_at=created_at)


def asks(call_id: str, name: str = "echo", arguments: dict[str, Any] | None = None) -> EventRecord:
    call = {"id": call_id, "name": name, "arguments": arguments or {}}
    return ev("model_response", {"text": "", "tool_calls": [call], "finish_reason": "tool_calls"})


def answer(text: str, finish_reason: str = "stop") -> EventRecord:
    return ev("model_response", {"text": text, "tool_calls": [], "finish_reason": finish_reason})


def tool_call(call_id: str, created_at: float = T0) -> EventRecord:
    return ev("tool_call", {"call_id": call_id, "name": "echo"}, created_at=created_at)


def tool_result(call_id: str, content: str = "ok") -> EventRecord:
    return ev("tool_result", {"call_id": call_id, "name": "echo", "content": content})


# --- models, tools and agents for the failure cases -----------------------------------


class FailingModel:
    def __init__(self, error: ModelError) -> None:
        self.error = error

    async def complete(
        self, messages: list[Message], tools: list[ToolSpec], stream: Stream = SILENT
    ) -> ModelResponse:
        raise self.error

    async def aclose(self) -> None:
        pass


class HangingModel:
    """Never answers; remembers whether its call was cancelled."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = False

    async def complete(
        self, messages: list[Message], tools: list[ToolSpec], stream: Stream = SILENT
    ) -> ModelResponse:
        self.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        pass


class AlwaysToolsModel:
    """Asks for a tool every time."""

    def __init__(self) -> None:
        self.calls = 0

    async def complete(
        self, messages: list[Message], tools: list[ToolSpec], stream: Stream = SILENT
    ) -> ModelResponse:
        self.calls += 1
        return ModelResponse("", [ToolCall(f"c{self.calls}", "echo", {})], "tool_calls", {})

    async def aclose(self) -> None:
        pass


class BrokenToolbox(BuiltinTools):
    def __init__(self, error: BaseException | None = None) -> None:
        super().__init__()
        self.error = error or RuntimeError("toolbox bug")

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        raise self.error


class RaisingAgent:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    async def run_turn(self, turn: Turn) -> str:
        raise self.error


class OutcomeAgent:
    def __init__(self, outcome: str) -> None:
        self.outcome = outcome

    async def run_turn(self, turn: Turn) -> str:
        return self.outcome


class SyncRunTurn:
    def run_turn(self, turn: Turn) -> str:
        return "completed"


def context(
    log: Log,
    text: str,
    model: Model | None = None,
    toolbox: Toolbox | None = None,
    released: asyncio.Event | None = None,
) -> TurnContext:
    """A turn of session s1, id t1, answering one user message; call inside a loop."""
    log.released = released or asyncio.Event()
    return TurnContext(
        "s1",
        "t1",
        [Message("user", text)],
        model or EchoModel(),
        toolbox or BuiltinTools(),
        log.commit,
        log.released,
    )


def run_echo_turn(text: str, model: Model | None = None, agent: Any = None) -> tuple[str, Log]:
    """Run one whole turn through run_agent; returns (outcome, log)."""
    log = Log()

    async def go() -> str:
        ctx = context(log, text, model)
        return await run_agent(agent or ToolLoopAgent(), ctx, log.commit)

    return asyncio.run(go()), log


# --- TurnContext with the built-in agent --------------------------------------------------


def test_a_plain_message_commits_the_answer_then_ends_the_turn() -> None:
    outcome, log = run_echo_turn("hello")
    assert outcome == "completed"
    assert log.types == ["model_response", "turn_ended"]
    response, ended = log.payloads("model_response")[0], log.payloads("turn_ended")[0]
    assert response["text"] == "echo: hello"
    assert response["tool_calls"] == []
    assert response["finish_reason"] == "stop"
    # Echo's prompt: the message's word and the words of the tools offered, as a server's.
    assert response["usage"]["prompt_tokens"] > 1 and response["usage"]["completion_tokens"] == 2
    assert {k: v for k, v in ended.items() if k != "tokens"} == {"outcome": "completed"}
    assert {turn_id for _, _, turn_id in log.entries} == {"t1"}


def test_a_tool_call_commits_each_step_in_order() -> None:
    log = Log()

    async def go() -> tuple[str, TurnContext]:
        ctx = context(log, '/tool echo {"x": 1}')
        return await run_agent(ToolLoopAgent(), ctx, log.commit), ctx

    outcome, ctx = asyncio.run(go())
    assert outcome == "completed"
    assert log.types == [
        "model_response",
        "tool_call",
        "tool_result",
        "model_response",
        "turn_ended",
    ]
    asked, final = log.payloads("model_response")
    [call] = asked["tool_calls"]
    assert (call["name"], call["arguments"]) == ("echo", {"x": 1})
    assert asked["finish_reason"] == "tool_calls"
    assert log.payloads("tool_call") == [
        {"call_id": call["id"], "name": "echo", "arguments": {"x": 1}}
    ]
    assert log.payloads("tool_result") == [
        {
            "call_id": call["id"],
            "name": "echo",
            "content": '{"x": 1}',
            "is_error": False,
            "tokens": 3,  # its UTF-8 bytes / 3, rounded up: kept for the context's count
        }
    ]
    assert final["text"] == 'echo: {"x": 1}'
    assert [m.role for m in ctx.messages] == ["user", "assistant", "tool", "assistant"]
    assert ctx.messages[2].tool_call_id == call["id"]


def test_an_unknown_tool_is_an_error_result_and_the_turn_completes() -> None:
    outcome, log = run_echo_turn("/tool nope {}")
    assert outcome == "completed"
    [result] = log.payloads("tool_result")
    assert result["is_error"] is True
    assert "unknown tool 'nope'" in result["content"]
    assert log.types[-1] == "turn_ended"
    assert log.payloads("turn_ended") == [{"outcome": "completed"}]


@pytest.mark.parametrize(
    ("error", "text"),
    [
        (RuntimeError("toolbox bug"), "the tool failed: RuntimeError: toolbox bug"),
        (SystemExit(2), "the tool failed: SystemExit: 2"),
    ],
    ids=["exception", "system-exit"],
)
def test_a_toolbox_that_raises_gives_an_error_result(error: BaseException, text: str) -> None:
    log = Log()

    async def go() -> str:
        ctx = context(log, "/tool echo {}", toolbox=BrokenToolbox(error))
        return await run_agent(ToolLoopAgent(), ctx, log.commit)

    assert asyncio.run(go()) == "completed"
    [result] = log.payloads("tool_result")
    assert result["is_error"] is True
    assert result["content"] == text


def test_a_cut_answer_ends_the_turn_truncated() -> None:
    outcome, log = run_echo_turn("/long a b c d")
    assert outcome == "truncated"
    assert log.payloads("model_response")[0]["finish_reason"] == "length"
    assert log.payloads("turn_ended") == [{"outcome": "truncated"}]


def test_the_agent_stops_after_max_steps_with_a_notice() -> None:
    model = AlwaysToolsModel()
    outcome, log = run_echo_turn("loop", model=model)
    assert outcome == "completed"
    assert model.calls == MAX_STEPS
    assert log.types.count("tool_result") == MAX_STEPS
    assert log.types[-2:] == ["notice", "turn_ended"]
    assert str(MAX_STEPS) in log.payloads("notice")[0]["text"]


@pytest.mark.parametrize("transient", [True, False])
def test_a_model_error_fails_the_turn_with_its_text(transient: bool) -> None:
    error = ModelError("model server http://m did not answer", transient=transient)
    outcome, log = run_echo_turn("hello", model=FailingModel(error))
    assert outcome == "failed"
    assert log.entries == [
        (
            "turn_ended",
            {
                "outcome": "failed",
                "error": "model server http://m did not answer",
                "transient": transient,
            },
            "t1",
        )
    ]


@pytest.mark.parametrize(
    ("agent", "error_has"),
    [
        (RaisingAgent(RuntimeError("kaput")), "agent error: RuntimeError: kaput"),
        (RaisingAgent(SystemExit(3)), "agent error: SystemExit: 3"),
        (RaisingAgent(KeyboardInterrupt()), "agent error: KeyboardInterrupt"),
        (RaisingAgent(RecursionError("deep")), "RecursionError: deep"),
        (RaisingAgent(MemoryError()), "agent error: MemoryError"),
        (OutcomeAgent("done"), "'done'"),
        (OutcomeAgent("failed"), "'failed'"),  # only the framework may say failed
    ],
    ids=[
        "raises",
        "system-exit",
        "keyboard-interrupt",
        "recursion",
        "memory",
        "bad-outcome",
        "failed-outcome",
    ],
)
def test_an_agent_bug_fails_the_turn(agent: Any, error_has: str) -> None:
    outcome, log = run_echo_turn("hello", agent=agent)
    assert outcome == "failed"
    [(type, payload, turn_id)] = log.entries
    assert (type, payload["outcome"], turn_id) == ("turn_ended", "failed", "t1")
    assert payload["error"].startswith("agent error: ")
    assert error_has in payload["error"]


@pytest.mark.parametrize("outcome", ["completed", "truncated"])
def test_the_agent_outcome_is_committed(outcome: str) -> None:
    result, log = run_echo_turn("hello", agent=OutcomeAgent(outcome))
    assert result == outcome
    assert log.entries == [("turn_ended", {"outcome": outcome}, "t1")]


@pytest.mark.parametrize(
    "error",
    [TurnReleased(), LeaseLost("s1", 1, 2)],
    ids=["released", "lease-lost"],
)
def test_a_release_or_lost_lease_ends_nothing(error: Exception) -> None:
    log = Log()

    async def go() -> None:
        await run_agent(RaisingAgent(error), context(log, "hello"), log.commit)

    with pytest.raises(type(error)):
        asyncio.run(go())
    assert log.entries == []


def test_a_notice_is_committed() -> None:
    log = Log()

    async def go() -> None:
        await context(log, "hello").notice("heads up")

    asyncio.run(go())
    assert log.entries == [("notice", {"text": "heads up"}, "t1")]


def test_messages_is_a_copy() -> None:
    log = Log()

    async def go() -> TurnContext:
        return context(log, "hello")

    ctx = asyncio.run(go())
    ctx.messages.append(Message("user", "sneaky"))
    assert ctx.messages == [Message("user", "hello")]
    assert [spec.name for spec in ctx.tools] == ["echo", "sleep"]


# --- release -----------------------------------------------------------------------------


def test_a_release_before_a_step_raises_and_commits_nothing() -> None:
    log = Log()

    async def go() -> None:
        released = asyncio.Event()
        released.set()
        await run_agent(ToolLoopAgent(), context(log, "hello", released=released), log.commit)

    with pytest.raises(TurnReleased):
        asyncio.run(go())
    assert log.entries == []


@pytest.mark.parametrize("step", ["call_model", "call_tool"])
def test_each_step_checks_the_release_first(step: str) -> None:
    log = Log()

    async def go() -> None:
        released = asyncio.Event()
        released.set()
        ctx = context(log, "hello", released=released)
        if step == "call_model":
            await ctx.call_model()
        else:
            await ctx.call_tool(ToolCall("c1", "echo", {}))

    with pytest.raises(TurnReleased):
        asyncio.run(go())
    assert log.entries == []


def test_a_release_abandons_a_slow_model_call_at_once() -> None:
    log = Log()

    async def go() -> float:
        released = asyncio.Event()
        ctx = context(log, "/sleep 5 late", released=released)
        asyncio.get_running_loop().call_later(0.1, released.set)
        began = time.monotonic()
        with pytest.raises(TurnReleased):
            await run_agent(ToolLoopAgent(), ctx, log.commit)
        return time.monotonic() - began

    elapsed = asyncio.run(go())
    assert elapsed < 1.0  # 0.1 s until the release; the model would take 5 s
    assert log.entries == []


def test_a_release_cancels_the_abandoned_model_call() -> None:
    model = HangingModel()

    async def go() -> None:
        log = Log()
        released = asyncio.Event()
        ctx = context(log, "hello", model=model, released=released)
        task = asyncio.ensure_future(ctx.call_model())
        await model.started.wait()
        released.set()
        with pytest.raises(TurnReleased):
            await task
        await asyncio.sleep(0)  # let the cancellation reach the model
        assert model.cancelled
        assert log.entries == []

    asyncio.run(go())


def test_cancelling_the_turn_cancels_the_model_call() -> None:
    model = HangingModel()

    async def go() -> None:
        ctx = context(Log(), "hello", model=model)
        task = asyncio.ensure_future(ctx.call_model())
        await model.started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)  # ample time for a cancellation to arrive
        assert model.cancelled

    asyncio.run(go())


def test_a_release_during_a_tool_call_lets_it_finish_and_records_its_result() -> None:
    log = Log()

    def release_soon(type: str) -> None:
        # The sleep tool runs for 0.3 s once `tool_call` is committed; release meanwhile.
        if type == "tool_call" and log.released is not None:
            asyncio.get_running_loop().call_later(0.05, log.released.set)

    log.on_commit = release_soon

    async def go() -> None:
        ctx = context(log, '/tool sleep {"seconds": 0.3}')
        await run_agent(ToolLoopAgent(), ctx, log.commit)

    with pytest.raises(TurnReleased):
        asyncio.run(go())
    assert log.types == ["model_response", "tool_call", "tool_result"]
    assert log.released_at == [False, False, True]  # the release came while the tool ran
    [result] = log.payloads("tool_result")
    assert (result["content"], result["is_error"]) == ("slept 0.3 s", False)


# --- start_turn ----------------------------------------------------------------------------


def test_start_turn_reads_then_says_how_far_in_turn_started() -> None:
    log = Log()
    events = [user("hi"), ev("turn_started", turn_id="t0"), answer("echo: hi"), user("again")]
    seen: list[tuple[str, list[Message]]] = []

    async def read() -> list[EventRecord]:
        log.calls.append("read")
        return events

    async def run(turn_id: str, messages: list[Message]) -> str:
        log.calls.append("run")
        seen.append((turn_id, messages))
        return "completed"

    turn_id, outcome = asyncio.run(start_turn(log.commit, read, run))
    assert log.calls == ["read", "commit turn_started", "run"]
    assert log.entries == [("turn_started", {"read_to": events[-1].seq}, turn_id)]
    assert outcome == "completed"
    assert seen == [(turn_id, to_messages(events))]


def test_each_turn_gets_a_new_id() -> None:
    async def read() -> list[EventRecord]:
        return []

    async def run(turn_id: str, messages: list[Message]) -> str:
        return "completed"

    ids = {asyncio.run(start_turn(Log().commit, read, run))[0] for _ in range(3)}
    assert len(ids) == 3


# --- resume_turn ---------------------------------------------------------------------------


@dataclass
class Runs:
    """A fake `run`: keeps what it was handed, returns `outcome`."""

    outcome: str = "completed"
    seen: list[tuple[str, list[Message]]] = field(default_factory=list)

    async def run(self, turn_id: str, messages: list[Message]) -> str:
        self.seen.append((turn_id, messages))
        return self.outcome


def resume(events: list[EventRecord], cause: str = "worker_crash") -> tuple[str, Log, Runs]:
    log, runs = Log(), Runs()
    outcome = asyncio.run(resume_turn("t1", events, cause, log.commit, runs.run))
    return outcome, log, runs


def test_resume_repairs_a_started_call_then_continues_with_a_note() -> None:
    events = [
        user("/tool echo {}"),
        ev("turn_started"),
        asks("c1"),
        tool_call("c1", created_at=T0 + 60),
    ]
    outcome, log, runs = resume(events, "worker_crash")
    assert outcome == "completed"
    assert log.types == ["tool_result", "continuation"]
    assert log.entries[0] == (
        "tool_result",
        {
            "call_id": "c1",
            "name": "echo",
            "content": INTERRUPTED_RESULT,
            "is_error": True,
            "repaired": True,
        },
        "t1",
    )
    _, note, turn_id = log.entries[1]
    assert turn_id == "t1"
    assert note["cause"] == "worker_crash"
    assert note["last_event_at"] == T0 + 60
    assert CONTINUATION_NOTES["worker_crash"] in note["text"]
    assert "2023-11-14 22:14:20 UTC" in note["text"]

    [(run_turn_id, messages)] = runs.seen
    assert run_turn_id == "t1"
    assert messages[:2] == to_messages(events)
    assert messages[2] == Message("tool", INTERRUPTED_RESULT, tool_call_id="c1")
    assert messages[3] == Message("user", note["text"], note=True)
    assert len(messages) == 4


def test_resume_repairs_a_call_that_never_started() -> None:
    _, log, runs = resume([user("x"), ev("turn_started"), asks("c1")])
    assert log.payloads("tool_result")[0]["content"] == NOT_STARTED_RESULT
    assert runs.seen[0][1][-2] == Message("tool", NOT_STARTED_RESULT, tool_call_id="c1")


def test_resume_with_all_results_in_continues_without_repairs() -> None:
    _, log, runs = resume([user("x"), ev("turn_started"), asks("c1"), tool_result("c1")])
    assert log.types == ["continuation"]
    assert runs.seen[0][1][-1].note is True
    assert [m.role for m in runs.seen[0][1]] == ["user", "assistant", "tool", "user"]


def test_an_answer_cut_by_max_tokens_is_continued_with_a_note_saying_so() -> None:
    _, log, runs = resume([user("x"), ev("turn_started"), answer("echo", "length")], "max_tokens")
    assert log.types == ["continuation"]
    note = log.payloads("continuation")[0]
    assert note["cause"] == "max_tokens" and "token limit" in note["text"]
    assert len(runs.seen) == 1 and runs.seen[0][1][-1].note is True


def test_a_continuation_does_not_answer_a_message_its_turn_never_read() -> None:
    """A message committed after the turn started (and after the runner chose to continue
    rather than to let it drive the next turn) belongs to the next turn: the continuation
    must not see it, or the next turn answers it a second time (found by the chaos test)."""
    first = user("x")
    events = [first, ev("turn_started", {"read_to": first.seq}), asks("c1"), tool_result("c1")]
    events.append(user("queued while the worker died"))
    _, log, runs = resume(events)
    assert log.types == ["continuation"]
    [(_, messages)] = runs.seen
    assert [m.content for m in messages if m.role == "user" and not m.note] == ["x"]


def test_resume_before_any_model_response_continues() -> None:
    _, log, runs = resume([user("x"), ev("turn_started")])
    assert log.types == ["continuation"]
    assert len(runs.seen) == 1


@pytest.mark.parametrize(
    ("tail", "outcome"),
    [
        ([answer("echo: x")], "completed"),
        ([answer("echo: x"), user("next one")], "completed"),
        ([answer("echo: x"), ev("notice", {"text": "fyi"})], "completed"),
        ([asks("c1"), tool_result("c1"), answer("echo: ok")], "completed"),
    ],
    ids=["answered", "user-after-answer", "notice-after-answer", "after-tools"],
)
def test_resume_of_a_finished_turn_only_ends_it(tail: list[EventRecord], outcome: str) -> None:
    result, log, runs = resume([user("x"), ev("turn_started"), *tail])
    assert result == outcome
    assert log.entries == [("turn_ended", {"outcome": outcome, "recovered": True}, "t1")]
    assert runs.seen == []  # no second reply


def test_resume_decides_on_its_own_turn_but_repairs_all() -> None:
    # An earlier turn's dangling call gets its result (chat APIs reject it anywhere), but
    # this turn's answer is committed: it is only ended, never answered twice.
    events = [
        user("a"),
        ev("turn_started", turn_id="t0"),
        ev("model_response", {"tool_calls": [{"id": "old", "name": "echo"}]}, turn_id="t0"),
        ev("turn_started"),
        answer("echo: a"),
    ]
    _, log, runs = resume(events)
    assert log.types == ["tool_result", "turn_ended"]
    assert log.payloads("tool_result")[0]["call_id"] == "old"
    assert runs.seen == []


@pytest.mark.parametrize("cause", [*CONTINUATION_NOTES, "something-new"])
def test_the_note_explains_without_asking_to_repeat_work(cause: str) -> None:
    _, log, _ = resume([user("x"), ev("turn_started"), asks("c1"), tool_call("c1")], cause)
    note = log.payloads("continuation")[0]
    text = note["text"]
    assert note["cause"] == cause
    assert CONTINUATION_NOTES.get(cause, "it stopped") in text
    assert T0_TEXT in text
    for word in ("re-run", "rerun", "retry", "again", "repeat", "redo"):
        assert word not in text.lower()
        assert word not in INTERRUPTED_RESULT.lower()


def test_a_resumed_turn_answers_from_the_repaired_result_without_rerunning_the_tool() -> None:
    events = [user('/tool echo {"x": 1}'), ev("turn_started"), asks("c1"), tool_call("c1")]
    log = Log()

    async def go() -> str:
        async def run(turn_id: str, messages: list[Message]) -> str:
            ctx = TurnContext(
                "s1", turn_id, messages, EchoModel(), BuiltinTools(), log.commit, asyncio.Event()
            )
            return await run_agent(ToolLoopAgent(), ctx, log.commit)

        return await resume_turn("t1", events, "daemon_restart", log.commit, run)

    assert asyncio.run(go()) == "completed"
    assert log.types == ["tool_result", "continuation", "model_response", "turn_ended"]
    assert log.payloads("model_response")[0]["text"] == f"echo: {INTERRUPTED_RESULT}"


def test_resume_puts_repaired_results_right_after_their_call() -> None:
    events = [
        user("/tool echo {}"),
        ev("turn_started"),
        asks("c1"),
        tool_call("c1"),
        user("meanwhile"),  # lease-less: committed by intake while the tool ran
    ]
    _, _, runs = resume(events)
    messages = runs.seen[0][1]
    asked = next(i for i, m in enumerate(messages) if m.tool_calls)
    assert messages[asked + 1] == Message("tool", INTERRUPTED_RESULT, tool_call_id="c1")


# --- load_agent_class ----------------------------------------------------------------------


def test_load_agent_class_loads_the_builtin_agent() -> None:
    assert load_agent_class("workers.agents.tool_loop:ToolLoopAgent") is ToolLoopAgent


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("", "must look like package.module:Class"),
        ("workers.agents.tool_loop", "must look like package.module:Class"),
        ("workers.agents.tool_loop.ToolLoopAgent", "must look like package.module:Class"),
        (":ToolLoopAgent", "must look like package.module:Class"),
        ("workers.agents.tool_loop:", "must look like package.module:Class"),
        ("no_such_package.agents:Agent", "cannot import no_such_package.agents"),
        ("workers.agents.tool_loop:NoSuchAgent", "NoSuchAgent is not a class"),
        ("workers.agents.tool_loop:MAX_STEPS", "MAX_STEPS is not a class"),
        ("workers.tools:ToolOutcome", "ToolOutcome is not a class"),
        ("workers.agent:load_agent_class", "load_agent_class is not a class"),
    ],
    ids=[
        "empty",
        "no-colon",
        "dotted-class",
        "no-module",
        "no-class",
        "missing-module",
        "missing-class",
        "not-a-class",
        "class-without-run-turn",
        "function",
    ],
)
def test_load_agent_class_refuses_with_what_to_fix(spec: str, says: str) -> None:
    with pytest.raises(AgentLoadError) as caught:
        load_agent_class(spec)
    assert "agent.class" in str(caught.value)
    assert says in str(caught.value)


def test_load_agent_class_refuses_a_sync_run_turn() -> None:
    with pytest.raises(AgentLoadError):
        load_agent_class(f"{__name__}:SyncRunTurn")
