"""The hosts on the database as the operator sees them: `turnkeeper hosts` (run as a user
runs it), the hosts part of `GET /v1/status` and of `turnkeeper status`, and the host
metrics; on a store the test fills with a live, a lost and a left host itself."""

from __future__ import annotations

import asyncio
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from supervisor.cli.common import Escaped
from supervisor.cli.daemon_commands import status_lines
from supervisor.contract.config import Config
from supervisor.http.app import Api
from supervisor.http.attach import Hub
from supervisor.http.auth import Tokens, digest
from supervisor.metrics import Metrics
from supervisor.store import Grant, Me, Store
from supervisor.store.models import Host as HostRow
from tests.conftest import python_env
from tests.support import run_turnkeeper

TOKEN = "admin-token"
MACHINE = "0123456789abcdef0123456789abcdef"  # a machine id, as /etc/machine-id holds one
LIVE, LOST, LEFT = "tk-east", MACHINE, "tk-west"
BACKENDS = pytest.mark.parametrize("db_url", ["sqlite", "postgresql", "mysql"], indirect=True)


def me(host_id: str, n: int) -> Me:
    return Me(
        host_id=host_id,
        boot_id=f"{n}" * 32,
        hostname=f"node{n}.example.internal",
        machine="",
        pid=4000 + n,
        pid_started=0.0,
        version="9.9.9",
    )


def lease(store: Store, host_id: str, n: int, count: int) -> None:
    """`count` new sessions leased to a worker of `host_id`'s boot `n`, for 10 minutes."""
    owner = f"{host_id}/{str(n) * 8}/w1.1"
    ids = [store.sessions.create("admin").id for _ in range(count)]
    granted = store.leases.grant([Grant(sid, owner) for sid in ids], 600.0)
    assert all(g.lease is not None for g in granted)


def fill(store: Store) -> None:
    """Three hosts: LIVE holds two sessions; LOST stopped renewing two minutes ago and its
    one lease has not run out yet; LEFT stopped cleanly, letting its session go."""
    never = lambda host: False  # noqa: E731  (no row is taken over here)
    for n, host_id in enumerate((LIVE, LOST, LEFT), 1):
        store.hosts.register(me(host_id, n), 600.0, never)
    lease(store, LIVE, 1, 2)
    lease(store, LOST, 2, 1)
    lease(store, LEFT, 3, 1)
    now = store.now()
    HostRow.update(last_seen=now - 120.0, expires_at=now - 90.0).where(
        HostRow.host_id == LOST
    ).execute()
    assert store.hosts.leave(LEFT, "3" * 32, f"{LEFT}/{'3' * 8}") == 1


@pytest.fixture
def filled(db_url: str) -> str:
    with Store(db_url) as store:
        fill(store)
    return db_url


def check_rows(rows: list[dict[str, Any]]) -> None:
    """The three hosts of `fill`, as every view must show them."""
    by_id = {h["id"]: h for h in rows}
    assert [h["id"] for h in rows] == sorted(by_id) == sorted([LIVE, LOST, LEFT])
    assert {i: (h["state"], h["sessions"]) for i, h in by_id.items()} == {
        LIVE: ("live", 2),
        LOST: ("lost", 1),
        LEFT: ("left", 0),
    }
    assert by_id[LIVE]["seen_ago"] < 60.0
    assert 119.0 <= by_id[LOST]["seen_ago"] < 180.0
    assert by_id[LOST]["last_seen"] < by_id[LIVE]["last_seen"]
    assert by_id[LIVE]["hostname"] == "node1.example.internal"
    assert (by_id[LIVE]["pid"], by_id[LIVE]["version"], by_id[LIVE]["boot"]) == (
        4001,
        "9.9.9",
        "1" * 32,
    )


# --- turnkeeper hosts -------------------------------------------------------------------


