"""`turnkeeper run`: the supervisor process.

The main loop reads like a story: take the leader lock, write the boot row, migrate,
sweep what an earlier boot left running, start the pool, serve until a signal, stop,
end the boot row. Signal handlers only enqueue; all work happens in the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
import uuid
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from setproctitle import setproctitle

from supervisor import __version__
from supervisor.contract.config import (
    Config,
    config_version,
    ignored_variables,
    mask_url,
    parse_listen,
    resolve_paths,
    resolved_host_id,
)
from supervisor.contract.logs import log
from supervisor.contract.origins import source_name
from supervisor.contract.reaper import become_subreaper
from supervisor.http.app import Api
from supervisor.http.attach import Hub
from supervisor.http.auth import Tokens
from supervisor.http.listener import Listener
from supervisor.http.metrics import Metrics
from supervisor.notify import Notifier
from supervisor.pool.membership import Membership
from supervisor.pool.pool import Pool
from supervisor.pool.recoverer import Recoverer
from supervisor.pool.signals import Signals
from supervisor.preflight import PluginError, StartupError, check_plugins, take_files
from supervisor.reloading import Reloader
from supervisor.restarts import service as restarting
from supervisor.stopping import READY_TIMEOUT, REAP_BOUND, STOP_REQUEST, StopSteps
from supervisor.store import RestartInfo, Store

CONTROL_SOCKET = "control.sock"
DB_THREADS = 8  # the supervisor's threads for blocking work, each with a connection

__all__ = ["Daemon", "PluginError", "StartupError"]


class Daemon(StopSteps):
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
        self.stop_started = time.monotonic()
        self.drain_budget = config.shutdown.drain_budget
        self.drain_cut_at: float | None = None
        self.drain_scope: asyncio.Timeout | None = None
        self.step_seconds: dict[str, float] = {}
        self.step_failed: set[str] = set()  # steps of the stop that failed or ran out
        self._stop = asyncio.Event()
        self._reloads: asyncio.Queue[None] = asyncio.Queue()
        self.failure: str | None = None  # a task of the supervisor that died, and why
        self.outcome = "startup_failed"  # the boot row's, once the stack unwinds
        self._failed = asyncio.Event()
        self.reloader: Reloader | None = None
        self.restart: RestartInfo | None = None  # the request this boot stops for
        self.reexec = False  # `run` replaces the process with a new start once this returns
        self.cancelled: str | None = None  # why the restart of `restart` did not happen
        self.restarter: restarting.Restarter | None = None

    async def run(self) -> int:
        """Start, serve until SIGTERM or SIGINT, stop; returns the exit code.

        Start and stop are one `AsyncExitStack`: each step that starts something pushes
        what undoes it, so a start that fails half-way (a port in use, say) undoes exactly
        what it did, in reverse, and the boot row says `startup_failed`; a stop unwinds
        the same stack, each step capped and timed (DESIGN.md section 7).
        """
        setproctitle("turnkeeper: supervisor")
        loop = asyncio.get_running_loop()
        # Each thread that touches the database keeps a connection: a bounded few.
        loop.set_default_executor(ThreadPoolExecutor(DB_THREADS, "turnkeeper-db"))
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_stop_signal, signum)
        loop.add_signal_handler(signal.SIGHUP, self._reloads.put_nowait, None)
        # The pre-checks first: a configuration they refuse is one line and exit 78.
        check_plugins(self.config)
        become_subreaper()
        tokens = take_files(self.config, self.paths)
        (self.paths.runtime_dir / STOP_REQUEST).unlink(missing_ok=True)  # an earlier boot's
        self._announce()
        async with contextlib.AsyncExitStack() as stack:
            store = await asyncio.to_thread(
                Store,
                self.paths.db_url,
                self.config.store.synchronous,
                max_event_bytes=self.config.store.max_event_bytes,
            )
            stack.push_async_callback(self._close_store, store)
            boot_id = uuid.uuid4().hex
            # The host id first: a daemon that may not run writes no boot row of that host.
            self.membership = membership = Membership(self.config, store, boot_id, self.host)
            await asyncio.to_thread(membership.join)  # HostTaken, SingleHost: exit 78
            await asyncio.to_thread(store.boots.begin, self.host, os.getpid(), __version__, boot_id)
            stack.push_async_callback(self._end_boot, store, boot_id)
            # Unwound after the descendants stop: then the others adopt its sessions at once.
            stack.push_async_callback(
                self._step, "peer deregistration", 2.0, lambda: asyncio.to_thread(membership.leave)
            )
            pool = await self._start(stack, store, membership, tokens)
            ready = await self._until_stop(pool.wait_ready(READY_TIMEOUT))
            if pool.fatal.is_set():
                raise StartupError("no worker could start: every slot is fatal (see above)")
            # From here on a stop is a stop, not a failed start.
            self.outcome = "unclean" if self.failure is not None else "clean"
            if ready:
                await self._serve_ready(stack, pool, store.backend, boot_id)
            elif self.failure is None:
                log("daemon").warning("stopped during start-up")
            if pool.fatal.is_set() or self.failure is not None:
                self.outcome = "unclean"
            assert self.api is not None
            self.api.stopping = True  # already set by the signal; also for a fatal pool
        failed = self.outcome != "clean"
        log("shutdown").info(
            "stopped {} in {:.2f} s",
            "cleanly"
            if not failed
            else "with every slot fatal"
            if self.failure is None
            else "after a task died",
            time.monotonic() - self.stop_started,
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
        say.info("database: {}", mask_url(self.paths.db_url))
        say.info("listen: {}", self.config.http.listen)
        for warning in ignored_variables():
            say.warning("{}", warning)

    async def _start(
        self, stack: contextlib.AsyncExitStack, store: Store, membership: Membership, tokens: Tokens
    ) -> Pool:
        """Everything between the boot row and readiness; each step pushes its undoing."""
        metrics, boot_id = Metrics(), membership.boot_id
        recovery = Recoverer(self.config, store, boot_id, self.host, metrics)
        await asyncio.to_thread(self._previous_stop, store, boot_id, metrics)
        await asyncio.to_thread(recovery.evaluate_breaker)
        version = config_version(self.config)
        await asyncio.to_thread(restarting.settle_earlier, store, self.host, boot_id, version)
        await asyncio.to_thread(recovery.prune)
        await asyncio.to_thread(membership.sweep)
        socket_path = self.paths.runtime_dir / CONTROL_SOCKET
        socket_path.unlink(missing_ok=True)  # stale; we hold its lock
        address, state = f"ipc://{socket_path}", self.paths.state_dir
        pool = Pool(self.config, store, boot_id, address, recovery, metrics, state_dir=state)
        metrics.state.pool = pool.status
        metrics.state.mcp = pool.mcp_states
        metrics.state.sessions = store.sessions.counts
        metrics.state.subagents = store.subagents.counts
        metrics.state.tasks = store.tasks.counts
        metrics.state.restarts = store.restarts.counts
        self.api = Api(
            self.config,
            store,
            Hub(),
            tokens,
            metrics,
            boot_id=boot_id,
            pool=pool,
            host_id=self.host,
        )
        pool.on_event.append(self.api.publish)
        self.reloader = reloader = Reloader(
            self.config, self.config_path, pool=pool, api=self.api, on_config=self._configured
        )
        self.restarter = restarter = restarting.Restarter(
            store,
            host=self.host,
            boot_id=boot_id,
            config=lambda: self.config,
            load=reloader.load,
            version=lambda: reloader.version,
            begin=self._restart,
            committed=pool.committed,
            stopping=lambda: self._stop.is_set(),
            hold=pool.orphans_held,
        )
        self.api.restarts = restarter
        pool.on_event.append(restarter.heard)
        # Workers start first, so that the stop, in reverse, closes the listener first.
        await pool.start()
        grace = self.config.shutdown.kill_grace
        stack.push_async_callback(
            self._step, "descendants", grace + REAP_BOUND, lambda: pool.stop(grace)
        )
        for task in pool.tasks:
            self._watch(task)
        waiting = asyncio.create_task(restarter.run(), name="restarts")
        self._watch(waiting)
        stack.push_async_callback(_cancel_and_wait, waiting)
        # The host row kept, the other daemons' wakes heard.
        signals = Signals(store, pool.ownership.woken_elsewhere)
        hosts = membership.serve(pool.ownership, signals)
        self._watch(hosts)
        stack.push_async_callback(_cancel_and_wait, hosts)
        stack.push_async_callback(asyncio.to_thread, signals.stop)
        stack.push_async_callback(self._subagent_drain_step, pool)  # after the listener's
        http = await self._listen(self.api)
        stack.push_async_callback(
            self._step, "http listener", self.config.attach.shutdown_timeout + 1.0, http.cleanup
        )
        stack.push_async_callback(self._drain_step, pool)
        # The boot scan runs now that the listener is up: an interrupted turn goes on as soon
        # as one worker is ready (the pool assigns only to ready ones), not once all are.
        for task in pool.recovery.start():  # its breaker loop and retry timer
            self._watch(task)
        stack.push_async_callback(pool.recovery.stop)
        return pool

    async def _serve_ready(
        self, stack: contextlib.AsyncExitStack, pool: Pool, backend: str, boot_id: str
    ) -> None:
        """Ready: say so, start recovery's passes and the watchdog, serve until a stop."""
        assert self.api is not None
        self.api.ready = True
        self.api.reloader = self.reloader  # from now on: a reload while it starts is a 503
        self.notifier.ready(self._summary(pool))
        watchdog = asyncio.create_task(self._watchdog(pool), name="watchdog")
        self._watch(watchdog)
        stack.push_async_callback(_cancel_and_wait, watchdog)
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

    async def _listen(self, api: Api) -> Listener:
        listener = Listener(
            api.app(),
            self.config.http,
            self.config.attach.shutdown_timeout,
            api.metrics.connections_evicted.inc,
        )
        try:
            await listener.start(parse_listen(self.config.http.listen))
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise StartupError(f"http.listen {self.config.http.listen}: {reason}") from exc
        return listener

    async def _serve(self, pool: Pool) -> None:
        """Serve until a stop, a fatal pool or a task's death. A SIGHUP's reload runs in the
        background (it never ends this loop); whatever ends it ends the reload too."""
        assert self.reloader is not None
        try:
            while not self._stop.is_set() and not self._failed.is_set():
                reload = asyncio.ensure_future(self._reloads.get())
                stop = asyncio.ensure_future(self._stop.wait())
                fatal = asyncio.ensure_future(pool.fatal.wait())
                failed = asyncio.ensure_future(self._failed.wait())
                done, pending = await asyncio.wait(
                    {reload, stop, fatal, failed}, return_when=asyncio.FIRST_COMPLETED
                )
                for task in pending:
                    task.cancel()
                if fatal in done:
                    log("pool").critical("every worker slot is fatal: stopping")
                    return
                if failed in done:
                    return  # _task_ended said why
                if reload in done and not self._stop.is_set():
                    self.reloader.begin()  # one at a time: it waits for one under way
        finally:
            await self.reloader.cancel()  # no slot retired or worker replaced during the stop

    async def _until_stop(self, work: Awaitable[object]) -> bool:
        """Run `work` unless a stop signal or a task's death comes first; True if it finished."""
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self._stop.wait())
        failed = asyncio.ensure_future(self._failed.wait())
        done, _ = await asyncio.wait({task, stop, failed}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        failed.cancel()
        if task in done:
            return bool(task.result() is not False)
        task.cancel()
        return False

    def _watch(self, task: asyncio.Task[Any]) -> None:
        """If `task` ever ends by itself, stop, and exit non-zero to be restarted."""
        task.add_done_callback(self._task_ended)

    def _task_ended(self, task: asyncio.Task[Any]) -> None:
        # Cancelled means stopped on purpose. Anything else leaves a daemon that looks
        # alive but no longer does its job: better a restart by systemd or supervisord.
        if task.cancelled() or self.failure is not None:
            return
        exc = task.exception()
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
            return
        if self._stop.is_set():
            log("shutdown").info("received {} again; already stopping", signal.Signals(signum).name)
            self._requested_drain()  # a second `stop --drain`'s file is not left for later
            return
        self.stop_started = time.monotonic()
        log("shutdown").info("received {}", signal.Signals(signum).name)
        self.notifier.stopping(f"stopping on {signal.Signals(signum).name}")
        self.drain_budget = self._requested_drain()
        self._stopping_now()

    def _stopping_now(self) -> None:
        if self.api is not None:
            self.api.stopping = True  # intake refuses from this moment
        if self.reloader is not None:
            self.reloader.cancel()  # a reload under way changes the pool no further
        if self.membership is not None:
            self.membership.adopting = False  # another host's sessions are for the others
        self._stop.set()


async def _cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel a task this daemon owns and wait until it has ended."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
