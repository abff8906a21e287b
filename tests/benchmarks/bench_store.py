"""Event-store append throughput against a raw sqlite3 baseline, on the same machine.

Workloads, run alternately (round-robin, in rounds) so they share the machine's state,
in one fresh temporary directory on tempfile's default filesystem:

- `raw_sqlite`: one thread, `BEGIN IMMEDIATE; INSERT; COMMIT` per event with sqlite3 into
  a table shaped like the store's `event` table: the baseline of every ratio;
- `raw_sqlite_store_sql`: the same loop running the store's own statements for an append
  (the session row's bump, then the insert) on a database with the store's schema: what
  that SQL costs with no Python around it, for context (no target);
- `store_single_session`: one thread appending to one session through `Store.events`;
- `store_single_session_asyncio`: one asyncio task doing the same with `append_async`
  (each append goes through the committer thread), for context (no target);
- `store_32_sessions`: 32 threads in this process, each appending to its own session;
- `store_32_sessions_asyncio`: 32 asyncio tasks in one event loop, each appending to its
  own session with `append_async`: the way a worker appends.

Every workload commits each append durably before the next (one fsync'd commit per
append for one session); the store's batch several sessions' appends into one commit.

Both use journal_mode=WAL; one pass with synchronous=FULL (the store's default, reported
at the top level) and a second with synchronous=NORMAL (under `synchronous_normal`).

    python -m tests.benchmarks.bench_store [--events N] [--quick]

Prints one JSON object. It measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor.store import Store
from supervisor.store.statements import Sql, sql_for
from tests.benchmarks.figures import percentile

TARGETS = {"single_session_ratio_min": 0.8, "sessions_32_ratio_min": 2.0}
DEFAULT_EVENTS = 3000
QUICK_EVENTS = 400
THREADS = 32
ROUNDS = 3
# Per pass, per workload, all rounds together: a slow disk stops a workload early.
WORKLOAD_BUDGET_S = 8.0
WARMUP_EVENTS = 150
EVENT_TYPE = "model_response"
TURN_ID = "t1"
WRITER = "worker"

RAW_SCHEMA = """
CREATE TABLE event (
    id INTEGER PRIMARY KEY,
    session_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    type TEXT NOT NULL,
    turn_id TEXT,
    payload TEXT NOT NULL,
    created_at REAL NOT NULL,
    writer TEXT NOT NULL,
    UNIQUE (session_id, seq)
)
"""
RAW_INSERT = (
    "INSERT INTO event (session_id, seq, type, turn_id, payload, created_at, writer) "
    "VALUES (?, ?, ?, ?, ?, ?, ?)"
)


def make_payload(size: int = 200) -> dict[str, Any]:
    """A JSON object whose compact text is `size` bytes."""
    payload: dict[str, Any] = {"text": "", "index": 0}
    base = len(json.dumps(payload, ensure_ascii=False))
    payload["text"] = "lorem ipsum dolor sit amet " * (size // 27 + 1)
    payload["text"] = payload["text"][: size - base]
    return payload


PAYLOAD = make_payload()
PAYLOAD_JSON = json.dumps(PAYLOAD, ensure_ascii=False)


def latency_ms(samples_ns: list[int]) -> dict[str, float]:
    ordered = sorted(s / 1e6 for s in samples_ns)
    return {
        "p50": round(percentile(ordered, 50), 3),
        "p99": round(percentile(ordered, 99), 3),
        "max": round(ordered[-1], 3) if ordered else float("nan"),
    }


class Tally:
    """Events, seconds and per-event latencies of one workload over all its rounds."""

    def __init__(self) -> None:
        self.events = 0
        self.seconds = 0.0
        self.latencies_ns: list[int] = []
        self.round_rates: list[float] = []
        self.commits = 0
        self.committed = 0

    def add(self, events: int, seconds: float, latencies_ns: list[int]) -> None:
        self.events += events
        self.seconds += seconds
        self.latencies_ns.extend(latencies_ns)
        self.round_rates.append(round(events / seconds, 1) if seconds else 0.0)

    @property
    def rate(self) -> float:
        return self.events / self.seconds if self.seconds else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "events": self.events,
            "seconds": round(self.seconds, 3),
            "events_per_s": round(self.rate, 1),
            "rounds_events_per_s": self.round_rates,
            "latency_ms": latency_ms(self.latencies_ns),
        }


# --- raw sqlite3 -------------------------------------------------------------------


def open_raw(path: Path, synchronous: str) -> sqlite3.Connection:
    conn = open_raw_conn(path, synchronous)
    conn.execute(RAW_SCHEMA)
    return conn


def timed(n: int, deadline: float, one: Callable[[int], object]) -> tuple[int, float, list[int]]:
    """`one(i)` for i in 1..n, until the deadline; returns (events, seconds, latencies)."""
    latencies: list[int] = []
    clock = time.perf_counter_ns
    start = clock()
    done = 0
    for i in range(1, n + 1):
        t0 = clock()
        one(i)
        t1 = clock()
        latencies.append(t1 - t0)
        done = i
        if t1 > deadline:
            break
    return done, (clock() - start) / 1e9, latencies


def run_raw(
    conn: sqlite3.Connection, session_id: str, n: int, deadline: float
) -> tuple[int, float, list[int]]:
    """One INSERT + COMMIT per event; returns (events, seconds, latencies)."""
    execute = conn.execute

    def one(seq: int) -> None:
        execute("BEGIN IMMEDIATE")
        execute(
            RAW_INSERT, (session_id, seq, EVENT_TYPE, TURN_ID, PAYLOAD_JSON, time.time(), WRITER)
        )
        execute("COMMIT")

    return timed(n, deadline, one)


def open_store_sql(path: Path, synchronous: str) -> tuple[sqlite3.Connection, str, Sql]:
    """A sqlite3 connection to a database with the store's schema, one leased session, and
    the store's statements for an append from a known session row."""
    with Store(f"sqlite:///{path.as_posix()}", synchronous) as store:
        session_id, _ = new_session(store, "raw")
        sql = sql_for(store.db)
    return open_raw_conn(path, synchronous), session_id, sql


