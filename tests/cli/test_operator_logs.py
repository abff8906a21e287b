"""What an operator reads: the first lines of a start, which worker and MCP server wrote a
line, JSON lines, a quiet idle daemon, named exit statuses and process titles."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import psutil
import pytest

from supervisor import __version__
from supervisor.store import Store
from tests.conftest import PYTHON, REPO, python_env
from tests.daemon import Daemon, daemons, turn_ended, wait_until

__all__ = ["daemons"]  # the fixture

Daemons = Callable[..., Daemon]

SECRET = "s3cr3t-pw"
# A line of the text format: time, level, [subsystem], then the context and message.
TEXT_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (?P<level>\w+) +\[(?P<sub>\w+)\] ")
NAMED_EXIT = re.compile(
    r"exited with (code \d+|signal SIG[A-Z0-9]+|the stop \(its status went to the stop's reaper\));"
)


def run_lines(daemon: Daemon, run: int = 1) -> list[str]:
    """The log lines of one run of the daemon, without its `--- run N ---` marker."""
    text = daemon.log().split(f"--- run {run} ---\n", 1)[1]
    return text.split(f"--- run {run + 1} ---\n", 1)[0].splitlines()


def mcp_server(name: str, **env: str) -> dict[str, object]:
    return {
        "name": name,
        "command": [sys.executable, "-m", "tests.mcp_servers.basic"],
        "env": {"PYTHONPATH": str(REPO), **env},
        "start_timeout": 5.0,
    }


def stop(daemon: Daemon) -> None:
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(30) == 0, daemon.log()


@pytest.mark.timeout(120)
def test_start_lines_tags_titles_and_exit_statuses(daemons: Daemons, tmp_path: Path) -> None:
    refuse = tmp_path / "refuse"
    refuse.touch()  # the MCP server writes a line on stderr and exits: a crash loop
    daemon = daemons(mcp={"servers": [mcp_server("basic", BASIC_REFUSE_IF_EXISTS=str(refuse))]})
    daemon.env = {"TURNKEEPER_HTTP_LISTEN": "127.0.0.1:1"}  # one underscore: ignored
    daemon.start()
    workers = daemon.worker_pids(ready=True)
    assert workers
    # Process titles, as ps and top show them; with the daemon's host id and state
    # directory when another daemon ran at its start (a test beside it).
    supervisor = Path(f"/proc/{daemon.pid}/cmdline").read_bytes().rstrip(b"\0").decode()
    bracket = re.fullmatch(
        rf"turnkeeper: supervisor( \[host \S+ {re.escape(str(daemon.state))}\])?", supervisor
    )
    assert bracket, supervisor
    for identity, pid in workers.items():
        title = f"turnkeeper: worker {identity}{bracket[1] or ''}"
        assert Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0") == title.encode()
        assert " ".join(psutil.Process(pid).cmdline()).strip() == title  # NUL-padded
        if not bracket[1]:
            assert psutil.Process(pid).name() == title
    stderr_line = re.compile(
        r"\[mcp\] worker=(w\d+\.\d+) server=basic basic\[\d+\]: basic: refusing to start"
    )
    found = wait_until(
        lambda: stderr_line.search(daemon.log()), 30, "a line of the MCP server's stderr"
    )
    assert found[1] in workers or re.fullmatch(r"w\d+\.\d+", found[1])
    stop(daemon)

    # Where the test's directory is on tmpfs, the start warns of it too: not the point here.
    lines = [line for line in run_lines(daemon) if "(memory, mounted at" not in line]
    state, run = daemon.state, daemon.root / "run"
    first = [line.split("] ", 1)[1] for line in lines[:8]]
    assert first == [
        f"turnkeeper {__version__} starting (pid {daemon.pid})",
        f"configuration: {daemon.config_path}",
        f"state directory: {state}; runtime directory: {run}",
        descriptors_line(first),
        f"database: sqlite:///{state / 'turnkeeper.db'}",
        f"listen: {daemon.listen}",
        "interrupted turns: continued after a restart, when at most 3600 s old"
        " (recovery.auto_continue = true)",
        "TURNKEEPER_HTTP_LISTEN is not a configuration variable and is ignored;"
        " did you mean TURNKEEPER_HTTP__LISTEN?",
    ], lines[:8]
    assert all(TEXT_LINE.match(line) for line in lines[:8])
    assert "WARNING" in lines[7]
    assert sum("TURNKEEPER_HTTP_LISTEN" in line for line in lines) == 1  # once, not per worker
    # Every line a worker or its MCP server wrote names the worker.
    tagged = [line for line in lines if re.search(r"\[(worker|mcp)\]", line)]
    assert len(tagged) >= len(workers) + 1  # each worker's "ready", at least one stderr line
    assert all(re.search(r"\] worker=w\d+\.\d+ ", line) for line in tagged), tagged
    assert all(" server=basic " in line for line in tagged if "[mcp]" in line)
    # Every exit of a worker is named.
    exits = [line for line in lines if re.search(r"worker w\d+\.\d+ \(pid \d+\) exited", line)]
    assert len(exits) >= len(workers)
    assert all(NAMED_EXIT.search(line) for line in exits), exits
    assert "unknown" not in "\n".join(lines)


def descriptors_line(lines: list[str]) -> str:
    """The start's line about the file descriptor limit, which depends on the machine's
    limits: raised, or nothing to raise. The test's list compares it in its place."""
    found = [line for line in lines if line.startswith("file descriptors: soft limit ")]
    assert len(found) == 1, lines
    assert re.fullmatch(
        r"file descriptors: soft limit (raised from \d+ to \d+ \(hard \d+\)"
        r"|\d+ \(hard \d+\), nothing to raise)",
        found[0],
    ), found
    return found[0]


