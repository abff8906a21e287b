"""A full disk is a clear answer, not a 500 (issue: hardening, item 5).

The daemon's state directory is a small tmpfs; the test fills it while the daemon serves,
frees it, and fills it again for the stop.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from supervisor.store import Store
from tests.daemon import Daemon, daemons, events, wait_until

__all__ = ["daemons"]

Daemons = Callable[..., Daemon]
DISK = "24m"
BIG = "x" * 100_000  # one message: its event, and the echo's answer, are this large


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs, mode 0700, unmounted afterwards; skips where mounting is refused."""
    where = tmp_path / "disk"
    where.mkdir(mode=0o700)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK},mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(disk: Path) -> Path:
    """Fill `disk` to the last byte with one file; returns it."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (1 << 20, 4096, 1):  # then the last partial megabyte and page
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_answers_503_loses_nothing_acknowledged_and_stops_cleanly(
    daemons: Daemons, tmp_path: Path, small_disk: Path
) -> None:
    daemon = daemons(
        http={"listen": f"unix:{tmp_path}/api.sock"},
        daemon={"state_dir": str(small_disk / "state")},
    )
    daemon.state = small_disk / "state"
    daemon.url = f"sqlite:///{daemon.state / 'turnkeeper.db'}"
    daemon.start()
    acknowledged: list[int] = []
    with daemon.client() as client:
        sid = client.post("/v1/sessions", json={}).json()["id"]
        filler = _fill(small_disk)
        refused: httpx.Response | None = None
        for _ in range(200):  # the log's free pages run out within a few megabytes
            answer = client.post(f"/v1/sessions/{sid}/inject", json={"text": BIG})
            if answer.status_code != 202:
                refused = answer
                break
            acknowledged.append(answer.json()["seq"])
        assert refused is not None, "the store never ran out of space"
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "storage_unavailable"
        assert refused.headers["Retry-After"] == "5"
        ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["status"] == "storage_unavailable"
        assert client.get("/healthz").status_code == 200  # alive: only not ready

        filler.unlink()
        wait_until(lambda: client.get("/readyz").status_code == 200, 30, "readiness again")
        seq = client.post(f"/v1/sessions/{sid}/inject", json={"text": "after"}).json()["seq"]
        acknowledged.append(seq)

        def answered() -> bool:
            found = client.get(f"/v1/sessions/{sid}/events", params={"after": seq}).json()
            texts = [e["payload"].get("text") for e in found["events"]]
            return "echo: after" in texts

        wait_until(answered, 90, "the message after the outage to be answered")
    with Store(daemon.url, migrate=False) as store:
        stored = {e.seq: e for e in events(store, sid)}
    for seq in acknowledged:  # every 202 is in the log, as the message it acknowledged
        assert stored[seq].type == "user_message"

    _fill(small_disk)
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(30) == 0, daemon.log()
    stop = daemon.log().rsplit("received SIGTERM", 1)[1]
    assert "Traceback" not in stop
    os.sync()