def open_raw_conn(path: Path, synchronous: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous.upper()}")
    conn.execute("PRAGMA busy_timeout=5000")
    return conn


def run_store_sql(
    conn: sqlite3.Connection, session_id: str, sql: Sql, n: int, deadline: float
) -> tuple[int, float, list[int]]:
    """`run_raw` with the store's statements: bump the session row, insert, commit."""
    last, token = conn.execute(
        "SELECT last_seq, lease_token FROM session WHERE id = ?", (session_id,)
    ).fetchone()
    execute = conn.execute

    def one(i: int) -> None:
        execute("BEGIN IMMEDIATE")
        execute(sql.bump, (last + i, time.time(), session_id, last + i - 1, token))
        execute(
            sql.insert,
            (session_id, last + i, EVENT_TYPE, TURN_ID, PAYLOAD_JSON, time.time(), WRITER, token),
        )
        execute("COMMIT")

    return timed(n, deadline, one)


# --- the store ---------------------------------------------------------------------


def new_session(store: Store, owner: str) -> tuple[str, int]:
    session_id = store.sessions.create("bench").id
    lease = store.leases.acquire(session_id, owner, ttl=3600)
    assert lease is not None  # a fresh session is free; not a benchmark assertion
    return session_id, lease.token


def append_loop(
    store: Store, session_id: str, token: int, n: int, deadline: float, latencies: list[int]
) -> int:
    clock = time.perf_counter_ns
    append = store.events.append
    done = 0
    for _ in range(n):
        t0 = clock()
        append(session_id, EVENT_TYPE, PAYLOAD, token=token, turn_id=TURN_ID)
        t1 = clock()
        latencies.append(t1 - t0)
        done += 1
        if t1 > deadline:
            break
    return done


