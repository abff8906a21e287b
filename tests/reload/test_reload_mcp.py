"""A reload waits for the MCP servers of the workers it starts: a server that does not
start (its command exits) is named, worker by worker, and the reload exits 1 although
the configuration is in force; fixed, the next reload replaces the workers and says
nothing more."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable

import pytest
import tomli_w

from tests.conftest import PYTHON
from tests.daemon import Daemon, daemons, turnkeeper

__all__ = ["daemons"]  # the fixture
TINY = {"name": "tiny", "command": [PYTHON, "-m", "tests.mcp_servers.tiny"]}
# Found on PATH, as a start's check asks, but it exits before it speaks MCP.
BROKEN = {"name": "broken", "command": [PYTHON, "-c", "raise SystemExit(3)"]}


def with_servers(daemon: Daemon, *servers: dict[str, object]) -> None:
    config = copy.deepcopy(daemon.config)
    config["mcp"] = {"servers": list(servers)}
    daemon.config_path.write_text(tomli_w.dumps(config))


@pytest.mark.timeout(180)
def test_a_reload_names_the_mcp_servers_its_new_workers_could_not_start(
    daemons: Callable[..., Daemon],
) -> None:
    daemon = daemons(pool={"workers": 2, "spare": 0}, mcp={"servers": [TINY]}).start()
    before = daemon.status()["config"]["version"]

    with_servers(daemon, TINY, BROKEN)
    reloaded = turnkeeper(daemon, "reload")
    assert reloaded.returncode == 1, reloaded
    workers = [s["worker"] for s in daemon.status()["slots"]]
    lines = reloaded.stdout.splitlines()
    assert lines[-2] == "workers replaced", lines
    assert lines[-1].startswith("not done: MCP servers did not start: "), lines
    for worker in workers:  # each new worker's, and only the broken server
        assert f"broken (worker {worker}: " in lines[-1], (workers, lines)
    assert "tiny" not in lines[-1]
    assert reloaded.stderr == f"turnkeeper: {lines[-1].removeprefix('not done: ')}\n"
    after = daemon.status()["config"]["version"]
    assert after != before  # in force all the same
    # The same in --json, server by server.
    again = turnkeeper(daemon, "reload", "--workers", "--json")
    assert again.returncode == 1, again
    result = json.loads(again.stdout)
    failed = sorted((m["worker"], m["server"]) for m in result["mcp_not_started"])
    now = sorted(s["worker"] for s in daemon.status()["slots"])
    assert failed == [(worker, "broken") for worker in now], result
    assert {m["state"] for m in result["mcp_not_started"]} <= {"backoff", "down"}

    with_servers(daemon, TINY)
    fixed = turnkeeper(daemon, "reload")
    assert fixed.returncode == 0, fixed
    assert fixed.stdout.splitlines()[-1] == "workers replaced"
    assert all([m["state"] for m in slot["mcp"]] == ["ready"] for slot in daemon.status()["slots"])
