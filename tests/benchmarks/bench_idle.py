"""Idle cost: the CPU an idle daemon uses, as a share of one core.

An idle supervisor should cost next to nothing, whatever else runs on the host and
however many sessions the database holds. The daemon is `turnkeeper run` as a real
process (`tests.daemon.Daemon`) with the shipped pool timings (2 workers + 1 spare,
heartbeat every 1 s, hang timeout 5 s, leases renewed every 10 s), SQLite, on a fresh
state dir per scenario:

- `empty`: an empty database;
- `host_processes`: the same, with `--procs` (500) extra `sleep` processes on the host
  while it is measured (started after the daemon is ready, SIGKILLed by pid after);
- `stored_sessions`: `--sessions` (100,000) sessions written into the database before
  the start (`scale_seed.seed`), `--interrupted` (1,000) of them with a turn in flight of
  an earlier boot of this host (a user message, `turn_started`, a lease that ran out),
  the others with one completed turn. Recovery's passes continue none of them
  (`recovery.max_per_pass = 0`: else they would be continued 10 every 5 s, which is work,
  not idling); they stay interrupted, left for a first touch, which the full pass (every
  5 s) reads; the 0.25 s pass reads only the index of sessions with input pending.

A run waits until the daemon is ready (and, with stored sessions, until the boot scan
logged what it found), then `--settle` seconds, then reads the CPU time (user + system)
of the supervisor and of each worker over `--seconds` of wall time. The supervisor's
target is 1% of a core in every scenario; the workers' figures are reported (each sends
a heartbeat every second and renews its leases every 10 s).

    python -m tests.benchmarks idle [--seconds S] [--procs N] [--sessions N] [--quick]

Prints one JSON object. It measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from tests.benchmarks import scale_seed
from tests.benchmarks.figures import cpu_s, shipped_pool, stop, wait_for
from tests.daemon import Daemon

TARGET_PERCENT = 1.0  # of one core, for the supervisor
SECONDS = 10.0
QUICK_SECONDS = 5.0
SETTLE_S = 3.0
PROCS = 500
SESSIONS = 100_000
INTERRUPTED = 1_000
_SCANNED = re.compile(r"\[recovery\] boot_scan: \d+ interrupted sessions")


def measure(daemon: Daemon, seconds: float) -> dict[str, Any]:
    """CPU of the supervisor and of each worker over `seconds`, as % of one core."""
    procs = {"supervisor": psutil.Process(daemon.pid)}
    procs |= {name: psutil.Process(pid) for name, pid in daemon.worker_pids().items()}
    before = {name: cpu_s(p) or 0.0 for name, p in procs.items()}
    started = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - started
    after = {name: cpu_s(p) or 0.0 for name, p in procs.items()}
    percent = {name: round(100 * (after[name] - before[name]) / wall, 2) for name in before}
    worker_figures = [v for k, v in percent.items() if k != "supervisor"]
    return {
        "seconds": round(wall, 2),
        "supervisor_percent": percent["supervisor"],
        "workers_percent": {k: v for k, v in percent.items() if k != "supervisor"},
        "worker_mean_percent": round(sum(worker_figures) / max(1, len(worker_figures)), 2),
        "target_percent": TARGET_PERCENT,
        "met": percent["supervisor"] <= TARGET_PERCENT,
    }


def sleepers(count: int) -> list[subprocess.Popen[bytes]]:
    """`count` idle `sleep` processes: more processes on the host, nothing else."""
    return [subprocess.Popen(["sleep", "3600"]) for _ in range(count)]


def run(root: Path, name: str, args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    """One scenario on a fresh state dir."""
    daemon = Daemon(
        root,
        pool=shipped_pool(),
        agent={"class": "tests.agents:ChaosAgent"},
        recovery={"max_per_pass": 0},  # the interrupted sessions wait for a first touch
    )
    figures: dict[str, Any] = {}
    if name == "stored_sessions":
        figures["sessions"], figures["interrupted"] = args.sessions, args.interrupted
        path = daemon.state / "turnkeeper.db"
        idle = args.sessions - args.interrupted
        figures["write_s"] = scale_seed.seed(path, daemon.url, idle, args.interrupted)["seed_s"]
    extra: list[subprocess.Popen[bytes]] = []
    try:
        daemon.start()
        if name == "stored_sessions":
            wait_for(lambda: _SCANNED.search(daemon.log()), 120, "the boot scan")
        time.sleep(args.settle)
        if name == "host_processes":
            extra = sleepers(args.procs)
            time.sleep(1.0)
        figures["host_processes"] = len(psutil.pids())
        figures |= measure(daemon, seconds)
    finally:
        for proc in extra:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        stop(daemon)
    return figures


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.bench_idle")
    parser.add_argument("--seconds", type=float, default=None, help=f"default {SECONDS:g}")
    parser.add_argument("--settle", type=float, default=SETTLE_S)
    parser.add_argument("--procs", type=int, default=PROCS)
    parser.add_argument("--sessions", type=int, default=SESSIONS)
    parser.add_argument("--interrupted", type=int, default=INTERRUPTED)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_SECONDS:g} s each")
    parser.add_argument("--only", choices=["empty", "host_processes", "stored_sessions"])
    args = parser.parse_args(argv)
    seconds = args.seconds or (QUICK_SECONDS if args.quick else SECONDS)
    names = [args.only] if args.only else ["empty", "host_processes", "stored_sessions"]
    scenarios: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tk-bench-idle-") as tmp:
        for name in names:
            scenarios[name] = run(Path(tmp) / name, name, args, seconds)
    result = {
        "benchmark": "idle",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "scenarios": scenarios,
        "target_percent": TARGET_PERCENT,
        "met": all(s["met"] for s in scenarios.values()),
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
