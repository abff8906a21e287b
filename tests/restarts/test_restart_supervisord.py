"""Requested restarts under the shipped supervisord program: the daemon re-executes in
place, so supervisord sees no exit (no "exited" line, the same pid), five times over; each
asking turn hears of its restart once and the other session's turn finishes once."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomli_w

from supervisor.store import Store
from tests.lifecycle.test_deploy import NOT_INSTALLED, Supervisord
from tests.restart_harness import RESTART_CONFIG, Rounds, wait_for

CONFIG = {
    "pool": {"workers": 2, "spare": 0, "heartbeat_interval": 0.2},
    "agent": {"class": "tests.agents:ChaosAgent"},  # for its `/gate`
    "recovery": {"attempt_delays": [0.0, 0.5, 1.0]},
    "restart": RESTART_CONFIG,
}


@pytest.fixture
def supervised(tmp_path: Path) -> Iterator[Supervisord]:
    if shutil.which("supervisord") is None or shutil.which("supervisorctl") is None:
        pytest.skip(NOT_INSTALLED)
    sup = Supervisord(tmp_path)
    (tmp_path / "turnkeeper.toml").write_text(tomli_w.dumps(CONFIG))
    sup.start()
    try:
        yield sup
    finally:
        sup.stop()


def program_pid(sup: Supervisord) -> int:
    """The pid supervisord knows its program by."""
    answer = sup.ctl("pid", "turnkeeper")
    return int(answer.stdout.strip())


@pytest.mark.timeout(420)
@pytest.mark.slow
def test_five_agent_restarts_under_supervisord(supervised: Supervisord, tmp_path: Path) -> None:
    sup = supervised
    wait_for(sup.ready, 60, "the daemon under supervisord", sup.logs)
    first = program_pid(sup)
    store = Store(f"sqlite:///{sup.state / 'turnkeeper.db'}")
    gates = tmp_path / "gates"
    gates.mkdir()
    rounds = Rounds(sup.client, store, gates, sup.logs, lambda: program_pid(sup))
    rounds.open()
    for number in range(1, 6):
        rounds.round(number)
    assert program_pid(sup) == first
    status = sup.ctl("status", "turnkeeper")
    assert "RUNNING" in status.stdout, status.stdout
    supervisord_log = (sup.root / "supervisord.log").read_text()
    # Started once, and never seen to exit: the restarts were in place.
    assert supervisord_log.count("spawned: 'turnkeeper'") == 1, supervisord_log
    assert "exited: turnkeeper" not in supervisord_log, supervisord_log
    store.close()
