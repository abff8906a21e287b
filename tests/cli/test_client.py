"""The commands that talk to the daemon over its HTTP API, as a user runs them: a real
daemon on a unix socket, the CLI as real processes."""

from __future__ import annotations

import os
import re
import selectors
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.cli.client import Client, ClientError, Reconnect, SseMessage, parse_sse, token_of
from supervisor.contract.config import load_config
from tests.conftest import PYTHON, REPO
from tests.daemon import Daemon, cli_env, wait_until
from tests.support import ctrl_c, run_turnkeeper

SESSION_ID = re.compile(r"^[0-9a-f]{32}$")


def turnkeeper(config: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_turnkeeper(*args, env=cli_env(**env), config=config)


def popen(config: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [PYTHON, "-m", "supervisor", "--config", str(config), *args],
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def read_lines(proc: subprocess.Popen[bytes], count: int, timeout: float) -> list[str]:
    """The first `count` lines `proc` prints; fails the test if they take too long."""
    assert proc.stdout is not None
    buffer = b""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while buffer.count(b"\n") < count:
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                pytest.fail(f"timed out waiting for {count} lines; got {buffer!r}")
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                pytest.fail(f"the process ended after {buffer!r}; rc {proc.wait()}")
            buffer += chunk
    return buffer.decode().splitlines()[:count]


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for the tests that need a running one; each makes its own sessions."""
    root = tmp_path_factory.mktemp("client")
    made = Daemon(root, http={"listen": f"unix:{root / 'api.sock'}"})
    try:
        yield made.start()
    finally:
        made.kill_everything()


def wait_for_a_turn(daemon: Daemon, session_id: str) -> None:
    """Until a turn of the session is in flight, asking the API in-process."""
    with Client.from_config(load_config(str(daemon.config_path), {}), {}) as client:
        wait_until(lambda: client.get_session(session_id)["active_turn_id"], 30, "a turn to start")


def new_session(daemon: Daemon) -> str:
    made = turnkeeper(daemon.config_path, "new", "--title", "client test")
    assert made.returncode == 0, made.stderr
    session_id = made.stdout.strip()
    assert SESSION_ID.match(session_id), made.stdout
    return session_id


# --- against a running daemon -----------------------------------------------------------


@pytest.mark.timeout(90)
def test_new_then_send_wait_prints_the_reply(daemon: Daemon) -> None:
    session_id = new_session(daemon)
    sent = turnkeeper(daemon.config_path, "send", session_id, "hello", "--wait")
    assert sent.returncode == 0, sent.stderr
    assert sent.stdout == "echo: hello\n"
    assert one_line(sent.stderr) == "committed as seq 1"


@pytest.mark.timeout(90)
def test_send_wait_prints_the_tool_call_and_the_answer(daemon: Daemon) -> None:
    session_id = new_session(daemon)
    sent = turnkeeper(daemon.config_path, "send", session_id, '/tool echo {"a": 1}', "--wait")
    assert sent.returncode == 0, sent.stderr
    assert sent.stdout.splitlines() == ["[tool echo]", 'echo: {"a": 1}']


@pytest.mark.timeout(90)
def test_send_with_the_same_key_commits_once(daemon: Daemon) -> None:
    session_id = new_session(daemon)
    for _ in range(2):
        sent = turnkeeper(daemon.config_path, "send", session_id, "once", "--key", "k1")
        assert sent.returncode == 0, sent.stderr
        assert one_line(sent.stderr) == "committed as seq 1"
    third = turnkeeper(daemon.config_path, "send", session_id, "twice", "--key", "k2")
    assert one_line(third.stderr) != "committed as seq 1"


@pytest.mark.timeout(90)
def test_send_wait_times_out_and_interrupt_ends_the_turn(daemon: Daemon) -> None:
    session_id = new_session(daemon)
    started = time.monotonic()
    sent = turnkeeper(
        daemon.config_path, "send", session_id, "/sleep 60 slow", "--wait", "--timeout", "1"
    )
    assert sent.returncode == 1
    assert time.monotonic() - started < 20
    assert sent.stderr.splitlines()[-1] == "turnkeeper: no reply within 1 s"
    assert "Traceback" not in sent.stderr
    wait_for_a_turn(daemon, session_id)
    stopped = turnkeeper(daemon.config_path, "interrupt", session_id)
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.startswith("interrupted the turn in flight")
    again = turnkeeper(daemon.config_path, "interrupt", session_id)
    assert again.stdout.strip() == "nothing was running: no turn to interrupt"


@pytest.mark.timeout(90)
def test_send_wait_reports_an_interrupted_turn(daemon: Daemon) -> None:
    session_id = new_session(daemon)
    waiting = popen(daemon.config_path, "send", session_id, "/sleep 60 slow", "--wait")
    try:
        wait_for_a_turn(daemon, session_id)
        stopped = turnkeeper(daemon.config_path, "interrupt", session_id)
        assert stopped.stdout.startswith("interrupted the turn in flight"), stopped.stderr
        out, err = waiting.communicate(timeout=30)
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait()
    assert waiting.returncode == 1, err  # the turn did not answer: --wait fails
    assert out.decode().splitlines() == ["[turn interrupted_by_operator]"]


@pytest.mark.timeout(90)
def test_interrupt_of_an_idle_session_says_nothing_was_running(daemon: Daemon) -> None:
    session_id = new_session(daemon)
    result = turnkeeper(daemon.config_path, "interrupt", session_id)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "nothing was running: no turn to interrupt"


@pytest.mark.timeout(90)
def test_status_shows_the_daemon_and_its_slots(daemon: Daemon) -> None:
    result = turnkeeper(daemon.config_path, "status")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert re.fullmatch(r"boot [0-9a-f]+  ready", lines[0]), lines[0]
    assert lines[1].startswith("breaker clear: 0 unclean boots in the last 300 s"), lines[1]
    assert lines[2].split() == [
        "SLOT",
        "STATE",
        "WORKER",
        "PID",
        "SPARE",
        "SESSIONS",
        "IN-FLIGHT",
        "SERVED",
    ]
    slots = [line for line in lines if re.match(r"\d+\s+\w+\s+w\d+\.\d+\s+\d+\s", line)]
    assert len(slots) == 2, result.stdout  # 2 workers, no spare
    assert "worker restarts 0" in lines
    assert any(re.fullmatch(r"sessions \d+ open \(.*\), 0 quarantined, 0 closed", x) for x in lines)
    assert any(line.startswith("attach streams ") for line in lines)


@pytest.mark.timeout(90)
def test_grant_prints_the_acl_after(daemon: Daemon) -> None:
    session_id = new_session(daemon)
    granted = turnkeeper(daemon.config_path, "grant", session_id, "bob", "read")
    assert granted.returncode == 0, granted.stderr
    rows = [line.split() for line in granted.stdout.splitlines()]
    assert rows == [["PRINCIPAL", "PERMISSION"], ["admin", "admin"], ["bob", "read"]]
    revoked = turnkeeper(daemon.config_path, "grant", session_id, "bob", "none")
    assert revoked.returncode == 0, revoked.stderr
    assert "bob" not in revoked.stdout and "admin" in revoked.stdout
    wrong = turnkeeper(daemon.config_path, "grant", session_id, "bob", "owner")
    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr


@pytest.mark.timeout(90)
def test_attach_prints_history_then_live_events_until_ctrl_c(daemon: Daemon) -> None:
    session_id = new_session(daemon)
    sent = turnkeeper(daemon.config_path, "send", session_id, "first", "--wait")
    assert sent.returncode == 0, sent.stderr
    attached = popen(daemon.config_path, "attach", session_id)
    try:
        history = read_lines(attached, 4, 30)
        assert [line.split()[0] for line in history] == ["1", "2", "3", "4"]
        assert history[0].split()[3:] == ["user_message", "first"]
        assert history[2].split()[3:] == ["model_response", "echo:", "first"]
        live = turnkeeper(daemon.config_path, "send", session_id, "second")
        assert live.returncode == 0, live.stderr
        more = read_lines(attached, 4, 30)
        assert [line.split()[3] for line in more] == [
            "user_message",
            "turn_started",
            "model_response",
            "turn_ended",
        ]
        assert ctrl_c(attached) == 0
        _, err = attached.communicate(timeout=15)
    finally:
        if attached.poll() is None:
            attached.kill()
            attached.wait()
    assert attached.returncode == 0
    assert err == b""


@pytest.mark.timeout(90)
def test_attach_after_skips_the_earlier_events(daemon: Daemon) -> None:
    session_id = new_session(daemon)
    assert turnkeeper(daemon.config_path, "send", session_id, "x", "--wait").returncode == 0
    attached = popen(daemon.config_path, "attach", session_id, "--after", "2")
    try:
        lines = read_lines(attached, 2, 30)
    finally:
        attached.kill()
        attached.wait()
    assert [line.split()[0] for line in lines] == ["3", "4"]


@pytest.mark.timeout(90)
def test_api_errors_are_one_line_with_the_status(daemon: Daemon) -> None:
    missing = "0" * 32
    for args in (["send", missing, "x"], ["attach", missing], ["interrupt", missing]):
        result = turnkeeper(daemon.config_path, *args)
        assert result.returncode == 1
        assert one_line(result.stderr) == f"turnkeeper: no session '{missing}' (HTTP 404)"
    session_id = new_session(daemon)
    bad = turnkeeper(daemon.config_path, "grant", session_id, "not a name", "read")
    assert bad.returncode == 1
    assert "principal" in one_line(bad.stderr) and "(HTTP 422)" in bad.stderr


@pytest.mark.timeout(90)
def test_a_refused_token_names_where_it_came_from(daemon: Daemon) -> None:
    result = turnkeeper(daemon.config_path, "status", TURNKEEPER_TOKEN="not-the-token")
    assert result.returncode == 1
    assert one_line(result.stderr) == (
        "turnkeeper: the daemon refused the token from $TURNKEEPER_TOKEN (HTTP 401)"
    )


# --- without a daemon -------------------------------------------------------------------


def test_a_missing_admin_token_names_the_file(tmp_path: Path) -> None:
    # (With no daemon running, the command says that first: exit 3.)
    missing = tmp_path / "state" / "admin.token"
    with pytest.raises(ClientError) as raised:
        token_of(missing, {})
    assert str(missing) in str(raised.value) and "first start" in str(raised.value)


# --- the SSE parser ---------------------------------------------------------------------


def test_parse_sse_delivers_events_and_skips_comments() -> None:
    lines = [
        ": keep-alive",
        "",
        "id: 7",
        "event: user_message",
        'data: {"seq": 7}',
        "",
        "data:first",
        "data: second",
        "",
        "event: ignored without data",
        "",
        "id: 9",
        "data: cut off by the end of the stream",
    ]
    assert list(parse_sse(lines)) == [
        SseMessage("7", "user_message", '{"seq": 7}'),
        SseMessage("7", "message", "first\nsecond"),
    ]


# --- reconnecting from the start (send --wait) ------------------------------------------


def test_a_stream_told_the_daemon_was_there_waits_for_it_from_the_first_attempt(
    tmp_path: Path,
) -> None:
    listen = f"unix:{tmp_path / 'api.sock'}"  # nobody listens: the daemon is restarting
    said: list[str] = []
    waits: list[float] = []

    class GaveUp(Exception):
        pass

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 3:
            raise GaveUp

    with Client(listen, "t") as client:
        with pytest.raises(ClientError, match="not running"):  # attach's first attempt
            next(client.stream("s" * 32, reconnect=Reconnect(said.append, print, sleep=sleep)))
        assert said == [] and waits == []
        waiting = Reconnect(said.append, print, sleep=sleep, from_start=True)
        with pytest.raises(GaveUp):
            next(client.stream("s" * 32, reconnect=waiting))
    assert said == ["no socket"]  # once, however many attempts
    assert waits == pytest.approx([0.2, 0.4, 0.8])
