"""The commands that read the database directly, run as a user runs them: `sessions
list|show|close|release`, `boots`, `breaker status`; with a real daemon where the
behaviour is about it (a live, a SIGKILLed, a stopped, a failed boot; a turn followed)."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import queue
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from supervisor.http.auth import digest
from supervisor.store import Store
from tests.conftest import PYTHON, REPO, python_env, this_host_id
from tests.daemon import Daemon, daemons, inject, turn_ended, wait_until
from tests.support import ctrl_c, run_turnkeeper

__all__ = ["daemons"]  # the fixture

Daemons = Callable[..., Daemon]
DEAD_PID = 999_999_999  # above pid_max: never a live process


def turnkeeper(where: Path | Daemon, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`python -m supervisor ARGS` on a state dir, or with a daemon's config file."""
    config = where.config_path if isinstance(where, Daemon) else None
    if config is not None:
        environ = python_env()
    else:
        environ = python_env(TURNKEEPER_DAEMON__STATE_DIR=str(where), TURNKEEPER_CONFIG="")
    for name in ("COLUMNS", "TURNKEEPER_TOKEN"):  # a width and a token of the test's own
        environ.pop(name, None)
    environ.update(env)
    return run_turnkeeper(*args, env=environ, config=config)


def store_at(state: Path) -> Store:
    return Store(f"sqlite:///{state / 'turnkeeper.db'}")


def widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


@pytest.fixture
def thirty(tmp_path: Path) -> tuple[Path, str]:
    """A state dir with one session of 30 events, the last one's text longer than a line."""
    state = tmp_path / "state"
    with store_at(state) as store:
        sid = store.sessions.create("alice", title="a session with thirty events").id
        for n in range(1, 30):
            store.events.append(sid, "user_message", {"text": f"message {n}"}, writer="intake")
        long_text = "the whole story " * 20 + "THE END"
        store.events.append(sid, "user_message", {"text": long_text}, writer="intake")
    return state, sid


def seqs(stdout: str) -> list[int]:
    """The seqs of the event lines of `sessions show`."""
    return [int(line.split()[0]) for line in stdout.splitlines() if line[:6].strip().isdigit()]


def test_show_prints_the_newest_20_events_and_says_how_many_are_not_shown(
    thirty: tuple[Path, str],
) -> None:
    state, sid = thirty
    shown = turnkeeper(state, "sessions", "show", sid)
    assert shown.returncode == 0, shown.stderr
    assert seqs(shown.stdout) == list(range(11, 31))
    assert "10 earlier events not shown" in shown.stdout
    assert "alice=admin" in shown.stdout
    assert widest(shown.stdout) <= 80, shown.stdout
    last = shown.stdout.splitlines()[-1]
    assert "THE END" not in last and last.endswith("…") and len(last) == 80  # cut to fit

    three = turnkeeper(state, "sessions", "show", sid, "--tail", "3")
    assert seqs(three.stdout) == [28, 29, 30] and "27 earlier events" in three.stdout
    none = turnkeeper(state, "sessions", "show", sid, "--tail", "0")
    assert seqs(none.stdout) == [] and "30 earlier events" in none.stdout


def test_after_alone_shows_every_later_event_and_with_tail_the_newest_of_them(
    thirty: tuple[Path, str],
) -> None:
    state, sid = thirty
    after = turnkeeper(state, "sessions", "show", sid, "--after", "5")
    assert seqs(after.stdout) == list(range(6, 31)) and "not shown" not in after.stdout
    everything = turnkeeper(state, "sessions", "show", sid, "--after", "0")
    assert seqs(everything.stdout) == list(range(1, 31))
    both = turnkeeper(state, "sessions", "show", sid, "--after", "5", "--tail", "2")
    assert seqs(both.stdout) == [29, 30] and "23 earlier events not shown" in both.stdout
    few = turnkeeper(state, "sessions", "show", sid, "--after", "27", "--tail", "10")
    assert seqs(few.stdout) == [28, 29, 30] and "not shown" not in few.stdout


def test_full_prints_whole_texts(thirty: tuple[Path, str]) -> None:
    state, sid = thirty
    full = turnkeeper(state, "sessions", "show", sid, "--tail", "1", "--full")
    assert full.returncode == 0, full.stderr
    assert "the whole story " * 20 + "THE END" in full.stdout and "…" not in full.stdout


