"""MCP servers and background tasks work inside the shipped unit's sandbox.

PID 1 of the machines this suite runs on is not always systemd, so the unit cannot be
started as a service; `tests.unit_sandbox` makes, from the unit file itself, what could
keep them from working: its system call filter and socket families (seccomp), no new
privileges and no capabilities, a read-only file system but for the daemon's own
directories, and its umask. Under all of it a real daemon runs a python and a node MCP
server (node's JIT included), which writes in its working directory and reaches the
network, and a task that writes in its directory and fetches over TCP; and the same
sandbox refuses a task what the unit forbids (writing /etc, a chown, a packet socket), so
it is really in force. The unit's ExecReload= (`turnkeeper reload`), run in the same
sandbox with the environment the unit gives it, applies a configuration and fails (78)
on one the daemon refuses. Then a SIGTERM stops the daemon cleanly, its tree reaped."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import tomli_w

from supervisor.cli.doctor import unit_settings
from supervisor.store import EventRecord, Store
from tests.conftest import PYTHON, REPO, python_env
from tests.daemon import Daemon, LoopbackServer, daemons, events, wait_until
from tests.restart_harness import inject, new_session
from tests.support import free_port
from tests.unit_sandbox import launcher, write_allowed

__all__ = ["daemons"]  # the fixture
UNIT = REPO / "systemd" / "turnkeeper.service"
MISSING = [
    tool
    for tool in ("unshare", "setpriv", "findmnt", "node", "systemd-analyze")
    if shutil.which(tool) is None
]

# A task the unit must refuse three things: a write outside its directories, a chown
# (the filter's ~@privileged; of its own file to its own owner, which needs no
# capability), a packet socket (RestrictAddressFamilies=).
FORBIDDEN = "\n".join(
    [
        "import os, socket",
        "open('mine', 'w').close()",
        "for name, attempt in [('etc', lambda: open('/etc/turnkeeper-sandbox', 'w')),",
        "                      ('chown', lambda: os.chown('mine', os.getuid(), os.getgid())),",
        "                      ('packet', lambda: socket.socket(socket.AF_PACKET, 3))]:",
        "    try:",
        "        attempt()",
        "        print(name, 'allowed')",
        "    except OSError as exc:",
        "        print(name, 'refused:', exc.strerror)",
    ]
)
FETCH = "\n".join(
    [
        "import sys, urllib.request",
        "body = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode()",
        "open('fetched.txt', 'w').write(body)",
        "print('fetched', body)",
    ]
)
URL = r"^http://127\.0\.0\.1:[0-9]{1,5}/[a-z]{1,20}$"


class Api(BaseHTTPRequestHandler):
    """An API an MCP server or a task calls: answers its path backwards."""

    def do_GET(self) -> None:
        body = self.path.strip("/")[::-1].encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def unit_environment(daemon: Daemon) -> dict[str, str]:
    """What the unit's StateDirectory=, RuntimeDirectory= and CacheDirectory= set, the
    service user's HOME (the state directory), and the configuration file."""
    return {
        "STATE_DIRECTORY": str(daemon.state),
        "RUNTIME_DIRECTORY": str(daemon.root / "run"),
        "CACHE_DIRECTORY": str(daemon.root / "cache"),
        "HOME": str(daemon.state),
        "TURNKEEPER_CONFIG": str(daemon.config_path),
    }


