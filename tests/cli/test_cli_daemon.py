"""The commands that talk to the daemon, through the real command line against real
daemons: exit code 3 without a daemon, `send -`, `send --wait`'s exit codes, `attach`
across a restart of the daemon, `status`, and the `--json` documents."""

from __future__ import annotations

import io
import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pytest

from supervisor.cli.client import Client, Reconnect
from supervisor.cli.common import Escaped
from supervisor.cli.daemon_commands import status_lines
from supervisor.contract.config import load_config
from supervisor.store import Store
from tests.cli.test_client import cli_env, new_session, one_line, wait_for_a_turn
from tests.conftest import PYTHON, REPO
from tests.daemon import Daemon, daemons, events, wait_until
from tests.support import ctrl_c, free_port, run_turnkeeper

__all__ = ["daemons"]  # the fixture

Daemons = Callable[..., Daemon]
SMALL = {"pool": {"workers": 1, "spare": 0}}


def turnkeeper(
    daemon: Daemon | Path, *args: str, stdin: str | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    config = daemon.config_path if isinstance(daemon, Daemon) else daemon
    return run_turnkeeper(*args, env=cli_env(**env), config=config, stdin=stdin)


def popen(daemon: Daemon, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [PYTHON, "-m", "supervisor", "--config", str(daemon.config_path), *args],
        cwd=REPO,
        env=cli_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


class Lines:
    """The lines a child writes to one pipe, read as they come, none lost between reads."""

    def __init__(self, pipe: IO[bytes] | None) -> None:
        assert pipe is not None
        self.fd = pipe.fileno()
        self.buffer = b""

    def read(self, count: int, timeout: float) -> list[str]:
        """The next `count` lines; fails the test if they take longer than `timeout`."""
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(self.fd, selectors.EVENT_READ)
            while self.buffer.count(b"\n") < count:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    pytest.fail(f"timed out waiting for {count} lines; got {self.buffer!r}")
                chunk = os.read(self.fd, 65536)
                if not chunk:
                    pytest.fail(f"the pipe closed after {self.buffer!r}")
                self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n", count)
        return [line.decode() for line in lines]

    def until(self, predicate: Callable[[str], bool], timeout: float) -> list[str]:
        """Lines up to and including the first one `predicate` accepts."""
        found: list[str] = []
        deadline = time.monotonic() + timeout
        while not found or not predicate(found[-1]):
            found += self.read(1, max(deadline - time.monotonic(), 0.01))
        return found

    def rest(self) -> str:
        """What is left once the child has exited."""
        while chunk := os.read(self.fd, 65536):
            self.buffer += chunk
        return self.buffer.decode()


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def seqs(lines: list[str]) -> list[int]:
    return [int(line.split()[0]) for line in lines]


# --- exit code 3 ------------------------------------------------------------------------


def stale_socket(path: Path) -> Path:
    """A socket file nobody listens on, as a daemon killed with SIGKILL leaves."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
    return path


COMMANDS = [
    ["new"],
    ["new", "--json"],
    ["send", "0" * 32, "hello"],
    ["send", "0" * 32, "hello", "--wait"],
    ["attach", "0" * 32],
    ["attach", "0" * 32, "--no-reconnect"],
    ["interrupt", "0" * 32],
    ["status"],
    ["status", "--json"],
    ["grant", "0" * 32, "bob", "read"],
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["tcp", "no socket", "stale socket"])
def test_every_command_exits_3_when_the_daemon_is_not_running(tmp_path: Path, where: str) -> None:
    if where == "tcp":
        listen, reason = f"127.0.0.1:{free_port()}", "connection refused"
    elif where == "no socket":
        listen, reason = f"unix:{tmp_path / 'api.sock'}", "no socket"
    else:
        listen, reason = f"unix:{stale_socket(tmp_path / 'api.sock')}", "connection refused"
    config = Daemon(tmp_path, http={"listen": listen}).config_path
    # Every command once; the other ways of not running are the client's one test.
    for args in COMMANDS if where == "no socket" else [["status"], ["attach", "0" * 32]]:
        result = turnkeeper(config, *args, TURNKEEPER_TOKEN="any")
        assert result.returncode == 3, (args, result.stdout, result.stderr)
        assert result.stdout == ""
        assert one_line(result.stderr) == (
            f"turnkeeper: the daemon is not running at {listen} ({reason}); "
            "start it with `turnkeeper run`"
        ), args


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    # (A daemon that never ran is exit 3: tests/cli/test_discovery.py.)
    config = Daemon(tmp_path, http={"listen": f"unix:{tmp_path / 'api.sock'}"}).config_path
    usage = turnkeeper(config, "attach", "0" * 32, "--after", "-1", TURNKEEPER_TOKEN="any")
    assert usage.returncode == 2 and "Traceback" not in usage.stderr


# --- send -------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_send_dash_reads_the_message_from_standard_input(daemons: Daemons) -> None:
    daemon = daemons(**SMALL).start()
    session_id = new_session(daemon)
    sent = turnkeeper(daemon, "send", session_id, "-", "--wait", stdin="two\nlines\n")
    assert sent.returncode == 0, sent.stderr
    assert sent.stdout == "echo: two\nlines\n"
    with Store(daemon.url) as store:
        assert events(store, session_id)[0].payload["text"] == "two\nlines"
    empty = turnkeeper(daemon, "send", session_id, "-", stdin="\n")
    assert empty.returncode == 2
    assert "TEXT" in empty.stderr and "standard input is empty" in empty.stderr
    with Store(daemon.url) as store:
        assert store.sessions.get(session_id).last_seq == 4  # nothing sent the second time


@pytest.mark.timeout(120)
def test_send_wait_exits_1_when_the_turn_fails_or_is_interrupted(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = daemons(**SMALL).start()
    session_id = new_session(daemon)
    failed = turnkeeper(daemon, "send", session_id, "/raise SystemExit", "--wait")
    assert failed.returncode == 1, failed.stderr
    assert failed.stdout.startswith("[turn failed] agent error: ")
    assert one_line(failed.stderr) == "committed as seq 1"
    answered = turnkeeper(daemon, "send", session_id, "fine again", "--wait")
    assert answered.returncode == 0 and answered.stdout == "echo: fine again\n"

    gate = tmp_path / "never-opened"
    waiting = popen(daemon, "send", session_id, f"/gate {gate} 60", "--wait", "--json")
    try:
        wait_for_a_turn(daemon, session_id)
        stopped = turnkeeper(daemon, "interrupt", session_id, "--json")
        assert stopped.returncode == 0, stopped.stderr
        interrupted = json.loads(stopped.stdout)
        assert interrupted == {"interrupted": True, "seq": interrupted["seq"]}
        assert isinstance(interrupted["seq"], int)
        out, err = waiting.communicate(timeout=30)
    finally:
        stop(waiting)
    assert waiting.returncode == 1, err
    reply = json.loads(out.splitlines()[-1])  # after the deltas, if any: JSON Lines
    assert reply["outcome"] == "interrupted_by_operator" and reply["reply"] == ""
    assert err == b""  # --json: no "committed as" line either


# --- attach across a restart ------------------------------------------------------------


@pytest.mark.timeout(180)
def test_attach_reconnects_when_the_daemon_restarts(daemons: Daemons) -> None:
    daemon = daemons(**SMALL).start()
    session_id = new_session(daemon)
    assert turnkeeper(daemon, "send", session_id, "before", "--wait").returncode == 0
    attached = popen(daemon, "attach", session_id)
    out, err = Lines(attached.stdout), Lines(attached.stderr)
    try:
        printed = out.read(4, 30)
        assert seqs(printed) == [1, 2, 3, 4]
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(30) == 0
        lost = err.read(1, 30)[0]
        assert re.fullmatch(
            rf"turnkeeper: lost the daemon at {re.escape(daemon.listen)} \(.+\); reconnecting",
            lost,
        ), lost
        assert attached.poll() is None, "attach ended with the daemon"

        daemon.start()
        back = err.read(1, 30)[0]
        resumed = re.fullmatch(
            rf"turnkeeper: reconnected to the daemon at {re.escape(daemon.listen)}; "
            r"resuming after seq (\d+)",
            back,
        )
        assert resumed, back
        sent = turnkeeper(daemon, "send", session_id, "after", "--wait")
        assert sent.returncode == 0 and sent.stdout == "echo: after\n", sent.stderr
        printed += out.until(lambda line: "after" in line.split()[4:], 30)  # its user_message
        printed += out.until(lambda line: line.split()[3] == "turn_ended", 30)
        assert ctrl_c(attached) == 0
        printed += out.rest().splitlines()
        assert err.rest() == ""  # one line when it lost the daemon, one when it was back
    finally:
        stop(attached)
    with Store(daemon.url) as store:
        stored = events(store, session_id)
    # Every event exactly once, in order: none printed twice across the restart, none lost.
    assert seqs(printed) == [e.seq for e in stored]
    assert int(resumed.group(1)) >= 4
    types = [line.split()[3] for line in printed]
    assert types[-4:] == ["user_message", "turn_started", "model_response", "turn_ended"]
    assert printed[-4].split()[4:] == ["after"]


def client_of(daemon: Daemon) -> Client:
    return Client.from_config(load_config(str(daemon.config_path), {}), {})


@pytest.mark.timeout(120)
def test_a_stream_that_lost_the_daemon_says_so_once_and_backs_off(daemons: Daemons) -> None:
    daemon = daemons(**SMALL).start()
    session_id = new_session(daemon)
    assert turnkeeper(daemon, "send", session_id, "before", "--wait").returncode == 0
    said: list[str] = []
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 6:  # back after six attempts, with a message waiting
            daemon.start()
            with client_of(daemon) as other:
                other.inject(session_id, "after")

    reconnect = Reconnect(said.append, lambda seq: said.append(f"back after {seq}"), sleep=sleep)
    seen: list[tuple[int, str]] = []
    with client_of(daemon) as client:
        for event in client.stream(session_id, reconnect=reconnect):
            seen.append((event["seq"], event["type"]))
            if event["seq"] == 4:
                daemon.signal(signal.SIGTERM)
                assert daemon.wait(30) == 0
            if event["seq"] > 4 and event["type"] == "turn_ended":
                break
    assert waits == pytest.approx([0.2, 0.4, 0.8, 1.6, 2.0, 2.0])
    assert said == ["no socket", "back after 4"]
    assert [seq for seq, _ in seen] == list(range(1, len(seen) + 1))
    assert seen[4] == (5, "user_message")


@pytest.mark.timeout(120)
def test_attach_no_reconnect_exits_3_when_the_daemon_goes_away(daemons: Daemons) -> None:
    daemon = daemons(**SMALL).start()
    session_id = new_session(daemon)
    assert turnkeeper(daemon, "send", session_id, "hello", "--wait").returncode == 0
    attached = popen(daemon, "attach", session_id, "--no-reconnect", "--json")
    try:
        printed = [json.loads(line) for line in Lines(attached.stdout).read(4, 30)]
        assert [event["seq"] for event in printed] == [1, 2, 3, 4]
        assert set(printed[0]) == {"seq", "type", "turn_id", "payload", "created_at"}
        assert printed[0]["payload"]["text"] == "hello"
        daemon.signal(signal.SIGTERM)
        assert attached.wait(timeout=30) == 3
        _, err = attached.communicate(timeout=5)
    finally:
        stop(attached)
    assert re.fullmatch(
        rf"turnkeeper: lost the daemon at {re.escape(daemon.listen)} \(.+\)",
        one_line(err.decode()),
    )


# --- status and the --json documents ----------------------------------------------------


@pytest.mark.timeout(120)
def test_json_documents_of_new_send_interrupt_and_grant(daemons: Daemons) -> None:
    daemon = daemons(**SMALL).start()
    made = turnkeeper(daemon, "new", "--title", "json", "--json")
    assert made.returncode == 0, made.stderr
    session = json.loads(made.stdout)
    assert session["title"] == "json" and session["kind"] == "attached"
    with daemon.client() as http:
        assert session == http.get(f"/v1/sessions/{session['id']}").json()
    session_id = session["id"]

    sent = turnkeeper(daemon, "send", session_id, "no wait", "--json")
    assert sent.returncode == 0 and sent.stderr == ""
    assert json.loads(sent.stdout) == {"seq": 1}
    waited = turnkeeper(daemon, "send", session_id, "hello", "--wait", "--json")
    assert waited.returncode == 0, waited.stderr
    reply = json.loads(waited.stdout.splitlines()[-1])  # the document: the last line
    assert reply == {
        "seq": reply["seq"],
        "turn_id": reply["turn_id"],
        "outcome": "completed",
        "error": None,
        "reply": "echo: hello",
    }
    assert reply["seq"] > 1 and re.fullmatch(r"[0-9a-f]{32}", reply["turn_id"])

    idle = turnkeeper(daemon, "interrupt", session_id, "--json")
    assert json.loads(idle.stdout) == {"interrupted": False, "seq": None}
    granted = turnkeeper(daemon, "grant", session_id, "bob", "write", "--json")
    assert json.loads(granted.stdout) == {"acl": {"admin": "admin", "bob": "write"}}


def wait_for_mcp(daemon: Daemon) -> dict[str, Any]:
    """/v1/status once every worker reports its MCP server ready."""

    def ready() -> dict[str, Any] | None:
        found = daemon.status()
        slots = found["slots"]
        every = slots and all([m["state"] for m in s.get("mcp", [])] == ["ready"] for s in slots)
        return found if every else None

    found: dict[str, Any] = wait_until(ready, 60, "the MCP servers to be ready")
    return found


@pytest.mark.timeout(240)
def test_status_labels_its_columns_and_shows_mcp_servers(daemons: Daemons) -> None:
    tiny = {"name": "tiny", "command": [PYTHON, "-m", "tests.mcp_servers.tiny"]}
    daemon = daemons(pool={"workers": 2, "spare": 0}, mcp={"servers": [tiny]}).start()
    session_id = new_session(daemon)
    assert turnkeeper(daemon, "send", session_id, "hi", "--wait").returncode == 0
    api = wait_for_mcp(daemon)

    shown = turnkeeper(daemon, "status", NO_COLOR="1")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), shown.stdout
    assert "\x1b" not in shown.stdout
    header = lines.index(next(line for line in lines if line.startswith("SLOT")))
    assert lines[header].split() == [
        "SLOT",
        "STATE",
        "WORKER",
        "PID",
        "SPARE",
        "SESSIONS",
        "IN-FLIGHT",
        "SERVED",
    ]
    rows = [line.split() for line in lines[header + 1 : header + 3]]
    assert [row[2] for row in rows] == [s["worker"] for s in api["slots"]]
    assert sum(int(row[7]) for row in rows) >= 1  # the turn above was served
    assert all(row[6] == "0" for row in rows)  # nothing in flight now
    mcp = lines.index("WORKER  MCP SERVER  STATE")
    assert [line.split() for line in lines[mcp + 1 : mcp + 3]] == [
        [s["worker"], "tiny", "ready"] for s in api["slots"]
    ]

    as_json = turnkeeper(daemon, "status", "--json")
    assert as_json.returncode == 0, as_json.stderr
    document = json.loads(as_json.stdout)
    assert set(document) == {
        "boot",
        "config",
        "host",
        "hosts",
        "hosts_error",
        "breaker",
        "slots",
        "worker_restarts",
        "model",
        "sessions",
        "attach_streams",
    }
    assert document["model"] == {"state": "ok", "since": None}
    assert "model ok" in lines
    assert document["boot"] == api["boot"]
    assert [(s["worker"], s["pid"]) for s in document["slots"]] == [
        (s["worker"], s["pid"]) for s in api["slots"]
    ]
    assert all({"turns", "turns_served", "mcp"} <= set(s) for s in document["slots"])


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def slot(index: int, state: str, **more: Any) -> dict[str, Any]:
    return {
        "slot": index,
        "state": state,
        "worker": f"w{index}.12345",
        "pid": 4194304,
        "ready": True,
        "spare": False,
        "sessions": 1000,
        "turns": 12,
        **more,
    }


def test_status_colours_what_is_wrong_on_a_terminal_only(monkeypatch: pytest.MonkeyPatch) -> None:
    document = {
        "boot": {"id": "f" * 32, "ready": True, "stopping": False},
        "breaker": {"tripped": True, "reason": "3 unclean boots in the last 300 s"},
        "slots": [
            slot(0, "running", turns_served=123456, mcp=[{"name": "files", "state": "down"}]),
            slot(1, "fatal"),  # as before the API reported turns served and MCP servers
        ],
        "worker_restarts": 9,
        "sessions": {"open": 3},
        "attach_streams": 0,
    }
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setattr(sys, "stdout", Terminal())
    printed = io.StringIO()  # as printed: through the stream that lets only our codes by
    Escaped(printed).write("\n".join(status_lines(document)))
    lines = printed.getvalue().split("\n")
    red = "\x1b[31m"
    assert lines[1] == f"{red}breaker TRIPPED: 3 unclean boots in the last 300 s\x1b[0m"
    fatal = next(line for line in lines if "fatal" in line)
    assert fatal.startswith(red) and fatal.split()[-1] == "-\x1b[0m"  # no turns served known
    assert next(line for line in lines if "files" in line).startswith(red)
    assert not next(line for line in lines if " running " in line).startswith("\x1b")
    plain = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in lines]
    assert all(len(line) <= 80 for line in plain), plain
    monkeypatch.setenv("NO_COLOR", "1")
    assert "\x1b" not in "".join(status_lines(document))
