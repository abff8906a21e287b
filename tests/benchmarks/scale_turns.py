"""Scale figures about turns: a long history, a worker killed with many turns in flight,
a new session behind a backlog of interrupted ones, many sessions arriving at once.

Each takes the benchmark's options and a fresh directory and returns a figure (see
`scale_support`); each starts its own daemons and stops them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from tests.benchmarks import scale_seed
from tests.benchmarks.figures import cpu_s, stats_ms
from tests.benchmarks.scale_support import (
    GATE_AGENT,
    ScaleDaemon,
    check,
    log_marks,
    median,
    ms,
    poll,
    ratio,
    with_daemon,
)

SETTLE_S = 3.0  # after ready, before a figure measures: the boot scan has run


def _ms_list(values: Sequence[float | None]) -> dict[str, Any]:
    return stats_ms([v * 1000 for v in values if v is not None])


# --- 1. a long history -------------------------------------------------------------


async def history(root: Path, opts: argparse.Namespace) -> dict[str, Any]:
    """inject -> turn_ended in a session of `--events` events vs sessions of ~10."""
    daemon = ScaleDaemon(root / "history", workers=1, spare=1)  # every session on one worker

    async def body(d: ScaleDaemon) -> dict[str, Any]:
        async with d.client() as http:
            # A fresh small session per measured turn, so each has ~10 events when measured.
            small = await d.create(http, opts.turns)
            big = (await d.create(http, 1))[0]
            for r in range(2):
                await asyncio.gather(*(d.turn(http, s, f"warm {r}") for s in small))
            seeded = await asyncio.to_thread(
                scale_seed.history, d.db_path, small[0], big, opts.events
            )
            small_events = d.sql("SELECT last_seq FROM session WHERE id = ?", (small[1],))[0][0]
            first = await d.turn(http, big, "first")  # assignment and the first history read
            owners = d.owners([big, *small])
            pids = d.worker_pids()
            turns: dict[str, list[float | None]] = {"big": [], "small": []}
            cpu: dict[str, float] = {"big": 0.0, "small": 0.0}
            for n in range(opts.turns):
                order = [("big", big), ("small", small[n])]
                for kind, sid in order if n % 2 else order[::-1]:
                    pid = pids.get(owners.get(sid) or "")
                    before = cpu_s(pid) if pid else None
                    figures = await d.turn(http, sid, f"turn {n}")
                    after = cpu_s(pid) if pid else None
                    turns[kind].append(figures["turn_ended_s"])
                    if before is not None and after is not None:
                        cpu[kind] += after - before
        big_ms, small_ms = _ms_list(turns["big"]), _ms_list(turns["small"])
        cpu_ms = {k: round(v / opts.turns * 1000, 2) for k, v in cpu.items()}
        return {
            "events_in_big_session": seeded,
            "events_in_small_sessions": small_events,
            "turns_each": opts.turns,
            "turn_ended_ms": {"big": big_ms, "small": small_ms},
            "big_first_turn_ms": ms(first["turn_ended_s"]),
            "worker_cpu_ms_per_turn": cpu_ms,
            "worker_cpu_ratio": ratio(cpu_ms["big"], cpu_ms["small"]),
            "note": "worker CPU of the owner, psutil, 10 ms ticks: summed over the turns",
            "checks": [
                check("latency_ratio", ratio(big_ms["p50"], small_ms["p50"]), "<=", 1.3, "x"),
            ],
        }

    return await with_daemon(daemon, body)


# --- 2. a worker killed with k turns in flight -------------------------------------


async def kill(root: Path, opts: argparse.Namespace) -> dict[str, Any]:
    """All k sessions of a SIGKILLed worker continued: k = `--kill-sessions` vs k = 1."""
    daemon = ScaleDaemon(root / "kill", workers=1, spare=1, agent=GATE_AGENT)
    counts = (1, opts.kill_sessions)

    async def body(d: ScaleDaemon) -> dict[str, Any]:
        rounds: dict[int, list[dict[str, Any]]] = {k: [] for k in counts}
        async with d.client() as http:
            for rep in range(opts.reps):
                for k in counts if rep % 2 == 0 else counts[::-1]:
                    rounds[k].append(await _kill_round(d, http, root / f"gate-{rep}-{k}", k))
        last = {
            k: median([r["all_continued_s"] for r in rs if r.get("all_continued_s")])
            for k, rs in rounds.items()
        }
        one, many = last[counts[0]], last[counts[1]]
        return {
            "sessions": list(counts),
            "all_continued_ms": {str(k): ms(v) for k, v in last.items()},
            "rounds": {str(k): rs for k, rs in rounds.items()},
            "checks": [check(f"k{counts[1]}_over_k1", ratio(many, one), "<=", 3.0, "x")],
        }

    return await with_daemon(daemon, body)


async def _kill_round(
    d: ScaleDaemon, http: aiohttp.ClientSession, gate: Path, k: int
) -> dict[str, Any]:
    """k sessions held mid-turn at a gate on one worker; SIGKILL it; wait until each of
    them has a `continuation` (or `turn_ended`) written after the kill."""
    await poll(d.full_strength, 90, 0.2)
    sids = await d.create(http, k)
    marks = ",".join("?" * k)
    await asyncio.gather(*(d.inject(http, s, f"/gate {gate} k={k}") for s in sids))
    in_flight = f"SELECT COUNT(*) FROM session WHERE id IN ({marks}) AND active_turn_id IS NOT NULL"
    started = await poll(lambda: d.sql(in_flight, tuple(sids))[0][0] == k, 60, 0.05)
    owners = set(d.owners(sids).values())
    pid = d.worker_pids().get(next(iter(owners)) or "") if len(owners) == 1 else None
    result: dict[str, Any] = {"k": k}
    if not started or pid is None:
        result["error"] = f"turns started: {bool(started)}; owners: {sorted(map(str, owners))}"
    else:
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(0.2)  # no database polling right after the kill
        query = (
            f"SELECT session_id, MIN(created_at) FROM event WHERE session_id IN ({marks}) "
            "AND type IN ('continuation', 'turn_ended') AND created_at >= ? GROUP BY session_id"
        )
        done = await poll(
            lambda: rows if len(rows := d.sql(query, (*sids, killed_at))) == k else None,
            120,
            0.1,
        )
        if done is None:
            result["error"] = "not every session was continued within 120 s"
        else:
            times = [t for _, t in done]
            result["first_continued_s"] = round(min(times) - killed_at, 4)
            result["all_continued_s"] = round(max(times) - killed_at, 4)
    gate.touch()
    idle = f"SELECT COUNT(*) FROM session WHERE id IN ({marks}) AND active_turn_id IS NULL"
    await poll(lambda: d.sql(idle, tuple(sids))[0][0] == k, 120, 0.1)
    await d.close_sessions(http, sids)
    return result


# --- 3. a new session behind a backlog ---------------------------------------------


async def backlog(root: Path, opts: argparse.Namespace) -> dict[str, Any]:
    """A new session's first reply with `--backlog` interrupted sessions waiting vs none."""
    found: dict[str, Any] = {}
    for name, waiting in (("none_waiting", 0), ("waiting", opts.backlog)):
        daemon = ScaleDaemon(root / name)
        seeded: dict[str, Any] = {}
        if waiting:
            seeded = await asyncio.to_thread(
                scale_seed.seed, daemon.db_path, daemon.url, 1, waiting
            )
            seeded.pop("interrupted_ids")

        async def body(d: ScaleDaemon) -> dict[str, Any]:
            await asyncio.sleep(SETTLE_S)
            with_work = (
                "SELECT COUNT(*) FROM session WHERE status = 'open' "
                "AND (pending OR active_turn_id IS NOT NULL)"
            )
            before = d.sql(with_work)[0][0]
            replies: list[float] = []
            errors: list[str] = []
            async with d.client(timeout=opts.backlog_timeout) as http:
                # Not measured: the daemon's first session warms what any first one does.
                warm = (await d.create(http, 1))[0]
                await d.turn(http, warm, "warm", timeout=opts.backlog_timeout)
                for _ in range(opts.first_replies):
                    try:
                        sid = (await d.create(http, 1))[0]
                        turn = await d.turn(http, sid, "hello", timeout=opts.backlog_timeout)
                    except (aiohttp.ClientError, TimeoutError, RuntimeError) as exc:
                        errors.append(f"{type(exc).__name__}: {exc}")
                        break
                    if turn["reply_s"] is None:
                        errors.append(f"no reply within {opts.backlog_timeout} s")
                        break
                    replies.append(turn["reply_s"])
            return {
                "sessions_with_work": before,
                "first_reply_ms": _ms_list(replies),
                "median_s": median(replies) if not errors else None,
                "errors": errors,
            }

        found[name] = await with_daemon(daemon, body) | seeded
    value = ratio(found["waiting"]["median_s"], found["none_waiting"]["median_s"])
    return found | {"checks": [check("waiting_over_none", value, "<=", 2.0, "x")]}


