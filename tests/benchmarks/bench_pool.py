"""Adoption latency after SIGKILL of a worker: the real daemon, 10 turns in flight per kill.

For each kill, the time from `time.time()` just before `os.kill(pid, SIGKILL)` to the
`created_at` of the first event that an adopting worker writes (the first event, in any of
the victim's 10 sessions, whose lease token is larger than the one the victim wrote with;
in practice the `continuation` event). Both clocks are this host's wall clock. The daemon
is `turnkeeper run` as a real process (`tests.daemon.Daemon`): echo model, SQLite with
`synchronous=FULL`, and the shipped defaults for the agent class, the heartbeat and the
hang timeout. Two pools are measured one after the other, each in its own state dir:

- `with_spare`: `pool.workers = 2, pool.spare = 1` (the victim's sessions go to the spare);
- `without_spare`: `pool.workers = 3, pool.spare = 0` (they go to the least-loaded others).

How a victim comes to own exactly 10 sessions with turns in flight: ownership is sticky.
A worker keeps every session it was assigned (and renews their leases) for as long as it
lives, and input for an owned session only wakes its owner; the supervisor picks an owner
only for a session that has none. So each boot first gives 10 fresh sessions to each
non-spare worker, with one short turn ("warm"; least-loaded assignment spreads them 10 per
worker), and from then on the benchmark reads ownership from the session rows. A round
picks as victim a live worker that owns at least 10 sessions (waiting, if they are busy,
until 10 are idle), injects `/sleep 5 ...` into 10 of its idle sessions, waits for the
`turn_started` of each, checks from the rows that each of the 10 is still owned by the
victim and that its turn was started under the victim's current token (otherwise the round
is dropped, counted as spoiled, and redone), and kills. The adopters then own those 10
sessions, so a later round's victim is an earlier round's adopter: the victims rotate over
the slots. If no worker owns 10 sessions, 10 more fresh sessions are warmed.

After the kill the benchmark stays quiet for a moment (so that its polling of the
database does not compete for the CPUs with the adopter), then waits until all 10
sessions show an event with a larger token, then until the pool is back at full strength
(every slot's newest worker alive and ready, live workers == slots) before the next round,
so that every kill meets the same pool: in `with_spare`, the replacement of the dead
worker is the new idle spare.

Crash-loop backoff (supervisor/slots.py: 0.5 s doubling to 30 s, forgiven only after 60 s
of healthy running): 30 kills of 3 slots would soon wait 30 s per restart. The victim is
the worker whose slot was killed least often in this boot (then: idle first, then least
recently killed), and the daemon is restarted (SIGTERM, a clean stop once every turn has
ended, `turnkeeper run` again on the same state dir) after 3 kills per slot, so no
restart waits more than 2 s. Restart delays and daemon restarts count in the wall time
(reported), never in the latency.

Besides the latency from the database, the marks of the daemon log (millisecond
timestamps, same clock) are reported as milliseconds after the kill: the supervisor's
"exited with signal SIGKILL", its first "assigned to ... (adopt", the adopting worker's
first "continuing turn", and the first event's `created_at` (set by the worker just before
its commit, so the commit's own fsync is not included).

    python -m tests.benchmarks pool [--kills N] [--quick]

Prints one JSON object. It measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from supervisor.contract.config import AgentConfig
from supervisor.store import EventRecord, SessionInfo, Store
from tests.benchmarks.figures import alive, log_time, shipped_pool, stats_ms, wait_for
from tests.conftest import this_host_id
from tests.daemon import Daemon, inject

T = TypeVar("T")

CONFIGS: dict[str, dict[str, int]] = {
    "with_spare": {"workers": 2, "spare": 1},
    "without_spare": {"workers": 3, "spare": 0},
}
TARGET_P99_MS_WITH_SPARE = 250
DEFAULT_KILLS = 30
QUICK_KILLS = 5
SESSIONS_PER_KILL = 10
SLEEP_S = 5
KILLS_PER_SLOT_PER_BOOT = 3  # restart delays 0.5, 1, 2 s; then a fresh boot
SETTLE_S = 0.3  # no database polling right after the kill
POLL_S = 0.05
MAX_SPOILED = 10
MAX_WARMUPS_PER_ROUND = 5

_STARTED = re.compile(r"started worker w(\d+)\.(\d+) \(pid (\d+)")
_READY = re.compile(r"\[pool\] worker (w\d+\.\d+) is ready")
_BOOT = re.compile(r"\[daemon\] ready: boot (\w+)")
_RESTART_IN = re.compile(r"restart in ([\d.]+)s")
_STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) "


def first_log_time(log: str, pattern: str) -> float | None:
    """The earliest timestamp of a log line matching `pattern` (no groups), or None."""
    found = re.findall(_STAMP + r".*" + pattern, log, flags=re.MULTILINE)
    return min((log_time(stamp) for stamp in found), default=None)


@dataclass
class Kill:
    """One measured kill."""

    slot: int
    first_ms: float  # kill -> first adopter event's created_at
    last_ms: float  # kill -> the 10th session's first adopter event
    adopters: int  # distinct workers the 10 sessions went to
    marks_ms: dict[str, float | None]


class PoolBench:
    """One pool configuration: a daemon, its sessions, and the kills measured on it."""

    def __init__(self, root: Path, workers: int, spare: int) -> None:
        self.workers, self.spare = workers, spare
        self.slots = workers + spare
        self.daemon = Daemon(
            root,
            pool=shipped_pool(workers, spare),
            agent={"class": AgentConfig().class_},
        )
        self.store: Store | None = None
        self.sessions: list[str] = []  # this boot's sessions
        self.kills_by_slot: Counter[int] = Counter()
        self.last_kill: dict[int, float] = {}
        self.kills: list[Kill] = []
        self.boots = 0
        self.spoiled = 0
        self.rounds = 0
        self.waited = Counter[str]()  # seconds spent waiting, by what for

    # --- the daemon -----------------------------------------------------------------

    def boot(self) -> None:
        """(Re)start the daemon and give each non-spare worker 10 idle sessions."""
        started = time.monotonic()
        if self.daemon.proc is not None and self.daemon.proc.poll() is None:
            assert self.store is not None
            store = self.store
            wait_for(lambda: not store.sessions.with_work(), 60, "every turn to end")
            self.daemon.signal(signal.SIGTERM)
            self.daemon.wait(30)
        self.daemon.start()
        self.boots += 1
        if self.store is None:
            self.store = Store(self.daemon.url, migrate=False)
        self.sessions = []
        self.kills_by_slot.clear()
        self.last_kill.clear()
        boot_id = _BOOT.findall(self.run_log())[-1]
        self.owner_prefix = f"{this_host_id()}/{boot_id[:8]}/"
        self.wait_full_strength()
        self.warm(SESSIONS_PER_KILL * self.workers)
        self.waited["boots"] += time.monotonic() - started

    def close(self) -> None:
        """Stop the daemon cleanly if it runs, then SIGKILL whatever is left, by pid."""
        try:
            if self.daemon.proc is not None and self.daemon.proc.poll() is None:
                self.daemon.signal(signal.SIGTERM)
                with contextlib.suppress(Exception):
                    self.daemon.wait(30)
        finally:
            self.daemon.kill_everything()
            if self.store is not None:
                self.store.close()
                self.store = None

    def run_log(self) -> str:
        return self.daemon.log().rsplit(f"--- run {self.daemon.runs} ---", 1)[-1]

    def current_workers(self) -> dict[int, tuple[str, int]]:
        """Each slot's newest worker of this boot: (identity, pid)."""
        newest: dict[int, tuple[int, int]] = {}
        for slot, generation, pid in _STARTED.findall(self.run_log()):
            if int(generation) > newest.get(int(slot), (0, 0))[0]:
                newest[int(slot)] = (int(generation), int(pid))
        return {s: (f"w{s}.{g}", pid) for s, (g, pid) in newest.items()}

    def full_strength(self) -> bool:
        current = self.current_workers()
        ready = set(_READY.findall(self.run_log()))
        return (
            len(current) == self.slots
            and all(ident in ready and alive(pid) for ident, pid in current.values())
            and len(self.daemon.live_workers()) == self.slots
        )

    def wait_full_strength(self) -> None:
        started = time.monotonic()
        wait_for(self.full_strength, 90, "the pool to be back at full strength")
        self.waited["full_strength"] += time.monotonic() - started

    # --- sessions -------------------------------------------------------------------

    def info(self, session_id: str) -> SessionInfo:
        assert self.store is not None
        return self.store.sessions.get(session_id)

    def warm(self, count: int) -> None:
        """`count` new sessions, each with one short turn, so that each gets an owner."""
        assert self.store is not None
        store = self.store
        fresh = [store.sessions.create("bench").id for _ in range(count)]
        for session_id in fresh:
            inject(store, session_id, "warm")

        def done() -> bool:
            infos = [self.info(s) for s in fresh]
            return all(i.owner and not i.active_turn_id and not i.pending for i in infos)

        wait_for(done, 60, "the warm-up turns to end")
        self.sessions.extend(fresh)

    def owned(self) -> dict[str, tuple[list[str], list[str]]]:
        """Live-owned sessions by worker identity: (idle, busy)."""
        owned: dict[str, tuple[list[str], list[str]]] = {}
        for session_id in self.sessions:
            info = self.info(session_id)
            if not info.owner or not info.owner.startswith(self.owner_prefix):
                continue
            idle, busy = owned.setdefault(info.owner.rsplit("/", 1)[-1], ([], []))
            (busy if info.active_turn_id or info.pending else idle).append(session_id)
        return owned

    def choose_victim(self) -> tuple[int, str, int, list[str]]:
        """(slot, identity, pid, 10 idle sessions it owns)."""
        for _ in range(MAX_WARMUPS_PER_ROUND):
            owned = self.owned()
            candidates = []
            for slot, (ident, pid) in self.current_workers().items():
                idle, busy = owned.get(ident, ([], []))
                if len(idle) + len(busy) >= SESSIONS_PER_KILL:
                    rank = (
                        self.kills_by_slot[slot],
                        len(idle) < SESSIONS_PER_KILL,
                        self.last_kill.get(slot, float("-inf")),
                        slot,
                    )
                    candidates.append((rank, slot, ident, pid))
            if not candidates:
                self.warm(SESSIONS_PER_KILL)
                continue
            _, slot, ident, pid = min(candidates)
            started = time.monotonic()
            idle = wait_for(
                lambda ident=ident: (
                    i if len(i := self.owned().get(ident, ([], []))[0]) >= SESSIONS_PER_KILL else []
                ),
                60,
                f"{ident}'s sessions to be idle",
            )
            self.waited["idle_victim"] += time.monotonic() - started
            return slot, ident, pid, idle[:SESSIONS_PER_KILL]
        raise RuntimeError("no worker came to own 10 sessions")

    # --- one kill -------------------------------------------------------------------

    def round(self) -> Kill | None:
        """One kill, measured; None if the round was spoiled (and nothing was killed)."""
        assert self.store is not None
        store = self.store
        self.rounds += 1
        self.wait_full_strength()
        slot, ident, pid, sessions = self.choose_victim()
        after = {s: inject(store, s, f"/sleep {SLEEP_S} round {self.rounds}") for s in sessions}

        def started(s: str) -> EventRecord | None:
            return next(
                (e for e in store.events.read(s, after[s]) if e.type == "turn_started"), None
            )

        wait_for(lambda: all(started(s) for s in sessions), 30, "the turns to start")
        turns = {s: started(s) for s in sessions}
        infos = {s: self.info(s) for s in sessions}
        owner = self.owner_prefix + ident
        ok = alive(pid) and all(
            (t := turns[s]) is not None
            and infos[s].owner == owner
            and infos[s].active_turn_id == t.turn_id
            and t.lease_token == infos[s].lease_token
            for s in sessions
        )
        if not ok:
            self.spoiled += 1
            wait_for(lambda: not store.sessions.with_work(), 60, "a spoiled round's turns to end")
            return None
        tokens = {s: int(infos[s].lease_token) for s in sessions}
        seqs = {s: turns[s].seq for s in sessions if turns[s] is not None}

        log_before = len(self.daemon.log())
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        self.kills_by_slot[slot] += 1
        self.last_kill[slot] = time.monotonic()
        time.sleep(SETTLE_S)

        def adopted(s: str) -> EventRecord | None:
            return next(
                (e for e in store.events.read(s, seqs[s]) if (e.lease_token or 0) > tokens[s]),
                None,
            )

        firsts: dict[str, EventRecord] = {}

        def all_adopted() -> bool:
            for s in sessions:
                if s not in firsts and (event := adopted(s)) is not None:
                    firsts[s] = event
            return len(firsts) == len(sessions)

        wait_for(all_adopted, 60, "the 10 sessions to be adopted")
        first_at = min(e.created_at for e in firsts.values())
        last_at = max(e.created_at for e in firsts.values())
        log = self.daemon.log()[log_before:]  # what the daemon logged after the kill
        adopters = set()
        for s in sessions:
            for assigned, token in re.findall(
                rf"session={s} assigned to (w\d+\.\d+) \(adopt, token (\d+)\)", log
            ):
                if int(token) > tokens[s]:
                    adopters.add(assigned)
        marks = {
            "exit_logged": first_log_time(log, rf"worker {ident} \(pid {pid}\) exited with"),
            "first_adopt_assigned": first_log_time(
                log, rf"session=(?:{'|'.join(sessions)}) assigned to \S+ \(adopt, token"
            ),
            "first_continuing_turn": first_log_time(
                log,
                rf"session=(?:{'|'.join(sessions)}) continuing turn "
                rf"(?:{'|'.join(t.turn_id or '-' for t in turns.values() if t is not None)})",
            ),
            "first_event": first_at,
        }
        return Kill(
            slot=slot,
            first_ms=(first_at - killed_at) * 1000,
            last_ms=(last_at - killed_at) * 1000,
            adopters=len(adopters),
            marks_ms={k: None if v is None else (v - killed_at) * 1000 for k, v in marks.items()},
        )

    def run(self, kills: int) -> dict[str, Any]:
        started = time.monotonic()
        per_boot = KILLS_PER_SLOT_PER_BOOT * self.slots
        self.boot()
        in_boot = 0
        while len(self.kills) < kills:
            if in_boot >= per_boot:
                self.boot()
                in_boot = 0
            kill = self.round()
            if kill is None:
                if self.spoiled > MAX_SPOILED:
                    raise RuntimeError(f"{self.spoiled} spoiled rounds; see {self.daemon.log_path}")
                continue
            self.kills.append(kill)
            in_boot += 1
        self.wait_full_strength()
        wall = time.monotonic() - started
        delays = [float(d) for d in _RESTART_IN.findall(self.daemon.log())]
        return {
            "pool": {"workers": self.workers, "spare": self.spare},
            "kills": len(self.kills),
            "first_adopted_event_ms": stats_ms([k.first_ms for k in self.kills]),
            "all_10_adopted_ms": stats_ms([k.last_ms for k in self.kills]),
            "log_marks_after_kill_ms": {
                name: stats_ms([v for k in self.kills if (v := k.marks_ms[name]) is not None])
                for name in self.kills[0].marks_ms
            }
            if self.kills
            else {},
            "adopters_per_kill": dict(sorted(Counter(k.adopters for k in self.kills).items())),
            "kills_by_slot": dict(sorted(Counter(k.slot for k in self.kills).items())),
            "boots": self.boots,
            "spoiled_rounds": self.spoiled,
            "restart_delays_s": dict(sorted(Counter(delays).items())),
            "waited_s": {k: round(v, 1) for k, v in sorted(self.waited.items())},
            "wall_s": round(wall, 1),
        }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.bench_pool")
    parser.add_argument(
        "--kills",
        type=int,
        default=None,
        help=f"kills per pool configuration (default {DEFAULT_KILLS})",
    )
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_KILLS} kills")
    args = parser.parse_args(argv)
    kills = args.kills or (QUICK_KILLS if args.quick else DEFAULT_KILLS)

    started = time.monotonic()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="turnkeeper-bench-") as tmp:
        for name, pool in CONFIGS.items():
            bench = PoolBench(Path(tmp) / name, **pool)
            try:
                results[name] = bench.run(kills)
            finally:
                bench.close()

    p99 = results["with_spare"]["first_adopted_event_ms"]["p99"]
    result: dict[str, Any] = {
        "benchmark": "pool",
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "kills": kills,
        "sessions_per_kill": SESSIONS_PER_KILL,
        "turn": f"/sleep {SLEEP_S}",
        "kills_per_slot_per_boot": KILLS_PER_SLOT_PER_BOOT,
        "target_p99_ms_with_spare": TARGET_P99_MS_WITH_SPARE,
        "meets_target": p99 is not None and p99 <= TARGET_P99_MS_WITH_SPARE,
        **results,
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
