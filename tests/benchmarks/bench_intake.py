"""Intake over HTTP against the real daemon: reply latency, and sustained injects per second.

The daemon is `turnkeeper run` as a real process (`tests.daemon.Daemon`) in a fresh state
dir, with the durable defaults: SQLite with `synchronous=FULL`, the echo model with no
delay, the shipped agent class, `pool.workers = 2, pool.spare = 1` and the shipped heartbeat
and hang timeout, listening on a free loopback TCP port. The client is one aiohttp
`ClientSession` in this process, authenticated with the admin token the daemon writes.

First the benchmark creates the sessions (`POST /v1/sessions`) and opens one attach stream
per session (`GET /v1/sessions/{id}/attach?after=0`, SSE), which stay open until the end.
Each stream's events are stamped with `time.perf_counter()` as they are parsed.

1. `latency`: in each round, one message is injected into every session at once
   (`asyncio.gather`), and the round ends when every session has sent the `turn_ended` of
   a turn that began after its message. Per injection: the time from just before sending
   the inject request to (a) its 202, (b) the first event on the session's stream with a
   seq larger than the injected one (normally `turn_started`), (c) the first
   `model_response` after it, and (d) the `turn_ended`. The first round is the sessions'
   first turns (a worker is assigned each session then) and is reported apart, under
   `first_round`; the other rounds are pooled.

   Then `latency_one_session`: `--solo` injections into one session, one at a time
   (each after the previous turn ended), the other streams still open: the same figures
   without the queueing of 50 at once.

2. `sustained`: `--clients` concurrent clients, client i injecting into session
   i mod `--sessions` in a loop for `--seconds` (each inject awaits its 202 before the
   next). Reported: injects/s, the inject request latency, the turns completed by the end
   of the phase (from the database: `turn_ended` events whose `created_at` is before its
   end; and as seen on the attach streams by then), then how long the workers took to
   answer the backlog (until no session has pending input or a turn in flight, up to a
   limit). A turn answers every message pending when it starts, so there are fewer turns
   than injects.

During each phase the CPU time of every process is measured (psutil, from the processes'
own counters at the start and the end, plus samples every `SAMPLE_S` for the peak): the
supervisor, each worker, this benchmark process (the client), and the whole machine.
`others_percent_of_one_cpu` is the machine's busy time that none of the measured processes
used: other processes (a sign the figures are disturbed) and kernel work charged to no
process (loopback softirq, the filesystem journal); `machine_time_percent_of_all_cpus`
splits the machine's time (user, system, softirq, iowait, steal). The supervisor's
`supervisor_main_thread_cpu_percent` is its event loop (the OS thread whose id is the pid),
`supervisor_busiest_thread_cpu_percent` its busiest OS thread (the loop, or the store's
committer thread): near 100, the supervisor is bound by one core.

3. `latency_with_model_delay`: the latency as a user feels it. A second daemon, the same
   but for the echo model's `model.delay` = 1 s (every model call takes a second, as a
   real model's would), and `--sessions` sessions injected at once per round for
   `--delay-rounds` rounds (the first round, the sessions' first turns, apart). The
   daemon's `overhead_ms` is inject -> `turn_ended` minus the delay; its p99 has a target
   (`TARGET_OVERHEAD_P99_MS`). A model that takes a second leaves the workers idle
   meanwhile, so this overhead is what turnkeeper adds, not what 50 turns queued behind
   a zero-delay model cost (the figures of 1).

`--synchronous normal` runs the same with SQLite `synchronous=NORMAL`, for comparison only:
the durable default, and what the figures are meant to describe, is FULL.

    python -m tests.benchmarks intake [--sessions N] [--rounds N] [--solo N] [--seconds S]
                                      [--clients N] [--delay-rounds N]
                                      [--synchronous full|normal] [--quick]

Prints one JSON object. It measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sqlite3
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from supervisor.contract.config import AgentConfig
from supervisor.store import Store
from tests.benchmarks import figures
from tests.benchmarks.figures import cpu_s, free_port, shipped_pool, stop
from tests.daemon import Daemon, is_worker

DEFAULTS = {
    "sessions": 50,
    "rounds": 10,
    "solo": 30,
    "seconds": 10.0,
    "clients": 50,
    "delay_rounds": 5,
}
QUICK = {
    "sessions": 50,
    "rounds": 3,
    "solo": 10,
    "seconds": 3.0,
    "clients": 50,
    "delay_rounds": 3,
}
# The client is one principal (the admin) with an attach stream per session, and a few
# more streams for good measure: above the shipped `http.max_streams_per_principal`.
STREAMS = 8
MODEL_DELAY_S = 1.0  # latency_with_model_delay: echo's `model.delay`
TARGET_OVERHEAD_P99_MS = 50.0
WORKERS, SPARE = 2, 1
TURN_TIMEOUT_S = 60.0  # one round's wait for every session's turn_ended
DRAIN_LIMIT_S = 40.0  # after the sustained phase, at most this long for the backlog
QUICK_DRAIN_LIMIT_S = 15.0
SAMPLE_S = 0.5


# --- figures -----------------------------------------------------------------------


def stats_ms(values_s: list[float]) -> dict[str, float | int | None]:
    """Latency figures, in ms, of durations in seconds."""
    return figures.stats_ms([v * 1000 for v in values_s])


def cpu_per_op(cpu: dict[str, Any] | None, injects: int, turns: int) -> dict[str, float | None]:
    """CPU milliseconds the supervisor spent per inject, the workers per turn."""
    if cpu is None:
        return {"supervisor_cpu_ms_per_inject": None, "workers_cpu_ms_per_turn": None}
    procs = cpu["by_process_percent_of_one_cpu"]
    supervisor = procs["supervisor"]["cpu_s"] or 0.0
    workers = sum(v["cpu_s"] or 0.0 for k, v in procs.items() if k.startswith("worker"))
    return {
        "supervisor_cpu_ms_per_inject": round(supervisor / injects * 1000, 2) if injects else None,
        "workers_cpu_ms_per_turn": round(workers / turns * 1000, 2) if turns else None,
    }


# --- CPU of the processes ----------------------------------------------------------


def _threads_s(proc: psutil.Process) -> dict[int, float]:
    try:
        return {t.id: t.user_time + t.system_time for t in proc.threads()}
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return {}


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all CPUs; idle and iowait excluded)."""
    times = psutil.cpu_times()
    idle = times.idle + getattr(times, "iowait", 0.0)
    return float(sum(times) - idle)


