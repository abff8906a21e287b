"""Scale figures over the HTTP API: SSE replays of a long history (and an inject while
they run), replies per second and their CPU cost with 1 and 4 workers, and the latency
a user feels with a model that takes a second.

Each takes the benchmark's options and a fresh directory and returns a figure (see
`scale_support`).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tests.benchmarks import bench_intake, bench_replay
from tests.benchmarks.bench_intake import CpuMeter, IntakeBench
from tests.benchmarks.scale_support import ScaleDaemon, check, ratio, with_daemon

REPLAYS = 10
TODAY_CPU_MS = {"supervisor": 4.5, "workers": 8.0}  # per reply, measured before the work


# --- 5 and 6. SSE replays ----------------------------------------------------------


async def replay(root: Path, opts: argparse.Namespace) -> dict[str, Any]:
    """`bench_replay` on a daemon of its own: figure 5, SSE replay of `--replay-events`
    events from `Last-Event-ID: 0`, CPU per event and 10 concurrent / 1; figure 6, another
    session's inject -> 202 while 10 replays run, against the daemon idle. `--reps` runs
    and inject rounds, `--injects` idle injects in all."""
    args = argparse.Namespace(
        events=opts.replay_events,
        runs=opts.reps,
        concurrent=REPLAYS,
        rounds=opts.reps,
        injects=max(1, opts.injects // opts.reps),
    )
    found = await with_daemon(ScaleDaemon(root / "replay"), lambda d: bench_replay.run(d, args))
    targets = bench_replay.TARGETS
    return found | {
        "checks": [
            check(
                "5.cpu_us_per_event",
                found["one_replay"]["supervisor_cpu_us_per_event"],
                "<=",
                targets["supervisor_cpu_us_per_event_max"],
                " us",
            ),
            check(
                "5.replay_10_over_1_wall",
                found["concurrent_replays_one_session"]["ratio_to_one"],
                "<=",
                targets["concurrent_to_one_ratio_max"],
                "x",
            ),
            check(
                "6.inject_p50_during_over_idle",
                found["inject_latency"]["ratio_p50"],
                "<=",
                targets["inject_during_to_idle_ratio_max"],
                "x",
            ),
        ]
    }


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

        result = found[f"workers_{workers}"] = await with_daemon(daemon, body)
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
        "checks": [
            check(
                "overhead_p99_ms",
                found["overhead_ms"]["p99"],
                "<=",
                bench_intake.TARGET_OVERHEAD_P99_MS,
                " ms",
            )
        ]
    }
