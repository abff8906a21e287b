"""A turnkeeper daemon run as a real process by tests, and helpers to watch it."""

from __future__ import annotations

import contextlib
import hashlib
import json
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import tomli_w

from supervisor.store import EventRecord, Store
from tests.conftest import PYTHON, REPO, python_env
from tests.support import cli_env, plain, run_turnkeeper

READY_TIMEOUT = 45.0


def wait_until(
    predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05
) -> Any:
    """Poll `predicate` until it returns something truthy; fail the test naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def tokens_file(path: Path, tokens: dict[str, str]) -> Path:
    """An `auth.tokens_file` at `path` (0600) for `tokens`, principal -> token."""
    path.write_text(
        "".join(
            f"{who} sha256:{hashlib.sha256(t.encode()).hexdigest()}\n" for who, t in tokens.items()
        )
    )
    path.chmod(0o600)
    return path


def answer_json(handler: BaseHTTPRequestHandler, status: int, document: Any) -> None:
    """Answer a test server's request with `document` as JSON."""
    body = json.dumps(document).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


class LoopbackServer:
    """An HTTP server of a test's on 127.0.0.1 (a model server, a webhook), answering with
    `handler` in a thread of its own until `close`."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def turnkeeper(daemon: Daemon, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The command line against `daemon`'s configuration, as a user runs it (a wide
    terminal, no stdin, `env` on top of `cli_env`)."""
    environ = cli_env(**{"COLUMNS": "200", **env})
    return run_turnkeeper(*args, env=environ, config=daemon.config_path)