def _role(proc: psutil.Process) -> str:
    try:
        cmdline = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "gone"
    if is_worker(proc):
        return "worker"
    if "resource_tracker" in cmdline:
        return "resource_tracker"
    return "other"


class CpuMeter:
    """CPU seconds of the daemon's processes, this process and the machine over a phase."""

    def __init__(self, daemon_pid: int) -> None:
        self.daemon = psutil.Process(daemon_pid)
        self.me = psutil.Process()
        self.procs: dict[str, psutil.Process] = {}
        self.start_s: dict[str, float] = {}
        self.peak: Counter[str] = Counter()
        self.samples: dict[str, list[float]] = {}
        self.threads_start: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _discover(self) -> None:
        self.procs = {"supervisor": self.daemon, "client": self.me}
        with contextlib.suppress(psutil.NoSuchProcess):
            workers = 0
            for child in self.daemon.children(recursive=True):
                role = _role(child)
                if role == "worker":
                    workers += 1
                    self.procs[f"worker_{workers}_pid_{child.pid}"] = child
                elif role != "gone":
                    self.procs[f"{role}_pid_{child.pid}"] = child

    def start(self) -> CpuMeter:
        self._discover()
        self.machine_start = _machine_busy_s()
        self.times_start = psutil.cpu_times()
        for name, proc in self.procs.items():
            self.start_s[name] = cpu_s(proc) or 0.0
            with contextlib.suppress(psutil.Error):
                proc.cpu_percent(None)
            self.samples[name] = []
        self.threads_start = _threads_s(self.daemon)
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._sample, name="bench-cpu", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            for name, proc in self.procs.items():
                try:
                    self.samples[name].append(proc.cpu_percent(None))
                except psutil.Error:
                    continue

    def stop(self) -> dict[str, Any]:
        wall = time.monotonic() - self._t0
        machine = _machine_busy_s() - self.machine_start
        times_end = psutil.cpu_times()
        all_cpus = wall * (os.cpu_count() or 1)
        breakdown = {
            name: round(
                (getattr(times_end, name) - getattr(self.times_start, name)) / all_cpus * 100, 1
            )
            for name in ("user", "system", "softirq", "irq", "iowait", "steal")
            if hasattr(times_end, name)
        }
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        by_process: dict[str, Any] = {}
        for name, proc in self.procs.items():
            end = cpu_s(proc)
            samples = self.samples.get(name, [])
            by_process[name] = {
                "cpu_s": None if end is None else round(end - self.start_s[name], 2),
                "cpu_percent": None
                if end is None
                else round((end - self.start_s[name]) / wall * 100, 1),
                "peak_sample_percent": round(max(samples), 1) if samples else None,
            }
        threads_end = _threads_s(self.daemon)
        deltas = sorted(
            (threads_end[t] - self.threads_start.get(t, 0.0) for t in threads_end), reverse=True
        )
        workers = [v["cpu_percent"] or 0.0 for k, v in by_process.items() if k.startswith("worker")]
        main_thread = threads_end.get(self.daemon.pid)
        mine = sum(v["cpu_percent"] or 0.0 for v in by_process.values())
        return {
            "wall_s": round(wall, 2),
            "by_process_percent_of_one_cpu": by_process,
            "workers_total_percent": round(sum(workers), 1),
            "supervisor_threads": len(threads_end),
            "supervisor_main_thread_cpu_percent": None
            if main_thread is None
            else round(
                (main_thread - self.threads_start.get(self.daemon.pid, 0.0)) / wall * 100, 1
            ),
            "supervisor_busiest_thread_cpu_percent": round(deltas[0] / wall * 100, 1)
            if deltas
            else None,
            "supervisor_second_thread_cpu_percent": round(deltas[1] / wall * 100, 1)
            if len(deltas) > 1
            else None,
            "machine_percent_of_all_cpus": round(machine / wall / (os.cpu_count() or 1) * 100, 1),
            "machine_time_percent_of_all_cpus": breakdown,
            # The machine's busy time that none of the measured processes used: other
            # processes, and kernel work not charged to a process (softirq, journal).
            "others_percent_of_one_cpu": round(max(0.0, machine / wall * 100 - mine), 1),
        }


