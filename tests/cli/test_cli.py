"""The command line as a user runs it: real processes, a real database file."""

from __future__ import annotations

import signal
import stat
import subprocess
import time
from pathlib import Path

from supervisor.store import Store
from tests.conftest import PYTHON, REPO, python_env
from tests.support import run_turnkeeper


def turnkeeper(state: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = python_env(TURNKEEPER_DAEMON__STATE_DIR=str(state), TURNKEEPER_CONFIG="", **env)
    return run_turnkeeper(*args, env=environ)


def test_read_commands_refuse_a_missing_database_without_creating_one(tmp_path: Path) -> None:
    state = tmp_path / "state"
    result = turnkeeper(state, "sessions", "list")
    assert result.returncode == 1
    assert "turnkeeper db migrate" in result.stderr and "Traceback" not in result.stderr
    assert not (state / "turnkeeper.db").exists()


def test_migrate_creates_a_private_database(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = turnkeeper(state, "db", "migrate")
    assert first.returncode == 0, first.stderr
    assert "migrated from version 0" in first.stdout
    assert "nothing to do" in turnkeeper(state, "db", "migrate").stdout
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "turnkeeper.db").stat().st_mode) == 0o600


def test_sessions_list_and_show(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with Store(f"sqlite:///{state / 'turnkeeper.db'}") as store:
        sid = store.sessions.create("alice", title="hello world").id
        store.events.append(sid, "user_message", {"text": "what time is it?"}, writer="intake")
        store.events.append(sid, "tool_call", {"name": "clock", "arguments": {}}, writer="intake")
    listing = turnkeeper(state, "sessions", "list")
    assert listing.returncode == 0, listing.stderr
    assert sid in listing.stdout and "hello world" in listing.stdout
    shown = turnkeeper(state, "sessions", "show", sid)
    assert shown.returncode == 0, shown.stderr
    assert "what time is it?" in shown.stdout and "tool_call" in shown.stdout
    assert "alice=admin" in shown.stdout
    missing = turnkeeper(state, "sessions", "show", "nope")
    assert missing.returncode == 1 and "no session 'nope'" in missing.stderr


def test_run_starts_records_its_boot_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    state = tmp_path / "state"
    proc = subprocess.Popen(
        [PYTHON, "-m", "supervisor", "run"],
        cwd=REPO,
        env=python_env(TURNKEEPER_DAEMON__STATE_DIR=str(state), TURNKEEPER_CONFIG=""),
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 30
    while "ready" not in proc.stderr.readline():
        assert time.monotonic() < deadline and proc.poll() is None
    boots = turnkeeper(state, "boots")
    assert str(proc.pid) in boots.stdout
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    boots = turnkeeper(state, "boots")
    assert boots.returncode == 0
    row = next(line for line in boots.stdout.splitlines() if str(proc.pid) in line)
    assert row.split()[-2:] == ["clean", "clear"]  # its outcome, and how it found the breaker


def test_a_bad_store_url_is_a_configuration_error(tmp_path: Path) -> None:
    result = turnkeeper(tmp_path, "db", "migrate", TURNKEEPER_STORE__URL="redis://localhost/0")
    assert result.returncode == 78
    assert result.stderr.strip().count("\n") == 0 and "store.url" in result.stderr


def test_the_console_script_and_python_m_agree(tmp_path: Path) -> None:
    script = Path(PYTHON).parent / "turnkeeper"
    assert script.exists(), "the package is not installed with its console script"
    by_script = subprocess.run([str(script), "--version"], capture_output=True, text=True)
    by_module = turnkeeper(tmp_path, "--version")
    assert by_script.returncode == by_module.returncode == 0
    assert by_script.stdout == by_module.stdout and "turnkeeper" in by_script.stdout
