"""A reload against a real daemon: the pool grows and shrinks, an MCP server's new command
reaches new workers, a turn in flight finishes once, an invalid edit changes nothing (the
start's one line, exit 78), `http.listen` is named as needing a restart and the old
address goes on serving (the command line sends the admin token to no other), a new
`daemon.state_dir` too (the command line finds the daemon all the same), the tokens file
is read again, and SIGHUP does the same."""

from __future__ import annotations

import copy
import hashlib
import json
import signal
import socket
import subprocess
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import pytest
import tomli_w

from supervisor.store import Store
from tests.conftest import PYTHON
from tests.daemon import Daemon, daemons, events, turnkeeper, wait_until
from tests.support import start_turnkeeper

__all__ = ["daemons"]  # the fixture
Daemons = Callable[..., Daemon]
TINY = [PYTHON, "-m", "tests.mcp_servers.tiny"]
TINY_UTF8 = [PYTHON, "-X", "utf8", "-m", "tests.mcp_servers.tiny"]


def edit(daemon: Daemon, /, **sections: dict[str, Any]) -> dict[str, Any]:
    """Write the daemon's file with `sections` changed (the test's `daemon.config`, which
    says where to reach the daemon, is left as it is); the configuration written."""
    config = copy.deepcopy(daemon.config)
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    daemon.config_path.write_text(tomli_w.dumps(config))
    return config


def version(daemon: Daemon) -> str:
    found: str = daemon.status()["config"]["version"]
    return found


def slots(daemon: Daemon) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = daemon.status()["slots"]
    return found


@pytest.mark.timeout(180)
def test_a_reload_resizes_the_pool_and_replaces_workers_for_a_new_mcp_command(
    daemons: Daemons, tmp_path: Path
) -> None:
    tiny = {"name": "tiny", "command": TINY}
    daemon = daemons(pool={"workers": 2, "spare": 0}, mcp={"servers": [tiny]}).start()
    before = version(daemon)
    assert len(slots(daemon)) == 2
    gate = tmp_path / "gate"  # holds the turn in flight across the reload
    with Store(daemon.url, migrate=False) as store:
        sid = store.sessions.create("test").id
        store.events.append(sid, "user_message", {"text": f"/gate {gate} go"}, writer="cli")
        wait_until(lambda: store.sessions.get(sid).active_turn_id, 30, "the turn to start")
        owner = str(store.sessions.get(sid).owner).rsplit("/", 1)[-1]
        edit(daemon, pool={"workers": 3}, mcp={"servers": [{"name": "tiny", "command": TINY_UTF8}]})
        reload = start_turnkeeper("reload", config=daemon.config_path)
        try:
            # Applied to the supervisor: a new version, three slots, the turn still running.
            wait_until(lambda: version(daemon) != before, 30, "the new configuration")
            assert len(slots(daemon)) == 3
            assert store.sessions.get(sid).active_turn_id
            # The owner's slot has its new worker, ready: the old one is asked to let go.
            index = int(owner[1:].split(".")[0])
            wait_until(
                lambda: any(
                    s["slot"] == index and s["worker"] != owner and s["ready"]
                    for s in slots(daemon)
                ),
                60,
                "the owner's replacement",
            )
            gate.touch()
            out, err = reload.communicate(timeout=90)
        finally:
            if reload.poll() is None:
                reload.kill()
        assert reload.returncode == 0, (out, err)
        lines = out.splitlines()
        assert "pool.workers: 2 -> 3" in lines
        assert f"mcp.servers.tiny.command: {_json(TINY)} -> {_json(TINY_UTF8)}" in lines
        after = version(daemon)
        assert f"configuration {before} -> {after}" in lines
        assert lines[-1] == "workers replaced"
        ended = wait_until(lambda: _ended(store, sid), 30, "the turn to end")
        kinds = [e.type for e in events(store, sid)]
        assert kinds.count("turn_started") == 1 and kinds.count("turn_ended") == 1, kinds
        assert kinds.count("model_response") == 1, kinds
        assert ended.payload["outcome"] == "completed"
    now = slots(daemon)
    assert [s["slot"] for s in now] == [0, 1, 2] and all(s["ready"] for s in now)
    assert owner not in {s["worker"] for s in now}
    for slot in now:  # every worker runs the new command
        wait_until(partial(_mcp_ready, daemon, slot["slot"]), 30, "its MCP server")
        children = [" ".join(c.cmdline()) for c in psutil.Process(slot["pid"]).children()]
        assert any("-X utf8 -m tests.mcp_servers.tiny" in c for c in children), children
    again = turnkeeper(daemon, "reload")
    assert again.returncode == 0, again
    assert again.stdout.splitlines() == [f"configuration {after} unchanged", "workers kept"]
    assert [s["worker"] for s in slots(daemon)] == [s["worker"] for s in now]
    # --no-wait returns while a held turn keeps the rolling restart (--workers) waiting.
    held = tmp_path / "held"
    with Store(daemon.url, migrate=False) as store:
        sid = store.sessions.create("test").id
        store.events.append(sid, "user_message", {"text": f"/gate {held} go"}, writer="cli")
        wait_until(lambda: store.sessions.get(sid).active_turn_id, 30, "the second turn")
        early = turnkeeper(daemon, "reload", "--workers", "--no-wait")
        assert early.returncode == 0, early
        assert early.stdout.splitlines() == [
            f"configuration {after} unchanged",
            "workers being replaced",
        ]
        assert store.sessions.get(sid).active_turn_id  # held: the replacement is not over
        held.touch()
        old = {s["worker"] for s in now}
        wait_until(
            lambda: all(s["ready"] and s["worker"] not in old for s in slots(daemon)),
            90,
            "every worker to be replaced",
        )
        wait_until(lambda: _ended(store, sid), 30, "the second turn to end")
        assert [e.type for e in events(store, sid)].count("turn_ended") == 1


