"""Scale figures of a quiet daemon and of the store: idle supervisor CPU, the work query
and lease renewal against the number of stored sessions, and durable appends.

Each takes the benchmark's options and a fresh directory and returns a figure (see
`scale_support`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import re
import sqlite3
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from supervisor.store import Store
from tests.benchmarks import bench_idle, bench_store, scale_seed
from tests.benchmarks.scale_support import ScaleDaemon, check, ratio, with_daemon

SETTLE_S = 3.0  # after ready: the boot scan and the first passes are done
OWNER = "bench-host/b00tb00t/w0.1"


# --- 4. idle supervisor CPU --------------------------------------------------------


async def _idle(d: ScaleDaemon, seconds: float) -> dict[str, Any]:
    """`bench_idle.measure` over `seconds`, with the processes on the machine."""
    found = await asyncio.to_thread(bench_idle.measure, d.daemon, seconds)
    return {"host_processes": len(psutil.pids())} | found


async def idle_cpu(root: Path, opts: argparse.Namespace) -> dict[str, Any]:
    """Idle supervisor CPU: as the machine is, with `--extra-processes` more `sleep`
    processes, and on a database of `--stored` sessions of which `--stored-interrupted`
    have an interrupted turn waiting."""
    found: dict[str, Any] = {}

    async def plain(d: ScaleDaemon) -> dict[str, Any]:
        await asyncio.sleep(SETTLE_S)
        found["normal"] = await _idle(d, opts.idle_seconds)
        sleepers: list[subprocess.Popen[bytes]] = []
        try:
            sleepers = bench_idle.sleepers(opts.extra_processes)
            await asyncio.sleep(1.0)
            found["extra_processes"] = await _idle(d, opts.idle_seconds)
        finally:
            for proc in sleepers:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
        return {}

    found |= await with_daemon(ScaleDaemon(root / "idle"), plain)

    # The interrupted sessions wait for a first touch: recovery's passes would otherwise
    # continue them, 10 every 5 s, which is work, not idling.
    stored = ScaleDaemon(root / "idle-stored", recovery={"max_per_pass": 0})
    seeded = await asyncio.to_thread(
        scale_seed.seed,
        stored.db_path,
        stored.url,
        opts.stored - opts.stored_interrupted,
        opts.stored_interrupted,
    )
    seeded.pop("interrupted_ids")

    async def many(d: ScaleDaemon) -> dict[str, Any]:
        await asyncio.sleep(SETTLE_S * 2)
        return await _idle(d, opts.idle_seconds)

    found["stored_sessions"] = await with_daemon(stored, many) | seeded
    checks = [
        check(
            f"{name}.supervisor_percent_of_a_core",
            found[name]["supervisor_percent"],
            "<=",
            bench_idle.TARGET_PERCENT,
            "%",
        )
        for name in ("normal", "extra_processes", "stored_sessions")
    ]
    return found | {"extra_sleep_processes": opts.extra_processes, "checks": checks}


# --- 8. the work query and lease renewal -------------------------------------------


class _Statements(logging.Handler):
    """The SQL peewee runs, as (sql, params)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.found: list[tuple[str, tuple[Any, ...]]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, tuple) and len(record.msg) == 2:
            sql, params = record.msg
            self.found.append((str(sql), tuple(params or ())))


