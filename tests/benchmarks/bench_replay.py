"""Replaying a session's log over HTTP against the real daemon: its cost, and the API meanwhile.

The daemon is `turnkeeper run` as a real process (`scale_support.ScaleDaemon`) in a fresh
state dir: SQLite with `synchronous=FULL`, the echo model with no delay, the shipped agent
class, pool timings and recovery schedule, listening on a free loopback TCP port. The
client is one aiohttp `ClientSession` in this process, authenticated with the admin token
the daemon writes (`http.max_streams_per_principal` is raised, as every replay is the
admin's). Before each timed run the benchmark waits until the daemon counts no attach
stream: a stream notices that its client left only at its next idle check.

`--concurrent` sessions (default 10) are filled with `--events` events each (default
5,000), appended through a `Store` opened by this process: a repeating turn of
`model_response` (a few hundred characters of text), `tool_call` and `tool_result`, none of
which asks for a turn. A replay is `GET /v1/sessions/{id}/attach` with `Last-Event-ID: 0`,
read until the last event arrived (counted from the raw bytes, one `data:` line per
event), then closed.

1. `one_replay`: `--runs` replays one after another. Per replay: its wall time, and the
   supervisor's CPU time (psutil, user + system, before and after) divided by the events:
   `supervisor_cpu_us_per_event`, over all the runs together (the kernel counts CPU time in
   10 ms ticks, a good part of one replay). The daemon's own idle CPU over the same wall
   time is included (its rate is reported apart, `idle_supervisor_cpu_percent`).
2. `concurrent_replays_one_session`: `--concurrent` replays of the first session at once,
   `--runs` times; the wall time from the first request to the last stream's last event.
   `ratio_to_one` = p50 concurrent wall / p50 single wall. Streams that ask for the same
   page while it waits for the reader share its read. `concurrent_replays_distinct_sessions`:
   the same with one replay of each session, where nothing is shared.
3. `inject_latency`: another session's `POST .../inject` -> 202, one request at a time, in
   `--rounds` rounds: `--injects` while nothing else runs (`idle`), then as many as fit
   while `--concurrent` replays run, one of each session (`during_replays`). Alternating
   keeps both under the same conditions of the machine. `ratio_p50` = p50 during / p50
   idle. Each inject starts an echo turn on that session, as a client's would.
4. `events_route`: the whole log read through `GET /v1/sessions/{id}/events` in pages of
   1,000, supervisor CPU per event (not a target; for comparison).

Targets: per-event supervisor CPU <= 30 us, concurrent / one <= 3, inject p50 during /
idle <= 2; each is reported with whether it was met.

    python -m tests.benchmarks replay [--events N] [--runs N] [--concurrent N]
                                      [--rounds N] [--injects N] [--quick]

Prints one JSON object. It measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from supervisor.contract.config import AgentConfig
from supervisor.store import Store
from tests.benchmarks import figures
from tests.benchmarks.scale_support import STREAMS, ScaleDaemon, with_daemon

TARGETS = {
    "supervisor_cpu_us_per_event_max": 30.0,
    "concurrent_to_one_ratio_max": 3.0,
    "inject_during_to_idle_ratio_max": 2.0,
}
DEFAULTS = {"events": 5000, "runs": 5, "concurrent": 10, "rounds": 8, "injects": 5}
QUICK = {"events": 5000, "runs": 2, "concurrent": 10, "rounds": 3, "injects": 5}
WORKERS, SPARE = 2, 1
SETTLE_TIMEOUT_S = 10.0
TEXT = ("The quick brown fox jumps over the lazy dog; " * 7).strip()
DATA_LINE = b"\ndata: "


def cpu_s(proc: psutil.Process) -> float:
    """`figures.cpu_s` of a process that outlives the measurement."""
    return figures.cpu_s(proc) or 0.0


def fill(url: str, session_id: str, count: int) -> None:
    """Append `count` events to the session: turns of model_response, tool_call, tool_result."""
    store = Store(url, migrate=False)
    try:
        futures = []
        for i in range(count):
            turn = f"{i // 3:032x}"
            kind = ("model_response", "tool_call", "tool_result")[i % 3]
            payloads: dict[str, dict[str, Any]] = {
                "model_response": {"text": f"{i}: {TEXT}", "tool_calls": []},
                "tool_call": {"name": "search", "arguments": {"query": f"fox {i}", "limit": 5}},
                "tool_result": {"name": "search", "content": f"{i} results for fox", "ok": True},
            }
            payload = payloads[kind]
            futures.append(
                store.events.submit(session_id, kind, payload, turn_id=turn, writer="cli")
            )
        for future in futures:
            future.result()
    finally:
        store.close()


class ReplayBench:
    def __init__(self, base: str, token: str, events: int) -> None:
        self.base = base
        self.token = token
        self.events = events
        self.http: aiohttp.ClientSession | None = None
        self.replayed: list[str] = []  # sessions of `events` events each
        self.other = ""

    async def open(self, url: str, sessions: int) -> None:
        self.http = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {self.token}"},
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_read=60),
        )
        self.replayed = [await self._create(f"replayed {i}") for i in range(sessions)]
        self.other = await self._create("other")
        for session_id in self.replayed:
            await asyncio.to_thread(fill, url, session_id, self.events)

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()

    async def _create(self, title: str) -> str:
        assert self.http is not None
        async with self.http.post(f"{self.base}/v1/sessions", json={"title": title}) as resp:
            body = await resp.json()
            assert resp.status == 201, body
            return str(body["id"])

    async def replay(self, index: int = 0) -> float:
        """One replay of session `index` from Last-Event-ID 0 to its last event; its wall
        time in seconds."""
        assert self.http is not None
        started = time.perf_counter()
        seen = 0
        tail = b""
        url = f"{self.base}/v1/sessions/{self.replayed[index]}/attach"
        async with self.http.get(url, headers={"Last-Event-ID": "0"}) as resp:
            assert resp.status == 200, resp.status
            async for chunk in resp.content.iter_any():
                data = tail + chunk
                seen += data.count(DATA_LINE)
                tail = data[-(len(DATA_LINE) - 1) :]
                if seen >= self.events:
                    break
        if seen < self.events:
            raise RuntimeError(f"the replay ended after {seen} of {self.events} events")
        return time.perf_counter() - started

    async def settle(self) -> None:
        """Wait until the streams of earlier replays ended (a stream notices a client that
        left within `attach.IDLE_CHECK`), so that they neither count nor cost."""
        assert self.http is not None
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline:
            async with self.http.get(f"{self.base}/v1/status") as resp:
                if (await resp.json()).get("attach_streams", 0) == 0:
                    return
            await asyncio.sleep(0.1)

    async def inject(self, n: int) -> float:
        assert self.http is not None
        sent = time.perf_counter()
        url = f"{self.base}/v1/sessions/{self.other}/inject"
        async with self.http.post(url, json={"text": f"ping {n}"}) as resp:
            await resp.read()
            assert resp.status == 202, resp.status
        return time.perf_counter() - sent

    async def events_route(self) -> int:
        assert self.http is not None
        after, total = 0, 0
        while True:
            url = f"{self.base}/v1/sessions/{self.replayed[0]}/events"
            async with self.http.get(url, params={"after": after, "limit": 1000}) as resp:
                page = (await resp.json())["events"]
            if not page:
                return total
            total += len(page)
            after = page[-1]["seq"]


async def measure(bench: ReplayBench, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    supervisor = psutil.Process(pid)
    me = psutil.Process()
    n = args.events

    # The daemon's idle CPU, then a warm-up replay (caches, connections, threads).
    before, t0 = cpu_s(supervisor), time.perf_counter()
    await asyncio.sleep(2.0)
    idle_percent = (cpu_s(supervisor) - before) / (time.perf_counter() - t0) * 100
    await bench.replay()

    # 1. One replay at a time.
    walls, per_event = [], []
    for _ in range(args.runs):
        await bench.settle()
        before = cpu_s(supervisor)
        walls.append(await bench.replay())
        per_event.append((cpu_s(supervisor) - before) / n * 1e6)
    one_wall = figures.percentile(sorted(walls), 50)
    cpu_us = statistics.fmean(per_event)  # the total over the runs: CPU time is in ticks

    # 2. Many at once: of one session, and of as many sessions.
    async def at_once(sessions: list[int]) -> dict[str, Any]:
        walls, cpu, client = [], [], []
        for _ in range(args.runs):
            await bench.settle()
            before, mine = cpu_s(supervisor), cpu_s(me)
            started = time.perf_counter()
            await asyncio.gather(*(bench.replay(i) for i in sessions))
            walls.append(time.perf_counter() - started)
            cpu.append((cpu_s(supervisor) - before) / (n * len(sessions)) * 1e6)
            client.append(cpu_s(me) - mine)
        ratio = figures.percentile(sorted(walls), 50) / one_wall
        return {
            "replays": len(sessions),
            "sessions": len(set(sessions)),
            "runs": args.runs,
            "wall_ms": figures.stats_ms([w * 1000 for w in walls]),
            "supervisor_cpu_us_per_event": round(statistics.fmean(cpu), 1),
            "client_cpu_s": round(statistics.median(client), 2),
            "ratio_to_one": round(ratio, 2),
            "target_max": TARGETS["concurrent_to_one_ratio_max"],
            "met": ratio <= TARGETS["concurrent_to_one_ratio_max"],
        }

    same = await at_once([0] * args.concurrent)
    distinct = await at_once(list(range(args.concurrent)))

    # 3. Another session's inject, idle and during the replays, in alternating rounds.
    idle: list[float] = []
    during: list[float] = []
    for r in range(args.rounds):
        await bench.settle()
        idle.extend([await bench.inject(100 * r + i) for i in range(args.injects)])
        replays = asyncio.gather(*(bench.replay(i) for i in range(args.concurrent)))
        i = 0
        while not replays.done():
            during.append(await bench.inject(10_000 * (r + 1) + i))
            i += 1
        await replays
    idle_p50 = figures.percentile(sorted(idle), 50)
    during_p50 = figures.percentile(sorted(during), 50) if during else float("nan")
    inject_ratio = during_p50 / idle_p50

    # 4. The events route, for comparison.
    await bench.settle()
    before = cpu_s(supervisor)
    read = await bench.events_route()
    route_cpu_us = (cpu_s(supervisor) - before) / max(read, 1) * 1e6

    return {
        "idle_supervisor_cpu_percent": round(idle_percent, 2),
        "one_replay": {
            "runs": args.runs,
            "wall_ms": figures.stats_ms([w * 1000 for w in walls]),
            "supervisor_cpu_us_per_event": round(cpu_us, 1),
            "supervisor_cpu_us_per_event_runs": [round(v, 1) for v in per_event],
            "target_max": TARGETS["supervisor_cpu_us_per_event_max"],
            "met": cpu_us <= TARGETS["supervisor_cpu_us_per_event_max"],
        },
        "concurrent_replays_one_session": same,
        "concurrent_replays_distinct_sessions": distinct,
        "inject_latency": {
            "idle_ms": figures.stats_ms([v * 1000 for v in idle]),
            "during_replays_ms": figures.stats_ms([v * 1000 for v in during]),
            "ratio_p50": round(inject_ratio, 2),
            "ratio_max": round(max(during) / max(idle), 2) if during else None,
            "target_max": TARGETS["inject_during_to_idle_ratio_max"],
            "met": inject_ratio <= TARGETS["inject_during_to_idle_ratio_max"],
        },
        "events_route": {"events": read, "supervisor_cpu_us_per_event": round(route_cpu_us, 1)},
    }


async def run(daemon: ScaleDaemon, args: argparse.Namespace) -> dict[str, Any]:
    """Fill the sessions on the running `daemon` and measure (`--events`, `--runs`,
    `--concurrent`, `--rounds`, `--injects` in `args`)."""
    bench = ReplayBench(daemon.base, daemon.token, args.events)
    try:
        await bench.open(daemon.url, args.concurrent)
        return await measure(bench, daemon.pid, args)
    finally:
        await bench.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.bench_replay")
    parser.add_argument("--events", type=int, default=None, help="events replayed (5000)")
    parser.add_argument("--runs", type=int, default=None, help="runs of each phase (5)")
    parser.add_argument("--concurrent", type=int, default=None, help="replays at once (10)")
    parser.add_argument("--rounds", type=int, default=None, help="inject rounds (8)")
    parser.add_argument("--injects", type=int, default=None, help="idle injects a round (5)")
    parser.add_argument("--quick", action="store_true", help="2 runs, 3 inject rounds")
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    settings = {
        "events": args.events,
        "runs": args.runs,
        "concurrent": args.concurrent,
        "inject_rounds": args.rounds,
        "idle_injects_per_round": args.injects,
        "pool": figures.shipped_pool(WORKERS, SPARE),
        "agent_class": AgentConfig().class_,
        "model": {"provider": "echo", "delay": 0.0},
        "store": "sqlite (WAL), synchronous FULL",
        "max_streams_per_principal": STREAMS,
        "client": f"aiohttp {aiohttp.__version__}, one ClientSession, no connection limit",
    }
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="turnkeeper-bench-") as tmp:
        daemon = ScaleDaemon(Path(tmp) / "replay", workers=WORKERS, spare=SPARE)
        found = asyncio.run(with_daemon(daemon, lambda d: run(d, args)))
    result: dict[str, Any] = {
        "benchmark": "replay",
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "settings": settings,
        "targets": TARGETS,
        **found,
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