class Daemon:
    """`turnkeeper run` in its own state dir, with a config file the test shapes."""

    def __init__(self, root: Path, **sections: dict[str, Any]) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.state = root / "state"
        config: dict[str, dict[str, Any]] = {
            "daemon": {"state_dir": str(self.state), "runtime_dir": str(root / "run")},
            # No spare unless a test asks: each worker's start is about a second of CPU,
            # and the suite runs four daemons at a time on two cores.
            "pool": {"workers": 2, "spare": 0, "heartbeat_interval": 0.2, "hang_timeout": 5.0},
            "agent": {"class": "tests.agents:ChaosAgent"},
            "shutdown": {"kill_grace": 3.0},
            # The attempt schedule shortened from 0, 5 and 30 s, so tests need not wait.
            "recovery": {"attempt_delays": [0.0, 0.5, 1.0]},
        }
        # The API on a socket of this daemon's own, so daemons of tests running in parallel
        # never share a port; a test that wants TCP gives its own `http.listen`.
        config["http"] = {"listen": f"unix:{root / 'api.sock'}"}
        for name, values in sections.items():
            config.setdefault(name, {}).update(values)
        self.config = config
        self.config_path = root / "turnkeeper.toml"
        self.config_path.write_text(tomli_w.dumps(config))
        self.url = f"sqlite:///{self.state / 'turnkeeper.db'}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = root / "daemon.log"
        self.runs = 0
        self.env: dict[str, str] = {}  # extra environment for the daemon process
        # What runs `turnkeeper` (a test may import a fault injector first, in the daemon).
        self.launcher: list[str] = [PYTHON, "-m", "supervisor"]
        # Every worker the API or the process tree showed, as pid and start time, so the
        # cleanup kills no process of another test that reused a pid.
        self.seen: dict[int, float] = {}

    def start(self, wait: bool = True) -> Daemon:
        self.runs += 1
        log = self.log_path.open("ab")
        log.write(f"--- run {self.runs} ---\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            [*self.launcher, "--config", str(self.config_path), "run"],
            cwd=REPO,
            env=python_env(**self.env),
            stdout=log,
            stderr=log,
        )
        log.close()
        if wait:
            wait_until(
                lambda: self.ready() or self._died(),
                READY_TIMEOUT,
                "the daemon to be ready",
            )
            assert self.proc.poll() is None, f"exited {self.proc.returncode}\n{self.log()}"
        return self

    @property
    def listen(self) -> str:
        return str(self.config.get("http", {}).get("listen", ""))

    def _http(self, token: str | None, timeout: float) -> httpx.Client:
        """A client of this daemon's `http.listen`, a unix socket or a TCP address."""
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        listen = self.listen
        if listen.startswith("unix:"):
            return httpx.Client(
                transport=plain(listen.removeprefix("unix:")),
                base_url="http://turnkeeper",
                headers=headers,
                timeout=timeout,
                trust_env=False,
            )
        host, port = listen.rsplit(":", 1)
        host = host.strip("[]")
        host = f"[{host}]" if ":" in host else host
        return httpx.Client(
            base_url=f"http://{host}:{port}",
            transport=plain(),
            headers=headers,
            timeout=timeout,
            trust_env=False,
        )

    def client(self) -> httpx.Client:
        """An admin client of the API, on the daemon's unix socket or TCP port."""
        token = (self.state / "admin.token").read_text().strip()
        return self._http(token, timeout=10)

    def ready(self) -> bool:
        """The latest run is alive and its `/readyz` answers 200."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            with self._http(None, timeout=5) as http:
                return http.get("/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    def status(self) -> dict[str, Any]:
        """`GET /v1/status` as the admin."""
        with self.client() as http:
            answer = http.get("/v1/status")
        answer.raise_for_status()
        found: dict[str, Any] = answer.json()
        return found

    def _died(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def worker_pids(self, ready: bool = False) -> dict[str, int]:
        """The workers in the pool's slots now, by identity (`ready`: only those that said so)."""
        found = {
            slot["worker"]: int(slot["pid"])
            for slot in self.status()["slots"]
            if slot["worker"] and slot["pid"] and (slot["ready"] or not ready)
        }
        for pid in found.values():
            self._note(pid)
        return found

    def _note(self, pid: int) -> None:
        with contextlib.suppress(psutil.Error):
            self.seen[pid] = psutil.Process(pid).create_time()

    def live_workers(self) -> list[psutil.Process]:
        try:
            children = psutil.Process(self.pid).children()
        except psutil.NoSuchProcess:
            return []
        return [c for c in children if is_worker(c)]

    def owner_pid(self, store: Store, session_id: str) -> int | None:
        """The pid of the worker that owns the session, if it is in the pool now."""
        owner = store.sessions.get(session_id).owner
        if owner is None:
            return None
        return self.worker_pids().get(owner.rsplit("/", 1)[-1])

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        for worker in self.live_workers():  # a SIGKILL may leave them orphans to clean up
            self._note(worker.pid)
        self.proc.send_signal(signum)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def kill_everything(self) -> None:
        """SIGKILL the daemon and every process it started, by pid."""
        if self.proc is None:
            return
        with contextlib.suppress(psutil.NoSuchProcess):
            procs = [psutil.Process(self.pid), *psutil.Process(self.pid).children(recursive=True)]
            for proc in procs:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.send_signal(signal.SIGCONT)
                    proc.kill()
        for pid, started in self.seen.items():
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if proc.create_time() == started and is_worker(proc):
                    proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def is_worker(proc: psutil.Process) -> bool:
    """A worker process: named `turnkeeper: worker ...` once it runs (setproctitle), and
    multiprocess's `spawn_main` command line for the moment before."""
    cmdline = " ".join(_cmdline(proc))
    return cmdline.startswith("turnkeeper: worker ") or "spawn_main" in cmdline


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Make daemons in this test's directory; every one is killed at the end."""
    made: list[Daemon] = []

    def make(**sections: dict[str, Any]) -> Daemon:
        daemon = Daemon(tmp_path / f"d{len(made)}", **sections)
        made.append(daemon)
        return daemon

    yield make
    for daemon in made:
        daemon.kill_everything()


def events(store: Store, session_id: str) -> list[EventRecord]:
    found = store.events.read(session_id, limit=100_000)
    assert [e.seq for e in found] == list(range(1, len(found) + 1)), "seqs are not contiguous"
    return found


def outcome_of(payload: dict[str, Any]) -> dict[str, Any]:
    """A `turn_ended` payload without what the turn spent (`tokens`), for comparisons."""
    return {key: value for key, value in payload.items() if key != "tokens"}


def turn_ended(store: Store, session_id: str, after: int = 0) -> EventRecord | None:
    """The first `turn_ended` after seq `after`."""
    return next(
        (
            e
            for e in store.events.read(session_id, after=after, limit=100_000)
            if e.type == "turn_ended"
        ),
        None,
    )


def inject(store: Store, session_id: str, text: str) -> int:
    return store.events.append(session_id, "user_message", {"text": text}, writer="cli")
