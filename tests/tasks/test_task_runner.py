"""The task runner with real processes, real signals and a real database: the outcome it
records (succeeded, failed, could not start, timed out, cancelled), the output file
bounded on disk, the heartbeat, and the stops that record nothing (SIGTERM, a row that
moved on), each leaving no process of the command's group behind. Commands are held by a
gate file, never raced against a sleep."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest

from supervisor.contract.mcp_env import INHERITED_ENV
from supervisor.store import Store, TaskInfo
from supervisor.tasks.runner import RunnerSpec, launch
from tests.conftest import BACKENDS
from tests.daemon import wait_until

pytestmark = pytest.mark.timeout(120)

# Held by a gate: it starts a grandchild, writes "<its pid> <grandchild's pid>" to `ready`,
# waits for the file `gate`, then stops its grandchild and exits with `code`. A stubborn
# one (and its children) ignores SIGTERM.
GATED = (
    '[ "$4" = stubborn ] && trap "" TERM; '
    'sleep 1000 & echo "$$ $!" > "$1.tmp" && mv "$1.tmp" "$1"; echo started; '
    'while [ ! -e "$2" ]; do sleep 0.05; done; echo finished; kill $!; exit "$3"'
)


class Tasks:
    """Tasks admitted by a turn and claimed by a daemon, and runners started for them."""

    def __init__(self, store: Store, directory: Path) -> None:
        self.store, self.directory = store, directory
        self.session = store.sessions.create("alice").id
        lease = store.leases.acquire(self.session, "h/boot1/w1", 30)
        assert lease is not None
        self.token, self.turn = lease.token, uuid.uuid4().hex
        store.events.append(
            self.session, "turn_started", {}, token=self.token, turn_id=self.turn, writer="worker"
        )

    def claimed(self) -> TaskInfo:
        started = self.store.tasks.start(
            self.session,
            "sleep",
            {},
            token=self.token,
            turn_id=self.turn,
            max_running=50,
            call_id=uuid.uuid4().hex,
        )
        task = self.store.tasks.claim(started.task.id, "h", "h/boot1")
        assert task is not None and task.status == "running"
        return task

    def spec(self, task: TaskInfo, argv: list[str], **changes: Any) -> RunnerSpec:
        spec = RunnerSpec(
            task=task.id,
            attempt=task.attempt,
            argv=argv,
            env={},
            cwd=str(self.directory / task.id),
            timeout=60.0,
            kill_grace=1.0,
            max_output=1 << 20,
            output=str(self.directory / f"{task.id}.log"),
            store_url=self.store.url,
            heartbeat=0.2,
            boot="boot1",
            host="h",
            create_cwd=True,
        )
        return replace(spec, **changes)

    def gated(self, task: TaskInfo, code: int = 0, stubborn: bool = False) -> list[str]:
        """A command held by its gate (`self.gate(task)`), ready once `self.ready(task)`."""
        mode = "stubborn" if stubborn else "plain"
        return [
            "sh",
            "-c",
            GATED,
            "sh",
            str(self.ready(task)),
            str(self.gate(task)),
            str(code),
            mode,
        ]

    def ready(self, task: TaskInfo) -> Path:
        return self.directory / f"{task.id}.ready"

    def gate(self, task: TaskInfo) -> Path:
        return self.directory / f"{task.id}.gate"

    def pids(self, task: TaskInfo) -> tuple[int, int]:
        """The command's pid and its grandchild's, once the command is ready."""
        ready = self.ready(task)
        wait_until(ready.exists, 30, "the command to be ready")
        command, grandchild = ready.read_text().split()
        return int(command), int(grandchild)

    def row(self, task: TaskInfo) -> TaskInfo:
        row = self.store.tasks.get(task.id)
        assert row is not None
        return row


@pytest.fixture
def tasks(store: Store, tmp_path: Path) -> Tasks:
    directory = tmp_path / "tasks"
    directory.mkdir(mode=0o700)
    return Tasks(store, directory)


def ended(runner: subprocess.Popen[bytes], timeout: float = 30) -> int:
    """The runner's exit status once it exited (reaped, as the supervisor would)."""
    return runner.wait(timeout=timeout)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def group_is_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def assert_all_gone(*pids: int) -> None:
    """Nothing of the command is left: not its processes, not its group, not its row in
    the child registry."""
    wait_until(lambda: not any(alive(pid) for pid in pids), 10, "the processes to be gone")
    assert group_is_gone(pids[0])