def run_store_single(store: Store, n: int, deadline: float) -> tuple[int, float, list[int]]:
    session_id, token = new_session(store, "w0.1")
    latencies: list[int] = []
    start = time.perf_counter_ns()
    done = append_loop(store, session_id, token, n, deadline, latencies)
    return done, (time.perf_counter_ns() - start) / 1e9, latencies


def run_store_threads(
    store: Store, threads: int, n_total: int, deadline: float
) -> tuple[int, float, list[int]]:
    """`threads` threads, each appending n_total/threads events to its own session."""
    sessions = [new_session(store, f"w{i}.1") for i in range(threads)]
    per_thread = max(1, n_total // threads)
    latencies: list[list[int]] = [[] for _ in range(threads)]
    done = [0] * threads
    barrier = threading.Barrier(threads + 1)

    def worker(i: int) -> None:
        session_id, token = sessions[i]
        barrier.wait()
        done[i] = append_loop(store, session_id, token, per_thread, deadline, latencies[i])

    pool = [threading.Thread(target=worker, args=(i,), name=f"bench-{i}") for i in range(threads)]
    for thread in pool:
        thread.start()
    barrier.wait()
    start = time.perf_counter_ns()
    for thread in pool:
        thread.join()
    seconds = (time.perf_counter_ns() - start) / 1e9
    return sum(done), seconds, [s for per in latencies for s in per]


def run_store_asyncio(
    store: Store, tasks: int, n_total: int, deadline: float
) -> tuple[int, float, list[int]]:
    """`tasks` asyncio tasks in one loop, each appending n_total/tasks events to its own session."""
    sessions = [new_session(store, f"a{i}.1") for i in range(tasks)]
    per_task = max(1, n_total // tasks)
    latencies: list[int] = []
    clock = time.perf_counter_ns

    async def one(session_id: str, token: int) -> int:
        done = 0
        for _ in range(per_task):
            t0 = clock()
            await store.events.append_async(
                session_id, EVENT_TYPE, PAYLOAD, token=token, turn_id=TURN_ID
            )
            t1 = clock()
            latencies.append(t1 - t0)
            done += 1
            if t1 > deadline:
                break
        return done

    async def all_tasks() -> int:
        return sum(await asyncio.gather(*(one(sid, token) for sid, token in sessions)))

    start = clock()
    done = asyncio.run(all_tasks())
    return done, (clock() - start) / 1e9, latencies


# --- one pass ----------------------------------------------------------------------


def run_pass(workdir: Path, synchronous: str, n_events: int) -> dict[str, Any]:
    raw_conn = open_raw(workdir / f"raw-{synchronous}.db", synchronous)
    sql_conn, sql_session, sql = open_store_sql(
        workdir / f"store-sql-{synchronous}.db", synchronous
    )
    store = Store(f"sqlite:///{(workdir / f'store-{synchronous}.db').as_posix()}", synchronous)
    try:
        far = time.perf_counter_ns() + 3_600 * 10**9
        # Warm-up: page cache, WAL file, sqlite3/peewee statement caches, the committer.
        run_raw(raw_conn, "warmup", WARMUP_EVENTS, far)
        run_store_sql(sql_conn, sql_session, sql, WARMUP_EVENTS, far)
        run_store_single(store, WARMUP_EVENTS, far)
        run_store_asyncio(store, 1, WARMUP_EVENTS, far)
        run_store_threads(store, THREADS, THREADS * 4, far)
        run_store_asyncio(store, THREADS, THREADS * 4, far)

        names = ("raw", "store_sql", "single", "single_asyncio", "threads", "asyncio")
        tallies = {name: Tally() for name in names}
        per_round = max(THREADS, n_events // ROUNDS)
        budget_ns = int(WORKLOAD_BUDGET_S / ROUNDS * 1e9)
        workloads: list[tuple[str, Callable[[float], tuple[int, float, list[int]]]]] = [
            ("raw", lambda d: run_raw(raw_conn, f"raw-{time.time_ns()}", per_round, d)),
            ("store_sql", lambda d: run_store_sql(sql_conn, sql_session, sql, per_round, d)),
            ("single", lambda d: run_store_single(store, per_round, d)),
            ("single_asyncio", lambda d: run_store_asyncio(store, 1, per_round, d)),
            ("threads", lambda d: run_store_threads(store, THREADS, per_round, d)),
            ("asyncio", lambda d: run_store_asyncio(store, THREADS, per_round, d)),
        ]
        for r in range(ROUNDS):
            # Rotate the order so no workload always runs first (or right after another).
            order = workloads[r % len(workloads) :] + workloads[: r % len(workloads)]
            for name, run in order:
                before = (store.events.commits, store.events.committed)
                deadline = time.perf_counter_ns() + budget_ns
                tallies[name].add(*run(deadline))
                tallies[name].commits += store.events.commits - before[0]
                tallies[name].committed += store.events.committed - before[1]
    finally:
        store.close()
        raw_conn.close()
        sql_conn.close()

    raw_rate = tallies["raw"].rate

    def against_raw(tally: Tally, **extra: Any) -> dict[str, Any]:
        figures = tally.summary()
        figures.update(extra)
        figures["ratio_to_raw"] = round(tally.rate / raw_rate, 3) if raw_rate else None
        figures["commits"] = tally.commits
        return figures

    def batched(tally: Tally, **extra: Any) -> dict[str, Any]:
        figures = against_raw(tally, **extra)
        figures["avg_batch"] = round(tally.committed / tally.commits, 2) if tally.commits else None
        return figures

    sql_rate = tallies["store_sql"].rate
    single = against_raw(tallies["single"])
    single["ratio_to_store_sql"] = round(tallies["single"].rate / sql_rate, 3) if sql_rate else None
    threads = batched(tallies["threads"], threads=THREADS)
    tasks = batched(tallies["asyncio"], tasks=THREADS)
    return {
        "synchronous": synchronous.upper(),
        "raw_sqlite": tallies["raw"].summary(),
        "raw_sqlite_store_sql": tallies["store_sql"].summary()
        | {"ratio_to_raw": round(sql_rate / raw_rate, 3) if raw_rate else None},
        "store_single_session": single,
        "store_single_session_asyncio": against_raw(tallies["single_asyncio"]),
        "store_32_sessions": threads,
        "store_32_sessions_asyncio": tasks,
        "meets_targets": {
            "single_session": (single["ratio_to_raw"] or 0) >= TARGETS["single_session_ratio_min"],
            "sessions_32_threads": (threads["ratio_to_raw"] or 0)
            >= TARGETS["sessions_32_ratio_min"],
            "sessions_32_asyncio": (tasks["ratio_to_raw"] or 0) >= TARGETS["sessions_32_ratio_min"],
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.bench_store")
    parser.add_argument(
        "--events",
        type=int,
        default=None,
        help=f"events per workload and pass, over {ROUNDS} rounds (default {DEFAULT_EVENTS})",
    )
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_EVENTS} events")
    args = parser.parse_args(argv)
    n_events = args.events or (QUICK_EVENTS if args.quick else DEFAULT_EVENTS)

    with tempfile.TemporaryDirectory(prefix="turnkeeper-bench-") as tmp:
        workdir = Path(tmp)
        full = run_pass(workdir, "full", n_events)
        normal = run_pass(workdir, "normal", n_events)

    result: dict[str, Any] = {
        "benchmark": "store",
        "python": sys.version.split()[0],
        "sqlite_version": sqlite3.sqlite_version,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "n_events": n_events,
        "rounds": ROUNDS,
        "payload_bytes": len(PAYLOAD_JSON.encode()),
        "journal_mode": "WAL",
        "targets": TARGETS,
        **full,
        "synchronous_normal": normal,
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
