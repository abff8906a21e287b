"""Restart after a SIGKILL of the supervisor, with one real MCP server: how soon the
interrupted turn goes on, against how long the MCP server takes to start by itself.

Two figures per run, measured one right after the other so that they share the
machine's state:

- `server_alone_s`: the MCP server's own start, measured alone. This process (the SDK
  already imported) spawns the server with the SDK's `stdio_client` and times the spawn,
  `initialize` and `list_tools` with the SDK's `ClientSession`.
- `restart_s`: the real daemon (`turnkeeper run`, `tests.daemon.Daemon`, the shipped pool
  timings: `pool.workers = 2, pool.spare = 1, heartbeat_interval = 1.0`) with that one
  MCP server configured, in a fresh state dir. A turn is held in flight by a gate
  (`/gate PATH` of `tests.agents:ChaosAgent`); the supervisor gets SIGKILL (its workers
  and their MCP servers die with it), the gate is opened, and `turnkeeper run` starts
  again on the same database. `restart_s` is the time from that second start to the
  `created_at` of the interrupted turn's `turn_ended` (the continuation ran and ended),
  both on this host's wall clock. `ready_s` is the time to the first `/readyz` 200.

The daemon's log marks of the second run are reported as seconds after its start (the
supervisor's first line, the last of the 3 workers spawned, the first MCP server and the
first worker ready, the daemon ready, the continuation begun), so a slow run shows where
its time went.

The target: `restart_s <= server_alone_s + 2` (medians). The server is `mcp-server-time`
(PyPI) when it is on PATH, else `--server-command`, else this project's
`tests.mcp_servers.basic` (written with the same SDK); the JSON names which.

    python -m tests.benchmarks restart [--runs N] [--quick] [--server-command "CMD ..."]

Prints one JSON object. It measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from supervisor.store import Store
from tests.benchmarks.figures import log_time, shipped_pool, wait_for
from tests.conftest import REPO
from tests.daemon import Daemon, inject, turn_ended

DEFAULT_RUNS = 3
QUICK_RUNS = 1
SLACK_S = 2.0  # the target: the server's own start plus this
MCP_START_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 120.0
TURN_TIMEOUT_S = 180.0
MARKS = {
    "supervisor_started": r"\] turnkeeper \S+ starting",
    "last_worker_spawned": r"\[pool\] started worker w2\.",
    "first_mcp_server_ready": r"MCP server '.*' ready",
    "first_worker_ready": r"\[pool\] worker \S+ is ready",
    "daemon_ready": r"\[daemon\] ready:",
    "continuing": r"continuing turn",
}


def server_command(given: str | None) -> tuple[list[str], dict[str, str], str]:
    """The MCP server to measure: (command, cwd, what it is)."""
    if given:
        return shlex.split(given), {}, "given: " + given
    found = shutil.which("mcp-server-time")
    if found:
        return [found], {}, "mcp-server-time (PyPI)"
    command = [sys.executable, "-m", "tests.mcp_servers.basic"]
    return command, {"cwd": str(REPO)}, "tests.mcp_servers.basic (mcp-server-time not found)"


async def _start_alone(command: list[str], cwd: str | None) -> tuple[float, int]:
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    params = StdioServerParameters(command=command[0], args=command[1:], cwd=cwd)
    began = time.perf_counter()
    async with (
        stdio_client(params) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        tools = await session.list_tools()
        took = time.perf_counter() - began
    return took, len(tools.tools)


def server_alone(command: list[str], cwd: str | None) -> tuple[float, int]:
    """Seconds from spawning the server to its tool list, with the SDK's client."""
    return asyncio.run(asyncio.wait_for(_start_alone(command, cwd), MCP_START_TIMEOUT_S))


def _marks(log: str, since: float) -> dict[str, float | None]:
    lines = log[log.rindex("--- run 2 ---") :].splitlines()
    found: dict[str, float | None] = {}
    for name, pattern in MARKS.items():
        found[name] = None
        for line in lines:
            if re.search(pattern, line):
                found[name] = round(log_time(line[:23]) - since, 3)
                break
    return found


def restart_run(root: Path, command: list[str], cwd: str | None) -> dict[str, Any]:
    """One SIGKILL of the supervisor with a turn held in flight, and the restart."""
    daemon = Daemon(
        root,
        pool=shipped_pool(),
        agent={"class": "tests.agents:ChaosAgent"},
        mcp={
            "servers": [
                {
                    "name": "time",
                    "command": command,
                    "cwd": cwd or "",
                    "start_timeout": MCP_START_TIMEOUT_S,
                }
            ]
        },
    )
    try:
        daemon.start()
        with Store(daemon.url, migrate=False) as store:
            session = store.sessions.create("bench").id
            gate = root / "gate"
            seq = inject(store, session, f"/gate {gate} held")
            wait_for(
                lambda: any(
                    e.type == "turn_started" for e in store.events.read(session, after=seq)
                ),
                TURN_TIMEOUT_S,
                "the held turn to start",
            )
            daemon.signal(signal.SIGKILL)
            daemon.wait(30)
            gate.touch()
            started = time.time()
            daemon.start(wait=False)
            wait_for(daemon.ready, READY_TIMEOUT_S, "the restarted daemon to be ready")
            ready = time.time() - started
            ended = wait_for(
                lambda: turn_ended(store, session, seq), TURN_TIMEOUT_S, "the continued turn"
            )
            notes = [e for e in store.events.read(session, after=seq) if e.type == "continuation"]
        return {
            "restart_s": round(ended.created_at - started, 3),
            "ready_s": round(ready, 3),
            "outcome": ended.payload.get("outcome"),
            "continuations": len(notes),
            "marks_s": _marks(daemon.log(), started),
        }
    finally:
        daemon.kill_everything()


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.bench_restart")
    parser.add_argument("--runs", type=int, default=None, help=f"default {DEFAULT_RUNS}")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_RUNS} run")
    parser.add_argument(
        "--server-command", default=None, help="the MCP server to run (a shell-quoted line)"
    )
    args = parser.parse_args(argv)
    runs = args.runs or (QUICK_RUNS if args.quick else DEFAULT_RUNS)
    command, where, server = server_command(args.server_command)
    cwd = where.get("cwd")

    alone: list[float] = []
    measured: list[dict[str, Any]] = []
    tools = 0
    with tempfile.TemporaryDirectory(prefix="tk-bench-restart-") as tmp:
        for index in range(runs):
            took, tools = server_alone(command, cwd)
            alone.append(took)
            run = restart_run(Path(tmp) / f"run{index}", command, cwd)
            run["server_alone_s"] = round(took, 3)
            measured.append(run)
    alone_median = median(alone)
    restart_median = median([r["restart_s"] for r in measured])
    target = None if alone_median is None else round(alone_median + SLACK_S, 3)
    load = os.getloadavg()[0]
    result: dict[str, Any] = {
        "benchmark": "restart",
        "server": server,
        "server_tools": tools,
        "runs": measured,
        "server_alone_s": {"median": alone_median, "all": [round(a, 3) for a in alone]},
        "restart_s": {
            "median": restart_median,
            "min": min((r["restart_s"] for r in measured), default=None),
            "max": max((r["restart_s"] for r in measured), default=None),
        },
        "ready_s_median": median([r["ready_s"] for r in measured]),
        "target_s": target,
        "target": f"restart_s <= server_alone_s + {SLACK_S:g}",
        "met": None if target is None or restart_median is None else restart_median <= target,
        "load_average_1m": round(load, 2),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
