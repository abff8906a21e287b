"""Background tasks as a client sees them: `GET /v1/sessions/{id}/tasks`, `GET
/v1/tasks/{id}` and its output, `DELETE /v1/tasks/{id}`, their ACL (a session's), and
the command line (`turnkeeper tasks`).

A real daemon runs; the rows are put in place through the store, as a turn would start a
task and a runner would record it, so each stays where the test put it: the daemon's task
pass runs at boot and then only when stirred (a cancel), and no runner is lost within
the test (`tasks.lost_grace` is an hour). Running tasks for real is
test_tasks_daemon.py's.
The routes' calls of the pool are also checked in-process, with a pool that records.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp.test_utils import TestClient, TestServer

from supervisor.contract.config import Config
from supervisor.core.vocabulary import TaskStatus
from supervisor.http.app import Api as App
from supervisor.http.attach import Hub
from supervisor.http.auth import Tokens, digest
from supervisor.metrics import Metrics
from supervisor.store import LeaseLost, Store, TaskInfo
from tests.conftest import this_host_id
from tests.daemon import Daemon, daemons, events, turnkeeper, wait_until
from tests.http.test_api import Api, assert_error, create_session, start
from tests.support import RoutesPool

__all__ = ["daemons", "start"]  # the fixtures

TASKS = {
    "kinds": [{"name": "hold", "command": ["sleep", "{seconds}"], "args": {"seconds": "^[0-9]+$"}}],
    "reconcile_interval": 3600.0,
    "lost_grace": 3600.0,
}
ELSEWHERE = "host-b"  # a host no daemon of the test runs on
UNKNOWN = "t" + "0" * 32


def put(
    store: Store,
    session_id: str,
    *,
    host: str | None = None,
    outcome: TaskStatus | None = None,
    tail: str = "",
) -> TaskInfo:
    """A task of `session_id` as its turn starts it (with the session's lease token, read
    again if the daemon took the lease in between): pending; with `host`, claimed there;
    with `outcome`, ended so (exit status 0 for a success, else 1)."""
    for _ in range(50):
        token = store.sessions.get(session_id).lease_token
        try:
            started = store.tasks.start(
                session_id, "hold", {"seconds": "30"}, token=token, turn_id=None, max_running=8
            )
        except LeaseLost:
            continue
        break
    else:
        raise AssertionError(f"the lease of {session_id} kept moving")
    task = started.task
    if host is not None:
        assert store.tasks.claim(task.id, host, f"{host}/boot0001") is not None
    if outcome is not None:
        code = 0 if outcome is TaskStatus.SUCCEEDED else 1
        assert store.tasks.record(
            task.id, 1, outcome, exit_code=code, duration=2.5, output_tail=tail
        )
    found = store.tasks.get(task.id)
    assert found is not None
    return found


def output_file(daemon: Daemon, task_id: str) -> Path:
    """Where the runner of a task of this daemon writes its output."""
    path = daemon.state / "tasks" / f"{task_id}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def ids(answer: httpx.Response) -> list[str]:
    assert answer.status_code == 200, answer.text
    return [task["id"] for task in answer.json()["tasks"]]


def results(store: Store, session_id: str) -> list[dict[str, Any]]:
    """The payloads of the `task_result`s in the session's log."""
    return [e.payload for e in events(store, session_id) if e.type == "task_result"]


# --- a real daemon ----------------------------------------------------------------------