# --- 7. many sessions arriving at once ---------------------------------------------


async def arrivals(root: Path, opts: argparse.Namespace) -> dict[str, Any]:
    """`--arrivals` sessions created and sent a first message at once: the spread of
    their assignments (daemon log, "assigned to"), first to last."""
    daemon = ScaleDaemon(root / "arrivals")

    async def body(d: ScaleDaemon) -> dict[str, Any]:
        rounds = []
        async with d.client() as http:
            for rep in range(opts.reps):
                rounds.append(await _arrival_round(d, http, opts.arrivals, rep))
                spread = rounds[-1].get("assigned_spread_s")
                if spread is None or spread > 5.0:
                    break  # slow today: one round says enough
        spreads = [r["assigned_spread_s"] for r in rounds if r.get("assigned_spread_s") is not None]
        value = median(spreads) if len(spreads) == len(rounds) else None
        return {
            "sessions": opts.arrivals,
            "rounds": rounds,
            "checks": [check("first_to_last_assigned_s", value, "<=", 1.0, " s")],
        }

    return await with_daemon(daemon, body)


async def _arrival_round(
    d: ScaleDaemon, http: aiohttp.ClientSession, n: int, rep: int
) -> dict[str, Any]:
    log_before = len(d.run_log())
    sent = time.time()

    async def one(i: int) -> str:
        sid = (await d.create(http, 1))[0]
        await d.inject(http, sid, f"arrival {rep} {i}")
        return sid

    sids = await asyncio.gather(*(one(i) for i in range(n)))
    posted = time.time()
    marks = ",".join("?" * n)
    ended = (
        f"SELECT COUNT(DISTINCT session_id) FROM event WHERE session_id IN ({marks}) "
        "AND type = 'turn_ended'"
    )
    done = await poll(lambda: d.sql(ended, tuple(sids))[0][0] == n, 120, 0.1)
    wanted = set(sids)
    assigned = {
        m.group(1): at
        for at, m in log_marks(d.run_log()[log_before:], r"session=(\w+) assigned to ")
        if m.group(1) in wanted
    }
    started = d.sql(
        f"SELECT MIN(created_at), MAX(created_at) FROM event WHERE session_id IN ({marks}) "
        "AND type = 'turn_started'",
        tuple(sids),
    )[0]
    result: dict[str, Any] = {
        "requests_s": round(posted - sent, 2),
        "all_replied": bool(done),
        "assigned_sessions": len(assigned),
    }
    if len(assigned) == n:
        result["assigned_spread_s"] = round(max(assigned.values()) - min(assigned.values()), 3)
        result["first_assigned_after_first_request_s"] = round(min(assigned.values()) - sent, 3)
    if started[0] is not None:
        result["turn_started_spread_s"] = round(started[1] - started[0], 3)
    return result