@pytest.mark.timeout(180)
def test_an_invalid_configuration_changes_nothing_and_says_what_a_start_says(
    daemons: Daemons,
) -> None:
    daemon = daemons(pool={"workers": 2, "spare": 0}).start()
    before, workers = version(daemon), daemon.worker_pids()
    text = daemon.config_path.read_text()
    # Refused by the command line itself: the file does not load.
    daemon.config_path.write_text(text + "\n[pool\n")
    refused = turnkeeper(daemon, "reload")
    assert refused.returncode == 78, refused
    assert refused.stderr.startswith("turnkeeper: configuration error: ")
    assert "invalid TOML" in refused.stderr and refused.stderr.count("\n") == 1
    assert refused.stderr == _start(daemon).stderr  # what a start of it says
    # ... and by the daemon on SIGHUP: it logs why and goes on.
    daemon.signal(signal.SIGHUP)
    wait_until(lambda: "refused, configuration" in daemon.log(), 30, "the refusal")
    edit(daemon, pool={"workers": 0})
    refused = turnkeeper(daemon, "reload")
    assert refused.returncode == 78 and "pool.workers: " in refused.stderr, refused
    assert refused.stderr == _start(daemon).stderr
    # Refused by the daemon: the file loads, a start's check does not pass.
    missing = {"name": "gone", "command": ["no-such-mcp-server-here"]}
    edit(daemon, pool={"workers": 3}, mcp={"servers": [missing]})
    refused = turnkeeper(daemon, "reload", "--json")
    assert refused.returncode == 78, refused
    line = refused.stderr.strip()
    assert "mcp.servers.gone.command: 'no-such-mcp-server-here' is not found" in line
    assert refused.stderr == _start(daemon).stderr
    result = json.loads(refused.stdout)
    assert not result["ok"] and result["error"] in line and result["changes"] == []
    assert result["version"] == result["version_before"] == before
    assert version(daemon) == before and daemon.worker_pids() == workers
    assert daemon.proc is not None and daemon.proc.poll() is None


