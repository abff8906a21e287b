"""No token holder takes more than its share of one daemon (issue 28): its open sessions
are bounded, a session's tree of subagents is bounded at every depth, and only the
principals the operator lists may have their agents restart the daemon."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from supervisor.store import Store
from tests.daemon import Daemon, daemons, events, tokens_file, turn_ended, wait_until

__all__ = ["daemons"]  # the fixture

Daemons = Callable[..., Daemon]
pytestmark = pytest.mark.timeout(180)

ALICE = "alice-token-0123456789"


def shared_daemon(daemons: Daemons, tmp_path: Path, **sections: dict[str, object]) -> Daemon:
    tokens = tokens_file(tmp_path / "tokens", {"alice": ALICE})
    auth = {"tokens_file": str(tokens), **sections.pop("auth", {})}
    return daemons(auth=auth, **sections)


def client_of(daemon: Daemon, token: str | None = None) -> httpx.Client:
    client = daemon.client()
    if token is not None:
        client.headers["Authorization"] = f"Bearer {token}"
    return client


def say(http: httpx.Client, store: Store, session: str, text: str) -> None:
    """`text` injected, and the turn it starts ended."""
    seq = http.post(f"/v1/sessions/{session}/inject", json={"text": text}).json()["seq"]
    wait_until(lambda: turn_ended(store, session, seq), 60, "the turn")


def tool_results(store: Store, session: str) -> list[str]:
    return [
        str(e.payload.get("content")) for e in events(store, session) if e.type == "tool_result"
    ]


def test_a_principal_past_its_open_sessions_gets_429_and_others_are_served(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = shared_daemon(daemons, tmp_path, auth={"max_open_sessions_per_principal": 2}).start()
    with client_of(daemon, ALICE) as alice, client_of(daemon) as admin:
        made = [alice.post("/v1/sessions", json={}) for _ in range(2)]
        assert [answer.status_code for answer in made] == [201, 201]
        refused = alice.post("/v1/sessions", json={"title": "one too many"})
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert error["code"] == "too_many_sessions"
        assert "auth.max_open_sessions_per_principal" in error["message"]
        assert admin.post("/v1/sessions", json={}).status_code == 201  # the admin's own count
        # A closed session no longer counts.
        assert alice.delete(f"/v1/sessions/{made[0].json()['id']}").status_code == 200
        assert alice.post("/v1/sessions", json={}).status_code == 201
        listed = admin.get("/v1/sessions").json()["sessions"]
        assert not any(s["title"] == "one too many" for s in listed)  # nothing half-written


def test_a_sessions_tree_of_subagents_is_bounded(daemons: Daemons, tmp_path: Path) -> None:
    daemon = shared_daemon(
        daemons, tmp_path, subagents={"max_children": 8, "max_total_per_root": 2}
    ).start()
    held = "\n".join(f"/subagent /sleep 120 held {n}" for n in range(3))
    with client_of(daemon, ALICE) as alice, Store(daemon.url, migrate=False) as store:
        root = alice.post("/v1/sessions", json={}).json()["id"]
        say(alice, store, root, held)
        results = tool_results(store, root)
        assert sum(r.startswith("started subagent") for r in results) == 2, results
        [refused] = [r for r in results if not r.startswith("started subagent")]
        assert "no subagent started" in refused and "subagents.max_total_per_root" in refused
        assert len(store.subagents.children(root)) == 2


def test_only_the_listed_principals_agents_may_restart_the_daemon(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = shared_daemon(
        daemons, tmp_path, restart={"agent_may_request": True, "min_interval": 1.0}
    ).start()
    with (
        client_of(daemon, ALICE) as alice,
        client_of(daemon) as admin,
        Store(daemon.url, migrate=False) as store,
    ):
        session = alice.post("/v1/sessions", json={}).json()["id"]
        say(alice, store, session, "/restart because I can")
        [result] = tool_results(store, session)
        assert "no restart requested" in result and "restart.agent_principals" in result
        assert store.restarts.list() == []  # nothing written
        # The admin's own session may (restart.agent_principals defaults to the admin).
        mine = admin.post("/v1/sessions", json={}).json()["id"]
        admin.post(f"/v1/sessions/{mine}/inject", json={"text": "/restart for the test"})
        wait_until(lambda: store.restarts.list(), 60, "the admin's agent's restart request")


# A command held by a gate: it waits for the file `gate`, then exits 0.
GATED = ["sh", "-c", 'while [ ! -e "$1" ]; do sleep 0.05; done', "sh", "{gate}"]
TASKS = {
    "kinds": [{"name": "gated", "command": GATED, "args": {"gate": "^/[A-Za-z0-9/_.-]+$"}}],
    "reconcile_interval": 0.5,
    "max_running_total": 2,
    "max_running_per_principal": 1,
}


def test_tasks_past_the_daemons_and_a_principals_share_wait_in_order(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = shared_daemon(daemons, tmp_path, tasks=TASKS).start()
    gates: dict[str, Path] = {}

    def start(http: httpx.Client, store: Store, session: str, name: str) -> str:
        gates[name] = daemon.root / f"gate-{name}"
        say(http, store, session, f'/task gated {{"gate": "{gates[name]}"}}')
        return tool_results(store, session)[-1]

    with (
        client_of(daemon, ALICE) as alice,
        client_of(daemon) as admin,
        Store(daemon.url, migrate=False) as store,
    ):
        mine = alice.post("/v1/sessions", json={}).json()["id"]
        theirs = admin.post("/v1/sessions", json={}).json()["id"]
        assert "queued" not in start(alice, store, mine, "a1")
        waits = start(alice, store, mine, "a2")
        assert "queued" in waits and "tasks.max_running_per_principal" in waits, waits
        assert "queued" not in start(admin, store, theirs, "b1")

        def running() -> int:
            found = store.tasks.of_session(mine) + store.tasks.of_session(theirs)
            return sum(t.status == "running" for t in found)

        # The daemon's share counts the tasks running: a1 and b1 claimed, not just started.
        wait_until(lambda: running() == 2, 30, "a1 and b1 to run")
        waits = start(admin, store, theirs, "b2")
        assert "queued" in waits and "tasks.max_running_total" in waits, waits
        ids = {t.id: t for t in store.tasks.of_session(mine) + store.tasks.of_session(theirs)}
        by_gate = {name: next(i for i, t in ids.items() if str(gates[name]) in str(t.args))
                   for name in gates}  # fmt: skip

        def status(*names: str) -> list[str]:
            return [store.tasks.get(by_gate[name]).status for name in names]

        def settled(*expected: str) -> bool:
            return status("a1", "a2", "b1", "b2") == list(expected)

        wait_until(lambda: settled("running", "pending", "running", "pending"), 30, "2 running")
        gates["a1"].touch()  # alice's share frees: her next one, not the admin's, starts
        wait_until(lambda: settled("succeeded", "running", "running", "pending"), 30, "a2 to start")
        gates["b1"].touch()  # the daemon's share frees: the admin's waiting one starts
        wait_until(
            lambda: settled("succeeded", "running", "succeeded", "running"), 30, "b2 to start"
        )
        gates["a2"].touch()
        gates["b2"].touch()
        wait_until(
            lambda: settled("succeeded", "succeeded", "succeeded", "succeeded"), 30, "the end"
        )