# --- the client --------------------------------------------------------------------


@dataclass
class Stream:
    """One session's attach stream: every event seen, with the time it was parsed."""

    session_id: str
    events: list[tuple[int, str, float]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    error: str | None = None

    def add(self, seq: int, kind: str, at: float) -> None:
        self.events.append((seq, kind, at))
        self.changed.set()

    def first_after(self, seq: int, kind: str | None = None) -> tuple[int, str, float] | None:
        for event in self.events:  # short lists; a scan is fine
            if event[0] > seq and (kind is None or event[1] == kind):
                return event
        return None

    async def wait_for(self, seq: int, kind: str, timeout: float) -> tuple[int, str, float] | None:
        deadline = time.monotonic() + timeout
        while True:
            found = self.first_after(seq, kind)
            if found is not None:
                return found
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), left)


async def read_stream(http: aiohttp.ClientSession, base: str, stream: Stream) -> None:
    """Parse the SSE stream (`id:` seq, `event:` type) until cancelled or closed."""
    url = f"{base}/v1/sessions/{stream.session_id}/attach"
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=None)
    try:
        async with http.get(url, params={"after": "0"}, timeout=timeout) as resp:
            if resp.status != 200:
                stream.error = f"attach answered {resp.status}"
                return
            seq: int | None = None
            kind = ""
            async for raw in resp.content:
                line = raw.rstrip(b"\r\n")
                if not line:
                    if seq is not None:
                        stream.add(seq, kind, time.perf_counter())
                    seq, kind = None, ""
                elif line.startswith(b"id:"):
                    seq = int(line[3:])
                elif line.startswith(b"event:"):
                    kind = line[6:].strip().decode()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        stream.error = f"{type(exc).__name__}: {exc}"