@pytest.mark.parametrize("db_url", BACKENDS, indirect=True)
def test_a_command_that_exits_records_its_outcome_with_output_and_tail(tasks: Tasks) -> None:
    task = tasks.claimed()
    script = 'echo "out $1"; echo err >&2; pwd'
    runner = launch(tasks.spec(task, ["sh", "-c", script, "sh", "one two"]))
    assert ended(runner) == 0
    row = tasks.row(task)
    assert (row.status, row.exit_code, row.reason) == ("succeeded", 0, "")
    cwd = tasks.directory / task.id
    assert row.output_tail == f"out one two\nerr\n{cwd}\n"
    assert row.duration is not None and 0 <= row.duration < 30
    output = tasks.directory / f"{task.id}.log"
    assert output.read_text() == row.output_tail
    assert output.stat().st_mode & 0o777 == 0o600
    assert cwd.stat().st_mode & 0o777 == 0o700  # the task's own directory, made for it
    log = Path(f"{output}.runner")
    assert log.stat().st_mode & 0o777 == 0o600 and "succeeded" in log.read_text()
    assert tasks.store.children.of_boot("boot1") == []  # recorded, then forgotten


def test_a_failing_command_records_its_exit_status(tasks: Tasks) -> None:
    task = tasks.claimed()
    runner = launch(tasks.spec(task, ["sh", "-c", "echo broken; exit 3"]))
    assert ended(runner) == 0
    row = tasks.row(task)
    assert (row.status, row.exit_code, row.output_tail) == ("failed", 3, "broken\n")


def test_a_command_that_cannot_start_fails_saying_why(tasks: Tasks) -> None:
    missing, plain = tasks.claimed(), tasks.claimed()
    not_executable = tasks.directory / "script.sh"
    not_executable.write_text("#!/bin/sh\necho hi\n")
    runners = [
        launch(tasks.spec(missing, [str(tasks.directory / "no-such-command")])),
        launch(tasks.spec(plain, [str(not_executable)])),
    ]
    assert [ended(runner) for runner in runners] == [0, 0]
    row = tasks.row(missing)
    assert (row.status, row.exit_code) == ("failed", None)
    assert "could not start (No such file or directory" in row.reason
    assert "no-such-command" in row.reason
    row = tasks.row(plain)
    assert row.status == "failed" and "could not start (Permission denied" in row.reason


def test_a_command_past_its_timeout_is_stopped_with_its_whole_group(tasks: Tasks) -> None:
    task = tasks.claimed()
    # It ignores SIGTERM (so SIGKILL follows the grace). It also starts a process in a
    # session of its own, whose parent exits at once: only a subreaper gets it back.
    marker = tasks.directory / "escaped"
    escape = f"setsid sh -c 'sleep 1000 & echo $! > \"{marker}\"' & "
    argv = tasks.gated(task, stubborn=True)
    argv[2] = escape + argv[2]
    runner = launch(tasks.spec(task, argv, timeout=1.5, kill_grace=0.5))
    command, grandchild = tasks.pids(task)
    wait_until(lambda: marker.exists() and marker.read_text().strip(), 10, "the escapee")
    escaped = int(marker.read_text())
    wait_until(lambda: psutil.Process(escaped).ppid() == runner.pid, 10, "its adoption")
    assert os.getsid(escaped) != os.getsid(command)
    assert ended(runner) == 0
    row = tasks.row(task)
    assert (row.status, row.exit_code) == ("timed_out", -signal.SIGKILL)
    assert "time limit is 1.5 s" in row.reason and "started" in row.output_tail
    assert_all_gone(command, grandchild, escaped)
    assert tasks.store.children.of_boot("boot1") == []


def test_a_cancel_told_by_sigusr1_stops_the_command_at_once(tasks: Tasks) -> None:
    task = tasks.claimed()
    # The heartbeat is an hour away: only SIGUSR1 can make the runner read the cancel.
    runner = launch(tasks.spec(task, tasks.gated(task), heartbeat=3600.0))
    command, grandchild = tasks.pids(task)
    assert tasks.store.tasks.cancel(task.id) is not None
    runner.send_signal(signal.SIGUSR1)
    assert ended(runner, timeout=15) == 0
    row = tasks.row(task)
    assert (row.status, row.exit_code) == ("cancelled", -signal.SIGTERM)
    assert_all_gone(command, grandchild)


def test_a_cancel_asked_before_the_start_starts_nothing(tasks: Tasks) -> None:
    task = tasks.claimed()
    tasks.store.tasks.cancel(task.id)
    runner = launch(tasks.spec(task, tasks.gated(task)))
    assert ended(runner) == 0
    assert tasks.row(task).status == "cancelled"
    assert not tasks.ready(task).exists()


