"""Timers through restarts: how late a timer that falls due a few seconds after a restart
is acted on, for each way of restarting (a requested restart in place, SIGTERM and a new
start, SIGKILL of the supervisor and a new start), on one real daemon.

Before each restart it arms `--each` timers of each kind, due 10 to 20 s later:

- `delivery`: a bound session's answer whose first attempt the receiver answered 503; its
  next try is due at the row's `next_at` (`delivery.backoff` = `backoff_cap` = 20 s, with
  jitter: 10 to 20 s). Lateness: the receiver's receipt of the retry minus `next_at`.
- `schedule`: a schedule of one moment (a 6-field cron expression), 15 s ahead, a second
  apart each. Lateness: its message's `created_at` minus that moment.
- `task`: a task (`sleep 600`) whose runner dies with the restart (the stop ends it; a
  SIGKILLed daemon's is ended by the next boot's sweep; before a restart in place, which
  would adopt a live runner, it is SIGKILLed). It is lost at its last heartbeat plus
  `tasks.lost_grace` (15 s). Lateness: the row's `ended_at` minus that.

The sweeps (`delivery.poll_interval`, `tasks.reconcile_interval`) are 60 s: a timer acted on
only by a sweep would be tens of seconds late. Every time is this host's clock (the
database's, on SQLite). A timer due before the new boot was ready is counted apart
(`due_before_ready`), not in the lateness.

    python -m tests.benchmarks timers [--each N]

Prints one JSON object: per way and kind, and over all, the lateness's median and max in
ms. It measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from supervisor.store import Store, TaskInfo
from tests.benchmarks.figures import wait_for
from tests.daemon import Daemon, inject
from tests.deliveries_receiver import Receiver
from tests.timers_harness import SLEEPER, WAYS, in_utc, kill_runner, restart

BACKOFF_S = 20.0
LOST_GRACE_S = 15.0
SCHEDULE_IN_S = 15.0
SWEEP_S = 60.0
TIMEOUT_S = 90.0
SECRET_ENV = "TK_BENCH_TIMERS_SECRET"


class Armed:
    """The timers of one round: each kind's, with what tells when it was acted on."""

    def __init__(self) -> None:
        self.deliveries: dict[str, float] = {}  # delivery id (the receiver's key) -> next_at
        self.schedules: dict[str, tuple[str, float]] = {}  # schedule -> (session, its time)
        self.tasks: list[str] = []


def _arm(daemon: Daemon, store: Store, hook: Receiver, each: int, way: str) -> Armed:
    armed = Armed()
    tasked = []
    for _ in range(each):  # the tasks first: their runners take longest to start
        session = store.sessions.create("admin").id
        inject(store, session, "/task sleeper {}")
        tasked.append(session)

    def running(session: str) -> TaskInfo | None:
        found = store.tasks.of_session(session)
        return found[0] if found and found[0].runner_pid and found[0].heartbeat_at else None

    tasks = [wait_for(lambda s=s: running(s), TIMEOUT_S, "a task's runner") for s in tasked]
    armed.tasks = [t.id for t in tasks]
    if way == "in place":  # a live runner would be adopted: these died just before
        for task in tasks:
            kill_runner(task)
    hook.answer = 503
    bound = []
    for _ in range(each):
        with daemon.client() as http:
            made = http.post("/v1/sessions", json={"deliver_to": "hook"})
        made.raise_for_status()
        bound.append(made.json()["id"])
        inject(store, bound[-1], "hello")
    for session in bound:
        row = wait_for(
            lambda s=session: [d for d in store.deliveries.list(session=s) if d.attempts == 1],
            TIMEOUT_S,
            "a first attempt",
        )[0]
        armed.deliveries[row.id] = row.next_at
    session = store.sessions.create("admin").id
    first = float(int(time.time() + SCHEDULE_IN_S))
    for n in range(each):
        moment = first + n
        with daemon.client() as http:
            made = http.post(
                "/v1/schedules", json={"cron": in_utc(moment), "text": "tick", "session": session}
            )
        made.raise_for_status()
        armed.schedules[made.json()["id"]] = (session, moment)
    return armed


