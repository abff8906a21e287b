"""A session's agent is code: only the operator chooses it, and whatever it raises, the
worker lives (issue: hardening, item 1). Each test drives a real daemon over HTTP."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.store import Store
from tests.daemon import Daemon, daemons, events, wait_until

__all__ = ["daemons"]

Daemons = Callable[..., Daemon]


def _daemon(daemons: Daemons, tmp_path: Path, **sections: dict[str, Any]) -> Daemon:
    return daemons(http={"listen": f"unix:{tmp_path}/api.sock"}, **sections)


def _answer(client: httpx.Client, session_id: str, after: int, timeout: float = 30) -> Any:
    """The first `turn_ended` after seq `after`, read over the API."""

    def ended() -> Any:
        found = client.get(f"/v1/sessions/{session_id}/events", params={"after": after}).json()
        return next((e for e in found["events"] if e["type"] == "turn_ended"), None)

    return wait_until(ended, timeout, f"a turn of {session_id} to end")


def test_a_session_may_name_only_an_agent_the_operator_allows(
    daemons: Daemons, tmp_path: Path
) -> None:
    marker = tmp_path / "imported"
    daemon = _daemon(daemons, tmp_path)
    daemon.env["TURNKEEPER_TEST_IMPORT_MARKER"] = str(marker)
    daemon.start()
    with daemon.client() as client:
        for name in ("tests.agents_side_effect:Agent", "os:system", "subprocess:Popen"):
            answer = client.post("/v1/sessions", json={"agent": name})
            assert answer.status_code == 422, answer.text
            error = answer.json()["error"]
            assert error["field"] == "agent" and "agent.allowed" in error["message"]
        assert client.get("/v1/sessions").json()["sessions"] == []  # nothing was stored
        # The configured class itself may be named.
        named = client.post("/v1/sessions", json={"agent": "tests.agents:ChaosAgent"})
        assert named.status_code == 201, named.text
    assert not marker.exists(), "the module was imported"


def test_a_listed_agent_is_allowed_and_a_stored_one_taken_off_the_list_fails_its_turns(
    daemons: Daemons, tmp_path: Path
) -> None:
    marker = tmp_path / "imported"
    listed = "tests.agents_side_effect:Agent"
    daemon = _daemon(daemons, tmp_path, agent={"allowed": [listed]})
    daemon.env["TURNKEEPER_TEST_IMPORT_MARKER"] = str(marker)
    daemon.start()
    with daemon.client() as client:
        sid = client.post("/v1/sessions", json={"agent": listed}).json()["id"]
        seq = client.post(f"/v1/sessions/{sid}/inject", json={"text": "hi"}).json()["seq"]
        assert _answer(client, sid, seq)["payload"]["outcome"] == "completed"
        assert marker.exists()  # imported in the worker, because the operator listed it
    # A row naming another class (written by hand here, or before an upgrade) is never run.
    with Store(daemon.url, migrate=False) as store:
        rogue = store.sessions.create("admin", agent="tests.agents_killer:Agent").id
    with daemon.client() as client:
        seq = client.post(f"/v1/sessions/{rogue}/inject", json={"text": "hi"}).json()["seq"]
        ended = _answer(client, rogue, seq)
        assert ended["payload"]["outcome"] == "failed"
        assert "not in agent.allowed" in ended["payload"]["error"]
        assert client.get("/v1/status").json()["worker_restarts"] == 0


@pytest.mark.parametrize(
    "kind", ["SystemExit", "KeyboardInterrupt", "RecursionError", "MemoryError"]
)
def test_whatever_an_agent_raises_fails_the_turn_and_the_worker_lives(
    daemons: Daemons, tmp_path: Path, kind: str
) -> None:
    daemon = _daemon(daemons, tmp_path).start()
    with daemon.client() as client:
        pids = {s["pid"] for s in client.get("/v1/status").json()["slots"]}
        sid = client.post("/v1/sessions", json={}).json()["id"]
        seq = client.post(f"/v1/sessions/{sid}/inject", json={"text": f"/raise {kind}"}).json()
        ended = _answer(client, sid, seq["seq"])
        assert ended["payload"]["outcome"] == "failed"
        assert ended["payload"]["error"].startswith(f"agent error: {kind}")
        seq = client.post(f"/v1/sessions/{sid}/inject", json={"text": "still there?"}).json()
        assert _answer(client, sid, seq["seq"])["payload"]["outcome"] == "completed"
        status = client.get("/v1/status").json()
        assert status["worker_restarts"] == 0
        assert {s["pid"] for s in status["slots"]} == pids


def test_an_agent_whose_import_kills_its_worker_is_quarantined_after_three_attempts(
    daemons: Daemons, tmp_path: Path
) -> None:
    killer = "tests.agents_killer:Agent"
    daemon = _daemon(daemons, tmp_path, agent={"allowed": [killer]}).start()
    with daemon.client() as client:
        poisoned = client.post("/v1/sessions", json={"agent": killer}).json()["id"]
        healthy = client.post("/v1/sessions", json={}).json()["id"]
        client.post(f"/v1/sessions/{poisoned}/inject", json={"text": "hello"})
        wait_until(
            lambda: client.get(f"/v1/sessions/{poisoned}").json()["status"] == "quarantined",
            90,
            "the poisoned session to be quarantined",
        )
        seq = client.post(f"/v1/sessions/{healthy}/inject", json={"text": "fine"}).json()["seq"]
        assert _answer(client, healthy, seq)["payload"]["outcome"] == "completed"
    with Store(daemon.url, migrate=False) as store:
        found = events(store, poisoned)
    types = [e.type for e in found]
    # The turn's own run died loading the agent, and so did each of the 3 attempts: no
    # note was written before a load that never returned.
    assert types.count("turn_started") == 1
    assert "continuation" not in types
    notice = next(e for e in found if e.type == "notice")
    assert "quarantined" in notice.payload["text"]
    assert found[-1].type == "turn_ended" and found[-1].payload["reason"] == "quarantined"
    assert "breaker TRIPPED" not in daemon.log()