def test_sigterm_stops_the_group_and_records_no_outcome(tasks: Tasks) -> None:
    task = tasks.claimed()
    runner = launch(tasks.spec(task, tasks.gated(task, stubborn=True), kill_grace=0.5))
    command, grandchild = tasks.pids(task)
    # The runner and its command are both in the child registry, for a later boot's sweep.
    # The command may be ready before the runner has committed its row: wait for both.
    expected = {
        (runner.pid, runner.pid, "task", f"runner {task.id}"),
        (command, command, "task", f"task {task.id}"),
    }

    def recorded() -> set[tuple[int, int | None, str, str]]:
        return {
            (child.pid, child.pgid, child.kind, child.name)
            for child in tasks.store.children.of_boot("boot1")
        }

    wait_until(lambda: recorded() == expected, 30, "both rows in the child registry")
    assert recorded() == expected
    runner.send_signal(signal.SIGTERM)
    assert ended(runner) == 0
    row = tasks.row(task)
    assert (row.status, row.exit_code, row.attempt) == ("running", None, 1)
    assert_all_gone(command, grandchild)
    assert tasks.store.children.of_boot("boot1") == []


def test_a_teardown_that_signals_the_runner_and_its_command_at_once_records_nothing(
    tasks: Tasks,
) -> None:
    task = tasks.claimed()
    runner = launch(tasks.spec(task, tasks.gated(task)))
    command, grandchild = tasks.pids(task)
    # The daemon's teardown signals every descendant at once: the command may be dead of
    # it before the runner reads its own SIGTERM. It must not record that as a failure.
    os.kill(runner.pid, signal.SIGSTOP)
    try:
        os.killpg(command, signal.SIGTERM)
        wait_until(lambda: not alive(command), 10, "the command to die")
        runner.send_signal(signal.SIGTERM)
    finally:
        os.kill(runner.pid, signal.SIGCONT)
    assert ended(runner) == 0
    row = tasks.row(task)
    assert (row.status, row.exit_code) == ("running", None)
    assert_all_gone(command, grandchild)


def test_a_command_that_exited_by_itself_as_the_sigterm_came_keeps_its_outcome(
    tasks: Tasks,
) -> None:
    task = tasks.claimed()
    runner = launch(tasks.spec(task, tasks.gated(task)))
    command, grandchild = tasks.pids(task)
    os.kill(runner.pid, signal.SIGSTOP)  # it reads the exit and the SIGTERM in one look
    try:
        tasks.gate(task).touch()
        wait_until(lambda: not alive(command), 10, "the command to exit by itself")
        runner.send_signal(signal.SIGTERM)
    finally:
        os.kill(runner.pid, signal.SIGCONT)
    assert ended(runner) == 0
    row = tasks.row(task)
    assert (row.status, row.exit_code) == ("succeeded", 0)
    assert_all_gone(command, grandchild)


def test_a_sigusr1_sent_as_the_runner_starts_waits_for_its_handler(tasks: Tasks) -> None:
    task = tasks.claimed()
    runner = launch(tasks.spec(task, tasks.gated(task)))
    runner.send_signal(signal.SIGUSR1)  # before the interpreter is up: it must not kill it
    tasks.pids(task)  # the command started: the runner lived through it
    assert runner.poll() is None
    tasks.gate(task).touch()
    assert ended(runner) == 0
    assert tasks.row(task).status == "succeeded"