def turnkeeper(
    db_url: str, tmp_path: Path, *args: str, **env: str
) -> subprocess.CompletedProcess[str]:
    environ = python_env(
        TURNKEEPER_CONFIG="",
        TURNKEEPER_DAEMON__STATE_DIR=str(tmp_path / "state"),
        TURNKEEPER_STORE__URL=db_url,
        **env,
    )
    for name in ("COLUMNS", "TURNKEEPER_TOKEN", "TURNKEEPER_DAEMON__HOST_ID"):
        if name not in env:
            environ.pop(name, None)
    return run_turnkeeper(*args, env=environ)


@BACKENDS
def test_hosts_lists_live_lost_and_left_hosts(filled: str, tmp_path: Path) -> None:
    shown = turnkeeper(filled, tmp_path, "hosts", "--json", TURNKEEPER_DAEMON__HOST_ID=LIVE)
    assert shown.returncode == 0, shown.stderr
    document = json.loads(shown.stdout)
    assert document["host"] == {"id": LIVE}
    check_rows(document["hosts"])

    text = turnkeeper(filled, tmp_path, "hosts", TURNKEEPER_DAEMON__HOST_ID=LIVE)
    assert text.returncode == 0, text.stderr
    header, *lines, mark = text.stdout.splitlines()
    assert header.split() == ["ID", "HOSTNAME", "STATE", "SEEN", "SESSIONS", "PID", "VERSION"]
    cells = {line.split()[0]: line.split() for line in lines}
    seen = {host_id: row.pop(3) for host_id, row in cells.items()}
    # A machine id is cut to 12 characters, as boot ids are; this machine's host is marked.
    assert cells == {
        f"{LIVE}*": [f"{LIVE}*", "node1", "live", "ago", "2", "4001", "9.9.9"],
        MACHINE[:12]: [MACHINE[:12], "node2", "lost", "ago", "1", "4002", "9.9.9"],
        LEFT: [LEFT, "node3", "left", "ago", "0", "4003", "9.9.9"],
    }
    assert re.fullmatch(r"2m\d\ds", seen[MACHINE[:12]])
    assert mark == "* this machine's daemon.host_id"
    assert max(map(len, text.stdout.splitlines())) <= 80
    assert "\x1b" not in text.stdout  # piped: no colour


