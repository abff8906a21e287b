"""Background tasks from inside a turn, on a real SQLite store: the `start_task` tool and
`turn.start_task`, the refusals the model reads, a repeated call that starts nothing
new, a start call repaired truthfully, and an outcome as input.

The turn runs in-process (no worker, no daemon): what is claimed here is what the turn's
context and the worker's history make of the store's start and report. Running the task
is the supervisor's (tests/tasks/test_tasks_daemon.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from supervisor.contract.config import Config
from supervisor.core.vocabulary import EventType, TaskStatus
from supervisor.store import LeaseLost, Store
from workers import history
from workers.agents.tool_loop import ToolLoopAgent
from workers.models import Message, ToolCall
from workers.models.echo import EchoModel
from workers.tasking import TOOL, Kinds, Starter, TaskRefused
from workers.tools import BuiltinTools
from workers.turns import TurnContext

TOKEN = 7
TASKS = {
    "max_running": 2,
    "kinds": [
        {"name": "build", "command": ["make", "{target}"], "args": {"target": "^[a-z]{1,12}$"}},
        {"name": "clean", "command": ["make", "clean"]},
        {"name": "wait", "command": ["sleep", "{seconds}"], "args": {"seconds": "^[0-9]{1,4}$"}},
    ],
}
KINDS = Kinds.of(Config.model_validate({"tasks": TASKS}).tasks)


def session(store: Store) -> str:
    """A session whose lease token is TOKEN, as if a worker held it."""
    sid = store.sessions.create("alice").id
    store.db.execute_sql("UPDATE session SET lease_token = ? WHERE id = ?", (TOKEN, sid))
    return sid


def turn(
    store: Store,
    sid: str,
    kinds: Kinds | None = KINDS,
    signals: list[Any] | None = None,
    token: int = TOKEN,
    text: str = "hi",
) -> TurnContext:
    """A turn `t1` of `sid` writing with `token`, its starter signalling into `signals`."""

    async def commit(type: str, payload: dict[str, Any], turn_id: str | None) -> int:
        return store.events.append(sid, type, payload, token=token, turn_id=turn_id)

    async def notify(kind: str, **fields: Any) -> None:
        if signals is not None:
            signals.append((kind, fields))

    starter = None if kinds is None else Starter(sid, store, lambda: token, notify, kinds)
    return TurnContext(
        sid,
        "t1",
        [Message("user", text)],
        EchoModel(),
        BuiltinTools(),
        commit,
        asyncio.Event(),
        None,
        starter,
    )


def call(ctx: TurnContext, arguments: dict[str, Any], call_id: str = "c1") -> Any:
    return asyncio.run(ctx.call_tool(ToolCall(call_id, TOOL, arguments)))


def types(store: Store, sid: str) -> list[str]:
    return [e.type for e in store.events.read(sid)]


def test_the_tool_starts_a_task_and_signals_the_supervisor(store: Store) -> None:
    sid = session(store)
    signals: list[Any] = []
    ctx = turn(store, sid, signals=signals)
    (spec,) = [spec for spec in ctx.tools if spec.name == TOOL]
    assert "build (args: target); clean (no args); wait (args: seconds)" in spec.description
    assert spec.input_schema["properties"]["kind"]["enum"] == ["build", "clean", "wait"]

    outcome = call(ctx, {"kind": "build", "args": {"target": "docs"}})
    assert not outcome.is_error, outcome.content
    (task,) = store.tasks.of_session(sid)
    assert (task.kind, task.args, task.status) == ("build", {"target": "docs"}, "pending")
    assert outcome.content.startswith(f"started task {task.id} (build)")
    assert "arrive in this conversation as a message" in outcome.content
    assert types(store, sid) == ["tool_call", "task_started", "tool_result"]
    started = store.events.read(sid)[1].payload
    assert (started["task"], started["call_id"]) == (task.id, "c1")
    # The supervisor's launcher hooks this signal: it starts the task's runner.
    assert signals == [
        ("committed", {"session": sid, "seq": task.started_seq, "event_type": "task_started"})
    ]

    # The same call made again (a continued turn) starts no second task, and signals nothing.
    again = call(ctx, {"kind": "build", "args": {"target": "docs"}})
    assert task.id in again.content and not again.is_error
    assert len(store.tasks.of_session(sid)) == 1 and len(signals) == 1


def test_a_number_is_an_argument_and_a_kind_without_args_takes_none(store: Store) -> None:
    sid = session(store)
    ctx = turn(store, sid)
    assert not call(ctx, {"kind": "wait", "args": {"seconds": 5}}, "c1").is_error
    assert not call(ctx, {"kind": "clean", "args": {}}, "c2").is_error
    assert [t.args for t in store.tasks.of_session(sid)] == [{"seconds": "5"}, {}]


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ({"kind": "deploy"}, "no task kind 'deploy'; the operator's kinds are: build (args: "),
        ({}, "no task kind 'None'"),
        ({"kind": "build"}, "needs the argument 'target'"),
        ({"kind": "build", "args": {"target": "../etc"}}, "does not match its pattern"),
        ({"kind": "build", "args": {"target": "a; rm -rf /"}}, "does not match its pattern"),
        ({"kind": "build", "args": {"target": "docs", "x": "1"}}, "takes no argument 'x'"),
        ({"kind": "build", "args": ["docs"]}, "must be a JSON object"),
        ({"kind": "build", "args": {"target": True}}, "must be a string or a number"),
        ({"kind": "clean", "args": {"target": "docs"}}, "(it takes: none)"),
    ],
    ids=[
        "unknown-kind",
        "no-kind",
        "missing-arg",
        "path",
        "shell",
        "extra-arg",
        "not-an-object",
        "boolean",
        "no-args-kind",
    ],
)
def test_a_start_that_does_not_fit_is_an_error_the_model_reads(
    store: Store, arguments: dict[str, Any], says: str
) -> None:
    sid = session(store)
    signals: list[Any] = []
    outcome = call(turn(store, sid, signals=signals), arguments)
    assert outcome.is_error and outcome.content.startswith("no task started: ")
    assert says in outcome.content, outcome.content
    assert store.tasks.of_session(sid) == [] and signals == []
    assert types(store, sid) == ["tool_call", "tool_result"]


def test_past_max_running_the_model_reads_why(store: Store) -> None:
    sid = session(store)
    ctx = turn(store, sid)
    for n in range(2):
        assert not call(ctx, {"kind": "build", "args": {"target": f"n{'x' * n}"}}, f"c{n}").is_error
    refused = call(ctx, {"kind": "clean"}, "c9")
    assert refused.is_error and "tasks.max_running" in refused.content
    # One ended: there is room again.
    first = store.tasks.of_session(sid)[0]
    assert store.tasks.cancel(first.id) is not None
    assert not call(ctx, {"kind": "clean"}, "c10").is_error
    started = [e for e in store.events.read(sid) if e.type == EventType.TASK_STARTED]
    assert len(started) == len(store.tasks.of_session(sid)) == 3


@pytest.mark.parametrize(
    "kinds",
    [Kinds(KINDS.kinds, max_running=0), Kinds((), max_running=8), None],
    ids=["max-running-0", "no-kinds", "no-starter"],
)
def test_turned_off_the_tool_is_not_offered_and_both_ways_refuse(
    store: Store, kinds: Kinds | None
) -> None:
    sid = session(store)
    ctx = turn(store, sid, kinds)
    assert TOOL not in [spec.name for spec in ctx.tools]
    outcome = call(ctx, {"kind": "build", "args": {"target": "docs"}})
    assert outcome.is_error
    if kinds is not None:  # without a starter the toolbox answers: no such tool
        assert "background tasks are off here" in outcome.content
    with pytest.raises(TaskRefused, match="background tasks are off here"):
        asyncio.run(ctx.start_task("build", {"target": "docs"}))
    assert store.tasks.of_session(sid) == []


def test_a_turn_fenced_out_starts_nothing(store: Store) -> None:
    sid = session(store)
    signals: list[Any] = []

    async def notify(kind: str, **fields: Any) -> None:
        signals.append((kind, fields))

    starter = Starter(sid, store, lambda: TOKEN + 1, notify, KINDS)
    with pytest.raises(LeaseLost):
        asyncio.run(starter.call({"kind": "clean"}, "t1", "c1"))
    with pytest.raises(LeaseLost):
        asyncio.run(turn(store, sid, token=TOKEN + 1).start_task("clean"))
    assert signals == []
    assert store.tasks.of_session(sid) == []
    assert EventType.TASK_STARTED not in types(store, sid)


def test_turn_start_task_refuses_with_the_reason(store: Store) -> None:
    sid = session(store)
    ctx = turn(store, sid)
    with pytest.raises(TaskRefused, match="the operator's kinds are: build"):
        asyncio.run(ctx.start_task("deploy"))
    with pytest.raises(TaskRefused, match="does not match its pattern"):
        asyncio.run(ctx.start_task("build", {"target": "UPPER"}))
    assert store.tasks.of_session(sid) == []


def test_an_agent_that_starts_again_in_a_continued_turn_gets_its_first_tasks(
    store: Store,
) -> None:
    """A continuation runs the agent from the top: its starts, in the same order with the
    same kind and arguments, are the ones it made before the crash, not new tasks."""
    sid = session(store)
    first_run = turn(store, sid)
    one = asyncio.run(first_run.start_task("build", {"target": "docs"}))
    two = asyncio.run(first_run.start_task("build", {"target": "docs"}))  # a second, on purpose
    assert one != two
    continued = turn(store, sid)  # the same turn id, run again
    assert asyncio.run(continued.start_task("build", {"target": "docs"})) == one
    assert asyncio.run(continued.start_task("build", {"target": "docs"})) == two
    with pytest.raises(TaskRefused, match=r"tasks\.max_running"):  # a new one: past the limit
        asyncio.run(continued.start_task("build", {"target": "site"}))
    assert [t.id for t in store.tasks.of_session(sid)] == [one, two]


def test_the_echo_model_starts_a_task_through_the_tool(store: Store) -> None:
    sid = session(store)
    ctx = turn(store, sid, text='/task build {"target": "docs"}')
    assert asyncio.run(ToolLoopAgent().run_turn(ctx)) == "completed"
    (task,) = store.tasks.of_session(sid)
    assert task.args == {"target": "docs"}
    answer = [e for e in store.events.read(sid) if e.type == EventType.MODEL_RESPONSE][-1]
    assert answer.payload["text"].startswith(f"echo: started task {task.id} (build)")

    refused = turn(store, session(store), text="/task deploy")
    asyncio.run(ToolLoopAgent().run_turn(refused))
    said = refused.messages[-1].content
    assert said.startswith("echo: no task started: there is no task kind 'deploy'")


def test_a_start_call_cut_before_its_result_is_repaired_with_what_it_did(store: Store) -> None:
    """The start is committed whole with the call's id: the repair says the task started,
    not that the call may or may not have taken effect. A call that started nothing is
    repaired as interrupted."""
    sid = session(store)
    calls = [
        {"id": "c9", "name": TOOL, "arguments": {"kind": "clean"}},
        {"id": "c8", "name": TOOL, "arguments": {"kind": "clean"}},
    ]
    store.events.append(sid, "model_response", {"text": "", "tool_calls": calls}, token=TOKEN)
    store.events.append(sid, "tool_call", {"call_id": "c9", "name": TOOL}, token=TOKEN)
    started = store.tasks.start(
        sid, "clean", {}, token=TOKEN, turn_id=None, max_running=8, call_id="c9"
    )
    store.events.append(sid, "tool_call", {"call_id": "c8", "name": TOOL}, token=TOKEN)
    done, cut = history.missing_results(store.events.read(sid))
    assert done.payload()["is_error"] is False
    assert done.payload()["content"].startswith(f"started task {started.task.id} (clean)")
    assert cut.payload()["is_error"] is True
    assert cut.payload()["content"] == history.INTERRUPTED_RESULT


def test_an_outcome_is_input_for_the_session_until_a_turn_reads_it(store: Store) -> None:
    sid = session(store)
    task = store.tasks.start(sid, "clean", {}, token=TOKEN, turn_id=None, max_running=8).task
    assert store.tasks.claim(task.id, "host-a", "host-a/boot0001") is not None
    assert not store.sessions.get(sid).pending
    seen = store.sessions.get(sid).last_seq
    assert store.tasks.record(
        task.id, 1, TaskStatus.SUCCEEDED, exit_code=0, duration=1.5, output_tail="removed 3\n"
    )
    assert store.tasks.report(task.id) is not None
    assert store.sessions.get(sid).pending
    # A turn read the log before the outcome came: the outcome still wants a turn...
    store.events.append(sid, "turn_started", {"read_to": seen}, token=TOKEN, turn_id="p")
    store.events.append(sid, "turn_ended", {"outcome": "completed"}, token=TOKEN, turn_id="p")
    assert store.sessions.get(sid).pending
    # ...and a turn that read it has answered it.
    read = store.sessions.get(sid).last_seq
    store.events.append(sid, "turn_started", {"read_to": read}, token=TOKEN, turn_id="q")
    assert not store.sessions.get(sid).pending
    messages = history.to_messages(store.events.read(sid))
    assert messages[-1].role == "user"
    assert messages[-1].content.startswith(
        f"[background task result] task {task.id} (clean) succeeded after 1.5 s."
    )
    assert "removed 3" in messages[-1].content
    # `task_started` itself is no message: the tool call and its result tell the model.
    assert all(task.id not in m.content for m in messages[:-1])
