"""Subagents with the daemon as a real process (issue 16): a child survives its
supervisor's or its worker's death and a clean stop, and its parent hears of it once;
a child too old is finalized, one that kills its worker every time is wedged, the limits
hold, and a parent's interrupt cancels its children."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest

from supervisor.store import EventRecord, Store, SubagentInfo
from tests.daemon import Daemon, daemons, events, inject, turn_ended, wait_until

__all__ = ["daemons"]  # the fixture

Daemons = Callable[..., Daemon]
pytestmark = pytest.mark.timeout(240)

SPAWNER = "tests.agents_spawner:Agent"
KILLER = "tests.agents_killer:Agent"
# Short attempt delays and a quick reconciler: tests wait for seconds, not minutes.
FAST = {"recovery": {"attempt_delays": [0.0, 0.2, 0.5]}, "subagents": {"reconcile_interval": 1.0}}


def of(store: Store, session_id: str, kind: str) -> list[EventRecord]:
    return [e for e in events(store, session_id) if e.type == kind]


def children(store: Store, parent: str) -> list[SubagentInfo]:
    return store.subagents.children(parent)


def row(store: Store, child: str) -> SubagentInfo:
    """The child's registry row, which must exist."""
    found = store.subagents.get(child)
    assert found is not None, child
    return found


def spawned(store: Store, text: str, count: int) -> tuple[str, list[str]]:
    """A parent whose message `text` starts `count` children, all with a turn in flight
    (and the parent's own turn over): the parent's id and the children's."""
    parent = store.sessions.create("admin").id
    seq = inject(store, parent, text)
    wait_until(lambda: turn_ended(store, parent, seq), 30, "the parent's spawning turn")

    def in_flight() -> list[str] | None:
        found = children(store, parent)
        rows = [store.sessions.get(c.id) for c in found]
        busy = len(found) == count and all(r.active_turn_id and r.owner for r in rows)
        return [c.id for c in found] if busy else None

    return parent, wait_until(in_flight, 30, f"{count} children with a turn in flight")


def settled(store: Store, parent: str, count: int) -> list[EventRecord] | None:
    """The parent's `count` results, once a completed turn has answered the last of them
    and nothing is left to run; None before."""
    results = of(store, parent, "subagent_result")
    if len(results) < count:
        return None
    info = store.sessions.get(parent)
    ended = [e for e in of(store, parent, "turn_ended") if e.seq > results[-1].seq]
    done = ended and ended[-1].payload["outcome"] == "completed"
    return results if done and not info.pending and info.active_turn_id is None else None


def assert_all_completed(store: Store, parent: str, kids: list[str], tasks: list[str]) -> None:
    """Each child did its own task once, after an interruption, and was reported once."""
    results = wait_until(lambda: settled(store, parent, len(kids)), 60, "the parent's answer")
    time.sleep(1.0)  # a duplicate result would land now
    results = of(store, parent, "subagent_result")
    assert sorted(r.payload["subagent"] for r in results) == sorted(kids)
    assert {r.payload["status"] for r in results} == {"completed"}
    by_child = {r.payload["subagent"]: r for r in results}
    for child, task in zip(kids, tasks, strict=True):
        found = events(store, child)
        users = [e.payload["text"] for e in found if e.type == "user_message"]
        replies = [e.payload["text"] for e in found if e.type == "model_response"]
        assert users == [task], found
        assert replies[-1] == "echo: " + task.rsplit(" ", 1)[1], found
        assert "continuation" in [e.type for e in found], "the child was not interrupted"
        assert by_child[child].payload["text"] == replies[-1]
        done = row(store, child)
        assert (done.status, done.result_seq) == ("completed", by_child[child].seq)
        assert store.sessions.get(child).status == "closed"
    answer = of(store, parent, "model_response")[-1].payload["text"]
    assert answer.startswith("echo: [subagent ") and " completed] echo: " in answer


