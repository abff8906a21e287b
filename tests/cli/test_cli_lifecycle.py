"""`turnkeeper stop` and `reload` as operators use them: the service manager is
respected, a stopped daemon is not an error, and a reload waits until it is done."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import tomli_w

from supervisor.cli.service import detect
from tests.conftest import PYTHON, REPO, python_env
from tests.daemon import Daemon, daemons, wait_until
from tests.support import run_turnkeeper

__all__ = ["daemons"]  # the fixture
Daemons = Callable[..., Daemon]


def cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_turnkeeper(*args, env=python_env(), config=config, timeout=120)


SYSTEM = "0::/system.slice/turnkeeper.service\n"
USER = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/tk.service\n"


@pytest.mark.parametrize(
    ("environ", "cgroup", "parent", "expected"),
    [
        pytest.param({"INVOCATION_ID": "x"}, SYSTEM, "systemd", "systemctl stop turnkeeper",
                     id="systemd"),
        pytest.param(None, SYSTEM, "systemd", "systemctl stop turnkeeper",
                     id="systemd-environ-unreadable"),
        pytest.param({}, USER, "systemd", "systemctl --user stop tk", id="user-unit"),
        pytest.param({"SUPERVISOR_ENABLED": "1", "SUPERVISOR_PROCESS_NAME": "tk",
                      "SUPERVISOR_GROUP_NAME": "agents"}, "0::/\n", "supervisord",
                     "supervisorctl stop agents:tk", id="supervisord-group"),
        pytest.param({"SUPERVISOR_ENABLED": "1"}, "0::/\n", "supervisord",
                     "supervisorctl stop turnkeeper", id="supervisord"),
        # Inherited variables alone: the tests of a CI runner that is itself a service.
        pytest.param({"INVOCATION_ID": "x"}, "0::/system.slice/ci.service\n", "python3", None,
                     id="below-a-service"),
        pytest.param({"SUPERVISOR_ENABLED": "1"}, "0::/\n", "bash", None,
                     id="below-a-supervisord-program"),
        pytest.param({}, "0::/\n", "systemd", None, id="pid1-in-a-container"),
        pytest.param({}, "", "bash", None, id="by-hand"),
    ],
)  # fmt: skip
def test_the_service_manager_is_told_by_the_parent(
    environ: dict[str, str] | None, cgroup: str, parent: str, expected: str | None
) -> None:
    manager = detect(environ, cgroup, parent)
    assert (manager.stop_command if manager else None) == expected


def test_stop_of_a_stopped_daemon_is_not_an_error(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path / "d")
    result = cli(daemon.config_path, "stop")
    assert result.returncode == 0, result
    assert "not running" in result.stdout


def test_reload_without_a_daemon_exits_3(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path / "d")
    result = cli(daemon.config_path, "reload")
    assert result.returncode == 3, result
    assert "not running" in result.stderr


def history_cache(daemon: Daemon, megabytes: int) -> None:
    """Change a key only the workers read in the daemon's file: a reload replaces them."""
    daemon.config["pool"]["history_cache_mb"] = megabytes
    daemon.config_path.write_text(tomli_w.dumps(daemon.config))


@pytest.mark.timeout(240)  # a minute or more on a busy two-core machine
def test_reload_waits_for_the_rolling_restart_and_says_what_it_did(daemons: Daemons) -> None:
    daemon = daemons().start()
    before = daemon.worker_pids(ready=True)
    assert before
    version = daemon.status()["config"]["version"]
    history_cache(daemon, 32)
    result = cli(daemon.config_path, "reload")
    assert result.returncode == 0, result
    # When it returns every old worker has exited and a new one serves each slot.
    for pid in before.values():
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
    status = daemon.status()
    assert all(slot["ready"] for slot in status["slots"])
    now = {slot["worker"] for slot in status["slots"]}
    assert not now & set(before)
    assert result.stdout.splitlines() == [
        "pool.history_cache_mb: 64 -> 32",
        f"configuration {version} -> {status['config']['version']}",
        "workers replaced",
    ]
    # Nothing changed: the workers stay, unless asked for.
    kept = cli(daemon.config_path, "reload", "--json")
    assert kept.returncode == 0, kept
    document = json.loads(kept.stdout)
    assert document["ok"] and not document["workers_replaced"] and document["changes"] == []
    assert {slot["worker"] for slot in daemon.status()["slots"]} == now
    again = cli(daemon.config_path, "reload", "--workers", "--json")
    assert again.returncode == 0, again
    document = json.loads(again.stdout)
    assert document["ok"] and document["workers_replaced"] and document["changes"] == []
    status = daemon.status()
    assert document["version"] == status["config"]["version"] == document["version_before"]
    assert not now & {slot["worker"] for slot in status["slots"]}
    stopped = cli(daemon.config_path, "stop")
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped


def test_stop_drain_on_a_terminal_shows_the_turns_in_flight(
    daemons: Daemons, tmp_path: Path
) -> None:
    import os
    import pty
    import select
    import signal

    daemon = daemons().start()
    gate = tmp_path / "gate"  # the turn stays in flight until the progress was seen
    with daemon.client() as client:
        sid = client.post("/v1/sessions", json={}).json()["id"]
        client.post(f"/v1/sessions/{sid}/inject", json={"text": f"/gate {gate} go"})
    wait_until(lambda: sum(s["turns"] for s in daemon.status()["slots"]), 30, "the turn")
    pid, fd = pty.fork()
    if pid == 0:  # the child: the CLI on the terminal
        os.chdir(REPO)
        args = ["--config", str(daemon.config_path), "stop", "--drain=60"]
        os.execve(PYTHON, [PYTHON, "-m", "supervisor", *args], python_env())
    seen = b""
    try:
        while b"draining: 1 turns in flight" not in seen:
            ready, _, _ = select.select([fd], [], [], 30)
            assert ready, f"no progress on the terminal: {seen!r}"
            seen += os.read(fd, 4096)
        gate.touch()
        while True:
            ready, _, _ = select.select([fd], [], [], 60)
            assert ready, f"stop did not finish: {seen!r}"
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the terminal closed: the CLI exited
                break
            if not chunk:
                break
            seen += chunk
    except BaseException:
        os.kill(pid, signal.SIGKILL)  # no CLI left waiting on a daemon the cleanup kills
        raise
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, seen
    assert b"stopped (pid" in seen, seen


def test_db_migrate_json(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path / "d")
    first = cli(daemon.config_path, "db", "migrate", "--json")
    assert first.returncode == 0, first
    created = json.loads(first.stdout)
    assert created["backend"] == "sqlite" and created["schema"] >= 1
    again = json.loads(cli(daemon.config_path, "db", "migrate", "--json").stdout)
    assert again["schema_before"] == again["schema"] == created["schema"]