def test_tasks_are_read_through_their_sessions_acl(start: Callable[..., Api]) -> None:
    api = start(tasks=TASKS)
    alice, bob, admin = api.client("alice"), api.client("bob"), api.client("admin")
    session = create_session(alice)
    with api.store() as store:
        done = put(
            store, session, host=this_host_id(), outcome=TaskStatus.SUCCEEDED, tail="3 files\n"
        )
        elsewhere = put(store, session, host=ELSEWHERE)
        waiting = put(store, session)
    output_file(api.daemon, done.id).write_bytes(b"counting\n\xff3 files\n")

    listed = alice.get(f"/v1/sessions/{session}/tasks")
    assert ids(listed) == [done.id, elsewhere.id, waiting.id]  # oldest first
    first = listed.json()["tasks"][0]
    assert first == {
        "id": done.id,
        "session": session,
        "kind": "hold",
        "args": {"seconds": "30"},
        "status": "succeeded",
        "attempt": 1,
        "cancel_requested": False,
        "host": this_host_id(),
        "exit_code": 0,
        "duration": 2.5,
        "reason": "",
        "output_tail": "3 files\n",
        "started_seq": done.started_seq,
        "result_seq": None,
        "created_at": done.created_at,
        "started_at": done.started_at,
        "heartbeat_at": done.heartbeat_at,
        "ended_at": first["ended_at"],
        "output_url": f"/v1/tasks/{done.id}/output",
    }
    assert isinstance(first["ended_at"], float)
    assert [t["status"] for t in listed.json()["tasks"]] == ["succeeded", "running", "pending"]
    assert ids(alice.get(f"/v1/sessions/{session}/tasks", params={"limit": 1})) == [done.id]
    assert_error(alice.get(f"/v1/sessions/{session}/tasks?limit=0"), 422, "invalid")
    assert alice.get(f"/v1/tasks/{done.id}").json() == first
    assert admin.get(f"/v1/tasks/{done.id}").json() == first

    # The output, from the file under this daemon's state directory; bytes that are not
    # UTF-8 are replaced, not an error.
    output = alice.get(first["output_url"])
    assert output.status_code == 200, output.text
    assert output.headers["Content-Type"].startswith("text/plain")
    assert output.text == "counting\n\ufffd3 files\n"
    error = assert_error(alice.get(f"/v1/tasks/{elsewhere.id}/output"), 409, "elsewhere")
    assert repr(ELSEWHERE) in error["message"]
    assert_error(alice.get(f"/v1/tasks/{waiting.id}/output"), 404, "no_output")

    # bob may read none of it, and is told nothing about it...
    assert_error(bob.get(f"/v1/sessions/{session}/tasks"), 404, "not_found")
    for task in (done, elsewhere, waiting):
        assert_error(bob.get(f"/v1/tasks/{task.id}"), 404, "not_found")
        assert_error(bob.get(f"/v1/tasks/{task.id}/output"), 404, "not_found")
        assert_error(bob.delete(f"/v1/tasks/{task.id}"), 404, "not_found")
    # ...exactly as about a task that does not exist, or an id that is none.
    for missing in (UNKNOWN, session, "nope", "T" + "0" * 32):
        error = assert_error(alice.get(f"/v1/tasks/{missing}"), 404, "not_found")
        assert error["message"] == f"no task {missing!r}"
        assert_error(alice.delete(f"/v1/tasks/{missing}"), 404, "not_found")
    # Once alice lets him read the session he reads its tasks, and may not cancel them.
    granted = alice.put(
        f"/v1/sessions/{session}/acl", json={"principal": "bob", "permission": "read"}
    )
    assert granted.status_code == 200, granted.text
    assert ids(bob.get(f"/v1/sessions/{session}/tasks")) == [done.id, elsewhere.id, waiting.id]
    assert bob.get(f"/v1/tasks/{done.id}/output").text == output.text
    assert_error(bob.delete(f"/v1/tasks/{waiting.id}"), 403, "forbidden")
    with api.store() as store:
        assert store.tasks.get(waiting.id).status == "pending"  # type: ignore[union-attr]

    document = api.client(None).get("/openapi.json").json()
    assert document["paths"]["/v1/tasks/{id}"]["delete"]["operationId"] == "cancelTask"
    assert (
        "text/plain"
        in document["paths"]["/v1/tasks/{id}/output"]["get"]["responses"]["200"]["content"]
    )