@pytest.mark.slow
@pytest.mark.parametrize("death", ["supervisor", "workers", "stop"])
def test_children_in_flight_survive_and_their_parent_hears_of_each_once(
    daemons: Daemons, death: str
) -> None:
    daemon = daemons(shutdown={"subagent_drain": 1.0}, **FAST).start()
    tasks = ["/sleep 6 a", "/sleep 6 b", "/sleep 6 c"]
    with Store(daemon.url, migrate=False) as store:
        text = "\n".join(f"/subagent {task}" for task in tasks)
        parent, kids = spawned(store, text, 3)
        by_task = {row(store, k).task: k for k in kids}
        kids = [by_task[task] for task in tasks]
        if death == "supervisor":  # its workers die with it (parent-death signal)
            daemon.signal(signal.SIGKILL)
            daemon.wait(10)
            daemon.start()
        elif death == "workers":
            owners = {daemon.owner_pid(store, kid) for kid in kids}
            for pid in owners:
                assert pid is not None, "a child's worker is not in the pool"
                os.kill(pid, signal.SIGKILL)
        else:
            daemon.signal(signal.SIGTERM)
            assert daemon.wait(30) == 0
            log = daemon.log().split(f"--- run {daemon.runs} ---")[-1]
            drained = [line for line in log.splitlines() if "subagent drain" in line]
            for kid in kids:  # the stop named each child it left running
                assert any(kid in line for line in drained), log
            assert {row(store, k).status for k in kids} == {"running"}
            daemon.start()
        assert_all_completed(store, parent, kids, tasks)
        assert daemon.proc is not None and daemon.proc.poll() is None
        assert daemon.runs == (1 if death == "workers" else 2)
        assert store.subagents.counts()["completed"] == 3
        assert store.subagents.counts()["running"] == 0


def test_a_child_interrupted_longer_ago_than_freshness_is_finalized(daemons: Daemons) -> None:
    daemon = daemons(subagents={"freshness": 2.0, "reconcile_interval": 1.0}).start()
    with Store(daemon.url, migrate=False) as store:
        parent, (kid,) = spawned(store, "/subagent /sleep 60 x", 1)
        daemon.signal(signal.SIGKILL)
        daemon.wait(10)
        time.sleep(3.0)  # the wall clock moves past subagents.freshness: that is the point
        daemon.start()
        results = wait_until(lambda: settled(store, parent, 1), 60, "the parent's answer")
        time.sleep(1.0)
        assert of(store, parent, "subagent_result") == results
        assert [r.payload["subagent"] for r in results] == [kid]
        assert results[0].payload["status"] == "finalized"
        done = row(store, kid)
        assert (done.status, done.result_seq) == ("finalized", results[0].seq)
        found = events(store, kid)
        assert [e.type for e in found[-2:]] == ["notice", "turn_ended"], found
        assert "subagents.freshness" in found[-2].payload["text"]
        assert found[-1].payload == {"outcome": "failed", "reason": "stale"}
        assert "continuation" not in [e.type for e in found]
        assert [e.type for e in found].count("turn_started") == 1
        assert store.sessions.get(kid).status == "closed"


@pytest.mark.slow
def test_a_child_that_kills_its_worker_every_time_is_wedged(daemons: Daemons) -> None:
    daemon = daemons(
        agent={"allowed": [SPAWNER, KILLER]},
        subagents={"max_recoveries": 3, "reconcile_interval": 1.0},
        recovery={"attempt_delays": [0.0, 0.2, 0.5]},
    ).start()
    with Store(daemon.url, migrate=False) as store, daemon.client() as client:
        parent = client.post("/v1/sessions", json={"agent": SPAWNER}).json()["id"]
        healthy = client.post("/v1/sessions", json={}).json()["id"]
        inject(store, parent, f"/spawn {KILLER} hello")
        kid = wait_until(lambda: children(store, parent), 30, "the child")[0].id
        assert row(store, kid).agent == KILLER
        wait_until(lambda: daemon.status()["worker_restarts"] >= 1, 30, "the first death")
        asked = inject(store, healthy, "still here")
        results = wait_until(lambda: settled(store, parent, 1), 120, "the parent's answer")
        answered = wait_until(lambda: turn_ended(store, healthy, asked), 60, "the healthy answer")
        assert answered.payload["outcome"] == "completed"
        assert of(store, healthy, "model_response")[-1].payload["text"] == "echo: still here"
        before = (events(store, kid), daemon.status()["worker_restarts"])
        time.sleep(4.0)  # a child run again would kill another worker and write events
        assert (events(store, kid), daemon.status()["worker_restarts"]) == before
        assert of(store, parent, "subagent_result") == results
        assert [r.payload["subagent"] for r in results] == [kid]
        assert results[0].payload["status"] == "wedged"
        assert "wedged" in results[0].payload["text"]
        done = row(store, kid)
        assert (done.status, done.result_seq) == ("wedged", results[0].seq)
        assert store.sessions.get(kid).status == "closed"
        found = events(store, kid)
        assert [e.type for e in found].count("turn_started") == 1
        assert found[-1].type == "turn_ended" and found[-1].payload["reason"] == "wedged"
        assert before[1] == 4  # the turn's own run and its 3 attempts, each a dead worker
        reply = of(store, parent, "model_response")[-1].payload["text"]
        assert reply.startswith(f"echo: [subagent {kid} (hello) wedged]")


