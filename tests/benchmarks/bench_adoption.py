"""Task runners through a restart in place: what k running tasks cost the restart, k = 1
against k = 100, on one real daemon with the shipped pool timings.

The tasks are of a cheap kind (`sleep 600`, running until the benchmark ends), each started
by a turn of its own session (`/task sleeper {}`), with `tasks.max_running_total` and
`tasks.max_running_per_principal` raised to let 100 run. Once every runner runs, `POST
/v1/restart {"drain": 0}` (the runners are left running; nothing else is in flight) and:

- `ready_s`: from the request to the first `/readyz` 200 of the new boot (the same pid);
- `adopted_s`: from the request to the daemon's log line of the last of the k tasks
  adopted ("task ID (sleeper) adopted: ..."), by the log's millisecond timestamps.

Then every task is checked still `running` with the runner it had (`kept_running`). The
first `--runs` restarts run with 1 task, then 99 more are started and the next `--runs`
run with 100. `ratio_100_to_1` is the median at k = 100 over the median at k = 1.

    python -m tests.benchmarks adoption [--runs N] [--many K]

Prints one JSON object. It measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from supervisor.store import Store
from tests.benchmarks.figures import log_time, shipped_pool, wait_for
from tests.daemon import Daemon, inject
from tests.timers_harness import SLEEPER

TIMEOUT_S = 120.0
ADOPTED = re.compile(r"task (t[0-9a-f]+) \(sleeper\) adopted")
READY = re.compile(r"\[daemon\] ready:")


def _ready_boot(daemon: Daemon, other_than: str) -> bool:
    try:
        return daemon.ready() and daemon.status()["boot"]["id"] != other_than
    except Exception:  # between two boots
        return False


def _start_tasks(store: Store, count: int) -> None:
    sessions = []
    for _ in range(count):
        session = store.sessions.create("admin").id
        inject(store, session, "/task sleeper {}")
        sessions.append(session)

    def running() -> bool:
        rows = [store.tasks.of_session(s) for s in sessions]
        return all(r and r[0].status == "running" and r[0].runner_pid for r in rows)

    wait_for(running, TIMEOUT_S, f"{count} runners")


def _restart(daemon: Daemon, store: Store) -> dict[str, Any]:
    """One restart in place with the running tasks left running: its figures."""
    before = {t.id: t.runner_pid for t in store.tasks.listed(["running"], limit=10_000)}
    boot = daemon.status()["boot"]["id"]
    began = time.time()
    with daemon.client() as http:
        http.post("/v1/restart", json={"reason": "benchmark", "drain": 0}).raise_for_status()
    wait_for(lambda: _ready_boot(daemon, boot), TIMEOUT_S, "the new boot")
    ready = time.time() - began
    adopted: dict[str, float] = {}
    ready_logged = None
    for line in daemon.log().splitlines():
        try:
            at = log_time(line[:23])
        except ValueError:
            continue
        if at < began - 0.001:
            continue
        if (found := ADOPTED.search(line)) is not None:
            adopted[found.group(1)] = at
        elif READY.search(line) and ready_logged is None:
            ready_logged = at
    after = {t.id: t.runner_pid for t in store.tasks.listed(["running"], limit=10_000)}
    return {
        "tasks": len(before),
        "ready_s": round(ready, 3),
        "ready_logged_s": None if ready_logged is None else round(ready_logged - began, 3),
        "adopted_s": round(max(adopted.values()) - began, 3) if adopted else None,
        "adopted": len(adopted),
        "kept_running": sum(1 for t, pid in before.items() if after.get(t) == pid),
    }


def _median(values: list[float | None]) -> float | None:
    found = [v for v in values if v is not None]
    return round(statistics.median(found), 3) if found else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks adoption")
    parser.add_argument("--runs", type=int, default=3, help="restarts with each k")
    parser.add_argument("--many", type=int, default=100, help="the larger k")
    args, _ = parser.parse_known_args(argv)
    many = max(2, args.many)
    limits = {"max_running_total": many + 10, "max_running_per_principal": many + 10}
    runs: dict[str, list[dict[str, Any]]] = {"1": [], str(many): []}
    started = 0.0
    with tempfile.TemporaryDirectory(prefix="tk-bench-adoption-") as tmp:
        daemon = Daemon(
            Path(tmp),
            pool=shipped_pool(),
            tasks={"kinds": [SLEEPER], **limits},
            restart={"min_interval": 0.0},
        )
        try:
            daemon.start()
            with Store(daemon.url, migrate=False) as store:
                _start_tasks(store, 1)
                runs["1"] = [_restart(daemon, store) for _ in range(args.runs)]
                began = time.time()
                _start_tasks(store, many - 1)
                started = time.time() - began
                runs[str(many)] = [_restart(daemon, store) for _ in range(args.runs)]
        finally:
            daemon.kill_everything()
    medians = {
        k: {name: _median([r[name] for r in found]) for name in ("ready_s", "adopted_s")}
        for k, found in runs.items()
    }
    one, lots = medians["1"], medians[str(many)]
    result: dict[str, Any] = {
        "benchmark": "adoption",
        "machine": {"python": platform.python_version(), "cpus": len(os.sched_getaffinity(0))},
        "runs": runs,
        "median": medians,
        "tasks_started_s": {"tasks": many - 1, "s": round(started, 3)},
        "ratio_100_to_1": {
            name: round(lots[name] / one[name], 2) if one[name] and lots[name] else None
            for name in ("ready_s", "adopted_s")
        },
    }
    print(json.dumps(result, indent=2))
    return result