def test_a_cancel_ends_a_pending_task_and_its_session_is_told_once(
    start: Callable[..., Api],
) -> None:
    api = start(tasks=TASKS)
    alice = api.client("alice")
    session = create_session(alice)
    with api.store() as store:
        waiting = put(store, session)
        running = put(store, session, host=ELSEWHERE)
        ended = put(store, session, host=this_host_id(), outcome=TaskStatus.FAILED)
        assert store.tasks.report(ended.id) is not None  # its outcome went to the session

        answer = alice.delete(f"/v1/tasks/{waiting.id}")
        assert answer.status_code == 200, answer.text
        cancelled = answer.json()
        assert (cancelled["status"], cancelled["cancel_requested"]) == ("cancelled", True)
        assert cancelled["ended_at"] is not None
        # The pool was told at once: its task pass reports the outcome now, not in an hour.
        wait_until(
            lambda: [r["task"] for r in results(store, session)] == [ended.id, waiting.id],
            15,
            "the cancelled task's task_result",
        )
        (told,) = [r for r in results(store, session) if r["task"] == waiting.id]
        assert told["status"] == "cancelled"
        told_at = store.tasks.get(waiting.id).result_seq  # type: ignore[union-attr]
        assert told_at is not None

        # A running task is asked to stop (its runner, on its host, acts on it).
        answer = alice.delete(f"/v1/tasks/{running.id}")
        assert answer.status_code == 200, answer.text
        assert (answer.json()["status"], answer.json()["cancel_requested"]) == ("running", True)
        # An ended one is answered as it is; a cancel again changes nothing.
        answer = alice.delete(f"/v1/tasks/{ended.id}")
        assert (answer.json()["status"], answer.json()["cancel_requested"]) == ("failed", False)
        again = alice.delete(f"/v1/tasks/{waiting.id}")
        assert again.status_code == 200 and again.json() == cancelled | {"result_seq": told_at}
        assert len(results(store, session)) == 2


@pytest.mark.timeout(240)  # a minute or more on a busy two-core machine
def test_the_command_line_lists_shows_and_cancels_tasks(start: Callable[..., Api]) -> None:
    api = start(tasks=TASKS)
    alice = api.client("alice")
    session, empty = create_session(alice), create_session(alice)
    with api.store() as store:
        # The output's end holds a terminal escape: it is shown, never sent to the terminal.
        done = put(
            store,
            session,
            host=this_host_id(),
            outcome=TaskStatus.SUCCEEDED,
            tail="a\n\x1b]0;x\x07b\n",
        )
        waiting = put(store, session)
    tokens = {"TURNKEEPER_TOKEN": api.tokens["alice"]}

    listed = turnkeeper(api.daemon, "tasks", session, **tokens)
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split() == ["ID", "KIND", "STATUS", "CREATED", "ENDED", "EXIT", "ARGS"]
    assert [row.split()[:3] for row in rows] == [
        [done.id, "hold", "succeeded"],
        [waiting.id, "hold", "pending"],
    ]
    assert rows[0].split()[-2:] == ["0", "seconds=30"]
    assert rows[1].split()[-2:] == ["-", "seconds=30"]
    as_json = turnkeeper(api.daemon, "tasks", session, "--json", **tokens)
    assert json.loads(as_json.stdout) == alice.get(f"/v1/sessions/{session}/tasks").json()
    nothing = turnkeeper(api.daemon, "tasks", empty, **tokens)
    assert nothing.stdout == f"session {empty} has no tasks\n"

    shown = turnkeeper(api.daemon, "tasks", done.id, **tokens)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[:5] == [
        f"task      {done.id}",
        f"session   {session}",
        "kind      hold",
        "args      seconds=30",
        "status    succeeded",
    ]
    assert "exit      0   after 2.5 s" in lines
    assert f"output    /v1/tasks/{done.id}/output" in lines
    assert lines[-3:] == ["the end of its output:", "a", "\ufffd]0;x\ufffdb"]
    as_json = turnkeeper(api.daemon, "tasks", done.id, "--json", **tokens)
    assert json.loads(as_json.stdout) == alice.get(f"/v1/tasks/{done.id}").json()

    cancel = turnkeeper(api.daemon, "tasks", waiting.id, "--cancel", **tokens)
    assert (cancel.returncode, cancel.stdout) == (0, f"task {waiting.id} cancelled\n")
    assert "status    cancelled" in turnkeeper(api.daemon, "tasks", waiting.id).stdout
    over = turnkeeper(api.daemon, "tasks", done.id, "--cancel", **tokens)
    assert over.stdout == f"task {done.id} had already ended: succeeded\n"

    for wrong in ([session, "--cancel"], ["nope"], [done.id.upper()]):
        refused = turnkeeper(api.daemon, "tasks", *wrong, **tokens)
        assert refused.returncode == 2 and "ID" in refused.stderr, refused.stderr
    bob = turnkeeper(api.daemon, "tasks", done.id, TURNKEEPER_TOKEN=api.tokens["bob"])
    assert bob.returncode == 1 and "no task" in bob.stderr and "404" in bob.stderr


