"""The CPU a turn costs with tracing on against off (target: at most 10 % more).

Two daemons, one after the other, each `turnkeeper run` as a real process
(`tests.daemon.Daemon`) with one worker, the echo model and the shipped agent: the first
with tracing off, the second sending its spans to an OTLP/HTTP receiver in this process on
loopback (`tests.otlp_receiver`). Each runs `--turns` turns, every one a model call that
asks for the built-in `echo` tool, the tool call and a model call that answers: a root, an
agent run, two model and one tool span per turn, plus the inject request and the
assignment. Turns are injected in rounds of `--sessions` (one message per session, each
round after the previous one's turns ended). Measured: the CPU seconds (user + system,
psutil) of the supervisor and its workers over the whole run of turns, after one warm-up
round and until the spans stopped arriving (their export is counted too; the run with
tracing off idles as long); reported per turn, and the ratio on/off. The spans the
receiver got are counted, so a run whose spans did not leave is seen.

    python -m tests.benchmarks tracing [--turns N] [--sessions N]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from supervisor.store import Store
from tests.daemon import Daemon, turn_ended, wait_until
from tests.otlp_receiver import Receiver

TARGET_RATIO = 1.10
MESSAGE = '/tool echo {"text": "benchmark"}'


def cpu(daemon: Daemon) -> float:
    """CPU seconds of the supervisor and its live workers so far."""
    total = 0.0
    for proc in [psutil.Process(daemon.pid), *daemon.live_workers()]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def settled(receiver: Receiver | None) -> None:
    """Until the receiver got no span for a second: the export's CPU is counted too."""
    if receiver is None:
        return
    seen = -1
    while len(receiver.spans) != seen:
        seen = len(receiver.spans)
        time.sleep(1.0)


def run(root: Path, turns: int, sessions: int, receiver: Receiver | None) -> dict[str, Any]:
    sections: dict[str, dict[str, Any]] = {
        "pool": {"workers": 1, "spare": 0},
        "agent": {"class": "workers.agents.tool_loop:ToolLoopAgent"},
    }
    if receiver is not None:
        sections["telemetry"] = {"otlp_endpoint": receiver.endpoint}
    daemon = Daemon(root, **sections)
    # Spans leave every 0.5 s (the SDK's default is 5 s): all are sent within the run.
    daemon.env = {"OTEL_BSP_SCHEDULE_DELAY": "500"}
    try:
        daemon.start()
        store = Store(daemon.url, migrate=False)
        with daemon.client() as http:
            ids = [http.post("/v1/sessions", json={}).json()["id"] for _ in range(sessions)]

            def round_() -> None:
                marks = {s: store.sessions.get(s).last_seq for s in ids}
                for s in ids:
                    http.post(f"/v1/sessions/{s}/inject", json={"text": MESSAGE})
                for s in ids:
                    wait_until(lambda s=s: turn_ended(store, s, marks[s]), 120, "a turn")

            round_()  # warm-up: every session assigned, the worker's first turns
            settled(receiver)
            before, began = cpu(daemon), time.monotonic()
            rounds = max(1, turns // sessions)
            for _ in range(rounds):
                round_()
            took = time.monotonic() - began
            settled(receiver)  # the spans of these turns exported: their CPU counted
            if receiver is None:
                time.sleep(2.0)  # the same idle time as a run that waits for its spans
            used = cpu(daemon) - before
        store.close()
        done = rounds * sessions
        return {
            "turns": done,
            "cpu_seconds": round(used, 3),
            "cpu_ms_per_turn": round(used / done * 1000, 3),
            "wall_seconds": round(took, 2),
        }
    finally:
        daemon.kill_everything()


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="tracing")
    parser.add_argument("--turns", type=int, default=400)
    parser.add_argument("--sessions", type=int, default=20)
    args = parser.parse_args(argv)
    receiver = Receiver()
    try:
        with tempfile.TemporaryDirectory() as directory:
            off = run(Path(directory) / "off", args.turns, args.sessions, None)
            on = run(Path(directory) / "on", args.turns, args.sessions, receiver)
        time.sleep(0.2)
        spans = len(receiver.spans)
    finally:
        receiver.close()
    ratio = on["cpu_ms_per_turn"] / off["cpu_ms_per_turn"]
    figures = {
        "benchmark": "tracing",
        "off": off,
        "on": on,
        "spans_received": spans,
        "ratio_on_off": round(ratio, 3),
        "target_ratio": TARGET_RATIO,
        "within_target": ratio <= TARGET_RATIO,
    }
    print(json.dumps(figures, indent=2))
    return figures
