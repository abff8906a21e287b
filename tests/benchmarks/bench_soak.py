"""A soak: `--sessions` sessions (20) in a steady closed loop for `--minutes` (20) against
the real daemon, the `echo` model with a 0.2 s delay and a `--window`-token context
window (4,096), the shipped pool.

Each session sends a message, waits for its turn's end, and sends the next (a sentence
and `/big 60` in turn, so each turn adds about 100 tokens to the history). Every 30 s the
benchmark records the replies, their latencies (request to `turn_ended`), the workers'
CPU time (psutil, user + system, summed over the worker processes) and each worker's RSS.

Figures: replies per second, p50 latency and worker CPU per reply over the first and the
last 5 minutes, and the ratio last / first of each (the target: at most 1.2); worker RSS
at the start, the end and its largest; the compactions made. The baseline is the soak's
own first 5 minutes: the question is whether it stays flat.

    python -m tests.benchmarks soak [--minutes N] [--sessions N] [--window N]

Prints one JSON object (and a line per 30 s on stderr). It measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from tests.benchmarks.scale_support import ScaleDaemon, with_daemon

BUCKET_S = 30.0
EDGE_S = 300.0  # the first and last 5 minutes


def worker_usage(pids: dict[str, int]) -> tuple[float, list[int]]:
    """(CPU seconds of the workers, user + system; each worker's RSS in bytes)."""
    cpu, rss = 0.0, []
    for pid in pids.values():
        try:
            proc = psutil.Process(pid)
            times = proc.cpu_times()
            cpu += times.user + times.system
            rss.append(proc.memory_info().rss)
        except psutil.Error:
            continue
    return cpu, rss


async def soak(daemon: ScaleDaemon, opts: argparse.Namespace) -> dict[str, Any]:
    deadline = time.monotonic() + opts.minutes * 60
    buckets: list[dict[str, Any]] = []
    current: dict[str, Any] = {"replies": 0, "latencies": []}
    async with daemon.client(timeout=120) as http:
        sessions = await daemon.create(http, opts.sessions)

        async def loop(session_id: str) -> None:
            index = 0
            while time.monotonic() < deadline:
                text = "/big 60" if index % 2 else f"message {index}: tell me about the weather"
                took = await daemon.turn(http, session_id, text, timeout=120)
                if took["turn_ended_s"] is not None:
                    current["replies"] += 1
                    current["latencies"].append(took["turn_ended_s"])
                index += 1

        async def sample() -> None:
            nonlocal current
            started = time.monotonic()
            cpu, _ = worker_usage(daemon.worker_pids())
            for _ in range(int(opts.minutes * 60 // BUCKET_S)):  # whole buckets only
                await asyncio.sleep(BUCKET_S - (time.monotonic() - started) % BUCKET_S)
                now_cpu, now_rss = worker_usage(daemon.worker_pids())
                done, current = current, {"replies": 0, "latencies": []}
                bucket = {
                    "t_s": round(time.monotonic() - started),
                    "replies": done["replies"],
                    "replies_per_s": round(done["replies"] / BUCKET_S, 2),
                    "p50_ms": round(statistics.median(done["latencies"]) * 1000, 1)
                    if done["latencies"]
                    else None,
                    "worker_cpu_s": round(max(now_cpu - cpu, 0.0), 2),
                    "worker_rss_mb": [round(r / 2**20, 1) for r in now_rss],
                }
                cpu = now_cpu
                buckets.append(bucket)
                print(json.dumps(bucket), file=sys.stderr, flush=True)

        await asyncio.gather(sample(), *(loop(s) for s in sessions))
        compactions = daemon.sql("SELECT COUNT(*) FROM event WHERE type = 'compaction'")[0][0]
        events = daemon.sql("SELECT COUNT(*) FROM event")[0][0]
    edge = max(1, int(EDGE_S / BUCKET_S))
    first, last = buckets[:edge], buckets[-edge:]
    return {
        "first_5min": summary(first),
        "last_5min": summary(last),
        "ratios_last_to_first": {
            key: ratio(summary(last)[key], summary(first)[key])
            for key in ("replies_per_s", "p50_ms", "worker_cpu_ms_per_reply")
        },
        "worker_rss_mb": {
            "start": buckets[0]["worker_rss_mb"],
            "end": buckets[-1]["worker_rss_mb"],
            "max": max(max(b["worker_rss_mb"] or [0]) for b in buckets),
        },
        "compactions": compactions,
        "events": events,
        "buckets": buckets,
    }


def summary(buckets: list[dict[str, Any]]) -> dict[str, Any]:
    replies = sum(b["replies"] for b in buckets)
    cpu = sum(b["worker_cpu_s"] for b in buckets)
    p50s = [b["p50_ms"] for b in buckets if b["p50_ms"] is not None]
    return {
        "replies_per_s": round(replies / (BUCKET_S * len(buckets)), 2),
        "p50_ms": round(statistics.median(p50s), 1) if p50s else None,
        "worker_cpu_ms_per_reply": round(cpu * 1000 / replies, 2) if replies else None,
    }


def ratio(last: float | None, first: float | None) -> float | None:
    return round(last / first, 3) if last is not None and first else None


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks soak")
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--window", type=int, default=4096)
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="turnkeeper-soak-") as root:
        daemon = ScaleDaemon(
            Path(root),
            delay=0.2,
            model={"context_window": opts.window, "max_tokens": 256},
        )
        found = asyncio.run(with_daemon(daemon, lambda d: soak(d, opts)))
    ratios = found["ratios_last_to_first"]
    result = {
        "benchmark": "soak",
        "minutes": opts.minutes,
        "sessions": opts.sessions,
        "window": opts.window,
        **found,
        "targets": {
            "replies_per_s_within_1.2x": ratios["replies_per_s"] is not None
            and ratios["replies_per_s"] >= 1 / 1.2,
            "p50_within_1.2x": ratios["p50_ms"] is not None and ratios["p50_ms"] <= 1.2,
            "worker_cpu_per_reply_within_1.2x": ratios["worker_cpu_ms_per_reply"] is not None
            and ratios["worker_cpu_ms_per_reply"] <= 1.2,
        },
    }
    print(json.dumps(result, indent=2))
    return result
