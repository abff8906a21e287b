"""Background tasks with the daemon as a real process (issue 17): a task running when
the supervisor is SIGKILLed ends with exactly one outcome after the restart (`lost` with
a notice, or one retried run for a kind that retries); a task that finishes while the
daemon is down is reported once after the restart; a worker SIGKILLed while its task runs
loses nothing; a cancel stops the command's whole process group."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from supervisor.store import EventRecord, Store, TaskInfo
from tests.daemon import Daemon, daemons, events, inject, turn_ended, wait_until

__all__ = ["daemons"]  # the fixture

Daemons = Callable[..., Daemon]
pytestmark = pytest.mark.timeout(240)

# A command held by a gate: it waits for the file `gate`, then prints and exits `code`.
GATED = [
    "sh",
    "-c",
    'echo "started $$"; while [ ! -e "$1" ]; do sleep 0.05; done; echo finished; exit "$2"',
    "sh",
    "{gate}",
    "{code}",
]
ARGS = {"gate": "^/[A-Za-z0-9/_.-]+$", "code": "^[0-9]{1,3}$"}
KINDS = [
    {"name": "gated", "command": GATED, "args": ARGS},
    {"name": "gated-retry", "command": GATED, "args": ARGS, "retry_on_restart": True},
]
FAST = {"reconcile_interval": 0.5, "lost_grace": 4.0, "kill_grace": 1.0}


def tasks_daemon(daemons: Daemons, **tasks: object) -> Daemon:
    return daemons(tasks={"kinds": KINDS, **FAST, **tasks})


def of(store: Store, session_id: str, kind: str) -> list[EventRecord]:
    return [e for e in events(store, session_id) if e.type == kind]


def started(store: Store, daemon: Daemon, kind: str, code: int = 0) -> tuple[str, TaskInfo, Path]:
    """A session whose turn started a task of `kind` held by a gate, its runner running:
    the session id, the task's row and the gate."""
    gate = daemon.root / f"gate-{time.monotonic_ns()}"
    session = store.sessions.create("admin").id
    args = json.dumps({"gate": str(gate), "code": str(code)})
    seq = inject(store, session, f"/task {kind} {args}")
    wait_until(lambda: turn_ended(store, session, seq), 30, "the turn that starts the task")
    [task] = store.tasks.of_session(session)

    def running() -> TaskInfo | None:
        row = store.tasks.get(task.id)
        return row if row is not None and row.runner_pid and row.status == "running" else None

    return session, wait_until(running, 30, "the task's runner"), gate


def results(store: Store, session: str) -> list[EventRecord]:
    return of(store, session, "task_result")


def answered(store: Store, session: str, count: int = 1) -> list[EventRecord] | None:
    """The session's `count` task results, once a turn after the last has ended."""
    found = results(store, session)
    if len(found) < count:
        return None
    info = store.sessions.get(session)
    return found if turn_ended(store, session, found[-1].seq) and not info.pending else None


def alive(pid: int | None, create_time: float | None) -> bool:
    """Whether that very process runs (an exited one its parent has not reaped yet does
    not: it is a zombie until the daemon's next look at its runners)."""
    try:
        proc = psutil.Process(pid) if pid is not None else None
        return (
            proc is not None
            and proc.create_time() == create_time
            and proc.status() != psutil.STATUS_ZOMBIE
        )
    except psutil.Error:
        return False


