"""A requested restart in place and a reload, against the stop and start an operator would
otherwise do, on one real daemon with the shipped pool timings (`pool.workers = 2,
pool.spare = 1, heartbeat_interval = 1.0`), one right after the other so that they share
the machine's state:

- `restart_s`: `POST /v1/restart` (the default drain; nothing in flight, so it ends at once)
  to the first `/readyz` 200 of the new boot (the same pid), and `settled_s` to its request
  settled `ok`.
- `restart_drained_s`: the same with a turn in flight (`/hold 2`: 2 s more to run when the
  restart is asked for), which the drain lets finish; `drained_after_turn_s` is from that
  turn's `turn_ended` (its `created_at`) to the first `/readyz` 200, what the restart adds
  to the turn. Each drained turn's outcome is listed (`completed`: it was not cut).
- `stop_start_s` (the baseline): SIGTERM, wait for the exit, `turnkeeper run` again, to the
  first `/readyz` 200: what `systemctl restart` does, minus systemd's own time.
- `reload_noop_s`: `POST /v1/reload` with nothing changed (the file read and checked, the
  agent probe's child included); `reload_workers_s`: with `pool.history_cache_mb` changed,
  so that all 3 workers are rolled, answered once the new ones are ready.

    python -m tests.benchmarks inplace [--runs N] [--quick]

Prints one JSON object with the medians, `restart_to_stop_start`,
`restart_drained_to_stop_start` and `drained_after_turn_to_stop_start` (the ratios of the
medians). It measures; it asserts nothing.
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

from supervisor.store import Store
from tests.benchmarks.figures import shipped_pool, wait_for
from tests.daemon import Daemon, turn_ended

DEFAULT_RUNS = 5
QUICK_RUNS = 2
TIMEOUT_S = 120.0
HOLD_S = 2.0  # seconds a drained turn runs on after the restart is asked for


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
        answer = http.post("/v1/restart", json={"reason": "benchmark"})
    answer.raise_for_status()
    restart_id = answer.json()["restart"]["id"]
    wait_for(lambda: _ready_boot(daemon, boot), TIMEOUT_S, "the new boot")
    ready = time.perf_counter() - began

    def settled() -> bool:
        with daemon.client() as http:
            return bool(http.get(f"/v1/restarts/{restart_id}").json()["state"] == "done")

    wait_for(settled, TIMEOUT_S, "the settlement")
    return ready, time.perf_counter() - began


def restart_drained_once(daemon: Daemon, store: Store, session: str) -> tuple[float, float, str]:
    """A turn held `HOLD_S` in flight, then a restart with the default drain: (seconds to
    the new boot ready, seconds from the turn's end to it, the turn's outcome)."""
    boot = daemon.status()["boot"]["id"]
    with daemon.client() as http:
        asked = http.post(f"/v1/sessions/{session}/inject", json={"text": f"/hold {HOLD_S:g}"})
    asked.raise_for_status()
    seq = int(asked.json()["seq"])
    wait_for(
        lambda: any(e.type == "turn_started" for e in store.events.read(session, after=seq)),
        TIMEOUT_S,
        "the held turn to start",
    )
    began_at, began = time.time(), time.perf_counter()
    with daemon.client() as http:
        http.post("/v1/restart", json={"reason": "benchmark"}).raise_for_status()
    wait_for(lambda: _ready_boot(daemon, boot), TIMEOUT_S, "the new boot")
    ready = time.perf_counter() - began
    ended = wait_for(lambda: turn_ended(store, session, seq), TIMEOUT_S, "the held turn's end")
    return ready, began_at + ready - ended.created_at, str(ended.payload.get("outcome"))


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
        "restart_drained_s": [],
        "drained_after_turn_s": [],
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
        outcomes: list[str] = []
        try:
            daemon.start()
            store = Store(daemon.url, migrate=False)
            session = store.sessions.create("admin").id
            for run in range(runs):
                ready, settled = restart_once(daemon)
                figures["restart_s"].append(ready)
                figures["settled_s"].append(settled)
                ready, after_turn, outcome = restart_drained_once(daemon, store, session)
                figures["restart_drained_s"].append(ready)
                figures["drained_after_turn_s"].append(after_turn)
                outcomes.append(outcome)
                figures["stop_start_s"].append(stop_start_once(daemon))
                figures["reload_noop_s"].append(reload_once(daemon, None))
                figures["reload_workers_s"].append(reload_once(daemon, 64 + run + 1))
            store.close()
        finally:
            daemon.kill_everything()
    medians = {name: round(statistics.median(values), 3) for name, values in figures.items()}
    result: dict[str, Any] = {
        "benchmark": "inplace",
        "runs": runs,
        "machine": {"python": platform.python_version(), "cpus": _cpus()},
        "median": medians,
        "all": {name: [round(v, 3) for v in values] for name, values in figures.items()},
        "drained_turn_outcomes": outcomes,
        "restart_to_stop_start": round(medians["restart_s"] / medians["stop_start_s"], 2),
        "restart_drained_to_stop_start": round(
            medians["restart_drained_s"] / medians["stop_start_s"], 2
        ),
        "drained_after_turn_to_stop_start": round(
            medians["drained_after_turn_s"] / medians["stop_start_s"], 2
        ),
    }
    print(json.dumps(result, indent=2, sort_keys=True))
    return result


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))