def test_max_children_and_max_depth_refuse_a_spawn_the_model_reads(daemons: Daemons) -> None:
    daemon = daemons(subagents={"max_children": 2, "max_depth": 1}).start()
    with Store(daemon.url, migrate=False) as store:
        text = "/subagent /sleep 60 a\n/subagent /sleep 60 b\n/subagent /sleep 60 c"
        parent, _ = spawned(store, text, 2)
        found = of(store, parent, "tool_result")
        assert [r.payload["is_error"] for r in found] == [False, False, True], found
        assert "max_children" in found[2].payload["content"]
        assert len(of(store, parent, "subagent_spawned")) == 2
        assert sorted(c.task for c in children(store, parent)) == ["/sleep 60 a", "/sleep 60 b"]
        # A child at depth 1 may start no grandchild: its model reads why.
        deep = store.sessions.create("admin").id
        inject(store, deep, "/subagent /subagent /sleep 0 x")
        wait_until(lambda: settled(store, deep, 1), 30, "the child's result")
        (kid,) = children(store, deep)
        refused = of(store, kid.id, "tool_result")
        assert len(refused) == 1 and refused[0].payload["is_error"] is True, refused
        assert "max_depth" in refused[0].payload["content"]
        assert of(store, kid.id, "subagent_spawned") == []
        assert children(store, kid.id) == []
        assert row(store, kid.id).status == "completed"
        assert sum(store.subagents.counts().values()) == 3  # a, b and the deep one alone


def stopped_its_turn(line: str) -> bool:
    """A worker's line that it stopped a session's turn: a step cancelled, or a model
    call cut whose cut answer the interrupt's own `turn_ended` had already fenced out."""
    return "turn cancelled" in line or "interrupted: the turn was ended" in line


def test_interrupting_a_parent_cancels_its_children_and_stops_their_workers(
    daemons: Daemons,
) -> None:
    daemon = daemons().start()
    with Store(daemon.url, migrate=False) as store, daemon.client() as client:
        parent, kids = spawned(store, "/subagent /sleep 60 x\n/subagent /sleep 60 y", 2)
        turns = len(of(store, parent, "turn_started"))
        answer = client.post(f"/v1/sessions/{parent}/interrupt")
        assert answer.status_code == 200, answer.text
        for kid in kids:
            assert row(store, kid).status == "cancelled"
            ended = of(store, kid, "turn_ended")
            assert [e.payload["outcome"] for e in ended] == ["interrupted_by_operator"]
        before = {kid: events(store, kid) for kid in kids}
        wait_until(
            lambda: all(
                any(kid in line and stopped_its_turn(line) for line in daemon.log().splitlines())
                for kid in kids
            ),
            10,
            "each child's worker to stop its turn",
        )
        time.sleep(3.0)  # a result would wake the parent now; a child's events would land
        assert {kid: events(store, kid) for kid in kids} == before
        results = of(store, parent, "subagent_result")
        assert sorted(r.payload["subagent"] for r in results) == sorted(kids)
        assert {r.payload["status"] for r in results} == {"cancelled"}
        assert len(of(store, parent, "turn_started")) == turns
        info = store.sessions.get(parent)
        assert not info.pending and info.active_turn_id is None
