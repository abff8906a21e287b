"""The subagent registry on SQLite, PostgreSQL and MariaDB: a spawn written whole or not at
all, the limits, one result per child, cancellation down the tree, recovery's finalize
judged on the turn and token it read, the reconcilers' claims, and the counts."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest

from supervisor.core.vocabulary import SubagentStatus
from supervisor.metrics import Metrics
from supervisor.store import LeaseLost, Spawned, Store, TooManySessions
from supervisor.subagents.rules import Refused
from tests.conftest import BACKENDS
from tests.support import stored_events as events

pytestmark = pytest.mark.parametrize("db_url", BACKENDS, indirect=True)

TTL = 30.0
LIMITS: dict[str, Any] = {"max_depth": 2, "max_children": 8}


class Turn:
    """A session's turn in flight on a lease, as a worker holds it."""

    def __init__(self, store: Store, session_id: str) -> None:
        self.store, self.session_id = store, session_id
        lease = store.leases.acquire(session_id, f"host-a/boot-1/w{uuid.uuid4().hex[:6]}", TTL)
        assert lease is not None
        self.token, self.id = lease.token, uuid.uuid4().hex
        self.append("turn_started", {})

    def append(self, type: str, payload: dict[str, Any]) -> int:
        return self.store.events.append(
            self.session_id, type, payload, token=self.token, turn_id=self.id, writer="worker"
        )

    def spawn(self, task: str, **options: Any) -> Spawned:
        return self.store.subagents.spawn(
            self.session_id, task, token=self.token, turn_id=self.id, **{**LIMITS, **options}
        )

    def end(self, answer: str = "done", outcome: str = "completed") -> None:
        self.append("model_response", {"text": answer})
        self.append("turn_ended", {"outcome": outcome})


def statuses(store: Store, *ids: str) -> list[str]:
    return [info.status for info in map(store.subagents.get, ids) if info is not None]


def top(store: Store) -> Turn:
    return Turn(store, store.sessions.create("alice", agent="helper").id)


def test_a_spawn_writes_the_parents_event_the_child_its_task_and_the_row(store: Store) -> None:
    parent = top(store)
    store.acl.grant(parent.session_id, "bob", "read")
    spawned = parent.spawn("count   the\nfiles", call_id="call-1")
    child = spawned.child
    assert spawned.new and (child.parent, child.depth, child.status) == (
        parent.session_id,
        1,
        "running",
    )
    assert child.title == "count the files" and child.agent == "helper"
    [event] = events(store, parent.session_id, "subagent_spawned")
    assert (event.seq, event.turn_id) == (spawned.spawned_seq, parent.id)
    assert event.payload == {
        "subagent": child.id,
        "task": "count   the\nfiles",
        "title": "count the files",
        "agent": "helper",
        "depth": 1,
        "call_id": "call-1",
    }
    session = store.sessions.get(child.id)
    assert (session.kind, session.parent, session.pending) == ("subagent", parent.session_id, True)
    assert session.active_turn_id is None and session.agent == "helper"
    [task] = events(store, child.id)
    assert (task.seq, task.type) == (spawned.task_seq, "user_message")
    assert task.payload == {"text": "count   the\nfiles", "subagent_of": parent.session_id}
    assert store.acl.entries(child.id) == {"alice": "admin", "bob": "read"}
    assert store.subagents.get(child.id) == child
    assert store.subagents.children(parent.session_id) == [child]
    assert store.subagents.running() == [child]
    assert child.to_dict()["result"] is None and child.to_dict()["id"] == child.id
    assert not store.sessions.get(parent.session_id).pending  # a spawn is no input


def test_a_spawn_on_a_stale_token_or_past_a_limit_writes_nothing(store: Store) -> None:
    parent = top(store)
    before = store.sessions.get(parent.session_id).last_seq
    taken = store.leases.acquire(parent.session_id, "host-b/boot-2/w0.1", TTL, force=True)
    assert taken is not None and taken.token > parent.token
    with pytest.raises(LeaseLost):
        parent.spawn("a task")
    parent.token = taken.token
    with pytest.raises(Refused, match="turned off"):
        parent.spawn("a task", max_depth=0)
    with pytest.raises(ValueError, match="non-empty"):
        parent.spawn("  ")
    assert store.sessions.get(parent.session_id).last_seq == before
    assert [s.kind for s in store.sessions.list()] == ["attached"]
    assert store.subagents.children(parent.session_id) == []
    assert set(store.subagents.counts().values()) == {0}


