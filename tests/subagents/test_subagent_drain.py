"""The waits of a stop: the subagent drain (`shutdown.subagent_drain`) in-process with a
moved clock, the drain cut short by a SIGTERM during a restart's, then the daemon's stop
with a subagent's turn held in flight."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from loguru import logger

from supervisor.contract.config import Config
from supervisor.daemon import Daemon as Supervisor
from supervisor.pool import drain
from supervisor.store import Store
from tests.daemon import Daemon, daemons, inject, turn_ended, wait_until

__all__ = ["daemons"]
Daemons = Callable[..., Daemon]


def session(sid: str, kind: str = "subagent", turn: str | None = "t1") -> SimpleNamespace:
    return SimpleNamespace(id=sid, kind=kind, active_turn_id=turn)


class FakePool:
    """What the drains read of the pool: its sessions, the database's turns in flight (one
    scripted read after another; the last repeats), and its workers (one that runs a turn
    for good, never saying it drained)."""

    def __init__(self, reads: list[list[SimpleNamespace]], assigned: set[str]) -> None:
        self.reads = reads
        self.assigned = dict.fromkeys(assigned)
        busy = SimpleNamespace(alive=True, ready=True, replacing=False, draining=False, turns=1)
        self.workers = {"w0.1": busy}
        self.config = SimpleNamespace(pool=SimpleNamespace(heartbeat_interval=1.0))
        self.store = SimpleNamespace(sessions=SimpleNamespace(with_work=self._read))
        self.ownership = SimpleNamespace(stopping=False)
        self.count = 0

    def hold_assignments(self) -> None:
        self.ownership.stopping = True

    def _read(self) -> list[SimpleNamespace]:
        self.count += 1
        return self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def lines() -> Iterator[list[str]]:
    found: list[str] = []
    sink = logger.add(lambda m: found.append(str(m).rstrip()), level="DEBUG", format="{message}")
    yield found
    logger.remove(sink)


def test_only_subagents_turns_on_this_daemons_workers_count() -> None:
    pool = FakePool(
        [
            [
                session("child"),
                session("top", kind="attached"),
                session("elsewhere"),  # another daemon's worker runs it
                session("pending", turn=None),  # input waiting, no turn yet
            ]
        ],
        assigned={"child", "top", "pending"},
    )
    assert drain.subagent_turns(pool) == ["child"]  # type: ignore[arg-type]
    assert [s.id for s in drain.turns_in_flight(pool)] == ["child", "top"]  # type: ignore[arg-type]


def test_the_drain_ends_as_soon_as_no_subagent_turn_is_in_flight(lines: list[str]) -> None:
    still = [session("c1"), session("c2")]
    pool = FakePool([still, [still[1]], [still[1]], []], assigned={"c1", "c2"})
    clock = Clock()
    left = asyncio.run(
        drain.subagent_drain(pool, ["c1", "c2"], 5.0, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
    )
    assert left == []
    assert pool.ownership.stopping  # nothing new is assigned during the drain
    assert clock.slept == [0.1] * 4  # the heartbeat (1 s) is longer than POLL
    assert lines == ["subagent drain: waiting up to 5 s for 2 subagent turns in flight"]


def test_at_the_cap_the_drain_names_the_subagents_still_running(lines: list[str]) -> None:
    pool = FakePool([[session("c1"), session("c2")]], assigned={"c1", "c2"})
    pool.config.pool.heartbeat_interval = 0.04  # shorter than POLL: polled at the heartbeat
    clock = Clock()
    left = asyncio.run(
        drain.subagent_drain(pool, ["c1", "c2"], 0.1, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
    )
    assert left == ["c1", "c2"]
    assert clock.slept == pytest.approx([0.04, 0.04, 0.02])  # never past the cap
    assert lines[-1] == (
        "subagent drain: 2 subagents still running, interrupted with the rest and resumed "
        "after the restart: c1, c2"
    )


def stopping_daemon(budget: float) -> Supervisor:
    """A daemon's stop steps, not started: a stop with a drain of `budget` seconds."""
    daemon = Supervisor(Config())
    daemon.outcome, daemon.drain_budget = "clean", budget
    return daemon


def drains(pool: FakePool) -> Callable[[float], Any]:
    """What the root hands the daemon's drain step: the pool drained until a deadline."""

    async def until(deadline: float) -> None:
        left = deadline - asyncio.get_running_loop().time()
        await drain.drain(pool, left)  # type: ignore[arg-type]

    return until


def test_a_cut_ends_a_drain_under_way_at_once_even_in_a_long_pause() -> None:
    async def scenario() -> None:
        daemon = stopping_daemon(600.0)  # a restart's drain
        pool = FakePool([[session("top", kind="attached")]], assigned={"top"})
        pool.config.pool.heartbeat_interval = 300.0  # a pause the cut must not wait out
        stop = asyncio.ensure_future(daemon._drain_step(drains(pool)))
        while daemon.drain_scope is None:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # the drain under way, between two looks
        daemon._cut_drain(0.0)  # a SIGTERM, with shutdown.drain_budget = 0
        await asyncio.wait_for(stop, 10)
        assert daemon.step_failed == {"drain"} and daemon.drain_scope is None

    asyncio.run(scenario())