def _acted(
    store: Store, hook: Receiver, armed: Armed
) -> dict[str, list[tuple[float, float]]] | None:
    """(due time, seconds late) of each timer, by kind, once every one was acted on; None
    before."""
    found: dict[str, list[tuple[float, float]]] = {"delivery": [], "schedule": [], "task": []}
    for key, due in armed.deliveries.items():
        retries = [r.at for r in hook.records if r.key == key][1:]
        if not retries:
            return None
        found["delivery"].append((due, retries[0] - due))
    for schedule, (session, due) in armed.schedules.items():
        events = store.events.read(session, limit=10_000)
        fired = [e for e in events if e.payload.get("schedule") == schedule]
        if not fired:
            return None
        found["schedule"].append((due, fired[0].created_at - due))
    for task_id in armed.tasks:
        row = store.tasks.get(task_id)
        if row is None or row.status != "lost" or row.ended_at is None:
            return None
        assert row.heartbeat_at is not None
        due = row.heartbeat_at + LOST_GRACE_S
        found["task"].append((due, row.ended_at - due))
    return found


def _round(daemon: Daemon, store: Store, hook: Receiver, each: int, way: str) -> dict[str, Any]:
    armed = _arm(daemon, store, hook, each, way)
    began = time.time()
    ready = restart(daemon, way, TIMEOUT_S)
    hook.answer = 200  # the retries measured are the last
    acted = wait_for(lambda: _acted(store, hook, armed), TIMEOUT_S, "every timer")
    every = [due for pairs in acted.values() for due, _ in pairs]
    kept = {kind: [late for due, late in pairs if due >= ready] for kind, pairs in acted.items()}
    return {
        "restart_to_ready_s": round(ready - began, 3),
        "first_due_after_ready_s": round(min(every) - ready, 3),
        "due_before_ready": sum(1 for due in every if due < ready),
        "late_ms": {kind: _summary(values) for kind, values in kept.items()},
        "all_ms": [round(s * 1000, 1) for values in kept.values() for s in values],
    }


def _summary(seconds: list[float]) -> dict[str, float | int | None]:
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "median": round(statistics.median(ms), 1) if ms else None,
        "max": round(max(ms), 1) if ms else None,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks timers")
    parser.add_argument("--each", type=int, default=5, help="timers of each kind per restart")
    args, _ = parser.parse_known_args(argv)
    hook = Receiver(b"bench-secret").start()
    rounds: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="tk-bench-timers-") as tmp:
            daemon = Daemon(
                Path(tmp),
                tasks={
                    "kinds": [SLEEPER],
                    "lost_grace": LOST_GRACE_S,
                    "reconcile_interval": SWEEP_S,
                },
                delivery={
                    "backoff": BACKOFF_S,
                    "backoff_cap": BACKOFF_S,
                    "poll_interval": SWEEP_S,
                    "targets": [
                        {"name": "hook", "url": hook.url, "secret_env": SECRET_ENV, "timeout": 5}
                    ],
                },
                restart={"min_interval": 0.0},
            )
            daemon.env[SECRET_ENV] = "bench-secret"
            try:
                daemon.start()
                with Store(daemon.url, migrate=False) as store:
                    for way in WAYS:
                        rounds[way] = _round(daemon, store, hook, args.each, way)
            finally:
                daemon.kill_everything()
    finally:
        hook.close()
    every = [ms for found in rounds.values() for ms in found.pop("all_ms")]
    result: dict[str, Any] = {
        "benchmark": "timers",
        "machine": {"python": platform.python_version(), "cpus": len(os.sched_getaffinity(0))},
        "each": args.each,
        "sweep_s": SWEEP_S,
        "rounds": rounds,
        "late_ms": _summary([ms / 1000 for ms in every]),
    }
    print(json.dumps(result, indent=2))
    return result