@pytest.mark.timeout(180)
def test_http_listen_needs_a_restart_the_rest_is_applied_by_sighup(
    daemons: Daemons, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice sha256:{hashlib.sha256(b'alice-token').hexdigest()}\n")
    tokens.chmod(0o600)
    daemon = daemons(pool={"workers": 2, "spare": 0}, auth={"tokens_file": str(tokens)})
    daemon.start()
    before = version(daemon)
    retired = {s["worker"]: s["pid"] for s in slots(daemon) if s["slot"] == 1}
    moved = tmp_path / "moved.sock"
    edit(daemon, http={"listen": f"unix:{moved}"}, pool={"workers": 1})
    with tokens.open("a") as more:
        more.write(f"bob sha256:{hashlib.sha256(b'bob-token').hexdigest()}\n")
    daemon.signal(signal.SIGHUP)
    wait_until(lambda: len(slots(daemon)) == 1, 60, "slot 1 to be retired")
    for pid in retired.values():
        wait_until(partial(_gone, pid), 30, "the retired worker to exit")
    changed = version(daemon)
    assert changed != before
    assert _as(daemon, "bob-token").status_code == 200  # the tokens file was read again
    assert _as(daemon, "nobody").status_code == 401
    # The command line finds the daemon where it listens, not where the file says: the
    # admin token goes to no other address (something else listens at the new one now).
    with socket.socket(socket.AF_UNIX) as decoy:
        decoy.bind(str(moved))
        decoy.listen()
        decoy.setblocking(False)
        result = turnkeeper(daemon, "reload", "--timeout", "20")
        assert result.returncode == 0, result
        assert result.stdout.splitlines() == [
            "needs a restart: http.listen (left as it was)",
            f"configuration {changed} unchanged",
            "workers kept",
        ]
        with pytest.raises(BlockingIOError):
            decoy.accept()  # nobody came
        status = turnkeeper(daemon, "status", TURNKEEPER_HTTP__LISTEN=daemon.listen)
        assert f"configuration {changed} loaded " in status.stdout, status
        # ... also when the file names other directories: their daemon is found all the same.
        edit(
            daemon,
            daemon={"state_dir": str(tmp_path / "elsewhere"), "runtime_dir": str(tmp_path / "r")},
            http={"listen": f"unix:{moved}"},
            pool={"workers": 1},
        )
        result = turnkeeper(daemon, "reload", "--timeout", "20")
        assert result.returncode == 0, result
        assert result.stdout.splitlines() == [
            "needs a restart: daemon.state_dir (left as it was)",
            "needs a restart: daemon.runtime_dir (left as it was)",
            "needs a restart: http.listen (left as it was)",
            f"configuration {changed} unchanged",
            "workers kept",
        ]
        with pytest.raises(BlockingIOError):
            decoy.accept()
    assert daemon.ready()  # the old address serves
    assert daemon.status()["config"]["source"] == str(daemon.config_path)


def _json(value: Any) -> str:
    return json.dumps(value)


def _ended(store: Store, session_id: str) -> Any:
    return next((e for e in events(store, session_id) if e.type == "turn_ended"), None)


def _mcp_ready(daemon: Daemon, index: int) -> bool:
    slot = next(s for s in slots(daemon) if s["slot"] == index)
    return [m["state"] for m in slot["mcp"]] == ["ready"]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _as(daemon: Daemon, token: str) -> Any:
    with daemon._http(token, timeout=10) as http:
        return http.get("/v1/sessions")


def _start(daemon: Daemon) -> subprocess.CompletedProcess[str]:
    """`turnkeeper run` of the file as it is now: a start refuses it before the lock."""
    started = turnkeeper(daemon, "run")
    assert started.returncode == 78, started
    return started