def test_a_cut_before_the_drain_begins_counts_from_the_signal() -> None:
    async def scenario() -> None:
        daemon = stopping_daemon(600.0)
        pool = FakePool([[session("top", kind="attached")]], assigned={"top"})
        daemon._cut_drain(0.0)
        await asyncio.wait_for(daemon._drain_step(drains(pool)), 10)
        assert "drain" not in daemon.step_seconds  # no drain at all

        later = stopping_daemon(600.0)
        later._cut_drain(0.05)
        await asyncio.sleep(0.1)  # the stop's other steps took longer than that
        await asyncio.wait_for(later._drain_step(drains(pool)), 10)
        assert "drain" not in later.step_seconds

    asyncio.run(scenario())


def test_a_failed_first_read_skips_the_drain(lines: list[str]) -> None:
    pool = FakePool([[]], assigned=set())

    def gone() -> list[Any]:
        raise RuntimeError("database is gone")

    pool.store.sessions.with_work = gone
    assert asyncio.run(drain.subagents_in_flight(pool)) == []  # type: ignore[arg-type]
    assert lines == [
        "subagent drain skipped: reading the turns failed: RuntimeError('database is gone')"
    ]


# --- the daemon's stop ---------------------------------------------------------------


def spawn_held_child(daemon: Daemon, gate: Path) -> str:
    """Before the daemon starts: a top session whose subagent's task holds its turn until
    `gate` exists."""
    with Store(daemon.url) as store:
        parent = store.sessions.create("test").id
        spawned = store.subagents.spawn(
            parent, f"/gate {gate} x", token=0, turn_id=None, max_depth=2, max_children=8
        )
        return spawned.child.id


def in_flight(daemon: Daemon, session_id: str) -> bool:
    with Store(daemon.url, migrate=False) as store:
        return store.sessions.get(session_id).active_turn_id is not None


def stop_lines(daemon: Daemon) -> list[str]:
    return [line for line in daemon.log().splitlines() if "[shutdown]" in line]


def index(lines: list[str], text: str) -> int:
    return next(n for n, line in enumerate(lines) if text in line)


@pytest.mark.timeout(120)
def test_a_stop_waits_for_a_subagents_turn_after_the_listener(
    daemons: Daemons, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    daemon = daemons(pool={"workers": 1, "spare": 0}, shutdown={"subagent_drain": 60.0})
    child = spawn_held_child(daemon, gate)
    daemon.start()
    wait_until(lambda: in_flight(daemon, child), 60, "the subagent's turn")
    daemon.signal(signal.SIGTERM)
    wait_until(
        lambda: "waiting up to 60 s for 1 subagent turns in flight" in daemon.log(),
        20,
        "the subagent drain",
    )
    # A second later it still waits: the workers run on, the turn is held in flight.
    time.sleep(1.0)
    assert daemon.proc is not None and daemon.proc.poll() is None
    assert in_flight(daemon, child) and "descendants" not in daemon.log()
    gate.touch()
    assert daemon.wait(30) == 0
    with Store(daemon.url, migrate=False) as store:  # it ended, not interrupted by the stop
        ended = turn_ended(store, child)
        assert ended is not None and ended.payload["outcome"] == "completed", daemon.log()
    lines = stop_lines(daemon)
    assert not any("still running" in line for line in lines)
    assert (
        index(lines, "http listener done")
        < index(lines, "subagent drain: waiting")
        < index(lines, "subagent drain done")
        < index(lines, "descendants done")
    ), lines


@pytest.mark.timeout(120)
def test_a_stop_waits_at_most_the_cap_and_leaves_the_subagent_running(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = daemons(pool={"workers": 1, "spare": 0}, shutdown={"subagent_drain": 1.5})
    child = spawn_held_child(daemon, tmp_path / "never")
    daemon.start()
    wait_until(lambda: in_flight(daemon, child), 60, "the subagent's turn")
    with daemon.client() as client:  # the registry's counts, read at scrape time
        scraped = client.get("/metrics").text.splitlines()
    assert 'turnkeeper_subagents{status="running"} 1.0' in scraped
    assert 'turnkeeper_subagents{status="completed"} 0.0' in scraped
    started = time.monotonic()
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(30) == 0
    took = time.monotonic() - started
    assert 1.5 <= took < 1.5 + 8, f"the stop took {took:.2f} s"
    assert (
        "subagent drain: 1 subagents still running, interrupted with the rest and resumed "
        f"after the restart: {child}"
    ) in daemon.log()
    with Store(daemon.url, migrate=False) as store:
        info = store.subagents.get(child)
        assert info is not None and info.status == "running"  # a stop cancels no child
        assert store.sessions.get(child).status == "open"


@pytest.mark.timeout(120)
def test_a_stop_without_a_subagent_turn_does_not_wait(daemons: Daemons, tmp_path: Path) -> None:
    daemon = daemons(pool={"workers": 1, "spare": 0}, shutdown={"subagent_drain": 60.0}).start()
    with Store(daemon.url, migrate=False) as store:
        top = store.sessions.create("test").id
        inject(store, top, f"/gate {tmp_path / 'never'} x")
    wait_until(lambda: in_flight(daemon, top), 60, "the top session's turn")
    started = time.monotonic()
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(30) == 0
    took = time.monotonic() - started
    assert took < 10, f"the stop took {took:.2f} s"
    assert not any("subagent drain" in line for line in stop_lines(daemon))
