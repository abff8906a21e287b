"""A session of `--turns` turns (default 1,000) on a finite context window, in process.

Each turn runs the worker's own code: `turns.start_turn` reads the session's `SessionLog`
(grown by the events the turn before committed, and rebased at every compaction), the
shipped tool-loop agent calls the `echo` model through `TurnContext` (compaction first,
when the prompt would not fit), and the events are committed to an in-memory log. The
echo model is a server with a `--window`-token window (2,048): a prompt past it fails.
The user messages alternate a sentence and `/big 60`, so the history grows by about 100
tokens a turn.

Figures: the prompt's tokens per turn (echo's count) at its largest, against the window;
the compactions; and the cost of building the history at a turn's start (the read of the
log and its messages), p50 over the first and over the last `--window-turns` (100) turns,
with their ratio: warm (the worker's cached log grown by the new events) and cold (a
worker that reads the session anew, after an eviction or a restart: from the newest
compaction on). The baseline is the same session with no window (`context_window = 0`,
nothing compacted), measured in the same run: its prompt and its history's cost grow
with the session.

    python -m tests.benchmarks context [--turns N] [--window N] [--quick]

Prints one JSON object. It measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from loguru import logger

from supervisor.contract.sections import COMPACTION_PROMPT
from supervisor.store import EventRecord
from workers import turns
from workers.agents.tool_loop import ToolLoopAgent
from workers.budget import Budget
from workers.cache import SessionLog
from workers.context import Compactor, Settings, Window
from workers.models import EchoModel, Message
from workers.tools import BuiltinTools

MAX_TOKENS, MARGIN = 128, 64


async def session(turns_wanted: int, window: int) -> dict[str, Any]:
    """Run the session; its figures."""
    model = EchoModel(max_tokens=MAX_TOKENS, window=window)
    events: list[EventRecord] = []
    log = SessionLog()
    settings = Settings(MAX_TOKENS, MARGIN, COMPACTION_PROMPT)
    size = Window(window)
    prompts: list[int] = []
    builds: list[float] = []
    colds: list[float] = []

    async def commit(type: str, payload: dict[str, Any], turn: str | None) -> int:
        seq = len(events) + 1
        events.append(EventRecord("s", seq, type, turn, payload, time.time(), "worker"))
        if type == "model_response":
            prompts.append(int(payload["usage"]["prompt_tokens"]))
        return seq

    async def keyed(type: str, payload: dict[str, Any], turn: str | None, key: str | None) -> int:
        return await commit(type, payload, turn)

    async def read() -> SessionLog:
        started = time.perf_counter()
        assert log.add(events[log.last_seq :])  # seq N is events[N - 1]
        builds.append(time.perf_counter() - started)
        return log

    for index in range(turns_wanted):
        text = "/big 60" if index % 2 else f"message {index}: tell me about the weather today"
        await commit("user_message", {"text": text}, None)

        async def run(turn_id: str, messages: list[Message]) -> str:
            started = time.perf_counter()
            snapshot = list(log)
            builds[-1] += time.perf_counter() - started

            def compactor(turn: turns.TurnContext) -> Compactor:
                return Compactor(
                    events=snapshot, base=int(log.summary is not None), window=size,
                    settings=settings, ask=turn.ask, commit=keyed, turn_id=turn_id,
                    ratio=log.ratio, session_tokens=log.session_tokens,
                )  # fmt: skip

            context = turns.TurnContext(
                "s", turn_id, messages, model, BuiltinTools(), commit, asyncio.Event(),
                compactor=compactor, budget=Budget(max_tokens=MAX_TOKENS),
            )  # fmt: skip
            return await turns.run_agent(ToolLoopAgent(), context, commit)

        async def timed_read() -> SessionLog:
            found = await read()
            started = time.perf_counter()
            found.messages()  # what start_turn builds, timed as part of the history's cost
            builds[-1] += time.perf_counter() - started
            return found

        _, outcome = await turns.start_turn(commit, timed_read, run)
        if outcome != "completed":
            raise SystemExit(f"turn {index} ended {outcome}")
        colds.append(cold(events))
    compactions = sum(1 for e in events if e.type == "compaction")
    return {
        "turns": turns_wanted,
        "events": len(events),
        "events_held_by_the_worker_at_the_end": len(log),
        "compactions": compactions,
        "prompt_tokens_max": max(prompts),
        "prompt_tokens_last": prompts[-1],
        "builds": builds,
        "colds": colds,
    }


def cold(events: list[EventRecord]) -> float:
    """Seconds to build the history as a worker that reads the session anew does: the
    events from the newest compaction on (what `SessionRunner._read_whole` reads), then
    their messages."""
    started = time.perf_counter()
    newest = next((e for e in reversed(events) if e.type == "compaction"), None)
    after = 0 if newest is None else int(newest.payload["to_seq"])
    SessionLog(events[after:]).messages()
    return time.perf_counter() - started


def _p50_us(values: list[float]) -> float:
    return round(statistics.median(values) * 1e6, 1)


def figures(found: dict[str, Any], edge: int, window: int) -> dict[str, Any]:
    builds, colds = found.pop("builds"), found.pop("colds")
    first, last = _p50_us(builds[:edge]), _p50_us(builds[-edge:])
    cold_first, cold_last = _p50_us(colds[:edge]), _p50_us(colds[-edge:])
    return {
        **found,
        "cold_history_build_p50_us_first": cold_first,
        "cold_history_build_p50_us_last": cold_last,
        "cold_history_build_ratio_last_to_first": round(cold_last / cold_first, 2),
        "window": window or None,
        "prompt_fits_the_window": bool(window) and found["prompt_tokens_max"] <= window,
        "history_build_p50_us_first": first,
        "history_build_p50_us_last": last,
        "history_build_ratio_last_to_first": round(last / first, 2) if first else None,
    }


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks context")
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--window-turns", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="200 turns")
    args = parser.parse_args(argv)
    logger.remove()  # the workers' compaction lines are not the figures
    count = 200 if args.quick else args.turns
    edge = min(args.window_turns, count // 4)
    compacted = figures(asyncio.run(session(count, args.window)), edge, args.window)
    baseline = figures(asyncio.run(session(count, 0)), edge, 0)
    result = {
        "benchmark": "context",
        "compacted": compacted,
        "baseline_no_window": baseline,
        "targets": {
            "prompt_under_the_window": compacted["prompt_fits_the_window"],
            "history_build_flat_within_1.2x": (compacted["history_build_ratio_last_to_first"] or 0)
            <= 1.2,
            "cold_history_build_bounded": compacted["events_held_by_the_worker_at_the_end"]
            < compacted["events"] / 4,
        },
    }
    print(json.dumps(result, indent=2))
    return result