@dataclass
class Injection:
    request_s: float  # send -> 202
    first_event_s: float | None  # send -> first event with a larger seq
    first_event_type: str | None
    model_response_s: float | None
    turn_ended_s: float | None


class IntakeBench:
    def __init__(self, daemon: Daemon, base: str, token: str, sessions: int) -> None:
        self.daemon = daemon
        self.base = base
        self.headers = {"Authorization": f"Bearer {token}"}
        self.n_sessions = sessions
        self.streams: list[Stream] = []
        self.readers: list[asyncio.Task[None]] = []
        self.http: aiohttp.ClientSession | None = None
        self.errors: Counter[str] = Counter()

    async def open(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        self.http = aiohttp.ClientSession(
            connector=connector,
            headers=self.headers,
            timeout=aiohttp.ClientTimeout(total=TURN_TIMEOUT_S),
        )
        for i in range(self.n_sessions):
            async with self.http.post(
                f"{self.base}/v1/sessions", json={"title": f"bench {i}"}
            ) as resp:
                body = await resp.json()
                if resp.status != 201:
                    raise RuntimeError(f"POST /v1/sessions answered {resp.status}: {body}")
            self.streams.append(Stream(body["id"]))
        self.readers = [
            asyncio.create_task(read_stream(self.http, self.base, s)) for s in self.streams
        ]
        # Every stream is open once it has replayed the session's first event (`created`
        # or similar) or, for an empty log, once the hub counts it.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            async with self.http.get(f"{self.base}/v1/status") as resp:
                status = await resp.json()
            if status.get("attach_streams", 0) >= self.n_sessions:
                break
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        for task in self.readers:
            task.cancel()
        await asyncio.gather(*self.readers, return_exceptions=True)
        if self.http is not None:
            await self.http.close()

    async def inject(self, session_id: str, text: str) -> tuple[int | None, float, float]:
        """(seq or None, the time just before sending, the time the answer was read)."""
        assert self.http is not None
        sent = time.perf_counter()
        try:
            async with self.http.post(
                f"{self.base}/v1/sessions/{session_id}/inject", json={"text": text}
            ) as resp:
                body = await resp.read()
                done = time.perf_counter()
                if resp.status != 202:
                    self.errors[f"inject {resp.status}"] += 1
                    return None, sent, done
                return int(json.loads(body)["seq"]), sent, done
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.errors[f"inject {type(exc).__name__}"] += 1
            return None, sent, time.perf_counter()

    # --- 1. latency -----------------------------------------------------------------

    async def one_injection(self, stream: Stream, text: str) -> Injection | None:
        seq, sent, answered = await self.inject(stream.session_id, text)
        if seq is None:
            return None
        ended = await stream.wait_for(seq, "turn_ended", TURN_TIMEOUT_S)
        if ended is None:
            self.errors["turn_ended timeout"] += 1
        first = stream.first_after(seq)
        model = stream.first_after(seq, "model_response")
        return Injection(
            request_s=answered - sent,
            first_event_s=None if first is None else first[2] - sent,
            first_event_type=None if first is None else first[1],
            model_response_s=None if model is None else model[2] - sent,
            turn_ended_s=None if ended is None else ended[2] - sent,
        )

    async def solo(self, count: int) -> dict[str, Any]:
        """One session, one injection at a time: the floor under the concurrent figures."""
        found = [await self.one_injection(self.streams[0], f"solo {n}") for n in range(count)]
        done = [i for i in found if i is not None]
        return {
            "injections": len(done),
            "inject_request_ms": stats_ms([i.request_s for i in done]),
            "first_reply_event_ms": stats_ms(
                [i.first_event_s for i in done if i.first_event_s is not None]
            ),
            "model_response_ms": stats_ms(
                [i.model_response_s for i in done if i.model_response_s is not None]
            ),
            "turn_ended_ms": stats_ms([i.turn_ended_s for i in done if i.turn_ended_s is not None]),
        }

    async def latency(self, rounds: int) -> dict[str, Any]:
        first_round: list[Injection] = []
        measured: list[Injection] = []
        round_walls: list[float] = []
        meter: CpuMeter | None = None
        for r in range(rounds + 1):
            if r == 1:
                meter = CpuMeter(self.daemon.pid).start()
            started = time.perf_counter()
            found = await asyncio.gather(
                *(self.one_injection(s, f"round {r} hello") for s in self.streams)
            )
            round_walls.append(time.perf_counter() - started)
            done = [i for i in found if i is not None]
            (first_round if r == 0 else measured).extend(done)
        cpu = meter.stop() if meter is not None else None
        return {
            "rounds": rounds,
            "injections": len(measured),
            "inject_request_ms": stats_ms([i.request_s for i in measured]),
            "first_reply_event_ms": stats_ms(
                [i.first_event_s for i in measured if i.first_event_s is not None]
            ),
            "model_response_ms": stats_ms(
                [i.model_response_s for i in measured if i.model_response_s is not None]
            ),
            "turn_ended_ms": stats_ms(
                [i.turn_ended_s for i in measured if i.turn_ended_s is not None]
            ),
            "first_reply_event_types": dict(Counter(i.first_event_type for i in measured)),
            "round_wall_ms": stats_ms(round_walls[1:]),
            "first_round": {
                "note": "the sessions' first turns (a worker is assigned each); not pooled",
                "inject_request_ms": stats_ms([i.request_s for i in first_round]),
                "first_reply_event_ms": stats_ms(
                    [i.first_event_s for i in first_round if i.first_event_s is not None]
                ),
                "model_response_ms": stats_ms(
                    [i.model_response_s for i in first_round if i.model_response_s is not None]
                ),
                "round_wall_ms": round(round_walls[0] * 1000, 1),
            },
            "cpu": cpu,
            "cpu_per_op": cpu_per_op(cpu, len(measured), len(measured)),
        }

    # --- 2. sustained ---------------------------------------------------------------

    async def sustained(self, clients: int, seconds: float, drain_limit: float) -> dict[str, Any]:
        latencies: list[float] = []
        per_client = [0] * clients
        wall_start = time.time()
        start = time.perf_counter()
        end = start + seconds
        ended_before = sum(1 for s in self.streams for e in s.events if e[1] == "turn_ended")

        async def client(i: int) -> None:
            stream = self.streams[i % len(self.streams)]
            n = 0
            while time.perf_counter() < end:
                seq, sent, answered = await self.inject(stream.session_id, f"load {i} {n}")
                n += 1
                if seq is not None:
                    latencies.append(answered - sent)
                    per_client[i] += 1

        meter = CpuMeter(self.daemon.pid).start()
        await asyncio.gather(*(client(i) for i in range(clients)))
        stopped = time.perf_counter()
        wall_end = time.time()
        cpu = meter.stop()
        elapsed = stopped - start
        ended_seen = (
            sum(1 for s in self.streams for e in s.events if e[1] == "turn_ended" and e[2] <= end)
            - ended_before
        )
        drain = await asyncio.to_thread(self._drain, drain_limit)
        db = await asyncio.to_thread(self._db_counts, wall_start, wall_end)
        accepted = len(latencies)
        return {
            "clients": clients,
            "sessions": len(self.streams),
            "seconds": round(elapsed, 2),
            "injects_accepted": accepted,
            "injects_per_s": round(accepted / elapsed, 1) if elapsed else None,
            "per_client_injects": {"min": min(per_client), "max": max(per_client)},
            "inject_request_ms": stats_ms(latencies),
            "turns_completed_during_phase": db["turns_during"],
            "turns_completed_during_phase_seen_on_streams": ended_seen,
            "turns_per_s_during_phase": round(db["turns_during"] / elapsed, 1) if elapsed else None,
            "injects_per_turn_during_phase": round(accepted / db["turns_during"], 1)
            if db["turns_during"]
            else None,
            "backlog_drain": drain,
            "database_after_drain": db["totals"],
            "cpu": cpu,
            "cpu_per_op": cpu_per_op(cpu, accepted, db["turns_during"]),
        }

    def _drain(self, limit: float) -> dict[str, Any]:
        """Wait until no session has pending input or a turn in flight (up to `limit`)."""
        started = time.monotonic()
        store = Store(self.daemon.url, migrate=False)
        try:
            at_end = len(store.sessions.with_work())
            left = at_end
            while left and time.monotonic() - started < limit:
                time.sleep(0.1)
                left = len(store.sessions.with_work())
        finally:
            store.close()
        return {
            "sessions_with_work_at_end_of_phase": at_end,
            "sessions_with_work_left": left,
            "drained": left == 0,
            "seconds": round(time.monotonic() - started, 2),
        }

    def _db_counts(self, wall_start: float, wall_end: float) -> dict[str, Any]:
        path = self.daemon.state / "turnkeeper.db"
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
        try:
            during = conn.execute(
                "SELECT COUNT(*) FROM event WHERE type = 'turn_ended' "
                "AND created_at >= ? AND created_at <= ?",
                (wall_start, wall_end),
            ).fetchone()[0]
            totals = dict(
                conn.execute(
                    "SELECT type, COUNT(*) FROM event GROUP BY type ORDER BY type"
                ).fetchall()
            )
        finally:
            conn.close()
        return {"turns_during": int(during), "totals": totals}


# --- main --------------------------------------------------------------------------


async def run(
    daemon: Daemon, base: str, token: str, args: argparse.Namespace, drain_limit: float
) -> dict[str, Any]:
    bench = IntakeBench(daemon, base, token, args.sessions)
    try:
        await bench.open()
        latency = await bench.latency(args.rounds)
        solo = await bench.solo(args.solo)
        sustained = await bench.sustained(args.clients, args.seconds, drain_limit)
        stream_errors = Counter(s.error for s in bench.streams if s.error)
    finally:
        await bench.close()
    return {
        "latency": latency,
        "latency_one_session": solo,
        "sustained": sustained,
        "errors": dict(bench.errors),
        "attach_stream_errors": dict(stream_errors),
    }


async def delay_overhead(
    root: Path, sessions: int, rounds: int, delay: float = MODEL_DELAY_S
) -> dict[str, Any]:
    """Phase 3 on its own daemon in `root`: the latency rounds with echo's `model.delay`
    set, and the overhead (inject -> `turn_ended` minus the delay)."""
    pool = shipped_pool(WORKERS, SPARE)
    port = free_port()
    daemon = Daemon(
        root,
        http={"listen": f"127.0.0.1:{port}", "max_streams_per_principal": sessions + STREAMS},
        pool=pool,
        agent={"class": AgentConfig().class_},
        model={"provider": "echo", "delay": delay},
    )
    bench: IntakeBench | None = None
    try:
        await asyncio.to_thread(daemon.start)
        token = (daemon.state / "admin.token").read_text().strip()
        bench = IntakeBench(daemon, f"http://127.0.0.1:{port}", token, sessions)
        await bench.open()
        latency = await bench.latency(rounds)
    finally:
        if bench is not None:
            await bench.close()
        await asyncio.to_thread(stop, daemon)
    ended = latency["turn_ended_ms"]
    delay_ms = delay * 1000

    def less_delay(value: float | None) -> float | None:
        return None if value is None else round(value - delay_ms, 1)

    overhead = {k: less_delay(ended[k]) for k in ("p50", "p99", "max")}
    return {
        "model_delay_s": delay,
        "sessions": sessions,
        "rounds": rounds,
        "pool": pool,
        "turn_ended_ms": ended,
        "overhead_ms": overhead,
        "first_round_model_response_ms": latency["first_round"]["model_response_ms"],
        "inject_request_ms": latency["inject_request_ms"],
        "target_overhead_p99_ms": TARGET_OVERHEAD_P99_MS,
        "meets_target": overhead["p99"] is not None and overhead["p99"] <= TARGET_OVERHEAD_P99_MS,
        "errors": dict(bench.errors) if bench is not None else {},
        "attach_stream_errors": dict(Counter(s.error for s in bench.streams if s.error))
        if bench is not None
        else {},
    }


def _filesystem(path: Path) -> str | None:
    """The type of the filesystem holding `path` (fsync costs differ: ext4, tmpfs...)."""
    resolved = str(path.resolve())
    best: tuple[int, str] | None = None
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint.rstrip("/") or "/"
        if (resolved == mount or resolved.startswith(mount.rstrip("/") + "/")) and (
            best is None or len(mount) > best[0]
        ):
            best = (len(mount), part.fstype)
    return None if best is None else best[1]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.bench_intake")
    parser.add_argument("--sessions", type=int, default=None, help="sessions (default 50)")
    parser.add_argument("--rounds", type=int, default=None, help="latency rounds (default 10)")
    parser.add_argument(
        "--solo", type=int, default=None, help="one-session sequential injections (default 30)"
    )
    parser.add_argument(
        "--seconds", type=float, default=None, help="sustained phase length (default 10)"
    )
    parser.add_argument(
        "--clients", type=int, default=None, help="sustained concurrent clients (default 50)"
    )
    parser.add_argument(
        "--delay-rounds",
        type=int,
        default=None,
        help=f"rounds with model.delay = {MODEL_DELAY_S} s (default 5; 0 skips them)",
    )
    parser.add_argument(
        "--synchronous",
        choices=("full", "normal"),
        default="full",
        help="SQLite synchronous (default full, the store's durable default)",
    )
    parser.add_argument("--quick", action="store_true", help="3 rounds, 3 s sustained")
    args = parser.parse_args(argv)
    chosen = QUICK if args.quick else DEFAULTS
    for name, value in chosen.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    drain_limit = QUICK_DRAIN_LIMIT_S if args.quick else DRAIN_LIMIT_S

    settings: dict[str, Any] = {
        "sessions": args.sessions,
        "latency_rounds": args.rounds,
        "one_session_injections": args.solo,
        "sustained_seconds": args.seconds,
        "sustained_clients": args.clients,
        "pool": shipped_pool(WORKERS, SPARE),
        "agent_class": AgentConfig().class_,
        "model": {"provider": "echo", "delay": 0.0},
        "store": "sqlite (WAL)",
        "state_dir_filesystem": _filesystem(Path(tempfile.gettempdir())),
        "client": f"aiohttp {aiohttp.__version__}, one ClientSession, no connection limit",
        "max_streams_per_principal": args.sessions + STREAMS,
        "drain_limit_s": drain_limit,
    }
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="turnkeeper-bench-") as tmp:
        port = free_port()
        daemon = Daemon(
            Path(tmp) / "intake",
            http={
                "listen": f"127.0.0.1:{port}",
                "max_streams_per_principal": args.sessions + STREAMS,
            },
            pool=dict(settings["pool"]),
            agent={"class": settings["agent_class"]},
            model={"provider": "echo", "delay": 0.0},
            store={"synchronous": args.synchronous},
        )
        stopped_in: float | None = None
        try:
            daemon.start()
            token = (daemon.state / "admin.token").read_text().strip()
            figures = asyncio.run(run(daemon, f"http://127.0.0.1:{port}", token, args, drain_limit))
        finally:
            stopped_in = stop(daemon)
        delayed = (
            asyncio.run(delay_overhead(Path(tmp) / "delayed", args.sessions, args.delay_rounds))
            if args.delay_rounds
            else None
        )

    result: dict[str, Any] = {
        "benchmark": "intake",
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "synchronous": args.synchronous.upper(),
        "settings": settings,
        **figures,
        "latency_with_model_delay": delayed,
        "daemon_stop_s": stopped_in,
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
