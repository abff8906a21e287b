"""Restart requests from inside a turn, on a real SQLite store: the `request_restart` tool
and `turn.request_restart`, off by default, the request in progress as the answer, the
rate limit the model reads, a repeated call that asks for nothing new, and a request
call repaired truthfully.

The turn runs in-process (no worker, no daemon): what is claimed here is what the turn's
context and the worker's history make of the store's request. Restarting is the
daemon's.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import supervisor
from supervisor.contract.config import Config, config_version
from supervisor.contract.spawn import WorkerSpec
from supervisor.core.vocabulary import EventType
from supervisor.store import LeaseLost, Store
from workers import history
from workers.agents.tool_loop import ToolLoopAgent
from workers.models import Message, ToolCall
from workers.models.echo import EchoModel
from workers.restarting import TOOL, Requester, RestartRefused, RestartScope, requested
from workers.tools import BuiltinTools
from workers.turns import TurnContext

TOKEN = 7
HOST = "host-a"
ON = RestartScope(
    HOST, "boot0001", 4242, "0123456789ab", enabled=True, min_interval=60.0, principals=("alice",)
)


def session(store: Store) -> str:
    """A session whose lease token is TOKEN, as if a worker held it."""
    sid = store.sessions.create("alice").id
    store.db.execute_sql("UPDATE session SET lease_token = ? WHERE id = ?", (TOKEN, sid))
    return sid


def turn(
    store: Store,
    sid: str,
    daemon: RestartScope | None = ON,
    signals: list[Any] | None = None,
    token: int = TOKEN,
    text: str = "hi",
    turn_id: str = "t1",
) -> TurnContext:
    """A turn (`t1`) of `sid` writing with `token`, its requester signalling into `signals`."""

    async def commit(type: str, payload: dict[str, Any], turn_id: str | None) -> int:
        return store.events.append(sid, type, payload, token=token, turn_id=turn_id)

    async def notify(kind: str, **fields: Any) -> None:
        if signals is not None:
            signals.append((kind, fields))

    requester = None if daemon is None else Requester(sid, store, lambda: token, notify, daemon)
    return TurnContext(
        sid,
        turn_id,
        [Message("user", text)],
        EchoModel(),
        BuiltinTools(),
        commit,
        asyncio.Event(),
        requester=requester,
    )


def call(ctx: TurnContext, arguments: dict[str, Any], call_id: str = "c1") -> Any:
    return asyncio.run(ctx.call_tool(ToolCall(call_id, TOOL, arguments)))


def types(store: Store, sid: str) -> list[str]:
    return [e.type for e in store.events.read(sid)]


def settle(store: Store, restart: str) -> None:
    """The daemon is back: the request is done (as the lead's startup settles it)."""
    assert store.restarts.settle(restart, boot="boot0002", version="0.0.0", config="c") is not None


def test_off_by_default_the_tool_is_not_offered_and_both_ways_refuse(store: Store) -> None:
    spec = WorkerSpec("w0.1", "o", "ipc://x", 4242, "boot0001", HOST, "sqlite://", {}, "r", "s")
    off = RestartScope.of(spec, Config())
    assert not off.enabled and off.min_interval == 60.0
    for daemon in (off, None):
        sid = session(store)
        ctx = turn(store, sid, daemon)
        assert TOOL not in [tool.name for tool in ctx.tools]
        outcome = call(ctx, {"reason": "testing"})
        assert outcome.is_error
        if daemon is not None:  # without a requester the toolbox answers: no such tool
            assert "restart.agent_may_request" in outcome.content, outcome.content
        with pytest.raises(RestartRefused, match=r"restart\.agent_may_request is false"):
            asyncio.run(ctx.request_restart("testing"))
        assert EventType.RESTART_REQUESTED not in types(store, sid)
    assert store.restarts.list() == []


def test_the_daemon_is_the_workers_supervisor_with_the_operators_rules() -> None:
    config = Config.model_validate({"restart": {"agent_may_request": True, "min_interval": 5}})
    spec = WorkerSpec("w0.1", "o", "ipc://x", 4242, "boot0001", HOST, "sqlite://", {}, "r", "s")
    assert RestartScope.of(spec, config) == RestartScope(
        HOST, "boot0001", 4242, config_version(config), enabled=True, min_interval=5.0
    )


def test_the_tool_writes_the_row_and_the_event_and_signals_the_supervisor(store: Store) -> None:
    sid = session(store)
    signals: list[Any] = []
    ctx = turn(store, sid, signals=signals)
    (spec,) = [tool for tool in ctx.tools if tool.name == TOOL]
    assert spec.input_schema["required"] == ["reason"]

    outcome = call(ctx, {"reason": "testing\x07 the\n new   build"})
    assert not outcome.is_error, outcome.content
    (row,) = store.restarts.list()
    assert (row.host, row.boot, row.pid, row.session, row.turn_id, row.call_id) == (
        HOST, "boot0001", 4242, sid, "t1", "c1",
    )  # fmt: skip
    assert (row.requested_by, row.reason, row.state, row.drain) == (
        "agent", "testing the new build", "pending", None,
    )  # fmt: skip
    assert (row.version_before, row.config_before) == (supervisor.__version__, ON.config)
    assert store.restarts.active(HOST) == row
    assert outcome.content == requested(row.id, "testing the new build")
    assert "restarts after this turn ends" in outcome.content
    assert types(store, sid) == ["tool_call", "restart_requested", "tool_result"]
    event = store.events.read(sid)[1]
    assert (event.turn_id, event.seq, event.writer) == ("t1", row.request_seq, "worker")
    assert event.payload["restart"] == row.id and event.payload["by"] == "agent"
    # The supervisor hooks this signal: it restarts once the turn has ended.
    assert signals == [
        ("committed", {"session": sid, "seq": row.request_seq, "event_type": "restart_requested"})
    ]

    # The same call made again (a continued turn) asks for nothing new, and signals nothing.
    again = call(turn(store, sid, signals=signals), {"reason": "testing the new build"})
    assert (again.content, again.is_error) == (outcome.content, False)
    assert len(store.restarts.list()) == 1 and len(signals) == 1


def test_while_one_is_live_another_session_gets_it_as_the_answer(store: Store) -> None:
    first, second = session(store), session(store)
    assert not call(turn(store, first), {"reason": "upgrade"}).is_error
    (live,) = store.restarts.list()
    signals: list[Any] = []
    ctx = turn(store, second, signals=signals)
    outcome = call(ctx, {"reason": "me too"}, "c2")
    assert not outcome.is_error, outcome.content
    assert outcome.content.startswith(f"no second restart requested: restart {live.id} is ")
    assert "already in progress, asked for by agent (reason: upgrade)" in outcome.content
    assert "the daemon restarts shortly" in outcome.content
    assert asyncio.run(ctx.request_restart("me too")) == live.id
    assert store.restarts.list() == [live] and signals == []
    assert types(store, second) == ["tool_call", "tool_result"]


def test_within_min_interval_of_the_last_the_model_reads_how_long_to_wait(store: Store) -> None:
    sid = session(store)
    ctx = turn(store, sid)
    assert not call(ctx, {"reason": "one"}).is_error
    (first,) = store.restarts.list()
    settle(store, first.id)
    refused = call(ctx, {"reason": "two"}, "c2")
    assert refused.is_error and refused.content.startswith("no restart requested: ")
    assert f"({first.id}); restart.min_interval is 60 s: try again in " in refused.content
    with pytest.raises(RestartRefused, match=r"try again in \d+"):
        asyncio.run(ctx.request_restart("two"))
    assert len(store.restarts.list()) == 1
    # Long enough ago: a new request is made.
    store.db.execute_sql(
        "UPDATE restart_request SET requested_at = requested_at - 61 WHERE id = ?", (first.id,)
    )
    again = call(ctx, {"reason": "two"}, "c3")
    assert not again.is_error, again.content
    assert [r.reason for r in store.restarts.list()] == ["two", "one"]


@pytest.mark.parametrize("arguments", [{}, {"reason": 5}, {"reason": ["x"]}, {"reason": None}])
def test_a_reason_that_is_not_a_string_is_an_error_the_model_reads(
    store: Store, arguments: dict[str, Any]
) -> None:
    sid = session(store)
    outcome = call(turn(store, sid), arguments)
    assert outcome.is_error and outcome.content.startswith("no restart requested: ")
    assert "reason must be a string" in outcome.content
    assert store.restarts.list() == []
    assert types(store, sid) == ["tool_call", "tool_result"]


def test_a_turn_fenced_out_asks_for_nothing(store: Store) -> None:
    sid = session(store)
    signals: list[Any] = []
    with pytest.raises(LeaseLost):
        call(turn(store, sid, signals=signals, token=TOKEN + 1), {"reason": "x"})
    with pytest.raises(LeaseLost):
        asyncio.run(turn(store, sid, token=TOKEN + 1).request_restart("x"))
    assert signals == [] and store.restarts.list() == []


def test_a_continued_turn_gets_the_requests_it_made_before(store: Store) -> None:
    """A continuation runs the agent from the top: its request, with the same reason in
    the same place, is the one it made before the crash, even once that one is done; so
    is the tool call made again with its id."""
    sid = session(store)
    one = asyncio.run(turn(store, sid).request_restart("upgrade"))
    assert call(turn(store, sid), {"reason": "upgrade"}, "c1").content.startswith(
        f"no second restart requested: restart {one} "
    )  # another request meanwhile: the live one is its answer
    settle(store, one)
    continued = turn(store, sid)  # the same turn id, run again
    assert asyncio.run(continued.request_restart("upgrade")) == one
    with pytest.raises(RestartRefused, match=r"restart\.min_interval"):  # a new one: too soon
        asyncio.run(continued.request_restart("something else"))
    assert [r.id for r in store.restarts.list()] == [one]


def test_a_later_turn_asking_with_the_same_words_makes_a_new_request(store: Store) -> None:
    """Keys repeat across turns (the n-th `turn.request_restart` with the same reason; a
    model's call ids): only the same turn's call gets the request it made."""
    sid = session(store)
    first = asyncio.run(turn(store, sid, turn_id="t1").request_restart("upgrade"))
    assert not call(turn(store, sid, turn_id="t1"), {"reason": "upgrade"}, "c1").is_error
    settle(store, first)
    rows = store.restarts.list()
    store.db.execute_sql("UPDATE restart_request SET requested_at = requested_at - 120")
    second = asyncio.run(turn(store, sid, turn_id="t2").request_restart("upgrade"))
    assert second != first
    settle(store, second)
    store.db.execute_sql("UPDATE restart_request SET requested_at = requested_at - 120")
    third = call(turn(store, sid, turn_id="t3"), {"reason": "upgrade"}, "c1")
    assert not third.is_error and "already" not in third.content, third.content
    assert len(store.restarts.list()) == len(rows) + 2


def test_a_repeated_call_of_a_done_request_says_it_is_over(store: Store) -> None:
    sid = session(store)
    assert not call(turn(store, sid), {"reason": "upgrade"}).is_error
    (row,) = store.restarts.list()
    settle(store, row.id)
    again = call(turn(store, sid), {"reason": "upgrade"})
    assert not again.is_error
    assert again.content.startswith(f"restart {row.id} (reason: upgrade) was requested by this")
    assert len(store.restarts.list()) == 1


def test_a_request_call_cut_before_its_result_is_repaired_with_what_it_did(
    store: Store,
) -> None:
    """The request is committed whole inside the call: the repair says it was requested,
    not that the call may or may not have taken effect. A call that asked for nothing is
    repaired as interrupted."""
    sid = session(store)
    calls = [
        {"id": "c9", "name": TOOL, "arguments": {"reason": "upgrade"}},
        {"id": "c8", "name": TOOL, "arguments": {"reason": "upgrade"}},
    ]
    store.events.append(sid, "model_response", {"text": "", "tool_calls": calls}, token=TOKEN)
    store.events.append(sid, "tool_call", {"call_id": "c9", "name": TOOL}, token=TOKEN)
    admitted = store.restarts.request(
        host=HOST, boot="b", pid=1, by="agent", reason="upgrade", drain=None, version="v",
        config="c", min_interval=60, session=sid, token=TOKEN, turn_id=None, call_id="c9",
    )  # fmt: skip
    store.events.append(sid, "tool_call", {"call_id": "c8", "name": TOOL}, token=TOKEN)
    done, cut = history.missing_results(store.events.read(sid))
    assert done.payload()["is_error"] is False
    assert done.payload()["content"] == requested(admitted.info.id, "upgrade")
    assert cut.payload()["is_error"] is True
    assert cut.payload()["content"] == history.INTERRUPTED_RESULT


def test_the_echo_model_asks_through_the_tool(store: Store) -> None:
    sid = session(store)
    ctx = turn(store, sid, text="/restart testing")
    assert asyncio.run(ToolLoopAgent().run_turn(ctx)) == "completed"
    calls = [e.payload for e in store.events.read(sid) if e.type == EventType.TOOL_CALL]
    assert [(c["name"], c["arguments"]) for c in calls] == [(TOOL, {"reason": "testing"})]
    (row,) = store.restarts.list()
    assert (row.reason, row.session, row.call_id) == ("testing", sid, calls[0]["call_id"])
    answer = [e for e in store.events.read(sid) if e.type == EventType.MODEL_RESPONSE][-1]
    assert answer.payload["text"] == f"echo: {requested(row.id, 'testing')}"

    off = turn(store, session(store), RestartScope(), text="/restart testing")
    asyncio.run(ToolLoopAgent().run_turn(off))
    said = off.messages[-1].content
    assert said.startswith("echo: no restart requested: agents may not ask for a restart")