def command_pids(daemon: Daemon) -> list[psutil.Process]:
    """The gated commands of this daemon's tasks still running, wherever they are."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if len(cmdline) > 4 and cmdline[0] == "sh" and str(daemon.root) in cmdline[4]:
            found.append(proc)
    return found


@pytest.mark.parametrize("death", ["SIGKILL", "SIGTERM"])
def test_a_task_running_when_the_daemon_stops_is_lost_once_with_a_notice(
    daemons: Daemons, death: str
) -> None:
    daemon = tasks_daemon(daemons).start()
    with Store(daemon.url, migrate=False) as store:
        session, task, gate = started(store, daemon, "gated")
        wait_until(lambda: command_pids(daemon), 30, "the task's command")
        if death == "SIGTERM":  # the teardown stops the runner and its command like any child
            daemon.signal(signal.SIGTERM)
            assert daemon.wait(30) == 0
            assert not alive(task.runner_pid, task.runner_started)
            assert command_pids(daemon) == []
            assert store.tasks.get(task.id).status == "running"  # no outcome: it was stopped
        else:
            daemon.signal(signal.SIGKILL)
            daemon.wait(10)
        daemon.start()  # its sweep kills what an earlier boot left running
        found = wait_until(lambda: answered(store, session), 60, "the lost task's report")
        assert not alive(task.runner_pid, task.runner_started)
        assert command_pids(daemon) == []
        gate.touch()  # a command that somehow survived would finish now
        time.sleep(2.0)  # and a second outcome would land now
        [result] = results(store, session)
        assert found == [result]
        assert (result.payload["task"], result.payload["status"]) == (task.id, "lost")
        notices = [e.payload["text"] for e in of(store, session, "notice")]
        assert [n for n in notices if task.id in n and "was lost" in n], notices
        row = store.tasks.get(task.id)
        assert row is not None
        assert (row.status, row.result_seq, row.attempt) == ("lost", result.seq, 1)
        assert store.tasks.counts()["running"] == 0


def test_a_task_of_a_kind_that_retries_runs_again_once_and_reports_that_run(
    daemons: Daemons,
) -> None:
    daemon = tasks_daemon(daemons).start()
    with Store(daemon.url, migrate=False) as store:
        session, task, gate = started(store, daemon, "gated-retry", code=3)
        daemon.signal(signal.SIGKILL)
        daemon.wait(10)
        daemon.start()

        def retried() -> TaskInfo | None:
            row = store.tasks.get(task.id)
            ok = row is not None and row.attempt == 2 and row.status == "running"
            return row if ok and row.runner_pid else None

        again = wait_until(retried, 60, "the task's second run")
        assert again.runner_pid != task.runner_pid
        notices = [e.payload["text"] for e in of(store, session, "notice")]
        assert [n for n in notices if task.id in n and "started" in n], notices
        assert results(store, session) == []  # nothing reported for the lost first run
        gate.touch()
        found = wait_until(lambda: answered(store, session), 60, "the second run's report")
        time.sleep(1.0)
        [result] = results(store, session)
        assert found == [result]
        assert (result.payload["status"], result.payload["exit_code"]) == ("failed", 3)
        assert "finished" in result.payload["text"]
        row = store.tasks.get(task.id)
        assert row is not None and (row.status, row.attempt) == ("failed", 2)


def test_an_outcome_recorded_while_the_daemon_is_down_is_reported_once_after(
    daemons: Daemons,
) -> None:
    daemon = tasks_daemon(daemons).start()
    with Store(daemon.url, migrate=False) as store:
        session, task, gate = started(store, daemon, "gated")
        daemon.signal(signal.SIGKILL)
        daemon.wait(10)
        gate.touch()  # the runner outlives its supervisor and records the outcome itself

        def recorded() -> TaskInfo | None:
            row = store.tasks.get(task.id)
            return row if row is not None and row.status == "succeeded" else None

        row = wait_until(recorded, 30, "the runner's outcome")
        assert row.result_seq is None and results(store, session) == []
        daemon.start()
        wait_until(lambda: answered(store, session), 60, "the outcome's report")
        time.sleep(1.0)
        [result] = results(store, session)
        assert (result.payload["task"], result.payload["status"]) == (task.id, "succeeded")
        assert "finished" in result.payload["text"]
        output = daemon.state / "tasks" / f"{task.id}.log"
        assert "finished" in output.read_text()


def test_a_worker_killed_while_its_task_runs_loses_nothing(daemons: Daemons) -> None:
    daemon = tasks_daemon(daemons).start()
    with Store(daemon.url, migrate=False) as store:
        session, task, gate = started(store, daemon, "gated")
        for pid in daemon.worker_pids().values():
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: len(daemon.worker_pids(ready=True)) >= 2, 30, "the workers again")
        assert alive(task.runner_pid, task.runner_started)
        gate.touch()
        found = wait_until(lambda: answered(store, session), 60, "the task's report")
        [result] = found
        assert result.payload["status"] == "succeeded"
        # The session's next turn read the result.
        replies = [e.payload["text"] for e in of(store, session, "model_response")]
        assert any(task.id in text for text in replies[1:]), replies


def test_a_cancel_stops_the_commands_whole_group_and_is_reported_once(
    daemons: Daemons,
) -> None:
    daemon = tasks_daemon(daemons).start()
    with Store(daemon.url, migrate=False) as store:
        session, task, _gate = started(store, daemon, "gated")
        response = daemon.client().delete(f"/v1/tasks/{task.id}")
        assert response.status_code in (200, 202), response.text
        found = wait_until(lambda: answered(store, session), 30, "the cancel's report")
        [result] = found
        assert result.payload["status"] == "cancelled"
        assert command_pids(daemon) == []  # the group was stopped before the outcome
        # The runner exits once it has recorded the outcome, which may be just after.
        wait_until(lambda: not alive(task.runner_pid, task.runner_started), 10, "the runner's exit")
        assert "turnkeeper_tasks" in daemon.client().get("/metrics").text
