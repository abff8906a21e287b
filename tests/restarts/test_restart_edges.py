"""Requested restarts that must not go as asked, against a real daemon: a SIGTERM during the
restart's drain (a stop instead, settled `failed` once), a configuration on disk that would
not start (refused, the daemon goes on), and an agent's request waiting for the turn that
asked to end before anything stops."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import tomli_w

from supervisor.store import Store
from tests.daemon import Daemon, daemons, turnkeeper
from tests.restart_harness import (
    RESTART_CONFIG,
    inject,
    new_session,
    read,
    started_after,
    status,
    wait_for,
)

__all__ = ["daemons"]


@pytest.mark.timeout(180)
def test_sigterm_during_the_drain_stops_and_the_request_fails_once(
    daemons: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = daemons(restart=RESTART_CONFIG).start()
    store = Store(daemon.url)
    other = new_session(daemon.client, "held")
    held = inject(daemon.client, other, f"/gate {tmp_path / 'never'} held")
    wait_for(lambda: started_after(store, other, held), 30, "the held turn", daemon.log)
    boot = daemon.status()["boot"]["id"]
    asked = turnkeeper(daemon, "restart", "--drain", "600", "--no-wait")
    assert asked.returncode == 0, asked.stdout + asked.stderr
    wait_for(lambda: "draining: up to 600 s" in daemon.log(), 30, "the drain", daemon.log)
    # The stop's own drain (shutdown.drain_budget, 0) cuts the restart's 600 s short.
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(60) == 0, daemon.log()
    assert "stopping instead, with a drain of at most 0 s from now" in daemon.log()
    # The held turn was cut by the stop, not waited for: no end, left to recovery.
    assert not [e for e in read(store, other) if e.type == "turn_ended"]
    (row,) = store.restarts.list()
    assert (row.state, row.outcome) == ("done", "failed"), row
    assert "told to stop (SIGTERM)" in row.detail, row.detail
    (ended,) = [b for b in store.boots.recent(5) if b.boot_id == boot]
    assert ended.outcome == "clean" and "restart" not in (ended.breaker or {}), ended
    daemon.start()
    assert store.restarts.get(row.id) == row  # settled once: the next start changes nothing
    assert daemon.status()["breaker"]["unclean_boots"] == 0
    store.close()


@pytest.mark.timeout(180)
def test_a_configuration_that_would_not_start_is_refused_and_the_daemon_goes_on(
    daemons: Callable[..., Daemon],
) -> None:
    daemon = daemons(restart=RESTART_CONFIG).start()
    store = Store(daemon.url)
    asker = new_session(daemon.client, "asks")
    boot = daemon.status()["boot"]["id"]
    broken = {**daemon.config, "agent": {"class": "tests.nowhere:Missing"}}
    daemon.config_path.write_text(tomli_w.dumps(broken))
    # An operator: refused with the start's own line, before anything stops.
    refused = turnkeeper(daemon, "restart", "--no-wait")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "agent.class" in refused.stderr and "would not come back" in refused.stderr
    assert store.restarts.list() == []
    # An agent: its request is settled `failed` at once, and its session told.
    asked = inject(daemon.client, asker, "/restart after an edit")

    def answered() -> bool:
        events = read(store, asker)
        results = [e for e in events if e.type == "restart_result"]
        turn = results and started_after(store, asker, results[0].seq)
        return bool(turn) and any(e.type == "turn_ended" and e.turn_id == turn for e in events)

    wait_for(answered, 60, "the refused request's answer", daemon.log)
    (row,) = store.restarts.list()
    assert (row.state, row.outcome, row.session) == ("done", "failed", asker), row
    assert "agent.class" in row.detail
    events = [e for e in read(store, asker) if e.seq > asked]
    (notice,) = [e for e in events if e.type == "notice"]
    assert notice.payload["outcome"] == "failed" and "did not" in notice.payload["text"]
    after = status(daemon.client)
    assert after is not None and after["boot"]["id"] == boot  # it never stopped
    store.close()


@pytest.mark.timeout(180)
def test_an_agents_restart_waits_for_the_turn_that_asked(
    daemons: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = daemons(restart=RESTART_CONFIG).start()
    store = Store(daemon.url)
    asker = new_session(daemon.client, "asks, then goes on")
    boot = daemon.status()["boot"]["id"]
    gate = tmp_path / "go-on"
    asked = inject(daemon.client, asker, f"/ask-restart {gate} new tools")
    turn = wait_for(lambda: started_after(store, asker, asked), 30, "the turn", daemon.log)
    host = daemon_host(daemon)
    row = wait_for(lambda: store.restarts.active(host), 30, "the request", daemon.log)
    # The turn that asked is in flight: the request waits, the daemon serves on.
    waits = f"restart {row.id} waits up to"
    wait_for(lambda: waits in daemon.log(), 30, "the request to wait", daemon.log)
    assert store.restarts.get(row.id).state == "pending"  # type: ignore[union-attr]
    assert daemon.status()["boot"]["id"] == boot
    gate.touch()
    wait_for(
        lambda: (s := status(daemon.client)) is not None and s["boot"]["id"] != boot,
        90,
        "the restart",
        daemon.log,
    )
    events = read(store, asker)
    ended = [e for e in events if e.type == "turn_ended" and e.turn_id == turn]
    assert [e.payload["outcome"] for e in ended] == ["completed"], ended
    assert not [e for e in events if e.type == "continuation"]  # never cut by the restart
    assert ended[0].seq < next(e.seq for e in events if e.type == "notice")
    store.close()


def daemon_host(daemon: Daemon) -> str:
    """The host id the daemon runs as (from /v1/status)."""
    return str(daemon.status()["host"]["id"])


def test_a_restart_whose_stop_failed_exits_instead_of_re_executing() -> None:
    """The same pid started again would find its host row still held (by itself, alive:
    exit 78) or its boot row never ended (the breaker would count it): exit 1 instead."""
    from supervisor.contract.config import Config
    from supervisor.daemon import Daemon as Supervisor

    daemon = Supervisor(Config())
    assert not daemon.comes_back()  # no restart asked for
    daemon.reexec = True
    daemon.step_failed = {"drain", "http listener"}  # a drain cut at its budget is no failure
    assert daemon.comes_back()
    for step in ("peer deregistration", "boot row"):
        daemon.step_failed = {step}
        assert not daemon.comes_back()