def test_hosts_on_a_database_without_hosts_says_so(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state' / 'turnkeeper.db'}"
    Store(url).close()
    shown = turnkeeper(url, tmp_path, "hosts")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("no hosts registered")
    document = json.loads(turnkeeper(url, tmp_path, "hosts", "--json").stdout)
    assert document["hosts"] == [] and document["host"]["id"]  # resolved: never empty


def test_hosts_help_says_what_the_states_mean(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state' / 'turnkeeper.db'}"
    text = turnkeeper(url, tmp_path, "hosts", "--help").stdout
    for line in (
        "live  it renews its row",
        "left  it stopped cleanly",
        "lost  it stopped renewing",
    ):
        assert line in text, text


# --- GET /v1/status and /metrics ------------------------------------------------------


async def status_and_metrics(store: Store) -> tuple[dict[str, Any], str]:
    tokens = Tokens({"admin": digest(TOKEN)})
    api = Api(Config(), store, Hub(), tokens, Metrics(), boot_id="b" * 32, host_id=LIVE)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with TestClient(TestServer(api.app())) as client:
        status = await client.get("/v1/status", headers=auth)
        assert status.status == 200, await status.text()
        metrics = await client.get("/metrics")
        assert metrics.status == 200
        return await status.json(), await metrics.text()


@BACKENDS
def test_status_shows_this_host_and_every_host_on_the_database(filled: str) -> None:
    with Store(filled) as store:
        document, metrics = asyncio.run(status_and_metrics(store))
    assert document["host"] == {"id": LIVE}
    check_rows(document["hosts"])
    assert document["hosts_error"] is None
    assert document["sessions"]["open"] == 4  # the rest of the status is there too

    assert f'turnkeeper_host_info{{host_id="{LIVE}"}} 1.0' in metrics
    for state, count in (("live", 1), ("lost", 1), ("left", 1)):
        assert f'turnkeeper_hosts{{state="{state}"}} {count}.0' in metrics
    # Live hosts and those still holding leases; a host that left holds none.
    sessions = re.findall(r'^turnkeeper_host_sessions\{host_id="(.*)"\} (.*)$', metrics, re.M)
    assert sorted(sessions) == sorted([(LIVE, "2.0"), (LOST, "1.0")])


def test_a_failed_hosts_read_leaves_the_rest_of_the_status(tmp_path: Path) -> None:
    with Store(f"sqlite:///{tmp_path / 'turnkeeper.db'}") as store:
        fill(store)
        store.db.execute_sql("DROP TABLE host")  # the registry cannot be read
        document, metrics = asyncio.run(status_and_metrics(store))
    assert document["hosts"] == []
    assert "host" in document["hosts_error"] and "could not be read" in document["hosts_error"]
    assert document["host"] == {"id": LIVE}
    assert document["sessions"]["open"] == 4
    assert f'turnkeeper_host_info{{host_id="{LIVE}"}} 1.0' in metrics
    assert "turnkeeper_hosts{" not in metrics  # empty for this scrape, not zero
    assert "# TYPE turnkeeper_hosts gauge" in metrics


# --- turnkeeper status ------------------------------------------------------------------


def document(hosts: list[dict[str, Any]], error: str | None = None) -> dict[str, Any]:
    return {
        "boot": {"id": "f" * 32, "ready": True, "stopping": False},
        "breaker": None,
        "slots": [],
        "worker_restarts": 0,
        "sessions": {"open": 3},
        "attach_streams": 0,
        "host": {"id": LIVE},
        "hosts": hosts,
        "hosts_error": error,
    }


def host(host_id: str, state: str, sessions: int, seen_ago: float) -> dict[str, Any]:
    return {
        "id": host_id,
        "hostname": "node.example.internal",
        "state": state,
        "last_seen": 1.8e9,
        "seen_ago": seen_ago,
        "sessions": sessions,
        "pid": 4194304,
        "version": "0.1.0",
        "boot": "a" * 32,
    }


def test_status_shows_the_host_table_only_for_several_hosts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    one = status_lines(document([host(LIVE, "live", 3, 0.4)]))
    assert one[-1] == f"host {LIVE}"
    assert not any(line.startswith("ID ") for line in one)

    several = status_lines(
        document(
            [host(LIVE, "live", 3, 0.4), host(LOST, "lost", 1, 75.0), host(LEFT, "left", 0, 9e4)]
        )
    )
    at = several.index(f"host {LIVE}")
    assert several[at + 1] == "hosts 1 live, 1 lost, 1 left"
    assert several[at + 2].split() == [
        "ID",
        "HOSTNAME",
        "STATE",
        "SEEN",
        "SESSIONS",
        "PID",
        "VERSION",
    ]
    rows = [line.split() for line in several[at + 3 :]]
    assert [r[:5] for r in rows] == [
        [f"{LIVE}*", "node", "live", "0s", "ago"],
        [MACHINE[:12], "node", "lost", "1m15s", "ago"],
        [LEFT, "node", "left", "1d01h", "ago"],
    ]
    assert all(len(line) <= 80 for line in several)

    broken = status_lines(document([], "the host registry could not be read: gone"))
    assert broken[-2:] == [f"host {LIVE}", "hosts: the host registry could not be read: gone"]
    # A daemon that does not report its host (older, or not wired): nothing is added.
    older = document([])
    for key in ("host", "hosts", "hosts_error"):
        del older[key]
    assert status_lines(older)[-1].startswith("attach streams")


def test_status_colours_a_lost_host_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal:
        def write(self, text: str) -> int:
            return len(text)

        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setattr(sys, "stdout", Terminal())
    printed = io.StringIO()  # as printed: through the stream that lets only our codes by
    shown = status_lines(document([host(LIVE, "live", 3, 0.4), host(LOST, "lost", 1, 75.0)]))
    Escaped(printed).write("\n".join(shown))
    lines = printed.getvalue().split("\n")
    lost = next(line for line in lines if line.startswith(MACHINE[:12]))
    assert "\x1b[31mlost\x1b[0m" in lost
