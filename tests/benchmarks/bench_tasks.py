"""Background tasks and schedules against the real daemon: what the durable machinery adds.

- `task_overhead_s`: a task of a kind whose command is `true`, started by the echo model
  (`/task noop {}`) in a new session, one after another: the time from the session's
  `task_started` to its `task_result` (both `created_at`, this host's clock). It covers
  the keeper's claim, the runner's start (a Python process that opens the database), the
  command, the runner's record of the outcome and the report. Baselines measured in the
  same run: `spawn_true_s` (this process runs `true`) and `spawn_python_s` (it runs
  `python -c pass`, the floor of a runner's start); `ratio_to_python` is the median
  overhead over the median Python spawn.
- `fire_lateness_s`: a schedule `*/2 * * * * *` (`schedules.min_interval = 1`) into one
  session for `--seconds`: for each fire, its `user_message`'s `created_at` minus its
  `scheduled_for`.

    python -m tests.benchmarks tasks [--tasks N] [--seconds S]

Prints one JSON object. It measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from supervisor.store import Store
from tests.daemon import Daemon, wait_until

KINDS = [{"name": "noop", "command": ["true"]}]


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "min": round(min(values), 4),
        "median": round(statistics.median(values), 4),
        "max": round(max(values), 4),
    }


def _spawn(argv: list[str], runs: int) -> list[float]:
    found = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(argv, check=True)
        found.append(time.perf_counter() - started)
    return found


def _task_overheads(daemon: Daemon, store: Store, count: int) -> list[float]:
    found = []
    for _ in range(count):
        session = store.sessions.create("admin").id
        store.events.append(session, "user_message", {"text": "/task noop {}"}, writer="cli")

        def result(session: str = session) -> float | None:
            events = store.events.read(session, limit=1000)
            started = [e for e in events if e.type == "task_started"]
            ended = [e for e in events if e.type == "task_result"]
            if started and ended:
                return ended[0].created_at - started[0].created_at
            return None

        found.append(wait_until(result, 60, "the task's result"))
    return found


def _fire_lateness(daemon: Daemon, store: Store, seconds: float) -> list[float]:
    session = store.sessions.create("admin").id
    made = daemon.client().post(
        "/v1/schedules", json={"cron": "*/2 * * * * *", "text": "tick", "session": session}
    )
    made.raise_for_status()
    time.sleep(seconds)
    daemon.client().delete(f"/v1/schedules/{made.json()['id']}")
    found = []
    for event in store.events.read(session, limit=10_000):
        if event.type == "user_message" and "scheduled_for" in event.payload:
            found.append(event.created_at - float(event.payload["scheduled_for"]))
    return found


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks tasks")
    parser.add_argument("--tasks", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tk-bench-tasks-") as root:
        daemon = Daemon(
            Path(root) / "d",
            agent={"class": "workers.agents.tool_loop:ToolLoopAgent"},
            tasks={"kinds": KINDS},
            schedules={"min_interval": 1.0},
        )
        try:
            daemon.start()
            with Store(daemon.url, migrate=False) as store:
                overheads = _task_overheads(daemon, store, args.tasks)
                lateness = _fire_lateness(daemon, store, args.seconds)
        finally:
            daemon.kill_everything()
    true_s = _spawn(["true"], args.tasks)
    python_s = _spawn([sys.executable, "-c", "pass"], args.tasks)
    figures: dict[str, Any] = {
        "benchmark": "tasks",
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "tasks": args.tasks,
        "task_overhead_s": _summary(overheads),
        "spawn_true_s": _summary(true_s),
        "spawn_python_s": _summary(python_s),
        "ratio_to_python": round(statistics.median(overheads) / statistics.median(python_s), 2),
        "fires": len(lateness),
        "fire_lateness_s": _summary(lateness),
    }
    print(json.dumps(figures, indent=2))
    return figures
