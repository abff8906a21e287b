"""Subagents from inside a turn, on a real SQLite store: the `spawn_subagent` tool, the
limits the model reads, a spawn call repaired truthfully, and a result as input.

The turn runs in-process (no worker, no daemon): what is claimed here is what the
turn's context and the worker's history make of the store's spawn and result.
"""

from __future__ import annotations

import asyncio
from typing import Any

from supervisor.core.vocabulary import EventType, SubagentStatus
from supervisor.store import EventRecord, Store
from workers import history
from workers.models import Message, ToolCall
from workers.models.echo import EchoModel
from workers.spawning import TOOL, Limits, Spawner, SpawnRefused
from workers.tools import BuiltinTools
from workers.turns import TurnContext

TOKEN = 7


def parent(store: Store) -> str:
    """A session whose lease token is TOKEN, as if a worker held it."""
    sid = store.sessions.create("alice").id
    store.db.execute_sql("UPDATE session SET lease_token = ? WHERE id = ?", (TOKEN, sid))
    return sid


def turn(store: Store, sid: str, limits: Limits, signals: list[Any]) -> TurnContext:
    async def commit(type: str, payload: dict[str, Any], turn_id: str | None) -> int:
        return store.events.append(sid, type, payload, token=TOKEN, turn_id=turn_id)

    async def notify(kind: str, **fields: Any) -> None:
        signals.append((kind, fields))

    spawner = Spawner(sid, store, lambda: TOKEN, notify, limits)
    return TurnContext(
        sid,
        "t1",
        [Message("user", "hi")],
        EchoModel(),
        BuiltinTools(),
        commit,
        asyncio.Event(),
        spawner,
    )


def test_the_tool_spawns_a_child_and_signals_its_task(store: Store) -> None:
    sid = parent(store)
    signals: list[Any] = []
    ctx = turn(store, sid, Limits(), signals)
    assert TOOL in [spec.name for spec in ctx.tools]
    outcome = asyncio.run(ctx.call_tool(ToolCall("c1", TOOL, {"task": "count to 3"})))
    assert not outcome.is_error
    (child,) = store.subagents.children(sid)
    assert child.id in outcome.content and child.task == "count to 3"
    types = [e.type for e in store.events.read(sid)]
    assert types == ["tool_call", "subagent_spawned", "tool_result"]
    first = store.events.read(child.id)[0]
    assert (first.type, first.payload["text"]) == ("user_message", "count to 3")
    # The supervisor is told of the child's task: it wakes the child.
    assert ("committed", {"session": child.id, "seq": 1, "event_type": "user_message"}) in signals
    # The same call made again (a continuation after a crash) starts no second child.
    again = asyncio.run(ctx.call_tool(ToolCall("c1", TOOL, {"task": "count to 3"})))
    assert child.id in again.content and len(store.subagents.children(sid)) == 1


def test_past_the_limits_the_model_reads_why_and_nothing_is_written(store: Store) -> None:
    sid = parent(store)
    ctx = turn(store, sid, Limits(max_depth=2, max_children=1), [])
    asyncio.run(ctx.call_tool(ToolCall("c1", TOOL, {"task": "one"})))
    refused = asyncio.run(ctx.call_tool(ToolCall("c2", TOOL, {"task": "two"})))
    assert refused.is_error and "max_children" in refused.content
    empty = asyncio.run(ctx.call_tool(ToolCall("c3", TOOL, {"task": "  "})))
    assert empty.is_error and "task" in empty.content
    assert len(store.subagents.children(sid)) == 1
    spawned = [e for e in store.events.read(sid) if e.type == EventType.SUBAGENT_SPAWNED]
    assert len(spawned) == 1


def test_turned_off_the_tool_is_not_offered_and_the_api_refuses(store: Store) -> None:
    sid = parent(store)
    ctx = turn(store, sid, Limits(max_depth=0), [])
    assert TOOL not in [spec.name for spec in ctx.tools]
    try:
        asyncio.run(ctx.spawn_subagent("x"))
    except SpawnRefused as exc:
        assert "off" in str(exc)
    else:
        raise AssertionError("spawn_subagent did not refuse")


def test_an_agent_the_operator_does_not_allow_is_refused(store: Store) -> None:
    sid = parent(store)
    ctx = turn(store, sid, Limits(agents=("workers.agents.tool_loop:ToolLoopAgent",)), [])
    try:
        asyncio.run(ctx.spawn_subagent("x", agent="os:system"))
    except SpawnRefused as exc:
        assert "agent.allowed" in str(exc)
    else:
        raise AssertionError("an agent outside agent.allowed was accepted")
    assert store.subagents.children(sid) == []


def test_a_spawn_call_cut_before_its_result_is_repaired_with_what_it_did(store: Store) -> None:
    """The spawn is committed whole with the call's id: the repair says the child started,
    not that the call may or may not have taken effect."""
    sid = parent(store)
    call = {"id": "c9", "name": TOOL, "arguments": {"task": "t"}}
    store.events.append(sid, "model_response", {"text": "", "tool_calls": [call]}, token=TOKEN)
    store.events.append(sid, "tool_call", {"call_id": "c9", "name": TOOL}, token=TOKEN)
    spawned = store.subagents.spawn(
        sid, "t", token=TOKEN, turn_id=None, max_depth=2, max_children=8, call_id="c9"
    )
    (missing,) = history.missing_results(store.events.read(sid))
    payload = missing.payload()
    assert payload["is_error"] is False and spawned.child.id in payload["content"]


def test_a_result_is_input_for_the_parent_until_a_turn_reads_it(store: Store) -> None:
    sid = parent(store)
    spawned = store.subagents.spawn(
        sid, "t", token=TOKEN, turn_id=None, max_depth=2, max_children=8
    )
    child = spawned.child.id
    store.events.append(child, "turn_started", {"read_to": 1}, turn_id="k")
    store.events.append(child, "model_response", {"text": "42", "tool_calls": []}, turn_id="k")
    # A parent turn read the log before the result came: the result still wants a turn.
    seen = store.sessions.get(sid).last_seq
    store.events.append(child, "turn_ended", {"outcome": "completed"}, turn_id="k")
    reported = store.subagents.report(child)
    assert reported is not None and reported.status is SubagentStatus.COMPLETED
    store.events.append(sid, "turn_started", {"read_to": seen}, token=TOKEN, turn_id="p")
    assert store.sessions.get(sid).pending
    events: list[EventRecord] = store.events.read(sid)
    messages = history.to_messages(events)
    assert messages[-1].role == "user" and f"[subagent {child}" in messages[-1].content
    assert "42" in messages[-1].content


def test_an_agent_that_spawns_again_in_a_continued_turn_gets_its_first_child(
    store: Store,
) -> None:
    """A continuation runs the agent from the top: its spawns, in the same order with the
    same tasks, are the ones it made before the crash, not new children."""
    sid = parent(store)
    first_run = turn(store, sid, Limits(), [])
    one = asyncio.run(first_run.spawn_subagent("count"))
    two = asyncio.run(first_run.spawn_subagent("count"))  # a second one, on purpose
    assert one != two
    continued = turn(store, sid, Limits(), [])  # the same turn id, run again
    assert asyncio.run(continued.spawn_subagent("count")) == one
    assert asyncio.run(continued.spawn_subagent("count")) == two
    assert asyncio.run(continued.spawn_subagent("something else")) not in (one, two)
    assert len(store.subagents.children(sid)) == 3
