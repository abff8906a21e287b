"""Several real daemons on one server database, each with its own state dir and host id."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Collection
from functools import partial
from pathlib import Path
from typing import Any

import psutil

from supervisor.store import Child, EventRecord, Store
from tests.daemon import Daemon, wait_until

STALE_AFTER = 4.0  # lease.stale_after of the cluster's daemons: adoption is due this late


class Cluster:
    """`n` daemons named host-a, host-b, ... on the database at `url`."""

    def __init__(self, root: Path, url: str, n: int = 3, **sections: dict[str, Any]) -> None:
        self.url = url
        self.daemons: dict[str, Daemon] = {}
        for i in range(n):
            host = f"host-{chr(ord('a') + i)}"
            config: dict[str, dict[str, Any]] = {
                "daemon": {"host_id": host},
                "store": {"url": url},
                "lease": {"stale_after": STALE_AFTER},
            }
            for name, values in sections.items():
                config.setdefault(name, {}).update(values)
            daemon = Daemon(root / host, **config)
            daemon.url = url
            self.daemons[host] = daemon
        self.store = Store(url)

    def start(self) -> Cluster:
        for daemon in self.daemons.values():
            daemon.start(wait=False)
        for daemon in self.daemons.values():
            wait_until(partial(_up_or_exited, daemon), 60, "a daemon of the cluster to be ready")
            assert daemon.proc is not None, "not started"
            code = daemon.proc.poll()
            assert code is None, f"exited {code}\n{daemon.log()}"
        return self

    def __getitem__(self, host: str) -> Daemon:
        return self.daemons[host]

    def owner_host(self, session_id: str) -> str | None:
        """The host id of the session's lease owner, None if it has none."""
        owner = self.store.sessions.get(session_id).owner
        return owner.split("/", 1)[0] if owner else None

    def owners(self, session_ids: Collection[str]) -> dict[str, str | None]:
        """The host id of each session's lease owner (None: it has none), in one read."""
        found: dict[str, str | None] = dict.fromkeys(session_ids)
        for info in self.store.sessions.some(session_ids):  # those with work
            found[info.id] = info.owner.split("/", 1)[0] if info.owner else None
        for session_id in session_ids:
            if found[session_id] is None:
                found[session_id] = self.owner_host(session_id)
        return found

    def events(self, session_id: str) -> list[EventRecord]:
        return self.store.events.read(session_id, limit=100_000)

    def children(self, host: str) -> list[Child]:
        """Every `child_process` row of `host`, whichever boot recorded it."""
        return self.store.children.of_other_boots("", host)  # no boot is called ""

    def processes(self, host: str) -> list[psutil.Process]:
        """The daemon of `host` and every process under it (workers, MCP servers)."""
        daemon = self.daemons[host]
        if daemon.proc is None or daemon.proc.poll() is not None:
            return []
        try:
            top = psutil.Process(daemon.proc.pid)
            return [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def pause(self, host: str) -> list[psutil.Process]:
        """SIGSTOP the whole host: its daemon, workers and their children (a paused VM)."""
        stopped = self.processes(host)
        for proc in stopped:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGSTOP)
        return stopped

    @staticmethod
    def resume(stopped: list[psutil.Process]) -> None:
        for proc in stopped:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGCONT)

    def kill(self, host: str) -> None:
        """SIGKILL the host's daemon (its workers follow it by PR_SET_PDEATHSIG)."""
        daemon = self.daemons[host]
        assert daemon.proc is not None
        os.kill(daemon.proc.pid, signal.SIGKILL)
        daemon.proc.wait(10)

    def close(self) -> None:
        for host, daemon in self.daemons.items():
            with contextlib.suppress(Exception):
                self.resume(self.processes(host))  # a paused host is killed awake
            with contextlib.suppress(Exception):
                daemon.kill_everything()
        self.store.close()


def _up_or_exited(daemon: Daemon) -> bool:
    return daemon.ready() or (daemon.proc is not None and daemon.proc.poll() is not None)
