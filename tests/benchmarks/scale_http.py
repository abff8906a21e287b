"""Scale figures over the HTTP API: SSE replays of a long history (and an inject while
they run), replies per second and their CPU cost with 1 and 4 workers, and the latency
a user feels with a model that takes a second.

Each takes the benchmark's options and a fresh directory and returns a figure (see
`scale_support`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from tests.benchmarks import bench_intake, scale_seed
from tests.benchmarks.bench_intake import CpuMeter, IntakeBench
from tests.benchmarks.figures import stats_ms
from tests.benchmarks.scale_support import ScaleDaemon, check, cpu_s, median, ratio, with_daemon

REPLAYS = 10
TODAY_CPU_MS = {"supervisor": 4.5, "workers": 8.0}  # per reply, measured before the work


# --- 5 and 6. SSE replays ----------------------------------------------------------


async def _replay(d: ScaleDaemon, http: aiohttp.ClientSession, session_id: str, last: int) -> int:
    """Attach with `Last-Event-ID: 0` and read until event `last`; events read.

    Read in raw chunks, only counting `id:` lines, so that this client (in the process
    that also times the injects of figure 6) costs little next to the supervisor.
    """
    url = f"{d.base}/v1/sessions/{session_id}/attach"
    timeout = aiohttp.ClientTimeout(total=120, sock_read=60)
    end = f"\nid: {last}\n".encode()
    seen, tail = 0, b"\n"
    async with http.get(url, headers={"Last-Event-ID": "0"}, timeout=timeout) as resp:
        if resp.status != 200:
            raise RuntimeError(f"attach answered {resp.status}")
        async for chunk in resp.content.iter_any():
            window = tail + chunk
            seen += window.count(b"\nid: ") - tail.count(b"\nid: ")
            if end in window:
                break
            tail = window[-len(end) :]
    return seen


async def _timed_replays(
    d: ScaleDaemon, http: aiohttp.ClientSession, session_id: str, last: int, n: int
) -> tuple[float, float | None, int]:
    """(wall seconds, supervisor CPU seconds, events read) of `n` concurrent replays."""
    before = cpu_s(d.pid)
    started = time.perf_counter()
    seen = await asyncio.gather(*(_replay(d, http, session_id, last) for _ in range(n)))
    wall = time.perf_counter() - started
    after = cpu_s(d.pid)
    cpu = None if before is None or after is None else after - before
    return wall, cpu, sum(seen)


async def _inject_ms(
    d: ScaleDaemon, http: aiohttp.ClientSession, session_id: str, count: int
) -> list[float]:
    """inject -> 202, one at a time, 20 ms apart."""
    found = []
    for i in range(count):
        started = time.perf_counter()
        await d.inject(http, session_id, f"beside the replays {i}")
        found.append((time.perf_counter() - started) * 1000)
        await asyncio.sleep(0.02)
    return found


async def replay(root: Path, opts: argparse.Namespace) -> dict[str, Any]:
    """Figure 5: SSE replay of `--replay-events` events from `Last-Event-ID: 0`, CPU per
    event and 10 concurrent / 1. Figure 6: another session's inject -> 202 while 10
    replays run, against the daemon idle."""
    daemon = ScaleDaemon(root / "replay")

    async def body(d: ScaleDaemon) -> dict[str, Any]:
        async with d.client(timeout=120) as http:
            source, other, big = await d.create(http, 3)
            await d.turn(http, source, "hello")  # the turn the history is copied from
            await d.turn(http, other, "hello")  # the other session has its worker
            last = await asyncio.to_thread(
                scale_seed.history, d.db_path, source, big, opts.replay_events
            )
            await _replay(d, http, big, last)  # warm: page cache, connections
            one = [await _timed_replays(d, http, big, last, 1) for _ in range(opts.reps)]
            ten = [await _timed_replays(d, http, big, last, REPLAYS) for _ in range(opts.reps)]
            idle = await _inject_ms(d, http, other, opts.injects)
            stop = asyncio.Event()
            replays = [0]

            async def replaying() -> None:
                while not stop.is_set():
                    await _replay(d, http, big, last)
                    replays[0] += 1

            tasks = [asyncio.create_task(replaying()) for _ in range(REPLAYS)]
            await asyncio.sleep(0.2)
            client = psutil.Process()
            before = client.cpu_times()
            started = time.perf_counter()
            try:
                busy = await _inject_ms(d, http, other, opts.injects)
                after = client.cpu_times()
                client_percent = (after.user + after.system - before.user - before.system) / (
                    time.perf_counter() - started
                )
            finally:
                stop.set()
                for task in tasks:
                    task.cancel()
                with contextlib.suppress(Exception):
                    await asyncio.gather(*tasks, return_exceptions=True)

        def us_per_event(runs: list[tuple[float, float | None, int]]) -> float | None:
            # Over all repetitions together: CPU time comes in 10 ms ticks.
            cpu = [c for _, c, _ in runs if c is not None]
            seen = sum(n for _, c, n in runs if c is not None)
            return round(sum(cpu) / seen * 1e6, 1) if seen else None

        wall_one = median([w for w, _, _ in one])
        wall_ten = median([w for w, _, _ in ten])
        idle_ms, busy_ms = stats_ms(idle), stats_ms(busy)
        return {
            "events": last,
            "replay_1_wall_ms": [round(w * 1000, 1) for w, _, _ in one],
            "replay_10_wall_ms": [round(w * 1000, 1) for w, _, _ in ten],
            "supervisor_cpu_us_per_event": {
                "1": us_per_event(one),
                "10": us_per_event(ten),
                "all": us_per_event(one + ten),
            },
            "inject_202_ms": {"idle": idle_ms, "during_10_replays": busy_ms},
            "replays_during_injects": replays[0],
            "client_cpu_percent_during_injects": round(client_percent * 100, 1),
            "events_read_per_replay": sorted(
                {n for _, _, n in one} | {n // REPLAYS for _, _, n in ten}
            ),
            "checks": [
                check("5.cpu_us_per_event", us_per_event(one + ten), "<=", 30.0, " us"),
                check("5.replay_10_over_1_wall", ratio(wall_ten, wall_one), "<=", 3.0, "x"),
                check(
                    "6.inject_p50_during_over_idle",
                    ratio(busy_ms["p50"], idle_ms["p50"]),
                    "<=",
                    2.0,
                    "x",
                ),
            ],
        }

    found, start_s = await with_daemon(daemon, body)
    return found | {"daemon_start_s": start_s}


# --- 11. replies per second --------------------------------------------------------


async def _closed_loop(d: ScaleDaemon, sessions: int, seconds: float) -> dict[str, Any]:
    """Every session: inject, await its `turn_ended` on its attach stream, again."""
    bench = IntakeBench(d.daemon, d.base, d.token, sessions)
    try:
        await bench.open()
        await asyncio.gather(*(bench.one_injection(s, "warm") for s in bench.streams))
        replies = [0]
        end = time.perf_counter() + seconds

        async def loop(stream: bench_intake.Stream) -> None:
            n = 0
            while time.perf_counter() < end:
                done = await bench.one_injection(stream, f"loop {n}")
                n += 1
                if done is not None and done.turn_ended_s is not None:
                    replies[0] += 1

        meter = CpuMeter(d.pid).start()
        started = time.perf_counter()
        await asyncio.gather(*(loop(s) for s in bench.streams))
        elapsed = time.perf_counter() - started
        cpu = meter.stop()
    finally:
        await bench.close()
    procs = cpu["by_process_percent_of_one_cpu"]
    supervisor = procs["supervisor"]["cpu_s"] or 0.0
    workers = sum(v["cpu_s"] or 0.0 for k, v in procs.items() if k.startswith("worker"))
    n = replies[0]
    return {
        "replies": n,
        "seconds": round(elapsed, 2),
        "replies_per_s": round(n / elapsed, 1),
        "supervisor_cpu_ms_per_reply": round(supervisor / n * 1000, 2) if n else None,
        "workers_cpu_ms_per_reply": round(workers / n * 1000, 2) if n else None,
        "client_cpu_percent": procs["client"]["cpu_percent"],
        "machine_percent_of_all_cpus": cpu["machine_percent_of_all_cpus"],
        "errors": dict(bench.errors),
        "attach_stream_errors": dict(Counter(s.error for s in bench.streams if s.error)),
    }


async def throughput(root: Path, opts: argparse.Namespace) -> dict[str, Any]:
    """Replies/s of `--sessions` sessions in a closed loop, with 1 and with 4 workers, and
    the supervisor's and the workers' CPU per reply."""
    found: dict[str, Any] = {}
    checks = []
    for workers in (1, 4):
        daemon = ScaleDaemon(root / f"throughput-{workers}", workers=workers, spare=1)

        async def body(d: ScaleDaemon) -> dict[str, Any]:
            return await _closed_loop(d, opts.sessions, opts.seconds)

        result, start_s = await with_daemon(daemon, body)
        found[f"workers_{workers}"] = result | {"daemon_start_s": start_s}
        for who, today in TODAY_CPU_MS.items():
            value = result[f"{who}_cpu_ms_per_reply"]
            checks.append(
                check(f"workers_{workers}.{who}_cpu_ms_per_reply", value, "<=", today / 2)
            )
    one, four = found["workers_1"]["replies_per_s"], found["workers_4"]["replies_per_s"]
    return found | {
        "sessions": opts.sessions,
        "spare": 1,
        "replies_per_s_4_over_1": ratio(four, one),
        "today_cpu_ms_per_reply": TODAY_CPU_MS,
        "checks": checks,
    }


# --- 12. latency with a model that takes a second ----------------------------------


async def overhead(root: Path, opts: argparse.Namespace) -> dict[str, Any]:
    """`bench_intake.delay_overhead`: echo with `model.delay` = 1 s, `--sessions` sessions
    injected at once per round; inject -> turn_ended p99 minus the delay."""
    found = await bench_intake.delay_overhead(root / "overhead", opts.sessions, opts.delay_rounds)
    return found | {
        "checks": [check("overhead_p99_ms", found["overhead_ms"]["p99"], "<=", 50.0, " ms")]
    }
