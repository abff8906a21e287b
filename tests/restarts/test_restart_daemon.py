"""Requested restarts against a real daemon in the foreground: an agent asks, five times,
while another session's turn is held in flight; the daemon re-executes in place (the same
pid, systemd told RELOADING=1 then READY=1), the asking session hears of each restart once
and answers once, the other turn finishes once, and the breaker counts nothing."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.store import Store
from tests.daemon import Daemon, daemons, turnkeeper
from tests.restart_harness import RESTART_CONFIG, Rounds, inject, started_after, status, wait_for

__all__ = ["daemons"]


class NotifyListener:
    """A NOTIFY_SOCKET standing in for systemd: every datagram, in order."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.received: list[str] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._done.is_set():
            try:
                self.received.append(self.sock.recv(65536).decode())
            except TimeoutError:
                continue
            except OSError:
                return

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)
        self.sock.close()


@pytest.mark.timeout(420)
@pytest.mark.slow
def test_five_agent_restarts_in_the_foreground(
    daemons: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = daemons(restart=RESTART_CONFIG)
    notify = NotifyListener(tmp_path / "notify.sock")
    daemon.env = {"NOTIFY_SOCKET": str(notify.path)}
    try:
        daemon.start()
        store = Store(daemon.url)
        rounds = Rounds(daemon.client, store, tmp_path, daemon.log, lambda: daemon.pid)
        rounds.open()
        for number in range(1, 6):
            rounds.round(number)
        assert daemon.proc is not None and daemon.proc.poll() is None
        # systemd heard each restart begin and end, from the same process.
        states = [m for m in notify.received if "RELOADING=1" in m or "READY=1" in m]
        assert [("RELOADING=1" in m) for m in states] == [False] + [True, False] * 5, states
        assert all("MONOTONIC_USEC=" in m for m in states if "RELOADING=1" in m), states
        assert not any("STOPPING=1" in m for m in notify.received), notify.received
        # The boot log: six boots of one pid, every one before the last ended clean.
        boots = [b for b in store.boots.recent(10)][:6]
        assert {b.pid for b in boots} == {daemon.pid}, boots
        assert [b.outcome for b in boots] == [None] + ["clean"] * 5, boots
        listed = turnkeeper(daemon, "boots")
        assert listed.returncode == 0 and listed.stdout.count("clean") >= 5, listed.stdout
        store.close()
    finally:
        notify.close()


@pytest.mark.timeout(240)
def test_an_operator_restart_with_its_own_drain_lets_the_turn_in_flight_finish(
    daemons: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = daemons(restart=RESTART_CONFIG).start()
    store = Store(daemon.url)
    rounds = Rounds(daemon.client, store, tmp_path, daemon.log, lambda: daemon.pid)
    rounds.open()
    boot = daemon.status()["boot"]["id"]
    gate = tmp_path / "drained"
    held = inject(daemon.client, rounds.other, f"/gate {gate} drain")
    turn = wait_for(lambda: started_after(store, rounds.other, held), 30, "the turn", daemon.log)
    asked = turnkeeper(daemon, "restart", "--drain", "60", "--reason", "upgrade", "--no-wait")
    assert asked.returncode == 0, asked.stdout + asked.stderr
    # Intake takes messages while it drains (for the next boot); the turn in flight goes
    # on and finishes.
    wait_for(lambda: daemon.status()["boot"]["stopping"], 30, "the drain to begin", daemon.log)
    late = inject(daemon.client, rounds.asker, "late")
    again = turnkeeper(daemon, "restart", "--no-wait")
    assert again.returncode == 0 and "already in progress" in again.stdout, again.stdout
    gate.touch()
    after = wait_for(
        lambda: (s := status(daemon.client)) is not None and s["boot"]["id"] != boot and s,
        90,
        "the new boot",
        daemon.log,
    )
    assert after["breaker"]["unclean_boots"] == 0
    endings = [e for e in store.events.read(rounds.other) if e.type == "turn_ended"]
    assert [(e.turn_id, e.payload["outcome"]) for e in endings] == [(turn, "completed")]
    assert not [e for e in store.events.read(rounds.other) if e.type == "continuation"]
    wait_for(lambda: started_after(store, rounds.asker, late), 60, "the late message", daemon.log)
    # An operator's restart tells no session; its row says how it went.
    (row,) = store.restarts.list(limit=10)
    assert (row.state, row.outcome, row.requested_by, row.reason) == (
        "done",
        "ok",
        "admin",
        "upgrade",
    ), row
    assert not [e for e in store.events.read(rounds.asker) if e.type == "notice"]
    store.close()
