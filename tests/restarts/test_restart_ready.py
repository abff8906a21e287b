"""`turnkeeper restart` against a real daemon reports the time until the new boot was
ready, not until the request was settled: the new boot's MCP server is held at its start
(a gate) after the settlement, and the command waits for it and counts it."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.store import Store
from tests.conftest import PYTHON, REPO
from tests.daemon import Daemon, daemons, wait_until
from tests.support import start_turnkeeper

__all__ = ["daemons"]


def held_server(gate: Path) -> dict[str, object]:
    """An MCP server that starts only once `gate` exists."""
    wait = f'while [ ! -e "{gate}" ]; do sleep 0.05; done; exec "$@"'
    command = ["sh", "-c", wait, "sh", PYTHON, "-m", "tests.mcp_servers.tiny"]
    return {"name": "held", "command": command, "cwd": str(REPO), "start_timeout": 60.0}


@pytest.mark.timeout(180)
def test_restart_reports_the_time_until_the_new_boot_is_ready(
    daemons: Callable[..., Daemon], tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    gate.touch()  # the first boot starts at once
    daemon = daemons(pool={"workers": 1, "spare": 0}, mcp={"servers": [held_server(gate)]}).start()
    boot = daemon.status()["boot"]["id"]
    gate.unlink()  # the next boot's MCP server waits
    proc = start_turnkeeper("restart", config=daemon.config_path)
    try:
        with Store(daemon.url, migrate=False) as store:
            settled = wait_until(
                lambda: next((r for r in store.restarts.list(limit=5) if r.state == "done"), None),
                60,
                "the request to be settled by the next boot",
            )
        seen = time.monotonic()
        assert settled.boot_after != boot and settled.outcome == "ok", settled
        assert not daemon.ready()  # its worker waits for its MCP server
        assert proc.poll() is None  # ... and so does the command
        gate.touch()
        held = time.monotonic() - seen  # at least this long between settled and ready
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, (out, err, daemon.log())
    line = out.splitlines()[1]
    found = re.fullmatch(
        r"restarted, ready (\d+\.\d) s after the request \(stopped and started in "
        rf"(\d+\.\d) s\): boot {boot} -> {settled.boot_after}, pid {daemon.pid} "
        r"\(the same process: re-executed in place\)",
        line,
    )
    assert found, out
    assert found[2] == f"{settled.seconds:.1f}", out
    # The hold after the settlement is in the time reported (0.1 s: the display's rounding
    # of both figures).
    assert float(found[1]) + 0.1 >= float(found[2]) + held, (out, held)
    assert daemon.ready()
