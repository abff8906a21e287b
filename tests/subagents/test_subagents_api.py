"""Subagents as a client sees them: `GET /v1/sessions/{id}/subagents`, their ACL, the
interrupt and close of a parent cancelling them and stopping their workers, and the
command line (`turnkeeper subagents`, the tree of `turnkeeper sessions show`).

Children are spawned directly in the database, as a parent's turn would spawn them, while
a real daemon runs; it then runs them with the echo model. Their task `/sleep 30 ...`
holds each child's turn in flight, so a child is still running when the test acts.
The wiring of the routes to the pool is also checked in-process, with a pool that records.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp.test_utils import TestClient, TestServer

from supervisor.contract.config import Config
from supervisor.http import openapi
from supervisor.http.app import Api as App
from supervisor.http.attach import Hub
from supervisor.http.auth import Tokens, digest
from supervisor.metrics import Metrics
from supervisor.store import LeaseLost, Store, SubagentInfo
from tests.daemon import Daemon, daemons, events, turnkeeper, wait_until
from tests.http.test_api import Api, assert_error, create_session, start
from tests.support import RoutesPool

__all__ = ["daemons", "start"]  # the fixtures

HELD = "/sleep 30"  # a child's task prefix that keeps its turn in flight for 30 s
STOPPED_WITHIN = 10.0  # seconds for a cancelled child's worker to stop its turn (not 30)


def spawn(store: Store, parent_id: str, task: str, title: str = "") -> SubagentInfo:
    """A child of `parent_id`, spawned as the parent's turn would (with its lease token,
    read again if the daemon took the parent's lease in between)."""
    for _ in range(50):
        token = store.sessions.get(parent_id).lease_token
        try:
            spawned = store.subagents.spawn(
                parent_id, task, token=token, turn_id=None, max_depth=2, max_children=8, title=title
            )
        except LeaseLost:
            continue
        return spawned.child
    raise AssertionError(f"the lease of {parent_id} kept moving")


def running_turn(store: Store, session_id: str) -> bool:
    return store.sessions.get(session_id).active_turn_id is not None


def turns_in_flight(daemon: Daemon) -> int:
    return sum(int(slot.get("turns") or 0) for slot in daemon.status()["slots"])


def ids(answer: httpx.Response) -> list[str]:
    assert answer.status_code == 200, answer.text
    return [child["id"] for child in answer.json()["subagents"]]


def results(store: Store, session_id: str) -> list[dict[str, Any]]:
    """The payloads of the `subagent_result`s in the session's log."""
    return [e.payload for e in events(store, session_id) if e.type == "subagent_result"]


# --- a real daemon ----------------------------------------------------------------------


def test_a_session_lists_its_subagents_to_whoever_may_read_it(start: Callable[..., Api]) -> None:
    api = start()
    alice, bob, admin = api.client("alice"), api.client("bob"), api.client("admin")
    parent = create_session(alice, title="lead")
    with api.store() as store:
        first = spawn(store, parent, f"{HELD} first")
        second = spawn(store, parent, f"{HELD} second", title="the second")
        wait_until(lambda: running_turn(store, first.id), 30, "the first child's turn")
        grandchild = spawn(store, first.id, f"{HELD} grand")

    listed = alice.get(f"/v1/sessions/{parent}/subagents")
    assert ids(listed) == [first.id, second.id]  # oldest first; no grandchild
    one, two = listed.json()["subagents"]
    assert one == {
        "id": first.id,
        "parent": parent,
        "depth": 1,
        "task": f"{HELD} first",
        "title": f"{HELD} first",
        "agent": one["agent"],
        "status": "running",
        "created_at": one["created_at"],
        "ended_at": None,
        "result": None,
    }
    assert (two["title"], two["status"]) == ("the second", "running")
    assert ids(alice.get(f"/v1/sessions/{first.id}/subagents")) == [grandchild.id]
    assert alice.get(f"/v1/sessions/{grandchild.id}/subagents").json() == {"subagents": []}
    assert ids(alice.get(f"/v1/sessions/{parent}/subagents", params={"limit": 1})) == [first.id]
    assert_error(alice.get(f"/v1/sessions/{parent}/subagents?limit=0"), 422, "invalid")
    assert ids(admin.get(f"/v1/sessions/{parent}/subagents")) == [first.id, second.id]

    # bob may read none of them, and is told nothing about them...
    for path in (parent, first.id, grandchild.id):
        assert_error(bob.get(f"/v1/sessions/{path}/subagents"), 404, "not_found")
        assert_error(bob.get(f"/v1/sessions/{path}"), 404, "not_found")
    # ...until alice lets him read the parent: the children inherit the change.
    granted = alice.put(
        f"/v1/sessions/{parent}/acl", json={"principal": "bob", "permission": "read"}
    )
    assert granted.status_code == 200, granted.text
    assert ids(bob.get(f"/v1/sessions/{parent}/subagents")) == [first.id, second.id]
    assert ids(bob.get(f"/v1/sessions/{first.id}/subagents")) == [grandchild.id]
    for child in (first.id, second.id, grandchild.id):
        assert bob.get(f"/v1/sessions/{child}").json()["parent"] in (parent, first.id)
    assert_error(bob.post(f"/v1/sessions/{parent}/interrupt"), 403, "forbidden")

    document = api.client(None).get("/openapi.json").json()
    operation = document["paths"]["/v1/sessions/{id}/subagents"]["get"]
    assert operation["operationId"] == "listSubagents"