def _statements(call: Callable[[], object]) -> list[tuple[str, tuple[Any, ...]]]:
    logger = logging.getLogger("peewee")
    handler, level = _Statements(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        call()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return handler.found


def _plans(path: Path, statements: list[tuple[str, tuple[Any, ...]]]) -> list[dict[str, Any]]:
    """EXPLAIN QUERY PLAN of each SELECT/UPDATE/DELETE statement."""
    plans = []
    with contextlib.closing(sqlite3.connect(path)) as conn:
        for sql, params in statements:
            if not sql.lstrip().upper().startswith(("SELECT", "UPDATE", "DELETE")):
                continue
            rows = conn.execute(f"EXPLAIN QUERY PLAN {sql}", params).fetchall()
            plans.append({"sql": sql, "plan": [row[-1] for row in rows]})
    return plans


def _scans_sessions(plans: list[dict[str, Any]]) -> bool:
    """Whether a plan reads the whole session table (or a whole index of it): a SCAN
    step of `session` or of its alias in the statement (`"session" AS "t1"`)."""
    for p in plans:
        names = {"session", *re.findall(r'"session" AS "(\w+)"', p["sql"])}
        for step in p["plan"]:
            words = step.replace('"', "").split()
            if len(words) > 1 and words[0] == "SCAN" and words[1] in names:
                return True
    return False


def _median_us(call: Callable[[], object], times: int) -> float:
    for _ in range(3):
        call()
    samples = []
    for _ in range(times):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return round(statistics.median(samples) * 1e6, 1)


def _work_query_at(root: Path, stored: int, calls: int) -> dict[str, Any]:
    path = root / f"work-{stored}" / "turnkeeper.db"
    url = f"sqlite:///{path}"
    # `stored` sessions in all: 10 interrupted, 10 with input pending, 10 whose leases
    # OWNER holds, the others idle.
    seeded = scale_seed.seed(path, url, stored - 30, 10)
    with Store(url, "normal") as store:
        for _ in range(10):
            sid = store.sessions.create("bench").id
            store.events.append(sid, "user_message", {"text": "hello"}, writer="intake")
        leased = [store.sessions.create("bench").id for _ in range(10)]
        for sid in leased:
            store.leases.acquire(sid, OWNER, ttl=300.0)
        work = store.sessions.with_work
        renew = store.leases.renew_owner
        result = {
            "stored_sessions": store.sessions.counts().get("open"),
            "with_work_returns": len(work()),
            "renew_owner_renews": renew(OWNER, 300.0),
            "with_work_us": _median_us(work, calls),
            "renew_owner_us": _median_us(lambda: renew(OWNER, 300.0), calls),
            "with_work_plan": _plans(path, _statements(work)),
            "renew_owner_plan": _plans(path, _statements(lambda: renew(OWNER, 300.0))),
            "seed_s": seeded["seed_s"],
        }
    return result


async def work_query(root: Path, opts: argparse.Namespace) -> dict[str, Any]:
    """`with_work()` and `renew_owner` at `--stored` stored sessions vs 1,000 (in-process,
    SQLite, synchronous=NORMAL so a commit's fsync does not hide the statement's cost)."""
    small = await asyncio.to_thread(_work_query_at, root, 1000, opts.calls)
    large = await asyncio.to_thread(_work_query_at, root, opts.stored, opts.calls)
    work = ratio(large["with_work_us"], small["with_work_us"])
    renew = ratio(large["renew_owner_us"], small["renew_owner_us"])
    scans = {
        "with_work": _scans_sessions(large["with_work_plan"]),
        "renew_owner": _scans_sessions(large["renew_owner_plan"]),
    }
    return {
        "small": {k: v for k, v in small.items() if not k.endswith("_plan")},
        "large": large,
        "plan_scans_session_table": scans,
        "checks": [
            check("with_work_ratio", work, "<=", 1.5, "x"),
            check("renew_owner_ratio", renew, "<=", 1.5, "x"),
            check("plans_scanning_sessions", sum(scans.values()), "<=", 0),
        ],
    }


# --- 10. durable appends -----------------------------------------------------------


async def appends(root: Path, opts: argparse.Namespace) -> dict[str, Any]:
    """bench_store's synchronous=FULL pass: one session's appends and 32 threads' against
    a raw sqlite3 loop, on this machine now."""
    workdir = root / "appends"
    workdir.mkdir()
    found = await asyncio.to_thread(bench_store.run_pass, workdir, "full", opts.store_events)
    single = found["store_single_session"]["ratio_to_raw"]
    threads = found["store_32_sessions"]["ratio_to_raw"]
    targets = bench_store.TARGETS
    return {
        "events": opts.store_events,
        "raw_events_per_s": found["raw_sqlite"]["events_per_s"],
        "single_session_events_per_s": found["store_single_session"]["events_per_s"],
        "threads_32_events_per_s": found["store_32_sessions"]["events_per_s"],
        "see": "python -m tests.benchmarks store (both synchronous settings, asyncio too)",
        "checks": [
            check(
                "single_session_over_raw", single, ">=", targets["single_session_ratio_min"], "x"
            ),
            check("threads_32_over_raw", threads, ">=", targets["sessions_32_ratio_min"], "x"),
        ],
    }