def test_show_json_has_the_session_its_acl_and_the_events_shown(
    thirty: tuple[Path, str],
) -> None:
    state, sid = thirty
    shown = turnkeeper(state, "sessions", "show", sid, "--tail", "2", "--json")
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    assert data["session"]["id"] == sid and data["session"]["acl"] == {"alice": "admin"}
    assert data["session"]["last_seq"] == 30 and data["session"]["state"] == "pending"
    assert [e["seq"] for e in data["events"]] == [29, 30] and data["omitted"] == 28
    assert data["events"][1]["payload"]["text"].endswith("THE END")
    assert set(data["events"][0]) == {"seq", "type", "turn_id", "payload", "created_at"}
    missing = turnkeeper(state, "sessions", "show", "nope", "--json")
    assert missing.returncode == 1 and "no session 'nope'" in missing.stderr


def test_list_fits_80_columns_and_has_json(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with store_at(state) as store:
        idle = store.sessions.create("alice", title="x" * 200).id
        poisoned = store.sessions.create("alice", title="poisoned").id
        store.sessions.quarantine(poisoned, "its turns kept killing workers")
    listing = turnkeeper(state, "sessions", "list")
    assert listing.returncode == 0, listing.stderr
    assert widest(listing.stdout) <= 80, listing.stdout
    rows = {line.split()[0]: line.split()[1] for line in listing.stdout.splitlines()[1:]}
    assert rows == {idle: "open", poisoned: "quarantined"}
    data = json.loads(turnkeeper(state, "sessions", "list", "--json").stdout)
    found = {s["id"]: s for s in data["sessions"]}
    assert found[idle]["title"] == "x" * 200 and found[idle]["status"] == "open"
    assert found[poisoned]["state"] == "quarantined"
    assert found[poisoned]["quarantine_reason"] == "its turns kept killing workers"
    empty = tmp_path / "empty"
    store_at(empty).close()
    assert json.loads(turnkeeper(empty, "sessions", "list", "--json").stdout) == {"sessions": []}


def test_release_without_a_daemon_is_done_in_the_database(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with store_at(state) as store:
        sid = store.sessions.create("alice").id
        store.sessions.quarantine(sid, "poison")
    released = turnkeeper(state, "sessions", "release", sid, "--json")
    assert released.returncode == 0, released.stderr
    assert json.loads(released.stdout) == {
        "id": sid,
        "released": True,
        "status": "open",
        "via": "database",
    }
    again = turnkeeper(state, "sessions", "release", sid)
    assert again.returncode == 0 and "not quarantined (open)" in again.stdout
    missing = turnkeeper(state, "sessions", "release", "nope")
    assert missing.returncode == 1 and "no session 'nope'" in missing.stderr


def test_close_needs_the_daemon(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with store_at(state) as store:
        sid = store.sessions.create("alice").id
    closed = turnkeeper(state, "sessions", "close", sid)
    assert closed.returncode == 3 and "daemon is not running" in closed.stderr
    with store_at(state) as store:
        assert store.sessions.get(sid).status == "open"


def test_breaker_status_exits_1_while_tripped(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with store_at(state) as store:
        for _ in range(3):  # three boots of this host that died (never ended)
            store.boots.begin(this_host_id(), DEAD_PID, "test")
    tripped = turnkeeper(state, "breaker", "status")
    assert tripped.returncode == 1 and tripped.stdout.startswith("TRIPPED: 3 unclean boots")
    data = turnkeeper(state, "breaker", "status", "--json")
    assert data.returncode == 1
    shape = json.loads(data.stdout)
    assert shape["tripped"] is True and shape["unclean_boots"] == 3 and shape["threshold"] == 3
    assert shape["host"] == this_host_id() and shape["clears_at"] is not None
    assert turnkeeper(state, "breaker", "reset").returncode == 0
    clear = turnkeeper(state, "breaker", "status", "--json")
    assert clear.returncode == 0 and json.loads(clear.stdout)["tripped"] is False


def on_a_terminal(state: Path, *args: str, **env: str) -> str:
    """The output of a command whose stdout is a terminal (a pty)."""
    leader, follower = pty.openpty()
    environ = python_env(TURNKEEPER_DAEMON__STATE_DIR=str(state), TURNKEEPER_CONFIG="", **env)
    if "NO_COLOR" not in env:
        environ.pop("NO_COLOR", None)
    proc = subprocess.Popen(
        [PYTHON, "-m", "supervisor", *args], cwd=REPO, env=environ, stdout=follower
    )
    os.close(follower)
    output = b""
    with contextlib.suppress(OSError):  # EIO: the command exited and closed the terminal
        while chunk := os.read(leader, 4096):
            output += chunk
    os.close(leader)
    assert proc.wait(timeout=60) == 0
    return output.decode()


def test_boots_colours_a_crash_red_on_a_terminal_only(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with store_at(state) as store:
        store.boots.begin(this_host_id(), DEAD_PID, "test")
    red = "\x1b[31mcrashed\x1b[0m"
    assert red in on_a_terminal(state, "boots")
    assert "crashed" in on_a_terminal(state, "boots", NO_COLOR="1")
    assert "\x1b[" not in on_a_terminal(state, "boots", NO_COLOR="1")
    piped = turnkeeper(state, "boots")
    assert "crashed" in piped.stdout and "\x1b[" not in piped.stdout


# --- with a real daemon ---------------------------------------------------------------


def boot_states(daemon: Daemon) -> dict[int, str]:
    """`boots --json`: each boot's state by its pid."""
    result = turnkeeper(daemon, "boots", "--json")
    assert result.returncode == 0, result.stderr
    return {b["pid"]: b["state"] for b in json.loads(result.stdout)["boots"]}


@pytest.mark.timeout(240)  # a minute or more on a busy two-core machine
def test_boots_shows_running_crashed_clean_and_startup_failed(daemons: Daemons) -> None:
    daemon = daemons().start()
    first = daemon.pid
    assert boot_states(daemon) == {first: "running"}
    table = turnkeeper(daemon, "boots")
    assert widest(table.stdout) <= 80, table.stdout
    row = next(line for line in table.stdout.splitlines() if f" {first} " in line)
    assert row.split()[-2] == "running", row

    daemon.signal(signal.SIGKILL)
    daemon.wait(10)
    assert boot_states(daemon) == {first: "crashed"}

    daemon.start()
    second = daemon.pid
    assert boot_states(daemon) == {first: "crashed", second: "running"}
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(30) == 0
    assert boot_states(daemon) == {first: "crashed", second: "clean"}
    table = turnkeeper(daemon, "boots").stdout
    assert widest(table) <= 80 and "crashed" in table and "clean" in table, table


def test_a_boot_that_cannot_bind_is_startup_failed(daemons: Daemons) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        daemon = daemons(http={"listen": f"127.0.0.1:{port}"})
        daemon.start(wait=False)
        assert daemon.wait(60) != 0
    assert boot_states(daemon) == {daemon.pid: "startup_failed"}
    assert "startup_failed" in turnkeeper(daemon, "boots").stdout


class Follower:
    """`sessions show --follow` as a process, its lines read as they come."""

    def __init__(self, daemon: Daemon, *args: str) -> None:
        command = [PYTHON, "-m", "supervisor", "--config", str(daemon.config_path)]
        self.proc = subprocess.Popen(
            [*command, "sessions", "show", *args, "--follow"],
            cwd=REPO,
            env=python_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def until(self, predicate: Callable[[str], bool], what: str, timeout: float = 30) -> str:
        """The first line from now on that `predicate` accepts."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                pytest.fail(f"`sessions show --follow` printed no {what}: {self.seen}")
            self.seen.append(line)
            if predicate(line):
                return line

    def interrupt(self) -> int:
        """Ctrl-C, as a user ends it."""
        return ctrl_c(self.proc)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def following(daemon: Daemon, *args: str) -> Iterator[Follower]:
    follower = Follower(daemon, *args)
    try:
        yield follower
    finally:
        follower.kill()


def test_follow_prints_a_turns_events_as_they_are_committed(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = daemons().start()
    gate = tmp_path / "gate"
    with Store(daemon.url, migrate=False) as store:
        sid = store.sessions.create("admin", title="followed").id
        inject(store, sid, "before")
        wait_until(lambda: turn_ended(store, sid), 30, "the first turn")
        before = store.sessions.get(sid).last_seq
        with (
            following(daemon, sid) as text,
            following(daemon, sid, "--json", "--after", str(before)) as js,
        ):
            text.until(lambda line: line.startswith("acl"), "header")
            text.until(lambda line: line.split()[0] == str(before), "the last old event")
            inject(store, sid, f"/gate {gate} go")

            def new(kind: str) -> Callable[[str], bool]:
                return lambda line: kind in line and int(line.split()[0]) > before

            # The turn is held at its gate: what is printed now was printed as it came.
            text.until(new("turn_started"), "turn_started")
            assert not gate.exists() and store.sessions.get(sid).active_turn_id is not None
            gate.touch()
            text.until(new("echo: /gate "), "reply")  # cut to fit the line
            text.until(new("turn_ended"), "turn_ended")
            ended = json.loads(js.until(lambda line: '"turn_ended"' in line, "JSON turn_ended"))
            assert ended["payload"]["outcome"] == "completed"
            assert all(json.loads(line)["seq"] > before for line in js.seen)  # --after
            assert text.interrupt() == 0
            assert js.interrupt() == 0


def write_tokens(path: Path, **tokens: str) -> None:
    path.write_text("".join(f"{p} sha256:{digest(t)}\n" for p, t in tokens.items()))
    path.chmod(0o600)


@pytest.mark.timeout(240)  # a minute or more on a busy two-core machine
def test_close_and_release_go_through_the_daemon(daemons: Daemons, tmp_path: Path) -> None:
    bob = f"bob-{uuid.uuid4().hex}"
    write_tokens(tmp_path / "tokens", bob=bob)
    daemon = daemons(auth={"tokens_file": str(tmp_path / "tokens")}).start()
    with daemon.client() as client:
        closing = client.post("/v1/sessions", json={"title": "to close"}).json()["id"]
        poisoned = client.post("/v1/sessions", json={"title": "poisoned"}).json()["id"]
        grant = {"principal": "bob", "permission": "write"}
        assert client.put(f"/v1/sessions/{poisoned}/acl", json=grant).status_code == 200
        said = client.post(f"/v1/sessions/{closing}/inject", json={"text": "remember me"})
        assert said.status_code == 202, said.text
    with Store(daemon.url, migrate=False) as store:
        wait_until(lambda: turn_ended(store, closing), 30, "the turn before the close")

    closed = turnkeeper(daemon, "sessions", "close", closing)
    assert closed.returncode == 0, closed.stderr
    assert f"closed session {closing}" in closed.stdout
    again = turnkeeper(daemon, "sessions", "close", closing, "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) == {"id": closing, "status": "closed", "already_closed": True}
    listed = json.loads(turnkeeper(daemon, "sessions", "list", "--json").stdout)
    assert {s["id"]: s["status"] for s in listed["sessions"]}[closing] == "closed"
    kept = json.loads(turnkeeper(daemon, "sessions", "show", closing, "--json").stdout)
    assert "remember me" in [e["payload"].get("text") for e in kept["events"]]
    with Store(daemon.url, migrate=False) as store:
        store.sessions.quarantine(poisoned, "test poison")
    # Its user, with write access and no operator's token, releases it.
    released = turnkeeper(daemon, "sessions", "release", poisoned, "--json", TURNKEEPER_TOKEN=bob)
    assert released.returncode == 0, released.stderr
    assert json.loads(released.stdout) == {
        "id": poisoned,
        "released": True,
        "status": "open",
        "via": "api",
    }
    again = turnkeeper(daemon, "sessions", "release", poisoned, TURNKEEPER_TOKEN=bob)
    assert again.returncode == 0 and "is not quarantined (open)" in again.stdout, again.stderr
    missing = turnkeeper(daemon, "sessions", "close", "0" * 32)
    assert missing.returncode == 1 and "HTTP 404" in missing.stderr
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(30) == 0
    down = turnkeeper(daemon, "sessions", "close", poisoned)
    assert down.returncode == 3 and "needs it" in down.stderr
