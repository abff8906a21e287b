"""systemd's notify protocol, with a real NOTIFY_SOCKET standing in for systemd."""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest

from tests.daemon import Daemon, daemons
from tests.support import plain

__all__ = ["daemons"]


@pytest.mark.timeout(90)
def test_ready_watchdog_stopping_and_no_socket_for_children(
    daemons: Callable[..., Daemon], tmp_path: Path
) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    address = str(tmp_path / "notify.sock")
    listener.bind(address)
    listener.settimeout(0.1)
    api = tmp_path / "api.sock"
    daemon = daemons(http={"listen": f"unix:{api}"})
    daemon.env = {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "1000000"}
    client = httpx.Client(transport=plain(str(api)), base_url="http://tk")
    received: list[tuple[float, str, int | None]] = []

    def drain_socket(until: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not until():
            try:
                data = listener.recv(4096).decode()
            except TimeoutError:
                continue
            ready_status = None
            if "READY=1" in data:
                ready_status = client.get("/readyz").status_code  # at the moment READY arrives
            received.append((time.monotonic(), data, ready_status))

    try:
        daemon.start(wait=False)
        drain_socket(lambda: any("READY=1" in d for _, d, _ in received), 45)
        ready = [r for r in received if "READY=1" in r[1]]
        assert ready, f"no READY=1; got {received}"
        assert ready[0][2] == 200, "READY=1 came before /readyz answered 200"
        assert "STATUS=" in ready[0][1]
        started = time.monotonic()
        drain_socket(lambda: time.monotonic() - started > 3.2, 5)
        pings = [t for t, d, _ in received if "WATCHDOG=1" in d and t >= started]
        # WATCHDOG_USEC is 1 s: a ping every 0.5 s, from the event loop.
        assert 5 <= len(pings) <= 8, f"{len(pings)} pings in 3.2 s"
        for worker in daemon.live_workers():
            assert "NOTIFY_SOCKET" not in worker.environ()
            assert "WATCHDOG_USEC" not in worker.environ()
        daemon.signal(signal.SIGTERM)
        drain_socket(lambda: any("STOPPING=1" in d for _, d, _ in received), 10)
        assert any("STOPPING=1" in d for _, d, _ in received)
        assert daemon.wait(20) == 0
    finally:
        client.close()
        listener.close()
    assert not psutil.pid_exists(daemon.pid) or psutil.Process(daemon.pid).status() == "zombie"
