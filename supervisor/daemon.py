"""`turnkeeper run`: the supervisor process.

The main loop reads like a story: take the leader lock, write the boot row, migrate,
sweep what an earlier boot left running, start the pool, serve until a signal, stop,
end the boot row. Signal handlers only enqueue; all work happens in the loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import uuid
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from setproctitle import setproctitle

from supervisor import __version__
from supervisor.composition import Hooks, Tree, build
from supervisor.contract import fdlimit, published, titles
from supervisor.contract.background import LoopDied, first_of, spawn
from supervisor.contract.clock import SYSTEM
from supervisor.contract.config import (
    Config,
    ignored_variables,
    mask_url,
    resolve_paths,
    resolved_host_id,
)
from supervisor.contract.limits import DB_THREADS
from supervisor.contract.logs import SUPERVISOR, log
from supervisor.contract.origins import source_name
from supervisor.contract.reaper import become_subreaper
from supervisor.contract.telemetry import Tracing, start_tracing
from supervisor.http.app import Api
from supervisor.notify import Notifier
from supervisor.pool.membership import Membership
from supervisor.pool.pool import Pool
from supervisor.pool.processes import start_resource_tracker
from supervisor.preflight import (
    PluginError,
    StartupError,
    check_plugins,
    take_files,
    volatile_storage,
    wait_for_database,
)
from supervisor.reloading import Reloader
from supervisor.restarts.service import Restarter
from supervisor.runtime.bus import Bus, Stopping
from supervisor.runtime.root import Drains
from supervisor.stopping import READY_TIMEOUT, STOP_REQUEST, StepLog
from supervisor.store import RestartInfo, Store
from supervisor.teardown import FLUSH_CAP, TELEMETRY_FLUSH, teardown_budget

__all__ = ["Daemon", "PluginError", "StartupError"]


class Daemon:
    """One boot of the supervisor."""

    def __init__(self, config: Config, config_path: str | None = None) -> None:
        self.config = config
        self.config_path = config_path  # `--config`: what a reload or a restart reads again
        self.paths = resolve_paths(config)
        self.hostname = socket.gethostname()
        self.host = resolved_host_id(config)
        self.api: Api | None = None
        self.membership: Membership | None = None
        self.notifier = Notifier.from_environ()  # before any child is started
        self.stop_started = SYSTEM.monotonic()
        self.drain_budget = config.shutdown.drain_budget
        self.drain_cut_at: float | None = None
        self.drain_scope: asyncio.Timeout | None = None
        self.step_seconds: dict[str, float] = {}
        self.step_failed: set[str] = set()  # steps of the stop that failed or ran out
        self.steps = StepLog(self.step_seconds, self.step_failed)
        self.tree: Tree | None = None  # the boot's services (`supervisor.composition`)
        self.bus: Bus | None = None
        self.boot_id = ""
        self.watchdog: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._reloads: asyncio.Queue[None] = asyncio.Queue()
        self.failure: str | None = None  # a task of the supervisor that died, and why
        self.outcome = "startup_failed"  # the boot row's, once the stack unwinds
        self._failed = asyncio.Event()
        self.reloader: Reloader | None = None
        self.restart: RestartInfo | None = None  # the request this boot stops for
        self.reexec = False  # `run` replaces the process with a new start once this returns
        self.cancelled: str | None = None  # why the restart of `restart` did not happen
        self.restarter: Restarter | None = None
        self.descriptors: fdlimit.Raised | None = None  # the start's raise of RLIMIT_NOFILE
        self.tracing: Tracing | None = None  # spans to OTLP (`telemetry.otlp_endpoint`)

    async def run(self) -> int:
        """Start, serve until SIGTERM or SIGINT, stop; returns the exit code.

        The services are built by the composition root (`supervisor.composition`) and
        started in dependency order by its `Root`: a start that fails half-way (a port in
        use, say) stops exactly what started, in reverse, and the boot row says
        `startup_failed`; a stop stops them all in reverse, each step capped and timed
        (docs/architecture.md, "The stop"), with the drain before the first service that serves it.
        """
        others = titles.other_supervisors(os.getpid())
        setproctitle(titles.supervisor_title(self.host, self.paths.state_dir, others=bool(others)))
        # Before any child starts: each gets the original soft limit back where it matters.
        self.descriptors = fdlimit.raise_soft_limit()
        loop = asyncio.get_running_loop()
        # Each thread that touches the database keeps a connection: a bounded few.
        loop.set_default_executor(ThreadPoolExecutor(DB_THREADS, "turnkeeper-db"))
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_stop_signal, signum)
        loop.add_signal_handler(signal.SIGHUP, self._reloads.put_nowait, None)
        # The pre-checks first: a configuration they refuse is one line and exit 78.
        check_plugins(self.config)
        become_subreaper()
        start_resource_tracker()  # while this process has one thread: see its docstring
        try:  # after it: the span exporter starts a thread
            self.tracing = start_tracing(self.config, SUPERVISOR)
        except ValueError as exc:  # OTEL_EXPORTER_OTLP_ENDPOINT is no URL
            raise PluginError(str(exc)) from None
        tokens = take_files(self.config, self.paths)
        (self.paths.runtime_dir / STOP_REQUEST).unlink(missing_ok=True)  # an earlier boot's
        self._announce()
        timeout = self.config.store.connect_timeout
        if not await wait_for_database(self.paths.db_url, timeout, self.notifier, self._stop):
            log("shutdown").info("stopped while waiting for the database")
            return 0
        store = await asyncio.to_thread(
            Store,
            self.paths.db_url,
            self.config.store.synchronous,
            max_event_bytes=self.config.store.max_event_bytes,
        )
        self.boot_id = boot_id = uuid.uuid4().hex
        hooks = Hooks(self._end_boot_row, self._restart, self._stop.is_set, self._configured)
        self.tree = tree = build(
            self.config,
            self.config_path,
            store,
            tokens,
            hooks,
            boot_id=boot_id,
            host=self.host,
            runtime_dir=self.paths.runtime_dir,
            state_dir=self.paths.state_dir,
        )
        self.api, self.membership, self.restarter = tree.api, tree.membership, tree.restarter
        self.reloader = tree.reloader
        self.bus = tree.bus
        try:
            await tree.root.start(self.steps)  # HostTaken, SingleHost, a port in use: raised
            self._publish()  # it listens: the command line can find it
            tree.root.run(self._service_ended)
            pool = tree.pool
            ready = await self._until_stop(pool.wait_ready(READY_TIMEOUT))
            if pool.fatal.is_set():
                raise StartupError("no worker could start: every slot is fatal (see above)")
            # From here on a stop is a stop, not a failed start.
            self.outcome = "unclean" if self.failure is not None else "clean"
            if ready:
                await self._serve_ready(pool, store.backend, boot_id)
            elif self.failure is None:
                log("daemon").warning("stopped during start-up")
            if pool.fatal.is_set() or self.failure is not None:
                self.outcome = "unclean"
            if not self.api.restarting:  # a restart's drain takes messages for the next boot
                self.api.stopping = True  # already set by the signal; also for a fatal pool
        finally:
            if self.watchdog is not None:
                self.watchdog.cancel()
                await asyncio.gather(self.watchdog, return_exceptions=True)
            serving = self.outcome != "startup_failed"
            await tree.root.stop(self.steps, self._drain_step if serving else None)
            if (tracing := self.tracing) is not None:
                tree.traces.close_all("daemon_stopped")  # runs in flight: their roots end
                await self.steps.run(TELEMETRY_FLUSH, FLUSH_CAP, lambda: tracing.flush(FLUSH_CAP))
            published.withdraw(self.paths.state_dir, self.paths.runtime_dir, os.getpid())
        failed = self.outcome != "clean"
        log("shutdown").info(
            "stopped {} in {:.2f} s",
            "cleanly"
            if not failed
            else "with every slot fatal"
            if self.failure is None
            else "after a task died",
            SYSTEM.monotonic() - self.stop_started,
        )
        return 1 if failed else 0

    def _announce(self) -> None:
        """The first lines of a start: what runs, from which configuration, on what files."""
        say = log("daemon")
        say.info("turnkeeper {} starting (pid {})", __version__, os.getpid())
        say.info("configuration: {}", source_name(self.config.source))
        say.info(
            "state directory: {}; runtime directory: {}",
            self.paths.state_dir,
            self.paths.runtime_dir,
        )
        if (raised := self.descriptors) is not None:
            say.log("WARNING" if raised.error else "INFO", "{}", raised.describe())
        say.info("database: {}", mask_url(self.paths.db_url))
        say.info("listen: {}", self.config.http.listen)
        say.info("{}", interrupted_turns_line(self.config))
        for problem in volatile_storage(self.paths):  # tmpfs, a PrivateTmp=yes /tmp
            say.warning("{}", problem)
        for warning in ignored_variables():
            say.warning("{}", warning)

    def _publish(self) -> None:
        """Say where this daemon is, in `daemon.json` (`supervisor.contract.published`)."""
        source = self.config.source
        where = published.Published(
            pid=os.getpid(),
            boot_id=self.boot_id,
            version=__version__,
            host_id=self.host,
            listen=self.config.http.listen,
            state_dir=str(self.paths.state_dir),
            runtime_dir=str(self.paths.runtime_dir),
            config=None if source is None else str(source.absolute()),
        )
        try:
            published.publish(where)
        except OSError as exc:  # the API serves all the same; the CLI falls back on the file
            log("daemon").warning("cannot publish where the daemon is: {}", exc)

    async def _serve_ready(self, pool: Pool, backend: str, boot_id: str) -> None:
        """Ready: say so, start the watchdog, serve until a stop."""
        assert self.api is not None
        self.api.ready = True  # from now on a reload is taken (a 503 while it starts)
        self.notifier.ready(self._summary(pool))
        self.watchdog = spawn(self._watchdog(pool), name="watchdog", ended=self._task_ended)
        log("daemon").info(
            "ready: boot {} pid {}, {} workers + {} spare, database {}, listening on {}",
            boot_id,
            os.getpid(),
            self.config.pool.workers,
            self.config.pool.spare,
            backend,
            self.config.http.listen,
        )
        await self._serve(pool)

    async def _serve(self, pool: Pool) -> None:
        """Serve until a stop, a fatal pool or a task's death. A SIGHUP's reload runs in the
        background (it never ends this loop); whatever ends it ends the reload too."""
        assert self.reloader is not None
        try:
            while not self._stop.is_set() and not self._failed.is_set():
                reload = spawn(self._reloads.get())
                stop, fatal = spawn(self._stop.wait()), spawn(pool.fatal.wait())
                failed = spawn(self._failed.wait())
                done = await first_of(reload, stop, fatal, failed)
                if fatal in done:
                    log("pool").critical("every worker slot is fatal: stopping")
                    return
                if failed in done:
                    return  # _task_ended said why
                if reload in done and not self._stop.is_set():
                    self.reloader.begin()  # one at a time: it waits for one under way
        finally:
            await self.reloader.cancel()  # no slot retired or worker replaced during the stop

    async def _until_stop(self, work: Coroutine[Any, Any, object]) -> bool:
        """Run `work` unless a stop signal or a task's death comes first; True if it finished."""
        task = spawn(work, name="until-stop")
        done = await first_of(task, spawn(self._stop.wait()), spawn(self._failed.wait()))
        return task in done and bool(task.result() is not False)

    def _service_ended(self, name: str, task: asyncio.Task[None]) -> None:
        """A service's loops ended by themselves: stop, exit non-zero, be restarted."""
        self._task_ended(task)

    def _task_ended(self, task: asyncio.Task[Any]) -> None:
        # Cancelled means stopped on purpose. Anything else leaves a daemon that looks
        # alive but no longer does its job: better a restart by systemd or supervisord.
        if task.cancelled() or self.failure is not None:
            return
        exc = task.exception()
        if isinstance(exc, LoopDied):  # a service's loop: named, with what it raised
            self.failure, exc = str(exc), exc.cause
        else:
            self.failure = f"task {task.get_name()} " + (f"died: {exc!r}" if exc else "ended")
        log("daemon").opt(exception=exc).critical(
            "{}; stopping, to exit non-zero and be restarted", self.failure
        )
        if self.api is not None:
            self.api.ready = False  # /readyz answers 503 from now on
        self.notifier.stopping(self.failure)
        self._failed.set()

    def _configured(self, config: Config) -> None:
        """A reload accepted `config`: from now on it is the daemon's."""
        self.config = config
        if not self._stop.is_set():
            self.drain_budget = config.shutdown.drain_budget  # also for a stop not by signal

    def _on_stop_signal(self, signum: int) -> None:
        if self._stop.is_set() and self.reexec:
            name = signal.Signals(signum).name
            budget = self._requested_drain()
            log("shutdown").info(
                "received {} during the restart: stopping instead, with a drain of at most "
                "{:g} s from now",
                name,
                budget,
            )
            self._cut_drain(budget)
            self.reexec = False
            self.cancelled = f"the daemon was told to stop ({name}) during it, and stopped"
            self.notifier.stopping(f"stopping on {name}")
            if self.bus is not None:
                self.bus.publish(Stopping(f"stopping on {name}"))  # intake refuses now
            return
        if self._stop.is_set():
            log("shutdown").info("received {} again; already stopping", signal.Signals(signum).name)
            self._requested_drain()  # a second `stop --drain`'s file is not left for later
            return
        self.stop_started = SYSTEM.monotonic()
        log("shutdown").info("received {}", signal.Signals(signum).name)
        self.notifier.stopping(f"stopping on {signal.Signals(signum).name}")
        self.drain_budget = self._requested_drain()
        self._stopping_now(Stopping("stop requested"))

    def _stopping_now(self, stopping: Stopping) -> None:
        # Intake refuses from this moment (a restart's takes messages for the next boot), a
        # reload under way changes the pool no further, another host's sessions are for
        # the others: each service hears it on the bus.
        if self.bus is not None:
            self.bus.publish(stopping)
        self._stop.set()

    # --- the stop -------------------------------------------------------------------

    async def _drain_step(self, drains: Drains) -> None:
        """The optional drain, before the first service that stays up through it stops:
        turns in flight may finish (capped, and cut short at once by `_cut_drain`)."""
        budget = self.drain_budget
        if self.drain_cut_at is not None:  # a SIGTERM came before the drain began
            budget = min(budget, self.drain_cut_at - SYSTEM.monotonic())
        if budget > 0 and self.outcome != "startup_failed":
            self.notifier.extend_timeout(budget + self._stop_bound())  # the rest of the stop too

            async def drained() -> None:
                async with asyncio.timeout(budget) as scope:
                    self.drain_scope = scope
                    try:
                        await drains(SYSTEM.monotonic() + budget)
                    finally:
                        self.drain_scope = None

            await self.steps.run("drain", budget, drained)

    def _cut_drain(self, budget: float) -> None:
        """The stop's own drain `budget`, counted from now, for a drain begun or still to
        begin, if it ends sooner: a SIGTERM during a restart's drain stops on its terms. A
        drain under way is woken at once, even in a sleep or a database read."""
        cut_at = SYSTEM.monotonic() + budget  # the event loop's clock: asyncio.timeout's
        self.drain_cut_at = min(cut_at, self.drain_cut_at or cut_at)
        scope = self.drain_scope
        if scope is not None and (when := scope.when()) is not None and cut_at < when:
            scope.reschedule(cut_at)

    def _end_boot_row(self) -> None:
        """End the boot row with its outcome, and the stop's step durations for the next
        boot's metrics (blocking: the host service's last step)."""
        assert self.tree is not None
        store, boot_id = self.tree.pool.store, self.boot_id
        if self.outcome != "startup_failed":
            stopped: dict[str, object] = {"shutdown_steps": self.step_seconds}
            if self.restart is not None and self.cancelled is None:
                stopped["restart"] = self.restart.id  # this boot's stop was a restart's
            store.boots.set_breaker(boot_id, stopped)
        if self.cancelled is not None and self.restarter is not None:
            self.restarter.cancelled(boot_id, self.cancelled)
        store.boots.end(boot_id, self.outcome)

    async def _watchdog(self, pool: Pool) -> None:
        """WATCHDOG=1 from the event loop itself (a hung loop stops pinging) and STATUS=."""
        interval = self.notifier.watchdog_interval or 10.0
        while True:
            self.notifier.send(WATCHDOG=1, STATUS=self._summary(pool))
            await SYSTEM.sleep(interval)

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
        self.stop_started = SYSTEM.monotonic()
        budget = info.drain if info.drain is not None else self.config.restart.drain_budget
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
        self._stopping_now(Stopping(f"restart {info.id}", restart=True))

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
        return teardown_budget(self.config, drain=0.0).total + 30.0


def interrupted_turns_line(config: Config) -> str:
    """Whether turns a stop or a crash interrupts are continued after the restart: a line
    of the start, so that an operator reads it before the first restart, not after."""
    recovery = config.recovery
    if recovery.auto_continue:
        return (
            "interrupted turns: continued after a restart, when at most "
            f"{recovery.freshness:g} s old (recovery.auto_continue = true)"
        )
    return (
        "interrupted turns: NOT continued after a restart; they wait for their user's next "
        "message (recovery.auto_continue = false)"
    )