def test_a_runner_whose_heartbeat_cannot_go_through_stops_its_command_by_itself(
    tasks: Tasks,
) -> None:
    if tasks.store.backend != "sqlite":
        pytest.skip("the database is held away with an SQLite lock")
    task = tasks.claimed()
    spec = tasks.spec(task, tasks.gated(task), heartbeat=0.3, lost_grace=2.5)
    runner = launch(spec)
    command, grandchild = tasks.pids(task)
    path = tasks.store.url.removeprefix("sqlite:///")
    holder = sqlite3.connect(path, timeout=30, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # no write goes through: the heartbeat fails
    try:
        # Before tasks.lost_grace runs out for any daemon, the command is stopped.
        wait_until(lambda: not alive(command), 15, "the runner to stop its command")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert ended(runner) == 0
    row = tasks.row(task)
    assert (row.status, row.exit_code) == ("running", None)  # no outcome: judged as lost
    assert_all_gone(command, grandchild)


def test_a_row_that_moved_on_stops_the_command_without_an_outcome(tasks: Tasks) -> None:
    task = tasks.claimed()
    runner = launch(tasks.spec(task, tasks.gated(task)))
    command, grandchild = tasks.pids(task)
    # A reconcile pass judged the runner lost and put the task back for a second attempt.
    assert tasks.store.tasks.lose(task.id, 1, 0.0, retry=True) is not None
    assert ended(runner) == 0
    row = tasks.row(task)
    assert (row.status, row.attempt, row.exit_code) == ("pending", 2, None)
    assert_all_gone(command, grandchild)


def test_the_heartbeat_is_renewed_while_the_command_runs(tasks: Tasks) -> None:
    task = tasks.claimed()
    runner = launch(tasks.spec(task, tasks.gated(task, code=4)))
    command, _ = tasks.pids(task)
    # The runner leads a session of its own; the command leads a group of its own in it.
    assert os.getsid(runner.pid) == runner.pid
    assert os.getpgid(command) == command != runner.pid and os.getsid(command) == runner.pid
    assert tasks.store.url not in " ".join(psutil.Process(runner.pid).cmdline())
    before = tasks.row(task).heartbeat_at
    assert before is not None
    wait_until(lambda: (tasks.row(task).heartbeat_at or 0) > before, 10, "a renewed heartbeat")
    wait_until(lambda: (tasks.row(task).heartbeat_at or 0) > before + 0.3, 10, "another one")
    tasks.gate(task).touch()
    assert ended(runner) == 0
    row = tasks.row(task)
    assert (row.status, row.exit_code) == ("failed", 4)
    assert row.output_tail == "started\nfinished\n"


def test_what_a_command_leaves_behind_is_stopped_when_it_exits(tasks: Tasks) -> None:
    task = tasks.claimed()
    pidfile = tasks.directory / "left"
    script = f'sleep 1000 & echo $! > "{pidfile}"; echo done'
    runner = launch(tasks.spec(task, ["sh", "-c", script]))
    assert ended(runner) == 0
    row = tasks.row(task)
    assert (row.status, row.exit_code, row.output_tail) == ("succeeded", 0, "done\n")
    assert_all_gone(int(pidfile.read_text()))


def test_output_past_max_output_is_bounded_on_disk(tasks: Tasks) -> None:
    task = tasks.claimed()
    script = "import sys\nfor i in range(20000): sys.stdout.write(f'line {i:06d}\\n')"
    runner = launch(tasks.spec(task, [sys.executable, "-c", script], max_output=4096))
    assert ended(runner) == 0
    row = tasks.row(task)
    assert row.status == "succeeded"
    text = (tasks.directory / f"{task.id}.log").read_text()
    dropped = 20000 * 12 - 4096
    note = f"\n[turnkeeper: {dropped} bytes of output dropped here]\n"
    assert len(text) == 4096 + len(note)
    head, tail = text.split(note)
    assert head.startswith("line 000000\n") and tail.endswith("line 019999\n")
    assert len(tail) == 1024  # a quarter of max_output
    assert row.output_tail.endswith("line 019999\n") and len(row.output_tail) == 2000
    assert f"{dropped} bytes of its output were left out" in row.reason


def test_the_command_gets_only_child_environment_and_the_kinds_env(
    tasks: Tasks, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TURNKEEPER_ADMIN_TOKEN", "daemon-secret")
    monkeypatch.setenv("HOME", "/home/someone")
    task = tasks.claimed()
    runner = launch(tasks.spec(task, ["env", "-0"], env={"FOO": "bar baz"}))
    assert ended(runner) == 0
    text = (tasks.directory / f"{task.id}.log").read_text()
    env = dict(item.split("=", 1) for item in text.split("\0") if item)
    assert set(env) <= {*INHERITED_ENV, "FOO"}
    assert env["FOO"] == "bar baz" and env["HOME"] == "/home/someone"
    assert "daemon-secret" not in text


def test_a_spec_travels_whole_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    spec = RunnerSpec(
        task="t1",
        attempt=2,
        argv=["a", "b c"],
        env={"X": "1"},
        cwd="/",
        timeout=1,
        kill_grace=0.5,
        max_output=1024,
        output=str(tmp_path / "o"),
        heartbeat=5,
        store_url="postgresql://u:password@127.0.0.1/db",
        boot="b",
        host="h",
    )
    again = RunnerSpec.from_json(spec.to_json())
    assert again == replace(spec, argv=("a", "b c"))
    assert "password" not in repr(spec)
    with pytest.raises(ValueError, match="timeout"):
        RunnerSpec.from_json(spec.to_json().replace('"timeout": 1', '"timeout": "soon"'))
    runner = subprocess.run(
        [sys.executable, "-m", "supervisor.tasks.runner"],
        input=b"{not json",
        capture_output=True,
        timeout=60,
    )
    assert runner.returncode == 1 and b"not JSON" in runner.stderr
