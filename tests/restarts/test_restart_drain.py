"""A requested restart drains by default (`restart.drain_budget`, 300 s): with a 10 s turn
and a 15 s background task in flight, and a message sent during the drain, the daemon
re-executes in place once both have finished (the same pid), interrupting nothing: no
`continuation`, no `notice`, every turn `completed`, the task's result its real output,
and the message sent during the drain taken (202) and answered after the restart."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from supervisor.store import EventRecord, Store
from tests.daemon import Daemon, daemons, events, turnkeeper, wait_until
from tests.restart_harness import inject, new_session, started_after, status, wait_for

__all__ = ["daemons"]

SLEEPER = {
    "name": "sleeper",
    "command": ["sh", "-c", 'sleep "$1"; echo "slept $1 s"', "sh", "{seconds}"],
    "args": {"seconds": "^[0-9]{1,3}$"},
}


def of(store: Store, session: str, kind: str) -> list[EventRecord]:
    return [e for e in events(store, session) if e.type == kind]


def answered(store: Store, session: str, after: int) -> EventRecord | None:
    """The `turn_ended` of the first turn started after seq `after`."""
    turn = started_after(store, session, after)
    ends = [e for e in of(store, session, "turn_ended") if e.turn_id == turn]
    return ends[0] if turn is not None and ends else None


@pytest.mark.timeout(240)
def test_a_restart_lets_the_turn_and_the_task_in_flight_finish_and_takes_messages(
    daemons: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = daemons(tasks={"kinds": [SLEEPER], "reconcile_interval": 0.5}).start()
    pid, boot = daemon.pid, daemon.status()["boot"]["id"]
    store = Store(daemon.url, migrate=False)
    tasked, held, late = (new_session(daemon.client, t) for t in ("task", "turn", "late"))

    asked = inject(daemon.client, tasked, "/task sleeper " + json.dumps({"seconds": "15"}))
    wait_for(lambda: answered(store, tasked, asked), 30, "the turn that starts it", daemon.log)
    [task] = store.tasks.of_session(tasked)
    wait_until(lambda: (store.tasks.get(task.id) or task).runner_pid, 30, "the task's runner")
    holding = inject(daemon.client, held, "/hold 10")
    turn = wait_for(lambda: started_after(store, held, holding), 30, "the 10 s turn", daemon.log)

    began = time.monotonic()
    restart = turnkeeper(daemon, "restart", "--reason", "a new configuration", "--no-wait")
    assert restart.returncode == 0, restart.stdout + restart.stderr
    wait_for(lambda: daemon.status()["boot"]["stopping"], 30, "the drain to begin", daemon.log)
    sent = inject(daemon.client, late, "sent during the drain")  # 202: taken, not refused
    assert started_after(store, late, sent) is None  # no turn starts in the drain
    again = turnkeeper(daemon, "restart", "--no-wait")
    assert again.returncode == 0 and "already in progress" in again.stdout, again.stdout

    after = wait_for(
        lambda: (s := status(daemon.client)) is not None and s["boot"]["id"] != boot and s,
        120,
        "the new boot",
        daemon.log,
    )
    took = time.monotonic() - began
    assert daemon.proc is not None and daemon.proc.poll() is None and daemon.pid == pid
    assert after["breaker"]["unclean_boots"] == 0
    # The drain waited for both (the task's 15 s), not for its 300 s budget.
    assert 9.0 < took < 100.0, took

    reply = wait_for(
        lambda: answered(store, late, sent), 60, "the late message's answer", daemon.log
    )
    new_boot = store.boots.recent(1)[0]
    assert new_boot.boot_id == after["boot"]["id"] and reply.created_at >= new_boot.started_at
    results = wait_for(lambda: of(store, tasked, "task_result"), 30, "the result", daemon.log)
    [result] = results
    assert (result.payload["task"], result.payload["status"]) == (task.id, "succeeded")
    assert "slept 15 s" in result.payload["text"]
    wait_for(lambda: answered(store, tasked, result.seq), 60, "the result's turn", daemon.log)

    [ended] = [e for e in of(store, held, "turn_ended") if e.turn_id == turn]
    assert ended.payload["outcome"] == "completed"
    for session in (tasked, held, late):
        kinds = {e.type for e in events(store, session)}
        assert not kinds & {"continuation", "notice"}, (session, kinds)
        outcomes = {e.payload["outcome"] for e in of(store, session, "turn_ended")}
        assert outcomes == {"completed"}, (session, outcomes)
    (row,) = store.restarts.list(limit=10)
    assert (row.state, row.outcome, row.drain) == ("done", "ok", None), row
    store.close()


GATED = {
    "name": "gated",
    "command": [
        "sh",
        "-c",
        'while [ ! -e "$1" ]; do sleep 0.05; done; echo "through"',
        "sh",
        "{gate}",
    ],
    "args": {"gate": "^/[A-Za-z0-9/_.-]+$"},
}


@pytest.mark.timeout(180)
def test_a_task_running_through_a_restart_in_place_is_adopted_and_reported_once(
    daemons: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = daemons(tasks={"kinds": [GATED], "reconcile_interval": 0.5}).start()
    boot = daemon.status()["boot"]["id"]
    store = Store(daemon.url, migrate=False)
    session = new_session(daemon.client, "task")
    gate = tmp_path / "gate"
    asked = inject(daemon.client, session, "/task gated " + json.dumps({"gate": str(gate)}))
    wait_for(lambda: answered(store, session, asked), 30, "the turn that starts it", daemon.log)
    [task] = store.tasks.of_session(session)
    running = wait_until(
        lambda: (row := store.tasks.get(task.id)) is not None and row.runner_pid and row,
        30,
        "the task's runner",
    )
    runner = psutil.Process(running.runner_pid)

    restart = turnkeeper(daemon, "restart", "--drain", "0", "--reason", "cut, not the task")
    assert restart.returncode == 0, restart.stdout + restart.stderr
    after = wait_for(lambda: status(daemon.client), 60, "the new boot", daemon.log)
    assert after["boot"]["id"] != boot
    # The same runner, still this process's child, the new boot's to watch.
    assert runner.is_running() and runner.ppid() == daemon.pid
    assert f"task {task.id} (gated) adopted" in daemon.log()
    row = store.tasks.get(task.id)
    assert row is not None and (row.status, row.runner_pid) == ("running", runner.pid)

    gate.touch()
    results = wait_for(lambda: of(store, session, "task_result"), 30, "the result", daemon.log)
    wait_for(lambda: answered(store, session, results[-1].seq), 30, "its turn", daemon.log)
    wait_until(lambda: not runner.is_running() or runner.status() != "zombie", 10, "its reaping")
    [result] = of(store, session, "task_result")
    assert (result.payload["status"], result.payload["exit_code"]) == ("succeeded", 0)
    assert "through" in result.payload["text"]
    assert not of(store, session, "notice")
    store.close()