def test_depth_and_running_children_are_limited(store: Store) -> None:
    parent = top(store)
    child = Turn(store, parent.spawn("one").child.id)
    grandchild = Turn(store, child.spawn("two").child.id)
    assert store.subagents.get(grandchild.session_id).depth == 2  # type: ignore[union-attr]
    with pytest.raises(Refused, match=r"at subagent depth 2; subagents\.max_depth is 2"):
        grandchild.spawn("three")
    assert grandchild.spawn("three", max_depth=3).child.depth == 3
    # Running children count, finished ones do not.
    with pytest.raises(Refused, match=r"has 1 subagents running, the limit .* is 1"):
        parent.spawn("another", max_children=1)
    store.sessions.close(child.session_id, "alice")  # its run is over: cancelled
    assert store.subagents.report(child.session_id) is not None
    assert parent.spawn("another", max_children=1).new
    # A parent that is not open starts none, even on its current lease.
    store.sessions.quarantine(parent.session_id, "test")
    parent = Turn(store, parent.session_id)
    with pytest.raises(Refused, match="this session is quarantined"):
        parent.spawn("more")


def test_the_same_tool_call_gets_its_first_child_back(store: Store) -> None:
    parent = top(store)
    first = parent.spawn("look up the weather", call_id="call-1")
    # Again after a crash, past the limit now: the call's child, no second one.
    again = parent.spawn("look up the weather", call_id="call-1", max_children=1)
    assert not again.new and again.child == first.child and again.spawned_seq == first.spawned_seq
    other = parent.spawn("look up the weather", call_id="call-2")
    assert other.new and other.child.id != first.child.id
    assert len(events(store, parent.session_id, "subagent_spawned")) == 2


def test_a_child_is_reported_once_when_its_run_is_over(store: Store) -> None:
    parent = top(store)
    child_id = parent.spawn("count the files", title="files").child.id
    assert store.subagents.report(child_id) is None  # its task is pending
    child = Turn(store, child_id)
    assert store.subagents.report(child_id) is None  # its turn is in flight
    child.end("42 files")
    reported = store.subagents.report(child_id)
    assert reported is not None
    assert (reported.child, reported.parent, reported.status, reported.woke) == (
        child_id,
        parent.session_id,
        SubagentStatus.COMPLETED,
        True,
    )
    assert store.subagents.report(child_id) is None
    [result] = events(store, parent.session_id, "subagent_result")
    assert result.seq == reported.seq
    assert result.payload == {
        "subagent": child_id,
        "status": "completed",
        "text": "42 files",
        "title": "files",
        "task": "count the files",
    }
    assert store.sessions.get(parent.session_id).pending  # its next turn reads the result
    info = store.subagents.get(child_id)
    assert info is not None and (info.status, info.result_seq, info.summary) == (
        "completed",
        reported.seq,
        "42 files",
    )
    assert info.ended_at is not None and info.to_dict()["result"] == "42 files"
    session = store.sessions.get(child_id)
    assert (session.status, session.pending, session.owner) == ("closed", False, None)
    with pytest.raises(LeaseLost):  # its worker writes nothing more
        child.append("model_response", {"text": "late"})


