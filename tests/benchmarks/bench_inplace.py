"""A requested restart in place and a reload, against the stop and start an operator would
otherwise do, on one real daemon with the shipped pool timings (`pool.workers = 2,
pool.spare = 1, heartbeat_interval = 1.0`), one right after the other so that they share
the machine's state:

- `restart_s`: `POST /v1/restart` (no drain, no turn in flight) to the first `/readyz` 200
  of the new boot (the same pid), and `settled_s` to its request settled `ok`.
- `stop_start_s` (the baseline): SIGTERM, wait for the exit, `turnkeeper run` again, to the
  first `/readyz` 200: what `systemctl restart` does, minus systemd's own time.
- `reload_noop_s`: `POST /v1/reload` with nothing changed (the file read and checked, the
  agent probe's child included); `reload_workers_s`: with `pool.history_cache_mb` changed,
  so that all 3 workers are rolled, answered once the new ones are ready.

    python -m tests.benchmarks inplace [--runs N] [--quick]

Prints one JSON object with the medians and `restart_to_stop_start` (their ratio). It
measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import tomli_w

from tests.benchmarks.figures import shipped_pool, wait_for
from tests.daemon import Daemon

DEFAULT_RUNS = 5
QUICK_RUNS = 2
TIMEOUT_S = 120.0


def _ready_boot(daemon: Daemon, other_than: str) -> str | None:
    """The boot id once a boot other than `other_than` answers ready; None before."""
    try:
        with daemon._http(None, timeout=2) as http:
            if http.get("/readyz").status_code != 200:
                return None
        boot = str(daemon.status()["boot"]["id"])
    except Exception:  # between two boots
        return None
    return boot if boot != other_than else None


def restart_once(daemon: Daemon) -> tuple[float, float]:
    """(seconds to the new boot ready, seconds to the request settled)."""
    boot = daemon.status()["boot"]["id"]
    began = time.perf_counter()
    with daemon.client() as http:
        answer = http.post("/v1/restart", json={"reason": "benchmark", "drain": 0})
    answer.raise_for_status()
    restart_id = answer.json()["restart"]["id"]
    wait_for(lambda: _ready_boot(daemon, boot), TIMEOUT_S, "the new boot")
    ready = time.perf_counter() - began

    def settled() -> bool:
        with daemon.client() as http:
            return bool(http.get(f"/v1/restarts/{restart_id}").json()["state"] == "done")

    wait_for(settled, TIMEOUT_S, "the settlement")
    return ready, time.perf_counter() - began


def stop_start_once(daemon: Daemon) -> float:
    """Seconds from SIGTERM to the next start's first ready."""
    boot = daemon.status()["boot"]["id"]
    began = time.perf_counter()
    daemon.signal(signal.SIGTERM)
    daemon.wait(TIMEOUT_S)
    daemon.start(wait=False)
    wait_for(lambda: _ready_boot(daemon, boot), TIMEOUT_S, "the next start")
    return time.perf_counter() - began


def reload_once(daemon: Daemon, cache_mb: int | None) -> float:
    """Seconds for `POST /v1/reload` to answer; with `cache_mb`, a workers' key changed."""
    if cache_mb is not None:
        daemon.config["pool"]["history_cache_mb"] = cache_mb
        daemon.config_path.write_text(tomli_w.dumps(daemon.config))
    began = time.perf_counter()
    with daemon.client() as http:
        http.timeout = TIMEOUT_S
        answer = http.post("/v1/reload", json={"wait": True})
    answer.raise_for_status()
    return time.perf_counter() - began


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks inplace")
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_RUNS} runs")
    args, _ = parser.parse_known_args(argv)
    runs = QUICK_RUNS if args.quick else args.runs
    figures: dict[str, list[float]] = {
        "restart_s": [],
        "settled_s": [],
        "stop_start_s": [],
        "reload_noop_s": [],
        "reload_workers_s": [],
    }
    with tempfile.TemporaryDirectory(prefix="tk-bench-inplace-") as tmp:
        daemon = Daemon(
            Path(tmp),
            pool=shipped_pool(),
            restart={"min_interval": 0.0},
            recovery={"attempt_delays": [0.0, 5.0, 30.0]},
        )
        try:
            daemon.start()
            for run in range(runs):
                ready, settled = restart_once(daemon)
                figures["restart_s"].append(ready)
                figures["settled_s"].append(settled)
                figures["stop_start_s"].append(stop_start_once(daemon))
                figures["reload_noop_s"].append(reload_once(daemon, None))
                figures["reload_workers_s"].append(reload_once(daemon, 64 + run + 1))
        finally:
            daemon.kill_everything()
    medians = {name: round(statistics.median(values), 3) for name, values in figures.items()}
    result: dict[str, Any] = {
        "benchmark": "inplace",
        "runs": runs,
        "machine": {"python": platform.python_version(), "cpus": _cpus()},
        "median": medians,
        "all": {name: [round(v, 3) for v in values] for name, values in figures.items()},
        "restart_to_stop_start": round(medians["restart_s"] / medians["stop_start_s"], 2),
    }
    print(json.dumps(result, indent=2, sort_keys=True))
    return result


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))
