"""A start that fails before it serves any session (here: its port taken) ends its boot
row `startup_failed`, and such boots do not trip the crash-loop breaker: once the port
is free, the next start runs its side work as usual."""

from __future__ import annotations

import json
import signal
import socket
from collections.abc import Callable

import pytest

from tests.daemon import Daemon, daemons, turnkeeper

__all__ = ["daemons"]  # the fixture

Daemons = Callable[..., Daemon]
THRESHOLD = 1  # one unclean boot would trip it


@pytest.mark.timeout(240)
def test_a_port_taken_again_and_again_does_not_trip_the_breaker(daemons: Daemons) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        daemon = daemons(
            http={"listen": f"127.0.0.1:{port}"},
            pool={"workers": 1},
            recovery={"breaker_threshold": THRESHOLD, "breaker_window": 3600},
        )
        for _ in range(THRESHOLD + 2):  # as Restart=always would, with the port still taken
            daemon.start(wait=False)
            assert daemon.wait(60) == 1, daemon.log()
    daemon.start()  # the port is free now
    boots = json.loads(turnkeeper(daemon, "boots", "--json").stdout)["boots"]
    assert [b["outcome"] for b in boots] == [None] + ["startup_failed"] * (THRESHOLD + 2), boots
    breaker = turnkeeper(daemon, "breaker", "status", "--json")
    assert breaker.returncode == 0, breaker.stdout + breaker.stderr
    state = json.loads(breaker.stdout)
    assert (state["tripped"], state["unclean_boots"]) == (False, 0), state
    assert daemon.status()["breaker"]["tripped"] is False
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(30) == 0, daemon.log()