def test_interrupting_a_parent_cancels_children_and_grandchildren_once(store: Store) -> None:
    parent = top(store)
    busy = Turn(store, parent.spawn("busy").child.id)
    grandchild = busy.spawn("deeper").child.id
    waiting = parent.spawn("waiting").child.id
    assert set(store.subagents.descendants(parent.session_id)) == {
        busy.session_id,
        waiting,
        grandchild,
    }
    assert store.sessions.interrupt(parent.session_id, "alice")
    assert statuses(store, busy.session_id, waiting, grandchild) == ["cancelled"] * 3
    results = events(store, parent.session_id, "subagent_result")
    assert sorted(e.payload["subagent"] for e in results) == sorted([busy.session_id, waiting])
    assert {e.payload["status"] for e in results} == {"cancelled"}
    assert "interrupted by alice" in results[0].payload["text"]
    [deeper] = events(store, busy.session_id, "subagent_result")
    assert (deeper.payload["subagent"], deeper.payload["status"]) == (grandchild, "cancelled")
    [ended] = events(store, busy.session_id, "turn_ended")
    assert ended.payload["outcome"] == "interrupted_by_operator"
    for sid in (busy.session_id, waiting, grandchild):
        assert store.sessions.get(sid).status == "closed"
    parent_now = store.sessions.get(parent.session_id)
    assert not parent_now.pending and parent_now.active_turn_id is None  # not woken
    # Once only: another interrupt, a close or a report adds no result.
    store.sessions.interrupt(parent.session_id, "alice")
    store.sessions.close(parent.session_id, "alice")
    assert store.subagents.report(busy.session_id) is None
    assert len(events(store, parent.session_id, "subagent_result")) == 2


def test_closing_a_parent_cancels_its_children(store: Store) -> None:
    parent = top(store)
    child = parent.spawn("work").child.id
    parent.end()
    assert store.sessions.close(parent.session_id, "bob")
    assert statuses(store, child) == ["cancelled"]
    [result] = events(store, parent.session_id, "subagent_result")
    assert result.payload["status"] == "cancelled" and "closed by bob" in result.payload["text"]
    closed = store.sessions.get(parent.session_id)
    assert (closed.status, closed.pending) == ("closed", False)


def test_finalize_acts_only_on_the_turn_and_token_it_was_judged_on(store: Store) -> None:
    parent = top(store)
    child = Turn(store, parent.spawn("slow").child.id)
    seen = store.sessions.get(child.session_id).last_seq
    finalize = store.subagents.finalize
    assert (
        finalize(child.session_id, "another-turn", SubagentStatus.FINALIZED, "stale", "x") is None
    )
    stale_token = child.token - 1
    args = (child.session_id, child.id, SubagentStatus.FINALIZED, "stale", "x")
    assert finalize(*args, token=stale_token) is None
    assert store.sessions.get(child.session_id).last_seq == seen
    assert statuses(store, child.session_id) == ["running"]
    reported = finalize(
        child.session_id, child.id, SubagentStatus.FINALIZED, "stale", "too old", token=child.token
    )
    assert reported is not None and reported.status is SubagentStatus.FINALIZED and reported.woke
    notice, ended = events(store, child.session_id)[-2:]
    assert (notice.type, notice.payload) == ("notice", {"text": "too old", "reason": "stale"})
    assert (ended.type, ended.turn_id, ended.payload["outcome"]) == (
        "turn_ended",
        child.id,
        "failed",
    )
    [result] = events(store, parent.session_id, "subagent_result")
    assert (result.payload["status"], result.payload["text"]) == ("finalized", "too old")
    assert store.sessions.get(parent.session_id).pending
    assert finalize(*args, token=child.token) is None  # reported already


def test_claims_are_exclusive_until_they_run_out_or_are_released(store: Store) -> None:
    parent = top(store)
    ids = {parent.spawn(f"task {n}").child.id for n in range(3)}
    claim = store.subagents.claim
    assert {c.id for c in claim("host-a/boot1", TTL)} == ids
    assert claim("host-b/boot2", TTL) == []
    assert {c.id for c in claim("host-a/boot1", TTL)} == ids  # its own, renewed
    assert store.subagents.release_claims("host-a/boot1") == 3
    assert {c.id for c in claim("host-b/boot2", -1.0)} == ids  # a claim that ran out
    assert {c.id for c in claim("host-c/boot3", TTL)} == ids
    # A reported child is nobody's to reconcile.
    done = Turn(store, sorted(ids)[0])
    done.end()
    assert store.subagents.report(done.session_id) is not None
    assert store.subagents.release_claims("host-c/boot3") == 2
    assert {c.id for c in claim("host-a/boot1", TTL)} == ids - {done.session_id}
    # A later boot of the same host takes its earlier boots' claims (they are dead).
    assert claim("host-a/boot4", TTL) == []
    assert {c.id for c in claim("host-a/boot4", TTL, mine="host-a/")} == ids - {done.session_id}
    assert claim("host-b/boot2", TTL, mine="host-b/") == []