def test_every_readable_task_newest_first_by_status(start: Callable[..., Api]) -> None:
    api = start(tasks=TASKS)
    alice, bob, admin = api.client("alice"), api.client("bob"), api.client("admin")
    mine, theirs = create_session(alice), create_session(bob)
    with api.store() as store:
        done = put(store, mine, host=this_host_id(), outcome=TaskStatus.FAILED)
        waiting = put(store, mine)
        other = put(store, theirs, host=this_host_id())
    assert ids(alice.get("/v1/tasks")) == [waiting.id, done.id]  # newest first, hers only
    assert ids(bob.get("/v1/tasks")) == [other.id]
    assert ids(admin.get("/v1/tasks")) == [other.id, waiting.id, done.id]
    assert ids(admin.get("/v1/tasks", params={"status": "pending,running"})) == [
        other.id,
        waiting.id,
    ]
    assert ids(alice.get("/v1/tasks", params={"status": "failed", "limit": 5})) == [done.id]
    assert ids(admin.get("/v1/tasks", params={"limit": 1})) == [other.id]
    error = assert_error(alice.get("/v1/tasks", params={"status": "running,done"}), 422, "invalid")
    assert "'done' is not a task status" in error["message"]
    tokens = {"TURNKEEPER_TOKEN": api.tokens["alice"]}
    live = turnkeeper(api.daemon, "tasks", **tokens)
    assert live.returncode == 0, live.stderr
    assert [row.split()[:3] for row in live.stdout.splitlines()[1:]] == [
        [waiting.id, "hold", "pending"]
    ]
    every = turnkeeper(api.daemon, "tasks", "--status", "all", "--json", **tokens)
    assert json.loads(every.stdout) == alice.get("/v1/tasks").json()
    none = turnkeeper(api.daemon, "tasks", "--status", "lost", **tokens)
    assert none.stdout == "no lost tasks\n"
    wrong = turnkeeper(api.daemon, "tasks", "--status", "done", **tokens)
    assert wrong.returncode == 2 and "--status" in wrong.stderr


def test_tasks_without_a_daemon_exits_3(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path / "down")  # configured, never started
    down = turnkeeper(daemon, "tasks", "0" * 32, TURNKEEPER_TOKEN="x")
    assert down.returncode == 3 and "not running" in down.stderr
    assert "timed_out" in turnkeeper(daemon, "tasks", "--help").stdout


# --- the routes and the pool, in-process ------------------------------------------------


TOKEN = "operator-token"


def test_a_cancel_tells_the_pool_of_a_live_task_only(tmp_path: Path) -> None:
    with Store(f"sqlite:///{tmp_path / 'db.sqlite'}") as store:
        session = store.sessions.create("admin").id
        waiting = put(store, session)
        running = put(store, session, host="h")
        ended = put(store, session, host="h", outcome=TaskStatus.SUCCEEDED)
        pool = RoutesPool()
        config = Config.model_validate({"daemon": {"state_dir": str(tmp_path / "state")}})
        tokens = Tokens({"admin": digest(TOKEN)})
        app = App(
            config,
            store,
            Hub(),
            tokens,
            Metrics(),
            boot_id="b" * 32,
            pool=pool,
            keeper=pool,
            host_id="h",
        )

        async def scenario() -> None:
            auth = {"Authorization": f"Bearer {TOKEN}"}
            async with TestClient(TestServer(app.app())) as client:
                for task in (waiting, running, ended):
                    answer = await client.delete(f"/v1/tasks/{task.id}", headers=auth)
                    assert answer.status == 200
                assert pool.cancelled == [waiting.id, running.id]
                # The output of a task of this host, from `<state_dir>/tasks/<id>.log`.
                path = tmp_path / "state" / "tasks" / f"{running.id}.log"
                answer = await client.get(f"/v1/tasks/{running.id}/output", headers=auth)
                assert answer.status == 404
                path.parent.mkdir(parents=True)
                path.write_text("so far\n")
                answer = await client.get(f"/v1/tasks/{running.id}/output", headers=auth)
                assert (answer.status, await answer.text()) == (200, "so far\n")

        asyncio.run(scenario())
        assert store.tasks.get(waiting.id).status == "cancelled"  # type: ignore[union-attr]
        assert store.tasks.get(running.id).cancel_requested  # type: ignore[union-attr]
