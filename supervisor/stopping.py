"""The stop's steps of `supervisor.daemon.Daemon` (DESIGN.md section 7): each capped,
timed and logged, whatever it raises; and the watchdog pings sent while it serves."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from supervisor import drain
from supervisor.contract.config import Config, Paths
from supervisor.contract.logs import log
from supervisor.http.app import Api
from supervisor.http.metrics import Metrics
from supervisor.notify import Notifier
from supervisor.pool.pool import Pool
from supervisor.store import RestartInfo, Store

if TYPE_CHECKING:
    from supervisor.restarts.service import Restarter

STOP_REQUEST = "stop-request.json"  # written by `turnkeeper stop --drain`, read at SIGTERM
REAP_BOUND = 1.5  # beyond kill_grace: SIGKILL and reaping
READY_TIMEOUT = 60.0


class StopSteps:
    """The steps a stop unwinds, and the stop for a requested restart, as a part of the
    daemon."""

    config: Config
    api: Api | None
    notifier: Notifier
    outcome: str
    drain_budget: float
    drain_cut_at: float | None  # the loop's time a SIGTERM during a restart ends the drain
    drain_scope: asyncio.Timeout | None  # the drain's, while it runs
    step_seconds: dict[str, float]
    paths: Paths
    restart: RestartInfo | None
    cancelled: str | None
    restarter: Restarter | None
    step_failed: set[str]
    reexec: bool
    stop_started: float
    _stop: asyncio.Event

    def _stopping_now(self) -> None: ...

    async def _drain_step(self, pool: Pool) -> None:
        """The optional drain, first of the stop: turns in flight may finish (capped, and
        cut short at once by `_cut_drain`)."""
        if self.api is not None:
            self.api.stopping = True
        loop = asyncio.get_running_loop()
        budget = self.drain_budget
        if self.drain_cut_at is not None:  # a SIGTERM came before the drain began
            budget = min(budget, self.drain_cut_at - loop.time())
        if budget > 0 and self.outcome != "startup_failed":
            self.notifier.extend_timeout(budget + 30)

            async def drained() -> None:
                async with asyncio.timeout(budget) as scope:
                    self.drain_scope = scope
                    try:
                        await drain.drain(pool, budget)
                    finally:
                        self.drain_scope = None

            await self._step("drain", budget, drained)

    def _cut_drain(self, budget: float) -> None:
        """The stop's own drain `budget`, counted from now, for a drain begun or still to
        begin, if it ends sooner: a SIGTERM during a restart's drain stops on its terms. A
        drain under way is woken at once, even in a sleep or a database read."""
        loop = asyncio.get_running_loop()
        cut_at = loop.time() + budget
        self.drain_cut_at = min(cut_at, self.drain_cut_at or cut_at)
        scope = self.drain_scope
        if scope is not None and (when := scope.when()) is not None and cut_at < when:
            scope.reschedule(cut_at)

    async def _subagent_drain_step(self, pool: Pool) -> None:
        """After the listener: a subagent's turn in flight may end (capped; drain.py)."""
        cap = self.config.shutdown.subagent_drain
        if cap <= 0 or self.outcome == "startup_failed":
            return
        running = await drain.subagents_in_flight(pool)
        if running:
            await self._step(
                "subagent drain", cap + 1.0, lambda: drain.subagent_drain(pool, running, cap)
            )

    async def _close_store(self, store: Store) -> None:
        try:
            await asyncio.to_thread(store.close)
        except Exception as exc:  # a full disk: the stop goes on
            log("shutdown").error("closing the database failed: {}", exc)

    async def _end_boot(self, store: Store, boot_id: str) -> None:
        """End the boot row with its outcome, and the stop's step durations for the next
        boot's metrics."""

        def end() -> None:
            if self.outcome != "startup_failed":
                stopped: dict[str, object] = {"shutdown_steps": self.step_seconds}
                if self.restart is not None and self.cancelled is None:
                    stopped["restart"] = self.restart.id  # this boot's stop was a restart's
                store.boots.set_breaker(boot_id, stopped)
            if self.cancelled is not None and self.restarter is not None:
                self.restarter.cancelled(boot_id, self.cancelled)
            store.boots.end(boot_id, self.outcome)

        await self._step("boot row", 5.0, lambda: asyncio.to_thread(end))

    @staticmethod
    def _previous_stop(store: Store, boot_id: str, metrics: Metrics) -> None:
        """The previous boot's stop step durations, as gauges."""
        for boot in store.boots.recent(2):
            if boot.boot_id != boot_id and boot.breaker:
                for step, seconds in (boot.breaker.get("shutdown_steps") or {}).items():
                    metrics.shutdown_steps.labels(step).set(float(seconds))
                return

    async def _step(self, name: str, cap: float, work: Callable[[], Awaitable[object]]) -> None:
        """One step of the stop: capped, timed, and whatever it raises, the stop goes on."""
        started = time.monotonic()
        try:
            await asyncio.wait_for(work(), cap)
        except TimeoutError:
            self.step_failed.add(name)
            log("shutdown").error(
                "{} did not finish within its cap of {:.1f} s; moving on", name, cap
            )
        except Exception as exc:  # a full disk, a database gone: the stop goes on
            self.step_failed.add(name)
            log("shutdown").error("{} failed: {}; moving on", name, exc)
        seconds = time.monotonic() - started
        self.step_seconds[name] = seconds
        log("shutdown").info("{} done in {:.2f} s", name, seconds)

    async def _watchdog(self, pool: Pool) -> None:
        """WATCHDOG=1 from the event loop itself (a hung loop stops pinging) and STATUS=."""
        interval = self.notifier.watchdog_interval or 10.0
        while True:
            self.notifier.send(WATCHDOG=1, STATUS=self._summary(pool))
            await asyncio.sleep(interval)

    @staticmethod
    def _summary(pool: Pool) -> str:
        status = pool.status()
        ready = sum(1 for s in status["slots"] if s["ready"])
        turns = sum(s["turns"] for s in status["slots"])
        return (
            f"{ready}/{len(status['slots'])} workers ready, {len(pool.assigned)} sessions, "
            f"{turns} turns running, {status['restarts']} restarts"
        )

    def _requested_drain(self) -> float:
        """The drain budget: `turnkeeper stop --drain` leaves one in the runtime dir."""
        request = self.paths.runtime_dir / STOP_REQUEST
        try:
            budget = float(json.loads(request.read_text())["drain"])
            request.unlink()
        except FileNotFoundError:
            return self.config.shutdown.drain_budget
        except (ValueError, KeyError, TypeError, OSError) as exc:
            log("shutdown").warning("ignoring {}: {}", request, exc)
            return self.config.shutdown.drain_budget
        return max(0.0, budget)

    def _restart(self, info: RestartInfo) -> None:
        """Stop for the restart request `info` (begun in the database), then re-execute."""
        self.restart = info
        if self._stop.is_set():  # a SIGTERM came while it was being begun
            self.cancelled = "the daemon was already stopping when it was to begin"
            return
        self.reexec = True
        self.stop_started = time.monotonic()
        budget = info.drain if info.drain is not None else self.config.shutdown.drain_budget
        self.drain_budget = budget
        why = info.reason or "no reason given"
        log("shutdown").info(
            "restarting in place for {} ({}), asked by {}: {}",
            info.id,
            f"drain up to {budget:g} s" if budget > 0 else "no drain",
            info.requested_by,
            why,
        )
        self.notifier.reloading(f"restarting: {why}", budget + self._stop_bound() + READY_TIMEOUT)
        self._stopping_now()

    def comes_back(self) -> bool:
        """Whether `run` re-executes now: a restart whose stop left the hosts' table and
        ended its boot row. Else the new start, with the same pid, would take its own host
        row for a live daemon's (and exit 78), or the breaker would count it: exit 1, and
        the service manager starts a new process, which takes both over."""
        failed = sorted(self.step_failed & {"peer deregistration", "boot row"})
        if self.reexec and failed:
            log("restart").error(
                "not re-executing: {} failed; exiting 1 for the service manager to start "
                "the daemon again",
                " and ".join(failed),
            )
        return self.reexec and not failed

    def _stop_bound(self) -> float:
        """The longest the stop's steps after the drain may take, each at its cap, and the
        next start's own steps before it waits for its workers."""
        c = self.config
        listener = c.attach.shutdown_timeout + 1.0
        subagents = c.shutdown.subagent_drain + 1.0
        return listener + subagents + c.shutdown.kill_grace + REAP_BOUND + 2.0 + 5.0 + 30.0
