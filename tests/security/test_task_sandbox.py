"""A background task is no way into the state directory (issue 28): a token holder's task
runs outside it, with none of the daemon's secrets in its environment, and no argument
becomes a `..` path or an option the kind did not write, whatever the kind's pattern."""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import tomli_w

from supervisor.store import EventRecord, Store
from supervisor.tasks.rules import KindRules, TaskRefused, check_args, render
from tests.daemon import Daemon, daemons, events, tokens_file, turn_ended, wait_until

__all__ = ["daemons"]  # the fixture

Daemons = Callable[..., Daemon]
pytestmark = pytest.mark.timeout(180)

LOOSE = "^[A-Za-z0-9_./-]+$"  # a pattern written carelessly: paths and dashes alike
ALICE = "alice-token-0123456789"
KINDS = [
    {"name": "read", "command": ["cat", "{file}"], "args": {"file": LOOSE}},
    {"name": "where", "command": ["pwd"]},
    {"name": "environment", "command": ["env"]},
    {
        "name": "argv",
        "command": ["python3", "-c", "import sys; print(sys.argv[1:])", "{word}"],
        "args": {"word": LOOSE},
        "allow_dash": True,
        "end_of_options": True,
    },
]
FAST = {"reconcile_interval": 0.5, "lost_grace": 4.0, "kill_grace": 1.0}


# --- the rules, without a daemon -------------------------------------------------------


def test_no_pattern_admits_a_dotdot_segment_or_a_leading_dash() -> None:
    kind = KindRules("read", ("cat", "{file}"), {"file": LOOSE})
    for value in ("../../admin.token", "a/../../b", "..", "x/..", "-n", "--help", "-"):
        with pytest.raises(TaskRefused, match="'file'"):
            check_args(kind, {"file": value})
    for value in ("notes.txt", "a/b.c", "..hidden", "a..b", "x-y", "./notes"):
        assert check_args(kind, {"file": value}) == {"file": value}


def test_a_kind_may_allow_a_dash_but_never_a_dotdot() -> None:
    kind = KindRules("grep", ("grep", "{flag}"), {"flag": LOOSE}, allow_dash=True)
    assert check_args(kind, {"flag": "-n"}) == {"flag": "-n"}
    with pytest.raises(TaskRefused, match=r"'\.\.'"):
        check_args(kind, {"flag": "-f../../admin.token"})


def test_end_of_options_goes_before_the_first_placeholder() -> None:
    command = ("grep", "-n", "{word}", "{file}")
    args = {"word": "-v", "file": "notes"}
    assert render(command, args) == ["grep", "-n", "-v", "notes"]
    assert render(command, args, end_of_options=True) == ["grep", "-n", "--", "-v", "notes"]
    # Written by the operator already: not twice.
    assert render(("cat", "--", "{file}"), args, end_of_options=True) == ["cat", "--", "notes"]


# --- a real daemon ---------------------------------------------------------------------


def sandbox_daemon(daemons: Daemons, tmp_path: Path, **tasks: object) -> Daemon:
    tokens = tokens_file(tmp_path / "tokens", {"alice": ALICE})
    daemon = daemons(auth={"tokens_file": str(tokens)}, tasks={"kinds": KINDS, **FAST, **tasks})
    # The service user's home is its state directory (the unit's `useradd --home-dir`).
    daemon.env = {
        "HOME": str(daemon.state),
        "TURNKEEPER_TOKEN": "secret-of-the-operator",
        "MODEL_API_KEY": "secret-of-the-model",
    }
    return daemon


def alice(daemon: Daemon) -> httpx.Client:
    client = daemon.client()
    client.headers["Authorization"] = f"Bearer {ALICE}"
    return client


def start_task(daemon: Daemon, store: Store, kind: str, args: dict[str, str]) -> str:
    """Alice's new session asks for a task; the session id once its turn ended."""
    with alice(daemon) as http:
        session = http.post("/v1/sessions", json={"title": "alice's"}).json()["id"]
        seq = http.post(
            f"/v1/sessions/{session}/inject", json={"text": f"/task {kind} {json.dumps(args)}"}
        ).json()["seq"]
    wait_until(lambda: turn_ended(store, session, seq), 30, "the turn that asks for the task")
    return session


def tool_results(store: Store, session: str) -> list[str]:
    return [str(e.payload) for e in events(store, session) if e.type == "tool_result"]