def test_interrupt_and_close_cancel_running_subagents_and_stop_their_workers(
    start: Callable[..., Api],
) -> None:
    api = start()
    alice = api.client("alice")
    interrupted, closed = create_session(alice), create_session(alice)
    with api.store() as store:
        children = [spawn(store, interrupted, f"{HELD} child {n}") for n in (1, 2)]
        last = spawn(store, closed, f"{HELD} last")
        for child in [*children, last]:
            wait_until(partial(running_turn, store, child.id), 30, f"the turn of {child.id}")
        grandchild = spawn(store, children[0].id, f"{HELD} grand")
        wait_until(lambda: running_turn(store, grandchild.id), 30, "the grandchild's turn")
        wait_until(lambda: turns_in_flight(api.daemon) == 4, 10, "four turns in flight")

        # The parent is idle: no turn of its own is interrupted, its children are.
        answer = alice.post(f"/v1/sessions/{interrupted}/interrupt")
        assert answer.json() == {"interrupted": False, "seq": None}
        listed = alice.get(f"/v1/sessions/{interrupted}/subagents").json()["subagents"]
        assert [c["status"] for c in listed] == ["cancelled", "cancelled"]
        assert all(
            c["ended_at"] is not None and "interrupted by alice" in c["result"] for c in listed
        )
        assert store.subagents.get(grandchild.id).status == "cancelled"  # type: ignore[union-attr]
        wait_until(lambda: turns_in_flight(api.daemon) == 1, STOPPED_WITHIN, "the workers to stop")

        answer = alice.delete(f"/v1/sessions/{closed}")
        assert answer.status_code == 200, answer.text
        assert store.subagents.get(last.id).status == "cancelled"  # type: ignore[union-attr]
        wait_until(
            lambda: turns_in_flight(api.daemon) == 0, STOPPED_WITHIN, "the last worker to stop"
        )

        # Again changes nothing: each child was reported once, to its own parent.
        alice.post(f"/v1/sessions/{interrupted}/interrupt")
        reported = results(store, interrupted)
        assert sorted(r["subagent"] for r in reported) == sorted(c.id for c in children)
        assert {r["status"] for r in reported} == {"cancelled"}
        assert [r["subagent"] for r in results(store, children[0].id)] == [grandchild.id]
        assert [(r["subagent"], r["status"]) for r in results(store, closed)] == [
            (last.id, "cancelled")
        ]
        for child in [*children, grandchild, last]:
            ended = [e.payload for e in events(store, child.id) if e.type == "turn_ended"]
            assert [e["outcome"] for e in ended] == ["interrupted_by_operator"], child.id
            assert not any(e.type == "model_response" for e in events(store, child.id))