def run_turnkeeper(
    sandbox: list[str], args: list[str], env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """`turnkeeper ARGS` in the sandbox, with the environment the unit gives its commands."""
    return subprocess.run(
        [*sandbox, PYTHON, "-m", "supervisor", *args],
        cwd=REPO,
        env=python_env(**env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=200,
    )


@pytest.mark.skipif(bool(MISSING), reason=f"not on PATH: {', '.join(MISSING)}")
@pytest.mark.timeout(180)
def test_mcp_servers_and_tasks_work_inside_the_units_sandbox(
    daemons: Callable[..., Daemon], tmp_path: Path
) -> None:
    api = LoopbackServer(Api)
    notes = tmp_path / "d0" / "notes"  # the node server's working directory
    daemon = daemons(
        http={"listen": f"127.0.0.1:{free_port()}"},  # AF_INET: the API on TCP
        pool={"workers": 1, "spare": 0},
        mcp={
            "servers": [
                {
                    "name": "tiny",
                    "command": [PYTHON, "-m", "tests.mcp_servers.tiny"],
                    "cwd": str(REPO),
                },
                {
                    "name": "notes",
                    "command": ["node", str(REPO / "tests/mcp_servers/notes.mjs")],
                    "cwd": str(notes),
                    "start_timeout": 30.0,
                },
            ]
        },
        tasks={
            "kinds": [
                {"name": "fetch", "command": [PYTHON, "-c", FETCH, "{url}"], "args": {"url": URL}},
                {"name": "forbidden", "command": [PYTHON, "-c", FORBIDDEN]},
            ],
        },
    )
    notes.mkdir(parents=True)
    # The directories as the unit gives them: in the environment, none in the file.
    del daemon.config["daemon"]
    daemon.config_path.write_text(tomli_w.dumps(daemon.config))
    daemon.env = unit_environment(daemon)
    allowed = write_allowed(UNIT.read_text(), daemon.root / "allowed-syscalls")
    sandbox = launcher(daemon.root, allowed, PYTHON)
    daemon.launcher = [*sandbox, PYTHON, "-m", "supervisor"]
    try:
        daemon.start()
        status = (Path("/proc") / str(daemon.pid) / "status").read_text()
        assert "\nSeccomp:\t2\n" in status and "\nNoNewPrivs:\t1\n" in status, status
        assert "\nCapEff:\t0000000000000000\n" in status, status
        slots = daemon.status()["slots"]
        assert [(m["name"], m["state"]) for m in slots[0]["mcp"]] == [
            ("tiny", "ready"),
            ("notes", "ready"),
        ], slots
        store = Store(daemon.url, migrate=False)
        session = new_session(daemon.client, "sandbox")
        port = api.server.server_address[1]
        turns = [
            "/tool ping {}",
            '/tool note {"text": "written in the sandbox"}',
            f'/tool fetch {{"url": "http://127.0.0.1:{port}/sandbox"}}',
            "/task fetch " + json.dumps({"url": f"http://127.0.0.1:{port}/tasks"}),
            "/task forbidden {}",
        ]
        for text in turns:
            seq = inject(daemon.client, session, text)
            wait_until(
                lambda seq=seq: [
                    e for e in events(store, session) if e.type == "turn_ended" and e.seq > seq
                ],
                60,
                f"the turn of {text!r}",
            )
        tool_results = [e.payload for e in events(store, session) if e.type == "tool_result"]
        said = json.dumps(tool_results)
        assert "pong" in said, said
        assert f"noted in {notes}" in said, said
        assert "fetched: xobdnas" in said, said
        assert (notes / "notes.txt").read_text() == "written in the sandbox\n"
        assert (notes / "notes.txt").stat().st_mode & 0o077 == 0  # UMask=0077

        def both() -> list[EventRecord] | None:
            found = [e for e in events(store, session) if e.type == "task_result"]
            return found if len(found) == 2 else None

        found = wait_until(both, 60, "both tasks' results")  # in the order they ended
        fetched, forbidden = sorted(found, key=lambda e: e.payload["kind"])
        assert (fetched.payload["status"], fetched.payload["exit_code"]) == ("succeeded", 0)
        assert "fetched sksat" in fetched.payload["text"], fetched.payload
        assert list((daemon.root / "cache" / "tasks").glob("*/fetched.txt")), "no file"
        text = forbidden.payload["text"]
        assert "etc refused: Read-only file system" in text, text
        assert "chown refused: Operation not permitted" in text, text
        assert "packet refused: Operation not permitted" in text, text
        store.close()

        # `systemctl reload`: the unit's ExecReload= in the same sandbox and environment.
        reload = unit_settings(UNIT.read_text())["ExecReload"].split()[1:]
        reloaded = run_turnkeeper(sandbox, reload, daemon.env)
        assert reloaded.returncode == 0, reloaded
        assert reloaded.stdout.splitlines()[-1] == "workers kept", reloaded
        refused_config = dict(daemon.config, pool={"workers": 0})
        daemon.config_path.write_text(tomli_w.dumps(refused_config))
        refused = run_turnkeeper(sandbox, reload, daemon.env)
        assert refused.returncode == 78, refused  # the reload fails; the daemon goes on
        assert "pool.workers" in refused.stderr, refused
        assert daemon.ready()

        daemon.signal(signal.SIGTERM)
        assert daemon.wait(60) == 0, daemon.log()
        with Store(daemon.url, migrate=False) as store:
            assert store.boots.recent(1)[0].outcome == "clean"
    finally:
        api.close()