def finished(store: Store, session: str) -> EventRecord:
    def result() -> EventRecord | None:
        return next((e for e in events(store, session) if e.type == "task_result"), None)

    return wait_until(result, 60, "the task's result")


def output(daemon: Daemon, task_id: str) -> str:
    with alice(daemon) as http:
        return http.get(f"/v1/tasks/{task_id}/output").text


def test_a_token_holder_cannot_read_the_admin_token_through_a_task(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = sandbox_daemon(daemons, tmp_path).start()
    admin_token = (daemon.state / "admin.token").read_text().strip()
    with Store(daemon.url, migrate=False) as store:
        for path in ("../../admin.token", "../state/admin.token", "-n"):
            session = start_task(daemon, store, "read", {"file": path})
            assert store.tasks.of_session(session) == [], path  # nothing written
            [result] = tool_results(store, session)
            assert "no task started" in result, result
        # A relative path names a file of the task's own directory, not of the state's.
        session = start_task(daemon, store, "read", {"file": "admin.token"})
        [task] = store.tasks.of_session(session)
        finished(store, session)
        assert store.tasks.get(task.id).status == "failed"
        assert admin_token not in output(daemon, task.id)


def test_a_task_runs_in_a_private_directory_outside_the_state_directory(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = sandbox_daemon(daemons, tmp_path, keep=1.0).start()
    with Store(daemon.url, migrate=False) as store:
        session = start_task(daemon, store, "where", {})
        [task] = store.tasks.of_session(session)
        finished(store, session)
        assert store.tasks.get(task.id).status == "succeeded"
        cwd = Path(output(daemon, task.id).strip())
        work_dir = daemon.state.with_name(daemon.state.name + "-tasks")
        assert cwd == work_dir / task.id
        assert daemon.state not in cwd.parents
        for directory in (work_dir, cwd):
            assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        # Past tasks.keep the next sweep (one at each start, then hourly) removes it: the
        # restart comes once it is past, however quick the stop and the start are.
        wait_until(lambda: time.time() - cwd.stat().st_mtime > 1.5, 10, "tasks.keep to pass")
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(30) == 0
        daemon.start()
        wait_until(lambda: not cwd.exists(), 30, "the task's directory to be removed")


def test_a_task_gets_none_of_the_daemons_secrets_nor_its_home(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = sandbox_daemon(daemons, tmp_path).start()
    with Store(daemon.url, migrate=False) as store:
        session = start_task(daemon, store, "environment", {})
        [task] = store.tasks.of_session(session)
        finished(store, session)
        env = dict(
            line.split("=", 1) for line in output(daemon, task.id).splitlines() if "=" in line
        )
    assert "secret-of" not in json.dumps(env)
    assert not any(name.startswith("TURNKEEPER_") for name in env)
    assert set(env) <= {"PATH", "HOME", "LANG", "LC_ALL", "TZ", "USER", "LOGNAME", "PWD"}
    assert not Path(env["HOME"]).resolve().is_relative_to(daemon.state.resolve())


def test_end_of_options_and_allow_dash_with_a_real_daemon(daemons: Daemons, tmp_path: Path) -> None:
    daemon = sandbox_daemon(daemons, tmp_path).start()
    with Store(daemon.url, migrate=False) as store:
        session = start_task(daemon, store, "argv", {"word": "-x"})
        [task] = store.tasks.of_session(session)
        finished(store, session)
        assert output(daemon, task.id).strip() == "['--', '-x']"


@pytest.mark.parametrize("where", ["work_dir", "cwd"])
def test_a_work_directory_inside_the_state_directory_is_a_configuration_error(
    daemons: Daemons, tmp_path: Path, where: str
) -> None:
    daemon = daemons(tasks={"kinds": KINDS})
    inside = str(daemon.state / "tasks")
    if where == "work_dir":
        daemon.config["tasks"]["work_dir"] = inside
    else:
        daemon.config["tasks"]["kinds"] = [{"name": "here", "command": ["pwd"], "cwd": inside}]
    daemon.state.mkdir(parents=True, mode=0o700)
    (daemon.state / "tasks").mkdir(mode=0o700)
    daemon.config_path.write_text(tomli_w.dumps(daemon.config))
    daemon.start(wait=False)
    assert daemon.wait(60) == 78
    key = "tasks.work_dir" if where == "work_dir" else "tasks.kinds.here.cwd"
    assert f"{key}: " in daemon.log()
