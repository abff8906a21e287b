"""Edges of the subagent registry on SQLite, PostgreSQL and MariaDB: a child with children
of its own, answers and ids a model made up, a tool call id reused by another turn, the
claims of a daemon that holds more rows than one pass takes, and a parent's cancellation
of a child that had finished unreported."""

from __future__ import annotations

import uuid

import pytest

from supervisor.core.vocabulary import SubagentStatus
from supervisor.store import Store
from tests.conftest import BACKENDS
from tests.subagents.test_subagents_store import Turn, events, statuses, top

pytestmark = pytest.mark.parametrize("db_url", BACKENDS, indirect=True)


def next_turn(turn: Turn) -> Turn:
    """The session's next turn, on the lease it holds."""
    turn.id = uuid.uuid4().hex
    turn.append("turn_started", {})
    return turn


def test_a_child_waits_for_its_own_children_before_it_is_reported(store: Store) -> None:
    parent = top(store)
    child = Turn(store, parent.spawn("delegate").child.id)
    grandchild = child.spawn("the real work").child.id
    child.end("started a helper")
    assert store.subagents.report(child.session_id) is None  # its helper is still running
    assert statuses(store, child.session_id) == [SubagentStatus.RUNNING]
    worker = Turn(store, grandchild)
    worker.end("42")
    done = store.subagents.report(grandchild)
    assert done is not None and done.parent == child.session_id
    assert store.sessions.get(child.session_id).pending  # the child reads the result next
    again = next_turn(child)
    again.end("the helper says 42")
    reported = store.subagents.report(child.session_id)
    assert reported is not None and reported.status is SubagentStatus.COMPLETED
    (result,) = events(store, parent.session_id, "subagent_result")
    assert result.payload["text"] == "the helper says 42"


def test_a_child_given_up_on_takes_its_running_children_with_it(store: Store) -> None:
    parent = top(store)
    child = Turn(store, parent.spawn("delegate").child.id)
    grandchild = child.spawn("long work").child.id
    info = store.sessions.get(child.session_id)
    assert info.active_turn_id is not None
    done = store.subagents.finalize(
        child.session_id, info.active_turn_id, SubagentStatus.FINALIZED, "stale", "too old"
    )
    assert done is not None and done.cancelled == (grandchild,)  # its worker is told to stop
    assert statuses(store, child.session_id, grandchild) == ["finalized", "cancelled"]
    assert len(events(store, child.session_id, "subagent_result")) == 1
    assert store.sessions.get(grandchild).status == "closed"


def test_what_a_model_makes_up_is_stored_or_refused_cleanly(store: Store) -> None:
    parent = top(store)
    with pytest.raises(ValueError, match="NUL"):
        parent.spawn("a\x00b")
    odd = "c\x00" + "x" * 500
    first = parent.spawn("task", call_id=odd, title="t\x00itle")
    assert first.child.title == "title" and len(first.child.call_id or "") <= 200
    assert parent.spawn("task", call_id=odd).child.id == first.child.id  # same call, same child
    child = Turn(store, first.child.id)
    child.end("an answer with a NUL \x00 in it")
    done = store.subagents.report(first.child.id)
    assert done is not None and done.status is SubagentStatus.COMPLETED
    info = store.subagents.get(first.child.id)
    assert info is not None and "\x00" not in info.summary


def test_a_call_id_reused_by_a_later_turn_starts_a_new_child(store: Store) -> None:
    parent = top(store)
    first = parent.spawn("one", call_id="call_0").child.id
    parent.end()
    later = next_turn(parent)
    second = later.spawn("two", call_id="call_0")
    assert second.new and second.child.id != first


def test_a_daemon_holding_more_rows_than_a_pass_takes_gets_them_all(store: Store) -> None:
    parent = top(store)
    ids = {parent.spawn(f"t{n}").child.id for n in range(3)}
    assert len(store.subagents.claim("host-a/boot-1", 30.0, limit=2)) == 2
    held = store.subagents.claim("host-a/boot-1", 30.0, limit=2)
    assert {row.id for row in held} == ids
    assert store.subagents.claim("host-b/boot-9", 30.0, limit=2) == []


def test_a_child_that_had_finished_unreported_keeps_its_answer_on_cancel(store: Store) -> None:
    parent = top(store)
    done_child = Turn(store, parent.spawn("quick").child.id)
    done_child.end("finished")
    busy = parent.spawn("slow").child.id
    store.sessions.interrupt(parent.session_id, "alice")
    results = {
        e.payload["subagent"]: e.payload
        for e in events(store, parent.session_id)
        if e.type == "subagent_result"
    }
    assert results[done_child.session_id]["status"] == "completed"
    assert results[done_child.session_id]["text"] == "finished"
    assert results[busy]["status"] == "cancelled"
    assert not store.sessions.get(parent.session_id).pending
