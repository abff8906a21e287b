"""How a worker starts its MCP servers: all at once, and `ready` only once they are up.

The servers are `tests.mcp_servers.gated`: each writes what it does to an events file and
answers `initialize` only when the test (or its peers) let it, so every assertion here is
on the recorded order of events, never on how long something took.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import multiprocess
import psutil
import pytest
import zmq

from supervisor.contract import control
from supervisor.contract.config import Config, McpServer
from supervisor.contract.spawn import WorkerSpec
from supervisor.core.vocabulary import McpState
from supervisor.store import Store
from tests.conftest import REPO
from workers.entry import run_worker
from workers.mcp import McpTools
from workers.mcp_launch import launch_all

pytestmark = pytest.mark.timeout(120)
START = 60.0  # each server's start_timeout: a held start is never cut short by it


def gated(name: str, events: Path, **env: str) -> McpServer:
    return McpServer(
        name=name,
        command=[sys.executable, "-m", "tests.mcp_servers.gated", name],
        cwd=str(REPO),
        env={"GATED_EVENTS": str(events), **env},
        start_timeout=START,
    )


def lines(events: Path) -> list[str]:
    return events.read_text().splitlines() if events.exists() else []


class Pids:
    """The MCP servers a test started, killed by pid at the end whatever happened."""

    def __init__(self) -> None:
        self.seen: list[psutil.Process] = []

    async def on_start(self, name: str, pid: int, create_time: float, pgid: int) -> None:
        with contextlib.suppress(psutil.Error):
            self.seen.append(psutil.Process(pid))

    def kill_all(self) -> None:
        for proc in self.seen:
            with contextlib.suppress(psutil.Error):
                proc.kill()


@pytest.fixture
def pids() -> Iterator[Pids]:
    tracker = Pids()
    try:
        yield tracker
    finally:
        tracker.kill_all()


@pytest.mark.parametrize("launched_first", [False, True], ids=["started", "launched-first"])
def test_two_servers_of_a_worker_start_at_once(
    tmp_path: Path, pids: Pids, launched_first: bool
) -> None:
    # Neither answers `initialize` before both were asked to: one after the other, the
    # first would wait until its start_timeout, fail, and only then the second begin.
    events = tmp_path / "events"
    servers = [gated(name, events, GATED_PEERS="2") for name in ("a", "b")]

    async def scenario() -> list[McpState]:
        launched = await launch_all(servers) if launched_first else None
        tools = McpTools(servers, on_start=pids.on_start, launched=launched)
        try:
            await tools.start()
            return [client.state for client in tools.clients]
        finally:
            await tools.aclose(1.0)

    states = asyncio.run(scenario())
    assert states == [McpState.READY, McpState.READY], lines(events)
    found = lines(events)
    answered = [i for i, line in enumerate(found) if line.startswith("answered ")]
    began = [i for i, line in enumerate(found) if line.split()[0] in ("start", "initialize")]
    assert sorted(line for line in found if line.startswith("initialize")) == [
        "initialize a",
        "initialize b",
    ]
    assert max(began) < min(answered), found  # both started before either finished


# --- `ready` means its servers are up -------------------------------------------------


class FakeSupervisor:
    """A ROUTER socket where a real worker process connects, and what it said, in order."""

    def __init__(self, path: Path) -> None:
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.address = f"ipc://{path}"
        self.router.bind(self.address)
        self.route = b""
        self.said: list[control.FromWorker] = []

    def next(self, timeout: float = 60.0) -> control.FromWorker:
        if not self.router.poll(timeout * 1000):
            pytest.fail(f"the worker said nothing for {timeout} s; it said {self.types()}")
        self.route, *frames = self.router.recv_multipart()
        message = control.decode(frames, control.WORKER_MESSAGES)
        self.said.append(message)
        return message

    def until(self, type: str) -> control.FromWorker:
        while (message := self.next()).type != type:
            pass
        return message

    def types(self) -> list[str]:
        return [m.type for m in self.said]

    def send(self, type: str, **fields: Any) -> None:
        self.router.send_multipart([self.route, control.encode(type, **fields)])

    def close(self) -> None:
        self.router.close()
        self.context.term()


def worker_spec(
    supervisor: FakeSupervisor, url: str, config: Config, host_id: str = "host"
) -> WorkerSpec:
    """The spawn arguments of worker w0.1 of `supervisor`, on the database `url`."""
    return WorkerSpec(
        identity="w0.1",
        owner=f"{host_id}/boot/w0.1",
        address=supervisor.address,
        parent_pid=os.getpid(),
        boot_id="b" * 32,
        host_id=host_id,
        db_url=url,
        config=config.model_dump(mode="json", by_alias=True),
        route="0" * 32,
        secret="5" * 64,
    )


def test_a_worker_says_ready_only_once_its_mcp_servers_are_up(tmp_path: Path) -> None:
    events, gate = tmp_path / "events", tmp_path / "gate"
    server = gated("g", events, GATED_GATE=str(gate))
    config = Config.model_validate(
        {
            "pool": {"heartbeat_interval": 0.1, "hang_timeout": 5.0},
            "agent": {"class": "tests.agents:ChaosAgent"},
            "mcp": {"servers": [server.model_dump()]},
        }
    )
    url = f"sqlite:///{tmp_path / 'turnkeeper.db'}"
    Store(url).close()  # the schema
    supervisor = FakeSupervisor(tmp_path / "control.sock")
    spec = worker_spec(supervisor, url, config)
    worker = multiprocess.get_context("spawn").Process(target=run_worker, args=(spec,))
    worker.start()
    try:
        assert supervisor.next().type == "hello"
        # The server was asked to initialize and is held: every heartbeat the worker sends
        # from now on was sent after any `ready` it sent before, on the same connection.
        deadline = time.monotonic() + 60
        while "initialize g" not in lines(events):
            assert time.monotonic() < deadline, lines(events)
            supervisor.next()
        beat = supervisor.until("heartbeat")
        assert isinstance(beat, control.Heartbeat) and beat.mcp == {"g": "starting"}
        assert "ready" not in supervisor.types()

        gate.touch()
        supervisor.until("ready")
        # The worker said ready after its server had answered the tool listing.
        assert "answered g tools/list" in lines(events)
        beat = supervisor.until("heartbeat")
        assert isinstance(beat, control.Heartbeat) and beat.mcp == {"g": "ready"}
        supervisor.send("stop")
        worker.join(30)
        assert worker.exitcode == 0
    finally:
        if worker.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGKILL)  # its MCP server dies with it
            worker.join(10)
        supervisor.close()
