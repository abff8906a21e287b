"""A start or restart with MCP servers configured (the daemon as a real process): one
worker starts first, alone, and takes the interrupted turn as soon as it is ready; the
rest of the pool follows it.

The MCP server is `tests.mcp_servers.gated`, whose start the test holds: every assertion
is on what the daemon shows while a start is held, never on how long something took."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.store import Store
from tests.conftest import PYTHON, REPO
from tests.daemon import Daemon, daemons, events, inject, turn_ended, wait_until

__all__ = ["daemons"]  # the fixture

Daemons = Callable[..., Daemon]
pytestmark = pytest.mark.timeout(240)


def gated(held: Path, free: int) -> dict[str, Any]:
    """The config of a `gated` server: held until `held/gate` exists, `free` let through."""
    return {
        "name": "g",
        "command": [PYTHON, "-m", "tests.mcp_servers.gated", "g"],
        "cwd": str(REPO),
        "env": {
            "GATED_EVENTS": str(held / "events"),
            "GATED_GATE": str(held / "gate"),
            "GATED_FREE": str(free),
        },
        # Longer than the daemon gives its pool to start: a held server never gives up.
        "start_timeout": 120.0,
    }


def held_slots(daemon: Daemon) -> list[dict[str, Any]] | None:
    """The slots, once a worker's heartbeat said its server is starting (held)."""
    try:
        slots: list[dict[str, Any]] = daemon.status()["slots"]
    except (httpx.HTTPError, OSError):
        return None  # the API is not up yet
    starting = [{"name": "g", "state": "starting"}]
    return slots if any(slot["mcp"] == starting for slot in slots) else None


def test_at_boot_one_worker_starts_first_and_the_rest_once_it_is_ready(
    daemons: Daemons, tmp_path: Path
) -> None:
    held = tmp_path / "mcp"
    held.mkdir()
    daemon = daemons(pool={"spare": 1}, mcp={"servers": [gated(held, free=0)]})
    daemon.start(wait=False)
    slots = wait_until(lambda: held_slots(daemon), 60, "a worker with its server held")
    # Its server is held, so it is not ready: no other worker was started meanwhile.
    assert [slot["slot"] for slot in slots if slot["worker"]] == [0], slots
    assert not slots[0]["ready"] and not slots[0]["spare"]

    (held / "gate").touch()
    wait_until(daemon.ready, 60, "the whole pool to be ready")
    slots = daemon.status()["slots"]
    assert all(slot["ready"] for slot in slots), slots
    # The spare is one of those that followed: the first may take turns at once.
    assert [slot["slot"] for slot in slots if slot["spare"]] in ([1], [2]), slots


def test_an_interrupted_turn_goes_on_while_the_other_workers_still_start(
    daemons: Daemons, tmp_path: Path
) -> None:
    # After the restart the first server to start passes (GATED_FREE), the others wait for
    # the gate: so one worker is ready and two are not.
    held = tmp_path / "mcp"
    held.mkdir()
    mcp_gate = held / "gate"
    mcp_gate.touch()  # the first boot starts at once
    daemon = daemons(pool={"spare": 1}, mcp={"servers": [gated(held, free=1)]})
    daemon.start()
    with Store(daemon.url, migrate=False) as store:
        session = store.sessions.create("admin").id
        gate = tmp_path / "turn-gate"  # the turn is held until its daemon is dead
        seq = inject(store, session, f"/gate {gate} held")
        wait_until(
            lambda: any(e.type == "turn_started" for e in store.events.read(session, after=seq)),
            30,
            "the held turn to start",
        )
        mcp_gate.unlink()
        for free in held.glob("free-*"):
            free.unlink()
        daemon.signal(signal.SIGKILL)  # its workers and their servers die with it
        daemon.wait(10)
        gate.touch()

        daemon.start(wait=False)
        ended = wait_until(lambda: turn_ended(store, session, seq), 45, "the continued turn")
        # Two workers are still starting their servers: the daemon is not ready yet.
        assert not daemon.ready()
        slots = daemon.status()["slots"]
        assert sum(1 for slot in slots if slot["ready"]) == 1, slots

        assert ended.payload["outcome"] == "completed"
        found = events(store, session)
        notes = [e for e in found if e.type == "continuation"]
        assert len(notes) == 1 and notes[0].payload["cause"] == "daemon_restart"
        replies = [e.payload["text"] for e in found if e.type == "model_response"]
        assert replies[-1] == f"echo: /gate {gate} held"

        mcp_gate.touch()
        wait_until(daemon.ready, 60, "the whole pool to be ready")