def test_owners_claiming_at_once_never_get_the_same_row(store: Store) -> None:
    # Threads on one Store: each thread has a connection, and a transaction, of its own
    # (the models are bound to one database per process, so not a Store each).
    parent = top(store)
    ids = {parent.spawn(f"task {n}", max_children=40).child.id for n in range(24)}
    owners = [f"host-{n}/boot{n}" for n in range(4)]
    for _ in range(3):
        claimed: dict[str, set[str]] = {}
        start = threading.Barrier(len(owners))

        def claim(owner: str, start: threading.Barrier, claimed: dict[str, set[str]]) -> None:
            start.wait()
            claimed[owner] = {c.id for c in store.subagents.claim(owner, TTL, limit=9)}

        threads = [threading.Thread(target=claim, args=(owner, start, claimed)) for owner in owners]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert set(claimed) == set(owners), "a claim failed"
        every = [row for rows in claimed.values() for row in rows]
        assert len(every) == len(set(every)), f"a row claimed twice: {claimed}"
        assert set(every) == ids  # 4 x 9 is room enough for all 24
        for owner in owners:
            assert store.subagents.release_claims(owner) == len(claimed[owner])


def test_counts_by_status_and_their_metric(store: Store) -> None:
    assert store.subagents.counts() == {status.value: 0 for status in SubagentStatus}
    parent = top(store)
    done, cancelled, _running = (parent.spawn(f"task {n}").child.id for n in range(3))
    Turn(store, done).end()
    store.subagents.report(done)
    store.sessions.close(cancelled, "alice")
    store.subagents.report(cancelled)
    counts = store.subagents.counts()
    assert counts == {
        **{s.value: 0 for s in SubagentStatus},
        "running": 1,
        "completed": 1,
        "cancelled": 1,
    }
    metrics = Metrics()
    assert b"turnkeeper_subagents{" not in metrics.render()  # not set: no family
    metrics.state.subagents = store.subagents.counts
    metrics.subagent_recovery.labels("report").inc()
    text = metrics.render().decode()
    for status in SubagentStatus:
        assert f'turnkeeper_subagents{{status="{status}"}} {float(counts[status])}' in text
    assert 'turnkeeper_subagent_recovery_total{action="report"} 1.0' in text

    def busy() -> dict[str, int]:
        raise RuntimeError("database is locked")

    metrics.state.subagents = busy
    text = metrics.render().decode()
    assert "# TYPE turnkeeper_subagents gauge" in text and "turnkeeper_subagents{" not in text


def test_a_tree_is_bounded_at_every_depth_and_carries_its_root_and_principal(
    store: Store,
) -> None:
    root = top(store)
    child = Turn(store, root.spawn("a", max_per_root=2).child.id)
    grandchild = child.spawn("b", max_per_root=2).child
    assert store.subagents.get(grandchild.id) is not None
    assert store.sessions.get(grandchild.id).principal == "alice"  # the root's, not the ACL's
    # Two running in the tree: neither the root nor its child may add a third.
    for turn in (root, child):
        with pytest.raises(Refused, match=r"subagents\.max_total_per_root"):
            turn.spawn("c", max_per_root=2)
    child.spawn("c", max_per_root=3)  # a larger cap admits it


def test_a_principal_has_at_most_max_open_sessions(store: Store) -> None:
    first = store.sessions.create("carol", max_open=2)
    store.sessions.create("carol", max_open=2)
    with pytest.raises(TooManySessions, match=r"auth\.max_open_sessions_per_principal"):
        store.sessions.create("carol", max_open=2)
    store.sessions.create("dave", max_open=2)  # another principal has its own
    store.sessions.close(first.id, by="carol")
    store.sessions.create("carol", max_open=2)  # a closed one no longer counts
