"""A turnkeeper daemon run as a real process by tests, and helpers to watch it."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import tomli_w

from supervisor.store import EventRecord, Store
from tests.conftest import PYTHON, REPO, python_env

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


class Daemon:
    """`turnkeeper run` in its own state dir, with a config file the test shapes."""

    def __init__(self, root: Path, **sections: dict[str, Any]) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.state = root / "state"
        config: dict[str, dict[str, Any]] = {
            "daemon": {"state_dir": str(self.state), "runtime_dir": str(root / "run")},
            "pool": {"workers": 2, "spare": 1, "heartbeat_interval": 0.2, "hang_timeout": 5.0},
            "agent": {"class": "tests.agents:ChaosAgent"},
            "shutdown": {"kill_grace": 3.0},
            # The attempt schedule shortened from 0, 5 and 30 s, so tests need not wait.
            "recovery": {"attempt_delays": [0.0, 0.5, 1.0]},
        }
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

    def start(self, wait: bool = True) -> Daemon:
        self.runs += 1
        log = self.log_path.open("ab")
        log.write(f"--- run {self.runs} ---\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            [PYTHON, "-m", "supervisor", "--config", str(self.config_path), "run"],
            cwd=REPO,
            env=python_env(**self.env),
            stdout=log,
            stderr=log,
        )
        log.close()
        if wait:
            wait_until(
                lambda: self.ready_count() >= self.runs or self._died(),
                READY_TIMEOUT,
                "the daemon to be ready",
            )
            assert self.proc.poll() is None, self.log()
        return self

    def client(self) -> httpx.Client:
        """An admin client of the API; the daemon must listen on a unix socket."""
        listen = str(self.config.get("http", {}).get("listen", ""))
        assert listen.startswith("unix:"), "give the daemon http={'listen': 'unix:PATH'}"
        token = (self.state / "admin.token").read_text().strip()
        return httpx.Client(
            transport=httpx.HTTPTransport(uds=listen.removeprefix("unix:")),
            base_url="http://turnkeeper",
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        )

    def _died(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ready_count(self) -> int:
        return self.log().count("[daemon] ready:")

    def worker_pids(self) -> dict[str, int]:
        """Every worker this daemon's runs started, by identity (the latest run wins)."""
        run_log = self.log().rsplit(f"--- run {self.runs} ---", 1)[-1]
        return {
            w: int(p) for w, p in re.findall(r"started worker (w\d+\.\d+) \(pid (\d+)", run_log)
        }

    def live_workers(self) -> list[psutil.Process]:
        try:
            children = psutil.Process(self.pid).children()
        except psutil.NoSuchProcess:
            return []
        return [c for c in children if "spawn_main" in " ".join(_cmdline(c))]

    def owner_pid(self, store: Store, session_id: str) -> int | None:
        owner = store.sessions.get(session_id).owner
        if owner is None:
            return None
        return self.worker_pids().get(owner.rsplit("/", 1)[-1])

    def signal(self, signum: int) -> None:
        assert self.proc is not None
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
        for pid in self.worker_pids().values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if psutil.pid_exists(pid) and "spawn_main" in " ".join(
                    _cmdline(psutil.Process(pid))
                ):
                    psutil.Process(pid).kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


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
