"""Start and stop are one stack: a start that fails half-way undoes what it did."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

from supervisor.store import Store
from tests.daemon import Daemon, daemons

__all__ = ["daemons"]


def test_a_start_that_cannot_listen_undoes_what_it_did_and_says_startup_failed(
    daemons: Callable[..., Daemon], tmp_path: Path
) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        daemon = daemons(http={"listen": f"127.0.0.1:{port}"})
        daemon.start(wait=False)
        assert daemon.wait(60) == 1
    finally:
        taken.close()
    log = daemon.log()
    assert f"http.listen 127.0.0.1:{port}" in log and "in use" in log
    assert "Traceback" not in log
    # The workers it had started were stopped, by the step that stops every descendant.
    assert "descendants done" in log and "processes stopped" in log
    with Store(daemon.url, migrate=False) as store:
        [boot] = store.boots.recent(1)
        assert boot.outcome == "startup_failed" and boot.ended_at is not None
