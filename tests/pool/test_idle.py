"""An idle supervisor reads no process table: children are reaped on SIGCHLD from this
process's own list of children, and the pool looks at nothing while nothing is due.

- `reap_orphans` under real children, with every way of scanning the host counted;
- a real pool in this process (real workers, a real database, a fake clock for the pool):
  while its workers send heartbeats and time stands still, it runs no round at all and
  scans nothing; when time moves on, the pass time asks for runs, still with no scan; a
  child that is not a worker is reaped on SIGCHLD; a killed worker's status stays its own;
- a real daemon: a grandchild whose parent exited is adopted by the supervisor (a
  subreaper) and reaped when it exits, with no zombie left.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import supervisor.pool.pool
from supervisor.composition import workers
from supervisor.contract import control
from supervisor.contract.config import Config
from supervisor.contract.reaper import own_children, reap_orphans
from supervisor.core.slots import SlotState
from supervisor.metrics import Metrics
from supervisor.pool.ownership import FULL_PASS
from supervisor.pool.plane import Said
from supervisor.pool.recoverer import Recoverer
from supervisor.runtime.bus import Bus
from supervisor.store import Store
from tests.agents import ChaosAgent
from tests.clock import FakeClock
from tests.conftest import this_host_id
from tests.daemon import Daemon, daemons, wait_until
from workers.agent import Turn

__all__ = ["daemons"]  # the fixture

AGENT = "tests.pool.test_idle:OrphanAgent"


class OrphanAgent(ChaosAgent):
    """`/orphan DIR`: leave a grandchild behind that writes its pid to DIR/pid and exits
    once DIR/gate exists; its parent, a shell, exits at once."""

    async def run_turn(self, turn: Turn) -> str:
        users = [m.content for m in turn.messages if m.role == "user" and not m.note]
        if users and users[-1].startswith("/orphan "):
            folder = users[-1].split(maxsplit=1)[1]
            script = f"(while [ ! -e {folder}/gate ]; do sleep 0.05; done) & echo $! > {folder}/pid"
            subprocess.run(["sh", "-c", script], check=True)
        return await super().run_turn(turn)


class Scans:
    """Counts every way this process could read the host's process table."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        listdir, scandir = os.listdir, os.scandir

        def counted_listdir(path: Any = ".") -> Any:
            self._note("os.listdir", path)
            return listdir(path)

        def counted_scandir(path: Any = ".") -> Any:
            self._note("os.scandir", path)
            return scandir(path)

        monkeypatch.setattr(os, "listdir", counted_listdir)
        monkeypatch.setattr(os, "scandir", counted_scandir)
        for name in ("process_iter", "pids"):
            monkeypatch.setattr(
                psutil, name, self._counting(f"psutil.{name}", getattr(psutil, name))
            )
        children = psutil.Process.children
        monkeypatch.setattr(psutil.Process, "children", self._counting("children", children))

    def _note(self, name: str, path: Any) -> None:
        if os.fsdecode(path).rstrip("/") == "/proc":
            self.calls.append(name)

    def _counting(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return function(*args, **kwargs)

        return counted


def exited(pid: int) -> bool:
    """Whether the child `pid` has exited (a zombie, not reaped yet), without reaping it."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_reap_orphans_reaps_exited_children_but_the_kept_with_no_scan_of_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kept = subprocess.Popen(["true"])
    orphan = subprocess.Popen(["true"])
    running = subprocess.Popen(["sleep", "60"])
    try:
        wait_until(lambda: exited(kept.pid) and exited(orphan.pid), 10, "the children to exit")
        assert {kept.pid, orphan.pid, running.pid} <= set(own_children())
        scans = Scans(monkeypatch)
        assert reap_orphans([kept.pid]) == [orphan.pid]
        assert scans.calls == []
        assert not psutil.pid_exists(orphan.pid)
        assert kept.wait(5) == 0  # its status was left for its owner
        assert running.poll() is None
    finally:
        running.kill()
        running.wait()
        orphan.returncode = 0  # reaped above: Popen must not wait for it again


# --- a real pool in this process --------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(f"sqlite:///{tmp_path / 'state' / 'turnkeeper.db'}") as s:
        yield s


def pool_config() -> Config:
    return Config.model_validate(
        {
            "pool": {"workers": 2, "spare": 0, "heartbeat_interval": 0.05, "hang_timeout": 600},
            "agent": {"class": "tests.agents:ChaosAgent"},
        }
    )


async def until(predicate: Callable[[], Any], what: str, timeout: float = 60.0) -> None:
    """Wait (in real time, the event loop running) until `predicate()` is true."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


def test_an_idle_pool_runs_no_round_and_reaps_on_sigchld_with_no_scan(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = pool_config()
    clock = FakeClock()
    boot = store.boots.begin(this_host_id(), os.getpid(), "test")
    recovery = Recoverer(config, store, boot, this_host_id(), Metrics(), clock=clock)
    bus = Bus()
    plane, ownership, pool = workers(
        config, store, boot, f"ipc://{tmp_path}/control.sock", recovery, Metrics(), bus, clock=clock
    )
    rounds: list[float] = []
    passes: list[float] = []
    heartbeats: list[str] = []
    tend, dispatch = pool.tending.tend, ownership.dispatching.dispatch

    def counted_tend(now: float) -> float:
        rounds.append(now)
        return tend(now)

    async def counted_dispatch() -> bool:
        passes.append(clock.monotonic())
        return await dispatch()

    def counted(said: Said) -> None:
        if isinstance(said.message, control.Heartbeat):
            heartbeats.append(said.worker.identity)

    pool.tending.tend, ownership.dispatching.dispatch = counted_tend, counted_dispatch
    bus.subscribe(Said, counted)
    # The stop signals this pool's workers only, not whatever else this process started.
    monkeypatch.setattr(
        supervisor.pool.pool,
        "descendants",
        lambda root, groups: [psutil.Process(w.pid) for w in pool.workers.values() if w.alive],
    )

    async def main() -> None:
        for service in (plane, ownership, pool):
            await service.start()
        running = asyncio.gather(*(s.run() for s in (plane, ownership, pool)))  # their loops
        try:
            worker = next(iter(pool.current.values()))
            # The first worker starts alone; its readiness starts the rest at once, though
            # time stands still (no deadline of the pool's comes).
            await until(
                lambda: len(pool.current) == 2 and all(w.ready for w in pool.current.values()),
                "the second worker, started once the first was ready",
            )
            # Ready asked for a pass; the loop is resting once that pass has run.
            await until(
                lambda: (
                    worker.ready
                    and not ownership.wanted.is_set()
                    and not pool.tending.stirred.is_set()
                    and clock.sleepers >= 2  # the waits of tending and of dispatching
                ),
                "the worker, and the pass its readiness asked for",
            )
            scans = Scans(monkeypatch)
            before = (len(rounds), len(passes), len(heartbeats))
            await until(lambda: len(heartbeats) >= before[2] + 20, "20 more heartbeats")
            assert (len(rounds), len(passes)) == before[:2]  # no tick: nothing was due
            await clock.advance(FULL_PASS + 0.1)
            await until(lambda: len(passes) > before[1], "the pass time asks for")
            assert scans.calls == []

            child = subprocess.Popen(["true"])  # not a worker: SIGCHLD reaps it
            await until(lambda: not psutil.pid_exists(child.pid), "the child to be reaped")
            child.returncode = 0
            assert scans.calls == []

            os.kill(worker.pid, signal.SIGKILL)  # its status is `_bury`'s, not the reaper's
            await until(lambda: worker.slot.state is SlotState.BACKOFF, "the worker's burial")
            assert worker.process.exitcode == -signal.SIGKILL
            assert scans.calls == []
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await pool.stop_descendants(2.0)
            plane.close()

    asyncio.run(main())


# --- a real daemon ----------------------------------------------------------------------


def test_an_orphan_adopted_by_the_supervisor_is_reaped_when_it_exits(
    daemons: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = daemons(agent={"class": AGENT}).start()
    folder = tmp_path / "orphan"
    folder.mkdir()
    with daemon.client() as client:
        session = client.post("/v1/sessions", json={}).json()["id"]
        sent = client.post(f"/v1/sessions/{session}/inject", json={"text": f"/orphan {folder}"})
        assert sent.status_code == 202, sent.text
    pid_file = folder / "pid"
    wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), 30, "the orphan")
    orphan = psutil.Process(int(pid_file.read_text()))
    created = orphan.create_time()
    # Its parent, the shell, exited: the subreaper supervisor adopted it.
    wait_until(lambda: orphan.ppid() == daemon.pid, 30, "the supervisor to adopt the orphan")

    (folder / "gate").touch()  # it exits now; the supervisor gets a SIGCHLD

    def reaped() -> bool:
        try:
            return psutil.Process(orphan.pid).create_time() != created  # the pid was reused
        except psutil.NoSuchProcess:
            return True

    wait_until(reaped, 30, "the supervisor to reap the orphan (no zombie left)")
    said = re.compile(rf"reaped exited orphans: pid [\d, ]*\b{orphan.pid}\b")
    wait_until(lambda: said.search(daemon.log()), 10, "the supervisor's word of it")