def test_start_lines_of_built_in_defaults_mask_the_database_password(tmp_path: Path) -> None:
    """A daemon on built-in defaults and a database that refuses: the first lines are
    written before the database is opened, and neither they nor the wait for it show its
    password."""
    url = f"postgresql://tk:{SECRET}@127.0.0.1:1/tk"
    env = python_env(
        HOME=str(tmp_path),
        TURNKEEPER_CONFIG="",
        TURNKEEPER_STORE__URL=url,
        TURNKEEPER_STORE__CONNECT_TIMEOUT="1",
        TURNKEEPER_DAEMON__STATE_DIR=str(tmp_path / "state"),
        TURNKEEPER_DAEMON__RUNTIME_DIR=str(tmp_path / "run"),
        TURNKEEPER_HTTP__LISTEN=f"unix:{tmp_path / 'api.sock'}",
    )
    proc = subprocess.Popen(
        [PYTHON, "-m", "supervisor", "run"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 1, output
    lines = [line.split("] ", 1)[1] for line in output.splitlines() if TEXT_LINE.match(line)]
    assert lines[:6] == [
        f"turnkeeper {__version__} starting (pid {proc.pid})",
        "configuration: built-in defaults",
        f"state directory: {tmp_path / 'state'}; runtime directory: {tmp_path / 'run'}",
        descriptors_line(lines),
        "database: postgresql://tk:***@127.0.0.1:1/tk",
        f"listen: unix:{tmp_path / 'api.sock'}",
    ], output
    assert "waiting for the database postgresql://tk:***@127.0.0.1:1/tk" in output
    assert "cannot start" in output
    assert SECRET not in output


@pytest.mark.timeout(120)
def test_json_lines_are_flat_objects(daemons: Daemons) -> None:
    daemon = daemons(log={"format": "json", "level": "DEBUG"}).start()
    with daemon.client() as http:
        ok = http.post("/v1/sessions", json={}).json()["id"]
        failing = http.post("/v1/sessions", json={}).json()["id"]
        assert http.post(f"/v1/sessions/{ok}/inject", json={"text": "hi"}).status_code == 202
        raised = http.post(f"/v1/sessions/{failing}/inject", json={"text": "/raise SystemExit"})
        assert raised.status_code == 202
    with Store(daemon.url, migrate=False) as store:
        wait_until(lambda: turn_ended(store, ok), 30, "the turn")
        ended = wait_until(lambda: turn_ended(store, failing), 30, "the failing turn")
        assert ended.payload["outcome"] == "failed"
    stop(daemon)

    records = [json.loads(line) for line in run_lines(daemon)]
    assert all(isinstance(r, dict) for r in records)
    allowed = {"ts", "level", "subsystem", "message", "session", "worker", "turn", "server"}
    allowed |= {"exception", "action", "trigger"}
    for record in records:
        assert {"ts", "level", "subsystem", "message"} <= set(record), record
        assert set(record) <= allowed, record
        assert all(isinstance(v, str | int | float | bool) for v in record.values()), record
        assert datetime.fromisoformat(record["ts"]).tzinfo is not None, record
        assert "\x1b" not in record["message"] and "Traceback" not in record["message"]
    messages = [r["message"] for r in records]
    assert messages[0] == f"turnkeeper {__version__} starting (pid {daemon.pid})"
    by_workers = [r for r in records if r["subsystem"] == "worker"]
    assert by_workers and all(re.fullmatch(r"w\d+\.\d+", r["worker"]) for r in by_workers)
    assert not any("worker" in r for r in records if r["subsystem"] in ("daemon", "shutdown"))
    assert any(r.get("session") == ok and r.get("turn") for r in by_workers)
    failure = next(r for r in records if r.get("session") == failing and "exception" in r)
    assert failure["level"] == "ERROR" and failure["worker"]
    assert "SystemExit" in failure["exception"] and "Traceback" in failure["exception"]


@pytest.mark.timeout(180)
def test_an_idle_daemon_is_quiet(daemons: Daemons) -> None:
    """Hundreds of idle sessions add nothing to a stop; a timer that finds nothing says
    nothing at INFO (it does at DEBUG, so it ran)."""
    daemon = daemons(recovery={"retry_interval": 0.2}, log={"level": "DEBUG"}).start()
    with daemon.client() as http:
        sessions = [http.post("/v1/sessions", json={}).json()["id"] for _ in range(200)]
        for sid in sessions:
            assert http.post(f"/v1/sessions/{sid}/inject", json={"text": "hi"}).status_code == 202
    with Store(daemon.url, migrate=False) as store:
        for sid in sessions:
            wait_until(lambda sid=sid: turn_ended(store, sid), 60, "every turn")
    wait_until(lambda: daemon.log().count("retry_timer: 0 interrupted") >= 3, 20, "the timer")
    stop(daemon)

    lines = run_lines(daemon)
    info = [line for line in lines if TEXT_LINE.match(line)["level"] != "DEBUG"]  # type: ignore[index]
    assert not [line for line in info if "retry_timer" in line]
    assert any("boot_scan: 0 interrupted sessions" in line for line in info)
    stopping = next(i for i, line in enumerate(info) if "received SIGTERM" in line)
    at_stop = info[stopping:]
    assert any("stopped cleanly" in line for line in at_stop)
    assert not [line for line in at_stop if "session=" in line], at_stop
    assert len(at_stop) <= 15, at_stop
    exits = [line for line in at_stop if " exited with " in line]
    assert exits and all(NAMED_EXIT.search(line) for line in exits), exits
