"""Flat cost: what each unit of work costs as the stored state and the load grow.

Each figure is measured against its baseline in the same run, on this machine now, and
judged against its target. The daemons are `turnkeeper run` as real processes
(`tests.daemon.Daemon`) on free loopback ports: SQLite with `synchronous=FULL`, the echo
model, the shipped agent class, pool timings and recovery schedule, `pool.workers = 2,
pool.spare = 1` unless a figure says otherwise. Large states are seeded fast: a template
session written through the store, copied by SQL (`scale_seed`). Latencies are from the
client's wall clock just before the request to the `created_at` the worker stamps on the
event (same host clock, so no polling delay is counted). CPU is psutil's user + system
time of a process, in 10 ms ticks.

 1. `history`: inject -> `turn_ended` in a session of `--events` events (copies of a
    real turn) / in sessions of ~10 events, median over `--turns` turns each,
    alternating; all on one worker (`workers = 1, spare = 1`), whose CPU per turn is
    reported too. Target <= 1.3x.
 2. `kill`: a worker holds `--kill-sessions` turns (then 1), each held at a gate
    (`tests.agents:ChaosAgent`'s `/gate`); SIGKILL; until every one of them has a
    `continuation` (or `turn_ended`) stamped after the kill. k = N / k = 1. Target <= 3x.
 3. `backlog`: a new session's first reply (inject -> `model_response`, median of
    `--first-replies` new sessions, one after another) on a daemon whose database holds
    `--backlog` sessions with an interrupted turn of an earlier boot of this host, a
    minute old (recovery's passes work them off meanwhile, 10 every 5 s) / on an empty
    one. Target <= 2x; no reply within `--backlog-timeout` is not met.
 4. `idle_cpu`: the idle supervisor's CPU (% of a core, over `--idle-seconds`,
    `bench_idle.measure`) as the machine is, with `--extra-processes` more `sleep`
    processes, and on a database of `--stored` sessions of which `--stored-interrupted`
    are interrupted. Target <= 1%.
 5. `sse_replay`: `bench_replay` with 10 sessions of `--replay-events` events, `--reps`
    runs: the supervisor's CPU per event of one replay (<= 30 us), 10 concurrent replays'
    wall / 1's (<= 3x);
 6. and another session's inject -> 202 while 10 replays run / idle (<= 2x, medians).
 7. `arrivals`: `--arrivals` sessions created and sent a first message at once: first
    to last "assigned to" in the daemon log. Target <= 1 s.
 8. `work_query`: `store.sessions.with_work()` and `store.leases.renew_owner` at
    `--stored` stored sessions / 1,000 (the same 10 pending, 10 interrupted, 10 leased),
    in-process, and their `EXPLAIN QUERY PLAN`: <= 1.5x, no SCAN of the session table.
 9. restart -> an interrupted turn continued with one real MCP server: bench_restart.
10. `appends`: bench_store's FULL pass: one session's appends / raw sqlite3 (>= 0.8x),
    32 threads / raw (>= 2x).
11. `throughput`: replies/s of `--sessions` sessions in a closed loop with 1 and 4
    workers, and the supervisor's and the workers' CPU ms per reply: each <= half of
    what it was before this work (`scale_http.TODAY_CPU_MS`).
12. `overhead`: echo with `model.delay` = 1 s, `--sessions` sessions at once:
    inject -> `turn_ended` p99 minus 1 s (`bench_intake.delay_overhead`). <= 50 ms.

    python -m tests.benchmarks scale [--only NUMBER_OR_NAME[,...]] [--reps N] [--quick]

A figure's number never collides with a benchmark's name (`--only 4`); a name does when
a `bench_NAME.py` exists, so give names as `--only=NAME`.

Prints one JSON object: every figure, with `checks` (value, target, met), and a
`summary` of all checks. It measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.benchmarks import scale_http, scale_quiet, scale_support, scale_turns
from tests.conftest import REPO

Figure = Callable[[Path, argparse.Namespace], Awaitable[dict[str, Any]]]


async def _see_restart(root: Path, opts: argparse.Namespace) -> dict[str, Any]:
    return {"see": "bench_restart", "checks": []}


# number, name, runner, what was measured before this work ("bbe95f7": that commit, by
# this benchmark, on a busy 2-core machine)
FIGURES: list[tuple[int, str, Figure, str]] = [
    (1, "history", scale_turns.history, "21x (bbe95f7: 41x)"),
    (2, "kill", scale_turns.kill, "27x, 53 ms -> 1.5 s (bbe95f7: 47x, 31 ms -> 1.45 s)"),
    (3, "backlog", scale_turns.backlog, "no reply once more than 1,000 have work"),
    (4, "idle_cpu", scale_quiet.idle_cpu, "bbe95f7: 3.2%, 8.2%, 12.7%"),
    (5, "sse_replay", scale_http.replay, "bbe95f7: 23 us/event, 9.9x; 6: 245x"),
    (7, "arrivals", scale_turns.arrivals, "15.7 s (bbe95f7: 2.2 s)"),
    (8, "work_query", scale_quiet.work_query, "bbe95f7: 24x, 126x, both SCAN session"),
    (9, "restart_mcp", _see_restart, ""),
    (10, "appends", scale_quiet.appends, ""),
    (11, "throughput", scale_http.throughput, "65 -> 76 replies/s; ~4.5 ms and ~8 ms CPU"),
    (12, "overhead", scale_http.overhead, "bbe95f7: 161 ms"),
]
ALIASES = {"6": "sse_replay", "inject_during_replay": "sse_replay"}
DEFAULTS: dict[str, Any] = {
    "reps": 3,
    "events": 10_000,
    "turns": 20,
    "kill_sessions": 100,
    "backlog": 10_000,
    "backlog_timeout": 30.0,
    "first_replies": 10,
    "idle_seconds": 6.0,
    "extra_processes": 500,
    "stored": 100_000,
    "stored_interrupted": 1_000,
    "replay_events": 5_000,
    "injects": 30,
    "arrivals": 200,
    "calls": 50,
    "store_events": 1_200,
    "sessions": 50,
    "seconds": 8.0,
    "delay_rounds": 4,
}
QUICK: dict[str, Any] = DEFAULTS | {
    "reps": 1,
    "events": 2_000,
    "turns": 5,
    "kill_sessions": 20,
    "backlog": 1_000,
    "backlog_timeout": 15.0,
    "first_replies": 3,
    "idle_seconds": 2.0,
    "extra_processes": 50,
    "stored": 10_000,
    "stored_interrupted": 100,
    "replay_events": 1_000,
    "injects": 10,
    "arrivals": 50,
    "calls": 10,
    "store_events": 300,
    "sessions": 20,
    "seconds": 2.0,
    "delay_rounds": 2,
}


def selected(only: list[str]) -> list[tuple[int, str, Figure, str]]:
    """The figures named (by name or number; comma-separated or repeated), or all."""
    wanted = {ALIASES.get(w, w) for part in only for w in part.split(",") if w}
    known = {str(n) for n, *_ in FIGURES} | {name for _, name, *_ in FIGURES}
    unknown = wanted - known
    if unknown:
        names = ", ".join(f"{n} {name}" for n, name, *_ in FIGURES)
        raise SystemExit(f"unknown figure {', '.join(sorted(unknown))}; known: {names}")
    return [f for f in FIGURES if not wanted or str(f[0]) in wanted or f[1] in wanted]


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


async def _run(
    figures: list[tuple[int, str, Figure, str]], opts: argparse.Namespace
) -> dict[str, Any]:
    found: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="turnkeeper-bench-") as tmp:
        for number, name, figure, before in figures:
            root = Path(tmp) / name
            root.mkdir()
            started = time.monotonic()
            try:
                result = await figure(root, opts)
            except (Exception, pytest.fail.Exception) as exc:
                result = {"error": f"{type(exc).__name__}: {exc}", "checks": []}
                result["traceback"] = traceback.format_exc().splitlines()[-8:]
                result["daemon_log"] = [
                    line for note in getattr(exc, "__notes__", []) for line in note.splitlines()
                ]
            result = {"figure": number, "before_this_work": before or None, **result}
            result["wall_s"] = round(time.monotonic() - started, 1)
            found[name] = result
            print(f"[scale] {number} {name}: {result['wall_s']} s", file=sys.stderr)
    return found


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.bench_scale")
    parser.add_argument(
        "--only", action="append", default=[], help="figure names or numbers (default all)"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, one repetition")
    for key, value in DEFAULTS.items():
        flag = "--" + key.replace("_", "-")
        parser.add_argument(flag, type=type(value), default=None, help=f"default {value}")
    opts = parser.parse_args(argv)
    for key, value in (QUICK if opts.quick else DEFAULTS).items():
        if getattr(opts, key) is None:
            setattr(opts, key, value)
    figures = selected(opts.only)

    started = time.monotonic()
    load_before = os.getloadavg()
    try:
        found = asyncio.run(_run(figures, opts))
    finally:
        scale_support.stop_all()
    errors = [
        {"figure": f["figure"], "name": f"{name}.error", "value": None, "target": "no error"}
        | {"met": False}
        for name, f in found.items()
        if "error" in f
    ]
    summary = [
        {
            "figure": f["figure"],
            "name": f"{name}.{c['name']}",
            **{k: c[k] for k in ("value", "target", "met")},
        }
        for name, f in found.items()
        for c in f.get("checks", [])
    ] + errors
    result: dict[str, Any] = {
        "benchmark": "scale",
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "uncommitted_changes": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "options": {k: getattr(opts, k) for k in DEFAULTS} | {"quick": opts.quick},
        "summary": summary,
        "all_met": all(c["met"] for c in summary),
        **found,
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
