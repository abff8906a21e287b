"""Helpers the tests share: a free port, the command line as a user runs it, made-up
events, a store's events, and a pool that records what the routes tell it.

`tests/daemon.py` is the other shared module: a real daemon as a process.
"""

from __future__ import annotations

import itertools
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

import httpx

from supervisor.store import EventRecord, Store
from tests.conftest import PYTHON, REPO, python_env

T0 = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC: the time made-up events are stamped with


def free_port() -> int:
    """A TCP port on loopback nobody listens on (free when asked; a tiny race after)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def plain(uds: str | None = None) -> httpx.HTTPTransport:
    """A transport for plain HTTP on loopback (or on the unix socket `uds`). Without it
    httpx builds a TLS context for every client, loading the CA bundle: about 20 ms of CPU,
    which a test polling a daemon at 20 Hz turns into half a core."""
    return httpx.HTTPTransport(uds=uds, verify=False)


def ctrl_c(proc: subprocess.Popen[Any], timeout: float = 15) -> int:
    """SIGINT to `proc`, as a user's Ctrl-C, and its exit status once it ended. One that
    does not end within `timeout` fails the test with what the kernel says of it (its
    state, where it sleeps, its blocked and ignored signals), then is killed."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        seen = []
        for name in ("status", "wchan", "stack"):
            try:
                text = Path(f"/proc/{proc.pid}/{name}").read_text()
            except OSError as exc:
                text = str(exc)
            seen.append(f"{name}: {text}" if name != "status" else text)
        proc.kill()
        proc.wait()
        raise AssertionError(
            f"{' '.join(map(str, proc.args))} did not end within {timeout} s of SIGINT\n"
            + "\n".join(seen)
        ) from None


def cli_env(**extra: str) -> dict[str, str]:
    """python_env() without the caller's TURNKEEPER_* variables, which would override."""
    env = {k: v for k, v in python_env().items() if not k.startswith("TURNKEEPER_")}
    env.update(extra)
    return env


def run_turnkeeper(
    *args: str,
    env: dict[str, str],
    config: Path | None = None,
    stdin: str | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    """`python -m supervisor [--config CONFIG] ARGS` as a user runs it, in the repository,
    with exactly `env`; stdin is `stdin`, or nothing at all."""
    command = [PYTHON, "-m", "supervisor"]
    if config is not None:
        command += ["--config", str(config)]
    return subprocess.run(
        [*command, *args],
        cwd=REPO,
        env=env,
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_turnkeeper(
    *args: str, config: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """`python -m supervisor --config CONFIG ARGS` started as a user runs it (the caller's
    TURNKEEPER_* variables left out, unless `env` is given), its output read as text."""
    return subprocess.Popen(
        [PYTHON, "-m", "supervisor", "--config", str(config), *args],
        cwd=REPO,
        env=cli_env() if env is None else env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


_seq = itertools.count(1)


def ev(
    type: str,
    payload: dict[str, Any] | None = None,
    turn_id: str | None = "t1",
    created_at: float = T0,
    *,
    seq: int | None = None,
    session: str = "s1",
) -> EventRecord:
    """One committed event of session "s1" (the next seq unless `seq` is given)."""
    number = next(_seq) if seq is None else seq
    return EventRecord(session, number, type, turn_id, payload or {}, created_at, "worker")


def stored_events(store: Store, session_id: str, type: str | None = None) -> list[EventRecord]:
    """A session's events as committed (of `type` only, if given)."""
    found = store.events.read(session_id, limit=100_000)
    return [e for e in found if type is None or e.type == type]


class RoutesPool:
    """A pool that records what the HTTP routes tell it: interrupts and task cancels."""

    def __init__(self) -> None:
        self.interrupted: list[str] = []
        self.cancelled: list[str] = []
        # What a test says the session's turn streamed so far: (turn, text, complete).
        self.streamed: dict[str, tuple[str, str, bool]] = {}

    def wake(self, session_id: str) -> None: ...

    def touch(self, session_id: str) -> None: ...

    def interrupt(self, session_id: str) -> None:
        self.interrupted.append(session_id)

    def streamed_so_far(self, session_id: str) -> tuple[str, str, bool] | None:
        return self.streamed.get(session_id)

    def cancel(self, task_id: str) -> None:
        self.cancelled.append(task_id)

    def status(self) -> dict[str, Any]:
        return {"slots": [], "restarts": 0}

    def breaker(self) -> dict[str, Any]:
        return {}