@pytest.mark.timeout(240)  # a minute or more on a busy two-core machine
def test_the_command_line_lists_subagents_and_shows_the_tree(start: Callable[..., Api]) -> None:
    api = start()
    alice = api.client("alice")
    parent = create_session(alice, title="lead")
    with api.store() as store:
        child = spawn(store, parent, f"{HELD} child", title="count the files")
        wait_until(lambda: running_turn(store, child.id), 30, "the child's turn")
        grandchild = spawn(store, child.id, f"{HELD} grand", title="count one folder")

    listed = turnkeeper(api.daemon, "subagents", parent)
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split() == ["ID", "STATUS", "DEPTH", "CREATED", "ENDED", "TITLE", "RESULT"]
    assert len(rows) == 1 and rows[0].split()[:3] == [child.id, "running", "1"]
    assert "count the files" in rows[0] and rows[0].endswith("-")
    as_json = turnkeeper(api.daemon, "subagents", parent, "--json")
    served = alice.get(f"/v1/sessions/{parent}/subagents").json()
    assert json.loads(as_json.stdout) == served

    alice.post(f"/v1/sessions/{parent}/interrupt")
    ended = turnkeeper(api.daemon, "subagents", parent).stdout.splitlines()[1]
    assert ended.split()[1] == "cancelled" and "its parent was interrupted by alice" in ended
    nothing = turnkeeper(api.daemon, "subagents", grandchild.id)
    assert nothing.stdout == f"session {grandchild.id} has no subagents\n"
    refused = turnkeeper(api.daemon, "subagents", parent, TURNKEEPER_TOKEN=api.tokens["bob"])
    assert refused.returncode == 1 and "no session" in refused.stderr and "404" in refused.stderr

    shown = turnkeeper(api.daemon, "sessions", "show", parent, COLUMNS="80")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    tree = lines.index("subagents 2 (0 running)")
    assert lines[tree + 1] == f"  - {child.id}  cancelled  count the files"
    assert lines[tree + 2] == f"    - {grandchild.id}  cancelled  count one folder"
    assert max(len(line) for line in lines) <= 80
    of_child = turnkeeper(api.daemon, "sessions", "show", child.id).stdout.splitlines()
    assert f"parent   {parent}  (subagent at depth 1, cancelled)" in of_child
    assert f"  - {grandchild.id}  cancelled  count one folder" in of_child
    assert "subagents" not in turnkeeper(api.daemon, "sessions", "show", grandchild.id).stdout
    data = json.loads(turnkeeper(api.daemon, "sessions", "show", parent, "--json").stdout)
    assert [c["id"] for c in data["subagents"]] == [child.id, grandchild.id]


def test_subagents_without_a_daemon_exits_3(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path / "down")  # configured, never started
    down = turnkeeper(daemon, "subagents", "0" * 32, TURNKEEPER_TOKEN="x")
    assert down.returncode == 3 and "not running" in down.stderr
    assert "cancelled" in turnkeeper(daemon, "subagents", "--help").stdout


# --- the routes and the pool, in-process ------------------------------------------------


TOKEN = "operator-token"


def test_interrupt_and_close_tell_the_pool_to_stop_every_descendant(tmp_path: Path) -> None:
    with Store(f"sqlite:///{tmp_path / 'db.sqlite'}") as store:
        lead = store.sessions.create("admin").id
        idle = store.sessions.create("admin").id
        child = spawn(store, lead, "a").id
        grandchild = spawn(store, child, "b").id
        pool = RoutesPool()
        app = App(
            Config(),
            store,
            Hub(),
            Tokens({"admin": digest(TOKEN)}),
            Metrics(),
            boot_id="b" * 32,
            pool=pool,
        )

        async def scenario() -> None:
            auth = {"Authorization": f"Bearer {TOKEN}"}
            async with TestClient(TestServer(app.app())) as client:
                answer = await client.post(f"/v1/sessions/{idle}/interrupt", headers=auth)
                assert answer.status == 200 and pool.interrupted == []
                answer = await client.post(f"/v1/sessions/{lead}/interrupt", headers=auth)
                assert answer.status == 200
                assert sorted(pool.interrupted) == sorted([child, grandchild])
                pool.interrupted.clear()
                answer = await client.delete(f"/v1/sessions/{lead}", headers=auth)
                assert answer.status == 200
                assert lead in pool.interrupted and child in pool.interrupted
                pool.interrupted.clear()
                answer = await client.delete(f"/v1/sessions/{lead}", headers=auth)  # again
                assert answer.status == 200 and pool.interrupted == []
                routes = {
                    (r.method.lower(), r.resource.canonical)
                    for r in app.app().router.routes()
                    if r.method != "HEAD" and r.resource is not None
                }
                documented = {
                    (method, path)
                    for path, operations in openapi.document()["paths"].items()
                    for method in operations
                }
                assert routes == documented  # every route documented, nothing else

        asyncio.run(scenario())
        assert [c.id for c in store.subagents.children(lead)] == [child]
        assert store.subagents.get(child).status == "cancelled"  # type: ignore[union-attr]
